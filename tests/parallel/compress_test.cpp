// Gradient compression under mpiexec (2 and 4 ranks, label mpi): the
// compressed collectives leave identical values on every rank, send the
// codec's share of the f32 bytes (asserted against the targets), and
// through the trainer every ZeRO stage trains with compressed gradients,
// every rank's parameters identical; error feedback is what makes the biased
// codecs (topk, onebit) train: without it they end measurably worse. 1-bit
// Adam (compression.momentum): with an exact reduction it trains the model of
// one process at every data-parallel degree, and with a codec it keeps the
// replicas identical, sends the codec's share and ends close to f32 where
// gradient compression does not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "../io/test_util.h"
#include "equivalence.h"
#include "lattice/core/threads.h"
#include "lattice/parallel/compress/gradient_reducer.h"
#include "lattice/comm/comm_stream.h"
#include "lattice/train/trainer.h"
#include "mpi_ranks.h"

using namespace lattice;
using namespace lattice::parallel;

namespace {

using mpitest::world;

const bool kOneThread = (set_num_threads(1), true);

std::vector<float> normal(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1e-3f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

using mpitest::first_differing_rank;

const GradCodec kCodecs[] = {GradCodec::BF16, GradCodec::F16, GradCodec::Int8, GradCodec::OneBit, GradCodec::TopK};

// The compressed all-reduce: the same floats on every rank, close to the sum
// for the 16-bit codecs, and exactly the codec's share of the f32 bytes; the
// reduce-scatter likewise (one of its two halves).
TEST(GradientReducer, IdenticalEverywhereAtTheCodecsShareOfTheBytes) {
  comm::Communicator& c = world();
  const int n = c.size();
  const int64_t k = 4096;
  for (GradCodec codec : kCodecs) {
    for (bool feedback : {true, false}) {
      CompressionOptions o;
      o.spec = CodecSpec{codec, 0.01};
      o.error_feedback = feedback;
      comm::CommStream stream(c, comm::Progress::Thread);
      GradientReducer reducer(stream, o);
      reducer.begin_step(0);
      ASSERT_TRUE(reducer.compressing());
      const std::vector<float> mine = normal(static_cast<size_t>(n * k), 7 + c.rank());
      std::vector<float> exact = mine, got = mine, slice(static_cast<size_t>(k));
      c.all_reduce(exact.data(), exact.size(), DType::F32, comm::ReduceOp::Sum);
      stream.wait(reducer.all_reduce(GradientReducer::key(1, 0), got.data(), k, "test"));
      const std::string what = std::string(grad_codec_name(codec)) + (feedback ? " with" : " without") + " EF";
      EXPECT_EQ(first_differing_rank(c, got), -1) << what;
      if (codec == GradCodec::BF16 || codec == GradCodec::F16) {
        const double rel = codec == GradCodec::BF16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -9);
        for (size_t i = 0; i < exact.size(); i++) EXPECT_NEAR(got[i], exact[i], rel * 4e-3 * n) << what << " " << i;
      }
      const GradientReducer::Bytes b = reducer.bytes();
      const double share = static_cast<double>(payload_bytes(o.spec, k)) / (4.0 * k);
      EXPECT_EQ(b.uncompressed, 2ull * (n - 1) * k * 4) << what;
      EXPECT_NEAR(static_cast<double>(b.sent) / b.uncompressed, share, 1e-12) << what;
      // The reduce-scatter: this rank's block of the (compressed) sum.
      reducer.reset_bytes();
      std::vector<float> chunk = mine;
      stream.wait(reducer.reduce_scatter(GradientReducer::key(2, 0), chunk.data(), k, slice.data(), false, "test"));
      EXPECT_NEAR(static_cast<double>(reducer.bytes().sent) / reducer.bytes().uncompressed, share, 1e-12) << what;
      if (codec == GradCodec::BF16)
        for (int64_t i = 0; i < k; i++) EXPECT_NEAR(slice[i], exact[c.rank() * k + i], 4e-3 * n / 128) << what;
    }
  }
  // The byte targets.
  auto share = [&](GradCodec codec) { return payload_bytes(CodecSpec{codec, 0.01}, k) / (4.0 * k); };
  EXPECT_EQ(share(GradCodec::BF16), 0.5);
  EXPECT_LE(share(GradCodec::Int8), 0.27);
  EXPECT_LE(share(GradCodec::TopK), 0.025);
  EXPECT_LE(share(GradCodec::OneBit), 0.04);
}

// Error feedback through the collective (worker and server errors): the
// same gradients reduced 40 times, the mean of what the compressed
// all-reduce and reduce-scatter delivered approaches the exact sum; without
// error feedback the biased codecs stay off by the same amount every time.
TEST(GradientReducer, ErrorFeedbackMakesTheMeanExact) {
  comm::Communicator& c = world();
  const int n = c.size();
  const int64_t k = 1024;
  const std::vector<float> mine = normal(static_cast<size_t>(n * k), 40 + c.rank());
  std::vector<float> exact = mine;
  c.all_reduce(exact.data(), exact.size(), DType::F32, comm::ReduceOp::Sum);
  for (GradCodec codec : {GradCodec::OneBit, GradCodec::TopK}) {
    double err[2] = {0, 0}, err_rs[2] = {0, 0};
    for (bool feedback : {true, false}) {
      CompressionOptions o;
      o.spec = CodecSpec{codec, 0.05};
      o.error_feedback = feedback;
      comm::CommStream stream(c, comm::Progress::Inline);
      GradientReducer reducer(stream, o);
      reducer.begin_step(0);
      const int T = 40;
      std::vector<double> mean(exact.size(), 0.0), mean_rs(static_cast<size_t>(k), 0.0);
      std::vector<float> slice(static_cast<size_t>(k));
      for (int t = 0; t < T; t++) {
        std::vector<float> got = mine, chunk = mine;
        stream.wait(reducer.all_reduce(GradientReducer::key(3, 0), got.data(), k, "ar"));
        stream.wait(reducer.reduce_scatter(GradientReducer::key(4, 0), chunk.data(), k, slice.data(), false, "rs"));
        for (size_t i = 0; i < got.size(); i++) mean[i] += got[i] / T;
        for (int64_t i = 0; i < k; i++) mean_rs[i] += slice[i] / T;
      }
      double num = 0, den = 0, num_rs = 0, den_rs = 0;
      for (size_t i = 0; i < exact.size(); i++) num += std::pow(mean[i] - exact[i], 2), den += std::pow(exact[i], 2);
      for (int64_t i = 0; i < k; i++) {
        const double e = exact[c.rank() * k + i];
        num_rs += std::pow(mean_rs[i] - e, 2), den_rs += e * e;
      }
      err[feedback ? 0 : 1] = std::sqrt(num / den);
      err_rs[feedback ? 0 : 1] = std::sqrt(num_rs / den_rs);
    }
    const std::string what = grad_codec_name(codec);
    // What is still owed after T steps is at most about one gradient a coordinate (topk at 5% sends each
    // about once in 20 steps), so the mean's error is of order 1/T of that.
    EXPECT_LT(err[0], codec == GradCodec::TopK ? 0.35 : 0.25)
        << what << ": relative error of the mean with error feedback";
    EXPECT_LT(err[0], 0.5 * err[1]) << what << ": with " << err[0] << ", without " << err[1];
    EXPECT_LT(err_rs[0], 0.5 * err_rs[1]) << what << " reduce-scatter: with " << err_rs[0] << ", without " << err_rs[1];
  }
}

// Warm-up steps reduce uncompressed: the plain collective's result and bytes.
TEST(GradientReducer, WarmUpStepsAreUncompressed) {
  comm::Communicator& c = world();
  CompressionOptions o;
  o.spec.codec = GradCodec::OneBit;
  o.warmup_steps = 2;
  comm::CommStream stream(c, comm::Progress::Inline);
  GradientReducer reducer(stream, o);
  const int64_t k = 256;
  for (int step = 0; step < 3; step++) {
    reducer.begin_step(step);
    EXPECT_EQ(reducer.compressing(), step >= 2);
    const std::vector<float> mine = normal(static_cast<size_t>(c.size() * k), 3 + c.rank());
    std::vector<float> exact = mine, got = mine;
    c.all_reduce(exact.data(), exact.size(), DType::F32, comm::ReduceOp::Sum);
    reducer.reset_bytes();
    stream.wait(reducer.all_reduce(0, got.data(), k, "test"));
    if (step < 2) EXPECT_EQ(got, exact) << "step " << step;
    EXPECT_EQ(reducer.bytes().sent == reducer.bytes().uncompressed, step < 2) << "step " << step;
  }
}

// ---- through the trainer ----

io::RunConfig dp_run(const std::string& codec, int zero) {
  return mpitest::compressed_run(codec, zero, world().size());
}

// The most a codec's reductions may send, as a share of f32's: its payload
// formula (gradient_codec.h) with room for the scales (int8, onebit) and the
// indices and rounding (topk: 8 bytes per kept value, 2.5·ratio).
double max_share(const std::string& codec, double topk_ratio) {
  if (codec == "bf16" || codec == "f16") return 0.5;
  if (codec == "int8") return 0.27;
  if (codec == "topk") return 2.5 * topk_ratio;
  return 0.04;  // onebit
}

// The compressed run learns: its loss falls at least half as far as the
// uncompressed run's over the same steps.
void expect_learns(const mpitest::RunResult& got, const mpitest::RunResult& plain, const std::string& what) {
  EXPECT_GE(got.losses.front() - got.losses.back(), 0.5 * (plain.losses.front() - plain.losses.back()))
      << what << ": loss " << got.losses.front() << " -> " << got.losses.back() << ", uncompressed "
      << plain.losses.front() << " -> " << plain.losses.back();
}

// Every ZeRO stage trains with compressed gradients: the replicas stay
// identical (the collective gives every rank the same values), every codec
// learns (its loss drop at least half the uncompressed run's), the 16-bit
// codecs stay within their rounding of the uncompressed run, and the
// gradient bytes are the codec's share (the embedding's sparse lookup
// exchange, which is not a reduction, is not counted: StepStats::grad_bytes).
TEST(CompressedTraining, EveryZeroStageKeepsTheReplicasIdentical) {
  comm::Communicator& all = world();
  for (int zero : {0, 1, 2, 3}) {
    const mpitest::RunResult plain = mpitest::train_run(dp_run("none", zero), all);
    for (const char* codec : {"bf16", "f16", "int8", "topk", "onebit"}) {
      const std::string what = std::string(codec) + " ZeRO-" + std::to_string(zero);
      io::RunConfig cfg = dp_run(codec, zero);
      train::TrainerOptions o;
      o.print = false;
      o.ranks = &all;
      train::Trainer t(cfg, o);
      mpitest::RunResult got;
      double sent = 0, uncompressed = 0;
      for (int s = 0; s < 10; s++) {
        const train::StepStats st = t.train_step();
        got.losses.push_back(st.loss);
        got.norms.push_back(st.grad_norm);
        sent += static_cast<double>(st.grad_bytes);
        uncompressed += static_cast<double>(st.grad_bytes_uncompressed);
      }
      got.params = t.full_tensors();
      // Identical on every rank, bit for bit.
      for (const train::HfTensor& p : got.params)
        ASSERT_EQ(first_differing_rank(all, p.data), -1) << what << ": " << p.name << " differs on that rank";
      const double share = sent / uncompressed;
      EXPECT_LE(share, max_share(codec, cfg.compression.topk_ratio) + 1e-9) << what;
      EXPECT_GT(share, 0.0) << what;
      for (size_t s = 0; s < got.losses.size(); s++) EXPECT_TRUE(std::isfinite(got.losses[s])) << what;
      // Every codec learns: its loss falls at least half as far as the
      // uncompressed run's over the same steps (a codec decoding zeros, or
      // garbage that stays finite, would not). Top-k at its default 1% sends
      // a hundredth of the gradient a step: over 10 steps it learns a
      // fifteenth as fast at ZeRO 0-1 (its known weakness, measured), so it
      // is held to this at 10% below.
      if (std::string(codec) != "topk") expect_learns(got, plain, what);
      if (std::string(codec) == "int8")  // a scale per 256 values: close to the f32 run after 10 steps
        for (size_t s = 0; s < got.losses.size(); s++)
          EXPECT_NEAR(got.losses[s], plain.losses[s], 1e-2 * std::fabs(plain.losses[s])) << what << " step " << s + 1;
      if (std::string(codec) == "bf16" || std::string(codec) == "f16") {  // rounding only: close to the f32 run
        for (size_t s = 0; s < got.losses.size(); s++)
          EXPECT_NEAR(got.losses[s], plain.losses[s], 2e-3 * std::fabs(plain.losses[s])) << what << " step " << s + 1;
      }
    }
  }
}

// Top-k learns at every ZeRO stage when it sends 10% of the gradient.
TEST(CompressedTraining, TopKAtTenPercentLearnsAtEveryZeroStage) {
  for (int zero : {0, 1, 2, 3}) {
    const mpitest::RunResult plain = mpitest::train_run(dp_run("none", zero), world());
    io::RunConfig c = dp_run("topk", zero);
    c.compression.topk_ratio = 0.1;
    expect_learns(mpitest::train_run(c, world()), plain, "topk 10% ZeRO-" + std::to_string(zero));
  }
}

// With tensor parallelism: each TP rank's data-parallel group compresses its
// slices (dp2 x tp2 on 4 ranks, ZeRO 0 and 2, SP on); bf16 stays within its
// rounding of the uncompressed run and every rank's full tensors agree.
TEST(CompressedTraining, WithTensorParallelism) {
  if (world().size() != 4) GTEST_SKIP() << "dp2 x tp2 needs 4 ranks";
  for (int zero : {0, 2}) {
    io::RunConfig c = dp_run("none", zero);
    c.parallel.dp = 2;
    c.parallel.tp = 2;
    c.parallel.sequence_parallel = true;
    const mpitest::RunResult plain = mpitest::train_run(c, world());
    c.compression.grad = "bf16";
    const mpitest::RunResult got = mpitest::train_run(c, world());
    for (size_t s = 0; s < got.losses.size(); s++)
      EXPECT_NEAR(got.losses[s], plain.losses[s], 2e-3 * std::fabs(plain.losses[s])) << "ZeRO-" << zero << " step "
                                                                                      << s + 1;
    for (const train::HfTensor& p : got.params)
      ASSERT_EQ(first_differing_rank(world(), p.data), -1) << p.name << " differs on that rank";
  }
}

// Under tensor parallelism a block of a codec can hold parameters that are
// whole on every TP rank (LayerNorms, row-parallel biases, wpe) beside
// slices of the others: whatever each data-parallel group compresses, the
// replicated parameters must stay identical over the TP group, or the model
// would stop being one model.
// The same for a Llama with one key/value head, kept whole on both TP ranks
// (its W_k and W_v are pieces held by two ranks: ShardSpec::replicas).
TEST(CompressedTraining, ReplicatedParametersStayIdenticalOverTheTensorParallelGroup) {
  if (world().size() != 4) GTEST_SKIP() << "dp2 x tp2 needs 4 ranks";
  for (const bool llama : {false, true})
    for (const char* codec : {"int8", "onebit", "topk", "powersgd"})
      for (int zero : {0, 1, 2}) {
        if (!llama && zero == 2) continue;  // (GPT-2 at ZeRO 0-1, as before)
        io::RunConfig c = dp_run(codec, zero);
        c.parallel.dp = 2;
        c.parallel.tp = 2;
        c.parallel.sequence_parallel = true;
        if (llama)
          for (const char* set : {"model.family=llama", "model.n_kv_head=1", "model.ffn_hidden=64"})
            io::apply_override(c, set);
        EXPECT_EQ(mpitest::replicated_param_differing_over_tp(c, world(), 4), "")
            << (llama ? "llama " : "gpt2 ") << codec << " ZeRO-" << zero
            << ": this parameter differs between the TP ranks that hold it";
      }
}

// The padding of a bucket is not a gradient: a codec that decodes every
// position (onebit writes ±scale where there were zeros) must not feed what
// it left there into the next step. With C=40 every block's bucket ends in a
// codec block that mixes real values and padding; 100 steps of onebit with
// error feedback at ZeRO 0 keep the gradient norm within a few times the
// uncompressed run's and the loss falling (the padding, left in place, grew
// geometrically and blew the norm up).
TEST(CompressedTraining, PaddingNeverFeedsBack) {
  auto run = [](const std::string& codec) {
    io::RunConfig c = dp_run(codec, 0);
    c.model.n_embd = 40;
    c.train.steps = 100;
    return mpitest::train_run(c, world(), 100);
  };
  const mpitest::RunResult plain = run("none"), onebit = run("onebit");
  const double most = *std::max_element(plain.norms.begin(), plain.norms.end());
  for (size_t s = 0; s < onebit.norms.size(); s++)
    ASSERT_LT(onebit.norms[s], 5 * most) << "step " << s + 1 << " (uncompressed at most " << most << ")";
  EXPECT_LT(onebit.losses.back(), onebit.losses.front() - 0.5);
}

// Error feedback matters: on the bundled Moby-Dick tokens, a small model
// trained data-parallel for 60 steps with topk (1%) and onebit ends
// measurably worse without error feedback than with it (the mean loss of the
// last 10 steps higher by more than 0.05 nats; measured 0.10 for onebit); uncompressed
// training learns (its loss falls well below the start). This is the early
// regime: over 300 steps under AdamW the error-feedback runs end worse
// (docs/performance.md, "Gradient compression").
// The small model the Moby-Dick tests train at dp=2 (L=2 C=64 H=4, T=32, the
// GPT-2 vocabulary, micro-batches of 4, AdamW 3e-3 -> 3e-4), and the mean of
// a run's last 10 losses (less noisy than one).
io::RunConfig moby_run(const std::string& codec, int zero, int64_t steps, int64_t lr_warmup) {
  io::RunConfig c = dp_run(codec, zero);
  c.model.vocab_size = 50257;
  c.model.n_layer = 2;
  c.model.n_embd = 64;
  c.model.n_head = 4;
  c.model.seq_len = 32;
  c.train.micro_batch_size = 4;
  c.train.grad_accum_steps = 1;
  c.train.steps = steps;
  c.optim.lr = 3e-3;
  c.optim.min_lr = 3e-4;
  c.optim.warmup_steps = lr_warmup;
  c.data.train = std::string(LATTICE_SOURCE_DIR) + "/data/moby/train_*.bin";
  return c;
}

double last_ten(const mpitest::RunResult& r) {
  double tail = 0;
  for (size_t s = r.losses.size() - 10; s < r.losses.size(); s++) tail += r.losses[s] / 10;
  return tail;
}

TEST(CompressedTraining, ErrorFeedbackMatters) {
  if (world().size() != 2) GTEST_SKIP() << "run at dp=2";
  const std::string data = std::string(LATTICE_SOURCE_DIR) + "/data/moby/train_000000.bin";
  ASSERT_TRUE(std::filesystem::exists(data)) << data << " is missing: scripts/setup.sh tokenizes the bundled Moby-Dick";
  auto run = [](const std::string& codec, bool feedback) {
    io::RunConfig c = moby_run(codec, 1, 60, 5);
    c.compression.error_feedback = feedback;
    if (codec == "none") c.compression.error_feedback = true;
    const mpitest::RunResult r = mpitest::train_run(c, world(), 60);
    return std::make_pair(r.losses.front(), last_ten(r));
  };
  const auto [first, plain] = run("none", true);
  EXPECT_LT(plain, first - 1.0) << "uncompressed training learns";
  for (const char* codec : {"topk", "onebit"}) {
    const double with = run(codec, true).second, without = run(codec, false).second;
    if (world().rank() == 0)
      std::printf("[ error feedback ] %s: last-10 loss %.4f with, %.4f without (uncompressed %.4f)\n", codec, with,
                  without, plain);
    EXPECT_LT(with + 0.05, without) << codec << ": with error feedback " << with << ", without " << without
                                    << " (uncompressed " << plain << ")";
  }
}

// ---- 1-bit Adam (compression.momentum, data_parallel.h) ----

// The compression tests' run with 1-bit Adam after 3 ordinary steps. No
// clipping: past the warm-up the norm it clips by is the root mean square of
// the ranks' own gradient norms, which depends on how the batch is cut.
io::RunConfig onebit_adam_run(const std::string& codec, int zero, int dp) {
  io::RunConfig c = mpitest::compressed_run(codec, zero, dp);
  c.compression.momentum = true;
  c.compression.warmup_steps = 3;
  c.optim.grad_clip = 0;
  return c;
}

// The mean of the ranks' momenta is Adam's averaged momentum: with an exact
// reduction (codec none) 1-bit Adam trains the model of one process at every
// data-parallel degree and ZeRO stage 0-1 — losses and parameters to the
// equivalence tolerance — and over pipelines (the tied embedding's copies on
// two ranks, and on one under ZB-V).
// One process runs the same frozen-variance Adam. The norm past the warm-up is
// the root mean square of the ranks' norms: the one process's exact norm
// before it, at least that after.
TEST(OneBitAdam, ExactMomentumTrainsTheModelOfOneProcess) {
  comm::Communicator& all = world();
  const int n = all.size();
  io::RunConfig one = onebit_adam_run("none", 0, 1);
  one.train.grad_accum_steps = 2 * n;  // the same global batch
  const mpitest::RunResult want = mpitest::train_run(one, mpitest::self());
  // And not plain Adam: freezing v changes the run after the warm-up.
  io::RunConfig adam = one;
  adam.compression.momentum = false;
  adam.compression.warmup_steps = 0;
  const mpitest::RunResult plain = mpitest::train_run(adam, mpitest::self());
  for (size_t s = 0; s < 3; s++) EXPECT_EQ(plain.losses[s], want.losses[s]) << "warm-up step " << s + 1;
  EXPECT_GT(std::fabs(plain.losses.back() - want.losses.back()), 1e-4) << "v was not frozen";

  std::vector<std::pair<std::string, io::RunConfig>> layouts;
  for (int zero : {0, 1}) layouts.push_back({"dp=" + std::to_string(n) + " ZeRO-" + std::to_string(zero),
                                              onebit_adam_run("none", zero, n)});
  if (n == 4)
    for (int zero : {0, 1}) {
      io::RunConfig c = onebit_adam_run("none", zero, 2);
      c.parallel.pp = 2;
      c.train.grad_accum_steps = 4;  // 2 replicas x 4 micro-batches of 2: the same 16 sequences
      layouts.push_back({"dp=2 pp=2 ZeRO-" + std::to_string(zero), c});
    }

  for (const auto& [what, cfg] : layouts) {
    mpitest::RunResult got = mpitest::train_run(cfg, all);
    for (size_t s = 0; s < got.norms.size(); s++) {
      if (s < 3) {
        EXPECT_NEAR(got.norms[s], want.norms[s], 1e-4 * want.norms[s]) << what << " step " << s + 1;
      } else {
        EXPECT_GE(got.norms[s], want.norms[s] * (1 - 1e-5)) << what << " step " << s + 1;
      }
    }
    got.norms = want.norms;  // (checked above)
    mpitest::expect_same_run(got, want, what);
  }
  if (n == 2) {
    // ZB-V: rank 0 holds the first and the last stage, so both copies of the
    // tied embedding (one momentum formed and reduced, copied to the other);
    // four layers for its four chunks. One data-parallel rank: the norm is
    // the exact one too.
    io::RunConfig c = onebit_adam_run("none", 0, 1);
    c.model.n_layer = 4;
    c.train.grad_accum_steps = 4;
    const mpitest::RunResult alone = mpitest::train_run(c, mpitest::self());
    c.parallel.pp = 2;
    c.parallel.schedule = "zb-v";
    c.parallel.virtual_stages = 2;
    mpitest::expect_same_run(mpitest::train_run(c, all), alone, "pp=2 zb-v");
  }
}

// A checkpoint written in the momentum phase resumes it: how many updates
// the frozen v had seen comes from the checkpoint (the optimizer has taken
// more steps since), and each rank's momentum restarts from the saved m —
// which, over one rank, is that rank's own — so at dp=1 the resumed run is
// the uninterrupted one, bit for bit (clipping on: over one rank the phase's
// norm is the exact one). Each rank runs its own one-process job.
TEST(OneBitAdam, ResumesInTheMomentumPhase) {
  const std::filesystem::path dir =
      mpitest::shared_dir("lattice_compress_test", "resume") / ("rank" + std::to_string(world().rank()));
  std::filesystem::create_directories(dir);
  io::RunConfig c = onebit_adam_run("none", 0, 1);
  c.optim.grad_clip = 1.0;
  const mpitest::RunResult whole = mpitest::train_run(c, mpitest::self());
  mpitest::train_run(c, mpitest::self(), 6, dir.string());
  io::RunConfig resumed = c;
  resumed.checkpoint.resume = (dir / "step_000006").string();
  train::TrainerOptions o;
  o.print = false;
  o.ranks = &mpitest::self();
  train::Trainer t(resumed, o);
  ASSERT_EQ(t.step(), 6);
  for (size_t s = 6; s < whole.losses.size(); s++) {
    const train::StepStats st = t.train_step();
    EXPECT_EQ(st.loss, whole.losses[s]) << "step " << s + 1;
    EXPECT_EQ(st.grad_norm, whole.norms[s]) << "step " << s + 1;
  }
}

// With a codec: every rank's parameters identical bit for bit, the bytes of
// the momentum reductions exactly the codec's share of f32's (ZeRO 0: both
// halves of the all-reduce compressed; ZeRO 1: the reduce-scatter), f32 bytes
// during the warm-up, and the run close to the exact one (bf16: its rounding;
// the others: their loss falling at least 30% as far as the exact run's — a
// codec decoding zeros leaves m at zero and learns nothing past the warm-up;
// measured 42% and more; topk at 10%, as 1% sends a hundredth of the momentum
// a step and 7 steps are few).
TEST(OneBitAdam, CodecsKeepTheReplicasIdenticalAtTheirShareOfTheBytes) {
  comm::Communicator& all = world();
  for (int zero : {0, 1}) {
    const mpitest::RunResult exact = mpitest::train_run(onebit_adam_run("none", zero, all.size()), all);
    for (const char* codec : {"bf16", "int8", "onebit", "topk"}) {
      const std::string what = std::string(codec) + " ZeRO-" + std::to_string(zero);
      train::TrainerOptions o;
      o.print = false;
      o.ranks = &all;
      io::RunConfig cfg = onebit_adam_run(codec, zero, all.size());
      if (std::string(codec) == "topk") cfg.compression.topk_ratio = 0.1;
      train::Trainer t(cfg, o);
      mpitest::RunResult got;
      double sent = 0, uncompressed = 0;
      for (int s = 0; s < 10; s++) {
        const train::StepStats st = t.train_step();
        got.losses.push_back(st.loss);
        if (s < 3) {
          EXPECT_EQ(st.grad_bytes, st.grad_bytes_uncompressed) << what << " warm-up step " << s + 1;
        } else {
          sent += static_cast<double>(st.grad_bytes);
          uncompressed += static_cast<double>(st.grad_bytes_uncompressed);
        }
      }
      for (const train::HfTensor& p : t.full_tensors())
        ASSERT_EQ(first_differing_rank(all, p.data), -1) << what << ": " << p.name << " differs on that rank";
      const double share = sent / uncompressed;
      EXPECT_LE(share, max_share(codec, cfg.compression.topk_ratio) + 1e-9) << what;
      EXPECT_GT(share, 0.0) << what;
      if (std::string(codec) == "bf16") {
        for (size_t s = 0; s < got.losses.size(); s++)
          EXPECT_NEAR(got.losses[s], exact.losses[s], 2e-3 * exact.losses[s]) << what << " step " << s + 1;
      } else {
        EXPECT_GE(got.losses.front() - got.losses.back(), 0.3 * (exact.losses.front() - exact.losses.back()))
            << what << ": loss " << got.losses.front() << " -> " << got.losses.back() << ", exact "
            << exact.losses.front() << " -> " << exact.losses.back();
      }
    }
  }
}

// Under tensor parallelism a codec block mixes replicated parameters with
// slices: the averaged momentum of the replicated ones is made alike over
// the TP group (average_replicated_grads on the momentum), or the copies drift.
TEST(OneBitAdam, ReplicatedParametersStayIdenticalOverTheTensorParallelGroup) {
  if (world().size() != 4) GTEST_SKIP() << "dp2 x tp2 needs 4 ranks";
  for (const char* codec : {"onebit", "topk"})
    for (int zero : {0, 1}) {
      io::RunConfig c = onebit_adam_run(codec, zero, 2);
      c.parallel.tp = 2;
      c.parallel.sequence_parallel = true;
      EXPECT_EQ(mpitest::replicated_param_differing_over_tp(c, world(), 6), "")
          << codec << " ZeRO-" << zero << ": this parameter differs between the TP ranks that hold it";
    }
}

// What 1-bit Adam is for: on the bundled Moby-Dick tokens (the
// ErrorFeedbackMatters model, 120 steps at dp=2, 20 ordinary steps first
// either way, error feedback on), onebit on the momentum ends within 3% of
// uncompressed training and below onebit on the gradient (the mean loss of
// the last 10 steps; measured +0.13% and +0.80%). topk (1%) is printed, not
// held to it: on the momentum it ends above topk on the gradient here (+3.03%
// against +1.90%), as on the demo (docs/performance.md).
TEST(OneBitAdam, OneBitOnTheMomentumEndsCloseToUncompressed) {
  if (world().size() != 2) GTEST_SKIP() << "run at dp=2";
  auto run = [](const std::string& codec, bool momentum) {
    io::RunConfig c = moby_run(codec, 0, 120, 10);
    if (codec != "none") c.compression.warmup_steps = 20;  // both ways alike
    c.compression.momentum = momentum;
    return last_ten(mpitest::train_run(c, world(), 120));
  };
  const double plain = run("none", false);
  for (const char* codec : {"onebit", "topk"}) {
    const double gradient = run(codec, false), momentum = run(codec, true);
    if (world().rank() == 0)
      std::printf("[ 1-bit Adam ] %s: last-10 loss %.4f on the momentum, %.4f on the gradient (uncompressed %.4f)\n",
                  codec, momentum, gradient, plain);
    if (std::string(codec) != "onebit") continue;
    EXPECT_LT(momentum, 1.03 * plain) << codec << " on the momentum";
    EXPECT_LT(momentum, gradient) << codec << ": on the momentum " << momentum << ", on the gradient " << gradient;
  }
}

}  // namespace
