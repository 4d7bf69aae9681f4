// lattice bench peak [--threads N] [--seconds S] [--repeat R] [--json]
//   Measures this CPU's arithmetic peak (fp32 FMA, and bf16 dot products where
//   the CPU has them) on N threads at once, stores it in the peak cache that
//   the step line's MFU and `bench train` use when it passes the rule of
//   train/machine.h (repeatable, measured alone, under the ceiling), and
//   prints it beside what the CPU is and which kernels and GEMM paths serve
//   each dtype.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "lattice/cli/args.h"
#include "lattice/cli/bench_registry.h"
#include "lattice/core/cpu.h"
#include "lattice/core/error.h"
#include "lattice/core/threads.h"
#include "lattice/io/json.h"
#include "lattice/kernels/ops.h"
#include "lattice/train/machine.h"

namespace lattice::cli {

static const char* kBenchPeakHelp =
    "usage: lattice bench peak [--threads N] [--seconds S] [--repeat R] [--json]\n"
    "\n"
    "Measures the peak multiply-add rate of this CPU for the instruction set in use\n"
    "(register-only FMA loops, VDPBF16PS for bf16), with N threads running at once\n"
    "(default: all cores), best of R runs of S seconds (defaults 3 and 0.5), and\n"
    "stores it in the cache that MFU is computed from when it passes: the best two\n"
    "runs within 5%, every thread running >= 90% of the time (nothing else on its\n"
    "core), and not above the ceiling (FLOPs a cycle of the level x the clock, +5%).\n"
    "Otherwise it says why. LATTICE_ISA=avx2|baseline measures a lower level.\n";

static int bench_peak(const std::vector<std::string>& args) {
  int threads = 0, repeats = 3;
  double seconds = 0.5;
  bool json = false;
  for (size_t i = 1; i < args.size(); i++) {
    if (args[i] == "--help" || args[i] == "-h") {
      std::printf("%s", kBenchPeakHelp);
      return 0;
    } else if (args[i] == "--threads") {
      threads = static_cast<int>(parse_int_flag("--threads", flag_value(args, i++), 1));
    } else if (args[i] == "--repeat") {
      repeats = static_cast<int>(parse_int_flag("--repeat", flag_value(args, i++), 1));
    } else if (args[i] == "--seconds") {
      const std::string v = flag_value(args, i++);
      char* end = nullptr;
      seconds = std::strtod(v.c_str(), &end);
      LATTICE_CHECK(end != v.c_str() && *end == '\0' && seconds > 0 && seconds <= 60,
                    "--seconds must be a number in (0, 60], got '" << v << "'");
    } else if (args[i] == "--json") {
      json = true;
    } else {
      LATTICE_FAIL("lattice bench peak: unknown option '" << args[i] << "' (see lattice bench peak --help)");
    }
  }
  set_num_threads(threads);
  const train::MachinePeak p = train::measure_machine_peak(num_threads(), seconds, repeats);
  const kernels::GemmPaths& g = kernels::gemm_paths();
  const train::PeakCeiling ceiling = train::peak_ceiling();
  if (json) {
    io::JsonValue o = io::JsonValue::object();
    o.set("impl", io::JsonValue::string("lattice-peak"));
    o.set("cpu", io::JsonValue::string(cpu_info().model));
    o.set("vendor", io::JsonValue::string(cpu_info().vendor));
    o.set("family", io::JsonValue::integer(cpu_info().family));
    o.set("model", io::JsonValue::integer(cpu_info().model_number));
    o.set("isa", io::JsonValue::string(isa_name(active_isa())));
    o.set("isa_detected", io::JsonValue::string(isa_name(detected_isa())));
    o.set("threads", io::JsonValue::integer(p.threads));
    o.set("repeats", io::JsonValue::integer(repeats));
    o.set("seconds", io::JsonValue::number(seconds));
    o.set("fp32_gflops_per_core", io::JsonValue::number(p.fp32_gflops_per_core));
    o.set("fp32_spread", io::JsonValue::number(p.fp32_repeats.spread));
    o.set("fp32_on_cpu", io::JsonValue::number(p.fp32_repeats.on_cpu));
    o.set("fp32_ceiling", io::JsonValue::number(ceiling.gflops_per_core(DType::F32)));
    o.set("bf16_gflops_per_core", io::JsonValue::number(p.bf16_gflops_per_core));
    o.set("bf16_spread", io::JsonValue::number(p.bf16_repeats.spread));
    o.set("bf16_on_cpu", io::JsonValue::number(p.bf16_repeats.on_cpu));
    o.set("bf16_ceiling", io::JsonValue::number(ceiling.gflops_per_core(DType::BF16)));
    o.set("clock_ghz", io::JsonValue::number(ceiling.clock_ghz));
    o.set("clock_source", io::JsonValue::string(ceiling.clock_source));
    o.set("gemm_f32", io::JsonValue::string(g.f32));
    o.set("gemm_bf16", io::JsonValue::string(g.bf16));
    o.set("dnnl_isa", io::JsonValue::string(g.dnnl_isa));
    o.set("cache", io::JsonValue::string(train::peak_cache_path()));
    o.set("cached", io::JsonValue::boolean(p.cached));
    o.set("not_cached_because", io::JsonValue::string(p.not_cached_because));
    std::printf("%s\n", io::to_json(o).c_str());
  } else {
    auto facts = [](const train::PeakRepeats& r) {
      char buf[128];
      if (r.repeats < 2)
        std::snprintf(buf, sizeof buf, "threads running %.0f%% of the time", 100 * r.on_cpu);
      else
        std::snprintf(buf, sizeof buf, "best two %.1f%% apart, threads running %.0f%% of the time", 100 * r.spread,
                      100 * r.on_cpu);
      return std::string(buf);
    };
    std::printf("machine: %s\n", train::describe_machine().c_str());
    std::printf("peak, %d thread%s at once, best of %d x %.2f s:\n", p.threads, p.threads == 1 ? "" : "s", repeats,
                seconds);
    std::printf("  fp32  %8.1f GFLOP/s per core  %8.1f in all  (%s)\n", p.fp32_gflops_per_core,
                p.fp32_gflops_per_core * p.threads, facts(p.fp32_repeats).c_str());
    std::printf("        %s\n", ceiling.describe(DType::F32).c_str());
    if (p.bf16_gflops_per_core > 0) {
      std::printf("  bf16  %8.1f GFLOP/s per core  %8.1f in all  (%.2fx fp32; %s)\n", p.bf16_gflops_per_core,
                  p.bf16_gflops_per_core * p.threads, p.bf16_gflops_per_core / p.fp32_gflops_per_core,
                  facts(p.bf16_repeats).c_str());
      std::printf("        %s\n", ceiling.describe(DType::BF16).c_str());
    } else {
      std::printf("  bf16  none (no bf16 dot-product instructions at the %s level)\n", isa_name(active_isa()));
    }
    std::printf("%s\n", p.note.c_str());
  }
  return 0;
}

LATTICE_REGISTER_BENCH("peak", "measure this CPU's fp32/bf16 peak (the MFU denominator) and store it", bench_peak);

}  // namespace lattice::cli
