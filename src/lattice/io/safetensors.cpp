#include "lattice/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <numeric>
#include <set>

#include "lattice/core/error.h"
#include "lattice/core/tensor.h"
#include "lattice/io/file_util.h"
#include "lattice/io/json.h"

namespace lattice::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swaps");

namespace {

// Element sizes of the standard safetensors dtypes. Only the first three are
// read by lattice; the others are recognised so a file can be listed.
struct DTypeInfo {
  const char* name;
  uint64_t size;
  bool supported;
  DType dtype;
};
constexpr DTypeInfo kDTypes[] = {
    {"F32", 4, true, DType::F32},      {"BF16", 2, true, DType::BF16},    {"F16", 2, true, DType::F16},
    {"F64", 8, false, DType::F32},     {"I64", 8, false, DType::F32},     {"I32", 4, false, DType::F32},
    {"I16", 2, false, DType::F32},     {"I8", 1, false, DType::F32},      {"U64", 8, false, DType::F32},
    {"U32", 4, false, DType::F32},     {"U16", 2, false, DType::F32},     {"U8", 1, false, DType::F32},
    {"BOOL", 1, false, DType::F32},    {"F8_E4M3", 1, false, DType::F32}, {"F8_E5M2", 1, false, DType::F32},
};

const DTypeInfo* find_dtype(const std::string& name) {
  for (const DTypeInfo& d : kDTypes)
    if (name == d.name) return &d;
  return nullptr;
}

std::string tensor_ref(const std::string& name) { return "tensor " + json_quote(name); }

std::string offsets_string(const TensorEntry& e) {
  std::string s = "[";  // appended piecewise: g++ 12 warns falsely (-Wrestrict) on "[" + to_string(...)
  s += std::to_string(e.begin);
  s += ", ";
  s += std::to_string(e.end);
  s += ']';
  return s;
}

}  // namespace

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F64: return "F64";
  }
  return "?";
}

