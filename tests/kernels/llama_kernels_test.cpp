// The Llama family's kernels: RMSNorm, SwiGLU and rotary position embedding.
// Each forward against a scalar double-precision reference, each backward
// against the double closed form and central finite differences of the
// double forward, parity with PyTorch (tests/kernels/fixtures/, made by
// tools/make_llama_kernel_fixture.py), bitwise independence of the thread
// count, and the errors a caller can provoke.
//
// Tolerances are stated against f32 rounding, u = 2⁻²⁴ ≈ 6e-8: a kernel
// result that goes through k roundings (and a C-term float sum) is off by a
// few u times the magnitudes involved; the test_util comparisons take
// atol + rtol·|want|. "[ MEASURED ]" lines print the largest errors seen, which
// docs/kernels.md quotes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "lattice/core/error.h"
#include "lattice/io/safetensors.h"
#include "lattice/kernels/ops.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

using test::randn;
using test::to_double;

// Prints the largest absolute and relative (to max(|want|, floor)) error.
void report(const std::string& what, const std::vector<float>& got, const std::vector<double>& want,
            double floor = 1e-3) {
  double max_abs = 0.0, max_rel = 0.0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    max_abs = std::max(max_abs, err);
    max_rel = std::max(max_rel, err / std::max(std::fabs(want[i]), floor));
  }
  std::printf("[ MEASURED ] %s: max abs %.3g, max rel %.3g\n", what.c_str(), max_abs, max_rel);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// ============================== RMSNorm ==============================

struct RmsReference {
  std::vector<double> out, rstd;
};

RmsReference rms_reference(const std::vector<double>& x, const std::vector<double>& w, int64_t N, int C,
                           double eps) {
  RmsReference r{std::vector<double>(N * C), std::vector<double>(N)};
  for (int64_t i = 0; i < N; ++i) {
    double sq = 0.0;
    for (int c = 0; c < C; ++c) sq += x[i * C + c] * x[i * C + c];
    const double s = 1.0 / std::sqrt(sq / C + eps);
    for (int c = 0; c < C; ++c) r.out[i * C + c] = x[i * C + c] * s * w[c];
    r.rstd[i] = s;
  }
  return r;
}

// dx_ij = rstd_i·(g_ij - x̂_ij·mean_c(g_i ⊙ x̂_i)), g = dout ⊙ w ; dw_c = Σ_i dout_ic·x̂_ic
void rms_backward_reference(const std::vector<double>& x, const std::vector<double>& w,
                            const std::vector<double>& dout, int64_t N, int C, double eps, std::vector<double>* dx,
                            std::vector<double>* dw) {
  const auto fwd = rms_reference(x, w, N, C, eps);
  dx->assign(N * C, 0.0);
  dw->assign(C, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    double mean_gx = 0.0;
    for (int c = 0; c < C; ++c) {
      const double xhat = x[i * C + c] * fwd.rstd[i];
      mean_gx += dout[i * C + c] * w[c] * xhat / C;
      (*dw)[c] += dout[i * C + c] * xhat;
    }
    for (int c = 0; c < C; ++c)
      (*dx)[i * C + c] = fwd.rstd[i] * (dout[i * C + c] * w[c] - x[i * C + c] * fwd.rstd[i] * mean_gx);
  }
}

TEST(RmsNorm, ForwardMatchesDoubleReference) {
  const int64_t N = 37;
  const int C = 100;  // not a multiple of any vector width: the remainder loops run too
  const float eps = 1e-5f;
  auto x = randn(N * C, 101, 2.0f, 0.5f), w = randn(C, 102, 0.3f, 1.0f);
  for (int c = 0; c < C; ++c) {
    x[0 * C + c] *= 1e4f;  // rstd ~ 1e-4
    x[1 * C + c] *= 1e-4f;  // mean(x²) ~ 1e-8 next to eps: eps matters
    x[2 * C + c] = 0.0f;    // rstd = 1/sqrt(eps), out = 0
  }
  std::vector<float> out(N * C), rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
  const auto ref = rms_reference(to_double(x), to_double(w), N, C, eps);
  report("rmsnorm rstd vs double", rstd, ref.rstd);
  report("rmsnorm out vs double", out, ref.out);
  // rstd: a 100-term float sum of squares (≤ 25 terms per lane, ~25u worst
  // case), halved by the square root; out: rstd's error and two products.
  test::expect_close(rstd, ref.rstd, 0.0, 1e-6, "rstd");
  test::expect_close(out, ref.out, 1e-7, 2e-6, "out");
  for (int c = 0; c < C; ++c) EXPECT_EQ(out[2 * C + c], 0.0f);
}

