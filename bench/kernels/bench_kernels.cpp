// Micro-benchmarks of lattice's CPU kernels at GPT-2 124M shapes (N = B·T =
// 1024 tokens). Every benchmark takes the thread count as its last argument
// (/threads:1, /threads:2) and reports GFLOP/s or GB/s as counters.
//
//   cmake --build build --target bench_kernels && ./build/bench/kernels/bench_kernels
//   ./build/bench/kernels/bench_kernels --benchmark_filter='gemm/'
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "lattice/core/dtype.h"
#include "lattice/core/rng.h"
#include "lattice/core/threads.h"
#include "lattice/kernels/cpu/gemm_internal.h"
#include "lattice/kernels/ops.h"

#ifdef LATTICE_BENCH_OPENBLAS
#include <cblas.h>
extern "C" void openblas_set_num_threads(int);
#endif

namespace k = lattice::kernels;

namespace {

std::vector<float> random_vector(size_t n, float scale = 1.0f, uint32_t seed = 1) {
  std::vector<float> v(n);
  uint64_t s = 0x9E3779B97F4A7C15ull * (seed + 1);
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = scale * (static_cast<float>((s >> 40) & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f);
  }
  return v;
}

void set_threads(int n) {
  lattice::set_num_threads(n);
#ifdef LATTICE_BENCH_OPENBLAS
  openblas_set_num_threads(n);
#endif
}

// ---- GEMM -------------------------------------------------------------------
struct LinearShape {
  const char* name;
  int IC, OC;
};
constexpr int kTokens = 1024;
const LinearShape kShapes[] = {{"qkv", 768, 2304}, {"attn_proj", 768, 768}, {"fc", 768, 3072},
                               {"fc_proj", 3072, 768}, {"lm_head", 768, 50304}};

enum class Pass { Forward, BackwardInput, BackwardWeight };
const char* pass_name(Pass p) {
  return p == Pass::Forward ? "fwd" : p == Pass::BackwardInput ? "bwd_input" : "bwd_weight";
}
enum class Backend { Lattice, DnnlSgemm, DnnlMatmul, DnnlMatmulBf16, OpenBlas };
const char* backend_name(Backend b) {
  switch (b) {
    case Backend::Lattice: return "lattice";
    case Backend::DnnlSgemm: return "dnnl_sgemm";
    case Backend::DnnlMatmul: return "dnnl_matmul";
    case Backend::DnnlMatmulBf16: return "dnnl_matmul_bf16";
    case Backend::OpenBlas: return "openblas";
  }
  return "?";
}

// One linear layer's GEMM in the layout the model uses:
//   fwd        out[N,OC]  = inp[N,IC] · W[OC,IC]ᵀ         (NT)
//   bwd_input  dinp[N,IC] = dout[N,OC] · W[OC,IC]         (NN)
//   bwd_weight dW[OC,IC] += dout[N,OC]ᵀ · inp[N,IC]       (TN, beta = 1)
void run_gemm(Backend backend, Pass pass, int64_t N, int64_t IC, int64_t OC, const void* inp, const void* w,
              const void* dout, float* out, float* dinp, float* dw) {
  bool ta = false, tb = false;
  int64_t M = 0, Nn = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
  const void *A = nullptr, *B = nullptr;
  float* C = nullptr;
  float beta = 0.0f;
  switch (pass) {
    case Pass::Forward: ta = false, tb = true, M = N, Nn = OC, K = IC, A = inp, lda = IC, B = w, ldb = IC, C = out, ldc = OC; break;
    case Pass::BackwardInput: ta = false, tb = false, M = N, Nn = IC, K = OC, A = dout, lda = OC, B = w, ldb = IC, C = dinp, ldc = IC; break;
    case Pass::BackwardWeight: ta = true, tb = false, M = OC, Nn = IC, K = N, A = dout, lda = OC, B = inp, ldb = IC, C = dw, ldc = IC, beta = 1.0f; break;
  }
  switch (backend) {
    case Backend::Lattice: k::gemm(ta, tb, M, Nn, K, 1.0f, A, lda, B, ldb, beta, C, ldc); break;
    case Backend::DnnlSgemm:
      k::cpu::gemm_dnnl_sgemm(ta, tb, M, Nn, K, 1.0f, static_cast<const float*>(A), lda, static_cast<const float*>(B), ldb, beta, C, ldc);
      break;
    case Backend::DnnlMatmul:
      k::cpu::gemm_dnnl_matmul(ta, tb, M, Nn, K, 1.0f, A, lda, B, ldb, beta, C, ldc, lattice::DType::F32, nullptr);
      break;
    case Backend::DnnlMatmulBf16:
      k::cpu::gemm_dnnl_matmul(ta, tb, M, Nn, K, 1.0f, A, lda, B, ldb, beta, C, ldc, lattice::DType::BF16, nullptr);
      break;
    case Backend::OpenBlas:
#ifdef LATTICE_BENCH_OPENBLAS
      cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, Nn, K, 1.0f,
                  static_cast<const float*>(A), lda, static_cast<const float*>(B), ldb, beta, C, ldc);
#endif
      break;
  }
}

void BM_gemm(benchmark::State& state, LinearShape shape, Pass pass, Backend backend, int threads) {
  set_threads(threads);
  const int64_t N = kTokens, IC = shape.IC, OC = shape.OC;
  const bool bf16 = backend == Backend::DnnlMatmulBf16;
  auto inp = random_vector(N * IC, 1.0f, 1), w = random_vector(OC * IC, 0.02f, 2), dout = random_vector(N * OC, 1.0f, 3);
  std::vector<float> out(N * OC), dinp(N * IC), dw(OC * IC);
  std::vector<uint16_t> inp16(inp.size()), w16(w.size()), dout16(dout.size());
  const void *pi = inp.data(), *pw = w.data(), *pd = dout.data();
  if (bf16) {
    lattice::convert(inp.data(), lattice::DType::F32, inp16.data(), lattice::DType::BF16, inp.size());
    lattice::convert(w.data(), lattice::DType::F32, w16.data(), lattice::DType::BF16, w.size());
    lattice::convert(dout.data(), lattice::DType::F32, dout16.data(), lattice::DType::BF16, dout.size());
    pi = inp16.data(), pw = w16.data(), pd = dout16.data();
  }
  run_gemm(backend, pass, N, IC, OC, pi, pw, pd, out.data(), dinp.data(), dw.data());  // warm-up (and primitive creation)
  for (auto _ : state) {
    run_gemm(backend, pass, N, IC, OC, pi, pw, pd, out.data(), dinp.data(), dw.data());
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * N * IC * OC;
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void register_gemm() {
  std::vector<Backend> backends = {Backend::Lattice, Backend::DnnlSgemm, Backend::DnnlMatmul, Backend::DnnlMatmulBf16};
#ifdef LATTICE_BENCH_OPENBLAS
  backends.push_back(Backend::OpenBlas);
#endif
  for (int threads : {1, 2})
    for (const auto& shape : kShapes)
      for (Pass pass : {Pass::Forward, Pass::BackwardInput, Pass::BackwardWeight})
        for (Backend b : backends) {
          const std::string name = std::string("gemm/") + shape.name + "/" + pass_name(pass) + "/" +
                                   backend_name(b) + "/threads:" + std::to_string(threads);
          benchmark::RegisterBenchmark(name.c_str(), BM_gemm, shape, pass, b, threads)
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime()
              ->MinTime(0.3);
        }
}

}  // namespace

int main(int argc, char** argv) {
  register_gemm();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
