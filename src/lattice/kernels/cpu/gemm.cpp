// GEMM through oneDNN, with the path for each dtype chosen at start-up from
// what this CPU and this oneDNN build can do (gemm_paths()).
//
// Why oneDNN: Debian's OpenBLAS 0.3.21 misdetects recent CPUs (the Emerald
// Rapids Xeon this project was developed on came out as "Prescott", SSE3
// kernels, ~30 GFLOP/s on one thread) unless OPENBLAS_CORETYPE is set; oneDNN
// dispatches its JIT kernels on CPUID at run time and needs no setting. A
// product must not need an environment variable to be fast. The comparison is
// re-measured per CPU in docs/kernels.md.
//
// Paths (bench/kernels, docs/kernels.md has the figures):
//   f32   dnnl_sgemm. At every GPT-2 shape and transpose combination it was
//         as fast as or faster than a cached dnnl::matmul primitive (which
//         falls to ~40-70% of it for some backward shapes, e.g. K = 3072 → 768),
//         and it needs no per-shape state.
//   bf16  two candidates, the faster one on this CPU is used:
//         - widen: bf16 blocks widened to f32 (exact) and dnnl_sgemm on them.
//           Runs everywhere (the portable path) at the f32 rate.
//         - dnnl_matmul_bf16: oneDNN's bf16 matmul primitive. Exists only
//           where oneDNN has a bf16 kernel for the CPU (avx512_core_bf16 in
//           2.6; none on AVX2-only CPUs). On Emerald Rapids it ran at half
//           the f32 rate (VDPBF16PS at half the FMA rate there), on Zen 5 at
//           twice it.
//         So: the primitive's existence is queried through the C API (a
//         status, not a caught exception; reference implementations do not
//         count), and when it exists both paths are timed once on a
//         GPT-2-sized product; the primitive is used if it is at least 1.2x
//         faster. LATTICE_DNNL_BF16=0 pretends it does not exist.
//         (dnnl_gemm_bf16bf16f32 is not exported by the 2.6 library.)
// The matmul primitive path is also kept for the benchmark and for callers
// that want a fused bias.
//
// Instruction set: oneDNN picks its own from CPUID. When LATTICE_ISA forces a
// lower level (core/cpu.h), oneDNN is capped to match (dnnl_set_max_cpu_isa:
// avx2, or sse41 for baseline) before its first kernel is generated, so a
// forced run exercises the GEMMs an AVX2-only machine would run.
//
// Threads: Debian's oneDNN is built with the OpenMP runtime (DNNL_CPU_RUNTIME
// = OMP, linked against libgomp, the same runtime as our kernels), so it uses
// omp_get_max_threads(), i.e. lattice::set_num_threads(). Called from inside an
// OpenMP parallel region it runs on the calling thread only.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <oneapi/dnnl/dnnl_debug.h>

