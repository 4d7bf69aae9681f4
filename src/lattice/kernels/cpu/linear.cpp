// Linear layer = GEMM + bias handling. W is [OC, IC] (torch.nn.Linear), so
//   forward      out  = inp · Wᵀ + b        gemm NT
//   input grad   dinp = dout · W            gemm NN
//   weight grad  dW (+)= doutᵀ · inp        gemm TN, beta = 1 (accumulate) or 0
//   bias grad    db (+)= Σ_n dout[n, :]     column sums, our own loop
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/cpu/vec_math.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

// Width of a column block of the bias reduction: each OpenMP task owns whole
// columns, so the sum over rows runs in the same order for any thread count.
constexpr int64_t kBiasColumnBlock = 128;

// out[n, j] = bias[j] for rows [row_begin, row_end).
void fill_rows_with_bias(float* out, const float* bias, int64_t row_begin, int64_t row_end, int OC) {
  for (int64_t n = row_begin; n < row_end; ++n) std::memcpy(out + n * OC, bias, sizeof(float) * OC);
}

// dbias[j] (+)= Σ_n dout[n, j] for j in [col_begin, col_end).
void column_sums(float* dbias, const float* dout, int64_t N, int OC, int64_t col_begin, int64_t col_end,
                 bool accumulate) {
  float acc[kBiasColumnBlock];
  const int64_t width = col_end - col_begin;
  for (int64_t j = 0; j < width; ++j) acc[j] = 0.0f;
  for (int64_t n = 0; n < N; ++n) {
    const float* row = dout + n * OC + col_begin;
    for (int64_t j = 0; j < width; ++j) acc[j] += row[j];
  }
  for (int64_t j = 0; j < width; ++j) dbias[col_begin + j] = accumulate ? dbias[col_begin + j] + acc[j] : acc[j];
}

}  // namespace

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int IC, int OC) {
  float beta = 0.0f;
  if (bias) {
    // Pre-filling the output with the bias and accumulating the product onto it
    // (beta = 1) costs one write pass of out, which the GEMM then reads while
    // it is still in cache; measured faster than a separate bias pass after it.
#pragma omp parallel for schedule(static)
    for (int64_t block = 0; block < (N + 63) / 64; ++block)
      cpu::simd([&] { return fill_rows_with_bias(out, bias, block * 64, std::min<int64_t>(N, block * 64 + 64), OC); });
    beta = 1.0f;
  }
  gemm(false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, beta, out, OC);
}

void linear_backward_input(float* dinp, const float* dout, const float* weight, int64_t N, int IC, int OC,
                           bool accumulate) {
  gemm(false, false, N, IC, OC, 1.0f, dout, OC, weight, IC, accumulate ? 1.0f : 0.0f, dinp, IC);
}

void linear_backward_weight(float* dweight, float* dbias, const float* dout, const float* inp, int64_t N, int IC,
                            int OC, bool accumulate) {
  gemm(true, false, OC, IC, N, 1.0f, dout, OC, inp, IC, accumulate ? 1.0f : 0.0f, dweight, IC);
  if (dbias) {
    const int64_t blocks = (OC + kBiasColumnBlock - 1) / kBiasColumnBlock;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b)
      cpu::simd([&] { return column_sums(dbias, dout, N, OC, b * kBiasColumnBlock, std::min<int64_t>(OC, (b + 1) * kBiasColumnBlock),
                  accumulate); });
  }
}

}  // namespace lattice::kernels