TEST(RmsNorm, BackwardMatchesFiniteDifferencesAndReference) {
  const int64_t N = 5;
  const int C = 24;
  const double eps = 1e-5;
  auto x = randn(N * C, 103, 1.5f, 0.3f), w = randn(C, 104, 0.5f, 1.0f), R = randn(N * C, 105);
  auto x_d = to_double(x), w_d = to_double(w), R_d = to_double(R);
  auto loss = [&] { return test::dot(R_d, rms_reference(x_d, w_d, N, C, eps).out); };
  // Central differences of the double forward: truncation h²/6·f''' ~ 1e-11,
  // cancellation ~1e-16/h ~ 1e-11, so 1e-7 separates a right closed form from a wrong one.
  const auto fd_x = test::finite_difference(x_d, loss, 1e-5);
  const auto fd_w = test::finite_difference(w_d, loss, 1e-5);
  std::vector<double> ref_x, ref_w;
  rms_backward_reference(x_d, w_d, R_d, N, C, eps, &ref_x, &ref_w);
  test::expect_close_d(ref_x, fd_x, 1e-7, 1e-6, "reference dx vs FD");
  test::expect_close_d(ref_w, fd_w, 1e-7, 1e-6, "reference dw vs FD");

  std::vector<float> out(N * C), rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, static_cast<float>(eps));
  // accumulate = false writes dx (NaN before must not survive).
  std::vector<float> dx(N * C, NAN), dw(C, 0.0f);
  rmsnorm_backward_input(dx.data(), R.data(), x.data(), w.data(), rstd.data(), N, C, /*accumulate=*/false);
  rmsnorm_backward_weight(dw.data(), R.data(), x.data(), rstd.data(), N, C);
  report("rmsnorm dx vs FD", dx, fd_x);
  report("rmsnorm dw vs FD", dw, fd_w);
  // f32: rstd (~1e-7 relative), a 24-term float sum for mean_gx, and a
  // difference g - x̂·mean_gx that may cancel: atol carries that part.
  test::expect_close(dx, fd_x, 1e-6, 1e-5, "dx vs FD");
  test::expect_close(dw, fd_w, 1e-6, 1e-5, "dw vs FD");
  test::expect_close(dx, ref_x, 1e-6, 1e-5, "dx vs reference");
  test::expect_close(dw, ref_w, 1e-6, 1e-5, "dw vs reference");

  // accumulate = true adds to what is there (the residual gradient).
  std::vector<float> dx_acc(N * C, 1.0f);
  rmsnorm_backward_input(dx_acc.data(), R.data(), x.data(), w.data(), rstd.data(), N, C, /*accumulate=*/true);
  for (auto& v : dx_acc) v -= 1.0f;
  test::expect_close(dx_acc, ref_x, 2e-6, 1e-5, "dx accumulated onto 1");

  // dweight accumulates by default...
  rmsnorm_backward_weight(dw.data(), R.data(), x.data(), rstd.data(), N, C);
  auto ref_w2 = ref_w;
  for (auto& v : ref_w2) v *= 2;
  test::expect_close(dw, ref_w2, 2e-6, 1e-5, "dw accumulated twice");
  // ...and accumulate = false overwrites without reading (NaN here).
  std::vector<float> dw2(C, NAN);
  rmsnorm_backward_weight(dw2.data(), R.data(), x.data(), rstd.data(), N, C, /*accumulate=*/false);
  test::expect_close(dw2, ref_w, 1e-6, 1e-5, "dw overwritten");
}

// Float only: central differences of Σ R ⊙ rmsnorm_forward(x) against the
// kernel's own backward. h = 1e-2: truncation ~h²·|f'''| ~ 1e-4, the loss's
// float rounding ~1e-6 / 2h ~ 5e-5; 1e-3 catches a wrong term (O(1e-1)).
TEST(RmsNorm, KernelBackwardMatchesKernelFiniteDifferences) {
  const int64_t N = 3;
  const int C = 16;
  auto x = randn(N * C, 106), w = randn(C, 107, 0.5f, 1.0f), R = randn(N * C, 108);
  std::vector<float> out(N * C), rstd(N), dx(N * C), dw(C, 0.0f);
  auto loss = [&] {
    rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
    double s = 0.0;
    for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(R[i]) * out[i];
    return s;
  };
  loss();
  rmsnorm_backward_input(dx.data(), R.data(), x.data(), w.data(), rstd.data(), N, C, false);
  rmsnorm_backward_weight(dw.data(), R.data(), x.data(), rstd.data(), N, C);
  test::expect_float_finite_differences(x, {0, 7, 20, 47}, loss, dx.data(), 1e-3, "dx");
  test::expect_float_finite_differences(w, {0, 5, 15}, loss, dw.data(), 1e-3, "dw");  // linear in w: no truncation
}