#include "lattice/core/cpu.h"
#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/core/timer.h"
#include "lattice/kernels/cpu/gemm_internal.h"
#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/cpu/vec_math.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace cpu {
namespace {

// Caps oneDNN's instruction set to a forced LATTICE_ISA. Must run before
// oneDNN generates any kernel, so every entry point below calls it first.
void configure_dnnl_once() {
  static const bool configured = [] {
    if (isa_forced()) {
      const dnnl_cpu_isa_t cap = startup_isa() == Isa::Avx2 ? dnnl_cpu_isa_avx2 : dnnl_cpu_isa_sse41;
      const dnnl_status_t st = dnnl_set_max_cpu_isa(cap);
      LATTICE_CHECK(st == dnnl_success, "oneDNN refused to cap its instruction set to " << dnnl_cpu_isa2str(cap)
                                                                                        << " (status " << st
                                                                                        << ")");
    }
    return true;
  }();
  (void)configured;
}

dnnl::engine& cpu_engine() {
  configure_dnnl_once();
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

void check_gemm_args(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                     int64_t ldc) {
  LATTICE_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm: negative size M=" << M << " N=" << N << " K=" << K);
  const int64_t a_cols = trans_a ? M : K, b_cols = trans_b ? K : N;
  LATTICE_CHECK(lda >= (a_cols > 1 ? a_cols : 1),
                "gemm: lda=" << lda << " is smaller than op(A)'s row length " << a_cols << (trans_a ? " (trans_a)" : ""));
  LATTICE_CHECK(ldb >= (b_cols > 1 ? b_cols : 1),
                "gemm: ldb=" << ldb << " is smaller than op(B)'s row length " << b_cols << (trans_b ? " (trans_b)" : ""));
  LATTICE_CHECK(ldc >= (N > 1 ? N : 1), "gemm: ldc=" << ldc << " is smaller than N=" << N);
}

// C = beta·C for the degenerate K = 0 product (oneDNN rejects zero dimensions).
void scale_c(int64_t M, int64_t N, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    float* row = C + i * ldc;
    if (beta == 0.0f) {
      std::memset(row, 0, sizeof(float) * N);
    } else {
      for (int64_t j = 0; j < N; ++j) row[j] *= beta;
    }
  }
}

struct MatmulKey {
  int64_t M, N, K, lda, ldb, ldc;
  float alpha, beta;
  int threads;
  bool trans_a, trans_b, has_bias;
  DType ab_type;
  bool operator==(const MatmulKey& o) const { return std::memcmp(this, &o, sizeof(MatmulKey)) == 0; }
};

struct MatmulKeyHash {
  size_t operator()(const MatmulKey& k) const {
    // FNV-1a over the bytes (the struct is zero-initialised, padding included).
    const unsigned char* p = reinterpret_cast<const unsigned char*>(&k);
    size_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof(MatmulKey); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  }
};

struct MatmulEntry {
  dnnl::matmul primitive;
  dnnl::memory a, b, c, bias, scratchpad;  // handles re-pointed on every call
  dnnl::memory::desc scratchpad_md;
  size_t scratchpad_bytes = 0;
  std::unordered_map<int, dnnl::memory> args;  // built once; holds the handles above
};

// Per calling thread: the primitives, a stream, and one scratchpad shared by
// all of this thread's primitives (grown once, counted as Workspace), so a
// steady-state call allocates nothing of ours and two threads never share a
// scratchpad.
struct MatmulThreadState {
  std::unordered_map<MatmulKey, MatmulEntry, MatmulKeyHash> cache;
  dnnl::stream stream{cpu_engine()};
  Buffer scratchpad;
};

MatmulThreadState& matmul_state() {
  thread_local MatmulThreadState state;
  return state;
}

dnnl::memory::desc matrix_desc(int64_t rows, int64_t cols, int64_t ld, bool transposed, dnnl::memory::data_type dt) {
  // op(X) is [rows, cols]; X is stored row-major with leading dimension ld, so
  // op(X)[r][c] lives at r*ld + c, or at c*ld + r when transposed.
  const dnnl::memory::dims strides = transposed ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1};
  return dnnl::memory::desc({rows, cols}, dt, strides);
}

