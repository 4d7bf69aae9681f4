// GEMM through oneDNN.
//
// Why oneDNN: on the Xeon this project is developed on (AVX-512, avx512_bf16),
// Debian's OpenBLAS 0.3.21 detects the core as "Prescott" and runs SSE3 kernels
// (20–31 GFLOP/s on one thread) unless OPENBLAS_CORETYPE=SkylakeX is set;
// oneDNN dispatches its JIT kernels on CPUID at run time and reaches 105–150
// GFLOP/s with no setting. A product must not need an environment variable to
// be fast. docs/kernels.md has the measurements that chose between oneDNN's two
// entry points (dnnl_sgemm and a cached matmul primitive) for each case.
//
// Threads: Debian's oneDNN is built with the OpenMP runtime (DNNL_CPU_RUNTIME
// = OMP, linked against libgomp, the same runtime as our kernels), so it uses
// omp_get_max_threads(), i.e. lattice::set_num_threads(). Called from inside an
// OpenMP parallel region it runs on the calling thread only.
#include <omp.h>

#include <cstring>
#include <unordered_map>

#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/kernels/cpu/gemm_internal.h"
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

}  // namespace

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
  } else {
    cpu::gemm_dnnl_matmul(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, ab_type, nullptr);
  }
}

}  // namespace lattice::kernels