TEST(RmsNorm, ThreadCountIndependent) {
  const int64_t N = 257;
  const int C = 768;
  auto x = randn(N * C, 109), w = randn(C, 110), dy = randn(N * C, 111);
  std::vector<float> out[2], rstd[2], dx[2], dw[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    out[t].resize(N * C), rstd[t].resize(N), dx[t].resize(N * C), dw[t].assign(C, 0.0f);
    rmsnorm_forward(out[t].data(), rstd[t].data(), x.data(), w.data(), N, C, 1e-6f);
    rmsnorm_backward_input(dx[t].data(), dy.data(), x.data(), w.data(), rstd[t].data(), N, C, false);
    rmsnorm_backward_weight(dw[t].data(), dy.data(), x.data(), rstd[t].data(), N, C);
  }
  EXPECT_TRUE(test::bitwise_equal(out[0], out[1]));
  EXPECT_TRUE(test::bitwise_equal(rstd[0], rstd[1]));
  EXPECT_TRUE(test::bitwise_equal(dx[0], dx[1]));
  EXPECT_TRUE(test::bitwise_equal(dw[0], dw[1]));
}

TEST(RmsNorm, RefusesEpsThatIsNotPositive) {
  std::vector<float> x(8, 0.0f), w(8, 1.0f), out(8), rstd(1);
  EXPECT_EQ(error_of([&] { rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), 1, 8, 0.0f); }),
            "rmsnorm_forward: eps=0 must be a finite number > 0 (an all-zero row would give 0/0)");
}

// ============================== SwiGLU ==============================

// σ without overflow in double: the reference the kernel's identities are held to.
double sigmoid_d(double g) { return g >= 0 ? 1.0 / (1.0 + std::exp(-g)) : std::exp(g) / (1.0 + std::exp(g)); }

// [N, 2F] = gate | up -> [N, F]
std::vector<double> swiglu_reference(const std::vector<double>& inp, int64_t N, int F) {
  std::vector<double> out(N * F);
  for (int64_t n = 0; n < N; ++n)
    for (int f = 0; f < F; ++f) {
      const double g = inp[n * 2 * F + f], u = inp[n * 2 * F + F + f];
      out[n * F + f] = g * sigmoid_d(g) * u;
    }
  return out;
}

std::vector<double> swiglu_backward_reference(const std::vector<double>& inp, const std::vector<double>& dout,
                                              int64_t N, int F) {
  std::vector<double> d(N * 2 * F);
  for (int64_t n = 0; n < N; ++n)
    for (int f = 0; f < F; ++f) {
      const double g = inp[n * 2 * F + f], u = inp[n * 2 * F + F + f], s = sigmoid_d(g);
      d[n * 2 * F + f] = dout[n * F + f] * u * s * (1.0 + g * sigmoid_d(-g));
      d[n * 2 * F + F + f] = dout[n * F + f] * g * s;
    }
  return d;
}

TEST(SwiGlu, ForwardMatchesDoubleReference) {
  const int64_t N = 6;
  const int F = 45;
  auto inp = randn(N * 2 * F, 201, 3.0f);
  // The first row's gates sweep the range where σ saturates or e^{-|g|} underflows.
  const float gates[] = {-1e4f, -100.0f, -88.0f, -87.0f, -60.0f, -30.0f, -15.0f, -5.0f, -1e-3f, 0.0f,
                         1e-3f, 5.0f,    15.0f,  30.0f,  60.0f,  88.0f,  100.0f, 1e4f};
  for (size_t i = 0; i < sizeof(gates) / sizeof(gates[0]); ++i) inp[i] = gates[i];
  std::vector<float> out(N * F);
  swiglu_forward(out.data(), inp.data(), N, F);
  const auto ref = swiglu_reference(to_double(inp), N, F);
  report("swiglu out vs double", out, ref, 1e-20);
  // exp_approx (≤ 2u), one division, two products: 1e-6 relative. Where
  // e^{-|g|} underflows (g < -87.3) the kernel gives 0 for a true value
  // below 1e-36: the absolute floor.
  test::expect_close(out, ref, 1e-35, 1e-6, "out");
}

TEST(SwiGlu, BackwardMatchesFiniteDifferencesAndReference) {
  const int64_t N = 3;
  const int F = 11;
  auto inp = randn(N * 2 * F, 202, 2.5f), R = randn(N * F, 203);
  inp[0] = 12.0f, inp[1] = -12.0f, inp[2] = 0.0f;  // gates where σ(1 - σ) is small, and zero
  auto inp_d = to_double(inp), R_d = to_double(R);
  auto loss = [&] { return test::dot(R_d, swiglu_reference(inp_d, N, F)); };
  const auto fd = test::finite_difference(inp_d, loss, 1e-5);
  const auto ref = swiglu_backward_reference(inp_d, R_d, N, F);
  test::expect_close_d(ref, fd, 1e-8, 1e-6, "reference d(gate|up) vs FD");

  std::vector<float> dinp(N * 2 * F, NAN);  // written, not accumulated
  swiglu_backward(dinp.data(), R.data(), inp.data(), N, F);
  report("swiglu dinp vs FD", dinp, fd);
  report("swiglu dinp vs double", dinp, ref);
  // exp (2u), a division, the 1 + g·(1 - σ) sum and three products.
  test::expect_close(dinp, fd, 1e-7, 2e-6, "d(gate|up) vs FD");
  test::expect_close(dinp, ref, 1e-7, 2e-6, "d(gate|up) vs reference");
}

