// PowerSGD under mpiexec (2 and 4 ranks, label mpi; compress/powersgd.h):
// a matrix sum of rank r comes back exact, bit-identical on every rank,
// landing where the chunk operations put the sum; the bytes sent are the
// two all-reduces of Σ r(m+n) (+ the exact values), checked against that
// formula on GPT-2's block shapes; error feedback makes repeated
// reductions' mean exact; and through the trainer every ZeRO stage (and
// pipelines, and tensor parallelism) trains close to the f32 run with
// identical replicas.
#include "lattice/parallel/compress/powersgd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "equivalence.h"
#include "lattice/core/error.h"
#include "lattice/core/threads.h"
#include "lattice/parallel/compress/gradient_reducer.h"
#include "lattice/comm/comm_stream.h"
#include "lattice/train/trainer.h"
#include "mpi_ranks.h"

using namespace lattice;
using namespace lattice::parallel;

namespace {

using mpitest::first_differing_rank;
using mpitest::world;

const bool kOneThread = (set_num_threads(1), true);

std::vector<float> normal(size_t n, unsigned seed, float std = 1e-3f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, std);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

model::ParamInfo param(const std::string& name, std::vector<int64_t> shape) {
  model::ParamInfo p;
  p.name = name;
  p.full_shape = std::move(shape);
  return p;
}

// A transformer block's parameters at width C (GPT-2: 768), in the model's order.
model::ParamGroup block(int64_t C) {
  model::ParamGroup g("h.0");
  g.add(param("ln_1.weight", {C}));
  g.add(param("ln_1.bias", {C}));
  g.add(param("attn.c_attn.weight", {3 * C, C}));
  g.add(param("attn.c_attn.bias", {3 * C}));
  g.add(param("attn.c_proj.weight", {C, C}));
  g.add(param("attn.c_proj.bias", {C}));
  g.add(param("ln_2.weight", {C}));
  g.add(param("ln_2.bias", {C}));
  g.add(param("mlp.c_fc.weight", {4 * C, C}));
  g.add(param("mlp.c_fc.bias", {4 * C}));
  g.add(param("mlp.c_proj.weight", {C, 4 * C}));
  g.add(param("mlp.c_proj.bias", {C}));
  return g;
}

// One chunk of n·k floats holding `extent` (k a multiple of 16, as ShardLayout's).
int64_t slice_for(int64_t extent, int n) { return ((extent + n - 1) / n + 15) / 16 * 16; }

// What this rank sends in a ring all-reduce of `count` floats (communicator.h's accounting).
uint64_t ring_all_reduce_bytes(uint64_t count, int n, int r) {
  if (n == 1 || count == 0) return 0;
  auto block = [&](int j) { return 4 * (count / n + (static_cast<uint64_t>(j) < count % n ? 1 : 0)); };
  return (4 * count - block(r)) + (4 * count - block((r + 1) % n));
}

CompressionOptions powersgd(int64_t rank, bool feedback = true) {
  CompressionOptions o;
  o.spec.codec = GradCodec::PowerSgd;
  o.spec.powersgd_rank = rank;
  o.error_feedback = feedback;
  return o;
}

// Rank w's gradient: a matrix U_w Vᵀ of rank r with V shared, so the sum
// over ranks (Σ U_w) Vᵀ has rank r too; the rest (biases, a 4×4 matrix too
// small to gain) random. PowerSGD gives the sum back to f32 rounding, on the
// first step (a drawn Q) and on the next ones (warm start, error ~0), and
// leaves the exact part the plain sum; every rank holds the same floats.
TEST(PowerSgd, RankRSumComesBackExactOnEveryRank) {
  comm::Communicator& c = world();
  const int n = c.size();
  const int64_t r = 4, m = 48, cols = 40;
  model::ParamGroup g("test");
  g.add(param("w", {m, cols}));
  g.add(param("b", {cols}));
  g.add(param("small", {4, 4}));
  const LowRankLayout layout = lowrank_layout(g, r);
  ASSERT_EQ(layout.matrices.size(), 1u);
  EXPECT_EQ(layout.matrices[0].rows, m);
  EXPECT_EQ(layout.matrices[0].cols, cols);
  EXPECT_EQ(layout.exact_floats(), cols + 16);  // b and small (each 16-aligned: two spans)
  const int64_t k = slice_for(g.numel(), n);

  const std::vector<float> V = normal(static_cast<size_t>(cols * r), 11, 1.0f);
  const std::vector<float> U = normal(static_cast<size_t>(m * r), 20 + c.rank(), 1.0f);
  std::vector<float> mine(static_cast<size_t>(n * k), 0.0f);
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < cols; j++) {
      float x = 0;
      for (int64_t q = 0; q < r; q++) x += U[i * r + q] * V[j * r + q];
      mine[i * cols + j] = x;
    }
  for (const LowRankLayout::Span& s : layout.exact) {
    const std::vector<float> rest = normal(static_cast<size_t>(s.n), 30 + c.rank() + static_cast<unsigned>(s.offset));
    std::copy(rest.begin(), rest.end(), mine.begin() + s.offset);
  }
  std::vector<float> exact = mine;
  c.all_reduce(exact.data(), exact.size(), DType::F32, comm::ReduceOp::Sum);
  double largest = 0;
  for (int64_t i = 0; i < m * cols; i++) largest = std::max(largest, std::fabs(static_cast<double>(exact[i])));

