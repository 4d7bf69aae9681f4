#include "lattice/train/machine.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "lattice/core/cpu.h"
#include "lattice/core/error.h"
#include "lattice/io/file_util.h"
#include "lattice/io/json.h"
#include "lattice/kernels/ops.h"

namespace lattice::train {
namespace {

// The cache key: the same CPU model at the same level and thread count.
std::string cache_key(int threads) {
  return cpu_info().model + " | " + isa_name(active_isa()) + " | " + std::to_string(threads) + " threads";
}

io::JsonValue read_cache() {
  std::ifstream in(peak_cache_path());
  if (!in.good()) return io::JsonValue::object();
  std::stringstream text;
  text << in.rdbuf();
  try {
    io::JsonValue v = io::parse_json(text.str(), peak_cache_path());
    return v.is_object() ? v : io::JsonValue::object();
  } catch (const Error&) {
    return io::JsonValue::object();  // a damaged cache is measured over
  }
}

void write_cache_entry(const MachinePeak& p) {
  try {
    const std::string path = peak_cache_path();
    std::error_code ec;
    std::filesystem::create_directories(io::parent_dir(path), ec);
    io::JsonValue cache = read_cache();
    // The best figure seen: another tenant only ever slows a measurement
    // down, so a lower one (taken under load) never replaces a higher one.
    double fp32 = p.fp32_gflops_per_core, bf16 = p.bf16_gflops_per_core;
    if (const io::JsonValue* old = cache.find(cache_key(p.threads)); old && old->is_object()) {
      if (const io::JsonValue* v = old->find("fp32_gflops_per_core"); v && v->is_number()) fp32 = std::max(fp32, v->as_double());
      if (const io::JsonValue* v = old->find("bf16_gflops_per_core"); v && v->is_number()) bf16 = std::max(bf16, v->as_double());
    }
    io::JsonValue entry = io::JsonValue::object();
    entry.set("fp32_gflops_per_core", io::JsonValue::number(fp32));
    entry.set("bf16_gflops_per_core", io::JsonValue::number(bf16));
    cache.set(cache_key(p.threads), entry);
    io::write_file_atomic(path, io::to_json(cache, 2) + "\n");
  } catch (const Error&) {
    // A read-only home directory costs a re-measurement next time, nothing more.
  }
}

double env_peak() {
  const char* env = std::getenv("LATTICE_PEAK_GFLOPS_PER_CORE");
  if (!env) return 0;
  char* end = nullptr;
  const double v = std::strtod(env, &end);
  LATTICE_CHECK(end != env && *end == '\0' && v > 0,
                "LATTICE_PEAK_GFLOPS_PER_CORE must be a positive number, got '" << env << "'");
  return v;
}

}  // namespace

std::string peak_cache_path() {
  std::string dir;
  if (const char* d = std::getenv("LATTICE_CACHE_DIR"); d && *d) {
    dir = d;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) {
    dir = std::string(x) + "/lattice";
  } else if (const char* h = std::getenv("HOME"); h && *h) {
    dir = std::string(h) + "/.cache/lattice";
  } else {
    dir = "/tmp/lattice-cache";
  }
  return dir + "/peak.json";
}

MachinePeak measure_machine_peak(int threads, double seconds, int repeats, bool store) {
  MachinePeak p;
  p.threads = threads;
  p.source = "measured now";
  for (int r = 0; r < std::max(1, repeats); r++) {
    p.fp32_gflops_per_core =
        std::max(p.fp32_gflops_per_core, kernels::measure_peak_gflops_per_core(DType::F32, threads, seconds));
    if (kernels::peak_measurable(DType::BF16))
      p.bf16_gflops_per_core =
          std::max(p.bf16_gflops_per_core, kernels::measure_peak_gflops_per_core(DType::BF16, threads, seconds));
  }
  if (store) write_cache_entry(p);
  return p;
}

MachinePeak machine_peak(int threads, int at_once, bool store) {
  if (const double v = env_peak(); v > 0) {
    MachinePeak p;
    p.fp32_gflops_per_core = v;
    p.threads = threads;
    p.source = "LATTICE_PEAK_GFLOPS_PER_CORE";
    return p;
  }
  const io::JsonValue cache = read_cache();
  if (const io::JsonValue* e = cache.find(cache_key(at_once)); e && e->is_object()) {
    const io::JsonValue* fp32 = e->find("fp32_gflops_per_core");
    const io::JsonValue* bf16 = e->find("bf16_gflops_per_core");
    if (fp32 && fp32->is_number() && fp32->as_double() > 0) {
      MachinePeak p;
      p.fp32_gflops_per_core = fp32->as_double();
      p.bf16_gflops_per_core = bf16 && bf16->is_number() ? bf16->as_double() : 0;
      p.threads = threads;
      p.source = "cached in " + peak_cache_path();
      return p;
    }
  }
  MachinePeak p = measure_machine_peak(threads, 0.2, 1, store && threads == at_once);
  if (!store) p.source = "measured now (not cached: several ranks share this machine)";
  return p;
}

std::string describe_machine() {
  std::string s = cpu_info().describe() + "; kernels " + isa_name(active_isa());
  if (isa_forced()) s += std::string(" (LATTICE_ISA; the CPU has ") + isa_name(detected_isa()) + ")";
  return s + "; GEMM " + kernels::describe_gemm_paths();
}

}  // namespace lattice::train