TEST(SwiGlu, KernelBackwardMatchesKernelFiniteDifferences) {
  const int64_t N = 2;
  const int F = 9;
  auto inp = randn(N * 2 * F, 204, 2.0f), R = randn(N * F, 205);
  std::vector<float> out(N * F), dinp(N * 2 * F);
  auto loss = [&] {
    swiglu_forward(out.data(), inp.data(), N, F);
    double s = 0.0;
    for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(R[i]) * out[i];
    return s;
  };
  swiglu_backward(dinp.data(), R.data(), inp.data(), N, F);
  test::expect_float_finite_differences(inp, {0, 4, 8, 9, 13, 17, 20, 30}, loss, dinp.data(), 1e-3, "dinp");
}

// No NaN or inf anywhere for huge finite gates; the limits are silu → g
// (g → +∞) or 0 (g → -∞), silu' → 1 or 0.
TEST(SwiGlu, HugeGatesStayFiniteAtTheirLimits) {
  const std::vector<float> gates = {-3e38f, -1e30f, -1e4f, -200.0f, -88.8f, 88.8f, 200.0f, 1e4f, 1e30f, 3e38f};
  const int F = static_cast<int>(gates.size());
  std::vector<float> inp(2 * F), out(F), dout(F, 1.0f), dinp(2 * F);
  for (int f = 0; f < F; ++f) inp[f] = gates[f], inp[F + f] = 0.5f;
  swiglu_forward(out.data(), inp.data(), 1, F);
  swiglu_backward(dinp.data(), dout.data(), inp.data(), 1, F);
  for (int f = 0; f < F; ++f) {
    const float g = gates[f];
    SCOPED_TRACE("g = " + std::to_string(g));
    ASSERT_TRUE(std::isfinite(out[f]) && std::isfinite(dinp[f]) && std::isfinite(dinp[F + f]));
    EXPECT_EQ(out[f], g > 0 ? g * 0.5f : 0.0f);       // silu(g)·u
    EXPECT_EQ(dinp[f], g > 0 ? 0.5f : 0.0f);          // u·silu'(g)
    EXPECT_EQ(dinp[F + f], g > 0 ? g : 0.0f);         // silu(g)
  }
}

TEST(SwiGlu, ThreadCountIndependent) {
  const int64_t N = 64;
  const int F = 1001;  // N·F above the serial threshold, so two threads split the rows
  auto inp = randn(N * 2 * F, 206, 4.0f), dy = randn(N * F, 207);
  std::vector<float> out[2], dinp[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    out[t].resize(N * F), dinp[t].resize(N * 2 * F);
    swiglu_forward(out[t].data(), inp.data(), N, F);
    swiglu_backward(dinp[t].data(), dy.data(), inp.data(), N, F);
  }
  EXPECT_TRUE(test::bitwise_equal(out[0], out[1]));
  EXPECT_TRUE(test::bitwise_equal(dinp[0], dinp[1]));
}

// ============================== RoPE ==============================

// Rotates n_heads heads of each row in double with the table's (float) cos/sin.
std::vector<double> rope_reference(const std::vector<double>& x, int64_t ld, const RopeTable& table, int B, int T,
                                   int n_heads, int first_position, bool inverse) {
  std::vector<double> y = x;
  const int hs = table.head_size(), half = hs / 2;
  for (int64_t r = 0; r < static_cast<int64_t>(B) * T; ++r) {
    const int p = first_position + static_cast<int>(r % T);
    for (int h = 0; h < n_heads; ++h)
      for (int i = 0; i < half; ++i) {
        const int64_t i1 = r * ld + h * hs + i, i2 = i1 + half;
        const double c = table.cos_row(p)[i], s = (inverse ? -1.0 : 1.0) * table.sin_row(p)[i];
        y[i1] = x[i1] * c - x[i2] * s;
        y[i2] = x[i2] * c + x[i1] * s;
      }
  }
  return y;
}

