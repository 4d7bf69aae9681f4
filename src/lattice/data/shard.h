// Token shards in llm.c's .bin layout, so shards made by either tool work in both:
//
//   bytes [0, 1024)      256 little-endian int32: [0] magic 20240520,
//                        [1] version 1, [2] number of tokens N, the rest 0
//   bytes [1024, 1024+2N) N little-endian uint16 token ids
//
// The file is exactly 1024 + 2N bytes. (llm.c's version 2, uint32 tokens for
// larger vocabularies, is refused with a message saying so.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lattice::data {

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr size_t kShardHeaderInts = 256;
constexpr size_t kShardHeaderBytes = kShardHeaderInts * sizeof(int32_t);
constexpr int64_t kMaxShardTokens = INT32_MAX;  // the count is an int32

struct ShardInfo {
  std::string path;
  int64_t num_tokens;
};

// Validates a shard's header given its first min(file_size, 1024) bytes and
// the file's size. Throws lattice::Error naming `path` on: a file shorter than
// the header, a bad magic number, an unsupported version, a negative count, or
// a size that disagrees with the count (truncated or with trailing bytes).
ShardInfo parse_shard_header(const std::string& path, const uint8_t* header, size_t header_bytes, uint64_t file_size);

// Opens `path` and validates its header (see parse_shard_header).
ShardInfo read_shard_header(const std::string& path);

// Throws unless every token is below vocab_size; the message names `path`, the
// token's index in the shard (first_index + i) and its byte offset.
void check_token_range(const std::string& path, const uint16_t* tokens, int64_t count, int64_t first_index,
                       int vocab_size);

// Writes `tokens` as a shard: to a temporary file next to `path`, then renamed
// over it, so a reader never sees a half-written shard.
void write_shard(const std::string& path, const std::vector<uint16_t>& tokens);
void write_shard(const std::string& path, const uint16_t* tokens, int64_t count);

// Reads a whole shard into memory, validating header and token range.
std::vector<uint16_t> read_shard(const std::string& path, int vocab_size = 65536);

// A shard mapped read-only into memory (mmap); the tokens are read in place.
class MappedShard {
 public:
  // Validates the header (not the token range; see check_token_range).
  explicit MappedShard(const std::string& path);
  MappedShard(MappedShard&& other) noexcept;
  MappedShard& operator=(MappedShard&& other) noexcept;
  MappedShard(const MappedShard&) = delete;
  MappedShard& operator=(const MappedShard&) = delete;
  ~MappedShard();

  const std::string& path() const { return info_.path; }
  int64_t num_tokens() const { return info_.num_tokens; }
  const uint16_t* tokens() const { return tokens_; }

 private:
  void unmap();
  ShardInfo info_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;
};

}  // namespace lattice::data
