// Context parallelism (label mpi, run on 2 and 4 ranks): the ring and
// all-to-all attention against one process's attention over the whole
// sequence, the balanced split's work per ring step from the counters (and
// the contiguous split's imbalance as the contrast), the bytes of each mode
// against its formula exactly, the loss and gradient norm reported exactly
// once over the right groups, and the bad-input messages. Equivalence of
// whole training runs under every composition is in the layout matrix.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "../model/activation_formulas.h"
#include "equivalence.h"
#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "lattice/core/memory.h"
#include "lattice/layers/context/context_parallel.h"
#include "lattice/model/gpt.h"
#include "lattice/model/recompute.h"
#include "mpi_ranks.h"

using namespace lattice;
using context::ContextParallel;
using context::HeadShape;
using context::Mode;
using mpitest::world;

namespace {

std::vector<float> random_values(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

// This rank's rows of a [B, T, width] array (its chunks, in local order).
std::vector<float> local_rows(const std::vector<float>& full, const ContextParallel& cp, int B, int T, int64_t width) {
  const int Tl = T / cp.size();
  std::vector<float> out(static_cast<size_t>(B) * Tl * width);
  for (int b = 0; b < B; b++)
    for (int t = 0; t < Tl; t++)
      std::memcpy(out.data() + (static_cast<int64_t>(b) * Tl + t) * width,
                  full.data() + (static_cast<int64_t>(b) * T + cp.position(t, Tl)) * width, sizeof(float) * width);
  return out;
}

double worst_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); i++) worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
  return worst;
}

struct Case {
  int NH, NKV, hs, c;    // c: tokens per chunk
  float scale = 1.0f;    // of the random Q/K/V: 30 makes log-sum-exps of hundreds, where exp overflows f32
};

