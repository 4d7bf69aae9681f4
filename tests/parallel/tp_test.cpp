// Tensor and sequence parallelism, run under mpiexec (2 and 4 ranks).
//
//  - the parallel layers (column/row-parallel MLP, vocabulary-parallel loss)
//    against the unsplit computation, forward and backward, on every rank
//    count the job has, SP off and on;
//  - equivalence: every layout (tp ∈ {2, 4}, SP off/on, GPT-2's vocabulary
//    50257 and one divisible by t, dp2×tp2 with ZeRO-1 and ZeRO-3) trains the
//    model of one process with the same global batch: losses to 1e-5
//    relative after 10 steps, full parameters (gathered, assembled, in HF
//    layout) to 1e-4 absolute — the tolerance dp_test.cpp derives from the
//    fp32-vs-fp64 study of the same model and recipe;
//  - checkpoints written at tp=2 resume at tp=1 and tp=4 on the same run;
//  - bytes on the wire per micro-batch against Megatron's counts;
//  - stored activations per rank against Korthikanti et al.'s formulas,
//    adjusted to what lattice keeps;
//  - activation recomputation (selective, full) bit-identical to none under
//    TP and SP, its stored bytes per layer against docs/recompute.md's
//    formula, and full recomputation's re-run forward collectives counted.
//
// Each rank computes the one-process reference itself on a communicator of
// its own (TrainerOptions::ranks).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../model/activation_formulas.h"
#include "equivalence.h"
#include "lattice/comm/mpi_communicator.h"
#include "lattice/comm/process_mesh.h"
#include "lattice/comm/runtime.h"
#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/core/rng.h"
#include "lattice/core/threads.h"
#include "lattice/io/config.h"
#include "lattice/kernels/ops.h"
#include "lattice/model/gpt.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/layers/tensor/vocab_parallel.h"
#include "lattice/train/checkpointing.h"
#include "lattice/train/model_io.h"
#include "lattice/train/trainer.h"
#include "mpi_ranks.h"

using namespace lattice;
namespace fs = std::filesystem;
namespace k = lattice::kernels;

namespace {

constexpr int kSteps = 10;

// The ranks share the machine's cores: one thread each for the tests that run
// the model and kernels directly (the Trainer's set train.threads=1 themselves).
const bool kOneThread = (set_num_threads(1), true);

using mpitest::self;
using mpitest::world;

fs::path shared_dir(const std::string& name) { return mpitest::shared_dir("lattice_tp_test", name); }

using mpitest::groups_of;

std::vector<float> random_vector(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = rng.next_normal() * scale;
  return v;
}

void expect_close(const float* got, const float* want, size_t n, float tol, const std::string& what) {
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (d > worst) worst = d, at = i;
  }
  EXPECT_LE(worst, tol) << what << ": largest difference at element " << at;
}

// ------------------------------------------------------------ the layers --

// A column-parallel Linear, GELU, a row-parallel Linear (the MLP of a block)
// on t ranks against the same on one: y, dx, and every weight gradient.
void check_mlp(comm::Communicator& group, bool sp) {
  const int t = group.size(), r = group.rank();
  const int64_t N = 8;
  const int C = 12, F = 16, Fl = F / t;
  const std::vector<float> x = random_vector(N * C, 1), A = random_vector(F * C, 2, 0.3f),
                           a = random_vector(F, 3, 0.1f), B = random_vector(C * F, 4, 0.3f),
                           b = random_vector(C, 5, 0.1f), dy = random_vector(N * C, 6);
  // One process.
  std::vector<float> h(N * F), g(N * F), y(N * C), dg(N * F), dh(N * F), dx(N * C);
  std::vector<float> dA(F * C), da(F), dB(C * F), db(C);
  k::linear_forward(h.data(), x.data(), A.data(), a.data(), N, C, F);
  k::gelu_forward(g.data(), h.data(), N * F);
  k::linear_forward(y.data(), g.data(), B.data(), b.data(), N, F, C);
  k::linear_backward_input(dg.data(), dy.data(), B.data(), N, F, C, false);
  k::linear_backward_weight(dB.data(), db.data(), dy.data(), g.data(), N, F, C, false);
  k::gelu_backward(dh.data(), h.data(), dg.data(), N * F);
  k::linear_backward_input(dx.data(), dh.data(), A.data(), N, C, F, false);
  k::linear_backward_weight(dA.data(), da.data(), dh.data(), x.data(), N, C, F, false);

  // This rank's slices: A's rows [r·Fl, (r+1)·Fl) and the same columns of B.
  std::vector<float> Al(A.begin() + r * Fl * C, A.begin() + (r + 1) * Fl * C),
      al(a.begin() + r * Fl, a.begin() + (r + 1) * Fl);
  std::vector<float> Bl(C * Fl);
  for (int o = 0; o < C; o++)
    for (int i = 0; i < Fl; i++) Bl[o * Fl + i] = B[o * F + r * Fl + i];
  tensor::TensorParallel tp(group, sp);
  const int64_t R = tp.local_rows(N), first = tp.first_row(N);
  std::vector<float> work(N * C), hl(N * Fl), gl(N * Fl), yl(N * C), partial(N * C);
  const float* xin = x.data() + first * C;  // this rank's rows (all of them without SP)
  const std::string what = "t=" + std::to_string(t) + (sp ? " SP" : "");
  const float* whole =
      tensor::ColumnParallelLinear(&tp, C, Fl).forward(hl.data(), xin, work.data(), Al.data(), al.data(), N);
  k::gelu_forward(gl.data(), hl.data(), N * Fl);
  tensor::RowParallelLinear(&tp, Fl, C)
      .forward(yl.data(), sp ? partial.data() : yl.data(), gl.data(), Bl.data(), b.data(), N);
  expect_close(yl.data(), y.data() + first * C, R * C, 1e-5f, what + " y");
  // Backward: dy is this rank's rows too, at their place in a full buffer.
  std::vector<float> dyw(N * C, 0.0f), dgl(N * Fl), dhl(N * Fl), dxl(N * C), dAl(Fl * C), dal(Fl), dBl(C * Fl), dbl(C);
  std::copy(dy.begin() + first * C, dy.begin() + (first + R) * C, dyw.begin() + first * C);
  const float* dy_whole = tensor::RowParallelLinear(&tp, Fl, C)
                              .backward_input(dgl.data(), dyw.data() + first * C, dyw.data(), Bl.data(), N);
  tensor::RowParallelLinear(&tp, Fl, C).backward_weight(dBl.data(), dbl.data(), dy_whole, gl.data(), N, false);
  k::gelu_backward(dhl.data(), hl.data(), dgl.data(), N * Fl);
  tensor::ColumnParallelLinear(&tp, C, Fl).backward_input(dxl.data(), dhl.data(), Al.data(), N);
  tensor::ColumnParallelLinear(&tp, C, Fl).backward_weight(dAl.data(), dal.data(), dhl.data(), whole, N, false);
  expect_close(dxl.data(), dx.data() + first * C, R * C, 1e-5f, what + " dx");
  expect_close(dAl.data(), dA.data() + r * Fl * C, Fl * C, 1e-5f, what + " dA (column-parallel weight)");
  expect_close(dal.data(), da.data() + r * Fl, Fl, 1e-5f, what + " da");
  std::vector<float> dB_mine(C * Fl);
  for (int o = 0; o < C; o++)
    for (int i = 0; i < Fl; i++) dB_mine[o * Fl + i] = dB[o * F + r * Fl + i];
  expect_close(dBl.data(), dB_mine.data(), C * Fl, 1e-5f, what + " dB (row-parallel weight)");
  expect_close(dbl.data(), db.data(), C, 1e-5f, what + " db (row-parallel bias, whole on every rank)");
}

