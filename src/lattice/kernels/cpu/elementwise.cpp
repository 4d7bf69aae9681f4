// GELU (tanh approximation), residual add, scaling, and the sum of squares.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "lattice/core/memory.h"
#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/cpu/vec_math.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

// Below this many elements an OpenMP region costs more than it saves.
constexpr int64_t kSerialBelow = 1 << 15;

constexpr float kGeluScale = 0.7978845608028654f;  // √(2/π)
constexpr float kGeluCubic = 0.044715f;

// With E = e^{2u}: 0.5·(1 + tanh u) = E/(E + 1) = σ(2u) and
// 1 - tanh²u = 4E/(E + 1)². Writing GELU through σ(2u) instead of 1 + tanh
// avoids the cancellation of 1 + tanh(u) for negative x, which the derivative
// multiplies by x·du/dx. 2u is capped at 40 (σ = 1 in float from there on;
// 1/(E + 1) stays a normal float); below -87.3 exp_approx flushes E to 0.
static inline __attribute__((always_inline)) float exp_2u(float x) {
  float two_u = 2.0f * kGeluScale * (x + kGeluCubic * x * x * x);
  two_u = two_u > 40.0f ? 40.0f : two_u;
  return cpu::exp_approx(two_u);
}

// gelu(x) = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) = x·σ(2u)
void gelu_forward_range(float* out, const float* inp, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float x = inp[i];
    const float e = exp_2u(x);
    out[i] = x * (e / (e + 1.0f));
  }
}

// gelu'(x) = 0.5·(1 + t) + 0.5·x·(1 - t²)·du/dx,  t = tanh(u), du/dx = √(2/π)·(1 + 3·0.044715·x²)
//          = σ(2u)·(1 + 2·x·du/dx/(E + 1))
// For |x| ≥ 10, gelu' is exactly 1 or 0 in float, so x is clamped to ±10
// first; that keeps x·x² from overflowing into 0·inf = NaN for huge inputs.
void gelu_backward_range(float* dinp, const float* inp, const float* dout, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float x = inp[i];
    x = x > 10.0f ? 10.0f : x;
    x = x < -10.0f ? -10.0f : x;
    const float e = exp_2u(x);
    const float inv = 1.0f / (e + 1.0f);
    const float sigma = e * inv;
    const float du_dx = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    dinp[i] = dout[i] * (sigma * (1.0f + 2.0f * x * du_dx * inv));
  }
}

void add_range(float* out, const float* a, const float* b, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) out[i] = a[i] + b[i];
}

void scale_range(float* a, float s, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] *= s;
}

// Σ x² in double with 32 independent partial sums (lane l takes the elements
// ≡ l mod 32): four 8-wide double FMA chains keep the FMA units busy where a
// single accumulator would wait on its latency, and because the lanes are
// explicit the result is the same on every instruction set.
double sum_squares_range(const float* x, int64_t begin, int64_t end) {
  constexpr int kLanes = 32;
  double lanes[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const double v = x[i + l];
      lanes[l] += v * v;
    }
  double tail = 0.0;
  for (; i < end; ++i) tail += static_cast<double>(x[i]) * x[i];
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total + tail;
}

// Runs fn(begin, end) over [0, n): one contiguous range per thread, or inline
// when n is small. Used only where the result does not depend on the split.
template <typename Fn>
void parallel_ranges(int64_t n, Fn fn) {
  if (n < kSerialBelow || omp_get_max_threads() == 1 || omp_in_parallel()) {
    fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel
  {
    int64_t begin, end;
    cpu::split_range(n, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    // Round the boundary to 16 floats (a cache line) so threads never share one.
    begin = begin == 0 ? 0 : std::min(n, (begin + 15) / 16 * 16);
    end = end == n ? n : std::min(n, (end + 15) / 16 * 16);
    if (begin < end) fn(begin, end);
  }
}

}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
  parallel_ranges(n, [&](int64_t b, int64_t e) { cpu::simd([&] { return gelu_forward_range(out, inp, b, e); }); });
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  parallel_ranges(n, [&](int64_t b, int64_t e) { cpu::simd([&] { return gelu_backward_range(dinp, inp, dout, b, e); }); });
}

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
  parallel_ranges(n, [&](int64_t s, int64_t e) { cpu::simd([&] { return add_range(out, a, b, s, e); }); });
}

void add_inplace(float* a, const float* b, int64_t n) {
  parallel_ranges(n, [&](int64_t s, int64_t e) { cpu::simd([&] { return add_range(a, a, b, s, e); }); });
}

void scale_inplace(float* a, float s, int64_t n) {
  parallel_ranges(n, [&](int64_t b, int64_t e) { cpu::simd([&] { return scale_range(a, s, b, e); }); });
}

// Fixed 64Ki-element chunks, each summed (in double) on its own, then the chunk
// sums added in index order: the result is the same for every thread count.
double sum_squares(const float* x, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  if (chunks <= 1) return cpu::simd([&] { return sum_squares_range(x, 0, n); });
  thread_local Buffer partials;
  if (partials.bytes() < sizeof(double) * chunks) partials.ensure(sizeof(double) * chunks, MemCategory::Workspace);
  double* part = partials.as<double>();
#pragma omp parallel for schedule(static) if (!omp_in_parallel())
  for (int64_t c = 0; c < chunks; ++c) part[c] = cpu::simd([&] { return sum_squares_range(x, c * kChunk, std::min(n, (c + 1) * kChunk)); });
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += part[c];
  return total;
}

}  // namespace lattice::kernels
