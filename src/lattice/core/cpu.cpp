#include "lattice/core/cpu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "lattice/core/error.h"
#include "lattice/core/timer.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace lattice {
namespace {

#if defined(__x86_64__)
struct Regs {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

Regs cpuid(unsigned leaf, unsigned subleaf = 0) {
  Regs r;
  if (!__get_cpuid_count(leaf, subleaf, &r.eax, &r.ebx, &r.ecx, &r.edx)) return Regs{};
  return r;
}

unsigned long long xgetbv0() {
  unsigned eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

bool bit(unsigned value, int n) { return (value >> n) & 1u; }

std::string trim(std::string s) {
  const size_t b = s.find_first_not_of(' ');
  const size_t e = s.find_last_not_of(' ');
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

CpuInfo read_cpu_info() {
  CpuInfo c;
  const Regs v = cpuid(0);
  char vendor[13] = {};
  std::memcpy(vendor + 0, &v.ebx, 4);
  std::memcpy(vendor + 4, &v.edx, 4);
  std::memcpy(vendor + 8, &v.ecx, 4);
  c.vendor = vendor;
  const unsigned max_leaf = v.eax;

  const Regs l1 = cpuid(1);
  const unsigned base_family = (l1.eax >> 8) & 0xF, base_model = (l1.eax >> 4) & 0xF;
  c.stepping = static_cast<int>(l1.eax & 0xF);
  c.family = static_cast<int>(base_family == 0xF ? base_family + ((l1.eax >> 20) & 0xFF) : base_family);
  c.model_number = static_cast<int>(base_family == 0x6 || base_family == 0xF
                                        ? base_model + (((l1.eax >> 16) & 0xF) << 4)
                                        : base_model);

  // Register state the OS saves on context switches: without it the
  // instructions fault even where CPUID lists them.
  const bool osxsave = bit(l1.ecx, 27);
  const unsigned long long xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_avx = (xcr0 & 0x6) == 0x6;             // XMM and YMM state
  const bool os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;  // opmask, ZMM_Hi256, Hi16_ZMM

  c.sse2 = bit(l1.edx, 26);
  c.fma = os_avx && bit(l1.ecx, 12);
  c.movbe = bit(l1.ecx, 22);
  c.avx = os_avx && bit(l1.ecx, 28);
  c.f16c = os_avx && bit(l1.ecx, 29);
  if (max_leaf >= 7) {
    const Regs l7 = cpuid(7, 0);
    c.bmi1 = bit(l7.ebx, 3);
    c.avx2 = os_avx && bit(l7.ebx, 5);
    c.bmi2 = bit(l7.ebx, 8);
    c.avx512f = os_avx512 && bit(l7.ebx, 16);
    c.avx512dq = os_avx512 && bit(l7.ebx, 17);
    c.avx512cd = os_avx512 && bit(l7.ebx, 28);
    c.avx512bw = os_avx512 && bit(l7.ebx, 30);
    c.avx512vl = os_avx512 && bit(l7.ebx, 31);
    c.amx_bf16 = bit(l7.edx, 22) && ((xcr0 >> 17) & 3) == 3;  // TILECFG and TILEDATA state
    if (l7.eax >= 1) c.avx512_bf16 = os_avx512 && bit(cpuid(7, 1).eax, 5);
  }
  const Regs ext = cpuid(0x80000000);
  if (ext.eax >= 0x80000001) c.lzcnt = bit(cpuid(0x80000001).ecx, 5);
  if (ext.eax >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; i++) {
      const Regs b = cpuid(0x80000002 + i);
      std::memcpy(brand + 16 * i + 0, &b.eax, 4);
      std::memcpy(brand + 16 * i + 4, &b.ebx, 4);
      std::memcpy(brand + 16 * i + 8, &b.ecx, 4);
      std::memcpy(brand + 16 * i + 12, &b.edx, 4);
    }
    c.model = trim(brand);
  }
  if (c.model.empty()) c.model = "unknown " + c.vendor + " CPU";
  return c;
}
#else
CpuInfo read_cpu_info() {
  CpuInfo c;
  c.vendor = "unknown";
  c.model = "non-x86-64 CPU";
  return c;
}
#endif

std::atomic<int> g_active_isa{-1};
std::atomic<int> g_startup_isa{-1};
std::atomic<bool> g_forced{false};
std::once_flag g_active_once;

void init_active_isa() {
  const Isa best = detected_isa();
  Isa isa = best;
  const char* env = std::getenv("LATTICE_ISA");
  if (env && *env && std::strcmp(env, "auto") != 0) {
    isa = parse_isa(env, "LATTICE_ISA");
    const std::vector<std::string> missing = cpu_info().missing_for(isa);
    if (!missing.empty()) {
      std::ostringstream m;
      for (size_t i = 0; i < missing.size(); i++) m << (i ? "," : "") << missing[i];
      LATTICE_FAIL("LATTICE_ISA=" << env << ": this CPU (" << cpu_info().model << ") lacks " << m.str()
                                  << "; it can run " << isa_name(best) << " or lower");
    }
  }
  g_forced.store(isa != best);
  g_startup_isa.store(static_cast<int>(isa));
  g_active_isa.store(static_cast<int>(isa));
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Baseline: return "baseline";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
  }
  return "?";
}

Isa parse_isa(const std::string& text, const std::string& what) {
  for (int i = 0; i < kIsaCount; i++)
    if (text == isa_name(static_cast<Isa>(i))) return static_cast<Isa>(i);
  LATTICE_FAIL(what << "='" << text << "' is not an instruction set level (valid: avx512, avx2, baseline, auto)");
}

std::vector<std::string> CpuInfo::missing_for(Isa isa) const {
  std::vector<std::string> missing;
  auto need = [&](bool have, const char* name) {
    if (!have) missing.push_back(name);
  };
  need(sse2, "sse2");
  if (isa >= Isa::Avx2) {
    need(avx, "avx");
    need(avx2, "avx2");
    need(fma, "fma");
    need(bmi1, "bmi1");
    need(bmi2, "bmi2");
    need(f16c, "f16c");
    need(lzcnt, "lzcnt");
    need(movbe, "movbe");
  }
  if (isa >= Isa::Avx512) {
    need(avx512f, "avx512f");
    need(avx512bw, "avx512bw");
    need(avx512cd, "avx512cd");
    need(avx512dq, "avx512dq");
    need(avx512vl, "avx512vl");
  }
  return missing;
}

std::string CpuInfo::describe() const {
  std::ostringstream s;
  s << model << " (" << vendor << " family " << family << " model " << model_number << ")";
  return s.str();
}

const CpuInfo& cpu_info() {
  static const CpuInfo info = read_cpu_info();
  return info;
}

Isa detected_isa() {
  static const Isa best = [] {
    for (int i = kIsaCount - 1; i > 0; i--)
      if (cpu_info().missing_for(static_cast<Isa>(i)).empty()) return static_cast<Isa>(i);
    return Isa::Baseline;
  }();
  return best;
}

Isa active_isa() {
  const int v = g_active_isa.load(std::memory_order_relaxed);
  if (v >= 0) return static_cast<Isa>(v);
  std::call_once(g_active_once, init_active_isa);
  return static_cast<Isa>(g_active_isa.load());
}

Isa startup_isa() {
  active_isa();
  return static_cast<Isa>(g_startup_isa.load());
}

bool isa_forced() {
  active_isa();
  return g_forced.load();
}

void set_active_isa_for_testing(Isa isa) {
  active_isa();
  LATTICE_CHECK(isa <= detected_isa(), "set_active_isa_for_testing(" << isa_name(isa) << "): this CPU can run "
                                                                      << isa_name(detected_isa()) << " at most");
  g_active_isa.store(static_cast<int>(isa));
}

std::vector<Isa> runnable_isas() {
  std::vector<Isa> out;
  for (int i = static_cast<int>(detected_isa()); i >= 0; i--) out.push_back(static_cast<Isa>(i));
  return out;
}

StatedClock stated_clock() {
  StatedClock c;
  {
    std::ifstream in("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq");
    double khz = 0;
    if (in >> khz && khz > 0) c.max_freq_ghz = khz / 1e6;
  }
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("cpu MHz", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const double mhz = std::strtod(line.c_str() + colon + 1, nullptr);
    if (mhz > 0) c.cpu_mhz_ghz = std::max(c.cpu_mhz_ghz, mhz / 1e3);
  }
  return c;
}

double measure_clock_ghz(double seconds) {
#if defined(__x86_64__)
#define LATTICE_ADD4 "add %1, %0\n\t" "add %1, %0\n\t" "add %1, %0\n\t" "add %1, %0\n\t"
#define LATTICE_ADD16 LATTICE_ADD4 LATTICE_ADD4 LATTICE_ADD4 LATTICE_ADD4
  // 64 additions a block, each needing the one before; the addend is a
  // register whose value the core cannot know in advance.
  constexpr int64_t kBlocks = 12288, kAddsPerBlock = 64;  // 786k cycles: ~0.3 ms at 2.5 GHz
  uint64_t a = 0;
  const uint64_t b =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) | 1;
  double best = 0;
  Timer total;
  do {
    Timer window;
    for (int64_t i = 0; i < kBlocks; i++)
      __asm__ volatile(LATTICE_ADD16 LATTICE_ADD16 LATTICE_ADD16 LATTICE_ADD16 : "+r"(a) : "r"(b));
    best = std::max(best, static_cast<double>(kBlocks * kAddsPerBlock) / window.seconds() / 1e9);
  } while (total.seconds() < seconds);
#undef LATTICE_ADD16
#undef LATTICE_ADD4
  __asm__ volatile("" : : "r"(a));  // the chain's result is used
  return best;
#else
  (void)seconds;
  return 0;
#endif
}

}  // namespace lattice
