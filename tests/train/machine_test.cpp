// The peak MFU is relative to (train/machine.h) cannot be inflated: a low
// cached figure is found out and replaced, a figure above what the ISA can do
// at the clock is never cached nor used, a measurement is cached only when it
// is repeatable and was taken alone, and bf16 runs divide by the rate of the
// arithmetic their GEMMs run in.
#include <gtest/gtest.h>
#include <time.h>

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "lattice/core/cpu.h"
#include "lattice/core/threads.h"
#include "lattice/core/timer.h"
#include "lattice/io/json.h"
#include "lattice/kernels/ops.h"
#include "lattice/train/machine.h"

using namespace lattice;
namespace fs = std::filesystem;

namespace {

// A fresh LATTICE_CACHE_DIR for one test (and the machine's clock back).
class PeakCacheTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("lattice_machine_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    setenv("LATTICE_CACHE_DIR", dir_.c_str(), 1);
    unsetenv("LATTICE_PEAK_GFLOPS_PER_CORE");
    train::set_peak_clock_for_testing(0);
  }
  void TearDown() override {
    train::set_peak_clock_for_testing(0);
    unsetenv("LATTICE_CACHE_DIR");
    fs::remove_all(dir_);
  }

  // The cache entry lattice keys one thread at this level with.
  static std::string key() { return cpu_info().model + " | " + isa_name(active_isa()) + " | 1 threads"; }

  // Writes an entry for one thread as lattice would have written it (with
  // the facts of a measurement that passed the rule).
  void write_entry(double fp32, double bf16) {
    auto figure = [](double g) {
      io::JsonValue o = io::JsonValue::object();
      o.set("gflops_per_core", io::JsonValue::number(g));
      o.set("repeats", io::JsonValue::integer(3));
      o.set("seconds", io::JsonValue::number(0.5));
      o.set("spread", io::JsonValue::number(0.01));
      o.set("on_cpu", io::JsonValue::number(1.0));
      return o;
    };
    io::JsonValue entry = io::JsonValue::object();
    entry.set("fp32", figure(fp32));
    if (bf16 > 0) entry.set("bf16", figure(bf16));
    io::JsonValue cache = io::JsonValue::object();
    cache.set(key(), entry);
    std::ofstream(train::peak_cache_path()) << io::to_json(cache, 2) << "\n";
  }

  // The cached figure of `dtype` ("fp32", "bf16") for one thread (0: no entry).
  double cached(const char* dtype) const {
    std::ifstream in(train::peak_cache_path());
    if (!in.good()) return 0;
    std::stringstream text;
    text << in.rdbuf();
    const io::JsonValue cache = io::parse_json(text.str(), "peak.json");
    const io::JsonValue* e = cache.find(key());
    if (!e) return 0;
    const io::JsonValue* f = e->find(dtype);
    return f ? f->at("gflops_per_core").as_double() : 0;
  }
  double cached_fp32() const { return cached("fp32"); }

  // A figure the machine reaches that no 0.05-s check beats by 10%: above
  // what it measures, under the ceiling (5% above the theoretical rate).
  static double good_figure(double measured, DType dtype) {
    const double ceiling = train::peak_ceiling().gflops_per_core(dtype);
    return ceiling > 0 ? std::max(measured, 0.99 * ceiling) : 1.5 * measured;
  }

  fs::path dir_;
};

kernels::PeakSample sample(double gflops, double on_cpu = 1.0) { return kernels::PeakSample{gflops, on_cpu}; }

double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

bool has(const std::string& text, const std::string& piece) { return text.find(piece) != std::string::npos; }

}  // namespace

// The rule, on figures made up for it: two repeats within 5%, every thread
// running >= 90% of the time, not above the ceiling.
TEST(PeakRule, RepeatableAloneAndUnderTheCeiling) {
  const train::PeakCeiling fast{100.0, "set for testing"};  // a ceiling no figure here reaches
  EXPECT_EQ(train::why_not_cacheable(DType::F32, {sample(100), sample(96), sample(80)}, fast), "");
  EXPECT_TRUE(has(train::why_not_cacheable(DType::F32, {sample(100)}, fast), "one repeat"));
  EXPECT_TRUE(has(train::why_not_cacheable(DType::F32, {sample(90), sample(100)}, fast), "10.0% apart"));
  // Steady but sharing its core with other work: repeatable, and still refused.
  EXPECT_TRUE(has(train::why_not_cacheable(DType::F32, {sample(100, 0.5), sample(99, 0.5)}, fast), "ran only 50%"));
  // The third repeat may have been disturbed; only the best two count.
  EXPECT_EQ(train::why_not_cacheable(DType::F32, {sample(100), sample(99), sample(40, 0.3)}, fast), "");
  // Above FLOPs a cycle x clock (+5%): 1 GHz bounds any level's loop below 140 GFLOP/s.
  const train::PeakCeiling slow{1.0, "set for testing"};
  const double limit = slow.gflops_per_core(DType::F32);
  EXPECT_GT(limit, 0);
  EXPECT_LT(limit, 140);
  EXPECT_TRUE(has(train::why_not_cacheable(DType::F32, {sample(1.01 * limit), sample(limit)}, slow),
                  "above the ceiling"));
  EXPECT_EQ(train::why_not_cacheable(DType::F32, {sample(0.99 * limit), sample(0.98 * limit)}, slow), "");
  // No clock: that one check is skipped, and the ceiling says why.
  const train::PeakCeiling unknown;
  EXPECT_EQ(train::why_not_cacheable(DType::F32, {sample(1e6), sample(1e6)}, unknown), "");
  EXPECT_TRUE(has(unknown.describe(DType::F32), "clock is unknown"));
}

