// Data parallelism and ZeRO, run under mpiexec (2 and 4 ranks): every layout
// trains the same model as one process with the same global batch; memory
// per rank and bytes on the wire match the formulas; reductions are posted
// while the backward still runs.
//
// Each rank computes the one-process reference itself, on a communicator of
// its own (TrainerOptions::ranks), so reference and layout run in one job.
// Two engines sharing one model (each owning some groups, over its own
// communicator: mixture of experts' dense and expert engines) train it as
// one engine does.
//
// Tolerances (equivalence.h): losses relative 1e-5 after 10 steps,
// parameters absolute 1e-4. The model and recipe are those of the PyTorch
// parity fixture (tests/model/fixtures/expected.json: L=2, H=4, C=32, V=101,
// T=16, AdamW lr 1e-2 with warm-up and cosine, clipping at 1), whose
// fp32-vs-fp64 study justifies the parameter tolerance.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "lattice/comm/mpi_communicator.h"
#include "lattice/comm/process_mesh.h"
#include "lattice/comm/runtime.h"
#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/core/rng.h"
#include "lattice/core/threads.h"
#include "lattice/data/shard.h"
#include "lattice/io/config.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/parallel/data/data_parallel.h"
#include "lattice/parallel/data/group_hooks_router.h"
#include "lattice/train/trainer.h"
#include "equivalence.h"
#include "mpi_ranks.h"

using namespace lattice;
namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 10;
constexpr int kGlobalBatch = 16;  // sequences per step, every layout

using mpitest::self;
using mpitest::world;

fs::path shared_dir(const std::string& name) { return mpitest::shared_dir("lattice_dp_test", name); }

// Rank 0 writes a shard of `n` random tokens below the vocabulary (101); every
// rank returns once it is there.
void write_shard(const fs::path& path, int n, uint64_t seed) {
  if (world().rank() == 0) {
    std::vector<uint16_t> tokens(static_cast<size_t>(n));
    Rng rng(seed);
    for (auto& t : tokens) t = static_cast<uint16_t>(rng.next_below(101));
    data::write_shard(path.string(), tokens);
  }
  world().barrier();
}

io::RunConfig base_config() {
  io::RunConfig c = mpitest::parity_recipe();
  c.train.global_batch_size = kGlobalBatch;
  return c;
}

// A layout: dp ranks, ZeRO stage, micro-batches per step, offload.
io::RunConfig layout(int dp, int stage, int micro, bool offload, const std::string& offload_dir = "") {
  io::RunConfig c = base_config();
  c.parallel.dp = dp;
  c.parallel.zero_stage = stage;
  c.train.micro_batch_size = kGlobalBatch / (dp * micro);
  // Small buckets: several per block group (3 at dp=4), as a large model has.
  // (Not much smaller: a group is padded to whole buckets of 16-float slices,
  // and for this tiny model finer buckets would pad it by several percent.)
  c.parallel.bucket_mb = 0.02;
  if (offload) {
    c.zero.offload = "disk";
    c.zero.offload_dir = offload_dir;
    c.zero.offload_window_mb = 0.05;  // a few windows: streaming really happens
  }
  return c;
}

std::string describe(const io::RunConfig& c) {
  return "dp=" + std::to_string(c.parallel.dp) + " zero=" + std::to_string(c.parallel.zero_stage) +
         " micro-batches=" + std::to_string(io::micro_batches_per_step(c)) +
         (c.zero.offload == "disk" ? " offload" : "") + (c.data.train.empty() ? "" : " shards");
}

using mpitest::expect_same_run;
using mpitest::RunResult;
using mpitest::same_params;

RunResult train(const io::RunConfig& cfg, comm::Communicator& ranks, int steps = kSteps) {
  return mpitest::train_run(cfg, ranks, steps);
}

