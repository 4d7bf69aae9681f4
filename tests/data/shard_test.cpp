// Token shards: write/read round trip and every corruption case with its message.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "lattice/data/shard.h"
#include "test_util.h"

namespace lattice::data {
namespace {

using testing::expect_error;
using testing::TempDir;

std::string header_bytes(int32_t magic, int32_t version, int32_t count) {
  std::string h(kShardHeaderBytes, '\0');
  std::memcpy(h.data(), &magic, 4);
  std::memcpy(h.data() + 4, &version, 4);
  std::memcpy(h.data() + 8, &count, 4);
  return h;
}

TEST(Shard, WriteReadRoundTrip) {
  TempDir dir;
  std::vector<uint16_t> tokens = {50256, 0, 1, 262, 65535, 15496, 995};
  const std::string path = dir.file("train_000000.bin");
  write_shard(path, tokens);
  EXPECT_EQ(std::filesystem::file_size(path), kShardHeaderBytes + 2 * tokens.size());
  ShardInfo info = read_shard_header(path);
  EXPECT_EQ(info.path, path);
  EXPECT_EQ(info.num_tokens, 7);
  EXPECT_EQ(read_shard(path), tokens);
  MappedShard mapped(path);
  EXPECT_EQ(mapped.num_tokens(), 7);
  EXPECT_EQ(std::vector<uint16_t>(mapped.tokens(), mapped.tokens() + 7), tokens);
  // The header is llm.c's: magic, version, count, then zeros.
  std::string bytes = testing::read_file(path);
  EXPECT_EQ(bytes.substr(0, kShardHeaderBytes), header_bytes(20240520, 1, 7));
  // No temporary file is left behind, and an empty shard is valid.
  write_shard(dir.file("empty.bin"), std::vector<uint16_t>{});
  EXPECT_EQ(read_shard_header(dir.file("empty.bin")).num_tokens, 0);
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(dir.path())) files += e.is_regular_file();
  EXPECT_EQ(files, 2);
}

TEST(Shard, MissingFile) {
  TempDir dir;
  expect_error([&] { read_shard_header(dir.file("nope.bin")); }, {dir.file("nope.bin"), "cannot open token shard"});
}

TEST(Shard, ShortFile) {
  TempDir dir;
  testing::write_file(dir.file("short.bin"), header_bytes(kShardMagic, 1, 0).substr(0, 100));
  expect_error([&] { read_shard_header(dir.file("short.bin")); },
               {dir.file("short.bin"), "100 bytes, shorter than the 1024-byte header"});
  testing::write_file(dir.file("empty.bin"), "");
  expect_error([&] { read_shard_header(dir.file("empty.bin")); }, {dir.file("empty.bin"), "0 bytes"});
}

TEST(Shard, BadMagic) {
  TempDir dir;
  testing::write_file(dir.file("magic.bin"), header_bytes(12345, 1, 0));
  expect_error([&] { read_shard_header(dir.file("magic.bin")); },
               {dir.file("magic.bin"), "bad magic number 12345", "expected 20240520"});
}

TEST(Shard, BadVersion) {
  TempDir dir;
  testing::write_file(dir.file("v2.bin"), header_bytes(kShardMagic, 2, 0));
  expect_error([&] { read_shard_header(dir.file("v2.bin")); },
               {dir.file("v2.bin"), "unsupported shard version 2", "uint32"});
}

TEST(Shard, NegativeCount) {
  TempDir dir;
  testing::write_file(dir.file("neg.bin"), header_bytes(kShardMagic, 1, -5));
  expect_error([&] { read_shard_header(dir.file("neg.bin")); }, {dir.file("neg.bin"), "negative token count -5"});
}

TEST(Shard, TruncatedTokens) {
  TempDir dir;
  testing::write_file(dir.file("trunc.bin"), header_bytes(kShardMagic, 1, 10) + std::string(8, '\0'));
  expect_error([&] { read_shard_header(dir.file("trunc.bin")); },
               {dir.file("trunc.bin"), "header says 10 tokens (1044 bytes)", "only 1032 bytes", "truncated"});
  testing::write_file(dir.file("huge.bin"), header_bytes(kShardMagic, 1, INT32_MAX));
  expect_error([&] { read_shard_header(dir.file("huge.bin")); }, {dir.file("huge.bin"), "2147483647 tokens"});
}

TEST(Shard, TrailingBytes) {
  TempDir dir;
  testing::write_file(dir.file("long.bin"), header_bytes(kShardMagic, 1, 1) + std::string(3, '\0'));
  expect_error([&] { read_shard_header(dir.file("long.bin")); }, {dir.file("long.bin"), "1 trailing bytes"});
}

TEST(Shard, TokenOutsideVocabulary) {
  TempDir dir;
  write_shard(dir.file("vocab.bin"), std::vector<uint16_t>{1, 2, 50256, 50257, 3});
  expect_error([&] { read_shard(dir.file("vocab.bin"), 50257); },
               {dir.file("vocab.bin"), "token 50257 at index 3", "byte offset 1030", "vocabulary size 50257"});
  EXPECT_EQ(read_shard(dir.file("vocab.bin"), 50258).size(), 5u);
}

TEST(Shard, WriteIntoMissingFolderFails) {
  TempDir dir;
  expect_error([&] { write_shard(dir.file("no/such/dir/x.bin"), std::vector<uint16_t>{1}); },
               {dir.file("no/such/dir/x.bin"), "cannot create"});
}

}  // namespace
}  // namespace lattice::data
