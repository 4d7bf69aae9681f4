#include "lattice/train/machine.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>

#include "lattice/core/cpu.h"
#include "lattice/core/error.h"
#include "lattice/io/file_util.h"
#include "lattice/io/json.h"

namespace lattice::train {
namespace {

// The rule (machine.h).
constexpr double kMaxSpread = 0.05;     // best two repeats within 5%
constexpr double kMinOnCpu = 0.90;      // every measuring thread ran >= 90% of the time
constexpr double kCeilingSlack = 0.05;  // the clock's own measurement error
constexpr double kStaleMargin = 0.10;   // a check this much above the cached figure proves it stale
// The start-up costs.
constexpr double kCheckSeconds = 0.05;
constexpr double kStartupSeconds = 0.1;
constexpr int kStartupRepeats = 3;
constexpr double kClockSeconds = 0.02;

std::string fmt(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* format, ...) {
  char buf[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buf, sizeof buf, format, args);
  va_end(args);
  return buf;
}

const char* peak_dtype_name(DType dtype) { return dtype == DType::BF16 ? "bf16" : "fp32"; }

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

void write_cache(const io::JsonValue& cache) {
  try {
    const std::string path = peak_cache_path();
    std::error_code ec;
    std::filesystem::create_directories(io::parent_dir(path), ec);
    io::write_file_atomic(path, io::to_json(cache, 2) + "\n");
  } catch (const Error&) {
    // A read-only home directory costs a re-measurement next time, nothing more.
  }
}

double number_or(const io::JsonValue& o, const char* key, double fallback) {
  const io::JsonValue* v = o.find(key);
  return v && v->is_number() ? v->as_double() : fallback;
}

// One dtype of a cache entry: {"gflops_per_core", "repeats", "seconds", "spread", "on_cpu"}.
struct CachedFigure {
  double gflops_per_core = 0;
  PeakRepeats repeats;
};

io::JsonValue figure_json(const CachedFigure& f) {
  io::JsonValue o = io::JsonValue::object();
  o.set("gflops_per_core", io::JsonValue::number(f.gflops_per_core));
  o.set("repeats", io::JsonValue::integer(f.repeats.repeats));
  o.set("seconds", io::JsonValue::number(f.repeats.seconds));
  o.set("spread", io::JsonValue::number(f.repeats.spread));
  o.set("on_cpu", io::JsonValue::number(f.repeats.on_cpu));
  return o;
}

// A figure written under the rule; nullopt for anything else (absent, or an
// entry from before the rule, which had no repeat facts).
std::optional<CachedFigure> figure_from_json(const io::JsonValue* o) {
  if (!o || !o->is_object()) return std::nullopt;
  CachedFigure f;
  f.gflops_per_core = number_or(*o, "gflops_per_core", 0);
  f.repeats.repeats = static_cast<int>(number_or(*o, "repeats", 0));
  f.repeats.seconds = number_or(*o, "seconds", 0);
  f.repeats.spread = number_or(*o, "spread", 1);
  f.repeats.on_cpu = number_or(*o, "on_cpu", 0);
  if (!(f.gflops_per_core > 0) || f.repeats.repeats < 2) return std::nullopt;
  return f;
}

struct CachedEntry {
  CachedFigure fp32;
  std::optional<CachedFigure> bf16;
};

// The entry for `threads` if it is usable here: fp32 present, and bf16 too
// when this CPU measures bf16.
std::optional<CachedEntry> read_entry(int threads) {
  const io::JsonValue cache = read_cache();
  const io::JsonValue* e = cache.find(cache_key(threads));
  if (!e || !e->is_object()) return std::nullopt;
  std::optional<CachedFigure> fp32 = figure_from_json(e->find("fp32"));
  std::optional<CachedFigure> bf16 = figure_from_json(e->find("bf16"));
  if (!fp32 || (kernels::peak_measurable(DType::BF16) && !bf16)) return std::nullopt;
  return CachedEntry{*fp32, bf16};
}

// Writes the entry for `threads`. `keep_higher`: a dtype whose valid cached
// figure is higher (and not above `ceiling`) keeps it. Returns the entry the
// file holds now.
CachedEntry store_entry(int threads, const CachedEntry& fresh, bool keep_higher, const PeakCeiling& ceiling) {
  io::JsonValue cache = read_cache();
  CachedEntry out = fresh;
  auto keeps = [&](const std::optional<CachedFigure>& old, double fresh_figure, DType dtype) {
    const double limit = ceiling.gflops_per_core(dtype);
    return old && old->gflops_per_core > fresh_figure && (limit <= 0 || old->gflops_per_core <= limit);
  };
  if (keep_higher) {
    if (const io::JsonValue* old = cache.find(cache_key(threads)); old && old->is_object()) {
      if (auto f = figure_from_json(old->find("fp32")); keeps(f, out.fp32.gflops_per_core, DType::F32)) out.fp32 = *f;
      if (auto f = figure_from_json(old->find("bf16")); out.bf16 && keeps(f, out.bf16->gflops_per_core, DType::BF16))
        out.bf16 = *f;
    }
  }
  io::JsonValue entry = io::JsonValue::object();
  entry.set("fp32", figure_json(out.fp32));
  if (out.bf16) entry.set("bf16", figure_json(*out.bf16));
  cache.set(cache_key(threads), entry);
  write_cache(cache);
  return out;
}

void erase_entry(int threads) {
  const io::JsonValue cache = read_cache();
  const std::string key = cache_key(threads);
  if (!cache.find(key)) return;
  io::JsonValue kept = io::JsonValue::object();
  for (const auto& [k, v] : cache.as_object())
    if (k != key) kept.set(k, v);
  write_cache(kept);
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

std::mutex g_clock_mutex;
double g_clock_for_testing = 0;

// The clock: the largest figure seen in this process. The measured clock of
// a VM's core moves by several percent from moment to moment (3.43 to 3.67
// GHz on the Zen 5 VM of docs/kernels.md), so it is measured again right
// after each peak measurement, with the cores in the state the measurement
// left them, and before a cached figure is dropped as impossible.
double g_measured_clock_ghz = 0;

double remeasure_clock() {
  const double ghz = measure_clock_ghz(kClockSeconds);
  std::lock_guard<std::mutex> lock(g_clock_mutex);
  g_measured_clock_ghz = std::max(g_measured_clock_ghz, ghz);
  return g_measured_clock_ghz;
}

// The repeats of one dtype, best first.
struct Repeats {
  std::vector<kernels::PeakSample> samples;
  double seconds = 0;

  double best() const { return samples.empty() ? 0 : samples[0].gflops_per_core; }
  PeakRepeats facts() const {
    PeakRepeats r;
    r.repeats = static_cast<int>(samples.size());
    r.seconds = seconds;
    if (samples.empty()) return r;
    r.on_cpu = samples[0].on_cpu;
    if (samples.size() >= 2) {
      r.spread = best() > 0 ? (samples[0].gflops_per_core - samples[1].gflops_per_core) / best() : 0;
      r.on_cpu = std::min(r.on_cpu, samples[1].on_cpu);
    }
    return r;
  }
};

std::vector<kernels::PeakSample> best_first(std::vector<kernels::PeakSample> s) {
  std::sort(s.begin(), s.end(), [](const kernels::PeakSample& a, const kernels::PeakSample& b) {
    return a.gflops_per_core > b.gflops_per_core;
  });
  return s;
}

Repeats measure_repeats(DType dtype, int threads, double seconds, int repeats) {
  Repeats r;
  r.seconds = seconds;
  for (int i = 0; i < std::max(1, repeats); i++) r.samples.push_back(kernels::measure_peak(dtype, threads, seconds));
  r.samples = best_first(std::move(r.samples));
  return r;
}

std::string describe_repeats(const PeakRepeats& r) {
  if (r.repeats == 0) return "";
  if (r.repeats == 1) return fmt("one measurement of %.2f s", r.seconds);
  return fmt("best of %d x %.2f s, best two %.1f%% apart, threads running %.0f%% of the time", r.repeats, r.seconds,
             100 * r.spread, 100 * r.on_cpu);
}

// Measures both dtypes; stores them when `store` and both pass. `replace`:
// the cached entry is known bad (stale or impossible): overwritten when the
// measurement passes, removed when it does not.
MachinePeak measure_and_store(int threads, double seconds, int repeats, bool store, bool replace,
                              const std::string& why_no_store) {
  const Repeats fp32 = measure_repeats(DType::F32, threads, seconds, repeats);
  std::optional<Repeats> bf16;
  if (kernels::peak_measurable(DType::BF16)) bf16 = measure_repeats(DType::BF16, threads, seconds, repeats);
  remeasure_clock();
  const PeakCeiling ceiling = peak_ceiling();
  MachinePeak p;
  p.threads = threads;
  p.source = "measured now";
  p.fp32_gflops_per_core = fp32.best();
  p.fp32_repeats = fp32.facts();
  if (bf16) {
    p.bf16_gflops_per_core = bf16->best();
    p.bf16_repeats = bf16->facts();
  }
  std::string why = why_not_cacheable(DType::F32, fp32.samples, ceiling);
  if (bf16) {
    const std::string why_bf16 = why_not_cacheable(DType::BF16, bf16->samples, ceiling);
    if (!why_bf16.empty()) why += (why.empty() ? "" : "; ") + why_bf16;
  }
  if (why.empty() && !why_no_store.empty()) why = why_no_store;
  if (why.empty() && !store) why = "not asked to";
  if (!why.empty()) {
    p.not_cached_because = why;
    p.note = "not cached: " + why;
    if (replace && store) erase_entry(threads);
    return p;
  }
  CachedEntry fresh{CachedFigure{p.fp32_gflops_per_core, p.fp32_repeats}, std::nullopt};
  if (bf16) fresh.bf16 = CachedFigure{p.bf16_gflops_per_core, p.bf16_repeats};
  const CachedEntry now = store_entry(threads, fresh, /*keep_higher=*/!replace, ceiling);
  p.cached = true;
  p.note = "stored in " + peak_cache_path();
  if (now.fp32.gflops_per_core > p.fp32_gflops_per_core)
    p.note += fmt(" (which keeps its higher fp32 %.1f)", now.fp32.gflops_per_core);
  if (bf16 && now.bf16 && now.bf16->gflops_per_core > p.bf16_gflops_per_core)
    p.note += fmt(" (which keeps its higher bf16 %.1f)", now.bf16->gflops_per_core);
  return p;
}

}  // namespace

double PeakCeiling::gflops_per_core(DType dtype) const {
  if (clock_ghz <= 0) return 0;
  return (1 + kCeilingSlack) * kernels::peak_flops_per_cycle(dtype, active_isa()) * clock_ghz;
}

std::string PeakCeiling::describe(DType dtype) const {
  if (clock_ghz <= 0) return "no ceiling check (the clock is unknown: nothing measured or stated)";
  const double per_cycle = kernels::peak_flops_per_cycle(dtype, active_isa());
  if (per_cycle <= 0) return "no ceiling check (no loop at this level)";
  return fmt("ceiling %.1f (%.0f FLOP/cycle x %.2f GHz %s, +%.0f%%)", gflops_per_core(dtype), per_cycle, clock_ghz,
             clock_source.c_str(), 100 * kCeilingSlack);
}

PeakCeiling peak_ceiling() {
  double measured = 0;
  {
    std::lock_guard<std::mutex> lock(g_clock_mutex);
    if (g_clock_for_testing > 0) return PeakCeiling{g_clock_for_testing, "set for testing"};
    if (g_clock_for_testing < 0) return PeakCeiling{};
    measured = g_measured_clock_ghz;
  }
  if (measured <= 0) measured = remeasure_clock();
  static const StatedClock stated = stated_clock();
  PeakCeiling c;
  for (const auto& [ghz, source] : {std::pair<double, const char*>{measured, "measured"},
                                    {stated.max_freq_ghz, "cpuinfo_max_freq"},
                                    {stated.cpu_mhz_ghz, "cpu MHz"}})
    if (ghz > c.clock_ghz) c = PeakCeiling{ghz, source};
  return c;
}

void set_peak_clock_for_testing(double ghz) {
  std::lock_guard<std::mutex> lock(g_clock_mutex);
  g_clock_for_testing = ghz;
}

std::string why_not_cacheable(DType dtype, const std::vector<kernels::PeakSample>& repeats,
                              const PeakCeiling& ceiling) {
  const std::vector<kernels::PeakSample> s = best_first(repeats);
  const char* name = peak_dtype_name(dtype);
  std::vector<std::string> why;
  if (s.size() < 2) {
    why.push_back(fmt("%s: one repeat (two within %.0f%% are needed)", name, 100 * kMaxSpread));
  } else {
    const double best = s[0].gflops_per_core, second = s[1].gflops_per_core;
    const double spread = best > 0 ? (best - second) / best : 0;
    if (spread > kMaxSpread)
      why.push_back(fmt("%s: best two repeats %.1f%% apart (more than %.0f%%)", name, 100 * spread, 100 * kMaxSpread));
  }
  if (!s.empty()) {
    const double on_cpu = s.size() >= 2 ? std::min(s[0].on_cpu, s[1].on_cpu) : s[0].on_cpu;
    if (on_cpu < kMinOnCpu)
      why.push_back(fmt("%s: a measuring thread ran only %.0f%% of the time (other work shared its core; %.0f%% "
                        "needed)",
                        name, 100 * on_cpu, 100 * kMinOnCpu));
    const double limit = ceiling.gflops_per_core(dtype);
    if (limit > 0 && s[0].gflops_per_core > limit)
      why.push_back(fmt("%s: %.1f GFLOP/s per core is above the %s", name, s[0].gflops_per_core,
                        ceiling.describe(dtype).c_str()));
  }
  std::string out;
  for (const std::string& w : why) out += (out.empty() ? "" : "; ") + w;
  return out;
}

DType MachinePeak::gemm_dtype(DType compute) const {
  return compute == DType::BF16 && bf16_gflops_per_core > 0 && kernels::gemm_paths().bf16_uses_primitive()
             ? DType::BF16
             : DType::F32;
}

double MachinePeak::gflops_per_core(DType compute) const {
  return gemm_dtype(compute) == DType::BF16 ? bf16_gflops_per_core : fp32_gflops_per_core;
}

std::string MachinePeak::describe(DType compute) const {
  const DType d = gemm_dtype(compute);
  const double per_core = gflops_per_core(compute);
  std::string s = fmt("%.0f GFLOP/s %s (%d thread%s x %.1f", per_core * threads, peak_dtype_name(d), threads,
                      threads == 1 ? "" : "s", per_core);
  const kernels::GemmPaths& g = kernels::gemm_paths();
  if (compute == DType::BF16 && d == DType::BF16) {
    s += ", the VDPBF16PS rate: bf16 GEMMs run on oneDNN's bf16 matmul";
    if (g.dnnl_isa.find("amx") != std::string::npos)
      s += " (which uses AMX here, faster than VDPBF16PS: MFU can read above 100%)";
  } else if (compute == DType::BF16 && g.bf16_uses_primitive()) {
    s += ", the fp32 FMA rate: no bf16 figure at this level";
  } else if (compute == DType::BF16) {
    s += ", the fp32 FMA rate: bf16 GEMMs widen to the fp32 sgemm";
  } else if (compute == DType::F16) {
    s += ", the fp32 FMA rate: f16 GEMMs run as the fp32 sgemm";
  }
  if (source == "LATTICE_PEAK_GFLOPS_PER_CORE") return s + "; set by LATTICE_PEAK_GFLOPS_PER_CORE)";
  s += "; " + source;
  const std::string repeats = describe_repeats(d == DType::BF16 ? bf16_repeats : fp32_repeats);
  if (!repeats.empty()) s += ": " + repeats;
  if (!note.empty()) s += "; " + note;
  return s + "; " + peak_ceiling().describe(d) + "; LATTICE_PEAK_GFLOPS_PER_CORE overrides)";
}

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
  return measure_and_store(threads, seconds, repeats, store, /*replace=*/false, "");
}

MachinePeak machine_peak(int threads, int at_once, bool store) {
  if (const double v = env_peak(); v > 0) {
    MachinePeak p;
    p.fp32_gflops_per_core = v;
    p.bf16_gflops_per_core = v;
    p.threads = threads;
    p.source = "LATTICE_PEAK_GFLOPS_PER_CORE";
    return p;
  }
  PeakCeiling ceiling = peak_ceiling();
  const bool bf16_here = kernels::peak_measurable(DType::BF16);
  std::string dropped;  // why the cache entry was not used
  if (std::optional<CachedEntry> e = read_entry(at_once)) {
    const double c32 = e->fp32.gflops_per_core, cbf = e->bf16 ? e->bf16->gflops_per_core : 0;
    double lim32 = ceiling.gflops_per_core(DType::F32), limbf = ceiling.gflops_per_core(DType::BF16);
    if ((lim32 > 0 && c32 > lim32) || (bf16_here && limbf > 0 && cbf > limbf)) {
      remeasure_clock();  // once more, before calling the figure impossible
      ceiling = peak_ceiling();
      lim32 = ceiling.gflops_per_core(DType::F32);
      limbf = ceiling.gflops_per_core(DType::BF16);
    }
    if (lim32 > 0 && c32 > lim32) {
      dropped = fmt("the cached fp32 %.1f is above the %s", c32, ceiling.describe(DType::F32).c_str());
    } else if (bf16_here && limbf > 0 && cbf > limbf) {
      dropped = fmt("the cached bf16 %.1f is above the %s", cbf, ceiling.describe(DType::BF16).c_str());
    } else {
      // The start-up check: a short measurement well above the cached figure
      // proves the figure was measured under load.
      const double k32 = kernels::measure_peak(DType::F32, threads, kCheckSeconds).gflops_per_core;
      const double kbf = bf16_here ? kernels::measure_peak(DType::BF16, threads, kCheckSeconds).gflops_per_core : 0;
      if (k32 > (1 + kStaleMargin) * c32) {
        dropped = fmt("the cached fp32 %.1f was stale: a %.2f-s check read %.1f, more than %.0f%% above", c32,
                      kCheckSeconds, k32, 100 * kStaleMargin);
      } else if (bf16_here && kbf > (1 + kStaleMargin) * cbf) {
        dropped = fmt("the cached bf16 %.1f was stale: a %.2f-s check read %.1f, more than %.0f%% above", cbf,
                      kCheckSeconds, kbf, 100 * kStaleMargin);
      } else {
        MachinePeak p;
        p.fp32_gflops_per_core = c32;
        p.fp32_repeats = e->fp32.repeats;
        if (e->bf16) {
          p.bf16_gflops_per_core = cbf;
          p.bf16_repeats = e->bf16->repeats;
        }
        p.threads = threads;
        p.source = "cached in " + peak_cache_path();
        p.cached = true;
        p.note = fmt("a %.2f-s check at start-up read fp32 %.1f", kCheckSeconds, k32);
        if (bf16_here) p.note += fmt(", bf16 %.1f", kbf);
        p.note += fmt(" (not more than %.0f%% above)", 100 * kStaleMargin);
        return p;
      }
    }
  }
  std::string why_no_store;
  if (!store) {
    why_no_store = "several ranks share this machine";
  } else if (threads != at_once) {
    why_no_store = fmt("%d threads measured for the %d that run at once", threads, at_once);
  }
  MachinePeak p = measure_and_store(threads, kStartupSeconds, kStartupRepeats, store && threads == at_once,
                                    /*replace=*/true, why_no_store);
  if (!dropped.empty()) p.note = dropped + " (dropped); " + p.note;
  return p;
}

std::string describe_machine() {
  std::string s = cpu_info().describe() + "; kernels " + isa_name(active_isa());
  if (isa_forced()) s += std::string(" (LATTICE_ISA; the CPU has ") + isa_name(detected_isa()) + ")";
  return s + "; GEMM " + kernels::describe_gemm_paths();
}

}  // namespace lattice::train
