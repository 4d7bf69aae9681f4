// Seeded random-mutation fuzzing of the shard header parser and the token
// checks: thousands of corrupted shards (flipped bytes, truncations, huge or
// negative counts, random headers). Nothing may crash or read out of bounds
// (run it under LATTICE_SANITIZE=ON), and every refusal is a lattice::Error.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "lattice/data/shard.h"
#include "test_util.h"

namespace lattice::data {
namespace {

std::vector<uint8_t> valid_shard(std::mt19937& gen, int tokens) {
  std::vector<uint16_t> t(tokens);
  for (auto& x : t) x = static_cast<uint16_t>(gen() % 50257);
  std::vector<uint8_t> bytes(kShardHeaderBytes + 2 * t.size(), 0);
  int32_t h[3] = {kShardMagic, kShardVersion, tokens};
  std::memcpy(bytes.data(), h, sizeof(h));
  if (!t.empty()) std::memcpy(bytes.data() + kShardHeaderBytes, t.data(), 2 * t.size());
  return bytes;
}

void mutate(std::mt19937& gen, std::vector<uint8_t>* bytes) {
  int mutations = 1 + gen() % 4;
  for (int m = 0; m < mutations; ++m) {
    switch (gen() % 7) {
      case 0:  // flip a bit anywhere
        if (!bytes->empty()) (*bytes)[gen() % bytes->size()] ^= static_cast<uint8_t>(1u << (gen() % 8));
        break;
      case 1:  // flip a bit of the first 12 header bytes (magic, version, count)
        if (bytes->size() >= 12) (*bytes)[gen() % 12] ^= static_cast<uint8_t>(1u << (gen() % 8));
        break;
      case 2:  // truncate
        bytes->resize(bytes->empty() ? 0 : gen() % bytes->size());
        break;
      case 3:  // append junk
        for (int i = 0, n = 1 + gen() % 16; i < n; ++i) bytes->push_back(static_cast<uint8_t>(gen()));
        break;
      case 4: {  // a huge, negative or off-by-one count
        if (bytes->size() < 12) break;
        const int32_t counts[] = {INT32_MAX, INT32_MIN, -1, 0, 1, static_cast<int32_t>(gen())};
        int32_t c = counts[gen() % 6];
        if (gen() % 2) {
          uint32_t old;  // off by one from the current count, wrapping like the bytes would
          std::memcpy(&old, bytes->data() + 8, 4);
          c = static_cast<int32_t>(old + (gen() % 2 ? 1u : 0xFFFFFFFFu));
        }
        std::memcpy(bytes->data() + 8, &c, 4);
        break;
      }
      case 5:  // a random version
        if (bytes->size() >= 8) {
          int32_t v = static_cast<int32_t>(gen() % 4);
          std::memcpy(bytes->data() + 4, &v, 4);
        }
        break;
      case 6:  // a token at or beyond the vocabulary
        if (bytes->size() > kShardHeaderBytes + 1) {
          size_t i = kShardHeaderBytes + 2 * (gen() % ((bytes->size() - kShardHeaderBytes) / 2));
          uint16_t t = static_cast<uint16_t>(50257 + gen() % (65536 - 50257));
          std::memcpy(bytes->data() + i, &t, 2);
        }
        break;
    }
  }
}

TEST(ShardFuzz, MutatedHeadersNeverCrash) {
  std::mt19937 gen(20240520);
  int accepted = 0, refused = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::vector<uint8_t> bytes = valid_shard(gen, gen() % 40);
    mutate(gen, &bytes);
    // Parse from a buffer of exactly the file's bytes, so a read past the end
    // is a heap overflow the sanitizer reports.
    auto exact = std::make_unique<uint8_t[]>(std::max<size_t>(bytes.size(), 1));
    if (!bytes.empty()) std::memcpy(exact.get(), bytes.data(), bytes.size());
    size_t header = std::min(bytes.size(), kShardHeaderBytes);
    try {
      ShardInfo info = parse_shard_header("fuzz.bin", exact.get(), header, bytes.size());
      ASSERT_EQ(kShardHeaderBytes + 2 * static_cast<uint64_t>(info.num_tokens), bytes.size());
      check_token_range("fuzz.bin", reinterpret_cast<const uint16_t*>(exact.get() + kShardHeaderBytes),
                        info.num_tokens, 0, 50257);
      ++accepted;
    } catch (const lattice::Error& e) {
      ASSERT_NE(std::string(e.what()).find("fuzz.bin"), std::string::npos) << e.what();
      ++refused;
    }
  }
  std::printf("[ fuzz     ] 20000 mutated shards: %d accepted, %d refused with a lattice::Error\n", accepted, refused);
  EXPECT_GT(accepted, 100);
  EXPECT_GT(refused, 10000);
}

TEST(ShardFuzz, MutatedFilesThroughReadShard) {
  // The same through the file path (open, fstat, pread, mmap).
  testing::TempDir dir;
  const std::string path = dir.file("fuzz.bin");
  std::mt19937 gen(99);
  for (int iter = 0; iter < 1000; ++iter) {
    std::vector<uint8_t> bytes = valid_shard(gen, gen() % 40);
    mutate(gen, &bytes);
    testing::write_file(path, std::string(bytes.begin(), bytes.end()));
    try {
      std::vector<uint16_t> tokens = read_shard(path, 50257);
      ASSERT_EQ(kShardHeaderBytes + 2 * tokens.size(), bytes.size());
    } catch (const lattice::Error& e) {
      ASSERT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace lattice::data
