#include <gtest/gtest.h>

#include <cmath>

#include "lattice/core/rng.h"

using namespace lattice;

TEST(Rng, PhiloxKnownAnswer) {
  // Known-answer vectors from the Random123 distribution (kat_vectors, philox4x32 10 rounds).
  auto r = philox4x32({0, 0}, {0, 0, 0, 0});
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
  r = philox4x32({0xa4093822u, 0x299f31d0u}, {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u});
  EXPECT_EQ(r[0], 0xd16cfe09u);
  EXPECT_EQ(r[1], 0x94fdccebu);
  EXPECT_EQ(r[2], 0x5001e420u);
  EXPECT_EQ(r[3], 0x24126ea1u);
}

TEST(Rng, InitDependsOnlyOnSeedNameIndex) {
  float a = init_normal(1337, "h.0.attn.c_attn.weight", 12345);
  EXPECT_EQ(a, init_normal(1337, "h.0.attn.c_attn.weight", 12345));
  EXPECT_NE(a, init_normal(1337, "h.0.attn.c_attn.weight", 12346));
  EXPECT_NE(a, init_normal(1337, "h.1.attn.c_attn.weight", 12345));
  EXPECT_NE(a, init_normal(1338, "h.0.attn.c_attn.weight", 12345));
}

TEST(Rng, NormalMoments) {
  double sum = 0, sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; i++) {
    double x = init_normal(7, "w", i);
    sum += x;
    sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sq / n, 1.0, 0.01);
}

TEST(Rng, StreamIsReproducibleFromCounter) {
  Rng a(42, 3);
  for (int i = 0; i < 8; i++) a.next_u32();  // two whole blocks
  uint64_t c = a.counter();
  EXPECT_EQ(c, 2u);
  uint32_t x = a.next_u32();
  Rng b(42, 3);
  b.set_counter(c);
  EXPECT_EQ(b.next_u32(), x);
  for (int i = 0; i < 1000; i++) ASSERT_LT(a.next_below(7), 7u);
}
