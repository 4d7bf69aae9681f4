// Internal helpers shared by the CPU kernels: a vectorisable exp and sqrt,
// and work-splitting helpers. (The run-time choice of instruction set is in
// simd.h.)
#pragma once

#include <cstdint>
#include <cstring>

namespace lattice::kernels::cpu {

// The shared core of exp_approx and exp_nonpositive: x = n·ln2 + r with
// |r| ≤ ln2/2 (n rounded with the 1.5·2^23 trick, no SSE4.1 round needed;
// ln2 in a hi part exact in float and a lo part), returns the Cephes
// degree-6 polynomial for e^r and sets *n_int = n. x must be in [-87.3, 88.7].
static inline __attribute__((always_inline)) float exp_reduced(float x, int32_t* n_int) {
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  int32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, 4);
  *n_int = shifted_bits - 0x4B400000;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for float, ~1 ulp on [-87, 88], written with plain arithmetic and bit
// casts so that GCC vectorises loops calling it (libm's expf does not vectorise
// without -ffast-math). exp_reduced, then e^r scaled by 2^n built in the
// exponent bits.
// x ≤ -87.3 (incl. -inf) returns 0; x ≥ 88.7 returns +inf-free FLT_MAX-ish e^88.7.
static inline __attribute__((always_inline)) float exp_approx(float x) {
  const bool underflow = x < -87.3f;
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.7f ? 88.7f : x;
  int32_t n_int;
  const float p = exp_reduced(x, &n_int);
  // 2^n as float bits; n ∈ [-126, 128]: for n = 128 build 2^127 and double.
  const int32_t n_low = n_int > 127 ? 127 : n_int;
  const int32_t scale_bits = (n_low + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, 4);
  float result = p * scale;
  result *= n_int > 127 ? 2.0f : 1.0f;  // a select, not a branch: AVX2 has no masked multiply
  return underflow ? 0.0f : result;
}

// sqrt(x) for finite x ≥ 0, within ~2 ulp for normal x (0 → 0; subnormal x
// gives a value below 1e-19 instead of its true root, irrelevant next to any
// epsilon). libm's sqrtf must set errno for x < 0; GCC keeps that branch
// (and so does not vectorise the loop) unless the whole translation unit is
// built with -fno-math-errno, which per-function attributes cannot turn on.
// Reciprocal square root from the exponent bits (error ≤ 3.5%), three Newton
// steps y ← y·(1.5 - 0.5·x·y²) (→ 1.8e-3 → 5e-6 → float rounding), then x·y.
static inline __attribute__((always_inline)) float sqrt_approx(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = 0x5F375A86 - (bits >> 1);
  float y;
  std::memcpy(&y, &bits, 4);
  const float half_x = 0.5f * x;
  y = y * (1.5f - half_x * y * y);
  y = y * (1.5f - half_x * y * y);
  y = y * (1.5f - half_x * y * y);
  return x * y;
}

// exp(x) for x ≤ 0 (softmax numerators, x = s - max): the same polynomial as
// exp_approx without the overflow handling, which is a third of its
// instructions. x ≤ -87.3 (incl. -inf) gives 0.
static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
  const bool underflow = x < -87.3f;
  x = x < -87.3f ? -87.3f : x;
  int32_t n_int;
  const float p = exp_reduced(x, &n_int);
  const int32_t scale_bits = (n_int + 127) << 23;  // n ∈ [-126, 0]
  float scale;
  std::memcpy(&scale, &scale_bits, 4);
  return underflow ? 0.0f : p * scale;
}

// Splits [0, n) into `parts` nearly equal ranges; returns range `i`.
inline void split_range(int64_t n, int64_t parts, int64_t i, int64_t* begin, int64_t* end) {
  const int64_t base = n / parts, extra = n % parts;
  *begin = i * base + (i < extra ? i : extra);
  *end = *begin + base + (i < extra ? 1 : 0);
}

}  // namespace lattice::kernels::cpu
