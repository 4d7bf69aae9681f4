// The pipeline executor under mpiexec (2 and 4 ranks): every schedule trains
// the model of one process with the same global batch — 10 steps, losses to
// 1e-5 relative, every parameter (both copies of the tied embedding
// included) to 1e-4 absolute (equivalence.h's tolerance) — and its measured
// timeline holds every action.
//
// Both sides are driven here, with the same recipe (AdamW, clipping at 1,
// warm-up and cosine), on token batches that depend only on (step,
// micro-batch): the one-process model over m micro-batches, and the
// pipeline's stage models through the executor.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "../io/test_util.h"
#include "equivalence.h"
#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/core/threads.h"
#include "lattice/io/config.h"
#include "lattice/kernels/ops.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/parallel/pipeline/executor.h"
#include "lattice/parallel/pipeline/partition.h"
#include "lattice/parallel/pipeline/timeline.h"
#include "lattice/train/trainer.h"
#include "mpi_ranks.h"

using namespace lattice;
using namespace lattice::pipeline;

namespace {

using mpitest::world;

const bool kOneThread = (set_num_threads(1), true);
constexpr int kSteps = 10, B = 2, T = 16;

using mpitest::groups_of;

model::ModelConfig tiny(int layers) {
  model::ModelConfig c;
  c.n_layer = layers;
  c.n_head = 4;
  c.n_embd = 32;
  c.vocab_size = 101;
  c.seq_len = T;
  return c;
}

std::vector<int32_t> tokens(int step, int micro, int salt) {
  std::vector<int32_t> v(B * T);
  for (int i = 0; i < B * T; i++) v[i] = static_cast<int32_t>((i * 31 + step * 17 + micro * 7 + salt) % 101);
  return v;
}

struct PipeRun {
  std::vector<double> losses, norms;
  std::vector<std::pair<std::string, std::vector<float>>> groups;  // name -> parameters
};

float lr_of(int step) { return optim::lr_at(step, kSteps, 3, 1e-2f, 1e-3f); }

PipeRun one_process(int layers, int m) {
  model::GPT g(tiny(layers), 5);
  optim::AdamW adam(g.groups(), optim::AdamWConfig{});
  PipeRun r;
  for (int step = 0; step < kSteps; step++) {
    g.zero_grad();
    double loss = 0;
    for (int k = 0; k < m; k++) {
      const auto in = tokens(step, k, 0), tg = tokens(step, k, 3);
      loss += g.forward(0, in.data(), tg.data(), B, T, 1.0f / static_cast<float>(m));
      g.backward(0);
    }
    const double norm = optim::global_grad_norm(g.groups());
    adam.step(lr_of(step), optim::clip_scale(norm, 1.0f));
    r.losses.push_back(loss / m);
    r.norms.push_back(norm);
  }
  for (const model::ParamGroup& p : g.groups())
    r.groups.push_back({p.name(), std::vector<float>(p.data(), p.data() + p.numel())});
  return r;
}

// The pipeline: stage s runs chunk s of the balanced partition, on the rank the schedule places it.
PipeRun pipelined(const Schedule& s, int layers, comm::Communicator& group,
                  std::vector<std::vector<Interval>>* timeline) {
  const model::ModelConfig c = tiny(layers);
  const std::vector<ChunkLayers> cut = balanced_partition(layer_costs(c, T), s.stages);
  std::vector<std::unique_ptr<model::GPT>> models;
  std::vector<std::unique_ptr<optim::AdamW>> adams;
  std::vector<model::GPT*> mine;
  for (int st = 0; st < s.stages; st++) {
    if (s.rank_of_stage[st] != group.rank()) continue;
    models.push_back(std::make_unique<model::GPT>(c, 5, nullptr, model::StageLayers{cut[st].first, cut[st].last}));
    adams.push_back(std::make_unique<optim::AdamW>(models.back()->groups(), optim::AdamWConfig{}));
    mine.push_back(models.back().get());
  }
  Executor ex(s, mine, group);
  PipeRun r;
  for (int step = 0; step < kSteps; step++) {
    for (auto& g : models) g->zero_grad();
    std::vector<std::vector<int32_t>> in, tg;
    std::vector<MicroBatch> batches;
    for (int k = 0; k < s.micro_batches; k++) in.push_back(tokens(step, k, 0)), tg.push_back(tokens(step, k, 3));
    for (int k = 0; k < s.micro_batches; k++) batches.push_back({in[k].data(), tg[k].data()});
    const double loss = ex.run_step(batches, B, T);
    // What the data-parallel engine does in lattice train: the tied
    // embedding's two shares summed between its stages, and the norm over
    // the pipeline with every parameter counted once (GPT::counts_in_norm).
    model::GPT *first = nullptr, *last = nullptr;
    for (auto& g : models) {
      if (g->first_stage()) first = g.get();
      if (g->last_stage()) last = g.get();
    }
    auto share = [](model::GPT* g) -> float* {
      if (!g) return nullptr;
      g->embedding_group().zero_unwritten_grads();
      return g->embedding_group().grad_storage();
    };
    float *a = share(first), *b = share(last);
    if (a || b) ex.sum_tied(a, b, static_cast<size_t>((first ? first : last)->embedding_group().numel()));
    double sum_squares = 0;
    for (auto& g : models)
      for (size_t i = 0; i < g->groups().size(); i++)
        for (const model::ParamInfo& info : g->groups()[i].params())
          if (g->counts_in_norm(i, info))
            sum_squares += kernels::sum_squares(g->groups()[i].grad() + info.offset, info.numel());
    group.all_reduce(&sum_squares, 1, DType::F64, comm::ReduceOp::Sum);
    const double norm = std::sqrt(sum_squares);
    for (auto& a : adams) a->step(lr_of(step), optim::clip_scale(norm, 1.0f));
    r.losses.push_back(loss);
    r.norms.push_back(norm);
  }
  for (auto& g : models)
    for (const model::ParamGroup& p : g->groups())
      r.groups.push_back({p.name(), std::vector<float>(p.data(), p.data() + p.numel())});
  if (timeline) *timeline = ex.gather_timelines();
  return r;
}

void expect_same(const PipeRun& got, const PipeRun& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); i++) {
    EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5 * std::fabs(want.losses[i])) << what << " step " << i + 1;
    EXPECT_NEAR(got.norms[i], want.norms[i], 1e-4 * std::fabs(want.norms[i])) << what << " norm, step " << i + 1;
  }
  for (const auto& [name, values] : got.groups) {
    const std::vector<float>* w = nullptr;
    for (const auto& [n, v] : want.groups)
      if (n == name) w = &v;
    ASSERT_TRUE(w) << what << ": group " << name;
    ASSERT_EQ(w->size(), values.size());
    double worst = 0;
    for (size_t i = 0; i < values.size(); i++) worst = std::max(worst, std::fabs(double(values[i]) - (*w)[i]));
    EXPECT_LE(worst, 1e-4) << what << ": group " << name;
  }
}