  for (bool feedback : {true, false}) {
    comm::CommStream stream(c, comm::Progress::Thread);
    GradientReducer reducer(stream, powersgd(r, feedback));
    for (int step = 0; step < 3; step++) {
      reducer.begin_step(step);
      ASSERT_TRUE(reducer.lowrank());
      std::vector<float> got = mine;
      stream.wait(reducer.all_reduce_lowrank(7, got.data(), layout, 1, k, "test"));
      const std::string what = std::string(feedback ? "with" : "without") + " EF, step " + std::to_string(step);
      ASSERT_EQ(first_differing_rank(c, got), -1) << what;
      for (int64_t i = 0; i < m * cols; i++) ASSERT_NEAR(got[i], exact[i], 2e-5 * largest) << what << " at " << i;
      for (const LowRankLayout::Span& s : layout.exact)
        for (int64_t i = s.offset; i < s.offset + s.n; i++) ASSERT_NEAR(got[i], exact[i], 1e-9) << what;
      for (size_t i = static_cast<size_t>(layout.extent); i < got.size(); i++) ASSERT_EQ(got[i], 0.0f) << "padding";
    }
    // The state: the matrix's Q (cols × r), and with error feedback an error over the layout.
    const size_t q_bytes = static_cast<size_t>(cols * r) * sizeof(float);
    EXPECT_EQ(reducer.error_bytes(), q_bytes + (feedback ? static_cast<size_t>(layout.extent) * sizeof(float) : 0));
  }
}

// The reduce-scatter form leaves in dst exactly the all-reduce form's slices
// (copied, or added), and the chunk operations refuse a PowerSGD reducer.
TEST(PowerSgd, ReduceScatterPlacesTheAllReducesSlices) {
  comm::Communicator& c = world();
  const int n = c.size();
  const model::ParamGroup g = block(32);
  const LowRankLayout layout = lowrank_layout(g, 2);
  const int64_t chunks = 3, k = slice_for((g.numel() + chunks - 1) / chunks, n);
  const std::vector<float> mine = [&] {
    std::vector<float> v = normal(static_cast<size_t>(chunks * n * k), 50 + c.rank());
    std::fill(v.begin() + layout.extent, v.end(), 0.0f);
    return v;
  }();
  comm::CommStream stream(c, comm::Progress::Thread);
  GradientReducer whole(stream, powersgd(2)), scatter(stream, powersgd(2)), added(stream, powersgd(2));
  for (GradientReducer* red : {&whole, &scatter, &added}) red->begin_step(0);
  std::vector<float> all = mine, chunk = mine, chunk2 = mine;
  std::vector<float> dst(static_cast<size_t>(chunks * k), -1.0f), acc(static_cast<size_t>(chunks * k), 1.0f);
  whole.all_reduce_lowrank(3, all.data(), layout, chunks, k, "all");
  scatter.reduce_scatter_lowrank(3, chunk.data(), layout, chunks, k, dst.data(), k, false, "scatter");
  added.reduce_scatter_lowrank(3, chunk2.data(), layout, chunks, k, acc.data(), k, true, "added");
  stream.wait_all();
  for (int64_t ch = 0; ch < chunks; ch++)
    for (int64_t i = 0; i < k; i++) {
      const float want = all[ch * n * k + c.rank() * k + i];
      ASSERT_EQ(dst[ch * k + i], want) << "chunk " << ch << " element " << i;
      ASSERT_EQ(acc[ch * k + i], 1.0f + want) << "chunk " << ch << " element " << i;
    }
  EXPECT_EQ(scatter.bytes().sent, whole.bytes().sent);
  EXPECT_EQ(scatter.bytes().uncompressed * 2, whole.bytes().uncompressed);  // against a reduce-scatter: half
  std::vector<float> plain = mine;
  EXPECT_THROW(stream.wait(whole.all_reduce(GradientReducer::key(1, 0), plain.data(), k, "chunk")), Error);
}