// inv_freq against 1/theta^(2i/hs) in double; cos/sin against the exact
// angle p·inv_freq (double) within the f32 angle's rounding, p·inv·2⁻²⁴, plus
// the rounding of cos/sin themselves.
TEST(Rope, TableMatchesTheFormula) {
  for (const auto& [hs, positions, theta] :
       std::vector<std::tuple<int, int, float>>{
           {16, 40, 10000.0f}, {64, 1024, 10000.0f}, {96, 2048, 10000.0f}, {128, 8192, 500000.0f}}) {
    SCOPED_TRACE("hs " + std::to_string(hs) + " theta " + std::to_string(theta));
    const RopeTable table(hs, positions, theta);
    EXPECT_EQ(table.head_size(), hs);
    EXPECT_EQ(table.max_positions(), positions);
    double worst_inv = 0.0, worst_cs = 0.0;
    const double u = std::ldexp(1.0, -24);
    std::vector<double> inv_tol(hs / 2);
    for (int i = 0; i < hs / 2; ++i) {
      const double e = 2.0 * i / hs, want = 1.0 / std::pow(static_cast<double>(theta), e);
      // f32 roundings: the exponent 2i/hs (relative u, which θ^e turns into
      // e·ln θ·u), the power (u) and the reciprocal (u); 1.5x for the
      // double-to-float double rounding of the power.
      inv_tol[i] = 1.5 * (2.0 + e * std::log(static_cast<double>(theta))) * u;
      EXPECT_NEAR(table.inv_freq()[i], want, inv_tol[i] * want) << "inv_freq " << i;
      worst_inv = std::max(worst_inv, std::fabs(table.inv_freq()[i] - want) / want);
    }
    for (int p = 0; p < positions; p += (p < 64 ? 1 : 37)) {
      for (int i = 0; i < hs / 2; ++i) {
        const double angle = p / std::pow(static_cast<double>(theta), 2.0 * i / hs);
        // The f32 angle p·inv_freq: inv_freq's error and the product's rounding
        // (u relative); then cos/sin rounded to f32 (≤ u).
        const double tol = angle * (inv_tol[i] + u) + 2 * u;
        EXPECT_NEAR(table.cos_row(p)[i], std::cos(angle), tol) << "cos p=" << p << " i=" << i;
        EXPECT_NEAR(table.sin_row(p)[i], std::sin(angle), tol) << "sin p=" << p << " i=" << i;
        worst_cs = std::max({worst_cs, std::fabs(table.cos_row(p)[i] - std::cos(angle)),
                             std::fabs(table.sin_row(p)[i] - std::sin(angle))});
      }
    }
    std::printf("[ MEASURED ] rope table hs=%d P=%d theta=%g: inv_freq max rel %.3g, cos/sin vs exact angle max abs "
                "%.3g\n",
                hs, positions, theta, worst_inv, worst_cs);
  }
}

TEST(Rope, ForwardRotatesQAndKOfQkvInPlace) {
  // attention's qkv [B, T, 3C]: Q and K are the first 2C columns of a row,
  // so one call with 2·NH heads rotates both and leaves V alone.
  const int B = 2, T = 9, NH = 3, hs = 18, C = NH * hs, first = 4;
  const RopeTable table(hs, 16, 10000.0f);
  auto qkv = randn(static_cast<size_t>(B) * T * 3 * C, 301);
  const auto before = qkv;
  rope_forward(qkv.data(), 3 * C, table, B, T, 2 * NH, first);
  const auto ref = rope_reference(to_double(before), 3 * C, table, B, T, 2 * NH, first, false);
  report("rope forward vs double", qkv, ref);
  // Two products and a sum (or one FMA) per element: ≤ 1.5u of the larger product.
  test::expect_close(qkv, ref, 2e-7, 2e-7, "rotated qkv");
  for (int64_t r = 0; r < B * T; ++r)
    for (int c = 2 * C; c < 3 * C; ++c) ASSERT_EQ(qkv[r * 3 * C + c], before[r * 3 * C + c]) << "V changed";
  // Position first_position (angle 0 only at p = 0): p = 4 is a real turn, and
  // the norm of every pair is kept.
  for (int64_t r = 0; r < B * T; ++r)
    for (int i = 0; i < hs / 2; ++i) {
      const double n0 = std::hypot(before[r * 3 * C + i], before[r * 3 * C + hs / 2 + i]);
      const double n1 = std::hypot(qkv[r * 3 * C + i], qkv[r * 3 * C + hs / 2 + i]);
      EXPECT_NEAR(n1, n0, 1e-6 * (1 + n0));
    }
}

TEST(Rope, BackwardMatchesFiniteDifferencesAndIsTheInverse) {
  const int B = 2, T = 5, heads = 3, hs = 8, ld = heads * hs + 5, first = 2;  // ld > heads·hs: a strided layout
  const RopeTable table(hs, 8, 10000.0f);
  auto x = randn(static_cast<size_t>(B) * T * ld, 302), R = randn(x.size(), 303);
  auto x_d = to_double(x), R_d = to_double(R);
  // FD of Σ R ⊙ rope(x) in double: rope is linear, so the central difference
  // is exact up to the double rounding (~1e-10 at h = 1e-5).
  auto loss = [&] { return test::dot(R_d, rope_reference(x_d, ld, table, B, T, heads, first, false)); };
  const auto fd = test::finite_difference(x_d, loss, 1e-5);
  auto dx = R;  // the columns past the heads are left as they are: their gradient passes through
  rope_backward(dx.data(), ld, table, B, T, heads, first);
  report("rope backward vs FD", dx, fd);
  test::expect_close(dx, fd, 2e-7, 2e-7, "dx vs FD");
  const auto ref = rope_reference(R_d, ld, table, B, T, heads, first, true);
  test::expect_close(dx, ref, 2e-7, 2e-7, "dx vs double transpose");
  // Backward after forward gives x back (cos² + sin² = 1 in float to ~u).
  auto y = x;
  rope_forward(y.data(), ld, table, B, T, heads, first);
  rope_backward(y.data(), ld, table, B, T, heads, first);
  test::expect_close(y, x_d, 5e-7, 5e-7, "backward(forward(x))");
}

