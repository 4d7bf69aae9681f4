#include "lattice/model/parts/norm.h"

#include <cstring>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "lattice/layers/tensor/tensor_parallel.h"

namespace lattice::model::parts {

namespace k = lattice::kernels;

void Norm::forward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                   int64_t R) const {
  if (kind_ == NormKind::LayerNorm)
    k::layernorm_forward(out, mean, rstd, x, w, b, R, C_, eps_);
  else
    k::rmsnorm_forward(out, rstd, x, w, R, C_, eps_);
}

void Norm::backward_input(float* dx, const float* dout, const float* x, const float* w, const float* mean,
                          const float* rstd, int64_t R) const {
  if (kind_ == NormKind::LayerNorm)
    k::layernorm_backward_input(dx, dout, x, w, mean, rstd, R, C_);
  else
    k::rmsnorm_backward_input(dx, dout, x, w, rstd, R, C_, true);
}

void Norm::weight_grads_into(float* dw, float* db, const float* dout, const float* x, const float* mean,
                             const float* rstd, int64_t R, bool accumulate) const {
  if (kind_ == NormKind::LayerNorm)
    k::layernorm_backward_weight(dw, db, dout, x, mean, rstd, R, C_, accumulate);
  else
    k::rmsnorm_backward_weight(dw, dout, x, rstd, R, C_, accumulate);
}

void Norm::weight_grads(ParamGroup& g, size_t w, const float* dout, const float* x, const float* mean,
                        const float* rstd, int64_t R, tensor::TensorParallel* tp, float* scratch) const {
  const int n = has_bias() ? 2 : 1;
  float* d[2] = {nullptr, nullptr};
  bool acc[2] = {false, false};
  for (int i = 0; i < n; i++) d[i] = g.write_grad(w + i, &acc[i]);
  LATTICE_CHECK(n == 1 || acc[0] == acc[1], "gradients of " << g.params()[w].name << " and "
                                                            << g.params()[w + 1].name << " are out of step");
  if (!tp || !tp->sequence_parallel()) return weight_grads_into(d[0], d[1], dout, x, mean, rstd, R, acc[0]);
  weight_grads_into(scratch, scratch + C_, dout, x, mean, rstd, R, false);
  tp->all_reduce(scratch, n * C_, comm::ReduceOp::Sum, "norm weight gradients");
  for (int i = 0; i < n; i++) {
    if (acc[0])
      k::add_inplace(d[i], scratch + i * C_, C_);
    else
      std::memcpy(d[i], scratch + i * C_, C_ * sizeof(float));
  }
}

}  // namespace lattice::model::parts