TEST(PipelineExecutor, EveryScheduleTrainsTheOneProcessModel) {
  for (int p : {2, 4}) {
    if (p > world().size()) continue;
    for (int m : {4, 8}) {
      const PipeRun want = one_process(4, m), want8 = one_process(8, m);
      for (const char* name : {"gpipe", "1f1b", "zb-h1"}) {
        const Schedule s = make_schedule(name, p, 1, m);
        expect_same(pipelined(s, 4, groups_of(p), nullptr), want,
                    std::string(name) + " pp=" + std::to_string(p) + " m=" + std::to_string(m));
      }
      // Interleaved: 2 chunks per rank, so 2p stages of the 8-layer model.
      for (const char* name : {"interleaved", "zb-v"}) {
        const Schedule s = make_schedule(name, p, 2, m);
        expect_same(pipelined(s, 8, groups_of(p), nullptr), want8,
                    std::string(name) + " v=2 pp=" + std::to_string(p) + " m=" + std::to_string(m));
      }
    }
  }
}

// A hand-written PyTorch-format schedule (split backward) runs too, and the
// measured timeline has every action of every rank in order.
TEST(PipelineExecutor, CsvScheduleRunsAndItsTimelineIsRecorded) {
  const Schedule s = from_csv("0F0,0F1,0I0,0I1,0W0,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n", "hand.csv");
  std::vector<std::vector<Interval>> timeline;
  expect_same(pipelined(s, 4, groups_of(2), &timeline), one_process(4, 2), "hand.csv");
  ASSERT_EQ(timeline.size(), 2u);
  for (int r = 0; r < 2; r++) {
    ASSERT_EQ(timeline[r].size(), s.actions[r].size());
    for (size_t i = 0; i < timeline[r].size(); i++) {
      EXPECT_EQ(timeline[r][i].action, s.actions[r][i]);
      EXPECT_LE(timeline[r][i].start, timeline[r][i].end);
      if (i) EXPECT_LE(timeline[r][i - 1].end, timeline[r][i].start);
    }
  }
  const std::string trace = chrome_trace(timeline, 1.0, "hand.csv");
  EXPECT_NE(trace.find("\"name\":\"1W1\""), std::string::npos);
  const double bubble = bubble_of(timeline);
  EXPECT_GE(bubble, 0.0);
  EXPECT_LT(bubble, 1.0);
}

}  // namespace

