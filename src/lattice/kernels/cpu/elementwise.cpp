// GELU (tanh approximation), residual add, scaling, the sum of squares, and
// the 16-bit storage casts of mixed precision.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "lattice/core/error.h"
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


// ---- 16-bit storage ----------------------------------------------------------

namespace {

// bf16 in integer arithmetic (GCC vectorises it at every level): round to
// nearest even at bit 16, NaN kept a quiet NaN (core/dtype.h's f32_to_bf16).
inline __attribute__((always_inline)) uint32_t bf16_rounded_bits(uint32_t u) {
  const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  return nan ? ((u | 0x00400000u) & 0xffff0000u) : rounded;
}

void bf16_round_range(float* x, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    u = bf16_rounded_bits(u);
    std::memcpy(x + i, &u, 4);
  }
}
void bf16_store_range(const float* x, uint16_t* d, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    d[i] = static_cast<uint16_t>(bf16_rounded_bits(u) >> 16);
  }
}
void bf16_load_range(const uint16_t* s, float* x, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(x + i, &u, 4);
  }
}

// f16 through the F16C converters (round to nearest even, overflow to inf,
// subnormals kept, NaN quiet), 16 or 8 values at a time; the scalar
// converters of core/dtype.h for the tail and on SSE2.
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
// GCC 12's AVX-512 conversion intrinsics start from an "undefined" register it then warns about.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target(LATTICE_TARGET_AVX512))) void f16_store_avx512(const float* x, uint16_t* d, int64_t b,
                                                                      int64_t e) {
  for (; b + 16 <= e; b += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + b),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + b), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; b < e; ++b) d[b] = f32_to_f16(x[b]);
}
__attribute__((target(LATTICE_TARGET_AVX512))) void f16_load_avx512(const uint16_t* s, float* x, int64_t b,
                                                                     int64_t e) {
  for (; b + 16 <= e; b += 16)
    _mm512_storeu_ps(x + b, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b))));
  for (; b < e; ++b) x[b] = f16_to_f32(s[b]);
}
__attribute__((target(LATTICE_TARGET_AVX2))) void f16_store_avx2(const float* x, uint16_t* d, int64_t b, int64_t e) {
  for (; b + 8 <= e; b += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + b),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + b), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; b < e; ++b) d[b] = f32_to_f16(x[b]);
}
__attribute__((target(LATTICE_TARGET_AVX2))) void f16_load_avx2(const uint16_t* s, float* x, int64_t b, int64_t e) {
  for (; b + 8 <= e; b += 8)
    _mm256_storeu_ps(x + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b))));
  for (; b < e; ++b) x[b] = f16_to_f32(s[b]);
}
#pragma GCC diagnostic pop
#define LATTICE_HAVE_F16C_PATHS 1
#endif

void f16_store_range(const float* x, uint16_t* d, int64_t b, int64_t e) {
#ifdef LATTICE_HAVE_F16C_PATHS
  switch (active_isa()) {
    case Isa::Avx512: return f16_store_avx512(x, d, b, e);
    case Isa::Avx2: return f16_store_avx2(x, d, b, e);
    case Isa::Baseline: break;
  }
#endif
  for (; b < e; ++b) d[b] = f32_to_f16(x[b]);
}
void f16_load_range(const uint16_t* s, float* x, int64_t b, int64_t e) {
#ifdef LATTICE_HAVE_F16C_PATHS
  switch (active_isa()) {
    case Isa::Avx512: return f16_load_avx512(s, x, b, e);
    case Isa::Avx2: return f16_load_avx2(s, x, b, e);
    case Isa::Baseline: break;
  }
#endif
  for (; b < e; ++b) x[b] = f16_to_f32(s[b]);
}

void check_16bit(DType t, const char* what) {
  LATTICE_CHECK(t == DType::BF16 || t == DType::F16,
                what << ": 16-bit storage is bf16 or f16, not " << dtype_name(t));
}

}  // namespace

void round_to(DType t, float* x, int64_t n) {
  if (t == DType::F32) return;
  check_16bit(t, "round_to");
  if (t == DType::BF16) {
    parallel_ranges(n, [&](int64_t b, int64_t e) { cpu::simd([&] { return bf16_round_range(x, b, e); }); });
    return;
  }
  // f16: through a small 16-bit buffer per block (the F16C converters are exact both ways).
  parallel_ranges(n, [&](int64_t b, int64_t e) {
    uint16_t tmp[1024];
    for (int64_t i = b; i < e; i += 1024) {
      const int64_t m = std::min<int64_t>(1024, e - i);
      f16_store_range(x + i, tmp, 0, m);
      f16_load_range(tmp, x + i, 0, m);
    }
  });
}

void store_16bit(DType t, const float* x, void* dst, int64_t n) {
  check_16bit(t, "store_16bit");
  uint16_t* d = static_cast<uint16_t*>(dst);
  if (t == DType::BF16)
    parallel_ranges(n, [&](int64_t b, int64_t e) { cpu::simd([&] { return bf16_store_range(x, d, b, e); }); });
  else
    parallel_ranges(n, [&](int64_t b, int64_t e) { f16_store_range(x, d, b, e); });
}

void load_16bit(DType t, const void* src, float* x, int64_t n) {
  check_16bit(t, "load_16bit");
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (t == DType::BF16)
    parallel_ranges(n, [&](int64_t b, int64_t e) { cpu::simd([&] { return bf16_load_range(s, x, b, e); }); });
  else
    parallel_ranges(n, [&](int64_t b, int64_t e) { f16_load_range(s, x, b, e); });
}

}  // namespace lattice::kernels
