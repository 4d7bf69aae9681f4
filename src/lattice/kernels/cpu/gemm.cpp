// GEMM through oneDNN.
//
// Why oneDNN: on the Xeon this project is developed on (AVX-512, avx512_bf16),
// Debian's OpenBLAS 0.3.21 detects the core as "Prescott" and runs SSE3 kernels
// (~30 GFLOP/s on one thread) unless OPENBLAS_CORETYPE=SkylakeX is set; oneDNN
// dispatches its JIT kernels on CPUID at run time and needs no setting. A
// product must not need an environment variable to be fast.
//
// Which oneDNN entry point (bench/kernels, docs/kernels.md has the figures):
//   f32   dnnl_sgemm. At every GPT-2 shape and transpose combination it was
//         as fast as or faster than a cached dnnl::matmul primitive (which
//         falls to ~40-70% of it for some backward shapes, e.g. K = 3072 → 768),
//         and it needs no per-shape state.
//   bf16  oneDNN 2.6's bf16 matmul (brgemm avx512_core_bf16, no AMX here) runs
//         at ~80 GFLOP/s, half the f32 rate; widening the bf16 blocks to f32
//         (exact) and calling dnnl_sgemm reaches the f32 rate. So bf16 goes
//         through gemm_bf16_via_sgemm. (dnnl_gemm_bf16bf16f32 is not exported
//         by the 2.6 library.)
// The matmul primitive path is kept (gemm_dnnl_matmul) for the benchmark and
// for callers that want a fused bias.
//
// Threads: Debian's oneDNN is built with the OpenMP runtime (DNNL_CPU_RUNTIME
// = OMP, linked against libgomp, the same runtime as our kernels), so it uses
// omp_get_max_threads(), i.e. lattice::set_num_threads(). Called from inside an
// OpenMP parallel region it runs on the calling thread only.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/kernels/cpu/gemm_internal.h"
#include "lattice/kernels/cpu/vec_math.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace cpu {
namespace {

dnnl::engine& cpu_engine() {
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
LATTICE_SIMD_CLONES
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
  if (rows * (c1 - c0) < (1 << 16) || omp_in_parallel()) return widen_rows(dst, src, ld, r0, r1, c0, c1);
  const int64_t chunks = std::min<int64_t>(rows, 64);
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    int64_t b, e;
    split_range(rows, chunks, chunk, &b, &e);
    widen_rows(dst + b * (c1 - c0), src, ld, r0 + b, r0 + e, c0, c1);
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

}  // namespace cpu

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
          const void* B, int64_t ldb, float beta, float* C, int64_t ldc, DType ab_type) {
  if (ab_type == DType::F32) {
    cpu::gemm_dnnl_sgemm(trans_a, trans_b, M, N, K, alpha, static_cast<const float*>(A), lda,
                         static_cast<const float*>(B), ldb, beta, C, ldc);
  } else if (ab_type == DType::BF16) {
    cpu::gemm_bf16_via_sgemm(trans_a, trans_b, M, N, K, alpha, static_cast<const uint16_t*>(A), lda,
                             static_cast<const uint16_t*>(B), ldb, beta, C, ldc);
  } else {
    LATTICE_FAIL("gemm: A/B type " << dtype_name(ab_type) << " is not supported (f32 or bf16)");
  }
}

}  // namespace lattice::kernels