TEST(TensorParallelLayers, ColumnThenRowParallelMlpMatchesTheUnsplitOne) {
  for (int t : {2, 4}) {
    if (t > world().size()) continue;
    for (bool sp : {false, true}) check_mlp(groups_of(t), sp);
  }
}

// A parameter's slice on this rank, by its ShardSpec (model/param_group.h).
std::vector<float> slice_of(const std::vector<float>& full, std::vector<int64_t> shape, int dim, int parts, int t,
                            int r) {
  model::ParamInfo p;
  p.full_shape = shape;
  p.shard = {dim, t, r, parts};
  p.shape = p.shard.local_shape(shape);
  std::vector<float> out(static_cast<size_t>(p.numel()));
  model::extract_slice(p, full.data(), out.data());
  return out;
}

// Attention by heads: c_attn column-parallel with rank r holding the Q, K and
// V rows of its heads, causal attention on those heads, c_proj row-parallel —
// against the whole layer, forward and backward (dx, both weights, both biases).
void check_attention(comm::Communicator& group, bool sp) {
  const int t = group.size(), r = group.rank();
  const int B = 2, T = 4, C = 16, H = 4, Hl = H / t, A = C / t;
  const int64_t N = B * T;
  const std::vector<float> x = random_vector(N * C, 41), W = random_vector(3 * C * C, 42, 0.3f),
                           b = random_vector(3 * C, 43, 0.1f), P = random_vector(C * C, 44, 0.3f),
                           pb = random_vector(C, 45, 0.1f), dy = random_vector(N * C, 46);
  // One process.
  std::vector<float> qkv(N * 3 * C), att(N * C), lse(N * H), y(N * C), datt(N * C), dqkv(N * 3 * C), dx(N * C);
  std::vector<float> dW(3 * C * C), db(3 * C), dP(C * C), dpb(C);
  k::linear_forward(qkv.data(), x.data(), W.data(), b.data(), N, C, 3 * C);
  k::attention_forward(att.data(), lse.data(), qkv.data(), B, T, C, H);
  k::linear_forward(y.data(), att.data(), P.data(), pb.data(), N, C, C);
  k::linear_backward_input(datt.data(), dy.data(), P.data(), N, C, C, false);
  k::linear_backward_weight(dP.data(), dpb.data(), dy.data(), att.data(), N, C, C, false);
  k::attention_backward(dqkv.data(), datt.data(), qkv.data(), att.data(), lse.data(), B, T, C, H);
  k::linear_backward_input(dx.data(), dqkv.data(), W.data(), N, C, 3 * C, false);
  k::linear_backward_weight(dW.data(), db.data(), dqkv.data(), x.data(), N, C, 3 * C, false);

  const std::vector<float> Wl = slice_of(W, {3 * C, C}, 0, 3, t, r), bl = slice_of(b, {3 * C}, 0, 3, t, r),
                           Pl = slice_of(P, {C, C}, 1, 1, t, r);
  tensor::TensorParallel tp(group, sp);
  const int64_t R = tp.local_rows(N), first = tp.first_row(N);
  std::vector<float> work(N * C), qkvl(N * 3 * A), attl(N * A), lsel(N * Hl), yl(N * C), partial(N * C);
  const float* whole = tensor::ColumnParallelLinear(&tp, C, 3 * A)
                           .forward(qkvl.data(), x.data() + first * C, work.data(), Wl.data(), bl.data(), N);
  k::attention_forward(attl.data(), lsel.data(), qkvl.data(), B, T, A, Hl);
  tensor::RowParallelLinear(&tp, A, C).forward(yl.data(), sp ? partial.data() : yl.data(), attl.data(), Pl.data(),
                                               pb.data(), N);
  const std::string what = "attention t=" + std::to_string(t) + (sp ? " SP" : "");
  expect_close(yl.data(), y.data() + first * C, R * C, 1e-5f, what + " y");
  std::vector<float> dyw(N * C, 0.0f), dattl(N * A), dqkvl(N * 3 * A), dxl(N * C), dWl(3 * A * C), dbl(3 * A),
      dPl(C * A), dpbl(C);
  std::copy(dy.begin() + first * C, dy.begin() + (first + R) * C, dyw.begin() + first * C);
  const float* dy_whole = tensor::RowParallelLinear(&tp, A, C).backward_input(dattl.data(), dyw.data() + first * C,
                                                                              dyw.data(), Pl.data(), N);
  tensor::RowParallelLinear(&tp, A, C).backward_weight(dPl.data(), dpbl.data(), dy_whole, attl.data(), N, false);
  k::attention_backward(dqkvl.data(), dattl.data(), qkvl.data(), attl.data(), lsel.data(), B, T, A, Hl);
  tensor::ColumnParallelLinear(&tp, C, 3 * A).backward_input(dxl.data(), dqkvl.data(), Wl.data(), N);
  tensor::ColumnParallelLinear(&tp, C, 3 * A).backward_weight(dWl.data(), dbl.data(), dqkvl.data(), whole, N, false);
  expect_close(dxl.data(), dx.data() + first * C, R * C, 1e-5f, what + " dx");
  expect_close(dWl.data(), slice_of(dW, {3 * C, C}, 0, 3, t, r).data(), 3 * A * C, 1e-5f, what + " d c_attn.weight");
  expect_close(dbl.data(), slice_of(db, {3 * C}, 0, 3, t, r).data(), 3 * A, 1e-5f, what + " d c_attn.bias");
  expect_close(dPl.data(), slice_of(dP, {C, C}, 1, 1, t, r).data(), C * A, 1e-5f, what + " d c_proj.weight");
  expect_close(dpbl.data(), dpb.data(), C, 1e-5f, what + " d c_proj.bias");
}