MatmulEntry build_matmul(const MatmulKey& k) {
  using dt = dnnl::memory::data_type;
  const dt ab = k.ab_type == DType::BF16 ? dt::bf16 : dt::f32;
  const auto a_md = matrix_desc(k.M, k.K, k.lda, k.trans_a, ab);
  const auto b_md = matrix_desc(k.K, k.N, k.ldb, k.trans_b, ab);
  const auto c_md = matrix_desc(k.M, k.N, k.ldc, false, dt::f32);
  const auto bias_md = dnnl::memory::desc({1, k.N}, dt::f32, dnnl::memory::dims{k.N, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (k.alpha != 1.0f) attr.set_output_scales(0, {k.alpha});
  if (k.beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(k.beta);
    attr.set_post_ops(ops);
  }
  auto& eng = cpu_engine();
  dnnl::matmul::desc desc = k.has_bias ? dnnl::matmul::desc(a_md, b_md, bias_md, c_md) : dnnl::matmul::desc(a_md, b_md, c_md);
  dnnl::matmul::primitive_desc pd(desc, attr, eng);
  MatmulEntry e;
  e.primitive = dnnl::matmul(pd);
  e.a = dnnl::memory(a_md, eng, DNNL_MEMORY_NONE);
  e.b = dnnl::memory(b_md, eng, DNNL_MEMORY_NONE);
  e.c = dnnl::memory(c_md, eng, DNNL_MEMORY_NONE);
  e.args = {{DNNL_ARG_SRC, e.a}, {DNNL_ARG_WEIGHTS, e.b}, {DNNL_ARG_DST, e.c}};
  if (k.has_bias) {
    e.bias = dnnl::memory(bias_md, eng, DNNL_MEMORY_NONE);
    e.args.emplace(DNNL_ARG_BIAS, e.bias);
  }
  e.scratchpad_md = pd.scratchpad_desc();
  e.scratchpad_bytes = e.scratchpad_md.get_size();
  return e;
}

// Widens rows [r0, r1) × columns [c0, c1) of a row-major bf16 matrix (leading
// dimension ld) into a dense f32 block with leading dimension c1 - c0.
void widen_rows(float* dst, const uint16_t* src, int64_t ld, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t width = c1 - c0;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* s = src + r * ld + c0;
    float* d = dst + (r - r0) * width;
    for (int64_t c = 0; c < width; ++c) {
      const uint32_t bits = static_cast<uint32_t>(s[c]) << 16;
      std::memcpy(&d[c], &bits, 4);
    }
  }
}

void widen_block(float* dst, const uint16_t* src, int64_t ld, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t rows = r1 - r0;
  if (rows * (c1 - c0) < (1 << 16) || omp_in_parallel()) return cpu::simd([&] { return widen_rows(dst, src, ld, r0, r1, c0, c1); });
  const int64_t chunks = std::min<int64_t>(rows, 64);
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    int64_t b, e;
    split_range(rows, chunks, chunk, &b, &e);
    cpu::simd([&] { return widen_rows(dst + b * (c1 - c0), src, ld, r0 + b, r0 + e, c0, c1); });
  }
}

// Ceil-divides n into blocks of at most `max_block`, of nearly equal size.
int64_t even_block(int64_t n, int64_t max_block) {
  const int64_t blocks = (n + max_block - 1) / max_block;
  return (n + blocks - 1) / blocks;
}

}  // namespace

void gemm_bf16_via_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                         const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
                         int64_t ldc) {
  check_gemm_args(trans_a, trans_b, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_c(M, N, beta, C, ldc);
  // Blocks of op(A) [mb, kb] and op(B) [kb, nb], at most 2048 × 2048 × 1024,
  // so the workspace stays ≤ 16 MiB whatever the shape (GPT-2's LM head would
  // need 150 MiB widened whole). Widening costs O(mb·kb + kb·nb) per block
  // against O(mb·nb·kb) multiply-adds: under 1% at these sizes.
  const int64_t mb = even_block(M, 2048), nb = even_block(N, 2048), kb = even_block(K, 1024);
  thread_local Buffer workspace;
  const size_t bytes = sizeof(float) * static_cast<size_t>(mb * kb + kb * nb);
  if (workspace.bytes() < bytes) workspace.ensure(bytes, MemCategory::Workspace);
  float* a_block = workspace.as<float>();
  float* b_block = a_block + mb * kb;
  for (int64_t j0 = 0; j0 < N; j0 += nb) {
    const int64_t j1 = std::min(N, j0 + nb);
    for (int64_t i0 = 0; i0 < M; i0 += mb) {
      const int64_t i1 = std::min(M, i0 + mb);
      for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t k1 = std::min(K, k0 + kb);
        // op(A)[i0:i1, k0:k1]: stored rows i (or k when transposed).
        if (trans_a)
          widen_block(a_block, A, lda, k0, k1, i0, i1);
        else
          widen_block(a_block, A, lda, i0, i1, k0, k1);
        if (trans_b)
          widen_block(b_block, B, ldb, j0, j1, k0, k1);
        else
          widen_block(b_block, B, ldb, k0, k1, j0, j1);
        const int64_t a_ld = trans_a ? i1 - i0 : k1 - k0, b_ld = trans_b ? k1 - k0 : j1 - j0;
        gemm_dnnl_sgemm(trans_a, trans_b, i1 - i0, j1 - j0, k1 - k0, alpha, a_block, a_ld, b_block, b_ld,
                        k0 == 0 ? beta : 1.0f, C + i0 * ldc + j0, ldc);
      }
    }
  }
}

