#include "lattice/core/rng.h"

#include <cmath>

namespace lattice {

uint64_t hash_name(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 2> key, std::array<uint32_t, 4> ctr) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; round++) {
    uint64_t p0 = static_cast<uint64_t>(kM0) * ctr[0];
    uint64_t p1 = static_cast<uint64_t>(kM1) * ctr[2];
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
    key[0] += kW0;
    key[1] += kW1;
  }
  return ctr;
}

static std::array<uint32_t, 2> key_of(uint64_t seed, uint64_t salt) {
  uint64_t k = seed * 0x9E3779B97F4A7C15ull ^ salt;
  return {static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}

float init_normal_hashed(uint64_t seed, uint64_t name_hash, uint64_t index) {
  auto r = philox4x32(key_of(seed, name_hash),
                      {static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), 0x1A77u, 0});
  // Box-Muller on two uniforms; the result is computed in double so that it is
  // the same on every platform and compiler setting.
  double u1 = uniform_from_bits(r[0]);
  double u2 = uniform_from_bits(r[1]);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

float init_normal(uint64_t seed, const std::string& name, uint64_t index) {
  return init_normal_hashed(seed, hash_name(name), index);
}

uint32_t Rng::next_u32() {
  if (have_ == 0) {
    block_ = philox4x32(key_of(seed_, stream_ + 0x5EED),
                        {static_cast<uint32_t>(counter_), static_cast<uint32_t>(counter_ >> 32), 0, 0});
    counter_++;
    have_ = 4;
  }
  return block_[--have_];
}

uint64_t Rng::next_u64() {
  uint64_t hi = next_u32();
  return (hi << 32) | next_u32();
}

float Rng::next_uniform() { return uniform_from_bits(next_u32()); }

float Rng::next_normal() {
  double u1 = next_uniform(), u2 = next_uniform();
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

uint64_t Rng::next_below(uint64_t n) {
  // Rejection sampling removes modulo bias.
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do {
    x = next_u64();
  } while (x >= limit);
  return x % n;
}

}  // namespace lattice
