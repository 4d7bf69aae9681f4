// The arithmetic peak of this CPU, measured: register-only multiply-add loops
// for the instruction set in use, run on every thread at once so that the
// all-core clock (not the one-core turbo) is what is measured. Each thread's
// rate is its FLOPs per second of its own CPU time, so a measurement taken
// while other processes share the cores is not read low (the wall-clock rate
// of a thread given half its core is half the peak); the share of wall time
// each thread ran is reported beside it.
//
//   avx512  16 independent chains of VFMADD on 16-float registers: 64 FLOP
//           per instruction; two FMA pipes with a 4-cycle latency need at
//           least 8 chains in flight.
//   avx2    12 chains of VFMADD on 8-float registers (16 registers in all).
//   baseline  SSE2 has no FMA: 12 chains of a multiply and an add on
//           4-float registers, 8 FLOP per pair.
//   bf16    VDPBF16PS (avx512_bf16): each 16-lane instruction adds two bf16
//           products per lane, 64 FLOP, 16 chains.
// The operands keep every value finite and normal (x ← x·a + b with a just
// below 1 converges to b/(1 - a)), so no subnormal slow path is measured.
//
// The most any x86-64 core retires of these per cycle (peak_flops_per_cycle):
// two FMA (or VDPBF16PS) instructions, at the register width of the level —
// Zen 5 and Intel's server cores have two 512-bit FMA pipes, Zen 4 splits a
// 512-bit FMA over its two 256-bit pipes, some Xeons have one 512-bit pipe.
// Without FMA, two multiplies and two adds (Zen's and Golden Cove's separate
// adders).
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "lattice/core/cpu.h"
#include "lattice/core/error.h"
#include "lattice/core/timer.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
constexpr int64_t kInner = 256;  // iterations between clock reads

// Each returns FLOPs done; `sink` keeps the results alive.
__attribute__((target("avx512f"))) double fma_avx512(int64_t outer, float* sink) {
  constexpr int kChains = 16;
  __m512 acc[kChains];
  for (int c = 0; c < kChains; c++) acc[c] = _mm512_set1_ps(0.5f + 0.01f * c);
  const __m512 a = _mm512_set1_ps(0.9999f), b = _mm512_set1_ps(1e-4f);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < kInner; i++)
#pragma GCC unroll 16
      for (int c = 0; c < kChains; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  __m512 total = acc[0];
  for (int c = 1; c < kChains; c++) total = _mm512_add_ps(total, acc[c]);
  float lanes[16];
  _mm512_storeu_ps(lanes, total);
  for (float l : lanes) *sink += l;
  return static_cast<double>(outer) * kInner * kChains * 16 * 2;
}

__attribute__((target("avx2,fma"))) double fma_avx2(int64_t outer, float* sink) {
  constexpr int kChains = 12;
  __m256 acc[kChains];
  for (int c = 0; c < kChains; c++) acc[c] = _mm256_set1_ps(0.5f + 0.01f * c);
  const __m256 a = _mm256_set1_ps(0.9999f), b = _mm256_set1_ps(1e-4f);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < kInner; i++)
#pragma GCC unroll 12
      for (int c = 0; c < kChains; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  __m256 total = acc[0];
  for (int c = 1; c < kChains; c++) total = _mm256_add_ps(total, acc[c]);
  float lanes[8];
  _mm256_storeu_ps(lanes, total);
  for (float l : lanes) *sink += l;
  return static_cast<double>(outer) * kInner * kChains * 8 * 2;
}

double mul_add_sse2(int64_t outer, float* sink) {
  constexpr int kChains = 12;
  __m128 acc[kChains];
  for (int c = 0; c < kChains; c++) acc[c] = _mm_set1_ps(0.5f + 0.01f * c);
  const __m128 a = _mm_set1_ps(0.9999f), b = _mm_set1_ps(1e-4f);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < kInner; i++)