// A measuring thread that shares its core with other work still reads the
// peak (its FLOPs per second of its own CPU time), and says it shared: here
// a spinning thread is pinned to the same CPU.
TEST(PeakRule, SharingTheCoreNeitherLowersTheFigureNorGoesUnnoticed) {
  cpu_set_t saved;
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof saved, &saved), 0);
  int cpu = 0;
  while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &saved)) cpu++;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof one, &one), 0);
  auto best_of_two = [] {
    kernels::PeakSample a = kernels::measure_peak(DType::F32, 1, 0.1), b = kernels::measure_peak(DType::F32, 1, 0.1);
    return a.gflops_per_core > b.gflops_per_core ? a : b;
  };
  const kernels::PeakSample alone = best_of_two();
  std::atomic<bool> stop{false};
  std::thread spinner([&] {
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    while (!stop.load(std::memory_order_relaxed)) {
    }
  });
  const kernels::PeakSample shared = best_of_two();
  stop = true;
  spinner.join();
  pthread_setaffinity_np(pthread_self(), sizeof saved, &saved);
  EXPECT_LT(shared.on_cpu, 0.8) << "the spinner did not share the core";
  EXPECT_GT(shared.gflops_per_core, 0.85 * alone.gflops_per_core)
      << "shared " << shared.gflops_per_core << " (running " << shared.on_cpu << " of the time), alone "
      << alone.gflops_per_core;
  EXPECT_NE(train::why_not_cacheable(DType::F32, {shared, shared}, train::PeakCeiling{}), "");
}

// The clock: what a dependent chain of additions measures is a clock this
// CPU can run at (between 0.5 and 7 GHz), and the machine's ceiling has one.
TEST(PeakRule, TheClockIsMeasured) {
#if defined(__x86_64__)
  const double ghz = measure_clock_ghz(0.01);
  EXPECT_GT(ghz, 0.5);
  EXPECT_LT(ghz, 7.0);
  const train::PeakCeiling c = train::peak_ceiling();
  EXPECT_GE(c.clock_ghz, ghz * 0.8) << c.clock_source;
#else
  GTEST_SKIP() << "the clock is measured on x86-64 only";
#endif
}

// A cached peak 1/4 of the real one (as the wall-clock measurements taken
// while a test suite loaded every core left: half the peak on 2 cores) is
// found out by the start-up check, dropped and replaced: neither used nor
// kept. Each dtype in turn is the low one.
TEST_F(PeakCacheTest, ALowCachedPeakIsReplaced) {
  const train::MachinePeak real = train::measure_machine_peak(1, 0.1, 3, /*store=*/false);
  ASSERT_GT(real.fp32_gflops_per_core, 0);
  for (DType dtype : {DType::F32, DType::BF16}) {
    const bool bf16 = dtype == DType::BF16;
    if (bf16 && real.bf16_gflops_per_core == 0) continue;  // no bf16 figure at this level
    const char* name = bf16 ? "bf16" : "fp32";
    const double low = (bf16 ? real.bf16_gflops_per_core : real.fp32_gflops_per_core) / 4;
    write_entry(bf16 ? good_figure(real.fp32_gflops_per_core, DType::F32) : low,
                bf16 ? low : real.bf16_gflops_per_core > 0 ? good_figure(real.bf16_gflops_per_core, DType::BF16) : 0);
    ASSERT_EQ(cached(name), low);
    Timer startup;
    const train::MachinePeak p = train::machine_peak(1, 1, /*store=*/true);
    std::printf("machine_peak with a stale cache entry: %.3f s\nMFU relative to %s\n", startup.seconds(),
                p.describe(dtype).c_str());
    EXPECT_EQ(p.source, "measured now") << name << ": " << p.note;
    EXPECT_TRUE(has(p.note, std::string("the cached ") + name)) << p.note;
    EXPECT_TRUE(has(p.note, "stale")) << p.note;
    EXPECT_GT(bf16 ? p.bf16_gflops_per_core : p.fp32_gflops_per_core, 1.1 * low) << p.note;
    // Replaced by the new measurement where it passed the rule, else removed.
    const double now = cached(name);
    EXPECT_TRUE(p.cached ? now == (bf16 ? p.bf16_gflops_per_core : p.fp32_gflops_per_core) : now == 0)
        << now << "; " << p.note;
    EXPECT_NE(now, low);
  }
}