void gemm_dnnl_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                     int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  check_gemm_args(trans_a, trans_b, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_c(M, N, beta, C, ldc);
  configure_dnnl_once();
  const dnnl_status_t st =
      dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  LATTICE_CHECK(st == dnnl_success, "dnnl_sgemm failed with status " << static_cast<int>(st) << " (M=" << M
                                                                     << " N=" << N << " K=" << K << ")");
}

void gemm_dnnl_matmul(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
                      int64_t lda, const void* B, int64_t ldb, float beta, float* C, int64_t ldc, DType ab_type,
                      const float* bias) {
  check_gemm_args(trans_a, trans_b, M, N, K, lda, ldb, ldc);
  LATTICE_CHECK(ab_type == DType::F32 || ab_type == DType::BF16,
                "gemm: A/B type " << dtype_name(ab_type) << " is not supported (f32 or bf16)");
  LATTICE_CHECK(bias == nullptr || alpha == 1.0f, "gemm with bias needs alpha = 1, got " << alpha);
  LATTICE_CHECK(ab_type != DType::BF16 || dnnl_bf16_matmul_available(),
                "gemm_dnnl_matmul: oneDNN has no bf16 matmul kernel for this CPU (oneDNN ISA "
                    << dnnl_cpu_isa2str(dnnl_get_effective_cpu_isa())
                    << "); kernels::gemm falls back to widening to f32");
  if (M == 0 || N == 0) return;
  if (K == 0) {
    scale_c(M, N, beta, C, ldc);
    if (bias)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) C[i * ldc + j] += bias[j];
    return;
  }
  MatmulKey key;
  std::memset(&key, 0, sizeof(key));  // padding bytes take part in hash and ==
  key.M = M, key.N = N, key.K = K, key.lda = lda, key.ldb = ldb, key.ldc = ldc;
  key.alpha = alpha, key.beta = beta;
  key.threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  key.trans_a = trans_a, key.trans_b = trans_b, key.has_bias = bias != nullptr;
  key.ab_type = ab_type;

  MatmulThreadState& state = matmul_state();
  auto it = state.cache.find(key);
  if (it == state.cache.end()) it = state.cache.emplace(key, build_matmul(key)).first;
  MatmulEntry& e = it->second;
  if (state.scratchpad.bytes() < e.scratchpad_bytes) state.scratchpad.ensure(e.scratchpad_bytes, MemCategory::Workspace);
  e.a.set_data_handle(const_cast<void*>(A));
  e.b.set_data_handle(const_cast<void*>(B));
  e.c.set_data_handle(C);
  if (bias) e.bias.set_data_handle(const_cast<float*>(bias));
  if (e.scratchpad_bytes > 0 && (!e.scratchpad || e.scratchpad.get_data_handle() != state.scratchpad.data())) {
    e.scratchpad = dnnl::memory(e.scratchpad_md, cpu_engine(), state.scratchpad.data());
    e.args[DNNL_ARG_SCRATCHPAD] = e.scratchpad;
  }
  e.primitive.execute(state.stream, e.args);
  state.stream.wait();
}

int64_t matmul_cache_size() { return static_cast<int64_t>(matmul_state().cache.size()); }