// Trains `cfg` on every rank for 5 steps and saves a checkpoint
// (checkpoint.dir/step_000005), there for every rank on return.
void save_after_five_steps(const io::RunConfig& cfg) {
  {
    train::TrainerOptions o;
    o.print = false;
    o.ranks = &world();
    train::Trainer t(cfg, o);
    for (int s = 0; s < 5; s++) t.train_step();
    t.save_checkpoint();
  }
  world().barrier();  // rank 0 has written it
}

const RunResult& reference() {
  static const RunResult r = train(layout(1, 0, 1, false), self());
  return r;
}

TEST(DataParallel, EveryLayoutTrainsTheOneProcessModel) {
  const int n = world().size();
  const fs::path off = shared_dir("offload");
  for (int stage = 0; stage <= 3; stage++)
    for (int micro : {1, 4})
      for (bool offload : {false, true}) {
        // The layout over every rank, and the same stage on one rank (dp=1).
        const io::RunConfig on_all = layout(n, stage, micro, offload, off.string());
        expect_same_run(train(on_all, world()), reference(), describe(on_all));
        const io::RunConfig alone = layout(1, stage, micro, offload, off.string() + "/self" +
                                                                          std::to_string(world().rank()));
        if (offload) fs::create_directories(alone.zero.offload_dir);
        expect_same_run(train(alone, self()), reference(), describe(alone) + " (one rank)");
      }
}

// Offload changes where the optimizer state lives, not the arithmetic: the
// run is bit-identical to the same layout in memory (stages 0, 1 and 3 on
// every rank, stage 2 on one).
TEST(DataParallel, OffloadIsBitIdenticalToMemory) {
  const fs::path off = shared_dir("offload_bits");
  for (int stage : {0, 1, 3}) {
    const RunResult mem = train(layout(world().size(), stage, 2, false), world());
    const RunResult disk = train(layout(world().size(), stage, 2, true, off.string()), world());
    EXPECT_EQ(disk.losses, mem.losses) << "stage " << stage;
    EXPECT_EQ(disk.norms, mem.norms) << "stage " << stage;
    EXPECT_TRUE(same_params(disk, mem)) << "stage " << stage;
  }
  const fs::path mine = off / ("self" + std::to_string(world().rank()));
  fs::create_directories(mine);
  const RunResult mem = train(layout(1, 2, 2, false), self());
  const RunResult disk = train(layout(1, 2, 2, true, mine.string()), self());
  EXPECT_EQ(disk.losses, mem.losses);
  EXPECT_TRUE(same_params(disk, mem));
}

// The same on token shards small enough that 10 steps cross several epochs.
TEST(DataParallel, EpochBoundariesAreLayoutIndependent) {
  const fs::path dir = shared_dir("shards");
  // 40 sequences of T+1 = 17 tokens: 2 steps of 16 per epoch, 8 skipped.
  write_shard(dir / "train_000.bin", 40 * 16 + 1, 7);
  auto with_shards = [&](io::RunConfig c) {
    c.data.train = (dir / "train_*.bin").string();
    return c;
  };
  const RunResult want = train(with_shards(layout(1, 0, 1, false)), self());
  for (int stage = 0; stage <= 3; stage++)
    for (int micro : {1, 2}) {
      const io::RunConfig c = with_shards(layout(world().size(), stage, micro, false));
      expect_same_run(train(c, world()), want, describe(c));
    }
  const io::RunConfig c = with_shards(layout(world().size(), 1, 2, true, dir.string()));
  expect_same_run(train(c, world()), want, describe(c));
}

