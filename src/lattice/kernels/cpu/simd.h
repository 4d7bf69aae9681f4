// Run-time choice of instruction set for the kernels' hot loops.
//
// Builds are plain x86-64 (no -march=native), so every hot loop is written
// once, as ordinary C++ that GCC vectorises, and compiled three times: for
// AVX-512, for AVX2+FMA and for SSE2. A kernel runs its loop through
//
//     cpu::simd([&] { gelu_forward_range(out, inp, begin, end); });
//
// which calls the copy for lattice::active_isa() (core/cpu.h: the best level
// the CPU supports, or the one LATTICE_ISA forces, so the portable copies are
// tested on every machine). How: each copy is a function template with a
// `target` attribute and `flatten`, so the lambda and everything it calls are
// inlined into it and vectorised for that target. Nothing else in the
// translation unit is compiled for the wider target (unlike compiling whole
// files with -mavx512f, whose inline functions could leak AVX-512 code into
// the baseline path through the linker).
//
// The loops must not contain OpenMP regions (outlined bodies are separate
// functions that flatten does not reach): kernels keep the `omp parallel`
// loop outside and call simd() once per chunk.
//
// Results: the copies evaluate the same expressions in the same order; they
// may differ in the last bit because GCC contracts a·b + c into one fused
// multiply-add where the target has FMA (AVX2, AVX-512) and not on SSE2.
// Within one level every kernel stays bitwise independent of the thread
// count. tests/kernels/isa_test.cpp runs every kernel on every level the
// machine has and compares them at f32 rounding.
#pragma once

#include "lattice/core/cpu.h"

namespace lattice::kernels::cpu {

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
// x86-64-v4 and x86-64-v3 as feature lists (an `arch=` target would stop GCC
// from inlining the caller's lambda, whose arch differs).
#define LATTICE_TARGET_AVX512 \
  "avx512f,avx512bw,avx512cd,avx512dq,avx512vl,avx2,fma,bmi,bmi2,f16c,lzcnt,movbe,popcnt,sse4.2"
#define LATTICE_TARGET_AVX2 "avx2,fma,bmi,bmi2,f16c,lzcnt,movbe,popcnt,sse4.2"

template <typename Fn>
__attribute__((target(LATTICE_TARGET_AVX512), flatten)) auto run_avx512(const Fn& fn) {
  return fn();
}
template <typename Fn>
__attribute__((target(LATTICE_TARGET_AVX2), flatten)) auto run_avx2(const Fn& fn) {
  return fn();
}
template <typename Fn>
__attribute__((flatten)) auto run_baseline(const Fn& fn) {
  return fn();
}

// Calls fn() compiled for active_isa(); returns what fn returns.
template <typename Fn>
inline auto simd(const Fn& fn) {
  switch (active_isa()) {
    case Isa::Avx512: return run_avx512(fn);
    case Isa::Avx2: return run_avx2(fn);
    case Isa::Baseline: break;
  }
  return run_baseline(fn);
}
#else
template <typename Fn>
inline auto simd(const Fn& fn) {
  return fn();
}
#endif

}  // namespace lattice::kernels::cpu