// A cached figure the machine can reach is kept after the start-up check.
TEST_F(PeakCacheTest, AGoodCachedPeakIsUsed) {
  const train::MachinePeak real = train::measure_machine_peak(1, 0.1, 3, /*store=*/false);
  const double fp32 = good_figure(real.fp32_gflops_per_core, DType::F32);
  write_entry(fp32, real.bf16_gflops_per_core > 0 ? good_figure(real.bf16_gflops_per_core, DType::BF16) : 0);
  Timer startup;
  const train::MachinePeak p = train::machine_peak(1, 1, /*store=*/true);
  std::printf("machine_peak with a good cache entry: %.3f s\nMFU relative to %s\n", startup.seconds(),
              p.describe(DType::BF16).c_str());
  EXPECT_TRUE(p.cached);
  EXPECT_EQ(p.fp32_gflops_per_core, fp32) << p.note;
  EXPECT_TRUE(has(p.source, "cached in " + train::peak_cache_path())) << p.source;
  EXPECT_TRUE(has(p.describe(DType::F32), "check at start-up")) << p.describe(DType::F32);
}

// A figure above FLOPs a cycle x clock is never cached: not from a new
// measurement, and an entry holding one is not used.
TEST_F(PeakCacheTest, AFigureAboveTheCeilingIsNeverCached) {
  train::set_peak_clock_for_testing(0.001);  // every real figure is above this ceiling
  const train::MachinePeak m = train::measure_machine_peak(1, 0.05, 2, /*store=*/true);
  EXPECT_FALSE(m.cached);
  EXPECT_TRUE(has(m.not_cached_because, "above the ceiling")) << m.not_cached_because;
  EXPECT_EQ(cached_fp32(), 0);
  const train::MachinePeak t = train::machine_peak(1, 1, /*store=*/true);
  EXPECT_FALSE(t.cached);
  EXPECT_EQ(cached_fp32(), 0);

  train::set_peak_clock_for_testing(0);  // the machine's clock
  const double ceiling = train::peak_ceiling().gflops_per_core(DType::F32);
  if (ceiling <= 0) GTEST_SKIP() << "no clock here: " << train::peak_ceiling().describe(DType::F32);
  // Each dtype in turn impossible, the other one a figure the machine reaches.
  const train::MachinePeak real = train::measure_machine_peak(1, 0.1, 2, /*store=*/false);
  for (DType dtype : {DType::F32, DType::BF16}) {
    const bool bf16 = dtype == DType::BF16;
    if (bf16 && real.bf16_gflops_per_core == 0) continue;
    const double impossible = 100 * train::peak_ceiling().gflops_per_core(dtype);
    write_entry(bf16 ? good_figure(real.fp32_gflops_per_core, DType::F32) : impossible,
                bf16 ? impossible
                     : real.bf16_gflops_per_core > 0 ? good_figure(real.bf16_gflops_per_core, DType::BF16) : 0);
    const train::MachinePeak p = train::machine_peak(1, 1, /*store=*/true);
    const char* name = bf16 ? "bf16" : "fp32";
    EXPECT_LT(bf16 ? p.bf16_gflops_per_core : p.fp32_gflops_per_core, impossible / 100) << p.note;
    EXPECT_TRUE(has(p.note, std::string("the cached ") + name)) << p.note;
    EXPECT_TRUE(has(p.note, "is above the ceiling")) << p.note;
    EXPECT_LT(cached(name), impossible / 100);
  }
}

// `lattice bench peak` keeps the higher of its figure and a valid cached one,
// never an impossible one. (Skipped when the machine is too busy for its
// measurement to pass the rule: nothing is stored then.)
TEST_F(PeakCacheTest, BenchPeakNeverKeepsAnImpossibleFigure) {
  if (train::peak_ceiling().gflops_per_core(DType::F32) <= 0) GTEST_SKIP() << "no clock here";
  write_entry(100 * train::peak_ceiling().gflops_per_core(DType::F32), 0);
  const train::MachinePeak bench = train::measure_machine_peak(1, 0.1, 3, /*store=*/true);
  if (!bench.cached) GTEST_SKIP() << "this measurement did not pass the rule here: " << bench.not_cached_because;
  EXPECT_EQ(cached("fp32"), bench.fp32_gflops_per_core) << bench.note;
}

