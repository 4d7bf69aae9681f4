// Seeded random-mutation fuzzing of the two parsers that read untrusted bytes.
// Each iteration mutates a valid input (flip/insert/delete/duplicate bytes,
// splice in JSON tokens, rewrite the header length); the parser must either
// accept it or throw lattice::Error, never crash or throw anything else (and
// under ASan/UBSan, never touch memory it should not).
#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "lattice/core/dtype.h"
#include "lattice/io/json.h"
#include "lattice/io/safetensors.h"
#include "test_util.h"

namespace lattice::io {
namespace {

const char* const kTokens[] = {"{", "}", "[", "]", ",", ":", "\"", "\\", "\\u", "\\ud800", "0", "-", "1e9",
                               "18446744073709551616", "-1", "null", "true", "\"F32\"", "\"I64\"", "\"dtype\"",
                               "\"shape\"", "\"data_offsets\"", "\"__metadata__\"", " ", "\xff", "\xc3", "\x00"};

std::string mutate(std::string s, std::mt19937_64& rng) {
  int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
    switch (rng() % 7) {
      case 0:  // flip a bit
        if (!s.empty()) s[pos % s.size()] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:  // random byte
        if (!s.empty()) s[pos % s.size()] = static_cast<char>(rng());
        break;
      case 2:  // delete a range
        if (!s.empty()) s.erase(pos % s.size(), 1 + rng() % 8);
        break;
      case 3: {  // insert a token
        const char* t = kTokens[rng() % (sizeof kTokens / sizeof kTokens[0])];
        s.insert(pos, t, std::max<size_t>(1, std::strlen(t)));
        break;
      }
      case 4:  // duplicate a range
        if (!s.empty()) {
          size_t from = rng() % s.size();
          s.insert(pos, s.substr(from, 1 + rng() % 16));
        }
        break;
      case 5:  // truncate
        s.resize(pos);
        break;
      case 6:  // change a digit
        for (size_t i = 0; i < s.size(); ++i) {
          size_t j = (pos + i) % s.size();
          if (s[j] >= '0' && s[j] <= '9') {
            s[j] = static_cast<char>('0' + rng() % 10);
            break;
          }
        }
        break;
    }
  }
  return s;
}

std::string valid_safetensors() {
  std::vector<float> a(6, 1.5f);
  std::vector<uint16_t> b(4, f32_to_bf16(2.0f));
  float c = 3;
  SafeTensorsWriter w;
  w.add("h.0.attn.c_attn.weight", DType::F32, {2, 3}, a.data());
  w.add("h.0.ln_1.bias", DType::BF16, {4}, b.data());
  w.add("scalar", DType::F32, {}, &c);
  w.add("empty", DType::F16, {0}, nullptr);
  w.set_metadata("format", "pt");
  std::string header = w.header_json();
  uint64_t n = header.size();
  std::string out(reinterpret_cast<const char*>(&n), 8);
  out += header;
  out.append(reinterpret_cast<const char*>(a.data()), 24);
  out.append(reinterpret_cast<const char*>(b.data()), 8);
  out.append(reinterpret_cast<const char*>(&c), 4);
  return out;
}

TEST(Fuzz, SafetensorsHeaderOnlyThrowsLatticeError) {
  std::mt19937_64 rng(20240520);
  std::string seed = valid_safetensors();
  ASSERT_NO_THROW(parse_safetensors_header(reinterpret_cast<const uint8_t*>(seed.data()), seed.size(), "seed"));
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string bytes = mutate(seed, rng);
    // Keep the length prefix consistent with the body half of the time, so
    // mutations reach the JSON and validation code instead of the length check.
    if (iter % 2 == 0 && bytes.size() >= 8) {
      size_t body = bytes.size() - 8;
      uint64_t n = body - std::min<size_t>(body, 36 + rng() % 8);
      std::memcpy(bytes.data(), &n, 8);
    }
    std::vector<uint8_t> buffer(bytes.begin(), bytes.end());  // exact-size allocation: ASan sees overreads
    try {
      SafeTensorsHeader h = parse_safetensors_header(buffer.data(), buffer.size(), "fuzz", iter % 3 == 0);
      for (const TensorEntry& e : h.tensors) ASSERT_LE(h.data_offset + e.end, buffer.size());
      ++accepted;
    } catch (const lattice::Error&) {
      ++rejected;
    } catch (...) {
      FAIL() << "non-lattice exception at iteration " << iter;
    }
  }
  EXPECT_GT(rejected, 0);
  EXPECT_GT(accepted, 0);  // some mutations keep the file valid (e.g. a changed metadata string)
}

TEST(Fuzz, JsonParserOnlyThrowsLatticeErrorAndRoundTrips) {
  std::mt19937_64 rng(1337);
  const std::string seeds[] = {
      R"({"a": [1, 2.5, -3e-7, true, false, null], "b": {"c": "d\n\u00e9\ud83d\ude00"}, "e": []})",
      R"([{"dtype": "F32", "shape": [768, 2304], "data_offsets": [0, 18446744073709551615]}])",
      R"("just a string with \\ escapes \" and unicode é")",
  };
  int accepted = 0;
  for (int iter = 0; iter < 30000; ++iter) {
    std::string text = mutate(seeds[iter % 3], rng);
    try {
      JsonValue v = parse_json(text, "fuzz");
      JsonValue again = parse_json(to_json(v), "fuzz-roundtrip");
      ASSERT_EQ(again, v) << to_json(v);
      ++accepted;
    } catch (const lattice::Error&) {
    } catch (...) {
      FAIL() << "non-lattice exception at iteration " << iter;
    }
  }
  EXPECT_GT(accepted, 100);
}

}  // namespace
}  // namespace lattice::io
