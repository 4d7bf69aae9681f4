#include "lattice/parallel/pipeline/timeline.h"

#include <algorithm>
#include <cstdio>
#include <limits>

#include "lattice/io/json.h"

namespace lattice::pipeline {

std::string chrome_trace(const std::vector<std::vector<Interval>>& timeline, double seconds_per_unit,
                         const std::string& title) {
  std::string o =
      "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"title\":" + io::json_quote(title) + "},\"traceEvents\":[\n";
  bool first = true;
  auto sep = [&] {
    if (!first) o += ",\n";
    first = false;
  };
  char buf[256];
  for (size_t r = 0; r < timeline.size(); r++) {
    sep();
    std::snprintf(buf, sizeof buf,
                  "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":%zu,\"args\":{\"name\":\"rank %zu\"}}", r,
                  r);
    o += buf;
  }
  for (size_t r = 0; r < timeline.size(); r++)
    for (const Interval& iv : timeline[r]) {
      sep();
      const double us = seconds_per_unit * 1e6;
      std::snprintf(buf, sizeof buf,
                    "{\"name\":\"%s\",\"cat\":\"%c\",\"ph\":\"X\",\"pid\":0,\"tid\":%zu,\"ts\":%.3f,\"dur\":%.3f,"
                    "\"args\":{\"stage\":%d,\"micro\":%d}}",
                    to_string(iv.action).c_str(), op_letter(iv.action.op), r, iv.start * us, (iv.end - iv.start) * us,
                    iv.action.stage, iv.action.micro);
      o += buf;
    }
  return o + "\n]}\n";
}

double bubble_of(const std::vector<std::vector<Interval>>& timeline) {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo, busy = 0;
  for (const auto& row : timeline)
    for (const Interval& iv : row) {
      lo = std::min(lo, iv.start);
      hi = std::max(hi, iv.end);
      busy += iv.end - iv.start;
    }
  if (!(hi > lo) || timeline.empty()) return 0;
  return 1.0 - busy / (static_cast<double>(timeline.size()) * (hi - lo));
}

}  // namespace lattice::pipeline