// LATTICE_PEAK_GFLOPS_PER_CORE sets the peak of every dtype; nothing is cached.
TEST_F(PeakCacheTest, TheEnvironmentOverrides) {
  setenv("LATTICE_PEAK_GFLOPS_PER_CORE", "123.5", 1);
  const train::MachinePeak p = train::machine_peak(2, 2);
  unsetenv("LATTICE_PEAK_GFLOPS_PER_CORE");
  EXPECT_EQ(p.gflops_per_core(DType::F32), 123.5);
  EXPECT_EQ(p.gflops_per_core(DType::BF16), 123.5);
  EXPECT_TRUE(has(p.describe(DType::F32), "247 GFLOP/s fp32 (2 threads x 123.5")) << p.describe(DType::F32);
  EXPECT_TRUE(has(p.describe(DType::F32), "set by LATTICE_PEAK_GFLOPS_PER_CORE")) << p.describe(DType::F32);
  EXPECT_FALSE(fs::exists(train::peak_cache_path()));
}

// The dtype MFU divides by: bf16's peak where bf16 GEMMs run on oneDNN's
// bf16 matmul, fp32's otherwise (f16 GEMMs are fp32 sgemm).
TEST(MachinePeakDtype, FollowsTheGemmPath) {
  train::MachinePeak p;
  p.fp32_gflops_per_core = 100;
  p.bf16_gflops_per_core = 200;
  p.threads = 1;
  p.source = "measured now";
  const bool primitive = kernels::gemm_paths().bf16_uses_primitive();
  EXPECT_EQ(p.gflops_per_core(DType::F32), 100);
  EXPECT_EQ(p.gflops_per_core(DType::F16), 100);
  EXPECT_EQ(p.gflops_per_core(DType::BF16), primitive ? 200 : 100);
  EXPECT_TRUE(has(p.describe(DType::BF16), primitive ? "200 GFLOP/s bf16" : "100 GFLOP/s fp32"))
      << p.describe(DType::BF16);
  EXPECT_TRUE(has(p.describe(DType::F16), "f16 GEMMs run as the fp32 sgemm")) << p.describe(DType::F16);
  p.bf16_gflops_per_core = 0;  // no bf16 figure at this level
  EXPECT_EQ(p.gflops_per_core(DType::BF16), 100);
}

// bf16 MFU <= 100%: the model FLOPs of a bf16 GEMM (2·M·N·K), timed through
// kernels::gemm under a Bf16GemmScope, per second and core, never exceed the
// peak gflops_per_core(BF16) gives. Dividing by the fp32 peak instead (the
// step line before) reads about 1.6x on a CPU whose bf16 matmul runs at 2x.
TEST(MachinePeakDtype, Bf16GemmRunsAtMostAtTheBf16Peak) {
  set_num_threads(1);
  constexpr int64_t n = 768;
  std::vector<float> a(n * n), b(n * n), c(n * n);
  for (int64_t i = 0; i < n * n; i++) {
    a[i] = static_cast<float>((i * 7 % 13) - 6) / 8;
    b[i] = static_cast<float>((i * 5 % 11) - 5) / 8;
  }
  kernels::GemmConstant ca, cb;  // converted to bf16 once, as the trainer's weights are
  ca.set(a.data(), n * n);
  cb.set(b.data(), n * n);
  // Rounds of a peak measurement (2 x 0.1 s) and 0.1 s of GEMMs, so that both
  // are rates over the same length of time (the clock of a VM's core moves by
  // a few percent from moment to moment); the best of each. Both count CPU
  // time (the process's, for the GEMMs: every thread oneDNN might use), so a
  // neighbour's load lowers neither.
  double peak = 0, best_gemm = 0;
  for (int round = 0; round < 3; round++) {
    peak = std::max(peak, train::measure_machine_peak(1, 0.1, 2, /*store=*/false).gflops_per_core(DType::BF16));
    kernels::Bf16GemmScope scope;
    kernels::gemm(false, true, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);  // warm
    Timer t;
    const double cpu0 = process_cpu_seconds();
    int calls = 0;
    do {
      kernels::gemm(false, true, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
      calls++;
    } while (t.seconds() < 0.1);
    best_gemm = std::max(best_gemm, 2.0 * n * n * n * calls / (process_cpu_seconds() - cpu0) / 1e9);
  }
  ASSERT_GT(peak, 0);
  EXPECT_LE(best_gemm / peak, 1.0) << "bf16 GEMM " << best_gemm << " GFLOP/s on one thread against a peak of " << peak
                                   << " (" << kernels::describe_gemm_paths() << ")";
  std::printf("bf16 GEMM %.1f GFLOP/s = %.0f%% of the %s peak %.1f\n", best_gemm, 100 * best_gemm / peak,
              kernels::gemm_paths().bf16_uses_primitive() ? "bf16" : "fp32", peak);
}