// Evaluation is a layout-independent mean too: the val loss of every rank's
// share of the val batches, reduced, equals the one-process evaluation
// (before training and after steps 5 and 10, 3 val batches each; ZeRO-3
// gathers the parameters for the forward passes only).
TEST(DataParallel, EvaluationIsLayoutIndependent) {
  const fs::path dir = shared_dir("eval");
  write_shard(dir / "val_000.bin", 100 * 16 + 1, 11);
  // Shards for training too: without data.train both are synthetic tokens and
  // data.val does not apply (it is refused).
  write_shard(dir / "train_000.bin", 40 * 16 + 1, 7);
  auto evaluate = [&](io::RunConfig c, comm::Communicator& ranks) {
    c.data.train = (dir / "train_*.bin").string();
    c.data.val = (dir / "val_*.bin").string();
    c.train.eval_steps = 3;
    train::TrainerOptions o;
    o.print = false;
    o.ranks = &ranks;
    train::Trainer t(c, o);
    std::vector<double> val = {t.evaluate()};  // before training, and after steps 5 and 10
    while (t.step() < kSteps) {
      t.train_step();
      if (t.step() % 5 == 0) val.push_back(t.evaluate());
    }
    return val;
  };
  const std::vector<double> want = evaluate(layout(1, 0, 1, false), self());
  ASSERT_EQ(want.size(), 3u);
  for (int stage : {0, 3})
    for (int micro : {1, 2}) {
      const io::RunConfig c = layout(world().size(), stage, micro, false);
      const std::vector<double> got = evaluate(c, world());
      ASSERT_EQ(got.size(), want.size()) << describe(c);
      for (size_t i = 0; i < want.size(); i++)
        EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << describe(c) << ", evaluation " << i + 1;
    }
}

// A checkpoint is the full model and optimizer whatever wrote it: one saved
// at each stage (and with offload) resumes at every other stage on the same
// trajectory as the uninterrupted one-process run.
TEST(DataParallel, CheckpointsMoveBetweenStages) {
  const fs::path dir = shared_dir("stages");
  const int n = world().size();
  struct Layout {
    int stage;
    bool offload;
    std::string name() const { return "zero=" + std::to_string(stage) + (offload ? " offload" : ""); }
  };
  const std::vector<Layout> layouts = {{0, false}, {1, false}, {2, false}, {3, false}, {3, true}};
  auto config = [&](const Layout& l) { return layout(n, l.stage, 2, l.offload, dir.string()); };
  for (size_t a = 0; a < layouts.size(); a++) {
    io::RunConfig first = config(layouts[a]);
    first.checkpoint.dir = (dir / ("from" + std::to_string(a))).string();
    save_after_five_steps(first);
    for (size_t b = 0; b < layouts.size(); b++) {
      if (b == a) continue;
      io::RunConfig c = config(layouts[b]);
      c.checkpoint.resume = first.checkpoint.dir + "/step_000005";
      train::TrainerOptions o;
      o.print = false;
      o.ranks = &world();
      train::Trainer t(c, o);
      RunResult got;
      got.losses.assign(reference().losses.begin(), reference().losses.begin() + 5);
      got.norms.assign(reference().norms.begin(), reference().norms.begin() + 5);
      while (t.step() < kSteps) {
        const train::StepStats st = t.train_step();
        got.losses.push_back(st.loss);
        got.norms.push_back(st.grad_norm);
      }
      got.params = t.full_tensors();
      expect_same_run(got, reference(), "saved at " + layouts[a].name() + ", resumed at " + layouts[b].name());
    }
  }
}

// A run checkpointed at dp=n continues at dp=2 and at dp=1 on the same data
// stream and model: the same losses as the uninterrupted run.
TEST(DataParallel, CheckpointResumesAtAnotherDataParallelSize) {
  const fs::path dir = shared_dir("resume");
  io::RunConfig first = layout(world().size(), 3, 1, false);
  first.checkpoint.dir = (dir / "run").string();
  save_after_five_steps(first);
  const std::string step_dir = (dir / "run" / "step_000005").string();
  auto resume_on = [&](int dp, int stage, comm::Communicator& ranks) {
    io::RunConfig c = layout(dp, stage, 2, false);
    c.checkpoint.resume = step_dir;
    train::TrainerOptions o;
    o.print = false;
    o.ranks = &ranks;
    train::Trainer t(c, o);
    std::vector<double> losses;
    while (t.step() < kSteps) losses.push_back(t.train_step().loss);
    return losses;
  };
  const std::vector<double> want(reference().losses.begin() + 5, reference().losses.end());
  std::vector<std::pair<std::string, std::vector<double>>> resumed;
  resumed.push_back({"dp=1 zero=0", resume_on(1, 0, self())});
  if (world().size() >= 2) {
    // Pairs of ranks run a dp=2 job each.
    std::unique_ptr<comm::Communicator> pair = world().split(world().rank() / 2, world().rank(), "pair");
    if (pair->size() == 2) resumed.push_back({"dp=2 zero=1", resume_on(2, 1, *pair)});
  }
  for (const auto& [what, losses] : resumed) {
    ASSERT_EQ(losses.size(), want.size()) << what;
    for (size_t i = 0; i < want.size(); i++)
      EXPECT_NEAR(losses[i], want[i], 1e-5 * want[i]) << "resumed at " << what << ", step " << i + 6;
  }
}

