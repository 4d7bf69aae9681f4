// Tensor parallelism (Megatron-LM style) and sequence parallelism.
//
// A transformer block is cut across the t ranks of a TP group so that each
// rank stores 1/t of every weight matrix and does 1/t of every GEMM:
//
//   MLP        Y = GELU(X·A) · B        A = [A_1 … A_t] split by columns (its
//              output features), B split by rows (its input features) to match:
//              rank r computes Y_r = GELU(X·A_r)·B_r, and Y = Σ_r Y_r + b — one
//              all-reduce ends the MLP. GELU needs no communication: it acts on
//              each column of X·A on its own.
//   attention  heads are independent: rank r holds the Q, K and V columns of
//              heads [r·NH/t, (r+1)·NH/t) of the fused c_attn (ShardSpec parts=3)
//              and the matching rows of c_proj, so again one all-reduce at the end.
//   embedding  wte split by vocabulary rows; a rank looks up the tokens of its
//              range (zeros for the others) and the lookups are summed; the
//              tied LM head is then column-parallel over the vocabulary and the
//              loss needs only per-row statistics (vocab_parallel.h).
//
// The communication hides in two conjugate operators around each parallel
// region (Megatron's f and g, Shoeybi et al. 2019):
//
//                         forward                 backward
//   f  (enter a region)   identity                all-reduce of dX
//   g  (leave a region)   all-reduce of Y         identity
//
// Sequence parallelism (Korthikanti et al. 2022) keeps the activations
// *between* regions (LayerNorm, residual) as slices of the N = B·T rows, rank
// r holding rows [r·N/t, (r+1)·N/t), and replaces each all-reduce by the
// pair it is made of, so the volume is the same and those activations shrink t×:
//
//                         forward                 backward
//   f  (enter a region)   all-gather of X         reduce-scatter of dX
//   g  (leave a region)   reduce-scatter of Y     all-gather of dY
//
// Rows, not sequence positions: lattice's activations are [B, T, C] row-major,
// so a contiguous block of the flattened rows is one all-gather away from the
// whole tensor, with no transpose (Megatron's [T, B, C] layout gets the same
// by cutting T). Every op between the regions is row-wise, so any row split
// is exact. A micro-batch's B·T rows must divide into t equal blocks
// (check_rows); the config asks model.seq_len % t == 0, which guarantees it
// for every micro-batch size.
//
// ColumnParallelLinear and RowParallelLinear (below) are the two halves of a
// region; gpt.cpp calls them for c_attn/c_proj and c_fc/c_proj, and for the
// LM head. With t = 1 they are plain Linears (the bias inside the GEMM), so a
// one-process model runs exactly the code it always ran.
#pragma once

#include <cstdint>
#include <string>

#include "lattice/comm/communicator.h"
#include "lattice/core/memory.h"

namespace lattice::tensor {

class TensorParallel {
 public:
  // `group`: the TP communicator (not owned; outlives this object).
  TensorParallel(comm::Communicator& group, bool sequence_parallel);

  int size() const { return group_.size(); }
  int rank() const { return group_.rank(); }
  bool sequence_parallel() const { return sp_; }
  comm::Communicator& group() { return group_; }

  // Rows of an N-row activation that this rank keeps outside the parallel
  // regions: N/t from row rank·N/t with sequence parallelism, else all N.
  int64_t local_rows(int64_t N) const { return sp_ ? N / size() : N; }
  int64_t first_row(int64_t N) const { return sp_ ? rank() * (N / size()) : 0; }
  // Checks that a micro-batch of N rows can be cut (sequence parallelism).
  void check_rows(int64_t N) const;

