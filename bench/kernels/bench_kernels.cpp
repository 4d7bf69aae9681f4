// Micro-benchmarks of lattice's CPU kernels at GPT-2 124M shapes (N = B·T =
// 1024 tokens). Every benchmark takes the thread count as its last argument
// (/threads:1, /threads:2) and reports GFLOP/s or GB/s as counters; the
// gradient codecs (grad_codec/, one thread) report the time a value.
//
//   cmake --build build --target bench_kernels && ./build/bench/kernels/bench_kernels
//   ./build/bench/kernels/bench_kernels --benchmark_filter='gemm/'
//   ./build/bench/kernels/bench_kernels --benchmark_filter='grad_codec/'
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "lattice/core/dtype.h"
#include "lattice/core/rng.h"
#include "lattice/core/threads.h"
#include "lattice/kernels/cpu/gemm_internal.h"
#include "lattice/kernels/ops.h"
#include "lattice/parallel/compress/gradient_codec.h"

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

// On a shared machine the best of several repetitions is the figure that
// estimates the kernel (other processes only ever make it slower), so every
// benchmark also reports min (of time; of a rate counter: the worst rate) and
// max (of a rate counter: the best rate) over --benchmark_repetitions.
benchmark::internal::Benchmark* with_min_max(benchmark::internal::Benchmark* b) {
  return b
      ->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); })
      ->ComputeStatistics("max", [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); });
}

