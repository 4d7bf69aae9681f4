// Metrics as JSON Lines: one object per step, appended and flushed line by
// line so a crash loses at most the line being written, and the file can be
// followed (tail -f) or plotted while the run is going.
//
//   {"step":12,"loss":5.8123,"lr":0.0006,"grad_norm":1.31,"step_ms":412.5,
//    "tokens_per_sec":9929.1,"mfu":0.21,"peak_mem_bytes":1234567168}
//
// The trainer writes at least step, loss, lr, grad_norm, step_ms,
// tokens_per_sec, mfu, peak_mem_bytes (and val_loss on evaluation steps).
// Non-finite numbers are written as null: JSON has no NaN or infinity.
#pragma once

#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "lattice/io/json.h"

namespace lattice::io {

class MetricsWriter {
 public:
  // Opens `path` for appending (a resumed run continues the file), or empty
  // when truncate is true. Missing parent directories are created.
  explicit MetricsWriter(const std::string& path, bool truncate = false);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // One line: the numeric fields in order, then the string fields.
  void write(const std::vector<std::pair<std::string, double>>& fields,
             const std::vector<std::pair<std::string, std::string>>& string_fields = {});
  // One line holding any JSON object.
  void write(const JsonValue& object);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

// The numeric columns of a metrics file: every key seen on any line, each a
// vector with one entry per line (NaN where a line lacks the key, has null,
// or has a non-number). A torn last line (no newline, not valid JSON: the run
// died while writing it) is skipped; any other bad line is an error naming the
// file and line.
struct MetricsColumns {
  std::vector<std::string> names;  // in order of first appearance
  std::map<std::string, std::vector<double>> columns;
  size_t rows = 0;

  bool has(const std::string& name) const { return columns.count(name) != 0; }
  // Throws "metrics file 'x' has no column 'y'" when absent.
  const std::vector<double>& column(const std::string& name) const;
  std::string source;
};

MetricsColumns read_metrics_jsonl(const std::string& path);

}  // namespace lattice::io
