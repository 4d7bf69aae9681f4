// kernels::gemm against a naive double-precision loop.
#include <limits>
#include <string>

#include "lattice/core/dtype.h"
#include "lattice/core/error.h"
#include "lattice/kernels/cpu/gemm_internal.h"
#include "lattice/kernels/ops.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

using test::randn;

struct GemmCase {
  bool ta, tb;
  int64_t M, N, K, lda, ldb, ldc;
  float alpha, beta;
};

// C[M,N] = alpha·op(A)·op(B) + beta·C in double; also returns, per element,
// |alpha|·Σ_k |op(A)_ik·op(B)_kj| + |beta·C_ij|, the scale of its rounding error.
void reference_gemm(const GemmCase& g, const std::vector<double>& A, const std::vector<double>& B,
                    std::vector<double>& C, std::vector<double>& magnitude) {
  magnitude.assign(C.size(), 0.0);
  for (int64_t i = 0; i < g.M; ++i)
    for (int64_t j = 0; j < g.N; ++j) {
      double acc = 0.0, mag = 0.0;
      for (int64_t k = 0; k < g.K; ++k) {
        const double a = g.ta ? A[k * g.lda + i] : A[i * g.lda + k];
        const double b = g.tb ? B[j * g.ldb + k] : B[k * g.ldb + j];
        acc += a * b;
        mag += std::fabs(a * b);
      }
      double& c = C[i * g.ldc + j];
      const double old = g.beta == 0.0f ? 0.0 : g.beta * c;
      magnitude[i * g.ldc + j] = std::fabs(g.alpha) * mag + std::fabs(old);
      c = g.alpha * acc + old;
    }
}

size_t a_size(const GemmCase& g) { return (g.ta ? g.K : g.M) * g.lda; }
size_t b_size(const GemmCase& g) { return (g.tb ? g.N : g.K) * g.ldb; }
size_t c_size(const GemmCase& g) { return g.M * g.ldc; }

// Checks C against the reference with a tolerance proportional to the error
// scale of each element, and that the padding between rows (ldc > N) is untouched.
void check_result(const GemmCase& g, const std::vector<float>& C, const std::vector<double>& want,
                  const std::vector<double>& magnitude, const std::vector<float>& C_before, double rel,
                  const std::string& what) {
  for (int64_t i = 0; i < g.M; ++i)
    for (int64_t j = 0; j < g.ldc; ++j) {
      const size_t idx = i * g.ldc + j;
      if (j >= g.N) {
        ASSERT_EQ(std::memcmp(&C[idx], &C_before[idx], 4), 0) << what << ": padding column " << j << " written";
        continue;
      }
      const double err = std::fabs(C[idx] - want[idx]);
      ASSERT_LE(err, rel * magnitude[idx] + 1e-30) << what << " at (" << i << "," << j << ")";
    }
}

// x rounded to bf16, and those bf16 values widened exactly, for the reference.
void to_bf16(const std::vector<float>& x, std::vector<uint16_t>& x16, std::vector<double>& widened) {
  x16.resize(x.size());
  convert(x.data(), DType::F32, x16.data(), DType::BF16, x.size());
  widened.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) widened[i] = bf16_to_f32(x16[i]);
}

std::string describe(const GemmCase& g) {
  std::ostringstream s;
  s << (g.ta ? "T" : "N") << (g.tb ? "T" : "N") << " M=" << g.M << " N=" << g.N << " K=" << g.K << " lda=" << g.lda
    << " ldb=" << g.ldb << " ldc=" << g.ldc << " alpha=" << g.alpha << " beta=" << g.beta;
  return s.str();
}

std::vector<GemmCase> cases() {
  std::vector<GemmCase> out;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, std::pair{0.7f, 0.3f}, std::pair{-1.5f, 1.0f}}) {
        GemmCase g{ta, tb, 37, 29, 53, 0, 0, 0, alpha, beta};
        g.lda = (ta ? g.M : g.K) + 3;  // non-trivial leading dimensions
        g.ldb = (tb ? g.K : g.N) + 5;
        g.ldc = g.N + 2;
        out.push_back(g);
      }
  return out;
}