// The whole job is one cp group (2 or 4 ranks).
TEST(ContextParallel, AttendsOverTheWholeSequenceAsOneProcess) {
  comm::Communicator& group = world();
  const int n = group.size(), B = 2;
  for (Mode mode : {Mode::Ring, Mode::AllToAll}) {
    for (const Case k : {Case{4, 4, 8, 5}, Case{4, 2, 8, 7}, Case{8, 4, 4, 3}, Case{4, 1, 8, 4}, Case{4, 2, 8, 5, 30}}) {
      const HeadShape s{k.NH, k.NKV, k.hs};
      if (mode == Mode::AllToAll && (k.NH % n || k.NKV % n)) continue;  // refused (below)
      ContextParallel cp(group, mode);
      const int T = 2 * n * k.c, Tl = T / n;
      const std::string what = std::string(context::name_of(mode)) + " NH=" + std::to_string(k.NH) +
                               " NKV=" + std::to_string(k.NKV) + " T=" + std::to_string(T) +
                               " scale=" + std::to_string(k.scale);
      // One process: the causal kernel over the whole sequence.
      const std::vector<float> qkv = random_values(static_cast<size_t>(B) * T * s.QKV(), 11, k.scale);
      const std::vector<float> dout = random_values(static_cast<size_t>(B) * T * s.A(), 12);
      std::vector<float> out(static_cast<size_t>(B) * T * s.A()), lse(static_cast<size_t>(B) * k.NH * T),
          dqkv(qkv.size());
      kernels::attention_forward(out.data(), lse.data(), qkv.data(), B, T, k.NH, k.NKV, k.hs);
      kernels::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, k.NH, k.NKV,
                                  k.hs);
      // Context parallel: this rank's rows.
      std::vector<float> my_qkv = local_rows(qkv, cp, B, T, s.QKV());
      const std::vector<float> my_dout = local_rows(dout, cp, B, T, s.A());
      std::vector<float> my_out(static_cast<size_t>(B) * Tl * s.A()), my_lse(static_cast<size_t>(B) * k.NH * Tl),
          heads_out(my_out.size()), my_dqkv(my_qkv.size());
      cp.forward(my_out.data(), my_lse.data(), my_qkv.data(), heads_out.data(), B, Tl, s);
      cp.backward(my_dqkv.data(), my_dout.data(), my_qkv.data(), my_out.data(), my_lse.data(), heads_out.data(), B,
                  Tl, s);
      const std::vector<float> want_out = local_rows(out, cp, B, T, s.A());
      const std::vector<float> want_dqkv = local_rows(dqkv, cp, B, T, s.QKV());
      if (mode == Mode::AllToAll) {
        // Each head by the same kernel on the same rows as one process: bitwise.
        EXPECT_EQ(my_out, want_out) << what;
        EXPECT_EQ(my_dqkv, want_dqkv) << what;
      } else {
        // Relative to the values' size. The scaled case's lse are hundreds,
        // where a naive log(exp(a) + exp(b)) merge overflows to inf/NaN; f32's
        // lse there is only good to ~3e-5 absolute (its ulp at 500), which
        // the output inherits, so it is held to 1e-4 relative: still far
        // below any wrong merge (whole blocks missing or mis-weighted).
        const double tol_out = k.scale > 1 ? 1e-4 : 2e-6, tol_grad = k.scale > 1 ? 1e-4 : 1e-5;
        for (float v : my_out) ASSERT_TRUE(std::isfinite(v)) << what;
        EXPECT_LT(worst_difference(my_out, want_out) / k.scale, tol_out) << what;
        EXPECT_LT(worst_difference(my_dqkv, want_dqkv) / (k.scale * k.scale), tol_grad) << what;
        // lse of this rank's rows: [B, NH, Tl] against [B, NH, T].
        double worst = 0;
        for (int bh = 0; bh < B * k.NH; bh++)
          for (int t = 0; t < Tl; t++)
            worst = std::max(worst, std::fabs(static_cast<double>(my_lse[bh * Tl + t]) - lse[bh * T + cp.position(t, Tl)]) /
                                        std::max(1.0, std::fabs(static_cast<double>(lse[bh * T + cp.position(t, Tl)]))));
        EXPECT_LT(worst, 2e-6) << what;
        if (k.scale > 1) {
          float most = 0;
          for (float v : lse) most = std::max(most, v);
          EXPECT_GT(most, 100.0f) << what << ": the scaled case does not reach large log-sum-exps";
        }
      }
    }
  }
}

// Work per ring step, from the counters: every rank computes the same number
// of scores at every step with the balanced split. The contiguous split
// (rank r holding tokens [r·T/cp, (r+1)·T/cp)) is the contrast: the last
// rank does (2cp−1)/cp times the mean work.
TEST(ContextParallel, BalancedSplitGivesEveryRankTheSameWorkAtEveryStep) {
  comm::Communicator& group = world();
  const int n = group.size(), B = 2, c = 6;
  const HeadShape s{4, 2, 8};
  ContextParallel cp(group, Mode::Ring);
  const int Tl = 2 * c;
  std::vector<float> qkv = random_values(static_cast<size_t>(B) * Tl * s.QKV(), 3 + group.rank());
  std::vector<float> out(static_cast<size_t>(B) * Tl * s.A()), lse(static_cast<size_t>(B) * s.NH * Tl);
  cp.forward(out.data(), lse.data(), qkv.data(), nullptr, B, Tl, s);
  ASSERT_EQ(cp.step_scores().size(), static_cast<size_t>(n));
  std::vector<double> mine(cp.step_scores().begin(), cp.step_scores().end()), all(mine.size() * n);
  group.all_gather(mine.data(), all.data(), mine.size(), DType::F64);
  for (int step = 0; step < n; step++) {
    double most = 0, sum = 0;
    for (int r = 0; r < n; r++) most = std::max(most, all[r * n + step]), sum += all[r * n + step];
    EXPECT_GT(most, 0);
    EXPECT_EQ(most / (sum / n), 1.0) << "ring step " << step << ": max/mean of the scores computed";
    if (group.rank() == 0)
      std::printf("[ cp=%d ] step %d: scores per rank %.0f, max/mean %.3f\n", n, step, most, most / (sum / n));
  }
  // The counters are the pairs' scores: the same function, under the contiguous split.
  double most = 0, sum = 0;
  for (int r = 0; r < n; r++) {
    double total = 0;
    for (int step = 0; step < n; step++)
      for (const context::BlockPair& p : context::ring_step_pairs(n, r, step, context::Split::Contiguous))
        total += static_cast<double>(context::pair_scores(p, c)) * B * s.NH;
    most = std::max(most, total), sum += total;
  }
  const double contiguous = most / (sum / n), want = (2.0 * n - 1) / n;
  if (group.rank() == 0)
    std::printf("[ cp=%d ] contiguous split: max/mean work %.3f ((2cp-1)/cp = %.3f, the diagonal's halves aside)\n", n,
                contiguous, want);
  EXPECT_NEAR(contiguous, want, 1.0 / c);
  EXPECT_GT(contiguous, 1.0 + 0.5 / n);
}