// Per-rank memory by category against the ZeRO paper's formulas, with this
// implementation's stated buffers (data_parallel.h). Ψ = Σ of the groups'
// capacities (their padded flat buffers).
// Checked over every rank and over one (dp=1: the stages run their machinery
// over one shard, which is the whole).
TEST(DataParallel, MemoryPerRankMatchesTheFormulas) {
  for (comm::Communicator* ranks : {&world(), &self()}) {
    for (int stage = 0; stage <= 3; stage++) {
      const int n = ranks->size();
      train::TrainerOptions o;
      o.print = false;
      o.ranks = ranks;
      io::RunConfig c = layout(n, stage, 1, false);
      train::Trainer t(c, o);
      const parallel::ShardLayout& shard = t.data_parallel().layout();
      double psi = 0, shard_psi = 0, largest_block = 0, emb = 0, fin = 0;
      const auto& groups = t.model().groups();
      for (size_t g = 0; g < groups.size(); g++) {
        psi += static_cast<double>(groups[g].capacity());
        shard_psi += static_cast<double>(shard.group(g).shard_numel());
      }
      // Borrowed buffers of stages 2-3: two chunks of the embedding (it is never
      // whole: sharded_embedding.h; one when it is a single chunk), one ln_f,
      // and two blocks of parameters (one in use, one prefetched) or one of
      // gradients.
      emb = static_cast<double>(std::min<int64_t>(shard.group(0).chunks, 2) * shard.group(0).chunk_numel());
      fin = static_cast<double>(groups.back().capacity());
      largest_block = static_cast<double>(groups[1].capacity());
      const double borrowed_params = emb + 2 * largest_block + fin, borrowed_grads = emb + largest_block + fin;
      // The model's construction (initialisation on every rank) is not
      // training memory: peaks count from here.
      MemoryTracker::instance().reset_peaks();
      for (int s = 0; s < 2; s++) t.train_step();
      const MemoryTracker& m = MemoryTracker::instance();
      const double params = static_cast<double>(m.peak(MemCategory::Params)) / 4;
      const double grads = static_cast<double>(m.peak(MemCategory::Grads)) / 4;
      const double optim = static_cast<double>(m.peak(MemCategory::Optimizer)) / 4;
      double want_params = psi, want_grads = psi, want_optim = 2 * psi;  // stage 0: 16Ψ bytes
      if (stage >= 1) want_optim = 2 * shard_psi;                        // 8Ψ + 8Ψ/n
      if (stage >= 2) want_grads = shard_psi + borrowed_grads;           // 4Ψ + 12Ψ/n
      if (stage >= 3) want_params = shard_psi + borrowed_params;         // 16Ψ/n
      const double textbook[4] = {16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n};
      if (world().rank() == 0)
        std::printf("[ memory ] dp=%d stage %d: params %.0f grads %.0f optimizer %.0f floats; expected %.0f %.0f %.0f "
                    "(ZeRO formula %.0f bytes of model state, measured %.0f)\n",
                    n, stage, params, grads, optim, want_params, want_grads, want_optim, textbook[stage],
                    4 * (params + grads + optim));
      EXPECT_NEAR(params, want_params, 0.1 * want_params) << "stage " << stage;
      EXPECT_NEAR(grads, want_grads, 0.1 * want_grads) << "stage " << stage;
      EXPECT_NEAR(optim, want_optim, 0.1 * want_optim) << "stage " << stage;
    }
  }
}