// Bytes: the P all-reduce carries Σ r·m plus the exact values, the Q one
// Σ r·n, each at the Communicator's ring cost; uncompressed is the f32
// all-reduce of the whole buffer. On GPT-2's block (C = 768) at r = 4 that is
// (Σ r(m+n) + biases and LayerNorms) / (the block, padded): 0.83%, and the
// matrices alone Σ r(m+n)/Σ mn; an embedding chunk of 682 rows of 768 sends
// r(682+768)/(682·768).
TEST(PowerSgd, BytesAreTheTwoAllReducesOfTheFactors) {
  comm::Communicator& c = world();
  const int n = c.size();
  const int64_t r = 4;
  const model::ParamGroup g = block(768);
  const LowRankLayout layout = lowrank_layout(g, r);
  ASSERT_EQ(layout.matrices.size(), 4u);  // the four weights; biases and LayerNorms exact
  int64_t factors = 0, mn = 0;
  for (const LowRankLayout::Matrix& m : layout.matrices) factors += r * (m.rows + m.cols), mn += m.rows * m.cols;
  EXPECT_EQ(factors, layout.p_floats() + layout.q_floats());
  EXPECT_EQ(layout.exact_floats(), 9984);  // 4 x 768 (LayerNorms) + 2304 + 768 + 3072 + 768 (biases)
  const int64_t k = slice_for(layout.extent, n);
  std::vector<float> grad = normal(static_cast<size_t>(n * k), 60 + c.rank());
  std::fill(grad.begin() + layout.extent, grad.end(), 0.0f);
  comm::CommStream stream(c, comm::Progress::Thread);
  GradientReducer reducer(stream, powersgd(r));
  reducer.begin_step(0);
  stream.wait(reducer.all_reduce_lowrank(1, grad.data(), layout, 1, k, "block"));
  const GradientReducer::Bytes b = reducer.bytes();
  const uint64_t want =
      ring_all_reduce_bytes(static_cast<uint64_t>(layout.p_floats() + layout.exact_floats()), n, c.rank()) +
      ring_all_reduce_bytes(static_cast<uint64_t>(layout.q_floats()), n, c.rank());
  EXPECT_EQ(b.sent, want);
  EXPECT_EQ(b.uncompressed, 2ull * (n - 1) * static_cast<uint64_t>(k) * 4);
  const double share = static_cast<double>(b.sent) / static_cast<double>(b.uncompressed);
  const double formula = static_cast<double>(factors + layout.exact_floats()) / static_cast<double>(n * k);
  EXPECT_NEAR(share, formula, 1e-5);  // the ring's blocks round to whole floats
  const double matrices = static_cast<double>(factors) / static_cast<double>(mn);
  EXPECT_NEAR(matrices, 49152.0 / 7077888.0, 1e-12);  // 4(3072 + 1536 + 3840 + 3840) / Σ mn: 1/144
  EXPECT_LT(share, 0.0084);
  const double embedding = 4.0 * (682 + 768) / (682.0 * 768.0);
  const LowRankLayout chunk = lowrank_rows({{0, 682}}, 768, r);
  EXPECT_EQ(chunk.p_floats() + chunk.q_floats(), 4 * (682 + 768));
  if (c.rank() == 0)
    std::printf("[ powersgd r=4 ] GPT-2 block: %.5f of f32 sent (matrices alone %.5f); embedding chunk 682x768: %.5f\n",
                share, matrices, embedding);
}