// Decoding rotates one new row at a time at its own position: the same
// numbers as the whole sequence at once, bit for bit.
TEST(Rope, RowByRowEqualsWholeSequence) {
  const int T = 11, heads = 4, hs = 32, ld = heads * hs;
  const RopeTable table(hs, 32, 500000.0f);
  auto whole = randn(static_cast<size_t>(T) * ld, 304);
  auto rows = whole;
  rope_forward(whole.data(), ld, table, 1, T, heads, 7);
  for (int t = 0; t < T; ++t) rope_forward(rows.data() + t * ld, ld, table, 1, 1, heads, 7 + t);
  EXPECT_TRUE(test::bitwise_equal(whole, rows));
}

TEST(Rope, ThreadCountIndependent) {
  const int B = 2, T = 64, heads = 24, hs = 64, ld = 3 * 12 * hs;
  const RopeTable table(hs, 128, 10000.0f);
  const auto x = randn(static_cast<size_t>(B) * T * ld, 305);
  std::vector<float> y[2], dx[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    y[t] = x, dx[t] = x;
    rope_forward(y[t].data(), ld, table, B, T, heads, 3);
    rope_backward(dx[t].data(), ld, table, B, T, heads, 3);
  }
  EXPECT_TRUE(test::bitwise_equal(y[0], y[1]));
  EXPECT_TRUE(test::bitwise_equal(dx[0], dx[1]));
}

TEST(Rope, RefusesOddHeadSizeAndPositionsOutsideTheTable) {
  EXPECT_EQ(error_of([] { RopeTable(7, 16, 10000.0f); }),
            "rope: head_size=7 is odd; rotary position embedding turns element i with element i + head_size/2 "
            "(rotate_half), so the head size must be even");
  EXPECT_EQ(error_of([] { RopeTable(8, 16, 0.0f); }), "rope: theta=0 must be a finite number > 0");
  EXPECT_EQ(error_of([] { RopeTable(8, 0, 10000.0f); }), "rope: max_positions=0 must be in 1..16777216");
  const RopeTable table(8, 16, 10000.0f);
  std::vector<float> x(static_cast<size_t>(2) * 8 * 16);
  EXPECT_EQ(error_of([&] { rope_forward(x.data(), 16, table, 2, 8, 2, 9); }),
            "rope_forward: positions 9..16 are outside the table's 0..15 (build the RopeTable for the longest "
            "sequence)");
  EXPECT_EQ(error_of([&] { rope_backward(x.data(), 12, table, 2, 8, 2, 0); }),
            "rope_backward: row length ld=12 is shorter than n_heads=2 heads of head_size=8");
  EXPECT_EQ(error_of([&] { rope_forward(x.data(), 16, RopeTable(), 2, 8, 2, 0); }),
            "rope_forward: the RopeTable is empty (default-constructed or moved from)");
  EXPECT_EQ(error_of([&] { rope_forward(x.data(), 16, table, 2, 8, 2, 8); }), "(no error)");  // positions 8..15
  RopeTable moved(8, 16, 10000.0f), into = std::move(moved);
  EXPECT_EQ(into.head_size(), 8);
  EXPECT_EQ(error_of([&] { rope_forward(x.data(), 16, moved, 2, 8, 2, 0); }),  // moved from on purpose
            "rope_forward: the RopeTable is empty (default-constructed or moved from)");
}

// ============================== PyTorch parity ==============================
// tools/make_llama_kernel_fixture.py: HF's LlamaRMSNorm, SiLU·up and
// LlamaRotaryEmbedding + apply_rotary_pos_emb, f32, backward by autograd.

class LlamaParity : public ::testing::Test {
 protected:
  static inline const std::string kPath =
      std::string(LATTICE_SOURCE_DIR) + "/tests/kernels/fixtures/llama_kernels.safetensors";
  io::SafeTensorsReader reader{kPath};

  std::vector<float> load(const std::string& name) const {
    std::vector<float> v(reader.get(name).numel());
    reader.read_f32(name, v.data(), v.size());
    return v;
  }
  std::vector<double> load_d(const std::string& name) const { return to_double(load(name)); }
  int meta_int(const std::string& key) const { return std::stoi(reader.metadata().at(key)); }
  float meta_float(const std::string& key) const { return std::stof(reader.metadata().at(key)); }
};

