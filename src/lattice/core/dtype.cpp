#include "lattice/core/dtype.h"

#include <cstring>

#include "lattice/core/error.h"

namespace lattice {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::F64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::F64: return "f64";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "f32" || name == "fp32" || name == "float32") return DType::F32;
  if (name == "bf16" || name == "bfloat16") return DType::BF16;
  if (name == "f16" || name == "fp16" || name == "float16") return DType::F16;
  LATTICE_FAIL("unknown dtype '" << name << "' (valid: f32, bf16, f16)");
}

static uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
static float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

uint16_t f32_to_f16(float x) {
  uint32_t u = bits_of(x);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in f16: value = m * 2^-24. Shift the full
    // 24-bit significand right with round-to-nearest-even.
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to 0
    uint32_t exp = abs >> 23;                       // biased f32 exponent, 102..112
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;  // 24-bit significand
    uint32_t shift = 126 - exp;                     // 14..24
    uint32_t kept = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (kept & 1u))) kept++;
    return static_cast<uint16_t>(sign | kept);
  }
  // Normal: rebias exponent (127 -> 15) and round the 23-bit mantissa to 10 bits.
  uint32_t r = abs - 0x38000000u;  // exponent - 112 in place
  uint32_t lsb = (r >> 13) & 1u;
  r += 0xfffu + lsb;
  return static_cast<uint16_t>(sign | (r >> 13));
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    if (mant == 0) return float_of(sign);
    // Subnormal: mant * 2^-24, exact in f32.
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return float_of(sign | ((exp + 112) << 23) | (mant << 13));
}

void convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  if (src_type == dst_type) {
    std::memcpy(dst, src, n * dtype_size(src_type));
    return;
  }
  LATTICE_CHECK(src_type != DType::F64 && dst_type != DType::F64,
                "convert: " << dtype_name(src_type) << " -> " << dtype_name(dst_type)
                            << " is not supported (f64 is for scalars on the wire)");
  if (src_type == DType::F32) {
    const float* s = static_cast<const float*>(src);
    uint16_t* d = static_cast<uint16_t*>(dst);
    if (dst_type == DType::BF16) {
#pragma omp parallel for schedule(static) if (n > (1u << 16))
      for (size_t i = 0; i < n; i++) d[i] = f32_to_bf16(s[i]);
    } else {
#pragma omp parallel for schedule(static) if (n > (1u << 16))
      for (size_t i = 0; i < n; i++) d[i] = f32_to_f16(s[i]);
    }
    return;
  }
  if (dst_type == DType::F32) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    float* d = static_cast<float*>(dst);
    if (src_type == DType::BF16) {
#pragma omp parallel for schedule(static) if (n > (1u << 16))
      for (size_t i = 0; i < n; i++) d[i] = bf16_to_f32(s[i]);
    } else {
#pragma omp parallel for schedule(static) if (n > (1u << 16))
      for (size_t i = 0; i < n; i++) d[i] = f16_to_f32(s[i]);
    }
    return;
  }
  // bf16 <-> f16 goes through f32 (exact widening, one rounding).
  const uint16_t* s = static_cast<const uint16_t*>(src);
  uint16_t* d = static_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; i++) {
    float v = src_type == DType::BF16 ? bf16_to_f32(s[i]) : f16_to_f32(s[i]);
    d[i] = dst_type == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
  }
}

}  // namespace lattice