namespace {

// ---- through the trainer: lattice train's pipeline path ----

io::RunConfig pp_layout(int pp, const std::string& schedule, int v = 1, int layers = 4) {
  io::RunConfig c = mpitest::parity_recipe();
  c.model.n_layer = layers;
  c.model.seq_len = T;
  c.train.micro_batch_size = B;
  c.train.grad_accum_steps = 4;
  c.parallel.pp = pp;
  c.parallel.schedule = schedule;
  c.parallel.virtual_stages = v;
  return c;
}

// Resumes `c` from dir/step_000005 on `ranks` for the last 5 steps: the tail of `want`.
void expect_resumed(io::RunConfig c, const std::filesystem::path& dir, comm::Communicator& ranks,
                    const mpitest::RunResult& want, const std::string& what) {
  c.checkpoint.resume = (dir / "step_000005").string();
  mpitest::RunResult got = mpitest::train_run(c, ranks, 5);
  mpitest::RunResult tail = want;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 5);
  tail.norms.erase(tail.norms.begin(), tail.norms.begin() + 5);
  mpitest::expect_same_run(got, tail, what);
}

TEST(PipelineTrainer, LatticeTrainAtPpTrainsTheOneProcessModel) {
  const mpitest::RunResult want = mpitest::train_run(pp_layout(1, "1f1b"), mpitest::self());
  const mpitest::RunResult want8 = mpitest::train_run(pp_layout(1, "1f1b", 1, 8), mpitest::self());
  for (int p : {2, 4}) {
    if (p > world().size()) continue;
    for (const char* s : {"gpipe", "1f1b", "zb-h1"})
      mpitest::expect_same_run(mpitest::train_run(pp_layout(p, s), groups_of(p)), want,
                               std::string(s) + " pp=" + std::to_string(p));
    for (const char* s : {"interleaved", "zb-v"})
      mpitest::expect_same_run(mpitest::train_run(pp_layout(p, s, 2, 8), groups_of(p)), want8,
                               std::string(s) + " v=2 pp=" + std::to_string(p));
    // An explicit cut: the first stage takes one layer, the last the rest.
    io::RunConfig c = pp_layout(p, "1f1b");
    c.parallel.partition = p == 2 ? "1,3" : "1,1,1,1";
    mpitest::expect_same_run(mpitest::train_run(c, groups_of(p)), want, "partition " + c.parallel.partition);
  }
}

// Data parallelism over pipelines: dp=2 replicas of a pp=2 pipeline, each on
// half of the global batch of 8 sequences, train the one-process model at
// every ZeRO stage — gradients all-reduced (0), Adam moments sharded (1),
// gradients too, reduced every micro-batch (2), parameters too, gathered for
// every pass (3); checkpoints of stages 0, 1 and 3 resume on one process, and
// a one-process checkpoint resumes under ZeRO-1 and ZeRO-3 (each replica
// keeps its slices).
TEST(PipelineTrainer, DataParallelPipelinesTrainTheOneProcessModel) {
  if (world().size() < 4) GTEST_SKIP() << "dp2 x pp2 needs 4 ranks";
  io::RunConfig one = pp_layout(1, "1f1b");
  one.train.grad_accum_steps = 1;
  one.train.global_batch_size = 8;
  const mpitest::RunResult want = mpitest::train_run(one, mpitest::self());
  auto layout = [](const char* schedule, int zero) {
    io::RunConfig c = pp_layout(2, schedule, std::string(schedule) == "zb-v" ? 2 : 1);
    c.parallel.dp = 2;
    c.parallel.zero_stage = zero;
    c.train.grad_accum_steps = 1;
    c.train.global_batch_size = 8;  // 2 micro-batches of 2 per replica
    return c;
  };
  for (int zero : {0, 1, 2, 3})
    for (const char* s : {"1f1b", "zb-h1", "gpipe", "zb-v"})
      mpitest::expect_same_run(mpitest::train_run(layout(s, zero), groups_of(4)), want,
                               std::string("dp2 x pp2 ") + s + " ZeRO-" + std::to_string(zero));
  for (int zero : {0, 1, 3}) {
    const std::filesystem::path dir = mpitest::shared_dir("lattice_pp_test", "dp_ckpt" + std::to_string(zero));
    mpitest::train_run(layout("1f1b", zero), groups_of(4), 5, dir.string());
    world().barrier();
    expect_resumed(one, dir, mpitest::self(), want,
                   "dp2 x pp2 ZeRO-" + std::to_string(zero) + " checkpoint resumed on one process");
  }
  const std::filesystem::path dir = mpitest::shared_dir("lattice_pp_test", "dp_ckpt_one");
  if (world().rank() == 0) mpitest::train_run(one, mpitest::self(), 5, dir.string());
  world().barrier();
  expect_resumed(layout("zb-h1", 1), dir, groups_of(4), want, "one-process checkpoint resumed at dp2 x pp2 ZeRO-1");
  expect_resumed(layout("zb-v", 3), dir, groups_of(4), want, "one-process checkpoint resumed at dp2 x pp2 ZeRO-3");
}