TEST(Gemm, F32AllTransposesAlphaBetaLeadingDimensions) {
  uint64_t seed = 1;
  for (const GemmCase& g : cases()) {
    auto A = randn(a_size(g), seed++), B = randn(b_size(g), seed++), C = randn(c_size(g), seed++);
    const auto C_before = C;
    auto want = test::to_double(C);
    std::vector<double> mag;
    reference_gemm(g, test::to_double(A), test::to_double(B), want, mag);
    gemm(g.ta, g.tb, g.M, g.N, g.K, g.alpha, A.data(), g.lda, B.data(), g.ldb, g.beta, C.data(), g.ldc);
    // f32 accumulation over K=53 terms: a few ulps of the magnitude.
    check_result(g, C, want, mag, C_before, 1e-5, "f32 " + describe(g));
  }
}

TEST(Gemm, BetaZeroIgnoresNanInC) {
  GemmCase g{false, false, 8, 9, 10, 10, 9, 9, 1.0f, 0.0f};
  auto A = randn(a_size(g), 3), B = randn(b_size(g), 4);
  std::vector<float> C(c_size(g), std::numeric_limits<float>::quiet_NaN());
  auto want = std::vector<double>(C.size(), 0.0);
  std::vector<double> mag;
  reference_gemm(g, test::to_double(A), test::to_double(B), want, mag);
  gemm(g.ta, g.tb, g.M, g.N, g.K, g.alpha, A.data(), g.lda, B.data(), g.ldb, g.beta, C.data(), g.ldc);
  check_result(g, C, want, mag, C, 1e-5, "beta=0 over NaN");
  std::vector<float> C16(c_size(g), std::numeric_limits<float>::quiet_NaN());
  std::vector<uint16_t> A16(A.size()), B16(B.size());
  convert(A.data(), DType::F32, A16.data(), DType::BF16, A.size());
  convert(B.data(), DType::F32, B16.data(), DType::BF16, B.size());
  gemm(false, false, g.M, g.N, g.K, 1.0f, A16.data(), g.lda, B16.data(), g.ldb, 0.0f, C16.data(), g.ldc, DType::BF16);
  for (float c : C16) EXPECT_FALSE(std::isnan(c));
}

// Runs `bf16_gemm` (one of the bf16 paths) over every case against the
// double-precision product of the bf16-rounded inputs.
template <typename Bf16Gemm>
void expect_bf16_path_matches_double(const std::string& path, Bf16Gemm bf16_gemm) {
  uint64_t seed = 100;
  for (const GemmCase& g : cases()) {
    auto A = randn(a_size(g), seed++), B = randn(b_size(g), seed++), C0 = randn(c_size(g), seed++);
    std::vector<uint16_t> A16, B16;
    std::vector<double> Ar, Br;
    to_bf16(A, A16, Ar);
    to_bf16(B, B16, Br);
    auto want = test::to_double(C0);
    std::vector<double> mag;
    reference_gemm(g, Ar, Br, want, mag);
    auto C = C0;
    bf16_gemm(g, A16.data(), B16.data(), C.data());
    // Products of bf16 values are exact in f32; the sum is f32.
    check_result(g, C, want, mag, C0, 1e-5, path + " " + describe(g));
  }
}

// The portable bf16 path (widen to f32 + dnnl_sgemm): runs on every CPU.
TEST(Gemm, Bf16WidenPathMatchesRoundedInputsInDouble) {
  expect_bf16_path_matches_double("bf16 widen", [](const GemmCase& g, const uint16_t* A, const uint16_t* B, float* C) {
    cpu::gemm_bf16_via_sgemm(g.ta, g.tb, g.M, g.N, g.K, g.alpha, A, g.lda, B, g.ldb, g.beta, C, g.ldc);
  });
}

// oneDNN's bf16 matmul primitive: only where oneDNN has a kernel for this CPU.
TEST(Gemm, Bf16MatmulPrimitiveMatchesRoundedInputsInDouble) {
  if (!cpu::dnnl_bf16_matmul_available())
    GTEST_SKIP() << "oneDNN has no bf16 matmul kernel on this CPU (oneDNN ISA " << gemm_paths().dnnl_isa
                 << ", or LATTICE_DNNL_BF16=0); the widen path covers bf16 here";
  expect_bf16_path_matches_double("bf16 matmul", [](const GemmCase& g, const uint16_t* A, const uint16_t* B,
                                                    float* C) {
    cpu::gemm_dnnl_matmul(g.ta, g.tb, g.M, g.N, g.K, g.alpha, A, g.lda, B, g.ldb, g.beta, C, g.ldc, DType::BF16,
                          nullptr);
  });
}

