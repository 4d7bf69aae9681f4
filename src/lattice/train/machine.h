// The machine a run is on, as the run banner, the step line's MFU and the
// benchmarks describe it: the CPU, the instruction set lattice's kernels use,
// the GEMM path of each dtype, and the arithmetic peak MFU is relative to.
//
// The peak is measured on this CPU (kernels::measure_peak: register-only FMA
// loops, VDPBF16PS for bf16, every thread at once), never assumed from another
// machine. MFU divides by the peak of the arithmetic the GEMMs run in
// (MachinePeak::gflops_per_core): the VDPBF16PS rate when bf16 GEMMs run on
// oneDNN's bf16 matmul (2x fp32 on Zen 5), the fp32 FMA rate otherwise (fp32;
// f16, whose GEMMs run as the fp32 sgemm; bf16 widened to the fp32 sgemm).
//
// A measurement is the best of R repeats of S seconds per dtype. It is cached
// only when it passes three checks (why_not_cacheable):
//   repeatable  R >= 2 and the best two repeats within 5% of each other;
//   alone       in both of those repeats every measuring thread ran for at
//               least 90% of the wall time (its CPU time / wall time): a
//               thread sharing its core with other work (a test suite) reads
//               low, and can read low steadily enough to look repeatable;
//   possible    not above the ceiling: the most FLOPs a cycle the ISA level
//               retires (kernels::peak_flops_per_cycle: 2 FMA pipes x vector
//               width x 2) x the clock, + 5% for the clock's own error. The
//               clock is the largest of what the system states (cpufreq
//               cpuinfo_max_freq, /proc/cpuinfo "cpu MHz") and what a chain
//               of dependent additions measures (core/cpu.h): the stated
//               figures alone are no bound (a VM's "cpu MHz" is the TSC rate,
//               below the clock its cores run at). Where there is no clock at
//               all, that check is skipped, and the description says so.
// A measurement that fails is used for the run, and says why it was not cached.
//
// The cache is a small file keyed by (CPU model, ISA level, threads at once):
// $LATTICE_CACHE_DIR, else $XDG_CACHE_HOME/lattice, else ~/.cache/lattice,
// file peak.json. Per dtype it keeps the best figure that passed, with how it
// was measured (other tenants only ever slow a measurement down). Entries
// written without these facts (before the rule) are ignored and overwritten.
//
// A cached figure can still be low (a steady load on another VM of the host is
// invisible to the CPU-time check), so machine_peak() checks it at start-up:
// one 0.05-s measurement per dtype; one that beats the cached figure by more
// than 10% proves the entry stale: it is dropped, the run measures properly
// (3 x 0.1 s per dtype) and stores that if it passes. A cached figure above
// the ceiling is dropped the same way. Start-up cost: about 0.13 s with a
// cache entry (the check and the clock), 0.65 s without (CPU with bf16).
//
// LATTICE_PEAK_GFLOPS_PER_CORE sets the per-core peak of every dtype
// (nothing is measured, checked or cached).
#pragma once

#include <string>
#include <vector>

#include "lattice/core/dtype.h"
#include "lattice/kernels/ops.h"

namespace lattice::train {

// How one dtype's figure was measured.
struct PeakRepeats {
  int repeats = 0;     // 0: not measured (from the environment, or no such instructions)
  double seconds = 0;  // each
  double spread = 1;   // (best - second best) / best; 1 with one repeat
  double on_cpu = 0;   // the least share of wall time a measuring thread ran, in the best two repeats
};

// The most one core can reach: kernels::peak_flops_per_cycle x the clock.
struct PeakCeiling {
  double clock_ghz = 0;      // 0: unknown (no ceiling)
  std::string clock_source;  // "measured", "cpuinfo_max_freq", "cpu MHz", "set for testing"
  // (1 + 5%) x FLOPs per cycle x clock, GFLOP/s per core; 0 when the clock is
  // unknown or the level has no loop for `dtype`.
  double gflops_per_core(DType dtype) const;
  // "ceiling 236.0 (64 FLOP/cycle x 3.51 GHz measured, +5%)" or "no ceiling
  // (the clock is unknown: ...)".
  std::string describe(DType dtype) const;
};
// This machine's: the clock is measured once per process (0.02 s).
PeakCeiling peak_ceiling();
// Tests: ghz > 0 fixes the ceiling's clock, ghz < 0 makes it unknown, 0 goes
// back to the machine's.
void set_peak_clock_for_testing(double ghz);

// Why a measurement of `dtype` (one PeakSample a repeat) may not be cached:
// "" when it may, else each failed check in words, "; "-separated.
std::string why_not_cacheable(DType dtype, const std::vector<kernels::PeakSample>& repeats, const PeakCeiling& ceiling);

struct MachinePeak {
  double fp32_gflops_per_core = 0;
  double bf16_gflops_per_core = 0;  // 0: no bf16 arithmetic at this ISA level
  PeakRepeats fp32_repeats, bf16_repeats;
  int threads = 0;  // threads the run uses (measurements ran this many at once)
  // "cached in PATH", "measured now", "LATTICE_PEAK_GFLOPS_PER_CORE"
  std::string source;
  // What happened to the cache: the start-up check, a stale entry dropped,
  // "stored in PATH" or "not cached: WHY".
  std::string note;
  bool cached = false;             // the figures are what the cache holds now
  std::string not_cached_because;  // measured now and not stored: why

  // The dtype whose peak bounds GEMMs computing at `compute`: BF16 when
  // compute is bf16, the bf16 GEMMs run on oneDNN's bf16 matmul
  // (kernels::gemm_paths().bf16_uses_primitive()) and there is a bf16
  // figure; F32 otherwise (f16 GEMMs run as the fp32 sgemm).
  DType gemm_dtype(DType compute) const;
  // The per-core peak MFU is relative to for a run computing at `compute`.
  double gflops_per_core(DType compute) const;
  // The run banner's text after "MFU relative to ": the peak of all threads,
  // which dtype's and why, per core, where it came from with its repeats and
  // spread, the check or the reason it was not cached, and the ceiling.
  std::string describe(DType compute) const;
};

// The peak for `threads` threads: LATTICE_PEAK_GFLOPS_PER_CORE if set, else
// the cache entry if it passes the start-up check, else a measurement (3 x
// 0.1 s per dtype), stored in the cache when it passes and `store` (a job of
// several ranks passes false: its ranks may share cores, and their
// measurements are taken while they compete). A cache that cannot be read or
// written is skipped silently (the run measures instead). `at_once`: threads
// running on the node together (all ranks'), whose all-core figure applies;
// the cache entry is that one's; a measurement runs `threads` threads here
// while the other ranks run theirs (stored only when threads == at_once).
MachinePeak machine_peak(int threads, int at_once, bool store = true);

// Measures now: best of `repeats` runs of `seconds` each per dtype, and
// stores it when `store` and it passes (the cache keeps the higher of it and
// a valid entry; `lattice bench peak`).
MachinePeak measure_machine_peak(int threads, double seconds, int repeats, bool store = true);

// Where the cache lives (the file need not exist).
std::string peak_cache_path();

// "AMD EPYC 9B45 (AuthenticAMD family 26 model 2); kernels avx512; GEMM f32
// dnnl_sgemm, bf16 ... ; oneDNN ISA avx512_core_bf16"
std::string describe_machine();

}  // namespace lattice::train