// Gradient compression over pipelines (compress/gradient_reducer.h through
// the data-parallel engine) at every ZeRO stage: the replicas of every stage
// stay bit-identical, the gradient bytes are the codec's share, every codec
// learns (its loss drop at least half the uncompressed run's), and bf16
// stays within its rounding of the uncompressed run.
TEST(PipelineTrainer, CompressedGradientsOverPipelines) {
  if (world().size() < 4) GTEST_SKIP() << "dp2 x pp2 needs 4 ranks";
  auto layout = [](const char* codec, int zero) {
    io::RunConfig c = pp_layout(2, "zb-h1");
    c.parallel.dp = 2;
    c.parallel.zero_stage = zero;
    c.train.grad_accum_steps = 1;
    c.train.global_batch_size = 8;
    c.compression.grad = codec;
    return c;
  };
  comm::Communicator& four = groups_of(4);
  for (int zero : {0, 1, 2, 3}) {
    const mpitest::RunResult plain = mpitest::train_run(layout("none", zero), four);
    for (const char* codec : {"bf16", "int8", "onebit"}) {
      const std::string what = std::string(codec) + " dp2 x pp2 ZeRO-" + std::to_string(zero);
      train::TrainerOptions o;
      o.print = false;
      o.ranks = &four;
      train::Trainer t(layout(codec, zero), o);
      double sent = 0, uncompressed = 0;
      std::vector<double> losses;
      for (int s = 0; s < 10; s++) {
        const train::StepStats st = t.train_step();
        losses.push_back(st.loss);
        sent += static_cast<double>(st.grad_bytes);
        uncompressed += static_cast<double>(st.grad_bytes_uncompressed);
      }
      const std::vector<train::HfTensor> params = t.full_tensors();
      for (const train::HfTensor& p : params)
        ASSERT_EQ(mpitest::first_differing_rank(four, p.data), -1) << what << ": " << p.name << " differs on that rank";
      const double want = std::string(codec) == "bf16" ? 0.5 : std::string(codec) == "int8" ? 0.27 : 0.04;
      // It learns: the loss falls at least half as far as uncompressed.
      EXPECT_GE(losses.front() - losses.back(), 0.5 * (plain.losses.front() - plain.losses.back()))
          << what << ": loss " << losses.front() << " -> " << losses.back() << ", uncompressed "
          << plain.losses.front() << " -> " << plain.losses.back();
      EXPECT_GT(uncompressed, 0) << what;
      EXPECT_LE(sent / uncompressed, want + 1e-9) << what;
      if (std::string(codec) == "bf16")
        for (size_t s = 0; s < losses.size(); s++)
          EXPECT_NEAR(losses[s], plain.losses[s], 2e-3 * std::fabs(plain.losses[s])) << what << " step " << s + 1;
    }
  }
}

