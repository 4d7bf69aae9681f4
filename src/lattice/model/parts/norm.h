// The block's normalisation: LayerNorm (GPT-2) or RMSNorm (Llama), over the
// C features of each of R rows.
//
//   LayerNorm  y = (x - mean(x)) · rstd · w + b,  rstd = 1/sqrt(var(x) + eps)
//   RMSNorm    y = x · rstd · w,                  rstd = 1/sqrt(mean(x²) + eps)
//
// The kernels (kernels/ops.h) keep the row statistics (mean and rstd, or
// rstd) for the backward. Every norm acts on rows: under sequence
// parallelism a rank normalises its own rows, and its weight gradient is a
// partial sum that weight_grads completes over the tensor-parallel group.
#pragma once

#include <cstdint>

#include "lattice/model/config.h"
#include "lattice/model/param_group.h"

namespace lattice::tensor {
class TensorParallel;
}

namespace lattice::model::parts {

class Norm {
 public:
  Norm() = default;
  Norm(NormKind kind, int C, float eps) : kind_(kind), C_(C), eps_(eps) {}
  bool has_bias() const { return kind_ == NormKind::LayerNorm; }

  // out = norm(x) (R rows); mean is written for LayerNorm only. b: LayerNorm's bias.
  void forward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b, int64_t R) const;
  // dx += ∂L/∂x given dout = ∂L/∂out (accumulates: the residual path's gradient is already there).
  void backward_input(float* dx, const float* dout, const float* x, const float* w, const float* mean,
                      const float* rstd, int64_t R) const;
  // The weight (and bias) gradients of this micro-batch into group g's
  // parameters w (and w + 1, LayerNorm's bias): overwritten on their first
  // write after zero_grad, accumulated after. With `tp` under sequence
  // parallelism this rank saw its rows only, so the micro-batch's partial
  // gradient (in `scratch`, 2C floats) is summed over the group before it
  // joins the accumulated one.
  void weight_grads(ParamGroup& g, size_t w, const float* dout, const float* x, const float* mean, const float* rstd,
                    int64_t R, tensor::TensorParallel* tp, float* scratch) const;

 private:
  void weight_grads_into(float* dw, float* db, const float* dout, const float* x, const float* mean,
                         const float* rstd, int64_t R, bool accumulate) const;
  NormKind kind_ = NormKind::LayerNorm;
  int C_ = 0;
  float eps_ = 1e-5f;
};

}  // namespace lattice::model::parts