// Bytes each rank sends per layer (forward + backward), in elements of f32:
//   ring        2·b·s·h_kv·(2(cp−1)/cp + 1)
//   all_to_all  2·(2h + 2h_kv)·b·s·(cp−1)/cp²
TEST(ContextParallel, BytesPerLayerEqualTheFormula) {
  comm::Communicator& group = world();
  const int n = group.size(), B = 2, c = 4, T = 2 * n * c, Tl = T / n;
  const HeadShape s{4 * n, 2 * n, 8};  // whole heads for all-to-all at any cp here
  const double b = B, h = static_cast<double>(s.A()), h_kv = static_cast<double>(s.KV());
  for (Mode mode : {Mode::Ring, Mode::AllToAll}) {
    ContextParallel cp(group, mode);
    std::vector<float> qkv = random_values(static_cast<size_t>(B) * Tl * s.QKV(), 5);
    std::vector<float> dout = random_values(static_cast<size_t>(B) * Tl * s.A(), 6);
    std::vector<float> out(dout.size()), lse(static_cast<size_t>(B) * s.NH * Tl), heads(out.size()), dqkv(qkv.size());
    group.reset_stats();
    cp.forward(out.data(), lse.data(), qkv.data(), heads.data(), B, Tl, s);
    cp.backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), heads.data(), B, Tl, s);
    const double elements = mode == Mode::Ring ? 2 * b * T * h_kv * (2.0 * (n - 1) / n + 1)
                                               : 2 * (2 * h + 2 * h_kv) * b * T * (n - 1) / (n * n);
    EXPECT_EQ(static_cast<double>(group.stats().bytes_sent), 4 * elements) << context::name_of(mode);
    if (group.rank() == 0)
      std::printf("[ cp=%d ] %s: %llu bytes per rank per layer (formula %.0f)\n", n, context::name_of(mode),
                  static_cast<unsigned long long>(group.stats().bytes_sent), 4 * elements);
  }
}

