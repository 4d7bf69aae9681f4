// RMSNorm over the last dimension C (Llama; HF LlamaRMSNorm in f32):
//   rstd_i = 1/sqrt((1/C) Σ_c x_ic² + eps) ; x̂_ic = x_ic·rstd_i ; out_ic = x̂_ic·w_c
// Unlike LayerNorm there is no mean to subtract, so the sum of squares has no
// cancellation: a float sum of C non-negative terms, split over the vector
// lanes (L = 4, 8 or 16 by level), is off by at most ~(C/L)·2⁻²⁴ relative and
// typically √(C/L)·2⁻²⁴ (1e-6 at C = 4096 on SSE2); rstd carries half of it.
// PyTorch's f32 mean has the same kind of error.
//
// Backward, with g = dout ⊙ w (∂rstd_i/∂x_ij = -rstd_i³·x_ij/C):
//   dx_ij = rstd_i·g_ij - x_ij·rstd_i³/C · Σ_c g_ic·x_ic
//         = rstd_i · (g_ij - x̂_ij · mean_c(g_i ⊙ x̂_i))
//   dw_c (+)= Σ_i dout_ic·x̂_ic
#include <cmath>

#include <algorithm>

#include "lattice/core/error.h"
#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

constexpr int64_t kRowBlock = 16;      // rows per OpenMP task (forward, input grad)
constexpr int64_t kColumnBlock = 128;  // columns per OpenMP task (weight grad)

void forward_rows(float* out, float* rstd, const float* inp, const float* weight, int64_t row_begin,
                  int64_t row_end, int C, float eps) {
  for (int64_t i = row_begin; i < row_end; ++i) {
    const float* x = inp + i * C;
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int c = 0; c < C; ++c) sq += x[c] * x[c];
    const float s = 1.0f / std::sqrt(sq / C + eps);
    float* o = out + i * C;
    for (int c = 0; c < C; ++c) o[c] = (x[c] * s) * weight[c];
    rstd[i] = s;
  }
}

void backward_input_rows(float* dinp, const float* dout, const float* inp, const float* weight, const float* rstd,
                         int64_t row_begin, int64_t row_end, int C, bool accumulate) {
  for (int64_t i = row_begin; i < row_end; ++i) {
    const float* x = inp + i * C;
    const float* dy = dout + i * C;
    const float s = rstd[i];
    float sum_gx = 0.0f;
#pragma omp simd reduction(+ : sum_gx)
    for (int c = 0; c < C; ++c) sum_gx += (dy[c] * weight[c]) * (x[c] * s);
    const float mean_gx = sum_gx / C;
    float* dx = dinp + i * C;
    if (accumulate) {
      for (int c = 0; c < C; ++c) dx[c] += s * (dy[c] * weight[c] - (x[c] * s) * mean_gx);
    } else {
      for (int c = 0; c < C; ++c) dx[c] = s * (dy[c] * weight[c] - (x[c] * s) * mean_gx);
    }
  }
}

// Columns [col_begin, col_end) over all rows, rows in order: the result does
// not depend on the thread count.
void backward_weight_columns(float* dweight, const float* dout, const float* inp, const float* rstd, int64_t N,
                             int C, int64_t col_begin, int64_t col_end, bool accumulate) {
  float acc[kColumnBlock];
  const int64_t width = col_end - col_begin;
  for (int64_t j = 0; j < width; ++j) acc[j] = 0.0f;
  for (int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C + col_begin;
    const float* dy = dout + i * C + col_begin;
    const float s = rstd[i];
    for (int64_t j = 0; j < width; ++j) acc[j] += dy[j] * (x[j] * s);
  }
  for (int64_t j = 0; j < width; ++j)
    dweight[col_begin + j] = accumulate ? dweight[col_begin + j] + acc[j] : acc[j];
}

void check_args(const char* what, int64_t N, int C) {
  LATTICE_CHECK(N >= 0 && C > 0, what << ": need N >= 0 and C > 0, got N=" << N << " C=" << C);
}

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int C, float eps) {
  check_args("rmsnorm_forward", N, C);
  LATTICE_CHECK(eps > 0.0f && std::isfinite(eps),
                "rmsnorm_forward: eps=" << eps << " must be a finite number > 0 (an all-zero row would give 0/0)");
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b)
    cpu::simd([&] { return forward_rows(out, rstd, inp, weight, b * kRowBlock, std::min(N, (b + 1) * kRowBlock), C, eps); });
}

void rmsnorm_backward_input(float* dinp, const float* dout, const float* inp, const float* weight,
                            const float* rstd, int64_t N, int C, bool accumulate) {
  check_args("rmsnorm_backward_input", N, C);
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b)
    cpu::simd([&] {
      return backward_input_rows(dinp, dout, inp, weight, rstd, b * kRowBlock, std::min(N, (b + 1) * kRowBlock), C,
                                 accumulate);
    });
}

void rmsnorm_backward_weight(float* dweight, const float* dout, const float* inp, const float* rstd, int64_t N,
                             int C, bool accumulate) {
  check_args("rmsnorm_backward_weight", N, C);
  const int64_t blocks = (C + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b)
    cpu::simd([&] {
      return backward_weight_columns(dweight, dout, inp, rstd, N, C, b * kColumnBlock,
                                     std::min<int64_t>(C, (b + 1) * kColumnBlock), accumulate);
    });
}

}  // namespace lattice::kernels