  // ---- the conjugate operators, on [rows, C] activations ----
  // The two primitives; each operator is one of them in each direction.
  //   gather: with SP, all-gathers the local_rows(N) rows at `slice` into
  //           `full` [N, C] (in place when slice == full + first_row(N)·C) and
  //           returns full; without SP, returns `slice` (it is whole).
  //   reduce: sums `partial` [N, C] over the group. With SP, reduce-scatters
  //           it: this rank's rows of the sum go to `out` (out == partial: in
  //           place, they land in its first local_rows(N) rows). Without SP,
  //           all-reduces in place and out must be partial.
  const float* gather(const float* slice, float* full, int64_t N, int64_t C, const char* what);
  void reduce(float* partial, float* out, int64_t N, int64_t C, const char* what);
  // f forward and g backward are gather; f backward and g forward are reduce.

  // All-reduce of a small buffer (statistics, LayerNorm gradients under SP).
  void all_reduce(float* data, int64_t n, comm::ReduceOp op, const char* what);
  void all_reduce(double* data, int64_t n, const char* what);

  // Time spent in this group's collectives since the last reset (for the
  // step line's share of TP communication).
  double comm_seconds() const { return comm_s_; }
  void reset_comm_seconds() { comm_s_ = 0; }

 private:
  comm::Communicator& group_;
  bool sp_;
  double comm_s_ = 0;
};

// Y_local = f(X) · W_localᵀ + b_local : W [OC, IC] split by output rows
// (OC_local = OC/t rows here), X replicated (or SP slices, gathered by f).
// `tp` null: one process, a plain Linear.
class ColumnParallelLinear {
 public:
  ColumnParallelLinear(TensorParallel* tp, int IC, int OC_local) : tp_(tp), IC_(IC), OC_(OC_local) {}
  // y [N, OC_local] from x (local_rows(N) rows). `gathered` [N, IC] receives
  // the whole input under SP. Returns the whole input the GEMM read.
  const float* forward(float* y, const float* x, float* gathered, const float* W, const float* b, int64_t N);
  // dx [N, IC] = dy · W_local, then f's backward sums it over the group in
  // place: all N rows without SP; with SP this rank's local_rows(N) rows of
  // the sum, in the first rows of dx.
  void backward_input(float* dx, const float* dy, const float* W, int64_t N);
  // dW (+)= dyᵀ · x_whole ; db (+)= Σ dy — local, no communication.
  void backward_weight(float* dW, float* db, const float* dy, const float* x_whole, int64_t N, bool accumulate);

 private:
  TensorParallel* tp_;
  int IC_, OC_;
};

// Y = g(X_local · W_localᵀ) + b : W [OC, IC] split by input columns (IC/t
// here), X_local the column-parallel layer's output. The bias is added once,
// after the sum. `tp` null: one process, a plain Linear.
class RowParallelLinear {
 public:
  RowParallelLinear(TensorParallel* tp, int IC_local, int OC) : tp_(tp), IC_(IC_local), OC_(OC) {}
  // y (local_rows(N) rows of OC) = Σ_ranks x_local·W_localᵀ + b. `partial`
  // [N, OC] holds the local product (may be y itself without SP).
  void forward(float* y, float* partial, const float* x_local, const float* W, const float* b, int64_t N);
  // g's backward (SP: all-gathers dy's slices into dy_whole [N, OC]; else dy
  // is whole), then dx_local [N, IC_local] = dy_whole · W_local. Returns dy_whole.
  const float* backward_input(float* dx_local, const float* dy, float* dy_whole, const float* W, int64_t N);
  // dW (+)= dy_wholeᵀ · x_local ; db (+)= Σ dy_whole (whole on every rank: the
  // replicated bias gets the same gradient everywhere, no reduction).
  void backward_weight(float* dW, float* db, const float* dy_whole, const float* x_local, int64_t N, bool accumulate);

 private:
  TensorParallel* tp_;
  int IC_, OC_;
};

// ---- how GPT-2's parameters are cut (the ShardSpec of each, model/param_group.h) ----
// Rows of wte for a vocabulary of V on t ranks: padded so each rank holds an
// equal range of whole 128-row tiles, ceil(V / 128t)·128t (50304 at t=1,
// 50432 at t=2, 50688 at t=4). The padding rows are zero and their logits never take
// part in the softmax, so the loss is that of the V real classes at any t.
int padded_vocab(int vocab_size, int t);

}  // namespace lattice::tensor