// The scale bugs of context parallelism (a loss or gradient counted cp times,
// or averaged over the wrong group) show in the first step: its loss and
// gradient norm are those of one process on the same global batch, and the
// same for dp, dp×cp and cp over the same ranks.
TEST(ContextParallel, LossAndNormAreReducedOverTheRightGroupsOnce) {
  const int n = world().size();
  io::RunConfig base = mpitest::parity_recipe();
  base.train.micro_batch_size = 1;
  base.train.global_batch_size = 4;
  base.model.seq_len = 16;
  const mpitest::RunResult one = mpitest::train_run(base, mpitest::self(), 2);
  std::vector<std::string> layouts = {"dp=" + std::to_string(n), "cp=" + std::to_string(n)};
  if (n == 4) layouts.push_back("dp=2 cp=2");
  for (const std::string& layout : layouts)
    for (const char* mode : {"ring", "all_to_all"}) {
      io::RunConfig c = base;
      std::string item;
      for (size_t at = 0; at < layout.size();) {
        size_t end = layout.find(' ', at);
        if (end == std::string::npos) end = layout.size();
        io::apply_override(c, "parallel." + layout.substr(at, end - at));
        at = end + 1;
      }
      if (c.parallel.cp > 1) c.parallel.cp_mode = mode;
      const mpitest::RunResult got = mpitest::train_run(c, world(), 2);
      for (size_t i = 0; i < 2; i++) {
        EXPECT_NEAR(got.losses[i], one.losses[i], 1e-6 * one.losses[i]) << layout << " " << mode << " step " << i + 1;
        EXPECT_NEAR(got.norms[i], one.norms[i], 1e-5 * one.norms[i]) << layout << " " << mode << " step " << i + 1;
      }
      if (c.parallel.cp == 1) break;  // cp_mode means nothing there
    }
}

double forward_bytes(model::ModelConfig c, int L, model::Recompute r, ContextParallel& cp, int b, int Tl) {
  c.n_layer = L;
  model::GPT gpt(c, 7);
  gpt.set_context_parallel(&cp);
  gpt.set_recompute(std::vector<model::Recompute>(L, r));
  std::vector<int32_t> in(static_cast<size_t>(b) * Tl);
  for (size_t i = 0; i < in.size(); i++) in[i] = static_cast<int32_t>((i * 7 + 3) % c.vocab_size);
  const size_t before = MemoryTracker::instance().current(MemCategory::Activations);
  gpt.forward(0, in.data(), in.data(), b, Tl, 1.0f);
  return static_cast<double>(MemoryTracker::instance().current(MemCategory::Activations) - before);
}

// Stored activations per layer per rank under context parallelism: a rank
// keeps its N = b·s/cp tokens' share of what one process keeps
// (docs/recompute.md's formula at N, tests/model/activation_formulas.h), and
// all-to-all one more N×A array (the head-sharded output its backward reads);
// printed beside Korthikanti et al.'s per-layer figures at s/cp (16-bit, t = 1).
TEST(ContextParallel, StoredActivationsPerLayerFollowTheFormula) {
  comm::Communicator& group = world();
  const int n = group.size(), b = 2, s = 16 * n, Tl = s / n;
  model::ModelConfig c = model::ModelConfig::defaults(model::Family::GPT2);
  c.n_head = 4 * n, c.n_embd = 16 * n, c.vocab_size = 101, c.seq_len = s;
  const model::GPT::Dims d = model::GPT(c, model::GPT::Unallocated{}).dims();
  for (Mode mode : {Mode::Ring, Mode::AllToAll}) {
    ContextParallel cp(group, mode);
    for (model::Recompute r : {model::Recompute::None, model::Recompute::Selective, model::Recompute::Full}) {
      const double measured = forward_bytes(c, 3, r, cp, b, Tl) - forward_bytes(c, 2, r, cp, b, Tl);
      const double N = static_cast<double>(b) * Tl;
      const double heads_out = mode == Mode::AllToAll ? d.A : 0;
      const double formula = model::testing::stored_bytes_per_layer(r, 4, N, N, model::testing::widths_of(d), heads_out);
      const double korthikanti = model::testing::korthikanti_bytes(r, Tl, b, d.C, d.NH);
      if (group.rank() == 0)
        std::printf("[ cp=%d %s ] %-9s stored per layer per rank: measured %8.0f  formula %8.0f  "
                    "Korthikanti at s/cp (16-bit) %8.0f\n",
                    n, context::name_of(mode), model::recompute_name(r), measured, formula, korthikanti);
      EXPECT_NEAR(measured, formula, 0.05 * formula) << context::name_of(mode) << " " << model::recompute_name(r);
    }
  }
}