// kernels::gemm serves bf16 through whichever path gemm_paths() chose, and
// never through one that does not exist here.
TEST(Gemm, Bf16GemmUsesAnAvailablePath) {
  const GemmPaths& p = gemm_paths();
  if (!p.bf16_primitive_available) {
    EXPECT_FALSE(p.bf16_uses_primitive()) << describe_gemm_paths();
  }
  const char* off = std::getenv("LATTICE_DNNL_BF16");
  if (off && std::string(off) == "0") {
    EXPECT_FALSE(p.bf16_uses_primitive()) << describe_gemm_paths();
  }
  expect_bf16_path_matches_double("bf16 " + std::string(p.bf16),
                                  [](const GemmCase& g, const uint16_t* A, const uint16_t* B, float* C) {
                                    gemm(g.ta, g.tb, g.M, g.N, g.K, g.alpha, A, g.lda, B, g.ldb, g.beta, C, g.ldc,
                                         DType::BF16);
                                  });
}

// Without the primitive, asking for it directly is one clear error.
TEST(Gemm, Bf16MatmulPrimitiveRefusedWhereAbsent) {
  if (cpu::dnnl_bf16_matmul_available()) GTEST_SKIP() << "oneDNN has a bf16 matmul kernel on this CPU";
  std::vector<uint16_t> A(4), B(4);
  std::vector<float> C(4);
  try {
    cpu::gemm_dnnl_matmul(false, false, 2, 2, 2, 1.0f, A.data(), 2, B.data(), 2, 0.0f, C.data(), 2, DType::BF16,
                          nullptr);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no bf16 matmul kernel for this CPU"), std::string::npos) << e.what();
  }
}

// The widen path on shapes beyond one widening block (N > 2048, K > 1024): blocks of C are
// written once each and the K blocks accumulate on top of beta·C.
TEST(Gemm, Bf16LargerThanOneBlock) {
  for (auto [ta, tb] : {std::pair{false, true}, std::pair{true, false}}) {
    GemmCase g{ta, tb, 3, 2100, 1100, 0, 0, 0, 0.5f, 0.25f};
    g.lda = (ta ? g.M : g.K) + 1, g.ldb = (tb ? g.K : g.N) + 1, g.ldc = g.N + 1;
    auto A = randn(a_size(g), 300), B = randn(b_size(g), 301), C = randn(c_size(g), 302);
    const auto C_before = C;
    std::vector<uint16_t> A16, B16;
    std::vector<double> Ar, Br;
    to_bf16(A, A16, Ar);
    to_bf16(B, B16, Br);
    auto want = test::to_double(C);
    std::vector<double> mag;
    reference_gemm(g, Ar, Br, want, mag);
    cpu::gemm_bf16_via_sgemm(g.ta, g.tb, g.M, g.N, g.K, g.alpha, A16.data(), g.lda, B16.data(), g.ldb, g.beta,
                             C.data(), g.ldc);
    check_result(g, C, want, mag, C_before, 2e-5, "bf16 blocked " + describe(g));
  }
}

TEST(Gemm, MatmulPrimitivePathWithBiasAndCache) {
  uint64_t seed = 200;
  for (const GemmCase& g : cases()) {
    auto A = randn(a_size(g), seed++), B = randn(b_size(g), seed++), C = randn(c_size(g), seed++);
    const auto C_before = C;
    auto want = test::to_double(C);
    std::vector<double> mag;
    reference_gemm(g, test::to_double(A), test::to_double(B), want, mag);
    for (int repeat = 0; repeat < 2; ++repeat) {  // second call runs the cached primitive
      C = C_before;
      cpu::gemm_dnnl_matmul(g.ta, g.tb, g.M, g.N, g.K, g.alpha, A.data(), g.lda, B.data(), g.ldb, g.beta, C.data(),
                            g.ldc, DType::F32, nullptr);
      check_result(g, C, want, mag, C_before, 1e-5, "matmul " + describe(g));
    }
  }
  // With a bias row (alpha = 1): C = A·B + beta·C + bias.
  GemmCase g{false, true, 20, 17, 33, 33, 33, 17, 1.0f, 0.0f};
  auto A = randn(a_size(g), 1), B = randn(b_size(g), 2), bias = randn(g.N, 3);
  std::vector<float> C(c_size(g));
  auto want = std::vector<double>(C.size(), 0.0);
  std::vector<double> mag;
  reference_gemm(g, test::to_double(A), test::to_double(B), want, mag);
  for (int64_t i = 0; i < g.M; ++i)
    for (int64_t j = 0; j < g.N; ++j) want[i * g.ldc + j] += bias[j], mag[i * g.ldc + j] += std::fabs(bias[j]);
  const int64_t cached = cpu::matmul_cache_size();
  for (int repeat = 0; repeat < 2; ++repeat) {
    cpu::gemm_dnnl_matmul(g.ta, g.tb, g.M, g.N, g.K, 1.0f, A.data(), g.lda, B.data(), g.ldb, 0.0f, C.data(), g.ldc,
                          DType::F32, bias.data());
    check_result(g, C, want, mag, C, 1e-5, "matmul with bias");
  }
  EXPECT_EQ(cpu::matmul_cache_size(), cached + 1);
}

