// Every kernel with a vectorised loop, run on every instruction-set level this
// machine has (core/cpu.h, kernels/cpu/simd.h) and compared with the baseline
// (SSE2) copy. The other kernel tests run on the best level (or the one
// LATTICE_ISA forces; CI runs them once more under LATTICE_ISA=avx2 and
// =baseline); this test makes sure every level computes the same thing, and
// says which levels this CPU could not run.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "lattice/core/cpu.h"
#include "lattice/core/error.h"
#include "lattice/kernels/cpu/gemm_internal.h"
#include "lattice/kernels/ops.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

using test::randn;

// A kernel run: fills `out` with everything the kernel wrote.
struct KernelCase {
  std::string name;
  std::function<void(std::vector<float>& out)> run;
};

void append(std::vector<float>& out, const std::vector<float>& v) { out.insert(out.end(), v.begin(), v.end()); }

std::vector<KernelCase> kernel_cases() {
  // Odd sizes so that every vector loop also runs its remainder.
  const int B = 2, T = 37, C = 48, NH = 4, V = 101, Vp = 128;
  const int64_t N = static_cast<int64_t>(B) * T;
  std::vector<KernelCase> cases;
  cases.push_back({"gelu", [=](std::vector<float>& out) {
                     auto x = randn(40000 + 13, 1, 3.0f), d = randn(x.size(), 2);
                     std::vector<float> y(x.size()), dx(x.size());
                     gelu_forward(y.data(), x.data(), static_cast<int64_t>(x.size()));
                     gelu_backward(dx.data(), x.data(), d.data(), static_cast<int64_t>(x.size()));
                     append(out, y);
                     append(out, dx);
                   }});
  cases.push_back({"add/scale/sum_squares", [=](std::vector<float>& out) {
                     auto a = randn(70001, 3), b = randn(70001, 4);
                     std::vector<float> c(a.size());
                     residual_forward(c.data(), a.data(), b.data(), static_cast<int64_t>(a.size()));
                     add_inplace(a.data(), b.data(), static_cast<int64_t>(a.size()));
                     scale_inplace(b.data(), 0.37f, static_cast<int64_t>(b.size()));
                     append(out, c);
                     append(out, a);
                     append(out, b);
                     out.push_back(static_cast<float>(sum_squares(c.data(), static_cast<int64_t>(c.size()))));
                   }});
  cases.push_back({"layernorm", [=](std::vector<float>& out) {
                     auto x = randn(N * C, 5, 2.0f, 1.0f), w = randn(C, 6), b = randn(C, 7), d = randn(N * C, 8);
                     std::vector<float> y(N * C), mean(N), rstd(N), dx(N * C, 0.0f), dw(C), db(C);
                     layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
                     layernorm_backward_input(dx.data(), d.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
                     layernorm_backward_weight(dw.data(), db.data(), d.data(), x.data(), mean.data(), rstd.data(), N,
                                               C, false);
                     for (const auto* v : {&y, &mean, &rstd, &dx, &dw, &db}) append(out, *v);
                   }});
  cases.push_back({"rmsnorm", [=](std::vector<float>& out) {
                     auto x = randn(N * C, 23, 2.0f, 1.0f), w = randn(C, 24), d = randn(N * C, 25);
                     std::vector<float> y(N * C), rstd(N), dx(N * C), dw(C);
                     rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
                     rmsnorm_backward_input(dx.data(), d.data(), x.data(), w.data(), rstd.data(), N, C, false);
                     rmsnorm_backward_weight(dw.data(), d.data(), x.data(), rstd.data(), N, C, false);
                     for (const auto* v : {&y, &rstd, &dx, &dw}) append(out, *v);
                   }});
  cases.push_back({"swiglu", [=](std::vector<float>& out) {
                     const int F = 2 * C + 5;
                     auto x = randn(N * 2 * F, 26, 4.0f), d = randn(N * F, 27);
                     std::vector<float> y(N * F), dx(N * 2 * F);
                     swiglu_forward(y.data(), x.data(), N, F);
                     swiglu_backward(dx.data(), d.data(), x.data(), N, F);
                     append(out, y);
                     append(out, dx);
                   }});
  cases.push_back({"rope", [=](std::vector<float>& out) {
                     const int hs = C / NH + 2;  // 14: a half of 7, the vector loops' remainders
                     const RopeTable table(hs, T + 3, 10000.0f);
                     auto qkv = randn(N * 3 * NH * hs, 28), d = qkv;
                     rope_forward(qkv.data(), 3 * NH * hs, table, B, T, 2 * NH, 3);
                     rope_backward(d.data(), 3 * NH * hs, table, B, T, 2 * NH, 3);
                     append(out, qkv);
                     append(out, d);
                   }});
  cases.push_back({"linear bias and column sums", [=](std::vector<float>& out) {
                     const int IC = 24, OC = 40;
                     auto x = randn(N * IC, 9), w = randn(OC * IC, 10), b = randn(OC, 11), d = randn(N * OC, 12);
                     std::vector<float> y(N * OC), dw(OC * IC), db(OC);
                     linear_forward(y.data(), x.data(), w.data(), b.data(), N, IC, OC);
                     linear_backward_weight(dw.data(), db.data(), d.data(), x.data(), N, IC, OC, false);
                     append(out, y);
                     append(out, dw);
                     append(out, db);
                   }});
  cases.push_back({"attention", [=](std::vector<float>& out) {
                     auto qkv = randn(N * 3 * C, 13), d = randn(N * C, 14);
                     std::vector<float> y(N * C), lse(B * NH * T), dqkv(N * 3 * C), dec(T * C);
                     attention_forward(y.data(), lse.data(), qkv.data(), B, T, C, NH);
                     attention_backward(dqkv.data(), d.data(), qkv.data(), y.data(), lse.data(), B, T, C, NH);
                     // The first sequence decoded in one call: keys/values straight from qkv.
                     attention_decode(dec.data(), qkv.data(), 3 * C, qkv.data() + C, qkv.data() + 2 * C, 3 * C, T, 0,
                                      C, NH);
                     for (const auto* v : {&y, &lse, &dqkv, &dec}) append(out, *v);
                   }});
  cases.push_back({"cross-entropy", [=](std::vector<float>& out) {
                     auto logits = randn(N * Vp, 15, 4.0f);
                     std::vector<int32_t> targets(N);
                     for (int64_t i = 0; i < N; i++) targets[i] = static_cast<int32_t>((i * 7) % V);
                     std::vector<float> losses(N), losses2(N);
                     crossentropy_forward(losses.data(), logits.data(), targets.data(), N, V, Vp);
                     crossentropy_forward_backward(logits.data(), losses2.data(), targets.data(), N, V, Vp, 0.5f);
                     append(out, losses);
                     append(out, losses2);
                     append(out, logits);
                   }});
  cases.push_back({"adamw", [=](std::vector<float>& out) {
                     auto p = randn(50001, 16), g = randn(p.size(), 17);
                     std::vector<float> m(p.size(), 0.0f), v(p.size(), 0.0f);
                     for (int step = 1; step <= 3; step++)
                       adamw_update(p.data(), g.data(), m.data(), v.data(), static_cast<int64_t>(p.size()), 1e-3f,
                                    0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f);
                     append(out, p);
                     append(out, m);
                     append(out, v);
                   }});
  cases.push_back({"adamw_momentum", [=](std::vector<float>& out) {
                     auto p = randn(50001, 21), mu = randn(p.size(), 22, 0.1f), v = randn(p.size(), 23, 0.1f);
                     for (auto& x : v) x = x * x;
                     std::vector<float> m(p.size(), 0.0f);
                     for (int step = 5; step <= 7; step++)
                       adamw_momentum_update(p.data(), mu.data(), m.data(), v.data(), static_cast<int64_t>(p.size()),
                                             1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 4);
                     append(out, p);
                     append(out, m);
                   }});
  cases.push_back({"embedding", [=](std::vector<float>& out) {
                     auto wte = randn(V * C, 18), wpe = randn(T * C, 19), d = randn(N * C, 20);
                     std::vector<int32_t> tokens(N);
                     for (int64_t i = 0; i < N; i++) tokens[i] = static_cast<int32_t>((i * 13) % V);
                     std::vector<float> y(N * C), dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
                     embedding_forward(y.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
                     embedding_backward(dwte.data(), dwpe.data(), d.data(), tokens.data(), B, T, C);
                     append(out, y);
                     append(out, dwte);
                     append(out, dwpe);
                   }});
  cases.push_back({"bf16 widening", [=](std::vector<float>& out) {
                     const int64_t M = 300, K = 70000 / 300 + 1, Nc = 5;  // widened whole, in parallel
                     auto a = randn(M * K, 21), b = randn(K * Nc, 22);
                     std::vector<uint16_t> a16(a.size()), b16(b.size());
                     convert(a.data(), DType::F32, a16.data(), DType::BF16, a.size());
                     convert(b.data(), DType::F32, b16.data(), DType::BF16, b.size());
                     std::vector<float> c(M * Nc);
                     cpu::gemm_bf16_via_sgemm(false, false, M, Nc, K, 1.0f, a16.data(), K, b16.data(), Nc, 0.0f,
                                              c.data(), Nc);
                     append(out, c);
                   }});
  return cases;
}

// Restores the level the process started with.
class IsaScope {
 public:
  IsaScope() : previous_(active_isa()) {}
  ~IsaScope() { set_active_isa_for_testing(previous_); }

 private:
  Isa previous_;
};

TEST(Isa, EveryLevelComputesTheSameAsBaseline) {
  IsaScope restore;
  test::ThreadScope threads(2);
  // Each level must also differ from baseline somewhere, bit for bit: its
  // wider vectors sum in another order and it fuses multiply-adds, so
  // identical results everywhere would mean the level's code never ran.
  std::vector<bool> differs(kIsaCount, false);
  for (const KernelCase& kc : kernel_cases()) {
    set_active_isa_for_testing(Isa::Baseline);
    std::vector<float> want_f;
    kc.run(want_f);
    const std::vector<double> want = test::to_double(want_f);
    for (Isa isa : runnable_isas()) {
      if (isa == Isa::Baseline) continue;
      set_active_isa_for_testing(isa);
      std::vector<float> got;
      kc.run(got);
      // Levels differ only where GCC fuses a·b + c into one FMA (not on
      // SSE2): a rounding or two per operation, amplified a little by the
      // exp and division chains (cross-entropy, attention).
      test::expect_close(got, want, 1e-5, 1e-4, kc.name + " on " + isa_name(isa) + " vs baseline");
      if (got.size() == want_f.size() && std::memcmp(got.data(), want_f.data(), got.size() * sizeof(float)) != 0)
        differs[static_cast<int>(isa)] = true;
    }
  }
  for (Isa isa : runnable_isas()) {
    if (isa == Isa::Baseline) continue;
    EXPECT_TRUE(differs[static_cast<int>(isa)])
        << isa_name(isa) << " computed every kernel bit-identically to baseline: its code did not run";
  }
  for (int i = kIsaCount - 1; i > static_cast<int>(detected_isa()); i--)
    std::printf("[   NOTE   ] this CPU (%s) cannot run %s: missing %zu feature(s); only its lower levels were "
                "compared\n",
                cpu_info().model.c_str(), isa_name(static_cast<Isa>(i)),
                cpu_info().missing_for(static_cast<Isa>(i)).size());
}

// A level above what the CPU has is refused, and the message says why.
TEST(Isa, LevelsAboveTheCpuAreRefused) {
  if (detected_isa() == Isa::Avx512) GTEST_SKIP() << "this CPU runs every level (AVX-512 available)";
  IsaScope restore;
  try {
    set_active_isa_for_testing(Isa::Avx512);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("can run"), std::string::npos) << e.what();
  }
}

TEST(Isa, ParseAndDescribe) {
  EXPECT_EQ(parse_isa("avx2", "LATTICE_ISA"), Isa::Avx2);
  EXPECT_EQ(parse_isa("baseline", "LATTICE_ISA"), Isa::Baseline);
  try {
    parse_isa("sse9", "LATTICE_ISA");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "LATTICE_ISA='sse9' is not an instruction set level (valid: avx512, avx2, baseline, auto)");
  }
  // A CPU with AVX2 but without AVX-512 lacks exactly the AVX-512 features.
  CpuInfo zen3;
  zen3.sse2 = zen3.avx = zen3.avx2 = zen3.fma = zen3.bmi1 = zen3.bmi2 = zen3.f16c = zen3.lzcnt = zen3.movbe = true;
  EXPECT_TRUE(zen3.missing_for(Isa::Avx2).empty());
  EXPECT_EQ(zen3.missing_for(Isa::Avx512),
            (std::vector<std::string>{"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}));
  // The detected level is one the CPU has every feature of.
  EXPECT_TRUE(cpu_info().missing_for(detected_isa()).empty());
  EXPECT_FALSE(cpu_info().model.empty());
}

}  // namespace
}  // namespace lattice::kernels