// Bytes each rank sends per step, against 2Ψ(n-1)/n (stages 0-2; stage 2
// reduces each micro-batch: (m+1)Ψ(n-1)/n) and 3Ψ(n-1)/n per micro-batch at
// stage 3, Ψ the parameters the flat buffers hold (with the vocabulary
// padding), in f32. Plus the sparse exchanges of the embedding
// (sharded_embedding.h): the lookup's gradient rows and tokens,
// (n-1)·B·T·(C+1) floats, once per step at stages 0-1 (its last
// micro-batch), every micro-batch at stages 2-3, and at stage 3 the lookup's
// rows and tokens again. (For GPT-2 124M at B=4, T=256 that is 1% of Ψ; for
// this tiny model, 10%.)
TEST(DataParallel, BytesOnTheWireMatchTheFormulas) {
  const int n = world().size();
  for (int stage = 0; stage <= 3; stage++)
    for (int micro : {1, 4}) {
      train::TrainerOptions o;
      o.print = false;
      o.ranks = &world();
      train::Trainer t(layout(n, stage, micro, false), o);
      double psi = 0;
      for (const auto& g : t.model().groups()) psi += static_cast<double>(g.numel());
      t.train_step();
      const double got = static_cast<double>(t.train_step().comm_bytes);
      const double per = 4 * psi * (n - 1) / n;  // one reduce-scatter or all-gather of every parameter
      const io::RunConfig& c = t.config();
      const double exchange = 4.0 * (n - 1) * c.train.micro_batch_size * c.model.seq_len * (c.model.n_embd + 1);
      double want = stage <= 1 ? 2 * per : stage == 2 ? (micro + 1) * per : 3 * micro * per;
      want += stage <= 1 ? exchange : micro * exchange * (stage == 3 ? 2 : 1);
      if (world().rank() == 0)
        std::printf("[ bytes  ] dp=%d stage %d, %d micro-batches: %.0f bytes sent per rank per step, formula %.0f\n",
                    n, stage, micro, got, want);
      EXPECT_NEAR(got, want, 0.05 * want) << "stage " << stage << ", " << micro << " micro-batches";
    }
}

// Overlap, shown by the order of events instead of timings: the reduction of
// the last block's gradients is posted before the backward of the block
// below it starts, and every block's before the embedding's backward ends.
TEST(DataParallel, ReductionsArePostedDuringTheBackward) {
  const int n = world().size();
  for (int stage = 0; stage <= 2; stage++) {
    train::TrainerOptions o;
    o.print = false;
    o.ranks = &world();
    train::Trainer t(layout(n, stage, 1, false), o);
    comm::CommStream& stream = t.data_parallel().stream();
    stream.record_events(true);
    t.train_step();
    const std::vector<std::string> events = stream.take_events();
    auto index_of = [&](const std::string& prefix) {
      for (size_t i = 0; i < events.size(); i++)
        if (events[i].rfind(prefix, 0) == 0) return static_cast<long>(i);
      return -1L;
    };
    const long grad_h1 = index_of("post grad h.1 "), backward_h0 = index_of("backward h.0");
    const long backward_h1 = index_of("backward h.1"), grad_emb = index_of("post grad embedding ");
    ASSERT_GE(grad_h1, 0) << "stage " << stage;
    ASSERT_GE(backward_h0, 0) << "stage " << stage;
    ASSERT_GE(grad_emb, 0) << "stage " << stage;
    EXPECT_LT(grad_h1, backward_h0) << "stage " << stage << ": h.1's reduction must start before h.0's backward";
    // The embedding's gradient, though final only at the very end (the
    // lookup's share), is reduced as soon as the head's share is in, before
    // the blocks' backward; the lookup's share follows as a sparse exchange.
    EXPECT_LT(grad_emb, backward_h1) << "stage " << stage;
  }
}