TEST_F(LlamaParity, RmsNormMatchesPyTorch) {
  const auto& shape = reader.get("rmsnorm.x").shape;
  const int64_t N = shape[0];
  const int C = static_cast<int>(shape[1]);
  const auto x = load("rmsnorm.x"), w = load("rmsnorm.weight"), dy = load("rmsnorm.dout");
  std::vector<float> out(N * C), rstd(N), dx(N * C), dw(C, 0.0f);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, meta_float("rmsnorm.eps"));
  rmsnorm_backward_input(dx.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C, false);
  rmsnorm_backward_weight(dw.data(), dy.data(), x.data(), rstd.data(), N, C);
  report("rmsnorm out vs torch", out, load_d("rmsnorm.out"));
  report("rmsnorm rstd vs torch", rstd, load_d("rmsnorm.rstd"), 1e-30);
  // dx row by row, relative to the row's largest |dx|: row 0 is x·1e3 (its dx
  // ~1e-3), row 1 x·1e-3 (dx ~1e3), and inside a row g - x̂·mean(g x̂) may
  // cancel to far below the row's scale.
  const auto want_dx = load_d("rmsnorm.dx");
  double worst_dx = 0.0;
  for (int64_t i = 0; i < N; ++i) {
    double scale = 0.0;
    for (int c = 0; c < C; ++c) scale = std::max(scale, std::fabs(want_dx[i * C + c]));
    test::expect_close(dx.data() + i * C, want_dx.data() + i * C, C, 2e-6 * scale, 0.0, "dx row " + std::to_string(i));
    for (int c = 0; c < C; ++c) worst_dx = std::max(worst_dx, std::fabs(dx[i * C + c] - want_dx[i * C + c]) / scale);
  }
  std::printf("[ MEASURED ] rmsnorm dx vs torch: max abs error / the row's max |dx| %.3g\n", worst_dx);
  report("rmsnorm dweight vs torch", dw, load_d("rmsnorm.dweight"));
  // Both sides are f32 with sums in another order: a few u relative.
  test::expect_close(out, load_d("rmsnorm.out"), 1e-6, 2e-6, "out");
  test::expect_close(rstd, load_d("rmsnorm.rstd"), 0.0, 1e-6, "rstd");
  test::expect_close(dw, load_d("rmsnorm.dweight"), 1e-6, 1e-5, "dweight");
}

TEST_F(LlamaParity, SwiGluMatchesPyTorch) {
  const int F = meta_int("swiglu.F");
  const int64_t N = reader.get("swiglu.inp").shape[0];
  ASSERT_EQ(reader.get("swiglu.inp").shape[1], 2 * F);
  const auto inp = load("swiglu.inp"), dy = load("swiglu.dout");
  std::vector<float> out(N * F), dinp(N * 2 * F);
  swiglu_forward(out.data(), inp.data(), N, F);
  swiglu_backward(dinp.data(), dy.data(), inp.data(), N, F);
  report("swiglu out vs torch", out, load_d("swiglu.out"));
  report("swiglu dinp vs torch", dinp, load_d("swiglu.dinp"));
  // PyTorch's expf and ours differ by an ulp or two; torch forms 1 - σ by a
  // subtraction, which only the absolute part of the tolerance has to cover
  // (its error is multiplied by g·σ·u·dout ≲ 1e-6 for the |g| ≤ 8 here).
  test::expect_close(out, load_d("swiglu.out"), 1e-6, 2e-6, "out");
  test::expect_close(dinp, load_d("swiglu.dinp"), 2e-6, 2e-6, "d(gate|up)");
}