SafeTensorsHeader parse_safetensors_header(const uint8_t* data, size_t size, const std::string& name_for_errors,
                                           bool allow_unsupported_dtypes) {
  const std::string where = "safetensors file '" + name_for_errors + "'";
  LATTICE_CHECK(size >= 8, where << ": file is too short (" << size << " bytes; a safetensors file starts with an "
                                 << "8-byte header length)");
  uint64_t header_len = 0;
  std::memcpy(&header_len, data, 8);
  LATTICE_CHECK(header_len <= kMaxSafetensorsHeaderBytes,
                where << ": header length " << header_len << " exceeds the limit of " << kMaxSafetensorsHeaderBytes
                      << " bytes (not a safetensors file?)");
  LATTICE_CHECK(header_len <= size - 8, where << ": header length " << header_len << " exceeds the file size ("
                                              << size << " bytes): file truncated or not safetensors");
  LATTICE_CHECK(header_len >= 2 && data[8] == '{',
                where << ": header does not start with '{' (not a safetensors file?)");

  std::string_view header_text(reinterpret_cast<const char*>(data + 8), header_len);
  JsonParseOptions options;
  options.reject_duplicate_keys = false;  // reported below with the tensor's name
  options.max_depth = 8;
  JsonValue root = parse_json(header_text, where + " header", options);
  LATTICE_CHECK(root.is_object(), where << ": header must be a JSON object");

  SafeTensorsHeader out;
  out.data_offset = 8 + header_len;
  const uint64_t data_size = size - out.data_offset;

  std::set<std::string> seen;
  bool have_metadata = false;
  for (const JsonValue::Member& member : root.as_object()) {
    const std::string& name = member.first;
    const JsonValue& value = member.second;
    if (name == "__metadata__") {
      LATTICE_CHECK(!have_metadata, where << ": duplicate \"__metadata__\"");
      have_metadata = true;
      LATTICE_CHECK(value.is_object(), where << ": \"__metadata__\" must be an object of strings");
      for (const JsonValue::Member& kv : value.as_object()) {
        LATTICE_CHECK(kv.second.is_string(),
                      where << ": \"__metadata__\" value for " << json_quote(kv.first) << " must be a string");
        LATTICE_CHECK(out.metadata.emplace(kv.first, kv.second.as_string()).second,
                      where << ": duplicate \"__metadata__\" key " << json_quote(kv.first));
      }
      continue;
    }
    const std::string t = where + ": " + tensor_ref(name);
    LATTICE_CHECK(!name.empty(), where << ": empty tensor name");
    LATTICE_CHECK(seen.insert(name).second, where << ": duplicate tensor name " << json_quote(name));
    LATTICE_CHECK(value.is_object(), t << ": entry must be an object with dtype, shape and data_offsets");
    std::set<std::string> fields;
    for (const JsonValue::Member& field : value.as_object()) {
      LATTICE_CHECK(field.first == "dtype" || field.first == "shape" || field.first == "data_offsets",
                    t << ": unexpected field " << json_quote(field.first)
                      << " (expected dtype, shape, data_offsets)");
      LATTICE_CHECK(fields.insert(field.first).second, t << ": duplicate field " << json_quote(field.first));
    }
    TensorEntry e;
    e.name = name;

    const JsonValue* dtype = value.find("dtype");
    LATTICE_CHECK(dtype != nullptr, t << ": missing field \"dtype\"");
    LATTICE_CHECK(dtype->is_string(), t << ": \"dtype\" must be a string");
    e.dtype_name = dtype->as_string();
    const DTypeInfo* info = find_dtype(e.dtype_name);
    LATTICE_CHECK(info != nullptr, t << ": unknown dtype " << json_quote(e.dtype_name)
                                     << " (lattice reads F32, BF16, F16)");
    LATTICE_CHECK(info->supported || allow_unsupported_dtypes,
                  t << ": dtype " << e.dtype_name << " is not supported (lattice reads F32, BF16, F16)");
    e.supported = info->supported;
    e.dtype = info->dtype;

    const JsonValue* shape = value.find("shape");
    LATTICE_CHECK(shape != nullptr, t << ": missing field \"shape\"");
    LATTICE_CHECK(shape->is_array(), t << ": \"shape\" must be an array of non-negative integers");
    LATTICE_CHECK(shape->size() <= 64, t << ": \"shape\" has " << shape->size() << " dimensions (at most 64)");
    uint64_t numel = 1;
    bool numel_overflow = false;
    for (size_t i = 0; i < shape->size(); ++i) {
      const JsonValue& dim = shape->as_array()[i];
      int64_t d = 0;
      LATTICE_CHECK(dim.get_i64(&d) && d >= 0,
                    t << ": shape[" << i << "] must be a non-negative integer that fits int64, got "
                      << to_json(dim));
      e.shape.push_back(d);
      numel_overflow = numel_overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel);
    }

    const JsonValue* offsets = value.find("data_offsets");
    LATTICE_CHECK(offsets != nullptr, t << ": missing field \"data_offsets\"");
    LATTICE_CHECK(offsets->is_array() && offsets->size() == 2,
                  t << ": \"data_offsets\" must be an array [begin, end] of two non-negative integers");
    for (size_t i = 0; i < 2; ++i) {
      uint64_t v = 0;
      LATTICE_CHECK(offsets->as_array()[i].get_u64(&v),
                    t << ": data_offsets[" << i << "] must be a non-negative integer that fits uint64, got "
                      << to_json(offsets->as_array()[i]));
      (i == 0 ? e.begin : e.end) = v;
    }
    LATTICE_CHECK(e.begin <= e.end, t << ": data_offsets " << offsets_string(e) << " end before they begin");
    LATTICE_CHECK(e.end <= data_size, t << ": data_offsets " << offsets_string(e)
                                        << " extend past the end of the data region (" << data_size
                                        << " bytes): file truncated?");
    uint64_t bytes = 0;
    LATTICE_CHECK(!numel_overflow && !__builtin_mul_overflow(numel, info->size, &bytes),
                  t << ": shape " << shape_string(e.shape) << " is too large");
    LATTICE_CHECK(bytes == e.end - e.begin, t << ": shape " << shape_string(e.shape) << " x " << e.dtype_name
                                              << " needs " << bytes << " bytes but data_offsets "
                                              << offsets_string(e) << " span " << (e.end - e.begin));
    out.tensors.push_back(std::move(e));
  }

  // The tensors must tile the data region: sorted by offset, each starts where
  // the previous one ends, and the last one ends at the end of the file.
  std::vector<size_t> order(out.tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const TensorEntry& x = out.tensors[a];
    const TensorEntry& y = out.tensors[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t covered = 0;
  const TensorEntry* previous = nullptr;
  for (size_t i : order) {
    const TensorEntry& e = out.tensors[i];
    LATTICE_CHECK(e.begin >= covered, where << ": " << tensor_ref(e.name) << " data_offsets " << offsets_string(e)
                                            << " overlap " << tensor_ref(previous->name) << " "
                                            << offsets_string(*previous));
    LATTICE_CHECK(e.begin == covered, where << ": gap in the data region between byte " << covered << " and "
                                            << tensor_ref(e.name) << " at " << offsets_string(e));
    covered = e.end;
    if (e.end > e.begin || previous == nullptr) previous = &e;
  }
  LATTICE_CHECK(covered == data_size, where << ": data region is " << data_size << " bytes but the tensors cover "
                                            << covered << " (trailing bytes after the last tensor)");
  return out;
}

// ---------------------------------------------------------------- reader

SafeTensorsReader::SafeTensorsReader(const std::string& path, bool allow_unsupported_dtypes) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LATTICE_CHECK(fd >= 0, "cannot open safetensors file '" << path << "': " << errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    LATTICE_FAIL("cannot read safetensors file '" << path << "': not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      std::string reason = errno_text();
      ::close(fd);
      LATTICE_FAIL("cannot map safetensors file '" << path << "': " << reason);
    }
    data_ = static_cast<const uint8_t*>(p);
    mapped_ = true;
  }
  ::close(fd);
  try {
    // An empty file is not mapped (mmap refuses length 0); the parser reports it as too short.
    header_ = parse_safetensors_header(data_, size_, path, allow_unsupported_dtypes);
  } catch (...) {
    if (mapped_) ::munmap(const_cast<uint8_t*>(data_), size_);
    mapped_ = false;
    throw;
  }
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_.emplace(header_.tensors[i].name, i);
}

