#include "lattice/io/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "lattice/core/error.h"
#include "lattice/io/file_util.h"

namespace fs = std::filesystem;

namespace lattice::io {

namespace {

constexpr const char* kFormat = "lattice-checkpoint-1";
constexpr const char* kMetaFile = "meta.json";
constexpr const char* kLatestFile = "latest";

// ---------------------------------------------------------------- CRC32C
//
// Reflected CRC with the Castagnoli polynomial 0x1EDC6F41 (reversed 0x82F63B78).
// Software path: slice-by-8, eight 256-entry tables; table[k][b] is the CRC of
// byte b followed by k zero bytes, so eight input bytes fold in at once.

using Tables = std::array<std::array<uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    t[0][b] = c;
  }
  for (uint32_t b = 0; b < 256; ++b)
    for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  return t;
}

uint32_t crc32c_software(uint32_t c, const uint8_t* p, size_t n) {
  static const Tables t = make_tables();
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian host
    uint32_t lo = static_cast<uint32_t>(word) ^ c;
    uint32_t hi = static_cast<uint32_t>(word >> 32);
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t c, const uint8_t* p, size_t n) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c64 = __builtin_ia32_crc32di(c64, word);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n--) c = __builtin_ia32_crc32qi(c, *p++);
  return c;
}
bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

std::string hex32(uint32_t x) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", x);
  return buf;
}

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

bool is_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

bool exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(path, ec));
}

void remove_tree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  LATTICE_CHECK(!ec, "cannot remove '" << path << "': " << ec.message());
}

void rename_or_fail(const std::string& from, const std::string& to) {
  LATTICE_CHECK(::rename(from.c_str(), to.c_str()) == 0,
                "cannot rename '" << from << "' to '" << to << "': " << errno_text());
}

// step_* directories of dir (complete or not), sorted by step.
std::vector<std::pair<int64_t, std::string>> step_dirs(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  LATTICE_CHECK(!ec, "cannot list checkpoint directory '" << dir << "': " << ec.message());
  for (const fs::directory_entry& e : it) {
    std::string name = e.path().filename().string();
    std::optional<int64_t> step = parse_step_dir_name(name);
    std::error_code ec2;
    if (step && e.is_directory(ec2)) out.emplace_back(*step, name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The directory name held by dir/latest, or "" when there is no such file.
std::string read_latest_name(const std::string& dir) {
  std::string latest_path = join_path(dir, kLatestFile);
  if (!exists(latest_path)) return "";
  std::string text = read_whole_file(latest_path, "checkpoint pointer");
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.pop_back();
  LATTICE_CHECK(parse_step_dir_name(text).has_value(),
                "'" << latest_path << "' should hold a checkpoint directory name like 'step_000100', got '"
                    << text << "'");
  return text;
}

}  // namespace

// ---------------------------------------------------------------- checksums

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  if (have_sse42()) return ~crc32c_sse42(c, p, bytes);
#endif
  return ~crc32c_software(c, p, bytes);
}

uint32_t crc32c_file(const std::string& path, uint64_t* bytes) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LATTICE_CHECK(fd >= 0, "cannot read '" << path << "': " << errno_text());
  std::vector<uint8_t> buf(size_t{1} << 20);
  uint32_t crc = 0;
  uint64_t total = 0;
  for (;;) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      std::string reason = errno_text();
      ::close(fd);
      LATTICE_FAIL("cannot read '" << path << "': " << reason);
    }
    if (n == 0) break;
    crc = crc32c(buf.data(), static_cast<size_t>(n), crc);
    total += static_cast<uint64_t>(n);
  }
  ::close(fd);
  if (bytes) *bytes = total;
  return crc;
}

// ---------------------------------------------------------------- names

std::string step_dir_name(int64_t step) {
  LATTICE_CHECK(step >= 0, "checkpoint step must be >= 0, got " << step);
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%06lld", static_cast<long long>(step));
  return buf;
}

std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  constexpr std::string_view prefix = "step_";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  if (name.size() - prefix.size() > 18) return std::nullopt;
  int64_t step = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

// ---------------------------------------------------------------- writer

CheckpointWriter::CheckpointWriter(const std::string& dir, int64_t step) : dir_(dir), step_(step) {
  LATTICE_CHECK(!dir.empty(), "checkpoint directory is empty (set checkpoint.dir)");
  std::error_code ec;
  fs::create_directories(dir, ec);
  LATTICE_CHECK(!ec && is_dir(dir), "cannot create checkpoint directory '" << dir << "': "
                                                                           << (ec ? ec.message() : "not a directory"));
  tmp_dir_ = join_path(dir, ".tmp_" + step_dir_name(step) + "_" + std::to_string(::getpid()));
  if (exists(tmp_dir_)) remove_tree(tmp_dir_);  // left by a crashed earlier attempt of this process id
  LATTICE_CHECK(::mkdir(tmp_dir_.c_str(), 0755) == 0, "cannot create '" << tmp_dir_ << "': " << errno_text());
}

