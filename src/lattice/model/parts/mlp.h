// The block's MLP, on this rank's hidden columns.
//
//   GELU (GPT-2)     fch = h · W_fcᵀ + b            [N, F]      hid = GELU_tanh(fch)
//   SwiGLU (Llama)   fch = h · [W_gate; W_up]ᵀ + b  [N, 2F]     hid = SiLU(gate) ⊙ up
//                    y = hid · W_downᵀ + b_down     (GPT-2: mlp.c_proj)
//
// with h = norm₂(r). Tensor parallelism (Megatron): the first projection is
// column-parallel and the second row-parallel, so one all-reduce (SP:
// reduce-scatter) ends the MLP. Under SwiGLU the gate and up projections are
// cut together — rank r holds the same columns of both, packed gate | up
// (parts/linear.h) — so the product SiLU(gate)·up needs no communication.
// A mixture-of-experts layer will be a third kind with the same contract.
#pragma once

#include <cstdint>

#include "lattice/core/dtype.h"
#include "lattice/model/config.h"
#include "lattice/model/parts/linear.h"

namespace lattice::tensor {
class TensorParallel;
}

namespace lattice::model::parts {

class Mlp {
 public:
  // F: the hidden width here (ffn / t).
  Mlp(tensor::TensorParallel* tp, MlpKind kind, int C, int F, LinearParams up, LinearParams down)
      : tp_(tp), kind_(kind), C_(C), F_(F), up_(up), down_(down) {}
  // Width of the first projection's output here: F, or 2F (gate | up).
  int64_t FU() const { return kind_ == MlpKind::SwiGLU ? 2LL * F_ : F_; }

  // y (rows(N) rows) from the norm's output ln (rows(N) rows; `work` [N, C]
  // takes the gathered input, then the partial product, under SP); fch and
  // hid are kept for the backward, each rounded to q.
  void forward(float* y, float* fch, float* hid, const float* ln, float* work, int64_t N, DType q) const;
  // hid [N, F] = GELU(fch) or SiLU(gate)·up, rounded to q: forward's step
  // between the projections (selective recomputation calls it again).
  void activation(float* hid, const float* fch, int64_t N, DType q) const;
  // From dy (rows(N) rows at dy_slice, gathered in place into dy_whole [N, C]
  // under SP): dhid [N, F] (scratch), dfch [N, FU], and dln [N, C] = dfch ·
  // W_up summed over the group (SP: this rank's rows of the sum in its first rows).
  void backward_input(float* dln, float* dfch, float* dhid, const float* dy_slice, float* dy_whole, const float* fch,
                      int64_t N) const;
  // dW_down (+)= dy_wholeᵀ · hid ; dW_up (+)= dfchᵀ · ln_whole (and the biases).
  void backward_weight(const float* dy_whole, const float* hid, const float* dfch, const float* ln_whole,
                       int64_t N) const;

 private:
  tensor::TensorParallel* tp_;
  MlpKind kind_;
  int C_, F_;
  LinearParams up_, down_;
};

}  // namespace lattice::model::parts