bool dnnl_bf16_matmul_available() {
  static const bool available = [] {
    const char* env = std::getenv("LATTICE_DNNL_BF16");
    if (env && std::strcmp(env, "0") == 0) return false;
    // A small bf16 x bf16 -> f32 matmul: does oneDNN have a kernel for it on
    // this CPU? The C API answers with a status.
    const dnnl_dims_t dims = {64, 64};
    dnnl_memory_desc_t a, b, c;
    if (dnnl_memory_desc_init_by_tag(&a, 2, dims, dnnl_bf16, dnnl_ab) != dnnl_success ||
        dnnl_memory_desc_init_by_tag(&b, 2, dims, dnnl_bf16, dnnl_ab) != dnnl_success ||
        dnnl_memory_desc_init_by_tag(&c, 2, dims, dnnl_f32, dnnl_ab) != dnnl_success)
      return false;
    dnnl_matmul_desc_t desc;
    if (dnnl_matmul_desc_init(&desc, &a, &b, nullptr, &c) != dnnl_success) return false;
    dnnl_primitive_desc_t pd = nullptr;
    if (dnnl_primitive_desc_create(&pd, &desc, nullptr, cpu_engine().get(), nullptr) != dnnl_success) return false;
    const char* impl = nullptr;
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    // A reference (scalar C++) implementation is not a bf16 kernel.
    const bool real = impl != nullptr && std::strncmp(impl, "ref", 3) != 0;
    dnnl_primitive_desc_destroy(pd);
    return real;
  }();
  return available;
}

namespace {

// Best of `reps` timings of fn(), in seconds.
template <typename Fn>
double best_seconds(int reps, const Fn& fn) {
  double best = 1e30;
  for (int r = 0; r < reps; r++) {
    Timer t;
    fn();
    best = std::min(best, t.seconds());
  }
  return best;
}

GemmPaths available_gemm_paths() {
  configure_dnnl_once();  // before anything asks oneDNN for its ISA
  GemmPaths p;
  p.dnnl_isa = dnnl_cpu_isa2str(dnnl_get_effective_cpu_isa());
  if (p.dnnl_isa.rfind("cpu_isa_", 0) == 0) p.dnnl_isa = p.dnnl_isa.substr(8);
  p.bf16_primitive_available = dnnl_bf16_matmul_available();
  return p;
}

GemmPaths choose_gemm_paths() {
  configure_dnnl_once();  // before anything asks oneDNN for its ISA
  GemmPaths p;
  p.dnnl_isa = dnnl_cpu_isa2str(dnnl_get_effective_cpu_isa());
  if (p.dnnl_isa.rfind("cpu_isa_", 0) == 0) p.dnnl_isa = p.dnnl_isa.substr(8);
  p.bf16_primitive_available = dnnl_bf16_matmul_available();
  if (p.bf16_primitive_available) {
    // One GPT-2-sized product (N = 256 tokens, C = 768 -> 768, ~0.3 GFLOP),
    // both paths alternately, best of 3 after a warm-up each.
    const int64_t M = 256, N = 768, K = 768;
    std::vector<uint16_t> A(M * K), B(K * N);
    for (size_t i = 0; i < A.size(); i++) A[i] = 0x3F80 + static_cast<uint16_t>(i % 64);  // 1.0 .. 1.5
    for (size_t i = 0; i < B.size(); i++) B[i] = 0x3C00 + static_cast<uint16_t>(i % 64);  // small values
    std::vector<float> C(M * N);
    auto widen = [&] { gemm_bf16_via_sgemm(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, C.data(), N); };
    auto primitive = [&] {
      gemm_dnnl_matmul(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, C.data(), N, DType::BF16, nullptr);
    };
    widen();
    primitive();
    double t_widen = 1e30, t_primitive = 1e30;
    for (int r = 0; r < 3; r++) {
      t_widen = std::min(t_widen, best_seconds(1, widen));
      t_primitive = std::min(t_primitive, best_seconds(1, primitive));
    }
    p.bf16_primitive_speedup = t_widen / t_primitive;
    if (p.bf16_primitive_speedup >= 1.2) p.bf16 = "dnnl_matmul_bf16";
  }
  return p;
}

}  // namespace

}  // namespace cpu

namespace {
std::mutex g_paths_mutex;
std::unique_ptr<GemmPaths> g_paths;  // decided once: timed, or set by set_bf16_gemm_path
}  // namespace

const GemmPaths& gemm_paths() {
  std::lock_guard<std::mutex> lock(g_paths_mutex);
  if (!g_paths) g_paths = std::make_unique<GemmPaths>(cpu::choose_gemm_paths());
  return *g_paths;
}