// ZeRO over pipelines keeps 1/dp of the Adam moments on each rank from stage
// 1 on, and at stage 3 the model state (parameters, gradients, moments) falls
// well below stage 1's.
TEST(PipelineTrainer, ZeroShardsTheStateOverTheReplicas) {
  if (world().size() < 4) GTEST_SKIP() << "dp2 x pp2 needs 4 ranks";
  struct Bytes {
    double moments, state;
  };
  auto measure = [](int zero) {
    // 12 layers: 6 blocks a stage, so that the borrowed buffers are fewer
    // than half a stage: at ZeRO-3 two blocks of parameters (one in use, one
    // prefetched, as on the whole model), at ZeRO-2 one block of gradients,
    // and a chunk of the embedding each (with 4 blocks a stage, two of them
    // and the chunk are more than the half ZeRO-3 saves).
    io::RunConfig c = pp_layout(2, "1f1b", 1, 12);
    c.parallel.dp = 2;
    c.parallel.zero_stage = zero;
    c.train.grad_accum_steps = 1;
    c.train.global_batch_size = 8;
    train::TrainerOptions o;
    o.print = false;
    o.ranks = &groups_of(4);
    MemoryTracker& mem = MemoryTracker::instance();
    auto state = [&] {
      return static_cast<double>(mem.current(MemCategory::Params) + mem.current(MemCategory::Grads) +
                                 mem.current(MemCategory::Optimizer));
    };
    const double before = state();
    train::Trainer t(c, o);
    t.train_step();  // borrowed buffers exist after a step
    return Bytes{static_cast<double>(t.optimizer().store().resident_bytes()), state() - before};
  };
  const Bytes z0 = measure(0), z1 = measure(1), z2 = measure(2), z3 = measure(3);
  EXPECT_GT(z0.moments, 0);
  // Half, but for the padding of each group's buckets to whole 16-float slices.
  EXPECT_NEAR(z1.moments / z0.moments, 0.5, 0.02) << z1.moments << " of " << z0.moments << " bytes";
  EXPECT_NEAR(z2.moments / z0.moments, 0.5, 0.02);
  EXPECT_LT(z2.state, z1.state) << "ZeRO-2 " << z2.state << " bytes, ZeRO-1 " << z1.state;
  EXPECT_LT(z3.state, z2.state) << "ZeRO-3 " << z3.state << " bytes, ZeRO-2 " << z2.state;
}

// Full 3D: tensor parallelism inside the stages (SP off and on), and on 8
// ranks dp2 x tp2 x pp2; a tp2 x pp2 checkpoint resumes on one process.
TEST(PipelineTrainer, TensorParallelStagesAndFull3DTrainTheOneProcessModel) {
  if (world().size() < 4) GTEST_SKIP() << "tp2 x pp2 needs 4 ranks";
  io::RunConfig one = pp_layout(1, "1f1b");
  one.train.grad_accum_steps = 1;
  one.train.global_batch_size = 8;
  const mpitest::RunResult want = mpitest::train_run(one, mpitest::self());
  auto layout3d = [&](int dp, const char* schedule, bool sp) {
    io::RunConfig c = pp_layout(2, schedule);
    c.parallel.tp = 2;
    c.parallel.dp = dp;
    c.parallel.sequence_parallel = sp;
    c.train.grad_accum_steps = 1;
    c.train.global_batch_size = 8;
    return c;
  };
  const std::filesystem::path dir = mpitest::shared_dir("lattice_pp_test", "tp_ckpt");
  for (const char* s : {"1f1b", "zb-h1"})
    for (bool sp : {false, true})
      mpitest::expect_same_run(mpitest::train_run(layout3d(1, s, sp), groups_of(4)), want,
                               std::string("tp2 x pp2 ") + s + (sp ? " SP" : ""));
  if (world().size() >= 8) {
    mpitest::expect_same_run(mpitest::train_run(layout3d(2, "1f1b", true), groups_of(8)), want, "dp2 x tp2 x pp2 SP");
    for (int zero : {1, 2, 3}) {
      io::RunConfig z = layout3d(2, "zb-h1", true);
      z.parallel.zero_stage = zero;
      mpitest::expect_same_run(mpitest::train_run(z, groups_of(8)), want,
                               "dp2 x tp2 x pp2 SP ZeRO-" + std::to_string(zero) + " zb-h1");
    }
    // A block codec over the replicas of tensor-parallel stages: the
    // parameters whole on every TP rank stay identical over the TP group
    // (average_replicated_grads, gradient_reducer.h).
    io::RunConfig c = layout3d(2, "1f1b", true);
    c.parallel.zero_stage = 1;
    c.compression.grad = "onebit";
    EXPECT_EQ(mpitest::replicated_param_differing_over_tp(c, groups_of(8), 4), "")
        << "onebit dp2 x tp2 x pp2: this parameter differs between the TP ranks";
  }
  mpitest::train_run(layout3d(1, "zb-h1", true), groups_of(4), 5, dir.string());
  world().barrier();
  expect_resumed(one, dir, mpitest::self(), want, "tp2 x pp2 SP checkpoint resumed on one process");
}