TEST(Gemm, DegenerateSizes) {
  std::vector<float> A(16, 1.0f), B(16, 1.0f), C(16, 2.0f);
  gemm(false, false, 0, 4, 4, 1.0f, A.data(), 4, B.data(), 4, 0.0f, C.data(), 4);  // M = 0: nothing
  EXPECT_EQ(C[0], 2.0f);
  gemm(false, false, 4, 4, 0, 1.0f, A.data(), 1, B.data(), 4, 0.5f, C.data(), 4);  // K = 0: C = beta·C
  EXPECT_EQ(C[5], 1.0f);
  gemm(false, false, 4, 4, 0, 1.0f, A.data(), 1, B.data(), 4, 0.0f, C.data(), 4);
  EXPECT_EQ(C[5], 0.0f);
}

TEST(Gemm, RejectsLeadingDimensionsTooSmall) {
  std::vector<float> A(64), B(64), C(64);
  try {
    gemm(false, false, 4, 4, 8, 1.0f, A.data(), 4, B.data(), 4, 0.0f, C.data(), 4);
    FAIL() << "lda < K accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lda=4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(gemm(false, true, 4, 8, 4, 1.0f, A.data(), 4, B.data(), 2, 0.0f, C.data(), 8), Error);
  EXPECT_THROW(gemm(false, false, 4, 8, 4, 1.0f, A.data(), 4, B.data(), 8, 0.0f, C.data(), 4), Error);
  EXPECT_THROW(gemm(false, false, 4, 4, 4, 1.0f, A.data(), 4, B.data(), 4, 0.0f, C.data(), 4, DType::F16), Error);
}

// oneDNN may split K differently with more threads, so 1 vs 2 threads is only
// required to agree to f32 reassociation; whether it is bit-identical is
// recorded (docs/kernels.md) rather than asserted.
TEST(Gemm, ThreadCountChangesAtMostRounding) {
  for (auto [ta, tb] : {std::pair{false, true}, std::pair{false, false}, std::pair{true, false}}) {
    const int64_t M = 256, N = 192, K = 1024;
    GemmCase g{ta, tb, M, N, K, ta ? M : K, tb ? K : N, N, 1.0f, 0.0f};
    auto A = randn(a_size(g), 11), B = randn(b_size(g), 12);
    std::vector<float> C1(c_size(g)), C2(c_size(g));
    {
      test::ThreadScope one(1);
      gemm(ta, tb, M, N, K, 1.0f, A.data(), g.lda, B.data(), g.ldb, 0.0f, C1.data(), g.ldc);
    }
    {
      test::ThreadScope two(2);
      gemm(ta, tb, M, N, K, 1.0f, A.data(), g.lda, B.data(), g.ldb, 0.0f, C2.data(), g.ldc);
    }
    std::vector<double> want(C1.begin(), C1.end());
    test::expect_close(C2, want, 1e-4, 1e-5, "gemm 2 threads vs 1");
    RecordProperty(std::string("bitwise_equal_") + (ta ? "T" : "N") + (tb ? "T" : "N"),
                   test::bitwise_equal(C1, C2) ? "yes" : "no");
    std::printf("[gemm %s%s %ldx%ldx%ld] 1 vs 2 threads bitwise equal: %s\n", ta ? "T" : "N", tb ? "T" : "N",
                static_cast<long>(M), static_cast<long>(N), static_cast<long>(K),
                test::bitwise_equal(C1, C2) ? "yes" : "no");
  }
}

}  // namespace
}  // namespace lattice::kernels
