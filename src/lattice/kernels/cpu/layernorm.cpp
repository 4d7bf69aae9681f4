// LayerNorm over the last dimension C (eps: the caller's, 1e-5 by default).
//   mean_i = (1/C) Σ_c x_ic ; var_i = (1/C) Σ_c (x_ic - mean_i)² ; rstd_i = 1/sqrt(var_i + eps)
//   x̂_ic = (x_ic - mean_i)·rstd_i ; out_ic = x̂_ic·w_c + b_c
// The variance is the two-pass form (sum of squared deviations from the mean
// already computed), which has no cancellation when |mean| ≫ std, unlike
// E[x²] - E[x]²; the row is in L1 for the second pass. The backward uses the
// stored (float) mean, so for rows with |mean| ≫ std its x̂ carries the
// rounding of the mean (relative ~ulp(mean)/std), as in PyTorch and llm.c.
//
// Backward, with g = dout ⊙ w:
//   dx_ic  = rstd_i · (g_ic - mean_c(g_i) - x̂_ic · mean_c(g_i ⊙ x̂_i))
//   dw_c (+)= Σ_i dout_ic·x̂_ic ; db_c (+)= Σ_i dout_ic
#include <algorithm>
#include <cmath>

#include "lattice/core/error.h"
#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/cpu/vec_math.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

constexpr int64_t kRowBlock = 16;        // rows per OpenMP task (forward, input grad)
constexpr int64_t kColumnBlock = 128;    // columns per OpenMP task (weight grads)

// The sums run on x - x_0 (the row's first element, a shift): for a row far
// from zero (mean ≫ std) the differences are exact and small, so the mean and
// the deviations keep full precision, where a plain float Σx would lose the
// digits of the mean that the deviations are made of.
void forward_rows(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                  int64_t row_begin, int64_t row_end, int C, float eps) {
  for (int64_t i = row_begin; i < row_end; ++i) {
    const float* x = inp + i * C;
    const float shift = x[0];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int c = 0; c < C; ++c) sum += x[c] - shift;
    const float delta = sum / C;  // mean - shift
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int c = 0; c < C; ++c) {
      const float d = (x[c] - shift) - delta;
      sq += d * d;
    }
    const float s = 1.0f / std::sqrt(sq / C + eps);
    float* o = out + i * C;
    for (int c = 0; c < C; ++c) o[c] = ((x[c] - shift) - delta) * s * weight[c] + bias[c];
    mean[i] = shift + delta;
    rstd[i] = s;
  }
}

void backward_input_rows(float* dinp, const float* dout, const float* inp, const float* weight, const float* mean,
                         const float* rstd, int64_t row_begin, int64_t row_end, int C) {
  for (int64_t i = row_begin; i < row_end; ++i) {
    const float* x = inp + i * C;
    const float* dy = dout + i * C;
    const float m = mean[i], s = rstd[i];
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma omp simd reduction(+ : sum_g, sum_gx)
    for (int c = 0; c < C; ++c) {
      const float g = dy[c] * weight[c];
      sum_g += g;
      sum_gx += g * (x[c] - m) * s;
    }
    const float mean_g = sum_g / C, mean_gx = sum_gx / C;
    float* dx = dinp + i * C;
    for (int c = 0; c < C; ++c) {
      const float xhat = (x[c] - m) * s;
      dx[c] += s * (dy[c] * weight[c] - mean_g - xhat * mean_gx);
    }
  }
}

// Columns [col_begin, col_end) over all rows: the row order of the sums is
// fixed, so the result does not depend on the thread count.
void backward_weight_columns(float* dweight, float* dbias, const float* dout, const float* inp, const float* mean,
                             const float* rstd, int64_t N, int C, int64_t col_begin, int64_t col_end,
                             bool accumulate) {
  float acc_w[kColumnBlock], acc_b[kColumnBlock];
  const int64_t width = col_end - col_begin;
  for (int64_t j = 0; j < width; ++j) acc_w[j] = acc_b[j] = 0.0f;
  for (int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C + col_begin;
    const float* dy = dout + i * C + col_begin;
    const float m = mean[i], s = rstd[i];
    for (int64_t j = 0; j < width; ++j) {
      acc_w[j] += dy[j] * ((x[j] - m) * s);
      acc_b[j] += dy[j];
    }
  }
  for (int64_t j = 0; j < width; ++j) {
    dweight[col_begin + j] = accumulate ? dweight[col_begin + j] + acc_w[j] : acc_w[j];
    dbias[col_begin + j] = accumulate ? dbias[col_begin + j] + acc_b[j] : acc_b[j];
  }
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int C, float eps) {
  LATTICE_CHECK(eps > 0.0f && std::isfinite(eps),
                "layernorm_forward: eps=" << eps << " must be a finite number > 0 (a constant row would give 0/0)");
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b)
    cpu::simd([&] {
      return forward_rows(out, mean, rstd, inp, weight, bias, b * kRowBlock, std::min(N, (b + 1) * kRowBlock), C, eps);
    });
}

void layernorm_backward_input(float* dinp, const float* dout, const float* inp, const float* weight,
                              const float* mean, const float* rstd, int64_t N, int C) {
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b)
    cpu::simd([&] { return backward_input_rows(dinp, dout, inp, weight, mean, rstd, b * kRowBlock, std::min(N, (b + 1) * kRowBlock), C); });
}

void layernorm_backward_weight(float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* mean, const float* rstd, int64_t N, int C, bool accumulate) {
  const int64_t blocks = (C + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b)
    cpu::simd([&] { return backward_weight_columns(dweight, dbias, dout, inp, mean, rstd, N, C, b * kColumnBlock,
                            std::min<int64_t>(C, (b + 1) * kColumnBlock), accumulate); });
}

}  // namespace lattice::kernels