// Error feedback: the same full-rank gradients reduced 60 times at r = 2;
// with it the mean of what was delivered approaches the exact sum (what one
// step drops is delivered later), without it each step gives the same
// rank-2 projection and the mean stays off by the dropped spectrum.
TEST(PowerSgd, ErrorFeedbackMakesTheMeanExact) {
  comm::Communicator& c = world();
  const int n = c.size();
  const int64_t rows = 24, cols = 16;
  const LowRankLayout layout = lowrank_rows({{0, rows}}, cols, 2);
  const int64_t k = slice_for(rows * cols, n);
  std::vector<float> mine = normal(static_cast<size_t>(n * k), 70 + c.rank());
  std::fill(mine.begin() + rows * cols, mine.end(), 0.0f);
  std::vector<float> exact = mine;
  c.all_reduce(exact.data(), exact.size(), DType::F32, comm::ReduceOp::Sum);
  double err[2] = {0, 0};
  for (bool feedback : {true, false}) {
    comm::CommStream stream(c, comm::Progress::Inline);
    GradientReducer reducer(stream, powersgd(2, feedback));
    reducer.begin_step(0);
    const int T = 60;
    std::vector<double> mean(static_cast<size_t>(rows * cols), 0.0);
    for (int t = 0; t < T; t++) {
      std::vector<float> got = mine;
      stream.wait(reducer.all_reduce_lowrank(9, got.data(), layout, 1, k, "ef"));
      for (int64_t i = 0; i < rows * cols; i++) mean[i] += got[i] / T;
    }
    double num = 0, den = 0;
    for (int64_t i = 0; i < rows * cols; i++) num += std::pow(mean[i] - exact[i], 2), den += std::pow(exact[i], 2);
    err[feedback ? 0 : 1] = std::sqrt(num / den);
  }
  if (c.rank() == 0) std::printf("[ powersgd EF ] mean's relative error: %.4f with, %.4f without\n", err[0], err[1]);
  EXPECT_LT(err[0], 0.2) << "relative error of the mean with error feedback";
  EXPECT_GT(err[1], 0.5) << "without error feedback a rank-2 projection of a random 24x16 matrix";
  EXPECT_LT(err[0], 0.5 * err[1]) << "with " << err[0] << ", without " << err[1];
}

// ---- through the trainer ----

io::RunConfig dp_run(const std::string& codec, int zero) {
  return mpitest::compressed_run(codec, zero, world().size());
}

struct Trained {
  mpitest::RunResult run;
  double sent = 0, uncompressed = 0;
};

Trained train(const io::RunConfig& cfg, comm::Communicator& ranks) {
  train::TrainerOptions o;
  o.print = false;
  o.ranks = &ranks;
  train::Trainer t(cfg, o);
  Trained r;
  for (int s = 0; s < cfg.train.steps; s++) {
    const train::StepStats st = t.train_step();
    r.run.losses.push_back(st.loss);
    r.run.norms.push_back(st.grad_norm);
    r.sent += static_cast<double>(st.grad_bytes);
    r.uncompressed += static_cast<double>(st.grad_bytes_uncompressed);
  }
  r.run.params = t.full_tensors();
  return r;
}

// Rank 4 of the test model's 32-wide matrices is lossy: the losses stay
// within 5% of the f32 run's over 10 steps (measured at most 2% at dp=2, 4% at dp=4).
constexpr double kTolerance = 0.05;

void expect_close_and_identical(const Trained& got, const mpitest::RunResult& plain, comm::Communicator& ranks,
                                double tolerance, const std::string& what) {
  for (const train::HfTensor& p : got.run.params)
    ASSERT_EQ(first_differing_rank(ranks, p.data), -1) << what << ": " << p.name << " differs on that rank";
  ASSERT_EQ(got.run.losses.size(), plain.losses.size());
  for (size_t s = 0; s < plain.losses.size(); s++) {
    ASSERT_TRUE(std::isfinite(got.run.losses[s])) << what << " step " << s + 1;
    EXPECT_NEAR(got.run.losses[s], plain.losses[s], tolerance * std::fabs(plain.losses[s]))
        << what << " step " << s + 1;
  }
  // It learns: at least half the f32 run's drop in loss.
  EXPECT_LT(got.run.losses.back(), got.run.losses.front() - 0.5 * (plain.losses.front() - plain.losses.back())) << what;
  EXPECT_GT(got.sent, 0) << what;
  EXPECT_LT(got.sent, got.uncompressed) << what;
}

