#include "lattice/io/metrics.h"

#include <cerrno>
#include <cmath>
#include <filesystem>
#include <limits>

#include "lattice/core/error.h"
#include "lattice/io/file_util.h"

namespace lattice::io {

MetricsWriter::MetricsWriter(const std::string& path, bool truncate) : path_(path) {
  LATTICE_CHECK(!path.empty(), "metrics file path is empty");
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    LATTICE_CHECK(!ec, "cannot create directory '" << parent.string() << "' for metrics file '" << path
                                                   << "': " << ec.message());
  }
  file_ = std::fopen(path.c_str(), truncate ? "w" : "a");
  LATTICE_CHECK(file_ != nullptr, "cannot open metrics file '" << path << "': " << errno_text());
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const std::vector<std::pair<std::string, double>>& fields,
                          const std::vector<std::pair<std::string, std::string>>& string_fields) {
  std::string line = "{";
  bool first = true;
  for (const auto& [key, value] : fields) {
    if (!first) line += ',';
    first = false;
    line += json_quote(key);
    line += ':';
    line += json_number(value);  // "null" when not finite
  }
  for (const auto& [key, value] : string_fields) {
    if (!first) line += ',';
    first = false;
    line += json_quote(key);
    line += ':';
    line += json_quote(value);
  }
  line += "}\n";
  LATTICE_CHECK(std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0,
                "cannot write metrics file '" << path_ << "': " << errno_text());
}

void MetricsWriter::write(const JsonValue& object) {
  LATTICE_CHECK(object.is_object(), "a metrics line must be a JSON object");
  std::string line = to_json(object) + "\n";
  LATTICE_CHECK(std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0,
                "cannot write metrics file '" << path_ << "': " << errno_text());
}

const std::vector<double>& MetricsColumns::column(const std::string& name) const {
  auto it = columns.find(name);
  LATTICE_CHECK(it != columns.end(), "metrics file '" << source << "' has no column '" << name << "'");
  return it->second;
}

MetricsColumns read_metrics_jsonl(const std::string& path) {
  std::string text = read_whole_file(path, "metrics file");
  MetricsColumns out;
  out.source = path;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    bool complete = nl != std::string::npos;
    std::string_view line(text.data() + pos, (complete ? nl : text.size()) - pos);
    pos = complete ? nl + 1 : text.size();
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    JsonValue row;
    try {
      row = parse_json(line, "metrics file '" + path + "' line " + std::to_string(line_no));
    } catch (const Error&) {
      if (!complete) break;  // torn final line
      throw;
    }
    LATTICE_CHECK(row.is_object(), "metrics file '" << path << "' line " << line_no << " is not a JSON object");
    for (const JsonValue::Member& m : row.as_object()) {
      if (!out.has(m.first)) {
        out.names.push_back(m.first);
        out.columns[m.first].assign(out.rows, nan);
      }
    }
    for (auto& [name, values] : out.columns) {
      const JsonValue* v = row.find(name);
      values.push_back(v && v->is_number() ? v->as_double() : nan);
    }
    ++out.rows;
  }
  return out;
}

}  // namespace lattice::io
