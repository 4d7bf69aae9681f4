// What the CPU at hand is and which instruction set lattice's own kernels use.
//
// lattice is built for plain x86-64 (no -march=native) and picks the vector
// instruction set at run time, so one binary is fast on an AVX-512 Xeon, an
// AVX2-only EPYC and anything in between:
//
//   Isa::Avx512    x86-64-v4: AVX-512 F/BW/CD/DQ/VL on top of Avx2
//   Isa::Avx2      x86-64-v3: AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE
//   Isa::Baseline  x86-64:    SSE2 only (the portable fallback)
//
// detected_isa() is the best level this CPU and its operating system support
// (CPUID plus XGETBV: a hypervisor may expose AVX-512 instructions without
// enabling their register state). active_isa() is the level the kernels run:
// detected_isa(), or lower when the environment variable LATTICE_ISA asks for
// it (avx512 | avx2 | baseline | auto), so the portable paths can be tested
// on a machine that has better ones. Asking for a level the CPU lacks is an
// error naming the missing features.
#pragma once

#include <string>
#include <vector>

namespace lattice {

enum class Isa { Baseline = 0, Avx2 = 1, Avx512 = 2 };
inline constexpr int kIsaCount = 3;

// "baseline", "avx2", "avx512".
const char* isa_name(Isa isa);
// Parses an isa_name(); throws lattice::Error naming `what` and the valid values.
Isa parse_isa(const std::string& text, const std::string& what);

struct CpuInfo {
  std::string vendor;  // "GenuineIntel", "AuthenticAMD"
  std::string model;   // brand string, e.g. "AMD EPYC 7763 64-Core Processor"
  int family = 0, model_number = 0, stepping = 0;
  // Features that decide the level (only those the OS enables count).
  bool sse2 = false, avx = false, avx2 = false, fma = false, bmi1 = false, bmi2 = false, f16c = false,
       lzcnt = false, movbe = false;
  bool avx512f = false, avx512bw = false, avx512cd = false, avx512dq = false, avx512vl = false;
  bool avx512_bf16 = false;  // VDPBF16PS (bf16 dot products into f32)
  bool amx_bf16 = false;

  // The features of `isa` this CPU lacks (empty: it can run that level).
  std::vector<std::string> missing_for(Isa isa) const;
  // "AMD EPYC 7763 64-Core Processor (AuthenticAMD family 25 model 1)"
  std::string describe() const;
};

// Read once with CPUID (thread-safe).
const CpuInfo& cpu_info();
// The best level cpu_info() supports.
Isa detected_isa();
// The level the kernels use: LATTICE_ISA if set (and not "auto"), else
// detected_isa(). Throws lattice::Error on the first call if LATTICE_ISA is
// malformed or names a level this CPU cannot run.
Isa active_isa();
// The level chosen at start-up (LATTICE_ISA or detected_isa()), which the
// GEMM library is capped to; set_active_isa_for_testing does not change it.
Isa startup_isa();
// True when startup_isa() was lowered by LATTICE_ISA.
bool isa_forced();
// For tests that run one kernel on every level the CPU supports: changes
// active_isa() for lattice's own kernels, for the whole process (refused
// above detected_isa()). Not thread-safe against kernels running at the same
// time.
void set_active_isa_for_testing(Isa isa);

// Every level this CPU can run, from the best down (detected_isa() first).
std::vector<Isa> runnable_isas();

// ---- The clock ---------------------------------------------------------------
// What the system states about the core clock: cpu0's cpufreq
// cpuinfo_max_freq (/sys/devices/system/cpu/cpu0/cpufreq) and the largest
// "cpu MHz" of /proc/cpuinfo. Neither is a dependable maximum: "cpu MHz" is
// the clock of the moment on bare metal and the TSC's nominal rate under a
// hypervisor (2096 MHz on a Zen 5 VM whose cores run at 3.4-3.8 GHz), and
// acpi-cpufreq's cpuinfo_max_freq leaves out boost. A value absent from the
// system is 0.
struct StatedClock {
  double max_freq_ghz = 0;  // cpuinfo_max_freq
  double cpu_mhz_ghz = 0;   // the largest "cpu MHz", in GHz
};
StatedClock stated_clock();

// The clock one core runs at now, measured: the calling thread times chains
// of dependent 64-bit register additions (one a cycle on x86-64 cores: each
// needs the last one's result, and none is folded away at rename the way
// some cores fold additions of a constant; a core that ran them faster would
// only read a higher clock), in windows of about 0.3 ms for `seconds`, and
// returns the fastest window's rate in GHz (a window the thread lost its CPU
// in only reads lower). 0 off x86-64.
double measure_clock_ghz(double seconds);

}  // namespace lattice