// Every ZeRO stage trains with PowerSGD at rank 4: the replicas bit-identical,
// the losses close to the f32 run's, fewer bytes; error feedback is wired
// (off, the run differs), and the warm-up steps are the uncompressed run's.
TEST(PowerSgdTraining, EveryZeroStage) {
  comm::Communicator& all = world();
  for (int zero : {0, 1, 2, 3}) {
    const std::string what = "powersgd ZeRO-" + std::to_string(zero);
    const mpitest::RunResult plain = mpitest::train_run(dp_run("none", zero), all);
    const Trained got = train(dp_run("powersgd", zero), all);
    expect_close_and_identical(got, plain, all, kTolerance, what);
    if (all.rank() == 0)
      std::printf("[ powersgd ] ZeRO-%d: step 10 loss %.5f (f32 %.5f), %.4f of the bytes\n", zero,
                  got.run.losses.back(), plain.losses.back(), got.sent / got.uncompressed);
    io::RunConfig off = dp_run("powersgd", zero);
    off.compression.error_feedback = false;
    const Trained without = train(off, all);
    EXPECT_FALSE(mpitest::same_params(without.run, got.run)) << what << ": error feedback changes nothing";
    // ... and on this run it helps (rank 4 of 32-wide matrices; measured 4.370 with, 4.473 without at ZeRO 0
    // against 4.286 uncompressed).
    EXPECT_LT(std::fabs(got.run.losses.back() - plain.losses.back()),
              std::fabs(without.run.losses.back() - plain.losses.back()))
        << what << ": the last loss with error feedback " << got.run.losses.back() << ", without "
        << without.run.losses.back() << ", uncompressed " << plain.losses.back();
    if (zero == 0) {
      io::RunConfig warm = dp_run("powersgd", zero);
      warm.compression.warmup_steps = 3;
      const Trained w = train(warm, all);
      for (size_t s = 0; s < 4; s++) EXPECT_EQ(w.run.losses[s], plain.losses[s]) << "warm-up, step " << s + 1;
      EXPECT_NE(w.run.losses[4], plain.losses[4]) << "compressed from step 4 on";
    }
  }
}

// Over pipelines (the data-parallel engine over stages, dp2 x pp2, ZeRO 0 and 2) and with
// tensor parallelism (dp2 x tp2, local slices' shapes): the same.
TEST(PowerSgdTraining, WithPipelinesAndTensorParallelism) {
  if (world().size() != 4) GTEST_SKIP() << "dp2 x pp2 and dp2 x tp2 need 4 ranks";
  for (int zero : {0, 2}) {
    io::RunConfig c = dp_run("none", zero);
    c.parallel.dp = 2;
    c.parallel.pp = 2;
    c.train.grad_accum_steps = 2;
    const mpitest::RunResult plain = mpitest::train_run(c, world());
    c.compression.grad = "powersgd";
    expect_close_and_identical(train(c, world()), plain, world(), kTolerance, "dp2 x pp2 ZeRO-" + std::to_string(zero));
  }
  for (int zero : {0, 3}) {
    io::RunConfig c = dp_run("none", zero);
    c.parallel.dp = 2;
    c.parallel.tp = 2;
    const mpitest::RunResult plain = mpitest::train_run(c, world());
    c.compression.grad = "powersgd";
    expect_close_and_identical(train(c, world()), plain, world(), kTolerance, "dp2 x tp2 ZeRO-" + std::to_string(zero));
  }
}

// Bad settings are refused by name.
TEST(PowerSgdTraining, BadSettings) {
  auto error_of = [](const io::RunConfig& c) -> std::string {
    try {
      train::TrainerOptions o;
      o.print = false;
      o.ranks = &world();
      train::Trainer t(c, o);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  io::RunConfig c = dp_run("int8", 0);
  c.compression.rank = 8;
  EXPECT_EQ(error_of(c), "compression.rank applies to compression.grad=\"powersgd\" (it is \"int8\")");
  c = dp_run("powersgd", 0);
  c.compression.rank = 0;
  EXPECT_NE(error_of(c).find("compression.rank must be an integer >= 1, got 0"), std::string::npos) << error_of(c);
}

}  // namespace
