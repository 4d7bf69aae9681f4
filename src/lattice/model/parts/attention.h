// The block's causal self-attention, on this rank's heads.
//
//   qkv  = norm₁(x) · W_qkvᵀ + b_qkv     Q [N, NH·hs] | K [N, NKV·hs] | V [N, NKV·hs]
//   Q, K ← RoPE(Q, K)                     (rotary positions only; HF's rotate-half)
//   atty = softmax(Q Kᵀ / √hs, causal) V  (query head h reads key/value head h / (NH/NKV))
//   y    = atty · W_oᵀ + b_o
//
// Grouped-query attention (Ainslie et al. 2023): NKV ≤ NH key/value heads,
// each shared by NH/NKV query heads; NKV = NH is multi-head attention. W_qkv
// is GPT-2's fused c_attn (one weight of 3C rows) or Llama's q_proj | k_proj
// | v_proj packed back to back (parts/linear.h), so either way one GEMM
// writes the qkv row the attention kernel reads.
//
// Tensor parallelism (Megatron): the projection into Q, K, V is column-
// parallel and the output projection row-parallel, so one all-reduce (SP:
// reduce-scatter) ends the attention. Query heads are split: NH/t here.
// Key/value heads are split too when t divides n_kv_head; when t is a
// multiple of n_kv_head instead, each key/value head is kept whole on the
// t/n_kv_head ranks whose query heads read it (kv_replicas > 1): those ranks
// compute the same K and V, each backpropagates only its own query heads'
// share, and the shares of W_k and W_v's gradients are summed over them
// (backward_weight). This is what Megatron-core does for n_kv_head < t; the
// alternative, splitting a head's hs columns, would need the scores summed
// over ranks inside the softmax.
#pragma once

#include <cstdint>
#include <vector>

#include "lattice/core/dtype.h"
#include "lattice/model/parts/linear.h"

namespace lattice::tensor {
class TensorParallel;
}
namespace lattice::kernels {
class RopeTable;
}
namespace lattice::context {
class ContextParallel;
}

namespace lattice::model::parts {

struct AttentionShape {
  int C = 0;            // model width
  int NH = 0;           // query heads here
  int NKV = 0;          // key/value heads here
  int hs = 0;           // head size
  int kv_replicas = 1;  // ranks holding each of these key/value heads (see above)
  int64_t A() const { return static_cast<int64_t>(NH) * hs; }
  int64_t QKV() const { return static_cast<int64_t>(NH + 2 * NKV) * hs; }
};

class Attention {
 public:
  // rope: the rotary table (null: learned positions, nothing rotated).
  // scratch: memory this part may grow for the replicated key/value gradients.
  // cp: the context-parallel group (null: the whole sequence is here).
  Attention(tensor::TensorParallel* tp, AttentionShape shape, const kernels::RopeTable* rope, LinearParams qkv,
            LinearParams out, std::vector<float>* scratch = nullptr, context::ContextParallel* cp = nullptr)
      : tp_(tp), s_(shape), rope_(rope), qkv_(qkv), out_(out), scratch_(scratch), cp_(cp) {}

  // qkv [N, QKV] from the norm's output ln (rows(N) rows; `work` [N, C]
  // takes it gathered under SP), rotated for positions first_position + t of
  // each of the B sequences of T (context parallelism: the global positions
  // of this rank's rows), rounded to q. Returns the whole input read.
  const float* project(float* qkv, const float* ln, float* work, int B, int T, int first_position, DType q) const;
  // atty [N, A] and lse [B, NH, T] from qkv: causal attention over each sequence, rounded to q.
  // Context parallelism: over the whole sequence, ring or all-to-all
  // (layers/context); all-to-all leaves the head-sharded Q/K/V in qkv, its
  // lse in lse and the head-sharded output in heads_out, for the backward.
  void attend(float* atty, float* lse, float* qkv, float* heads_out, int B, int T, DType q) const;
  // y = atty · W_oᵀ + b_o (rows(N) rows; `partial` [N, C] the local product under SP, else y).
  void output(float* y, float* partial, const float* atty, int64_t N) const;

  // From dy, the gradient of y (rows(N) rows at dy_slice, gathered in place
  // into dy_whole [N, C] under SP): datty [N, A] (scratch), dqkv [N, QKV]
  // (before the rotation: the projection's), and dln [N, C] = dqkv · W_qkv
  // summed over the group (SP: this rank's rows of the sum in its first rows).
  void backward_input(float* dln, float* dqkv, float* datty, const float* dy_slice, float* dy_whole,
                      const float* qkv, const float* atty, const float* lse, const float* heads_out, int B,
                      int T) const;
  // dW_o (+)= dy_wholeᵀ · atty ; dW_qkv (+)= dqkvᵀ · ln_whole (and the biases).
  void backward_weight(const float* dy_whole, const float* atty, const float* dqkv, const float* ln_whole,
                       int64_t N) const;

 private:
  tensor::TensorParallel* tp_;
  AttentionShape s_;
  const kernels::RopeTable* rope_;
  LinearParams qkv_, out_;
  std::vector<float>* scratch_;
  context::ContextParallel* cp_;
  // RoPE over qkv's query and key heads (backward: its transpose), at each row's position.
  void rotate(float* x, int B, int T, int first_position, bool backward) const;
};

}  // namespace lattice::model::parts