TEST(TensorParallelLayers, AttentionByHeadsMatchesTheWholeLayer) {
  for (int t : {2, 4}) {
    if (t > world().size()) continue;
    for (bool sp : {false, true}) check_attention(groups_of(t), sp);
  }
}

// The vocabulary-parallel loss at V=1000 (padded to 1024: at t=2 ranges of
// 512 and 488 real classes, at t=4 256, 256, 256 and 232) equals the
// one-process kernel; so do dlogits.
TEST(TensorParallelLayers, VocabularyParallelCrossEntropyMatchesTheWholeSoftmax) {
  const int64_t N = 6;
  const int V = 1000;
  for (int t : {2, 4}) {
    if (t > world().size()) continue;
    comm::Communicator& group = groups_of(t);
    tensor::TensorParallel tp(group, false);
    const int Vp = tensor::padded_vocab(V, t);
    ASSERT_EQ(Vp % t, 0);
    std::vector<float> logits = random_vector(N * Vp, 9, 3.0f);
    std::vector<int32_t> targets(N);
    for (int64_t i = 0; i < N; i++) targets[i] = static_cast<int32_t>((i * 37 + 5) % V);
    targets[0] = V - 1;  // the last real class
    // Padding logits that would win if they took part.
    for (int64_t i = 0; i < N; i++)
      for (int j = V; j < Vp; j++) logits[i * Vp + j] = 1e4f;
    std::vector<float> want = logits, want_losses(N);
    k::crossentropy_forward_backward(want.data(), want_losses.data(), targets.data(), N, V, Vp, 0.5f);
    const tensor::VocabRange range = tensor::vocab_range(V, Vp, t, group.rank());
    std::vector<float> mine(N * range.rows), losses(N);
    for (int64_t i = 0; i < N; i++)
      for (int j = 0; j < range.rows; j++) mine[i * range.rows + j] = logits[i * Vp + range.first + j];
    tensor::vocab_parallel_cross_entropy(&tp, mine.data(), losses.data(), targets.data(), N, range, true, 0.5f);
    for (int64_t i = 0; i < N; i++)
      EXPECT_NEAR(losses[i], want_losses[i], 1e-5 * std::fabs(want_losses[i])) << "t=" << t;
    for (int64_t i = 0; i < N; i++)
      for (int j = 0; j < range.rows; j++)
        EXPECT_NEAR(mine[i * range.rows + j], want[i * Vp + range.first + j], 1e-6) << "t=" << t << " row " << i;
  }
}

