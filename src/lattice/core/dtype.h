// Element types: f32, bf16, f16, and exact round-to-nearest-even conversions.
//
// bf16 is the top half of an f32 (8-bit exponent, 7-bit mantissa); f16 is IEEE
// binary16 (5-bit exponent, 10-bit mantissa, subnormals below 2^-14). Both
// conversions from f32 round to nearest, ties to even, keep NaN a (quiet) NaN
// and map overflow to infinity, exactly as hardware converters do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace lattice {

// F64 exists for scalars that cross the wire (loss sums, the squared
// gradient norm); tensors are f32, bf16 or f16.
enum class DType : uint8_t { F32, BF16, F16, F64 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "f32", "bf16", "f16", "f64"
// Parses "f32"/"fp32"/"float32", "bf16"/"bfloat16", "f16"/"fp16"/"float16";
// throws lattice::Error naming the accepted spellings otherwise.
DType parse_dtype(const std::string& name);

// bf16 conversions are inline: they sit in hot loops (the bf16 reduction of
// every all-reduce, bulk casts) that must vectorise.
inline uint16_t f32_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    // NaN: keep the sign and top mantissa bits, force the quiet bit so that a
    // NaN whose payload lives only in the low bits does not become infinity.
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  // Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate.
  // Overflow of the rounding carries into the exponent and yields inf.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
uint16_t f32_to_f16(float x);
float f16_to_f32(uint16_t h);

// x rounded to t and back (t = F32, F64: x itself), as kernels::round_to does in bulk.
inline float round_to_dtype(float x, DType t) {
  if (t == DType::BF16) return bf16_to_f32(f32_to_bf16(x));
  if (t == DType::F16) return f16_to_f32(f32_to_f16(x));
  return x;
}

// Bulk conversions between buffers of the given dtypes (same element count).
void convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n);

}  // namespace lattice