CheckpointWriter::~CheckpointWriter() {
  if (!committed_) {
    std::error_code ec;
    fs::remove_all(tmp_dir_, ec);  // best effort; a leftover .tmp_* is never read as a checkpoint
  }
}

std::string CheckpointWriter::path(const std::string& file_name) const {
  LATTICE_CHECK(is_plain_file_name(file_name), "checkpoint file name must be a plain name, got '" << file_name << "'");
  LATTICE_CHECK(file_name != kMetaFile, "'meta.json' is written by CheckpointWriter::commit");
  LATTICE_CHECK(!committed_, "checkpoint " << step_dir_name(step_) << " is already committed");
  return join_path(tmp_dir_, file_name);
}

void CheckpointWriter::write_file(const std::string& file_name, const std::string& contents) {
  FileWriter w(path(file_name));
  w.write(contents.data(), contents.size());
  w.sync_and_close();
}

std::string CheckpointWriter::commit(JsonValue meta, int keep) {
  LATTICE_CHECK(!committed_, "checkpoint " << step_dir_name(step_) << " is already committed");
  LATTICE_CHECK(meta.is_object(), "checkpoint meta must be a JSON object");

  // Checksum and fsync every file the trainer wrote, in name order.
  std::vector<std::string> names;
  std::error_code list_error;
  fs::directory_iterator listing(tmp_dir_, list_error);
  LATTICE_CHECK(!list_error, "cannot list '" << tmp_dir_ << "': " << list_error.message());
  for (const fs::directory_entry& e : listing) {
    std::string name = e.path().filename().string();
    std::error_code ec;
    LATTICE_CHECK(e.is_regular_file(ec), "checkpoint " << step_dir_name(step_) << ": '" << name
                                                       << "' is not a regular file");
    LATTICE_CHECK(name != kMetaFile, "'meta.json' is written by CheckpointWriter::commit");
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  JsonValue files = JsonValue::object();
  for (const std::string& name : names) {
    std::string p = join_path(tmp_dir_, name);
    fsync_path(p);
    uint64_t bytes = 0;
    uint32_t crc = crc32c_file(p, &bytes);
    JsonValue entry = JsonValue::object();
    entry.set("bytes", JsonValue::unsigned_integer(bytes));
    entry.set("crc32c", JsonValue::string(hex32(crc)));
    files.set(name, std::move(entry));
  }

  JsonValue full = JsonValue::object();
  full.set("format", JsonValue::string(kFormat));
  full.set("step", JsonValue::integer(step_));
  for (const JsonValue::Member& m : meta.as_object())
    if (m.first != "format" && m.first != "step" && m.first != "files") full.set(m.first, m.second);
  full.set("files", std::move(files));
  {
    FileWriter w(join_path(tmp_dir_, kMetaFile));
    std::string text = to_json(full, 2) + "\n";
    w.write(text.data(), text.size());
    w.sync_and_close();
  }
  fsync_path(tmp_dir_);

  // Publish: rename into place (a same-step directory from an abandoned run is
  // moved aside first, then deleted), make the rename durable, then point
  // `latest` at it.
  std::string name = step_dir_name(step_);
  std::string final_dir = join_path(dir_, name);
  std::string old_dir;
  if (exists(final_dir)) {
    old_dir = join_path(dir_, ".old_" + name + "_" + std::to_string(::getpid()));
    if (exists(old_dir)) remove_tree(old_dir);
    rename_or_fail(final_dir, old_dir);
  }
  rename_or_fail(tmp_dir_, final_dir);
  committed_ = true;
  fsync_path(dir_);
  write_file_atomic(join_path(dir_, kLatestFile), name + "\n");
  if (!old_dir.empty()) remove_tree(old_dir);
  prune_checkpoints(dir_, keep);
  return final_dir;
}

// ---------------------------------------------------------------- retention

std::vector<std::string> prune_checkpoints(const std::string& dir, int keep) {
  std::vector<std::string> deleted;
  if (keep <= 0) return deleted;
  std::string latest = read_latest_name(dir);
  auto dirs = step_dirs(dir);
  // The newest `keep` by step survive, and so does the one `latest` names.
  if (dirs.size() <= static_cast<size_t>(keep)) return deleted;
  dirs.resize(dirs.size() - static_cast<size_t>(keep));
  for (const auto& [step, name] : dirs) {
    if (name == latest) continue;
    // Renamed away first so a crash mid-delete never leaves a half-deleted step_* directory.
    std::string path = join_path(dir, name);
    std::string doomed = join_path(dir, ".del_" + name + "_" + std::to_string(::getpid()));
    rename_or_fail(path, doomed);
    remove_tree(doomed);
    deleted.push_back(path);
  }
  if (!deleted.empty()) fsync_path(dir);
  return deleted;
}

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::string> out;
  if (!is_dir(dir)) return out;
  for (const auto& [step, name] : step_dirs(dir)) {
    std::string path = join_path(dir, name);
    if (exists(join_path(path, kMetaFile))) out.push_back(path);
  }
  return out;
}