// A checkpoint is full tensors by HF name at any pp: saved at pp=2 after 5
// steps, it resumes at pp=1 and (4 ranks) pp=4 on the uninterrupted run; saved
// at pp=4, it resumes at pp=1 and at tp=2 x pp=2.
TEST(PipelineTrainer, CheckpointsResumeAcrossPipelineLayouts) {
  const std::filesystem::path dir = mpitest::shared_dir("lattice_pp_test", "ckpt");
  const mpitest::RunResult want = mpitest::train_run(pp_layout(1, "1f1b"), mpitest::self());
  comm::Communicator& pairs = groups_of(2);
  if (world().rank() < 2) mpitest::train_run(pp_layout(2, "1f1b"), pairs, 5, dir.string());
  world().barrier();
  expect_resumed(pp_layout(1, "1f1b"), dir, mpitest::self(), want, "pp=2 resumed at pp=1");
  if (world().size() < 4) return;
  expect_resumed(pp_layout(4, "zb-h1"), dir, groups_of(4), want, "pp=2 resumed at pp=4 zb-h1");
  world().barrier();
  const std::filesystem::path dir4 = mpitest::shared_dir("lattice_pp_test", "ckpt4");
  mpitest::train_run(pp_layout(4, "1f1b"), groups_of(4), 5, dir4.string());
  world().barrier();
  expect_resumed(pp_layout(1, "1f1b"), dir4, mpitest::self(), want, "pp=4 resumed at pp=1");
  io::RunConfig tp2pp2 = pp_layout(2, "zb-h1");
  tp2pp2.parallel.tp = 2;
  expect_resumed(tp2pp2, dir4, groups_of(4), want, "pp=4 resumed at tp=2 x pp=2");
}

// Evaluation runs the stages' forwards only and gives the one-process loss.
TEST(PipelineTrainer, EvaluationMatchesOneProcess) {
  const auto eval = [](const io::RunConfig& c, comm::Communicator& r) { return mpitest::eval_before_and_after(c, r); };
  const std::vector<double> want = eval(pp_layout(1, "1f1b"), mpitest::self());
  const std::vector<double> got = eval(pp_layout(2, "1f1b"), groups_of(2));
  for (size_t i = 0; i < want.size(); i++) EXPECT_NEAR(got[i], want[i], 1e-5 * std::fabs(want[i])) << "eval " << i;
  if (world().size() < 4) return;
  // Under data parallelism and ZeRO-3 (every forward gathers its parameters).
  io::RunConfig one = pp_layout(1, "1f1b"), z3 = pp_layout(2, "zb-h1");
  one.train.grad_accum_steps = z3.train.grad_accum_steps = 1;
  one.train.global_batch_size = z3.train.global_batch_size = 8;
  z3.parallel.dp = 2;
  z3.parallel.zero_stage = 3;
  const std::vector<double> want8 = eval(one, mpitest::self()), got3 = eval(z3, groups_of(4));
  for (size_t i = 0; i < want8.size(); i++)
    EXPECT_NEAR(got3[i], want8[i], 1e-5 * std::fabs(want8[i])) << "dp2 x pp2 ZeRO-3 eval " << i;
}

