// lattice schedule NAME|FILE.csv [--pp P] [--micro-batches M] [--virtual-stages V]
//                  [--costs F,I,W] [--transfer T] [--csv OUT] [--trace OUT.json] [--plot OUT.svg]
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "lattice/cli/args.h"
#include "lattice/cli/command.h"
#include "lattice/cli/schedule_report.h"
#include "lattice/core/error.h"
#include "lattice/io/file_util.h"
#include "lattice/parallel/pipeline/timeline.h"

namespace lattice::cli {

static const char* kScheduleHelp =
    "usage: lattice schedule NAME|FILE.csv [--pp P] [--micro-batches M] [--virtual-stages V]\n"
    "                        [--costs F,I,W] [--transfer T] [--csv OUT] [--trace OUT.json] [--plot OUT.svg]\n"
    "\n"
    "Generates a pipeline schedule (NAME: gpipe, 1f1b, interleaved, zb-h1, zb-v; defaults\n"
    "--pp 4 --micro-batches 8, --virtual-stages 2 for interleaved and zb-v) or reads one in PyTorch's\n"
    "compute-only CSV format (a row per rank, cells like 0F3 1I3 1W3 2B0), validates it\n"
    "and simulates it: per-rank lists, makespan, bubble (beside the formula), peak\n"
    "in-flight micro-batches. --costs sets the time of a forward, an input backward and\n"
    "a weight backward (a full backward B is I + W; default 1,1,1); --transfer adds a\n"
    "time to every hop between ranks. --csv writes the schedule, --trace the simulated\n"
    "timeline as Chrome trace JSON (Perfetto, chrome://tracing), --plot an SVG Gantt chart.\n";

static double parse_positive(const std::string& flag, const std::string& text, bool allow_zero) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  LATTICE_CHECK(end != text.c_str() && *end == '\0' && (allow_zero ? v >= 0 : v > 0),
                flag << " needs a number " << (allow_zero ? ">= 0" : "> 0") << ", got '" << text << "'");
  return v;
}

static int run_schedule(const std::vector<std::string>& args) {
  std::string what, csv_out, trace_out, plot_out;
  int p = 4, m = 8, v = 0;
  pipeline::Costs costs;
  for (size_t i = 1; i < args.size(); i++) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kScheduleHelp);
      return 0;
    } else if (a == "--pp") {
      p = static_cast<int>(parse_int_flag(a, flag_value(args, i++)));
    } else if (a == "--micro-batches") {
      m = static_cast<int>(parse_int_flag(a, flag_value(args, i++)));
    } else if (a == "--virtual-stages") {
      v = static_cast<int>(parse_int_flag(a, flag_value(args, i++)));
    } else if (a == "--costs") {
      const std::string text = flag_value(args, i++);
      std::vector<double> c;
      size_t begin = 0;
      while (begin <= text.size()) {
        size_t end = text.find(',', begin);
        if (end == std::string::npos) end = text.size();
        c.push_back(parse_positive("--costs", text.substr(begin, end - begin), false));
        begin = end + 1;
      }
      LATTICE_CHECK(c.size() == 3, "--costs needs three numbers F,I,W, got '" << text << "'");
      costs.forward = c[0], costs.backward_input = c[1], costs.backward_weight = c[2];
    } else if (a == "--transfer") {
      costs.transfer = parse_positive(a, flag_value(args, i++), true);
    } else if (a == "--csv") {
      csv_out = flag_value(args, i++);
    } else if (a == "--trace") {
      trace_out = flag_value(args, i++);
    } else if (a == "--plot") {
      plot_out = flag_value(args, i++);
    } else {
      LATTICE_CHECK(a.rfind("-", 0) != 0, "lattice schedule: unknown option '" << a << "' (see --help)");
      LATTICE_CHECK(what.empty(),
                    "lattice schedule takes one NAME or FILE.csv, got '" << what << "' and '" << a << "'");
      what = a;
    }
  }
  LATTICE_CHECK(!what.empty(), "lattice schedule needs a NAME (gpipe, 1f1b, interleaved, zb-h1, zb-v) or a FILE.csv");
  const bool from_file = what.size() > 4 && what.compare(what.size() - 4, 4, ".csv") == 0;
  const pipeline::Schedule s = from_file ? pipeline::from_csv(io::read_whole_file(what, "schedule"), what)
                                         : pipeline::make_schedule(what, p,
                                                                   v > 0 ? v
                                                                   : what == "interleaved" || what == "zb-v" ? 2
                                                                                                             : 1,
                                                                   m);
  const pipeline::Simulation sim = print_schedule_report(s, costs);
  if (!csv_out.empty()) {
    io::write_file_atomic(csv_out, pipeline::to_csv(s));
    std::printf("wrote %s\n", csv_out.c_str());
  }
  if (!trace_out.empty()) {
    io::write_file_atomic(trace_out,
                          pipeline::chrome_trace(sim.timeline, 1e-3, s.name + " (simulated, 1 unit = 1 ms)"));
    std::printf("wrote %s\n", trace_out.c_str());
  }
  if (!plot_out.empty()) {
    write_timeline_svg(plot_out, sim.timeline,
                       s.name + " (simulated): bubble " + std::to_string(sim.bubble).substr(0, 6), "time (cost units)");
    std::printf("wrote %s\n", plot_out.c_str());
  }
  return 0;
}

LATTICE_REGISTER_COMMAND("schedule", "generate, read, validate and simulate pipeline schedules (CSV, trace, SVG)",
                         run_schedule);

}  // namespace lattice::cli
