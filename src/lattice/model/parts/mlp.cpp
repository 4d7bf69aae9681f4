#include "lattice/model/parts/mlp.h"

#include "lattice/kernels/ops.h"
#include "lattice/layers/tensor/tensor_parallel.h"

namespace lattice::model::parts {

namespace k = lattice::kernels;

void Mlp::forward(float* y, float* fch, float* hid, const float* ln, float* work, int64_t N, DType q) const {
  const bool sp = tp_ && tp_->sequence_parallel();
  const int FU = static_cast<int>(this->FU());
  tensor::ColumnParallelLinear(tp_, C_, FU).forward(fch, ln, work, up_.weight(), up_.bias(), N);
  k::round_to(q, fch, N * FU);
  activation(hid, fch, N, q);
  tensor::RowParallelLinear(tp_, F_, C_).forward(y, sp ? work : y, hid, down_.weight(), down_.bias(), N);
}

void Mlp::activation(float* hid, const float* fch, int64_t N, DType q) const {
  if (kind_ == MlpKind::GELU)
    k::gelu_forward(hid, fch, N * F_);
  else
    k::swiglu_forward(hid, fch, N, F_);
  k::round_to(q, hid, N * F_);
}

void Mlp::backward_input(float* dln, float* dfch, float* dhid, const float* dy_slice, float* dy_whole,
                         const float* fch, int64_t N) const {
  tensor::RowParallelLinear(tp_, F_, C_).backward_input(dhid, dy_slice, dy_whole, down_.weight(), N);
  if (kind_ == MlpKind::GELU)
    k::gelu_backward(dfch, fch, dhid, N * F_);
  else
    k::swiglu_backward(dfch, dhid, fch, N, F_);
  tensor::ColumnParallelLinear(tp_, C_, static_cast<int>(FU())).backward_input(dln, dfch, up_.weight(), N);
}

void Mlp::backward_weight(const float* dy_whole, const float* hid, const float* dfch, const float* ln_whole,
                          int64_t N) const {
  float *dw, *db;
  bool acc = down_.write_grads(&dw, &db);
  k::linear_backward_weight(dw, db, dy_whole, hid, N, F_, C_, acc);
  acc = up_.write_grads(&dw, &db);
  k::linear_backward_weight(dw, db, dfch, ln_whole, N, C_, static_cast<int>(FU()), acc);
}

}  // namespace lattice::model::parts