// One data-parallel engine serves pipelines as it serves the whole model:
// disk offload at ZeRO 1 and 3 trains bit-identically to the state in memory.
TEST(PipelineTrainer, DiskOffloadOverPipelinesIsBitIdentical) {
  if (world().size() < 4) GTEST_SKIP() << "dp2 x pp2 needs 4 ranks";
  for (int zero : {1, 3}) {
    io::RunConfig c = pp_layout(2, "zb-h1");
    c.parallel.dp = 2;
    c.parallel.zero_stage = zero;
    c.train.grad_accum_steps = 2;
    c.train.global_batch_size = 8;
    const mpitest::RunResult memory = mpitest::train_run(c, groups_of(4), 5);
    const std::filesystem::path dir = mpitest::shared_dir("lattice_pp_test", "offload" + std::to_string(zero));
    c.zero.offload = "disk";
    c.zero.offload_dir = dir.string();
    c.zero.offload_window_mb = 0.01;  // several windows even for this model
    const mpitest::RunResult disk = mpitest::train_run(c, groups_of(4), 5);
    const std::string what = "dp2 x pp2 ZeRO-" + std::to_string(zero) + " offload";
    {
      // The state is really on disk: files of this rank in the directory, and
      // less of it resident than in memory.
      train::TrainerOptions o;
      o.print = false;
      o.ranks = &groups_of(4);
      train::Trainer t(c, o);
      io::RunConfig in_memory = c;
      in_memory.zero = io::RunConfig().zero;
      train::Trainer m(in_memory, o);
      EXPECT_NE(t.optimizer().store().describe().find("disk"), std::string::npos)
          << what << ": " << t.optimizer().store().describe();
      EXPECT_LT(t.optimizer().store().resident_bytes(), m.optimizer().store().resident_bytes()) << what;
      EXPECT_FALSE(std::filesystem::is_empty(dir)) << what << ": no offload file in " << dir;
    }
    ASSERT_EQ(disk.losses.size(), memory.losses.size());
    for (size_t s = 0; s < memory.losses.size(); s++) EXPECT_EQ(disk.losses[s], memory.losses[s]) << what;
    ASSERT_EQ(disk.params.size(), memory.params.size());
    for (size_t i = 0; i < memory.params.size(); i++)
      EXPECT_EQ(disk.params[i].data, memory.params[i].data) << what << ": " << memory.params[i].name;
  }
}

// The step's data-parallel communication figures (the step line's comm
// column, the metrics' comm_* fields) are those of the one engine under
// pipelines too: the bytes this rank sent and the time the collectives ran.
TEST(PipelineTrainer, CommunicationFiguresAreFilledUnderPipelines) {
  if (world().size() < 4) GTEST_SKIP() << "dp2 x pp2 needs 4 ranks";
  io::RunConfig c = pp_layout(2, "1f1b");
  c.parallel.dp = 2;
  c.train.grad_accum_steps = 1;
  c.train.global_batch_size = 8;
  train::TrainerOptions o;
  o.print = false;
  o.ranks = &groups_of(4);
  train::Trainer t(c, o);
  t.train_step();
  const train::StepStats s = t.train_step();
  EXPECT_GT(s.comm_bytes, 0u) << "gradients were reduced over the replicas";
  EXPECT_GT(s.comm_ms, 0.0);
  EXPECT_GE(s.comm_exposed_ms, 0.0);
  EXPECT_LE(s.comm_exposed_ms, s.step_ms);
}

// A model whose tied embedding is most of it (vocabulary 4096 x 32 against
// four blocks of 12·32²), so that holding it whole shows in the peaks.
io::RunConfig embedding_heavy(int zero) {
  io::RunConfig c = pp_layout(2, "1f1b");
  c.model.vocab_size = 4096;
  c.parallel.dp = 2;
  c.parallel.zero_stage = zero;
  c.parallel.bucket_mb = 0.05;  // embedding chunks of 400 rows
  c.train.grad_accum_steps = 1;
  c.train.global_batch_size = 8;
  return c;
}

// The embedding's floats of this rank's stage, if it holds the embedding,
// and the stage's whole parameter count (its parts' groups, unpadded).
struct StageSizes {
  double embedding = 0, stage = 0;
};
StageSizes stage_sizes(train::Trainer& t) {
  StageSizes s;
  for (const model::ParamGroup& g : t.model().groups()) {
    s.stage += static_cast<double>(g.numel());
    if (g.name() == "embedding") s.embedding = static_cast<double>(g.numel());
  }
  return s;
}

// ZeRO-2/3 over pipelines handle the tied embedding piece by piece, as on the
// whole model: on the first and the last stage the gradient of the embedding
// never exists whole (the peak of gradient memory stays below one embedding),
// and the two copies still train the one-process model.
TEST(PipelineTrainer, ZeroTwoAndThreeNeverHoldTheWholeEmbeddingGradient) {
  if (world().size() < 4) GTEST_SKIP() << "dp2 x pp2 needs 4 ranks";
  for (int zero : {2, 3}) {
    train::TrainerOptions o;
    o.print = false;
    o.ranks = &groups_of(4);
    MemoryTracker& mem = MemoryTracker::instance();
    const double before = static_cast<double>(mem.current(MemCategory::Grads));
    mem.reset_peaks();
    train::Trainer t(embedding_heavy(zero), o);
    for (int s = 0; s < 2; s++) t.train_step();
    const double peak = static_cast<double>(mem.peak(MemCategory::Grads)) - before;
    const StageSizes z = stage_sizes(t);
    ASSERT_GT(z.embedding, 0) << "every stage of a 2-stage pipeline holds the tied embedding";
    std::printf("[ memory ] rank %d, dp2 x pp2 ZeRO-%d: peak gradient memory %.0f floats, the embedding %.0f\n",
                world().rank(), zero, peak / 4, z.embedding);
    EXPECT_LT(peak / 4, z.embedding) << "ZeRO-" << zero << ": a whole embedding gradient existed on rank "
                                     << world().rank();
  }
  io::RunConfig one = embedding_heavy(0);
  one.parallel.dp = one.parallel.pp = 1;
  const mpitest::RunResult want = mpitest::train_run(one, mpitest::self(), 5);
  for (int zero : {2, 3})
    mpitest::expect_same_run(mpitest::train_run(embedding_heavy(zero), groups_of(4), 5), want,
                             "embedding-heavy dp2 x pp2 ZeRO-" + std::to_string(zero));
}

