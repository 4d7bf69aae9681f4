// AdamW (Loshchilov & Hutter), in PyTorch's operation order (torch.optim.AdamW,
// foreach=False), so that a parity test against PyTorch agrees to rounding:
//   g = grad·grad_scale
//   p ← p·(1 - lr·wd)                         decoupled weight decay
//   m ← β1·m + (1-β1)·g ; v ← β2·v + (1-β2)·g²
//   p ← p - (lr/bc1) · m / (sqrt(v)/sqrt(bc2) + eps)     bc_k = 1 - β_k^t
// which equals ops.h's p -= lr·(m̂/(sqrt(v̂)+eps) + wd·p) with m̂ = m/bc1, v̂ = v/bc2.
// The bias corrections are computed in double once per call. Memory-bound:
// reads p, g, m, v and writes p, m, v (28 bytes per parameter).
//
// adamw_momentum_update is 1-bit Adam's step after its warm-up: the momentum
// arrives already formed (averaged over the data-parallel ranks), v is frozen
//   m ← momentum
//   p ← p·(1 - lr·wd) - (lr/bc1) · m / (sqrt(max(v̂, m̂²)) + eps)
// with v̂ = v/bc2(t_v), bc2 taken at the step t_v where v stopped changing,
// and m̂ = m/bc1. The max restores what live Adam keeps, |m̂| ≲ sqrt(v̂), where
// a gradient has outgrown its frozen v (see ops.h).
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "lattice/core/error.h"
#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/cpu/vec_math.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

struct AdamWCoefficients {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, step_size, sqrt_bc2, grad_scale, lift;
};

void adamw_range(float* param, const float* grad, float* m, float* v, int64_t begin, int64_t end,
                 AdamWCoefficients k) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = grad[i] * k.grad_scale;
    const float mi = k.beta1 * m[i] + k.one_minus_beta1 * g;
    const float vi = k.beta2 * v[i] + k.one_minus_beta2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = cpu::sqrt_approx(vi) / k.sqrt_bc2 + k.eps;  // (vectorises; std::sqrt does not)
    param[i] = param[i] * k.decay - k.step_size * (mi / denom);
  }
}

void adamw_momentum_range(float* param, const float* momentum, float* m, const float* v, int64_t begin, int64_t end,
                          AdamWCoefficients k) {
  for (int64_t i = begin; i < end; ++i) {
    const float mi = momentum[i];
    m[i] = mi;
    // v̂ lifted to m̂² where the momentum has outgrown it (k.lift = bc2/bc1²
    // turns m² into v's units): sqrt(max(v, lift·m²)) / sqrt(bc2)
    const float vi = std::max(v[i], k.lift * mi * mi);
    const float denom = cpu::sqrt_approx(vi) / k.sqrt_bc2 + k.eps;
    param[i] = param[i] * k.decay - k.step_size * (mi / denom);
  }
}

// Runs range(begin, end) over [0, n): one SIMD call when small (or already
// inside a parallel region), else split over the OpenMP threads at multiples
// of 16 elements.
template <class Range>
void over_threads(int64_t n, const Range& range) {
  if (n < (1 << 15) || omp_in_parallel()) return cpu::simd([&] { return range(0, n); });
#pragma omp parallel
  {
    int64_t begin, end;
    cpu::split_range(n, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    begin = begin == 0 ? 0 : std::min(n, (begin + 15) / 16 * 16);
    end = end == n ? n : std::min(n, (end + 15) / 16 * 16);
    if (begin < end) cpu::simd([&] { return range(begin, end); });
  }
}

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, int64_t step, float grad_scale) {
  LATTICE_CHECK(step >= 1, "adamw_update: step must be >= 1 (bias correction 1 - beta^step), got " << step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  AdamWCoefficients k;
  k.beta1 = beta1;
  k.beta2 = beta2;
  k.one_minus_beta1 = 1.0f - beta1;
  k.one_minus_beta2 = 1.0f - beta2;
  k.eps = eps;
  k.decay = static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay);
  k.step_size = static_cast<float>(lr / bc1);
  k.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  k.grad_scale = grad_scale;
  over_threads(n, [&](int64_t begin, int64_t end) { return adamw_range(param, grad, m, v, begin, end, k); });
}

void adamw_momentum_update(float* param, const float* momentum, float* m, const float* v, int64_t n, float lr,
                           float beta1, float beta2, float eps, float weight_decay, int64_t step,
                           int64_t variance_step) {
  LATTICE_CHECK(step >= 1 && variance_step >= 1,
                "adamw_momentum_update: step and variance_step must be >= 1, got " << step << " and " << variance_step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(variance_step));
  AdamWCoefficients k{};
  k.eps = eps;
  k.decay = static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay);
  k.step_size = static_cast<float>(lr / bc1);
  k.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  k.lift = static_cast<float>(bc2 / (bc1 * bc1));
  over_threads(n, [&](int64_t begin, int64_t end) { return adamw_momentum_range(param, momentum, m, v, begin, end, k); });
}

}  // namespace lattice::kernels