#pragma GCC unroll 12
      for (int c = 0; c < kChains; c++) acc[c] = _mm_add_ps(_mm_mul_ps(acc[c], a), b);
  __m128 total = acc[0];
  for (int c = 1; c < kChains; c++) total = _mm_add_ps(total, acc[c]);
  float lanes[4];
  _mm_storeu_ps(lanes, total);
  for (float l : lanes) *sink += l;
  return static_cast<double>(outer) * kInner * kChains * 4 * 2;
}

__attribute__((target("avx512f,avx512bf16"))) double dpbf16_avx512(int64_t outer, float* sink) {
  constexpr int kChains = 16;
  __m512 acc[kChains];
  for (int c = 0; c < kChains; c++) acc[c] = _mm512_set1_ps(0.01f * c);
  // bf16 pairs (0.5, 0.5) · (1e-4, 1e-4): each lane grows by 1e-4 per step.
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F00), b = (__m512bh)_mm512_set1_epi16(0x38D1);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < kInner; i++)
#pragma GCC unroll 16
      for (int c = 0; c < kChains; c++) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  __m512 total = acc[0];
  for (int c = 1; c < kChains; c++) total = _mm512_add_ps(total, acc[c]);
  float lanes[16];
  _mm512_storeu_ps(lanes, total);
  for (float l : lanes) *sink += l;
  return static_cast<double>(outer) * kInner * kChains * 16 * 4;
}
#endif

using Loop = double (*)(int64_t, float*);

Loop loop_for(DType dtype, Isa isa) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (dtype == DType::BF16) return isa == Isa::Avx512 && cpu_info().avx512_bf16 ? dpbf16_avx512 : nullptr;
  switch (isa) {
    case Isa::Avx512: return fma_avx512;
    case Isa::Avx2: return fma_avx2;
    case Isa::Baseline: return mul_add_sse2;
  }
#endif
  (void)dtype, (void)isa;
  return nullptr;
}

// CPU time of the calling thread: the part of a wall-clock interval it ran.
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

}  // namespace

bool peak_measurable(DType dtype) { return loop_for(dtype, active_isa()) != nullptr; }

double peak_flops_per_cycle(DType dtype, Isa isa) {
  if (dtype == DType::BF16) return isa == Isa::Avx512 ? 2 * 16 * 4 : 0;  // VDPBF16PS: 2 products + 2 adds a lane
  switch (isa) {
    case Isa::Avx512: return 2 * 16 * 2;  // 2 FMA pipes x 16 lanes x (multiply + add)
    case Isa::Avx2: return 2 * 8 * 2;
    case Isa::Baseline: return (2 + 2) * 4;  // 2 multiplies + 2 adds x 4 lanes
  }
  return 0;
}

PeakSample measure_peak(DType dtype, int threads, double seconds) {
  LATTICE_CHECK(dtype == DType::F32 || dtype == DType::BF16,
                "peak: dtype " << dtype_name(dtype) << " has no peak measurement (f32 or bf16)");
  LATTICE_CHECK(threads >= 1, "peak: threads must be >= 1, got " << threads);
  const Loop loop = loop_for(dtype, active_isa());
  if (!loop) return PeakSample{};
  std::vector<double> rate(threads, 0.0), on_cpu(threads, 0.0);
  std::vector<float> sink(threads * 16, 0.0f);  // one cache line per thread
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    loop(64, &sink[t * 16]);  // warm-up: clocks up, code in cache
#pragma omp barrier
    Timer timer;
    const double cpu0 = thread_cpu_seconds();
    double flops = 0;
    while (timer.seconds() < seconds) flops += loop(64, &sink[t * 16]);
    const double wall = timer.seconds(), ran = thread_cpu_seconds() - cpu0;
    // FLOPs per second the thread ran: time the scheduler gave to other work
    // neither counts nor lowers the figure.
    rate[t] = flops / std::max(ran, 1e-9) / 1e9;
    on_cpu[t] = ran / wall;
  }
  // The mean per thread, all threads running together; the least-served thread.
  PeakSample s;
  s.on_cpu = 1.0;
  for (int t = 0; t < threads; t++) {
    s.gflops_per_core += rate[t] / threads;
    s.on_cpu = std::min(s.on_cpu, on_cpu[t]);
  }
  return s;
}

}  // namespace lattice::kernels