// ---------------------------------------------------------------- several engines over one model

// Mixture of experts reduces the dense groups and the experts' over different
// communicators: two engines serve one model, each owning some groups, their
// hooks composed by a GroupHooksRouter. Here, on a dense model: engine A owns
// the embedding and the final group over `ranks`, engine B the blocks over
// another communicator of the same ranks. The step is every call on both
// engines, the norm sqrt(A's Σg² + B's Σg²), and both update with the same
// grad_scale: the run must be the one engine's that owns every group.
// Driven by hand (the trainer builds one engine): the parity model, 2
// micro-batches of 2 sequences a rank, kEngineSteps steps of the recipe.
constexpr int kEngineSteps = 4, kEngineMicro = 2, kEngineB = 2, kEngineT = 16;

model::ModelConfig engine_model() {
  model::ModelConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 32;
  c.vocab_size = 101;
  c.seq_len = kEngineT;
  return c;
}

std::vector<int32_t> engine_tokens(int step, int micro, int rank, int salt) {
  std::vector<int32_t> v(kEngineB * kEngineT);
  for (size_t i = 0; i < v.size(); i++)
    v[i] = static_cast<int32_t>((static_cast<int>(i) * 31 + step * 17 + micro * 7 + rank * 13 + salt) % 101);
  return v;
}

// The whole dense model's pass order (embedding, blocks, final; backward the
// tied head's embedding, final, blocks from the last), given to both engines
// as DataParallelOptions::order: each must keep only its own groups.
std::vector<size_t> dense_order(const model::GPT& m, model::GroupHooks::Pass pass) {
  const size_t b0 = m.block_index(0), b1 = b0 + static_cast<size_t>(m.config().n_layer);
  std::vector<size_t> order;
  if (pass == model::GroupHooks::Pass::Forward) {
    order.push_back(m.embedding_index());
    for (size_t b = b0; b < b1; b++) order.push_back(b);
    order.push_back(m.final_index());
  } else {
    order = {m.embedding_index(), m.final_index()};
    for (size_t b = b1; b > b0; b--) order.push_back(b - 1);
  }
  return order;
}

bool embedding_or_final(const model::GPT& m, size_t g) { return g == m.embedding_index() || g == m.final_index(); }

struct EngineRun {
  std::vector<double> losses, norms;
  std::vector<std::vector<float>> params, adam_m;  // every group, whole (numel floats)
};

// The engines of one run over one model: `blocks_on` null, one engine owning
// every group over `ranks` (its hooks installed); else A (embedding, final)
// over `ranks` and B (blocks) over `*blocks_on` (the same ranks), routed.
struct Engines {
  model::GPT model;
  std::unique_ptr<parallel::DataParallel> a, b;
  std::unique_ptr<parallel::GroupHooksRouter> router;

  Engines(int stage, comm::Communicator& ranks, comm::Communicator* blocks_on)
      : model(engine_model(), model::GPT::Unallocated{}) {
    parallel::DataParallelOptions o;
    o.zero_stage = stage;
    o.bucket_bytes = 0.02 * (1 << 20);  // several buckets a block, as in layout()
    o.progress = comm::progress_from_env();
    if (!blocks_on) {
      a = std::make_unique<parallel::DataParallel>(std::vector<model::GPT*>{&model}, ranks, o);
      return;
    }
    o.install_hooks = false;
    o.order = dense_order;
    parallel::DataParallelOptions oa = o, ob = o;
    oa.name = "dense";
    oa.owns = embedding_or_final;
    ob.name = "blocks";
    ob.owns = [](const model::GPT& m, size_t g) { return !embedding_or_final(m, g); };
    a = std::make_unique<parallel::DataParallel>(std::vector<model::GPT*>{&model}, ranks, oa);
    b = std::make_unique<parallel::DataParallel>(std::vector<model::GPT*>{&model}, *blocks_on, ob);
    EXPECT_EQ(model.hooks(), nullptr) << "install_hooks = false installs nothing";
    router = std::make_unique<parallel::GroupHooksRouter>(std::vector<parallel::DataParallel*>{a.get(), b.get()}, 0);
    model.set_hooks(router.get());
  }
  ~Engines() {
    if (router) model.set_hooks(nullptr);
  }
  std::vector<parallel::DataParallel*> all() {
    std::vector<parallel::DataParallel*> v = {a.get()};
    if (b) v.push_back(b.get());
    return v;
  }
  parallel::DataParallel& owner(size_t g) { return a->owns(0, g) ? *a : *b; }
};