// ZeRO-3 over pipelines draws its initial values slice by slice: building the
// trainer never holds a stage's parameters whole on any rank.
TEST(PipelineTrainer, ZeroThreeDrawsInitialValuesAsSlices) {
  if (world().size() < 4) GTEST_SKIP() << "dp2 x pp2 needs 4 ranks";
  train::TrainerOptions o;
  o.print = false;
  o.ranks = &groups_of(4);
  MemoryTracker& mem = MemoryTracker::instance();
  const double before = static_cast<double>(mem.current(MemCategory::Params));
  mem.reset_peaks();
  train::Trainer t(embedding_heavy(3), o);
  const double peak = static_cast<double>(mem.peak(MemCategory::Params)) - before;
  const StageSizes z = stage_sizes(t);
  std::printf("[ memory ] rank %d, dp2 x pp2 ZeRO-3: peak parameter memory while building %.0f floats, the stage "
              "%.0f\n",
              world().rank(), peak / 4, z.stage);
  EXPECT_LT(peak / 4, z.stage) << "rank " << world().rank() << " held its stage's parameters whole";
}

// The message with which building a trainer for `c` on `ranks` fails.
std::string trainer_error(const io::RunConfig& c, comm::Communicator& ranks) {
  return io::testing::error_of([&] {
    train::TrainerOptions o;
    o.print = false;
    o.ranks = &ranks;
    train::Trainer t(c, o);
  });
}

TEST(PipelineTrainer, BadPipelineSettingsAreRefusedByName) {
  comm::Communicator& pairs = groups_of(2);
  auto has = [](const std::string& msg, const std::string& piece) {
    EXPECT_NE(msg.find(piece), std::string::npos) << msg;
  };
  io::RunConfig c = pp_layout(2, "interleaved", 3, 4);  // 2 x 3 = 6 chunks for 4 layers
  has(trainer_error(c, pairs), "6 chunks for 4 layers");
  c = pp_layout(2, "interleaved", 2, 4);
  c.train.grad_accum_steps = 3;  // not a multiple of pp
  has(trainer_error(c, pairs), "must be a multiple of parallel.pp=2");
  has(trainer_error(pp_layout(2, "pipedream"), pairs), "parallel.schedule=\"pipedream\" is not a schedule");
  has(trainer_error(pp_layout(2, "zb-v"), pairs), "zb-v schedule: two chunks per rank (parallel.virtual_stages=2)");
  has(trainer_error(pp_layout(2, "csv:/nonexistent/schedule.csv"), pairs), "/nonexistent/schedule.csv");
  has(trainer_error(pp_layout(1, "gpipe"), mpitest::self()), "applies to pipeline parallelism");
  c = pp_layout(2, "1f1b");
  c.parallel.partition = "3,2";  // 5 of 4 layers
  has(trainer_error(c, pairs), "parallel.partition=\"3,2\" covers 5 layers but the model has 4");
  c.parallel.partition = "4";
  has(trainer_error(c, pairs), "lists 1 chunks but the pipeline has 2");
  c.parallel.partition = "2,x";
  has(trainer_error(c, pairs), "'x' is not a number of layers");
  // recompute.first counts each stage's layers: stage 1 of "3,1" has one.
  c.parallel.partition = "3,1";
  c.recompute.mode = "full";
  c.recompute.first = 2;
  EXPECT_EQ(trainer_error(c, pairs),
            "recompute.first=2 names layers that do not exist: pipeline stage 1 has 1 layer (3..3); set "
            "recompute.first <= 1, or 0 for every layer of each stage");

}

}  // namespace