// ---------------------------------------------------------------- resolving

std::optional<std::string> find_latest_checkpoint(const std::string& dir) {
  if (!is_dir(dir)) return std::nullopt;
  std::string latest = read_latest_name(dir);
  if (!latest.empty()) {
    std::string path = join_path(dir, latest);
    LATTICE_CHECK(is_dir(path), "'" << join_path(dir, kLatestFile) << "' names '" << latest
                                    << "' which does not exist");
    return path;
  }
  std::vector<std::string> all = list_checkpoints(dir);
  if (all.empty()) return std::nullopt;
  return all.back();
}

std::string resolve_checkpoint(const std::string& spec, const std::string& checkpoint_dir) {
  LATTICE_CHECK(!spec.empty(), "no checkpoint given to resume from");
  if (spec == "latest") {
    LATTICE_CHECK(!checkpoint_dir.empty(), "checkpoint.resume = \"latest\" needs checkpoint.dir");
    std::optional<std::string> found = find_latest_checkpoint(checkpoint_dir);
    LATTICE_CHECK(found.has_value(), "no checkpoint found in '" << checkpoint_dir << "'");
    return *found;
  }
  LATTICE_CHECK(exists(spec), "checkpoint '" << spec << "' does not exist");
  LATTICE_CHECK(is_dir(spec), "checkpoint '" << spec
                                             << "' is a file; give a checkpoint directory (step_NNNNNN) or the "
                                                "directory that holds them");
  if (exists(join_path(spec, kMetaFile))) return spec;
  std::optional<std::string> found = find_latest_checkpoint(spec);
  LATTICE_CHECK(found.has_value(), "no checkpoint found in '" << spec << "'");
  return *found;
}

// ---------------------------------------------------------------- integrity

JsonValue read_checkpoint_meta(const std::string& step_dir) {
  std::string meta_path = join_path(step_dir, kMetaFile);
  LATTICE_CHECK(exists(meta_path), "'" << step_dir << "' is not a checkpoint: '" << meta_path << "' is missing");
  JsonValue meta = parse_json(read_whole_file(meta_path, "checkpoint meta"), "checkpoint meta '" + meta_path + "'");
  LATTICE_CHECK(meta.is_object(), "checkpoint meta '" << meta_path << "' is not a JSON object");
  const JsonValue* format = meta.find("format");
  LATTICE_CHECK(format && format->is_string() && format->as_string() == kFormat,
                "checkpoint meta '" << meta_path << "' has an unknown format (expected \"format\": \"" << kFormat
                                    << "\")");
  return meta;
}

void verify_checkpoint(const std::string& step_dir) {
  JsonValue meta = read_checkpoint_meta(step_dir);
  std::string meta_path = join_path(step_dir, kMetaFile);
  const JsonValue* files = meta.find("files");
  LATTICE_CHECK(files && files->is_object(), "checkpoint meta '" << meta_path << "' has no \"files\" object");
  for (const JsonValue::Member& m : files->as_object()) {
    const std::string& name = m.first;
    LATTICE_CHECK(is_plain_file_name(name) && name != kMetaFile,
                  "checkpoint meta '" << meta_path << "' lists an invalid file name '" << name << "'");
    uint64_t expected_bytes = 0;
    const JsonValue* bytes = m.second.find("bytes");
    const JsonValue* crc = m.second.find("crc32c");
    LATTICE_CHECK(bytes && bytes->get_u64(&expected_bytes) && crc && crc->is_string(),
                  "checkpoint meta '" << meta_path << "': entry for '" << name
                                      << "' needs \"bytes\" (integer) and \"crc32c\" (hex string)");
    std::string path = join_path(step_dir, name);
    struct stat st {};
    LATTICE_CHECK(::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode),
                  "checkpoint file '" << path << "' is missing");
    uint64_t size = static_cast<uint64_t>(st.st_size);
    LATTICE_CHECK(size >= expected_bytes, "checkpoint file '" << path << "' is truncated (" << size
                                                              << " bytes, expected " << expected_bytes << ")");
    LATTICE_CHECK(size == expected_bytes, "checkpoint file '" << path << "' has the wrong size (" << size
                                                              << " bytes, expected " << expected_bytes << ")");
    uint32_t actual = crc32c_file(path);
    LATTICE_CHECK(hex32(actual) == crc->as_string(), "checkpoint file '" << path
                                                                         << "' is corrupted: checksum mismatch (crc32c "
                                                                         << hex32(actual) << ", expected "
                                                                         << crc->as_string() << ")");
  }
}

}  // namespace lattice::io