// A checkpoint written under context parallelism (and ZeRO-3 over dp×cp) is
// the model whole: one process that loads it holds, bit for bit, the
// parameters the cp ranks trained (only cp rank 0's group writes it).
TEST(ContextParallel, CheckpointsAreTheWholeModel) {
  const int n = world().size();
  io::RunConfig c = mpitest::parity_recipe();
  c.train.micro_batch_size = 2;
  c.train.global_batch_size = 4;
  c.parallel.cp = n;
  c.parallel.zero_stage = 3;
  const std::filesystem::path dir = mpitest::shared_dir("lattice_cp_test", "ckpt");
  const mpitest::RunResult trained = mpitest::train_run(c, world(), 2, dir.string());
  world().barrier();
  io::RunConfig one = c;
  one.parallel = io::RunConfig().parallel;
  one.checkpoint.init_from = (dir / "step_000002" / "model.safetensors").string();
  const mpitest::RunResult loaded = mpitest::train_run(one, mpitest::self(), 0);
  ASSERT_EQ(loaded.params.size(), trained.params.size());
  for (size_t p = 0; p < trained.params.size(); p++) {
    EXPECT_EQ(loaded.params[p].name, trained.params[p].name);
    EXPECT_EQ(loaded.params[p].data, trained.params[p].data) << trained.params[p].name;
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

TEST(ContextParallel, RefusesWhatItCannotCut) {
  comm::Communicator& group = world();
  const int n = group.size();
  ContextParallel ring(group, Mode::Ring), a2a(group, Mode::AllToAll);
  EXPECT_THROW(
      {
        try {
          ring.check_local_length(3);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("model.seq_len must be divisible by 2*parallel.cp=" +
                                               std::to_string(2 * n)),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
  EXPECT_NO_THROW(ring.check_heads({3, 1, 8}));
  EXPECT_NO_THROW(a2a.check_heads({2 * n, n, 8}));
  EXPECT_THROW(a2a.check_heads({2 * n, 1, 8}), Error);  // whole query heads, but one key/value head
  EXPECT_THROW(
      {
        try {
          a2a.check_heads({2 * n + 1, 1, 8});
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("parallel.cp_mode=\"all_to_all\" gives each of the parallel.cp=" +
                                               std::to_string(n) + " ranks whole heads"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
  EXPECT_THROW(context::parse_mode("ulysses"), Error);
  // Through the trainer: the model's heads (4 query, 4 key/value) at cp = n
  // with all-to-all and 3 heads; seq_len not cut into 2·cp chunks.
  io::RunConfig c = mpitest::parity_recipe();
  c.parallel.cp = n;
  c.parallel.cp_mode = "all_to_all";
  c.model.n_head = 1;
  train::TrainerOptions o;
  o.print = false;
  o.ranks = &world();
  try {
    train::Trainer t(c, o);
    ADD_FAILURE() << "all_to_all over one head was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.cp_mode=\"all_to_all\""), std::string::npos) << e.what();
  }
  // A mesh that does not factor the ranks started.
  c = mpitest::parity_recipe();
  c.parallel.cp = n + 1;
  c.model.seq_len = 8 * (n + 1);  // cut into 2·cp chunks: the mesh is what is wrong
  try {
    train::Trainer t(c, o);
    ADD_FAILURE() << "cp=" << n + 1 << " on " << n << " ranks was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.cp=" + std::to_string(n + 1) + " × parallel.tp=1 = " +
                                         std::to_string(n + 1) + " does not equal the " + std::to_string(n)),
              std::string::npos)
        << e.what();
  }
  c = mpitest::parity_recipe();
  c.parallel.cp = n;
  c.model.seq_len = 2 * n + 2;
  try {
    train::Trainer t(c, o);
    ADD_FAILURE() << "a seq_len not divisible by 2*cp was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.cp=" + std::to_string(n) + " cuts each sequence into 2*cp="),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
