#include "lattice/cli/schedule_report.h"

#include <cstdio>

#include "lattice/core/error.h"
#include "lattice/io/file_util.h"
#include "lattice/io/json.h"
#include "lattice/io/plot.h"
#include "lattice/parallel/pipeline/timeline.h"

namespace lattice::cli {

using namespace lattice::pipeline;

// The bubble a generated schedule has at equal costs, or -1 (for ZB-V the
// lower bound of any order: see zb_v in schedule.h).
static double textbook_bubble(const Schedule& s, const Costs& c) {
  const double p = s.ranks, m = s.micro_batches, v = s.chunks_per_rank();
  if (!(c.forward == c.backward_input && c.forward == c.backward_weight && c.transfer == 0)) return -1;
  if (s.name == "gpipe" || s.name == "1f1b") return (p - 1) / (m + p - 1);
  if (s.name == "interleaved") return (p - 1) / (v * m + p - 1);
  if (s.name == "zb-h1" && m >= p) return (p - 1) / (3 * m + p - 1);
  if (s.name == "zb-v") return (p - 1) / (6 * m + p - 1);
  return -1;
}

Simulation print_schedule_report(const Schedule& s, const Costs& costs) {
  validate(s);
  const Simulation sim = simulate(s, costs);
  std::printf("schedule %s: %d ranks, %d stages (%d per rank), %d micro-batches; valid\n", s.name.c_str(), s.ranks,
              s.stages, s.chunks_per_rank(), s.micro_batches);
  for (int r = 0; r < s.ranks; r++) {
    std::string line;
    for (const Action& a : s.actions[r]) line += (line.empty() ? "" : " ") + to_string(a);
    std::printf("  rank %d: %s\n", r, line.c_str());
  }
  std::printf("costs F=%g I=%g W=%g (B=%g) transfer=%g: makespan %g, bubble %.4f", costs.forward, costs.backward_input,
              costs.backward_weight, costs.of(Op::B), costs.transfer, sim.makespan, sim.bubble);
  const double formula = textbook_bubble(s, costs);
  if (formula >= 0) std::printf(s.name == "zb-v" ? " (lower bound %.4f)" : " (formula %.4f)", formula);
  std::printf("\npeak in-flight micro-batches per rank (stage equivalents):");
  for (double x : sim.peak_in_flight) std::printf(" %g", x);
  std::printf("\n");
  return sim;
}

void write_timeline_svg(const std::string& path, const std::vector<std::vector<Interval>>& timeline,
                        const std::string& title, const std::string& x_label) {
  std::vector<std::string> rows;
  std::vector<io::GanttBox> boxes;
  for (size_t r = 0; r < timeline.size(); r++) {
    rows.push_back("rank " + std::to_string(r));
    for (const Interval& iv : timeline[r]) {
      io::GanttBox b;
      b.row = static_cast<int>(r);
      b.start = iv.start;
      b.end = iv.end;
      b.label = std::to_string(iv.action.micro);
      // Okabe-Ito: forward blue; backward green (full) / vermillion (input); weight orange.
      b.color = iv.action.op == Op::F   ? "#0072B2"
                : iv.action.op == Op::B ? "#009E73"
                : iv.action.op == Op::I ? "#D55E00"
                                        : "#E69F00";
      boxes.push_back(b);
    }
  }
  io::write_file_atomic(path, io::svg_gantt(title, rows, boxes, x_label,
                                            {{"#0072B2", "F forward"},
                                             {"#009E73", "B backward"},
                                             {"#D55E00", "I input backward"},
                                             {"#E69F00", "W weight backward"}}));
}

std::vector<std::vector<Interval>> read_chrome_trace(const std::string& path) {
  const io::JsonValue doc = io::parse_json(io::read_whole_file(path, "trace"), path);
  const io::JsonValue* events = doc.find("traceEvents");
  LATTICE_CHECK(events && events->is_array(), path << ": not a Chrome trace (no traceEvents array)");
  std::vector<std::vector<Interval>> timeline;
  const std::vector<io::JsonValue>& all = events->as_array();
  for (size_t i = 0; i < all.size(); i++) {
    const io::JsonValue& e = all[i];
    const io::JsonValue* ph = e.find("ph");
    if (!ph || !ph->is_string() || ph->as_string() != "X") continue;
    const io::JsonValue *name = e.find("name"), *tid = e.find("tid"), *ts = e.find("ts"), *dur = e.find("dur");
    LATTICE_CHECK(
        name && name->is_string() && tid && tid->is_number() && ts && ts->is_number() && dur && dur->is_number(),
        path << ": event " << i << " lacks name, tid, ts or dur");
    const int rank = static_cast<int>(tid->as_double());
    LATTICE_CHECK(rank >= 0 && rank < 4096, path << ": event " << i << " has tid " << rank);
    if (static_cast<int>(timeline.size()) <= rank) timeline.resize(static_cast<size_t>(rank) + 1);
    Interval iv;
    iv.action = parse_action(name->as_string(), path + " event " + std::to_string(i));
    iv.start = ts->as_double() * 1e-6;
    iv.end = iv.start + dur->as_double() * 1e-6;
    timeline[rank].push_back(iv);
  }
  LATTICE_CHECK(!timeline.empty(), path << ": no pipeline actions (complete events named like 1F3)");
  return timeline;
}

}  // namespace lattice::cli