void set_bf16_gemm_path(bool primitive, double measured_speedup) {
  std::lock_guard<std::mutex> lock(g_paths_mutex);
  if (g_paths) {
    // A later job in the same process (tests run many) repeats the decision.
    LATTICE_CHECK(g_paths->bf16_uses_primitive() == primitive,
                  "set_bf16_gemm_path: this process already computes bf16 GEMMs with " << g_paths->bf16);
    return;
  }
  GemmPaths p = cpu::available_gemm_paths();
  LATTICE_CHECK(!primitive || p.bf16_primitive_available,
                "set_bf16_gemm_path: oneDNN has no bf16 matmul kernel on this CPU (oneDNN ISA " << p.dnnl_isa << ")");
  p.bf16_primitive_speedup = measured_speedup;
  if (primitive) p.bf16 = "dnnl_matmul_bf16";
  g_paths = std::make_unique<GemmPaths>(p);
}

std::string describe_gemm_paths() {
  const GemmPaths& p = gemm_paths();
  std::string s = std::string("f32 ") + p.f32 + ", bf16 " + p.bf16;
  if (!p.bf16_primitive_available) {
    s += " (oneDNN has no bf16 matmul for this CPU)";
  } else {
    char buf[96];
    std::snprintf(buf, sizeof buf, " (oneDNN's bf16 matmul ran %.2fx the widened f32 path)", p.bf16_primitive_speedup);
    s += buf;
  }
  return s + "; oneDNN ISA " + p.dnnl_isa;
}

// ---- bf16 GEMM operands -------------------------------------------------------

namespace {

thread_local bool g_bf16_operands = false;

struct Constant {
  int64_t n = 0;
  Buffer bf16;        // the values converted, made on first use after set()
  bool converted = false;
};
std::mutex g_constants_mutex;
std::map<const float*, Constant> g_constants;  // by first element

// The registered constant holding op's stored rows × cols (leading
// dimension ld), with the offset of p in it, or null. Hold the mutex.
Constant* find_constant(const float* p, int64_t rows, int64_t cols, int64_t ld, int64_t* at) {
  auto it = g_constants.upper_bound(p);
  if (it == g_constants.begin()) return nullptr;
  --it;
  *at = p - it->first;
  return *at >= 0 && *at + (rows - 1) * ld + cols <= it->second.n ? &it->second : nullptr;
}

// This thread's operand workspace `slot` (0: A, 1: B), at least `bytes`.
void* operand_workspace(int slot, size_t bytes) {
  thread_local Buffer scratch[2];
  scratch[slot].ensure(bytes, MemCategory::Workspace);
  return scratch[slot].data();
}

// The portable path's operand: a constant as it is (it holds bf16 values,
// exact in f32), anything else rounded to bf16 into this thread's f32
// workspace `slot` (leading dimension cols) — then dnnl_sgemm multiplies
// exactly the bf16 products oneDNN's bf16 matmul would.
const float* rounded_operand(const float* p, int64_t rows, int64_t cols, int64_t ld, int slot, int64_t* ld_out) {
  {
    std::lock_guard<std::mutex> lock(g_constants_mutex);
    int64_t at = 0;
    if (find_constant(p, rows, cols, ld, &at)) {
      *ld_out = ld;
      return p;
    }
  }
  float* out = static_cast<float*>(operand_workspace(slot, static_cast<size_t>(rows * cols) * sizeof(float)));
  for (int64_t r = 0; r < rows; r++) std::memcpy(out + r * cols, p + r * ld, sizeof(float) * cols);
  round_to(DType::BF16, out, rows * cols);
  *ld_out = cols;
  return out;
}

// op's stored rows × cols at bf16: a constant's copy (converted on its first
// use after set(); *ld16 = ld), or converted into this thread's workspace
// `slot` (leading dimension cols).
const uint16_t* bf16_operand(const float* p, int64_t rows, int64_t cols, int64_t ld, int slot, int64_t* ld16) {
  {
    std::lock_guard<std::mutex> lock(g_constants_mutex);
    int64_t at = 0;
    if (Constant* c = find_constant(p, rows, cols, ld, &at)) {
      if (!c->converted) {
        c->bf16.ensure(static_cast<size_t>(c->n) * 2, MemCategory::Workspace);
        store_16bit(DType::BF16, p - at, c->bf16.data(), c->n);
        c->converted = true;
      }
      *ld16 = ld;
      return c->bf16.as<uint16_t>() + at;
    }
  }
  uint16_t* out = static_cast<uint16_t*>(operand_workspace(slot, static_cast<size_t>(rows * cols) * 2));
  if (ld == cols) {
    store_16bit(DType::BF16, p, out, rows * cols);
  } else {
    for (int64_t r = 0; r < rows; r++) store_16bit(DType::BF16, p + r * ld, out + r * cols, cols);
  }
  *ld16 = cols;
  return out;
}

}  // namespace

