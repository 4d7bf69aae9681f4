// The machine a run is on, as the run banner, the step line's MFU and the
// benchmarks describe it: the CPU, the instruction set lattice's kernels use,
// the GEMM path of each dtype, and the arithmetic peak MFU is relative to.
//
// The peak is measured on this CPU (kernels::measure_peak_gflops_per_core),
// never assumed from another machine. Measuring takes a fraction of a second,
// so the result is kept in a small cache file keyed by (CPU model, ISA level,
// threads): $LATTICE_CACHE_DIR, else $XDG_CACHE_HOME/lattice, else
// ~/.cache/lattice, file peak.json. `lattice bench peak` re-measures (longer,
// best of several); an entry keeps the best figure ever measured, since other
// tenants of a machine only ever slow a measurement down. The environment variable
// LATTICE_PEAK_GFLOPS_PER_CORE overrides the fp32 figure.
#pragma once

#include <string>

namespace lattice::train {

struct MachinePeak {
  double fp32_gflops_per_core = 0;
  double bf16_gflops_per_core = 0;  // 0: no bf16 arithmetic at this ISA level
  int threads = 0;                  // threads that ran at once when it was measured
  // "measured now", "cached in PATH", "LATTICE_PEAK_GFLOPS_PER_CORE"
  std::string source;
};

// The peak for `threads` threads: LATTICE_PEAK_GFLOPS_PER_CORE if set (fp32;
// the bf16 figure is then 0), else the cache entry, else a brief measurement
// (0.2 s per dtype), stored in the cache when `store` (a job of several ranks
// passes false: its ranks may share cores, and a measurement taken while
// they compete would understate the peak for every later run). A cache that
// cannot be read or written is skipped silently (the run measures instead).
// `at_once`: threads running on the node together (all ranks'), whose
// all-core figure applies; the cache entry is that one's; a measurement runs
// `threads` threads here while the other ranks run theirs.
MachinePeak machine_peak(int threads, int at_once, bool store = true);

// Measures now: best of `repeats` runs of `seconds` each per dtype, and
// stores the result in the cache when `store`.
MachinePeak measure_machine_peak(int threads, double seconds, int repeats, bool store = true);

// Where the cache lives (the file need not exist).
std::string peak_cache_path();

// "AMD EPYC 9B45 (AuthenticAMD family 26 model 2); kernels avx512; GEMM f32
// dnnl_sgemm, bf16 ... ; oneDNN ISA avx512_core_bf16"
std::string describe_machine();

}  // namespace lattice::train
