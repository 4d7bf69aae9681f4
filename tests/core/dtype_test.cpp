#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "lattice/core/dtype.h"

using namespace lattice;

static float f(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

// Reference: exact rounding done in double arithmetic, independent of the bit tricks.
static uint16_t bf16_reference(float x) {
  if (std::isnan(x)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  float lo = f(u & 0xffff0000u), hi = f((u & 0xffff0000u) + 0x10000u);
  double dlo = std::fabs(static_cast<double>(x) - lo), dhi = std::fabs(static_cast<double>(hi) - x);
  uint16_t lo_bits = static_cast<uint16_t>(u >> 16);
  if (dlo < dhi) return lo_bits;
  if (dhi < dlo) return static_cast<uint16_t>(lo_bits + 1);
  return (lo_bits & 1) ? static_cast<uint16_t>(lo_bits + 1) : lo_bits;
}

TEST(DType, Bf16EdgeCases) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // NaN whose payload is only in the low 16 bits must stay NaN, not become inf.
  uint16_t n = f32_to_bf16(f(0x7f800001u));
  EXPECT_TRUE(std::isnan(bf16_to_f32(n)));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  // Ties: 1 + 2^-8 is exactly between 1 and 1+2^-7 -> even (1.0).
  EXPECT_EQ(f32_to_bf16(f(0x3f808000u)), 0x3f80);
  // 1 + 3*2^-8 is between 1+2^-7 (odd) and 1+2^-6 -> even (up).
  EXPECT_EQ(f32_to_bf16(f(0x3f818000u)), 0x3f82);
  // Just above a tie rounds up.
  EXPECT_EQ(f32_to_bf16(f(0x3f808001u)), 0x3f81);
  // Largest finite rounds to inf.
  EXPECT_EQ(f32_to_bf16(f(0x7f7fffffu)), 0x7f80);
  // Subnormals are kept (bf16 has the f32 exponent range).
  EXPECT_EQ(f32_to_bf16(f(0x00010000u)), 0x0001);
  EXPECT_EQ(bf16_to_f32(0x0001), f(0x00010000u));
}

TEST(DType, Bf16MatchesReferenceOnManyValues) {
  for (uint32_t u = 0; u < 0xff800000u; u += 0x3f3f3) {
    float x = f(u);
    if (std::isnan(x)) continue;
    ASSERT_EQ(f32_to_bf16(x), bf16_reference(x)) << std::hex << u;
  }
}

TEST(DType, F16EdgeCases) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);          // largest finite
  EXPECT_EQ(f32_to_f16(65519.99f), 0x7bff);         // below the tie: stays finite
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);          // tie to even -> inf
  EXPECT_EQ(f32_to_f16(1e10f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f(0x7f800001u)))));
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie between 0 and 2^-24 -> even (0)
  EXPECT_EQ(f32_to_f16(std::ldexp(1.5f, -25)), 0x0001);  // above the tie
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: tie -> even (2)
  EXPECT_EQ(f32_to_f16(std::ldexp(5.0f, -25)), 0x0002);  // 2.5 units: tie -> even (2)
  // Ties in the normal range: 1 + 2^-11 -> 1.0 ; 1 + 3*2^-11 -> 1 + 2^-9.
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(f16_to_f32(0x7c00), std::numeric_limits<float>::infinity());
}

TEST(DType, F16RoundTripOfEveryHalf) {
  for (uint32_t h = 0; h < 0x10000; h++) {
    float x = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(x)) continue;
    ASSERT_EQ(f32_to_f16(x), h) << std::hex << h;
  }
}

TEST(DType, F16IsNearest) {
  // For many f32 values, the chosen half is at least as close as its neighbours.
  for (uint32_t u = 0x33000000u; u < 0x477ff000u; u += 0x1357u) {
    float x = f(u);
    uint16_t h = f32_to_f16(x);
    double err = std::fabs(static_cast<double>(f16_to_f32(h)) - x);
    if (h > 0) {
      ASSERT_LE(err, std::fabs(static_cast<double>(f16_to_f32(h - 1)) - x)) << std::hex << u;
    }
    if (h < 0x7bff) {
      ASSERT_LE(err, std::fabs(static_cast<double>(f16_to_f32(h + 1)) - x)) << std::hex << u;
    }
  }
}

TEST(DType, ParseNamesAndErrors) {
  EXPECT_EQ(parse_dtype("bf16"), DType::BF16);
  EXPECT_EQ(parse_dtype("fp16"), DType::F16);
  EXPECT_EQ(parse_dtype("float32"), DType::F32);
  try {
    parse_dtype("int8");
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("'int8'"), std::string::npos);
  }
}
