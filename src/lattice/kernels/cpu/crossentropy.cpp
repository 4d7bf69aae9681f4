// Softmax cross-entropy over the vocabulary, rows of logits [N, Vp] of which
// the first V columns are classes and V..Vp-1 padding (never read as classes).
//   m_i = max_{j<V} z_ij ; s_i = Σ_{j<V} exp(z_ij - m_i) ; lse_i = m_i + log s_i
//   loss_i = lse_i - z_i,target
//   dz_ij = dloss · (exp(z_ij - m_i)/s_i - [j = target])   (j < V),  0 for j ≥ V
// Subtracting the row maximum keeps every exp ≤ 1. A row of GPT-2's 50304
// floats (196 KiB) stays in L2 across the passes, so the fused version reads
// and writes the big tensor from memory once.
#include <algorithm>
#include <cmath>

#include "lattice/core/error.h"
#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/cpu/vec_math.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

float row_max(const float* z, int V) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int j = 0; j < V; ++j) m = z[j] > m ? z[j] : m;
  return m;
}

// Σ_j exp(z_j - m): float sums over blocks of 256 terms (vectorised), the
// block sums added in double. One float sum over all 50k terms would carry a
// relative error up to ~1e-4 into every probability. (A double accumulator
// inside the loop stops GCC from vectorising it.)
constexpr int kSumBlock = 256;

float row_sum_exp(const float* z, int V, float m) {
  double total = 0.0;
  for (int j0 = 0; j0 < V; j0 += kSumBlock) {
    const int j1 = std::min(V, j0 + kSumBlock);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int j = j0; j < j1; ++j) s += cpu::exp_nonpositive(z[j] - m);
    total += s;
  }
  return static_cast<float>(total);
}

// z_j ← exp(z_j - m) for j < V; returns Σ_j exp(z_j - m) (as row_sum_exp),
// in double: the vocabulary-parallel loss adds the ranks' sums before rounding.
double row_exp_in_place_double(float* z, int V, float m) {
  double total = 0.0;
  for (int j0 = 0; j0 < V; j0 += kSumBlock) {
    const int j1 = std::min(V, j0 + kSumBlock);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int j = j0; j < j1; ++j) {
      const float e = cpu::exp_nonpositive(z[j] - m);
      z[j] = e;
      s += e;
    }
    total += s;
  }
  return total;
}

float row_exp_in_place(float* z, int V, float m) { return static_cast<float>(row_exp_in_place_double(z, V, m)); }

// z_j ← z_j·scale for j < V, 0 for the padding V ≤ j < Vp.
void row_scale_and_clear_padding(float* z, int V, int Vp, float scale) {
  for (int j = 0; j < V; ++j) z[j] *= scale;
  for (int j = V; j < Vp; ++j) z[j] = 0.0f;
}

void check_args(const int32_t* targets, int64_t N, int V, int Vp) {
  LATTICE_CHECK(N >= 0 && V > 0 && Vp >= V,
                "crossentropy: need N >= 0 and 0 < V <= Vp, got N=" << N << " V=" << V << " Vp=" << Vp);
  for (int64_t i = 0; i < N; ++i)
    LATTICE_CHECK(targets[i] >= 0 && targets[i] < V,
                  "crossentropy: targets[" << i << "]=" << targets[i] << " is outside [0, V=" << V << ")");
}

}  // namespace

void crossentropy_forward(float* losses, const float* logits, const int32_t* targets, int64_t N, int V, int Vp) {
  check_args(targets, N, V, Vp);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* z = logits + i * Vp;
    const int32_t target = targets[i];
    const float m = cpu::simd([&] { return row_max(z, V); });
    const float s = cpu::simd([&] { return row_sum_exp(z, V, m); });
    losses[i] = m + std::log(s) - z[target];
  }
}

void crossentropy_forward_backward(float* logits_inout, float* losses, const int32_t* targets, int64_t N, int V,
                                   int Vp, float dloss) {
  check_args(targets, N, V, Vp);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    float* z = logits_inout + i * Vp;
    const int32_t target = targets[i];
    const float z_target = z[target];
    const float m = cpu::simd([&] { return row_max(z, V); });
    const float s = cpu::simd([&] { return row_exp_in_place(z, V, m); });  // the row stays in L2 for the next pass
    losses[i] = m + std::log(s) - z_target;
    cpu::simd([&] { return row_scale_and_clear_padding(z, V, Vp, dloss / s); });
    z[target] -= dloss;
  }
}

// ---- vocabulary-parallel pieces (the same row passes, on this rank's columns) ----

void crossentropy_local_max(float* row_max_out, double* target_logit, const float* logits, const int32_t* targets,
                            int64_t N, int64_t first, int real, int ld) {
  LATTICE_CHECK(N >= 0 && real >= 0 && real <= ld, "crossentropy_local_max: need 0 <= real <= ld, got real="
                                                        << real << " ld=" << ld);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* z = logits + i * ld;
    row_max_out[i] = real > 0 ? cpu::simd([&] { return row_max(z, real); }) : -INFINITY;
    const int64_t local = static_cast<int64_t>(targets[i]) - first;
    target_logit[i] = local >= 0 && local < real ? static_cast<double>(z[local]) : 0.0;
  }
}

void crossentropy_local_exp(float* logits_inout, double* sum_exp, const float* m, int64_t N, int real, int ld) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    float* z = logits_inout + i * ld;
    sum_exp[i] = real > 0 ? cpu::simd([&] { return row_exp_in_place_double(z, real, m[i]); }) : 0.0;
  }
}

void crossentropy_local_grad(float* logits_inout, const double* sum_exp, const int32_t* targets, int64_t N,
                             int64_t first, int real, int ld, float dloss) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    float* z = logits_inout + i * ld;
    const float s = static_cast<float>(sum_exp[i]);
    cpu::simd([&] { return row_scale_and_clear_padding(z, real, ld, dloss / s); });
    const int64_t local = static_cast<int64_t>(targets[i]) - first;
    if (local >= 0 && local < real) z[local] -= dloss;
  }
}

}  // namespace lattice::kernels
