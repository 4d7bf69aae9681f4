#include "lattice/data/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "lattice/core/error.h"

namespace lattice::data {
namespace {

int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));  // the format is little-endian, as is every machine we run on
  return v;
}

// RAII file descriptor.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void open_for_read(const std::string& path, Fd* fd, uint64_t* size) {
  fd->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LATTICE_CHECK(fd->fd >= 0, path << ": cannot open token shard: " << std::strerror(errno));
  struct stat st;
  LATTICE_CHECK(::fstat(fd->fd, &st) == 0, path << ": cannot stat token shard: " << std::strerror(errno));
  LATTICE_CHECK(S_ISREG(st.st_mode), path << ": not a regular file");
  *size = static_cast<uint64_t>(st.st_size);
}

ShardInfo read_header_from(const std::string& path, int fd, uint64_t size) {
  uint8_t header[kShardHeaderBytes];
  size_t want = size < kShardHeaderBytes ? static_cast<size_t>(size) : kShardHeaderBytes;
  size_t got = 0;
  while (got < want) {
    ssize_t n = ::pread(fd, header + got, want - got, static_cast<off_t>(got));
    LATTICE_CHECK(n >= 0, path << ": read error: " << std::strerror(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  return parse_shard_header(path, header, got, size);
}

}  // namespace

ShardInfo parse_shard_header(const std::string& path, const uint8_t* header, size_t header_bytes, uint64_t file_size) {
  LATTICE_CHECK(file_size >= kShardHeaderBytes && header_bytes >= kShardHeaderBytes,
                path << ": file is " << file_size << " bytes, shorter than the " << kShardHeaderBytes
                     << "-byte header of a token shard");
  int32_t magic = load_i32(header);
  int32_t version = load_i32(header + 4);
  int32_t count = load_i32(header + 8);
  LATTICE_CHECK(magic == kShardMagic, path << ": bad magic number " << magic << " (expected " << kShardMagic
                                           << "); not a token shard in llm.c's .bin layout");
  LATTICE_CHECK(version == kShardVersion,
                path << ": unsupported shard version " << version << " (only version " << kShardVersion
                     << ", uint16 tokens, is supported" << (version == 2 ? "; version 2 holds uint32 tokens" : "")
                     << ")");
  LATTICE_CHECK(count >= 0, path << ": negative token count " << count << " in the header");
  const uint64_t expected = kShardHeaderBytes + 2 * static_cast<uint64_t>(count);
  LATTICE_CHECK(file_size >= expected, path << ": header says " << count << " tokens (" << expected
                                            << " bytes) but the file is only " << file_size
                                            << " bytes (truncated?)");
  LATTICE_CHECK(file_size == expected, path << ": header says " << count << " tokens (" << expected
                                            << " bytes) but the file is " << file_size << " bytes ("
                                            << (file_size - expected) << " trailing bytes)");
  return {path, count};
}

ShardInfo read_shard_header(const std::string& path) {
  Fd fd;
  uint64_t size;
  open_for_read(path, &fd, &size);
  return read_header_from(path, fd.fd, size);
}

void check_token_range(const std::string& path, const uint16_t* tokens, int64_t count, int64_t first_index,
                       int vocab_size) {
  // One branch-free pass finds the maximum; only a failure pays for locating it.
  uint16_t max_token = 0;
  for (int64_t i = 0; i < count; ++i) max_token = tokens[i] > max_token ? tokens[i] : max_token;
  if (max_token < vocab_size) return;
  for (int64_t i = 0; i < count; ++i) {
    if (tokens[i] >= vocab_size) {
      int64_t index = first_index + i;
      LATTICE_FAIL(path << ": token " << tokens[i] << " at index " << index << " (byte offset "
                        << kShardHeaderBytes + 2 * index << ") is not below the vocabulary size " << vocab_size);
    }
  }
}

void write_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  write_shard(path, tokens.data(), static_cast<int64_t>(tokens.size()));
}

void write_shard(const std::string& path, const uint16_t* tokens, int64_t count) {
  LATTICE_CHECK(count >= 0 && count <= kMaxShardTokens,
                path << ": " << count << " tokens do not fit one shard (at most " << kMaxShardTokens << ")");
  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = static_cast<int32_t>(count);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  LATTICE_CHECK(f, path << ": cannot create " << tmp << ": " << std::strerror(errno));
  bool ok = std::fwrite(header, sizeof(header), 1, f) == 1;
  if (ok && count > 0) ok = std::fwrite(tokens, sizeof(uint16_t), static_cast<size_t>(count), f) == static_cast<size_t>(count);
  int saved_errno = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    LATTICE_FAIL(path << ": write failed: " << std::strerror(saved_errno ? saved_errno : errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    saved_errno = errno;
    std::remove(tmp.c_str());
    LATTICE_FAIL(path << ": cannot rename " << tmp << " into place: " << std::strerror(saved_errno));
  }
}

std::vector<uint16_t> read_shard(const std::string& path, int vocab_size) {
  MappedShard shard(path);
  check_token_range(path, shard.tokens(), shard.num_tokens(), 0, vocab_size);
  return std::vector<uint16_t>(shard.tokens(), shard.tokens() + shard.num_tokens());
}

MappedShard::MappedShard(const std::string& path) {
  Fd fd;
  uint64_t size;
  open_for_read(path, &fd, &size);
  info_ = read_header_from(path, fd.fd, size);
  map_bytes_ = static_cast<size_t>(size);
  void* p = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd.fd, 0);
  LATTICE_CHECK(p != MAP_FAILED, path << ": mmap of " << map_bytes_ << " bytes failed: " << std::strerror(errno));
  map_ = p;
  tokens_ = reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(map_) + kShardHeaderBytes);
}

MappedShard::MappedShard(MappedShard&& other) noexcept
    : info_(std::move(other.info_)), map_(other.map_), map_bytes_(other.map_bytes_), tokens_(other.tokens_) {
  other.map_ = nullptr;
  other.map_bytes_ = 0;
  other.tokens_ = nullptr;
}

MappedShard& MappedShard::operator=(MappedShard&& other) noexcept {
  if (this != &other) {
    unmap();
    info_ = std::move(other.info_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
  }
  return *this;
}

MappedShard::~MappedShard() { unmap(); }

void MappedShard::unmap() {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
}

}  // namespace lattice::data
