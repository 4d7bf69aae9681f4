// safetensors files: the format of Hugging Face checkpoints, and of ours.
//
//   [u64 little-endian N][N bytes of JSON header][data region]
//   header = {"name": {"dtype": "F32", "shape": [768, 2304], "data_offsets": [begin, end]},
//             ..., "__metadata__": {"key": "value"}}
//
// Offsets are relative to the start of the data region. The reader treats the
// file as untrusted and validates everything before any tensor is touched:
// header length within the file and at most 100 MB; strict JSON; every field
// present with the right type and nothing else; known dtypes; non-negative
// integers that fit; shape x dtype size == end - begin (without overflow);
// tensors that tile the data region exactly (sorted by offset, each starts
// where the previous ends, the last ends at the end of the file; so no
// overlap, no hole, no trailing bytes); no duplicate names; metadata values
// are strings. These are the rules Hugging Face's own reader enforces, so a
// file accepted here loads there too. Every error is a lattice::Error naming
// the file and the tensor or field.
//
// The writer keeps tensors in insertion order (header and data), pads the
// header with spaces so the data region starts 8-byte aligned, and writes
// through a temporary file + fsync + rename, so a crash never leaves a
// half-written file under the final name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lattice/core/dtype.h"
#include "lattice/io/file_util.h"

namespace lattice::io {

// Header length limit (the JSON part), as in the reference implementation.
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull * 1000 * 1000;

struct TensorEntry {
  std::string name;
  DType dtype = DType::F32;       // meaningful only when `supported`
  std::string dtype_name;         // as written in the file: "F32", "BF16", "I64"...
  bool supported = true;          // dtype is F32, BF16 or F16
  std::vector<int64_t> shape;     // empty = 0-d scalar (one element)
  uint64_t begin = 0, end = 0;    // byte range within the data region

  int64_t numel() const;
};

struct SafeTensorsHeader {
  std::vector<TensorEntry> tensors;  // in header order
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;          // 8 + N: where the data region starts in the file
};

// Validates the header of a whole safetensors file held in memory (data, size)
// against its size. Throws lattice::Error naming `name_for_errors` and the
// tensor/field. With allow_unsupported_dtypes (listing a file), tensors with
// other standard dtypes (F64, I64, U8, BOOL, F8_E4M3...) are accepted and marked
// supported = false; otherwise they are an error naming the tensor and dtype.
SafeTensorsHeader parse_safetensors_header(const uint8_t* data, size_t size,
                                           const std::string& name_for_errors,
                                           bool allow_unsupported_dtypes = false);

class SafeTensorsReader {
 public:
  // Maps the file read-only and validates it (see the rules above).
  explicit SafeTensorsReader(const std::string& path, bool allow_unsupported_dtypes = false);
  ~SafeTensorsReader();
  SafeTensorsReader(const SafeTensorsReader&) = delete;
  SafeTensorsReader& operator=(const SafeTensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorEntry>& tensors() const { return header_.tensors; }  // file order
  const TensorEntry* find(const std::string& name) const;  // nullptr if absent
  // Like find, but throws "no tensor 'x' in safetensors file 'f'".
  const TensorEntry& get(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }

  // Copies the tensor, converted to f32, into out (which holds numel elements;
  // it must equal the tensor's element count).
  void read_f32(const std::string& name, float* out, size_t numel) const;
  // Same, and the tensor's shape must equal expected_shape.
  void read_f32(const std::string& name, float* out, const std::vector<int64_t>& expected_shape) const;
  // The tensor's bytes as stored (little-endian; not necessarily aligned to
  // the element size). Valid while the reader lives.
  const void* raw(const std::string& name) const;

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;
  SafeTensorsHeader header_;
  std::map<std::string, size_t> index_;
};

class SafeTensorsWriter {
 public:
  // Records a tensor. `data` is referenced, not copied: it must stay valid and
  // unchanged until write() returns. Names must be unique and non-empty.
  // `data` may be null for a file written with SafeTensorsStream.
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data);
  void set_metadata(const std::string& key, const std::string& value);
  // Writes `path` via path.tmp.<pid> + fsync + rename (+ fsync of the directory).
  void write(const std::string& path) const;
  // The header JSON (unpadded) that write() would produce; for tests.
  std::string header_json() const;

 private:
  struct Item {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    const void* data;
    uint64_t bytes;
  };
  std::vector<Item> items_;
  std::map<std::string, std::string> metadata_;
  friend class SafeTensorsStream;
};

// A safetensors file written tensor by tensor, so that a writer never holds
// all of them at once (checkpoints of a sharded model: one group gathered at a
// time). The header comes from `layout` (every tensor added, data not
// needed); append() takes the tensors' bytes in the order they were added;
// finish() checks that all came, fsyncs and renames into place, as write()
// does. Destroyed unfinished, the temporary file is removed.
class SafeTensorsStream {
 public:
  SafeTensorsStream(const SafeTensorsWriter& layout, const std::string& path);
  ~SafeTensorsStream();
  SafeTensorsStream(const SafeTensorsStream&) = delete;
  SafeTensorsStream& operator=(const SafeTensorsStream&) = delete;
  void append(const void* data, size_t bytes);
  void finish();

 private:
  std::string path_, tmp_;
  std::vector<uint64_t> sizes_;
  size_t next_ = 0;
  std::unique_ptr<FileWriter> file_;
};

// safetensors dtype names: "F32", "BF16", "F16".
const char* safetensors_dtype_name(DType dtype);

}  // namespace lattice::io