EngineRun train_engines(int stage, comm::Communicator& ranks, comm::Communicator* blocks_on) {
  set_num_threads(1);
  Engines e(stage, ranks, blocks_on);
  model::GPT& m = e.model;
  for (parallel::DataParallel* d : e.all()) d->initialize(5);
  const int n = ranks.size();
  EngineRun r;
  for (int step = 0; step < kEngineSteps; step++) {
    for (parallel::DataParallel* d : e.all()) d->begin_step(step);
    double loss = 0;
    for (int k = 0; k < kEngineMicro; k++) {
      const std::vector<int32_t> in = engine_tokens(step, k, ranks.rank(), 0);
      const std::vector<int32_t> tg = engine_tokens(step, k, ranks.rank(), 3);
      loss += m.forward(0, in.data(), tg.data(), kEngineB, kEngineT, 1.0f / kEngineMicro);
      for (parallel::DataParallel* d : e.all()) d->before_backward(0, k == kEngineMicro - 1);
      m.backward(0);
    }
    for (parallel::DataParallel* d : e.all()) d->part_done(0);
    for (parallel::DataParallel* d : e.all()) d->finish_gradients();
    loss = e.a->sum_over_ranks(loss) / (n * kEngineMicro);
    double sum_squares = 0;
    for (parallel::DataParallel* d : e.all()) sum_squares += d->grad_sum_squares();
    const double norm = std::sqrt(sum_squares) / n;
    const float lr = optim::lr_at(step, kEngineSteps, 3, 1e-2f, 1e-3f);
    for (parallel::DataParallel* d : e.all())
      d->optimizer_step(lr, static_cast<float>(optim::clip_scale(norm, 1.0f) / n));
    r.losses.push_back(loss);
    r.norms.push_back(norm);
  }
  // Every group from the engine that owns it, in the model's order (each
  // engine's gathers are collective over its own ranks).
  for (size_t g = 0; g < m.groups().size(); g++) {
    const int64_t numel = m.groups()[g].numel(), capacity = e.owner(g).layout().group(g).capacity();
    std::vector<float> p(static_cast<size_t>(std::max(capacity, m.groups()[g].capacity()))), v(p.size());
    e.owner(g).gather_full(0, g, parallel::DataParallel::State::Params, p.data());
    e.owner(g).gather_full(0, g, parallel::DataParallel::State::AdamM, v.data());
    r.params.emplace_back(p.begin(), p.begin() + numel);
    r.adam_m.emplace_back(v.begin(), v.begin() + numel);
  }
  return r;
}

// The largest absolute difference between two runs' parameter (or moment) lists.
double largest_difference(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double worst = 0;
  for (size_t g = 0; g < a.size() && g < b.size(); g++)
    for (size_t i = 0; i < a[g].size() && i < b[g].size(); i++)
      worst = std::max(worst, std::fabs(static_cast<double>(a[g][i]) - b[g][i]));
  return worst;
}

