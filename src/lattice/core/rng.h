// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011).
//
// A counter-based generator maps (key, counter) -> 128 random bits with no
// hidden state, which is what layout-independent initialisation needs: the
// initial value of element i of parameter "h.3.attn.c_attn.weight" is
//
//     init_normal(seed, "h.3.attn.c_attn.weight", i) * std
//
// whatever slice of the tensor a rank holds and in whatever order it fills it.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace lattice {

// 64-bit FNV-1a of a string: turns a parameter name into part of the key.
uint64_t hash_name(const std::string& name);

// One Philox4x32-10 block: 4 random 32-bit words for (key, counter).
std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 2> key, std::array<uint32_t, 4> counter);

// Uniform in (0, 1) from 32 random bits (never 0, so log() is safe).
inline float uniform_from_bits(uint32_t bits) { return (static_cast<float>(bits >> 8) + 0.5f) * (1.0f / 16777216.0f); }

// Standard normal N(0,1) for element `index` of the tensor named `name`.
float init_normal(uint64_t seed, const std::string& name, uint64_t index);
// Same with the name already hashed (hot loops hash once per tensor).
float init_normal_hashed(uint64_t seed, uint64_t name_hash, uint64_t index);

// A stateful stream for sampling and data order: (seed, stream id) is the key,
// a 64-bit counter advances. Its state is two integers, saved in checkpoints.
class Rng {
 public:
  Rng(uint64_t seed = 0, uint64_t stream = 0) : seed_(seed), stream_(stream) {}
  uint32_t next_u32();
  uint64_t next_u64();
  float next_uniform();  // (0, 1)
  float next_normal();
  // Uniform integer in [0, n).
  uint64_t next_below(uint64_t n);

  uint64_t seed() const { return seed_; }
  uint64_t stream() const { return stream_; }
  uint64_t counter() const { return counter_; }
  void set_counter(uint64_t c) {
    counter_ = c;
    have_ = 0;
  }

 private:
  uint64_t seed_, stream_, counter_ = 0;
  std::array<uint32_t, 4> block_{};
  int have_ = 0;  // unread words left in block_ (consumed from the back)
};

}  // namespace lattice