TEST_F(LlamaParity, RopeMatchesPyTorch) {
  const int B = meta_int("rope.B"), T = meta_int("rope.T"), NH = meta_int("rope.NH"), NKV = meta_int("rope.NKV"),
            hs = meta_int("rope.head_size"), first = meta_int("rope.first_position");
  const RopeTable table(hs, meta_int("rope.max_positions"), meta_float("rope.theta"));
  // The table: inv_freq bit for bit, cos/sin (HF duplicates them over the two halves).
  const auto inv_freq = load("rope.inv_freq");
  for (int i = 0; i < hs / 2; ++i) EXPECT_EQ(table.inv_freq()[i], inv_freq[i]) << "inv_freq " << i;
  const auto cos_t = load("rope.cos"), sin_t = load("rope.sin");
  std::vector<float> cos_l, sin_l;
  std::vector<double> cos_w, sin_w;
  for (int p = 0; p < table.max_positions(); ++p)
    for (int i = 0; i < hs; ++i) {
      cos_l.push_back(table.cos_row(p)[i % (hs / 2)]), sin_l.push_back(table.sin_row(p)[i % (hs / 2)]);
      cos_w.push_back(cos_t[p * hs + i]), sin_w.push_back(sin_t[p * hs + i]);
    }
  report("rope cos vs torch", cos_l, cos_w);
  report("rope sin vs torch", sin_l, sin_w);
  test::expect_close(cos_l, cos_w, 1.2e-7, 0.0, "cos");  // both round cos of the same f32 angle: ≤ 1-2 ulp
  test::expect_close(sin_l, sin_w, 1.2e-7, 0.0, "sin");

  // A fused row [Q (NH heads) | K (NKV heads) | V (NKV heads)] (grouped-query
  // layout): Q and K are contiguous, so one call rotates both.
  const int ld = (NH + 2 * NKV) * hs;
  const auto q = load("rope.q"), k = load("rope.k"), dq_out = load("rope.dq_out"), dk_out = load("rope.dk_out");
  auto fuse = [&](const std::vector<float>& qs, const std::vector<float>& ks, float v) {
    std::vector<float> row(static_cast<size_t>(B) * T * ld, v);
    for (int64_t r = 0; r < B * T; ++r) {
      std::copy_n(qs.begin() + r * NH * hs, NH * hs, row.begin() + r * ld);
      std::copy_n(ks.begin() + r * NKV * hs, NKV * hs, row.begin() + r * ld + NH * hs);
    }
    return row;
  };
  auto split = [&](const std::vector<float>& row, std::vector<float>* qs, std::vector<float>* ks) {
    for (int64_t r = 0; r < B * T; ++r) {
      qs->insert(qs->end(), row.begin() + r * ld, row.begin() + r * ld + NH * hs);
      ks->insert(ks->end(), row.begin() + r * ld + NH * hs, row.begin() + r * ld + (NH + NKV) * hs);
    }
  };
  auto fused = fuse(q, k, 7.0f);
  rope_forward(fused.data(), ld, table, B, T, NH + NKV, first);
  std::vector<float> q_out, k_out;
  split(fused, &q_out, &k_out);
  for (int64_t r = 0; r < B * T; ++r)
    for (int c = (NH + NKV) * hs; c < ld; ++c) ASSERT_EQ(fused[r * ld + c], 7.0f) << "V changed";
  auto grad = fuse(dq_out, dk_out, 7.0f);
  rope_backward(grad.data(), ld, table, B, T, NH + NKV, first);
  std::vector<float> dq, dk;
  split(grad, &dq, &dk);
  report("rope q_out vs torch", q_out, load_d("rope.q_out"));
  report("rope k_out vs torch", k_out, load_d("rope.k_out"));
  report("rope dq vs torch", dq, load_d("rope.dq"));
  report("rope dk vs torch", dk, load_d("rope.dk"));
  // torch rounds q·cos, rotate_half(q)·sin and their sum; the kernel may fuse
  // one product into the sum: ≤ ~2u of the products (|x| ≲ 4 here).
  test::expect_close(q_out, load_d("rope.q_out"), 1e-6, 0.0, "q_out");
  test::expect_close(k_out, load_d("rope.k_out"), 1e-6, 0.0, "k_out");
  test::expect_close(dq, load_d("rope.dq"), 1e-6, 0.0, "dq");
  test::expect_close(dk, load_d("rope.dk"), 1e-6, 0.0, "dk");
}

// A Llama 3 sized table (hs = 128, theta = 500000) at positions up to 8191:
// there the f32 angle p·inv_freq is off the exact one by up to ~2.4e-4 rad,
// so matching PyTorch to an ulp shows the kernel computes the angle as HF does.
TEST_F(LlamaParity, RopeTableMatchesPyTorchAtLargePositions) {
  const int hs = meta_int("rope_table.head_size");
  const auto positions = load("rope_table.positions");
  const RopeTable table(hs, static_cast<int>(positions.back()) + 1, meta_float("rope_table.theta"));
  const auto inv_freq = load("rope_table.inv_freq");
  int inv_freq_differ = 0;
  for (int i = 0; i < hs / 2; ++i) inv_freq_differ += table.inv_freq()[i] != inv_freq[i];
  EXPECT_EQ(inv_freq_differ, 0) << "inv_freq values that differ from torch's";
  const auto cos_t = load("rope_table.cos"), sin_t = load("rope_table.sin");
  std::vector<float> got;
  std::vector<double> want, exact;
  for (size_t k = 0; k < positions.size(); ++k) {
    const int p = static_cast<int>(positions[k]);
    for (int i = 0; i < hs; ++i) {
      got.push_back(table.cos_row(p)[i % (hs / 2)]);
      want.push_back(cos_t[k * hs + i]);
      exact.push_back(std::cos(p / std::pow(static_cast<double>(meta_float("rope_table.theta")),
                                            2.0 * (i % (hs / 2)) / hs)));
      got.push_back(table.sin_row(p)[i % (hs / 2)]);
      want.push_back(sin_t[k * hs + i]);
      exact.push_back(std::sin(p / std::pow(static_cast<double>(meta_float("rope_table.theta")),
                                            2.0 * (i % (hs / 2)) / hs)));
    }
  }
  report("rope table (hs 128, theta 5e5, p <= 8191) vs torch", got, want);
  report("rope table (hs 128, theta 5e5, p <= 8191) vs exact angles", got, exact);
  test::expect_close(got, want, 1.2e-7, 0.0, "cos/sin at large positions");
}

}  // namespace
}  // namespace lattice::kernels