TEST(DataParallel, TwoEnginesOverOneModelEqualOneEngine) {
  for (int dp : {2, 4}) {
    if (dp > world().size()) continue;
    comm::Communicator& ranks = mpitest::groups_of(dp);
    // The same ranks, another communicator (as the expert replicas are).
    const std::unique_ptr<comm::Communicator> copy = ranks.split(0, ranks.rank(), "blocks");
    for (int stage = 0; stage <= 3; stage++) {
      const std::string what = "dp=" + std::to_string(dp) + " zero=" + std::to_string(stage);
      const EngineRun one = train_engines(stage, ranks, nullptr);
      const EngineRun two = train_engines(stage, ranks, copy.get());
      ASSERT_EQ(two.losses.size(), one.losses.size()) << what;
      for (size_t s = 0; s < one.losses.size(); s++) {
        EXPECT_NEAR(two.losses[s], one.losses[s], 1e-6 * one.losses[s]) << what << " step " << s + 1;
        // sqrt(Σ_A + Σ_B): the same squares, summed in another order.
        EXPECT_NEAR(two.norms[s], one.norms[s], 1e-6 * one.norms[s]) << what << " norm, step " << s + 1;
      }
      ASSERT_EQ(two.params.size(), one.params.size()) << what;
      const double dparams = largest_difference(two.params, one.params);
      const double dm = largest_difference(two.adam_m, one.adam_m);
      if (world().rank() == 0)
        std::printf("[ engines ] %s: two engines against one: losses %s, parameters within %.1e, Adam m within %.1e\n",
                    what.c_str(), two.losses == one.losses ? "bit-identical" : "close", dparams, dm);
      EXPECT_LE(dparams, 1e-6) << what;
      EXPECT_LE(dm, 1e-6) << what;
    }
  }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// An engine refuses the groups it does not own: a checkpoint gather, a load,
// a hook call; and a router needs exactly one engine per group.
TEST(DataParallel, AnEngineRefusesGroupsItDoesNotOwn) {
  comm::Communicator& ranks = world();
  const std::unique_ptr<comm::Communicator> copy = ranks.split(0, ranks.rank(), "blocks");
  Engines e(1, ranks, copy.get());
  const size_t h0 = e.model.block_index(0);
  std::vector<float> buffer(static_cast<size_t>(e.b->layout().group(h0).capacity()));
  const std::string not_mine =
      " of group h.0 of part 0 on the data-parallel engine 'dense' that does not own it (another engine serves it; "
      "hooks go through a GroupHooksRouter)";
  EXPECT_EQ(error_of([&] { e.a->gather_full(0, h0, parallel::DataParallel::State::Params, buffer.data()); }),
            "internal: gather_full" + not_mine);
  EXPECT_EQ(error_of([&] { e.a->load_full(0, h0, parallel::DataParallel::State::AdamV, buffer.data()); }),
            "internal: load_full" + not_mine);
  EXPECT_EQ(error_of([&] { e.a->hooks(0).before_grads(h0); }), "internal: before_grads" + not_mine);
  EXPECT_FALSE(e.a->owns(0, h0));
  EXPECT_TRUE(e.b->owns(0, h0));
  EXPECT_EQ(&e.router->route(h0), &e.b->hooks(0));
  EXPECT_EQ(&e.router->route(e.model.embedding_index()), &e.a->hooks(0));
  // Both engines for every group, then neither for the blocks.
  model::GroupHooks* ha = &e.a->hooks(0);
  const size_t groups = e.model.groups().size();
  auto everything = [](size_t) { return true; };
  EXPECT_EQ(error_of([&] { parallel::GroupHooksRouter both(groups, {{everything, ha}, {everything, ha}}); }),
            "internal: group 0 of a model part is owned by 2 data-parallel engines; every group needs exactly one");
  auto dense = [&](size_t g) { return embedding_or_final(e.model, g); };
  EXPECT_EQ(error_of([&] { parallel::GroupHooksRouter none(groups, {{dense, ha}}); }),
            "internal: group 1 of a model part is owned by 0 data-parallel engines; every group needs exactly one");
}

}  // namespace