SafeTensorsReader::~SafeTensorsReader() {
  if (mapped_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

const TensorEntry* SafeTensorsReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

const TensorEntry& SafeTensorsReader::get(const std::string& name) const {
  const TensorEntry* e = find(name);
  LATTICE_CHECK(e != nullptr, "no tensor " << json_quote(name) << " in safetensors file '" << path_ << "' ("
                                           << header_.tensors.size() << " tensors)");
  return *e;
}

const void* SafeTensorsReader::raw(const std::string& name) const {
  const TensorEntry& e = get(name);
  return data_ + header_.data_offset + e.begin;
}

void SafeTensorsReader::read_f32(const std::string& name, float* out, size_t numel) const {
  const TensorEntry& e = get(name);
  LATTICE_CHECK(e.supported, "safetensors file '" << path_ << "': " << tensor_ref(name) << " has dtype "
                                                  << e.dtype_name << ", which lattice cannot read (F32, BF16, F16)");
  LATTICE_CHECK(static_cast<size_t>(e.numel()) == numel,
                "safetensors file '" << path_ << "': " << tensor_ref(name) << " has shape " << shape_string(e.shape)
                                     << " (" << e.numel() << " elements), expected " << numel << " elements");
  if (numel == 0) return;
  const uint8_t* src = data_ + header_.data_offset + e.begin;
  size_t elem = dtype_size(e.dtype);
  if (e.dtype == DType::F32 || reinterpret_cast<uintptr_t>(src) % elem == 0) {
    convert(src, e.dtype, out, DType::F32, numel);
  } else {
    // 16-bit data at an odd address (possible after a tensor of odd byte size).
    std::vector<uint16_t> aligned(numel);
    std::memcpy(aligned.data(), src, numel * elem);
    convert(aligned.data(), e.dtype, out, DType::F32, numel);
  }
}

void SafeTensorsReader::read_f32(const std::string& name, float* out,
                                 const std::vector<int64_t>& expected_shape) const {
  const TensorEntry& e = get(name);
  LATTICE_CHECK(e.shape == expected_shape, "safetensors file '" << path_ << "': " << tensor_ref(name)
                                                                << " has shape " << shape_string(e.shape)
                                                                << ", expected " << shape_string(expected_shape));
  read_f32(name, out, static_cast<size_t>(e.numel()));
}

// ---------------------------------------------------------------- writer

void SafeTensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data) {
  LATTICE_CHECK(!name.empty(), "safetensors tensor name must not be empty");
  LATTICE_CHECK(name != "__metadata__", "\"__metadata__\" is reserved and cannot name a tensor");
  for (const Item& item : items_) LATTICE_CHECK(item.name != name, "tensor " << json_quote(name) << " added twice");
  uint64_t numel = 1;
  for (int64_t d : shape) {
    LATTICE_CHECK(d >= 0, "tensor " << json_quote(name) << " has a negative dimension in shape " << shape_string(shape));
    numel *= static_cast<uint64_t>(d);
  }
  uint64_t bytes = numel * dtype_size(dtype);
  items_.push_back(Item{name, dtype, std::move(shape), data, bytes});
}

void SafeTensorsWriter::set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

std::string SafeTensorsWriter::header_json() const {
  JsonValue root = JsonValue::object();
  if (!metadata_.empty()) {
    JsonValue meta = JsonValue::object();
    for (const auto& [k, v] : metadata_) meta.append_member(k, JsonValue::string(v));
    root.append_member("__metadata__", std::move(meta));
  }
  uint64_t offset = 0;
  for (const Item& item : items_) {
    JsonValue shape = JsonValue::array();
    for (int64_t d : item.shape) shape.push_back(JsonValue::integer(d));
    JsonValue offsets = JsonValue::array();
    offsets.push_back(JsonValue::unsigned_integer(offset));
    offsets.push_back(JsonValue::unsigned_integer(offset + item.bytes));
    offset += item.bytes;
    JsonValue entry = JsonValue::object();
    entry.append_member("dtype", JsonValue::string(safetensors_dtype_name(item.dtype)));
    entry.append_member("shape", std::move(shape));
    entry.append_member("data_offsets", std::move(offsets));
    root.append_member(item.name, std::move(entry));
  }
  return to_json(root);
}

SafeTensorsStream::SafeTensorsStream(const SafeTensorsWriter& layout, const std::string& path)
    : path_(path), tmp_(path + ".tmp." + std::to_string(::getpid())) {
  std::string header = layout.header_json();
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t header_len = header.size();
  for (const SafeTensorsWriter::Item& item : layout.items_) sizes_.push_back(item.bytes);
  file_ = std::make_unique<FileWriter>(tmp_);
  file_->write(&header_len, 8);
  file_->write(header.data(), header.size());
}

SafeTensorsStream::~SafeTensorsStream() {
  if (file_) {
    file_.reset();
    ::unlink(tmp_.c_str());
  }
}

void SafeTensorsStream::append(const void* data, size_t bytes) {
  LATTICE_CHECK(file_ && next_ < sizes_.size(), "safetensors stream '" << path_ << "': more tensors than its header");
  LATTICE_CHECK(bytes == sizes_[next_], "safetensors stream '" << path_ << "': tensor " << next_ << " has " << bytes
                                                               << " bytes, its header says " << sizes_[next_]);
  if (bytes) file_->write(data, bytes);
  next_++;
}

void SafeTensorsStream::finish() {
  LATTICE_CHECK(file_ && next_ == sizes_.size(), "safetensors stream '" << path_ << "': " << next_ << " of "
                                                                        << sizes_.size() << " tensors written");
  file_->sync_and_close();
  file_.reset();
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    std::string reason = errno_text();
    ::unlink(tmp_.c_str());
    LATTICE_FAIL("cannot rename '" << tmp_ << "' to '" << path_ << "': " << reason);
  }
  fsync_path(parent_dir(path_));
}

void SafeTensorsWriter::write(const std::string& path) const {
  std::string header = header_json();
  // Pad with spaces so the data region starts at a multiple of 8 bytes.
  header.append((8 - header.size() % 8) % 8, ' ');
  uint64_t header_len = header.size();
  for (const Item& item : items_)
    LATTICE_CHECK(item.bytes == 0 || item.data != nullptr,
                  "tensor " << json_quote(item.name) << " has no data (write it with SafeTensorsStream)");
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  try {
    FileWriter w(tmp);
    w.write(&header_len, 8);
    w.write(header.data(), header.size());
    for (const Item& item : items_)
      if (item.bytes) w.write(item.data, item.bytes);
    w.sync_and_close();
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string reason = errno_text();
    ::unlink(tmp.c_str());
    LATTICE_FAIL("cannot rename '" << tmp << "' to '" << path << "': " << reason);
  }
  fsync_path(parent_dir(path));
}

}  // namespace lattice::io
