// Element types: f32, bf16, f16, and exact round-to-nearest-even conversions.
//
// bf16 is the top half of an f32 (8-bit exponent, 7-bit mantissa); f16 is IEEE
// binary16 (5-bit exponent, 10-bit mantissa, subnormals below 2^-14). Both
// conversions from f32 round to nearest, ties to even, keep NaN a (quiet) NaN
// and map overflow to infinity, exactly as hardware converters do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace lattice {

enum class DType : uint8_t { F32, BF16, F16 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "f32", "bf16", "f16"
// Parses "f32"/"fp32"/"float32", "bf16"/"bfloat16", "f16"/"fp16"/"float16";
// throws lattice::Error naming the accepted spellings otherwise.
DType parse_dtype(const std::string& name);

uint16_t f32_to_bf16(float x);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_f16(float x);
float f16_to_f32(uint16_t h);

// Bulk conversions between buffers of the given dtypes (same element count).
void convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n);

}  // namespace lattice