Bf16GemmScope::Bf16GemmScope() : previous_(g_bf16_operands) { g_bf16_operands = true; }
Bf16GemmScope::~Bf16GemmScope() { g_bf16_operands = previous_; }
bool bf16_gemm_scope_active() { return g_bf16_operands; }

GemmConstant& GemmConstant::operator=(GemmConstant&& o) noexcept {
  if (this != &o) {
    reset();
    begin_ = o.begin_;
    o.begin_ = nullptr;
  }
  return *this;
}

void GemmConstant::set(const float* begin, int64_t n) {
  std::lock_guard<std::mutex> lock(g_constants_mutex);
  if (begin_ && begin_ != begin) g_constants.erase(begin_);
  Constant& c = g_constants[begin];
  c.n = n;
  c.converted = false;  // converted again on its next use (the buffer is kept)
  begin_ = begin;
}

void GemmConstant::reset() {
  if (!begin_) return;
  std::lock_guard<std::mutex> lock(g_constants_mutex);
  g_constants.erase(begin_);
  begin_ = nullptr;
}

size_t gemm_constant_bytes() {
  std::lock_guard<std::mutex> lock(g_constants_mutex);
  size_t bytes = 0;
  for (const auto& [p, c] : g_constants) bytes += c.bf16.bytes();
  return bytes;
}

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
          const void* B, int64_t ldb, float beta, float* C, int64_t ldc, DType ab_type) {
  if (ab_type == DType::F32 && g_bf16_operands && M > 0 && N > 0 && K > 0) {
    const float* a = static_cast<const float*>(A);
    const float* b = static_cast<const float*>(B);
    const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K, b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
    int64_t lda2 = 0, ldb2 = 0;
    if (!gemm_paths().bf16_uses_primitive()) {
      const float* ar = rounded_operand(a, a_rows, a_cols, lda, 0, &lda2);
      const float* br = rounded_operand(b, b_rows, b_cols, ldb, 1, &ldb2);
      return cpu::gemm_dnnl_sgemm(trans_a, trans_b, M, N, K, alpha, ar, lda2, br, ldb2, beta, C, ldc);
    }
    const uint16_t* a16 = bf16_operand(a, a_rows, a_cols, lda, 0, &lda2);
    const uint16_t* b16 = bf16_operand(b, b_rows, b_cols, ldb, 1, &ldb2);
    return gemm(trans_a, trans_b, M, N, K, alpha, a16, lda2, b16, ldb2, beta, C, ldc, DType::BF16);
  }
  if (ab_type == DType::F32) {
    cpu::gemm_dnnl_sgemm(trans_a, trans_b, M, N, K, alpha, static_cast<const float*>(A), lda,
                         static_cast<const float*>(B), ldb, beta, C, ldc);
  } else if (ab_type == DType::BF16) {
    if (gemm_paths().bf16_uses_primitive())
      cpu::gemm_dnnl_matmul(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, DType::BF16, nullptr);
    else
      cpu::gemm_bf16_via_sgemm(trans_a, trans_b, M, N, K, alpha, static_cast<const uint16_t*>(A), lda,
                               static_cast<const uint16_t*>(B), ldb, beta, C, ldc);
  } else {
    LATTICE_FAIL("gemm: A/B type " << dtype_name(ab_type) << " is not supported (f32 or bf16)");
  }
}

}  // namespace lattice::kernels
