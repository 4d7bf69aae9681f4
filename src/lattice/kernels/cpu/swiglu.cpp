// SwiGLU, the gated MLP activation of Llama: the fused gate/up projection's
// output row n is [g_n (F values) | u_n (F values)] and
//   h_nf = silu(g_nf) · u_nf ,  silu(g) = g·σ(g) ,  σ(g) = 1/(1 + e^{-g})
// Backward (σ' = σ·(1 - σ)):
//   dg = dh · u · silu'(g) ,  silu'(g) = σ + g·σ·(1 - σ) = σ·(1 + g·(1 - σ))
//   du = dh · silu(g)
//
// Numerics. With e = e^{-|g|} ∈ (0, 1], which cannot overflow (e^{-g} does
// for g < -88.7):
//   σ(g) = 1/(1 + e) for g ≥ 0, e/(1 + e) for g < 0, and 1 - σ(g) is the other one,
// so 1 - σ is never formed by a subtraction (1 - 0.99995 keeps only a few
// digits) and no intermediate is inf or NaN for any finite g. silu itself is
// (g or g·e)/(1 + e): for g ≥ 0 the single rounding of PyTorch's
// x/(1 + exp(-x)). Below g = -87.3 exp_nonpositive flushes e to 0, so silu
// and its derivative are 0 there (their true magnitudes are < 1e-36).
#include <omp.h>

#include <cmath>

#include "lattice/core/error.h"
#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/cpu/vec_math.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

// Below this many output elements an OpenMP region costs more than it saves.
constexpr int64_t kSerialBelow = 1 << 15;

void forward_row(float* out, const float* gate, const float* up, int F) {
  for (int f = 0; f < F; ++f) {
    const float g = gate[f];
    const float e = cpu::exp_nonpositive(-std::fabs(g));
    const float silu = (g >= 0.0f ? g : g * e) / (1.0f + e);
    out[f] = silu * up[f];
  }
}

void backward_row(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int F) {
  for (int f = 0; f < F; ++f) {
    const float g = gate[f];
    const float e = cpu::exp_nonpositive(-std::fabs(g));
    const float inv = 1.0f / (1.0f + e);
    const float sigma = g >= 0.0f ? inv : e * inv;
    const float one_minus_sigma = g >= 0.0f ? e * inv : inv;
    dgate[f] = (dout[f] * up[f]) * (sigma * (1.0f + g * one_minus_sigma));
    dup[f] = dout[f] * (g * sigma);
  }
}

void check_args(const char* what, int64_t N, int F) {
  LATTICE_CHECK(N >= 0 && F > 0, what << ": need N >= 0 and F > 0, got N=" << N << " F=" << F);
}

}  // namespace

void swiglu_forward(float* out, const float* inp, int64_t N, int F) {
  check_args("swiglu_forward", N, F);
  const int64_t row = 2 * static_cast<int64_t>(F);
#pragma omp parallel for schedule(static) if (N * F >= kSerialBelow && !omp_in_parallel())
  for (int64_t n = 0; n < N; ++n)
    cpu::simd([&] { return forward_row(out + n * F, inp + n * row, inp + n * row + F, F); });
}

void swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int F) {
  check_args("swiglu_backward", N, F);
  const int64_t row = 2 * static_cast<int64_t>(F);
#pragma omp parallel for schedule(static) if (N * F >= kSerialBelow && !omp_in_parallel())
  for (int64_t n = 0; n < N; ++n)
    cpu::simd([&] {
      return backward_row(dinp + n * row, dinp + n * row + F, dout + n * F, inp + n * row, inp + n * row + F, F);
    });
}

}  // namespace lattice::kernels