// The vocabulary-parallel lookup: each rank its rows (zero rows for other
// ranks' tokens), wpe on rank 0 only, summed over the group — bitwise the
// one-process lookup (adding zeros is exact); and its backward: each rank's
// rows of d wte, and the whole d wpe on every rank.
TEST(TensorParallelLayers, VocabularyParallelEmbeddingMatchesTheWholeTable) {
  const int B = 2, T = 4, C = 8, V = 1000;
  for (int t : {2, 4}) {
    if (t > world().size()) continue;
    comm::Communicator& group = groups_of(t);
    tensor::TensorParallel tp(group, false);
    const int Vp = tensor::padded_vocab(V, t);
    const std::vector<float> wte = random_vector(static_cast<size_t>(Vp) * C, 21), wpe = random_vector(T * C, 22),
                             dx = random_vector(B * T * C, 23);
    std::vector<int32_t> tokens(B * T);
    for (int i = 0; i < B * T; i++) tokens[i] = (i * 277 + 3) % V;  // tokens of every rank's range
    std::vector<float> want(B * T * C), dwte(static_cast<size_t>(Vp) * C, 0.0f), dwpe(T * C, 0.0f);
    k::embedding_forward(want.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    k::embedding_backward(dwte.data(), dwpe.data(), dx.data(), tokens.data(), B, T, C);

    const tensor::VocabRange range = tensor::vocab_range(V, Vp, t, group.rank());
    std::vector<int32_t> rows(B * T);
    tensor::local_tokens(rows.data(), tokens.data(), B * T, range);
    std::vector<float> x(B * T * C), my_dwte(static_cast<size_t>(range.rows) * C, 0.0f), my_dwpe(T * C, 0.0f);
    k::embedding_forward(x.data(), rows.data(), wte.data() + range.first * C, group.rank() == 0 ? wpe.data() : nullptr,
                         B, T, C);
    tp.reduce(x.data(), x.data(), B * T, C, "lookup");
    EXPECT_EQ(x, want) << "t=" << t;
    k::embedding_backward(my_dwte.data(), my_dwpe.data(), dx.data(), rows.data(), B, T, C);
    EXPECT_TRUE(std::equal(my_dwte.begin(), my_dwte.end(), dwte.begin() + range.first * C)) << "t=" << t;
    EXPECT_EQ(my_dwpe, dwpe) << "t=" << t;
  }
}

// The split backward (backward_input of every layer, then backward_weight:
// how pipeline schedules will run it) on slices gives bitwise the fused
// backward's gradients, over two micro-batches, SP off and on.
TEST(TensorParallel, SplitBackwardEqualsFusedOnSlices) {
  model::ModelConfig mc;
  mc.n_layer = 2, mc.n_head = 4, mc.n_embd = 32, mc.vocab_size = 1000, mc.seq_len = 8;
  const int B = 2, T = 8;
  std::vector<int32_t> in(B * T), out(B * T);
  for (int i = 0; i < B * T; i++) in[i] = (i * 263 + 1) % 1000, out[i] = (i * 171 + 5) % 1000;
  for (int t : {2, 4}) {
    if (t > world().size()) continue;
    for (bool sp : {false, true}) {
      tensor::TensorParallel tp(groups_of(t), sp);
      model::GPT fused(mc, 3, &tp), split(mc, 3, &tp);
      fused.zero_grad();
      split.zero_grad();
      for (int m = 0; m < 2; m++) {
        fused.forward(0, in.data(), out.data(), B, T, 0.5f);
        fused.backward(0);
        split.forward(0, in.data(), out.data(), B, T, 0.5f);
        split.backward_input(0);
        split.backward_weight(0);
      }
      for (size_t g = 0; g < fused.groups().size(); g++) {
        const model::ParamGroup& a = fused.groups()[g];
        const model::ParamGroup& b = split.groups()[g];
        EXPECT_TRUE(std::equal(a.grad(), a.grad() + a.numel(), b.grad()))
            << "t=" << t << (sp ? " SP" : "") << " group " << a.name();
      }
    }
  }
}

// -------------------------------------------------------- equivalence --

io::RunConfig base_config(int vocab) {
  io::RunConfig c = mpitest::parity_recipe();
  c.model.vocab_size = vocab;
  c.train.global_batch_size = vocab > 1000 ? 4 : 8;  // GPT-2's vocabulary: fewer rows of logits
  c.train.micro_batch_size = c.train.global_batch_size;
  return c;
}

io::RunConfig layout(int vocab, int tp, bool sp, int dp = 1, int stage = 0, int micro = 1) {
  io::RunConfig c = base_config(vocab);
  c.parallel.tp = tp;
  c.parallel.dp = dp;
  c.parallel.sequence_parallel = sp;
  c.parallel.zero_stage = stage;
  c.parallel.bucket_mb = 0.02;
  c.train.micro_batch_size = c.train.global_batch_size / (dp * micro);
  return c;
}

std::string describe(const io::RunConfig& c) {
  return "V=" + std::to_string(c.model.vocab_size) + " tp=" + std::to_string(c.parallel.tp) +
         (c.parallel.sequence_parallel ? " SP" : "") + " dp=" + std::to_string(c.parallel.dp) +
         " zero=" + std::to_string(c.parallel.zero_stage) +
         " micro-batches=" + std::to_string(io::micro_batches_per_step(c));
}

using mpitest::expect_same_run;
using mpitest::RunResult;

// Every rank of the layout must end with the same full tensors: the sliced
// ones are assembled alike, and each rank reports its own copy of the
// replicated ones (LayerNorms, row-parallel biases, wpe), which must not drift
// apart across the TP group. Checked bitwise with a max and a min over the ranks.
void expect_identical_on_every_rank(const RunResult& r, comm::Communicator& ranks, const std::string& what) {
  for (const train::HfTensor& p : r.params) {
    std::vector<float> hi = p.data, lo = p.data;
    ranks.all_reduce(hi.data(), hi.size(), DType::F32, comm::ReduceOp::Max);
    for (float& v : lo) v = -v;
    ranks.all_reduce(lo.data(), lo.size(), DType::F32, comm::ReduceOp::Max);
    bool same = true;
    for (size_t i = 0; i < p.data.size(); i++) same = same && hi[i] == p.data[i] && -lo[i] == p.data[i];
    EXPECT_TRUE(same) << what << ": " << p.name << " differs between ranks";
  }
}

RunResult train(const io::RunConfig& cfg, comm::Communicator& ranks, int steps = kSteps,
                const std::string& save_dir = "", bool split_backward = false) {
  RunResult r = mpitest::train_run(cfg, ranks, steps, save_dir, split_backward);
  expect_identical_on_every_rank(r, ranks, describe(cfg));
  return r;
}

// The one-process run of a vocabulary, computed once per job.
const RunResult& reference(int vocab) {
  static std::map<int, RunResult> runs;
  auto it = runs.find(vocab);
  if (it == runs.end()) it = runs.emplace(vocab, train(layout(vocab, 1, false), self())).first;
  return it->second;
}

// V=512 is divisible by 128t for t ∈ {2, 4}: no padding, every rank's range
// all real. 50257 is GPT-2's own and divisible by neither: padded to 50432 at
// t=2 and 50688 at t=4, the last rank's range partly padding. One and two
// micro-batches per step (SP's partial LayerNorm gradients accumulate).
TEST(TensorParallel, EveryTpLayoutTrainsTheOneProcessModel) {
  for (int vocab : {512, 50257}) {
    const RunResult& want = reference(vocab);
    for (int t : {2, 4}) {
      if (t > world().size()) continue;
      for (bool sp : {false, true})
        for (int micro : {1, 2}) {
          const io::RunConfig c = layout(vocab, t, sp, 1, 0, micro);
          expect_same_run(train(c, groups_of(t)), want, describe(c));
        }
    }
  }
}

// ZeRO shards over the dp ranks of each TP rank; every stage, SP off and on,
// two micro-batches per step; and stage 1 with the optimizer state on disk.
TEST(TensorParallel, DataTimesTensorParallelWithZeroTrainsTheOneProcessModel) {
  if (world().size() < 4) GTEST_SKIP() << "dp2 x tp2 needs 4 ranks";
  for (int stage = 0; stage <= 3; stage++)
    for (bool sp : {false, true}) {
      const io::RunConfig c = layout(1000, 2, sp, 2, stage, 2);
      expect_same_run(train(c, groups_of(4)), reference(1000), describe(c));
    }
  // The split backward (backward_input, then backward_weight) under the ZeRO
  // stages that hook into it most: gradients (2) and parameters (3) sharded.
  for (int stage : {2, 3}) {
    const io::RunConfig split = layout(1000, 2, true, 2, stage, 2);
    expect_same_run(train(split, groups_of(4), kSteps, "", true), reference(1000), describe(split) + " split backward");
  }
  io::RunConfig c = layout(1000, 2, true, 2, 1, 2);
  c.zero.offload = "disk";
  c.zero.offload_dir = shared_dir("offload").string();
  expect_same_run(train(c, groups_of(4)), reference(1000), describe(c) + " offload");
}

// Evaluation (no backward, no generation) under TP and SP is the one-process
// mean loss over the same val batches, before and after training.
TEST(TensorParallel, EvaluationMatchesOneProcess) {
  const auto evaluate = [](const io::RunConfig& c, comm::Communicator& r) {
    return mpitest::eval_before_and_after(c, r);
  };
  const std::vector<double> want = evaluate(layout(50257, 1, false), self());
  for (int t : {2, 4}) {
    if (t > world().size()) continue;
    for (bool sp : {false, true}) {
      const std::vector<double> got = evaluate(layout(50257, t, sp), groups_of(t));
      for (size_t i = 0; i < want.size(); i++)
        EXPECT_NEAR(got[i], want[i], 1e-5 * std::fabs(want[i])) << "t=" << t << (sp ? " SP" : "") << " eval " << i;
    }
  }
}

// A checkpoint is full tensors by HF name: written at tp=2, it resumes at
// tp=1 and (on 4 ranks) tp=4 with SP, and the last 5 steps are those of the
// uninterrupted run.
TEST(TensorParallel, CheckpointAtTp2ResumesAtTp1AndTp4) {
  const fs::path dir = shared_dir("ckpt");
  const RunResult& want = reference(1000);
  const io::RunConfig at2 = layout(1000, 2, true);
  comm::Communicator& pairs = groups_of(2);  // collective: every rank makes its pair
  RunResult saved;
  if (world().rank() < 2) saved = train(at2, pairs, 5, dir.string());
  world().barrier();
  // `lattice generate` loads it whole, into one process's model: the same tensors.
  if (world().rank() < 2) {
    std::unique_ptr<model::GPT> gpt = train::load_model_for_inference((dir / "step_000005").string(), 0);
    const std::vector<train::HfTensor> loaded = train::export_hf(*gpt, train::params_of(*gpt));
    ASSERT_EQ(loaded.size(), saved.params.size());
    for (size_t p = 0; p < loaded.size(); p++) {
      EXPECT_EQ(loaded[p].name, saved.params[p].name);
      EXPECT_EQ(loaded[p].data, saved.params[p].data) << loaded[p].name;
    }
    std::vector<int32_t> prompt = {1, 2, 3};
    EXPECT_NO_THROW(gpt->next_logits(prompt.data(), 3));
  }
  auto resumed = [&](io::RunConfig c, comm::Communicator& ranks) {
    c.checkpoint.resume = (dir / "step_000005").string();
    RunResult r = train(c, ranks, 5);
    RunResult full = want;
    full.losses.erase(full.losses.begin(), full.losses.begin() + 5);
    full.norms.erase(full.norms.begin(), full.norms.begin() + 5);
    expect_same_run(r, full, describe(c) + " resumed from tp=2");
  };
  resumed(layout(1000, 1, false), self());
  if (world().size() >= 4) resumed(layout(1000, 4, true), groups_of(4));
}

// The same for a Llama whose 2 key/value heads are replicated at tp=4 (each
// whole on two ranks): its checkpoint holds each head once, whole, and
// resumes at tp=1 and at tp=2 (heads split) as the uninterrupted run.
TEST(TensorParallel, LlamaCheckpointAtTp4ResumesAtTp1AndTp2) {
  if (world().size() < 4) GTEST_SKIP() << "needs 4 ranks";
  const fs::path dir = shared_dir("ckpt_llama");
  auto llama = [](io::RunConfig c) {
    for (const char* set : {"model.family=llama", "model.n_kv_head=2", "model.ffn_hidden=64"})
      io::apply_override(c, set);
    return c;
  };
  const RunResult want = train(llama(layout(1000, 1, false)), self());
  comm::Communicator& fours = groups_of(4);
  comm::Communicator& pairs = groups_of(2);
  if (world().rank() < 4) train(llama(layout(1000, 4, true)), fours, 5, dir.string());
  world().barrier();
  auto resumed = [&](io::RunConfig c, comm::Communicator& ranks) {
    c.checkpoint.resume = (dir / "step_000005").string();
    RunResult r = train(c, ranks, 5);
    RunResult full = want;
    full.losses.erase(full.losses.begin(), full.losses.begin() + 5);
    full.norms.erase(full.norms.begin(), full.norms.begin() + 5);
    expect_same_run(r, full, describe(c) + " resumed from a Llama at tp=4");
  };
  resumed(llama(layout(1000, 1, false)), self());
  resumed(llama(layout(1000, 2, true)), pairs);
}

// ---------------------------------------------------------------- bytes --

// One micro-batch (forward + backward) of a GPT on a TP group, and the bytes
// this rank sent by kind of collective.
struct Sent {
  uint64_t all_reduce = 0, all_gather = 0, reduce_scatter = 0, calls_ar = 0, calls_ag = 0, calls_rs = 0;
};

Sent one_micro_batch(comm::Communicator& group, bool sp, int L, int B, int T,
                     model::Recompute mode = model::Recompute::None) {
  model::ModelConfig mc;
  mc.n_layer = L;
  mc.n_head = 4;
  mc.n_embd = 32;
  mc.vocab_size = 1000;
  mc.seq_len = T;
  tensor::TensorParallel tp(group, sp);
  model::GPT gpt(mc, 5, &tp);
  gpt.set_recompute(std::vector<model::Recompute>(L, mode));
  std::vector<int32_t> in(B * T), out(B * T);
  for (int i = 0; i < B * T; i++) in[i] = (i * 277) % 1000, out[i] = (i * 111 + 3) % 1000;
  gpt.zero_grad();
  group.reset_stats();
  gpt.forward(0, in.data(), out.data(), B, T, 1.0f);
  gpt.backward(0);
  const comm::CommStats s = group.stats();
  return {s.bytes(comm::CommOp::AllReduce),     s.bytes(comm::CommOp::AllGather),
          s.bytes(comm::CommOp::ReduceScatter), s.calls_of(comm::CommOp::AllReduce),
          s.calls_of(comm::CommOp::AllGather),  s.calls_of(comm::CommOp::ReduceScatter)};
}

// Megatron's counts (Korthikanti et al. §4.2.2): per layer per micro-batch,
// without SP 2 all-reduces of b·s·h forward and 2 backward; with SP 4
// all-gathers + 4 reduce-scatters of the same volume (an all-reduce is a
// reduce-scatter plus an all-gather). lattice's SP sends 2 all-gathers more
// per layer: the LayerNorm outputs re-gathered for the column-parallel
// weight gradients, as Megatron also does (kept sliced, they halve those
// activations). Outside the layers: the embedding's sum and the head's input
// gradient (one b·s·h each way), the loss statistics (N floats of row maxima,
// 2N doubles of sums: all-reduces), and under SP the final LayerNorm output
// gathered for the head, dx₀ gathered for the embedding's gradient, and each
// LayerNorm's 2h weight gradients all-reduced. Per-rank ring bytes: an
// all-reduce of S sends 2(t-1)/t·S, a gather or scatter (t-1)/t·S.
TEST(TensorParallel, BytesOnTheWireAreMegatronsPerLayerCounts) {
  const int B = 2, T = 8, C = 32, L = 2;
  const double N = B * T, S = N * C * 4.0;  // b·s·h floats, in bytes
  for (int t : {2, 4}) {
    if (t > world().size()) continue;
    const double ar = 2.0 * (t - 1) / t, ag = (t - 1.0) / t;
    const double loss_ar = (N * 4 + 2 * N * 8) * ar;
    const Sent off = one_micro_batch(groups_of(t), false, L, B, T);
    EXPECT_EQ(off.calls_ar, static_cast<uint64_t>(4 * L + 2 + 2)) << "t=" << t;
    EXPECT_DOUBLE_EQ(static_cast<double>(off.all_reduce), L * 4 * S * ar + 2 * S * ar + loss_ar) << "t=" << t;
    EXPECT_EQ(off.all_gather + off.reduce_scatter, 0u);
    const Sent on = one_micro_batch(groups_of(t), true, L, B, T);
    EXPECT_EQ(on.calls_rs, static_cast<uint64_t>(4 * L + 2)) << "t=" << t << " SP";
    EXPECT_EQ(on.calls_ag, static_cast<uint64_t>(6 * L + 2)) << "t=" << t << " SP";
    EXPECT_DOUBLE_EQ(static_cast<double>(on.reduce_scatter), (4 * L + 2) * S * ag) << "t=" << t << " SP";
    EXPECT_DOUBLE_EQ(static_cast<double>(on.all_gather), (6 * L + 2) * S * ag) << "t=" << t << " SP";
    // The same volume as the all-reduces it replaces, plus the 2L re-gathers.
    EXPECT_DOUBLE_EQ(static_cast<double>(on.reduce_scatter + on.all_gather) - 2 * L * S * ag,
                     static_cast<double>(off.all_reduce) - loss_ar);
    EXPECT_EQ(on.calls_ar, static_cast<uint64_t>(2 * L + 1 + 2)) << "LayerNorm gradients and the loss";
    EXPECT_DOUBLE_EQ(static_cast<double>(on.all_reduce), (2 * L + 1) * 2 * C * 4.0 * ar + loss_ar);
  }
}

// Recomputation's collectives: selective recomputes norms and an activation
// function, with no communication; full re-runs each block's forward in its
// backward, collectives included — 2 all-reduces of S per layer more without
// SP, 2 all-gathers and 2 reduce-scatters of S per layer more with SP —
// except for the last layer when the backward follows the forward directly
// (the one-layer work arrays still hold it): L - 1 layers here.
TEST(TensorParallel, FullRecomputationRerunsTheForwardsCollectives) {
  const int B = 2, T = 8, C = 32, L = 3, t = 2;
  const double S = B * T * C * 4.0, ar = 2.0 * (t - 1) / t, ag = (t - 1.0) / t;
  comm::Communicator& pairs = groups_of(t);
  for (bool sp : {false, true}) {
    const Sent none = one_micro_batch(pairs, sp, L, B, T);
    const Sent selective = one_micro_batch(pairs, sp, L, B, T, model::Recompute::Selective);
    const Sent full = one_micro_batch(pairs, sp, L, B, T, model::Recompute::Full);
    const std::string what = sp ? "SP" : "no SP";
    EXPECT_EQ(selective.all_reduce, none.all_reduce) << what;
    EXPECT_EQ(selective.all_gather, none.all_gather) << what;
    EXPECT_EQ(selective.reduce_scatter, none.reduce_scatter) << what;
    if (!sp) {
      EXPECT_EQ(full.calls_ar, none.calls_ar + 2 * (L - 1)) << what;
      EXPECT_DOUBLE_EQ(static_cast<double>(full.all_reduce - none.all_reduce), 2 * (L - 1) * S * ar) << what;
    } else {
      EXPECT_EQ(full.calls_ag, none.calls_ag + 2 * (L - 1)) << what;
      EXPECT_EQ(full.calls_rs, none.calls_rs + 2 * (L - 1)) << what;
      EXPECT_EQ(full.calls_ar, none.calls_ar) << what;
      EXPECT_DOUBLE_EQ(static_cast<double>(full.all_gather - none.all_gather), 2 * (L - 1) * S * ag) << what;
      EXPECT_DOUBLE_EQ(static_cast<double>(full.reduce_scatter - none.reduce_scatter), 2 * (L - 1) * S * ag)
          << what;
    }
  }
}

// Recomputation under tensor parallelism, SP off and on, both families, f32
// and bf16, the fused and the split backward: selective and full give the
// losses and every gradient of recompute none bit for bit (the re-run
// forward's collectives sum the same partial products in the same order).
TEST(TensorParallel, RecomputationIsBitIdentical) {
  comm::Communicator& pairs = groups_of(2);
  const int B = 2, T = 8;
  for (const char* family : {"gpt2", "llama"})
    for (bool sp : {false, true})
      for (DType dtype : {DType::F32, DType::BF16})
        for (bool split : {false, true}) {
          model::ModelConfig mc = std::string(family) == "llama" ? model::ModelConfig::defaults(model::Family::Llama)
                                                                 : model::ModelConfig();
          mc.n_layer = 2, mc.n_head = 4, mc.n_embd = 32, mc.vocab_size = 101, mc.seq_len = T;
          if (std::string(family) == "llama") mc.n_kv_head = 2, mc.ffn_hidden = 64;
          auto run = [&](model::Recompute mode) {
            tensor::TensorParallel tp(pairs, sp);
            model::GPT gpt(mc, 5, &tp);
            gpt.set_compute_dtype(dtype);
            gpt.set_recompute(std::vector<model::Recompute>(mc.n_layer, mode));
            std::vector<int32_t> in(B * T), out(B * T);
            std::vector<float> got;
            gpt.zero_grad();
            for (int m = 0; m < 2; m++) {
              for (int i = 0; i < B * T; i++) in[i] = (i * 7 + m) % 101, out[i] = (i * 5 + 3 * m + 1) % 101;
              got.push_back(gpt.forward(m, in.data(), out.data(), B, T, 0.5f));
            }
            for (int m = 2; m-- > 0;) {
              if (split) {
                gpt.backward_input(m);
              } else {
                gpt.backward(m);
              }
            }
            if (split)
              for (int m = 0; m < 2; m++) gpt.backward_weight(m);
            for (model::ParamGroup& g : gpt.groups()) got.insert(got.end(), g.grad(), g.grad() + g.numel());
            return got;
          };
          const std::vector<float> none = run(model::Recompute::None);
          const std::string what = std::string(family) + (sp ? " SP " : " ") + dtype_name(dtype) +
                                   (split ? " split" : " fused");
          EXPECT_EQ(run(model::Recompute::Selective), none) << what << " selective";
          EXPECT_EQ(run(model::Recompute::Full), none) << what << " full";
        }
}

// ---------------------------------------------------- activation memory --

// Stored activations per layer per rank, measured by MemoryTracker after a
// training forward as the difference between models of 2 and 1 layers (the
// embedding's and head's buffers cancel),
// against Korthikanti et al.'s per-layer formulas for 16-bit activations,
//   sbh(34 + 5as/h)   sbh(10 + 24/t + 5as/(ht))   sbh(34/t + 5as/(ht))
// adjusted to what lattice keeps, in fp32 (4 bytes, not 2):
//  - no dropout (GPT-2 training here has none): Megatron's 2sbh of masks
//    after attention and MLP and its sbh attention-dropout mask are absent;
//  - fused attention stores no a·s·s scores or probabilities (its 5as/h
//    term) but one log-sum-exp per head and token (a·s·b floats);
//  - LayerNorms keep their output (for the next GEMM's weight gradient),
//    mean and rstd; the residual x and r; QKV, the attention output, the
//    MLP's pre- and post-GELU hidden layer.
// Per token per layer, in floats: replicated 4h + 4 (x, LN₁ out, r, LN₂ out,
// four statistics), split 12h/t + a/t (qkv 3h, atty h, fc 4h, gelu 4h, lse a):
//   t = 1:  4·sb·(16h + a + 4)    TP: 4·sb·(4h + 4 + (12h + a)/t)    TP+SP: 4·sb·(16h + a + 4)/t
TEST(TensorParallel, StoredActivationsFollowKorthikantisFormulasAdjusted) {
  const int B = 2, T = 16, C = 32, H = 4;
  const double sb = B * T;
  const bool print = world().rank() == 0;
  if (print) std::printf("stored activation bytes per layer, b=%d s=%d h=%d a=%d (fp32)\n", B, T, C, H);
  if (print) std::printf("  %-9s %10s %10s %16s\n", "layout", "measured", "adjusted", "Korthikanti-16b");
  for (int t : {1, 2, 4}) {
    if (t > world().size()) continue;
    for (bool sp : {false, true}) {
      if (t == 1 && sp) continue;
      // What a training forward of one micro-batch leaves allocated in
      // MemoryTracker's activations category (its slot: what the backward
      // will read, the logits, the tokens), on a real model of L layers.
      auto per_model = [&](int L) {
        model::ModelConfig mc;
        mc.n_layer = L, mc.n_head = H, mc.n_embd = C, mc.vocab_size = 101, mc.seq_len = T;
        std::unique_ptr<tensor::TensorParallel> tp;
        if (t > 1) tp = std::make_unique<tensor::TensorParallel>(groups_of(t), sp);
        model::GPT gpt(mc, 7, tp.get());
        std::vector<int32_t> in(B * T), out(B * T);
        for (int i = 0; i < B * T; i++) in[i] = (i * 5) % 101, out[i] = (i * 3 + 1) % 101;
        const size_t before = MemoryTracker::instance().current(MemCategory::Activations);
        gpt.forward(0, in.data(), out.data(), B, T, 1.0f);
        const double grew = static_cast<double>(MemoryTracker::instance().current(MemCategory::Activations) - before);
        EXPECT_EQ(grew, static_cast<double>(gpt.stored_activation_bytes(B, T))) << "t=" << t << (sp ? " SP" : "");
        return grew;
      };
      const double measured = per_model(2) - per_model(1);
      const double h = C, a = H;
      const double adjusted = t == 1 ? 4 * sb * (16 * h + a + 4)
                              : sp   ? 4 * sb * (16 * h + a + 4) / t
                                     : 4 * sb * (4 * h + 4 + (12 * h + a) / t);
      const double s_over_h = T / h;
      const double korthikanti = t == 1 ? sb * h * (34 + 5 * a * s_over_h)
                                 : sp   ? sb * h * (34.0 / t + 5 * a * s_over_h / t)
                                        : sb * h * (10 + 24.0 / t + 5 * a * s_over_h / t);
      if (print) std::printf("  t=%d %-4s %10.0f %10.0f %16.0f\n", t, sp ? "SP" : "", measured, adjusted, korthikanti);
      EXPECT_NEAR(measured, adjusted, 0.15 * adjusted) << "t=" << t << (sp ? " SP" : "");
    }
  }
}

// Stored activation bytes per layer per rank under recomputation, measured as
// above (models of 2 and 1 layers), against docs/recompute.md's formula
// (tests/model/activation_formulas.h) at this rank's widths (qkv 3h/t, atty
// h/t, fc and its GELU 4h/t each, a/t log-sum-exps) and R rows of the
// residual stream (N, or N/t with SP), printed beside Korthikanti et al.'s
// 16-bit figures for the same layout.
TEST(TensorParallel, StoredActivationsUnderRecomputationFollowTheFormula) {
  const int B = 2, T = 16, C = 32, H = 4, t = 2;
  const double N = B * T, h = C, a = H, s = T, e = 4;
  const bool print = world().rank() == 0;
  if (print) std::printf("stored activation bytes per layer per rank, b=%d s=%d h=%d a=%d t=%d (fp32)\n", B, T, C, H, t);
  for (bool sp : {false, true})
    for (model::Recompute mode : {model::Recompute::None, model::Recompute::Selective, model::Recompute::Full}) {
      auto per_model = [&](int L) {
        model::ModelConfig mc;
        mc.n_layer = L, mc.n_head = H, mc.n_embd = C, mc.vocab_size = 101, mc.seq_len = T;
        tensor::TensorParallel tp(groups_of(t), sp);
        model::GPT gpt(mc, 7, &tp);
        gpt.set_recompute(std::vector<model::Recompute>(L, mode));
        std::vector<int32_t> in(B * T), out(B * T);
        for (int i = 0; i < B * T; i++) in[i] = (i * 5) % 101, out[i] = (i * 3 + 1) % 101;
        const size_t before = MemoryTracker::instance().current(MemCategory::Activations);
        gpt.forward(0, in.data(), out.data(), B, T, 1.0f);
        return static_cast<double>(MemoryTracker::instance().current(MemCategory::Activations) - before);
      };
      const double measured = per_model(2) - per_model(1);
      const double R = sp ? N / t : N;
      const model::testing::LayerWidths w{h, 3 * h / t, h / t, 4 * h / t, 4 * h / t, a / t};
      const double formula = model::testing::stored_bytes_per_layer(mode, e, N, R, w);
      const double korthikanti = model::testing::korthikanti_bytes(mode, s, B, h, a, t, sp);
      if (print)
        std::printf("  t=%d %-3s %-9s measured %7.0f  formula %7.0f  Korthikanti (16-bit) %7.0f\n", t, sp ? "SP" : "",
                    model::recompute_name(mode), measured, formula, korthikanti);
      EXPECT_NEAR(measured, formula, 0.05 * formula) << (sp ? "SP " : "") << model::recompute_name(mode);
    }
}

// --------------------------------------------------------------- bad input --

TEST(TensorParallel, MeshThatDoesNotCoverTheRanksIsRefusedByName) {
  io::RunConfig c = layout(1000, 2, false);
  c.parallel.dp = 1;  // tp·dp = 2 on a group of 4
  if (world().size() < 4) GTEST_SKIP();
  train::TrainerOptions o;
  o.print = false;
  o.ranks = &groups_of(4);
  try {
    train::Trainer t(c, o);
    FAIL() << "a 2-rank mesh on 4 ranks was accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("parallel.tp=2"), std::string::npos) << m;
    EXPECT_NE(m.find("4"), std::string::npos) << m;
  }
}

}  // namespace