// One thread: rates from the thread's CPU time, which other processes on a
// shared machine inflate far less than wall time. Two threads: wall time (the
// CPU time of the main thread would miss the worker's share).
void timing(benchmark::internal::Benchmark* b, int threads) {
  b->Unit(benchmark::kMillisecond)->MinTime(0.3);
  if (threads > 1) b->UseRealTime();
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
// GPT-2 124M's, then the ones configs/llama-125m.toml adds (no biases): Q, K, V with 4 of 12
// heads for keys and values (768 + 2·256 columns), the SwiGLU gate and up projections in one
// (2·2304), the down projection (2304 → 768). Its attention output is attn_proj's shape.
const LinearShape kShapes[] = {{"qkv", 768, 2304},         {"attn_proj", 768, 768},       {"fc", 768, 3072},
                               {"fc_proj", 3072, 768},     {"lm_head", 768, 50304},       {"llama_qkv", 768, 1280},
                               {"llama_gate_up", 768, 4608}, {"llama_down", 2304, 768}};

enum class Pass { Forward, BackwardInput, BackwardWeight };
const char* pass_name(Pass p) {
  return p == Pass::Forward ? "fwd" : p == Pass::BackwardInput ? "bwd_input" : "bwd_weight";
}
enum class Backend { Lattice, DnnlSgemm, DnnlMatmul, LatticeBf16, DnnlMatmulBf16, OpenBlas };
const char* backend_name(Backend b) {
  switch (b) {
    case Backend::Lattice: return "lattice";
    case Backend::DnnlSgemm: return "dnnl_sgemm";
    case Backend::DnnlMatmul: return "dnnl_matmul";
    case Backend::LatticeBf16: return "lattice_bf16";
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
    case Backend::LatticeBf16: k::gemm(ta, tb, M, Nn, K, 1.0f, A, lda, B, ldb, beta, C, ldc, lattice::DType::BF16); break;
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
  const bool bf16 = backend == Backend::DnnlMatmulBf16 || backend == Backend::LatticeBf16;
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
  std::vector<Backend> backends = {Backend::Lattice,     Backend::DnnlSgemm,      Backend::DnnlMatmul,
                                   Backend::LatticeBf16, Backend::DnnlMatmulBf16};
#ifdef LATTICE_BENCH_OPENBLAS
  backends.push_back(Backend::OpenBlas);
#endif
  for (int threads : {1, 2})
    for (const auto& shape : kShapes)
      for (Pass pass : {Pass::Forward, Pass::BackwardInput, Pass::BackwardWeight})
        for (Backend b : backends) {
          const std::string name = std::string("gemm/") + shape.name + "/" + pass_name(pass) + "/" +
                                   backend_name(b) + "/threads:" + std::to_string(threads);
          timing(with_min_max(benchmark::RegisterBenchmark(name.c_str(), BM_gemm, shape, pass, b, threads)),
                 threads);
        }
}


// ---- Linear forward with bias: pre-fill + sgemm (what linear_forward does)
// vs a matmul primitive with the bias fused --------------------------------------
void BM_linear_bias(benchmark::State& state, LinearShape shape, bool fused, int threads) {
  set_threads(threads);
  const int64_t N = kTokens;
  auto inp = random_vector(N * shape.IC, 1.0f, 1), w = random_vector(int64_t{shape.OC} * shape.IC, 0.02f, 2),
       bias = random_vector(shape.OC, 0.1f, 3);
  std::vector<float> out(N * shape.OC);
  auto run = [&] {
    if (fused)
      k::cpu::gemm_dnnl_matmul(false, true, N, shape.OC, shape.IC, 1.0f, inp.data(), shape.IC, w.data(), shape.IC,
                               0.0f, out.data(), shape.OC, lattice::DType::F32, bias.data());
    else
      k::linear_forward(out.data(), inp.data(), w.data(), bias.data(), N, shape.IC, shape.OC);
  };
  run();
  for (auto _ : state) {
    run();
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * N * shape.IC * shape.OC * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// ---- Attention ------------------------------------------------------------------
// FLOPs counted for the causal half only (what a masked implementation has to
// do): forward 2 GEMMs (QKᵀ, PV) = 2·2·hs·T(T+1)/2 per query head; backward 5
// (QKᵀ recompute, dP, dV, dQ, dK). Grouped-query attention does the same
// arithmetic per query head as multi-head (K/V heads are shared, not fewer
// products), so its rate compares directly.
double attention_flops(int B, int T, int NH, int hs, int gemms) {
  return gemms * 2.0 * B * NH * hs * (T * (T + 1.0) / 2.0);
}

// GPT-2 124M's attention (NH = NKV = 12, hs = 64), or a grouped-query
// variant of it (NKV < NH key/value heads).
void BM_attention(benchmark::State& state, int B, int T, int NH, int NKV, int hs, bool backward, int threads) {
  set_threads(threads);
  const int64_t ld = static_cast<int64_t>(NH + 2 * NKV) * hs, width = static_cast<int64_t>(NH) * hs;
  auto qkv = random_vector(static_cast<size_t>(B) * T * ld, 1.0f, 4);
  auto dout = random_vector(static_cast<size_t>(B) * T * width, 1.0f, 5);
  std::vector<float> out(dout.size()), lse(B * NH * T), dqkv(qkv.size());
  k::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, hs);
  for (auto _ : state) {
    if (backward)
      k::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH, NKV, hs);
    else
      k::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, hs);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(attention_flops(B, T, NH, hs, backward ? 5 : 2) * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// ---- Memory-bound kernels: GB/s = bytes read + written per call / time -------------
void report_bytes(benchmark::State& state, double bytes) {
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_layernorm(benchmark::State& state, int which, int threads) {
  set_threads(threads);
  const int64_t N = kTokens;
  const int C = 768;
  auto x = random_vector(N * C, 1.0f, 6), w = random_vector(C, 1.0f, 7), b = random_vector(C, 1.0f, 8),
       dy = random_vector(N * C, 1.0f, 9);
  std::vector<float> out(N * C), mean(N), rstd(N), dx(N * C), dw(C), db(C);
  k::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  for (auto _ : state) {
    if (which == 0) k::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    if (which == 1)
      k::layernorm_backward_input(dx.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
    if (which == 2)
      k::layernorm_backward_weight(dw.data(), db.data(), dy.data(), x.data(), mean.data(), rstd.data(), N, C);
    benchmark::ClobberMemory();
  }
  const double tensor = 4.0 * N * C;
  report_bytes(state, which == 0 ? 2 * tensor : which == 1 ? 4 * tensor : 2 * tensor);
}

void BM_gelu(benchmark::State& state, bool backward, int threads) {
  set_threads(threads);
  const int64_t n = kTokens * 4 * 768;
  auto x = random_vector(n, 3.0f, 10), dy = random_vector(n, 1.0f, 11);
  std::vector<float> out(n);
  for (auto _ : state) {
    if (backward)
      k::gelu_backward(out.data(), x.data(), dy.data(), n);
    else
      k::gelu_forward(out.data(), x.data(), n);
    benchmark::ClobberMemory();
  }
  report_bytes(state, 4.0 * n * (backward ? 3 : 2));
}

// The Llama kernels at the shapes of their GPT-2 124M counterparts: RMSNorm
// as LayerNorm (N = 1024, C = 768); SwiGLU with F = 3072 outputs per row (as
// GELU's 1024 x 3072); RoPE on Q and K of a qkv [4, 256, 3·768] (24 heads of 64).
void BM_rmsnorm(benchmark::State& state, int which, int threads) {
  set_threads(threads);
  const int64_t N = kTokens;
  const int C = 768;
  auto x = random_vector(N * C, 1.0f, 20), w = random_vector(C, 1.0f, 21), dy = random_vector(N * C, 1.0f, 22);
  std::vector<float> out(N * C), rstd(N), dx(N * C), dw(C);
  k::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
  for (auto _ : state) {
    if (which == 0) k::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
    if (which == 1)
      k::rmsnorm_backward_input(dx.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C, /*accumulate=*/true);
    if (which == 2) k::rmsnorm_backward_weight(dw.data(), dy.data(), x.data(), rstd.data(), N, C);
    benchmark::ClobberMemory();
  }
  const double tensor = 4.0 * N * C;
  report_bytes(state, which == 0 ? 2 * tensor : which == 1 ? 4 * tensor : 2 * tensor);
}

void BM_swiglu(benchmark::State& state, bool backward, int threads) {
  set_threads(threads);
  const int64_t N = kTokens;
  const int F = 4 * 768;
  auto inp = random_vector(N * 2 * F, 3.0f, 23), dy = random_vector(N * F, 1.0f, 24);
  std::vector<float> out(N * F), dinp(N * 2 * F);
  for (auto _ : state) {
    if (backward)
      k::swiglu_backward(dinp.data(), dy.data(), inp.data(), N, F);
    else
      k::swiglu_forward(out.data(), inp.data(), N, F);
    benchmark::ClobberMemory();
  }
  const double outputs = 4.0 * N * F;
  report_bytes(state, backward ? 5 * outputs : 3 * outputs);  // fwd: g, u, h ; bwd: g, u, dh, dg, du
}

void BM_rope(benchmark::State& state, bool backward, int threads) {
  set_threads(threads);
  const int B = 4, T = 256, C = 768, NH = 12, hs = C / NH;
  const k::RopeTable table(hs, T, 10000.0f);
  auto qkv = random_vector(static_cast<size_t>(B) * T * 3 * C, 1.0f, 25);
  for (auto _ : state) {
    // Forward then backward would undo each other; either alone keeps the values bounded (a rotation).
    if (backward)
      k::rope_backward(qkv.data(), 3 * C, table, B, T, 2 * NH, 0);
    else
      k::rope_forward(qkv.data(), 3 * C, table, B, T, 2 * NH, 0);
    benchmark::ClobberMemory();
  }
  report_bytes(state, 4.0 * B * T * 2 * C * 2);  // Q and K read and written (the table stays in cache)
}

void BM_residual(benchmark::State& state, int threads) {
  set_threads(threads);
  const int64_t n = kTokens * 768;
  auto a = random_vector(n, 1.0f, 12), b = random_vector(n, 1.0f, 13);
  for (auto _ : state) {
    k::add_inplace(a.data(), b.data(), n);
    benchmark::ClobberMemory();
  }
  report_bytes(state, 4.0 * n * 3);
}

void BM_crossentropy(benchmark::State& state, int threads) {
  set_threads(threads);
  const int64_t N = kTokens;
  const int V = 50257, Vp = 50304;
  auto logits = random_vector(N * Vp, 4.0f, 14);
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = static_cast<int32_t>((i * 7919) % V);
  std::vector<float> losses(N);
  // In place: later iterations run on the previous dlogits, same cost.
  for (auto _ : state) {
    k::crossentropy_forward_backward(logits.data(), losses.data(), targets.data(), N, V, Vp, 1.0f / N);
    benchmark::ClobberMemory();
  }
  report_bytes(state, 4.0 * N * Vp * 2);
}

constexpr int64_t kGpt2Params = 124439808;

void BM_adamw(benchmark::State& state, int threads) {
  set_threads(threads);
  const int64_t n = kGpt2Params;
  std::vector<float> p(n, 0.01f), g(n, 0.001f), m(n, 0.0f), v(n, 0.0f);
  int64_t step = 1;
  for (auto _ : state) {
    k::adamw_update(p.data(), g.data(), m.data(), v.data(), n, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, step++, 1.0f);
    benchmark::ClobberMemory();
  }
  report_bytes(state, 4.0 * n * 7);
}

void BM_sum_squares(benchmark::State& state, int threads) {
  set_threads(threads);
  const int64_t n = kGpt2Params;
  std::vector<float> g(n, 0.001f);
  double sink = 0.0;
  for (auto _ : state) benchmark::DoNotOptimize(sink += k::sum_squares(g.data(), n));
  report_bytes(state, 4.0 * n);
}

void BM_embedding_backward(benchmark::State& state, int threads) {
  set_threads(threads);
  const int B = 4, T = 256, C = 768, V = 50304;
  std::vector<float> dwte(static_cast<size_t>(V) * C), dwpe(T * C);
  auto dout = random_vector(static_cast<size_t>(B) * T * C, 1.0f, 15);
  std::vector<int32_t> tokens(B * T);
  for (int i = 0; i < B * T; ++i) tokens[i] = (i * 7919) % V;
  for (auto _ : state) {
    k::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
    benchmark::ClobberMemory();
  }
  report_bytes(state, 4.0 * B * T * C * 5);  // dout read; dwte rows and dwpe read + written
}

// ---- Gradient codecs (parallel/compress/gradient_codec.h) ----------------------------
// One block of 4M gradient values (uniform in ±0.01) through data parallelism's
// codecs, one thread, as the communication thread runs them:
//   encode_decoded  encode() with its decoded copy (what error feedback needs)
//   encode          encode() alone (error feedback off)
//   decode          decode() of the payload into f32
// "none" (a copy of the f32 values) is the reference each codec is paid
// against. time/value: the time of one call / 4M (thread CPU time, as every
// one-thread benchmark here), printed in ps or ns.
constexpr int64_t kCodecValues = int64_t{4} << 20;

enum class CodecCall { EncodeDecoded, Encode, Decode };
const char* codec_call_name(CodecCall c) {
  return c == CodecCall::EncodeDecoded ? "encode_decoded" : c == CodecCall::Encode ? "encode" : "decode";
}

void BM_grad_codec(benchmark::State& state, lattice::parallel::GradCodec codec, CodecCall call, int threads) {
  namespace par = lattice::parallel;
  set_threads(threads);
  const int64_t n = kCodecValues;
  par::CodecSpec spec;
  spec.codec = codec;  // topk keeps its default ratio (0.01)
  const auto x = random_vector(n, 0.01f, 16);
  std::vector<uint32_t> payload(par::payload_bytes(spec, n) / 4);  // whole words, 4-byte aligned
  std::vector<float> decoded(n);
  par::encode(spec, x.data(), n, payload.data(), decoded.data());  // warm-up; decode's input
  for (auto _ : state) {
    switch (call) {
      case CodecCall::EncodeDecoded: par::encode(spec, x.data(), n, payload.data(), decoded.data()); break;
      case CodecCall::Encode: par::encode(spec, x.data(), n, payload.data(), nullptr); break;
      case CodecCall::Decode: par::decode(spec, payload.data(), n, decoded.data()); break;
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  // n values per call, as a rate inverted: seconds per value (printed with
  // its prefix: 650ps is 0.65 ns a value).
  state.counters["time/value"] = benchmark::Counter(
      static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["payload/f32"] = static_cast<double>(payload.size()) / static_cast<double>(n);
}

template <typename... Args>
void add(const std::string& name, int threads, Args&&... args) {
  timing(with_min_max(benchmark::RegisterBenchmark((name + "/threads:" + std::to_string(threads)).c_str(),
                                                   std::forward<Args>(args)..., threads)),
         threads);
}

void register_others() {
  for (int threads : {1, 2}) {
    for (const auto& shape : kShapes) {
      // No bias in GPT-2's head nor anywhere in the Llama.
      if (std::string(shape.name) == "lm_head" || std::string(shape.name).rfind("llama_", 0) == 0) continue;
      add(std::string("linear_fwd_bias/") + shape.name + "/prefill_sgemm", threads, BM_linear_bias, shape, false);
      add(std::string("linear_fwd_bias/") + shape.name + "/matmul_fused", threads, BM_linear_bias, shape, true);
    }
    for (auto [B, T] : {std::pair{4, 256}, std::pair{4, 1024}}) {
      // Built with += : GCC 12 warns (-Wrestrict, a false positive) on "literal" + std::string.
      std::string shape = "B";
      shape += std::to_string(B);
      shape += "_T";
      shape += std::to_string(T);
      shape += "_C768_NH12";
      add("attention_fwd/" + shape, threads, BM_attention, B, T, 12, 12, 64, false);
      add("attention_bwd/" + shape, threads, BM_attention, B, T, 12, 12, 64, true);
    }
    // Grouped-query: GPT-2 small's 12 query heads sharing 4 key/value heads.
    add("attention_fwd/B4_T256_NH12_NKV4_hs64", threads, BM_attention, 4, 256, 12, 4, 64, false);
    add("attention_bwd/B4_T256_NH12_NKV4_hs64", threads, BM_attention, 4, 256, 12, 4, 64, true);
    add("layernorm_fwd/N1024_C768", threads, BM_layernorm, 0);
    add("layernorm_bwd_input/N1024_C768", threads, BM_layernorm, 1);
    add("layernorm_bwd_weight/N1024_C768", threads, BM_layernorm, 2);
    add("gelu_fwd/N1024x3072", threads, BM_gelu, false);
    add("gelu_bwd/N1024x3072", threads, BM_gelu, true);
    add("rmsnorm_fwd/N1024_C768", threads, BM_rmsnorm, 0);
    add("rmsnorm_bwd_input/N1024_C768", threads, BM_rmsnorm, 1);
    add("rmsnorm_bwd_weight/N1024_C768", threads, BM_rmsnorm, 2);
    add("swiglu_fwd/N1024_F3072", threads, BM_swiglu, false);
    add("swiglu_bwd/N1024_F3072", threads, BM_swiglu, true);
    add("rope_fwd/B4_T256_C768_NH12", threads, BM_rope, false);
    add("rope_bwd/B4_T256_C768_NH12", threads, BM_rope, true);
    add("add_inplace/N1024x768", threads, BM_residual);
    add("crossentropy_fwd_bwd/N1024_V50257_Vp50304", threads, BM_crossentropy);
    add("adamw/124M", threads, BM_adamw);
    add("sum_squares/124M", threads, BM_sum_squares);
    add("embedding_bwd/B4_T256_C768", threads, BM_embedding_backward);
  }
  using lattice::parallel::GradCodec;
  for (GradCodec codec : {GradCodec::None, GradCodec::BF16, GradCodec::F16, GradCodec::Int8, GradCodec::OneBit,
                          GradCodec::TopK})
    for (CodecCall call : {CodecCall::EncodeDecoded, CodecCall::Encode, CodecCall::Decode}) {
      std::string name = "grad_codec/";
      name += codec_call_name(call);
      name += "/";
      name += lattice::parallel::grad_codec_name(codec);
      name += "/4M";
      add(name, 1, BM_grad_codec, codec, call);
    }
}

}  // namespace

int main(int argc, char** argv) {
  register_gemm();
  register_others();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
