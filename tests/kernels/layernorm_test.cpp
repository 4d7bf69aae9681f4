// LayerNorm: forward vs double two-pass reference (incl. rows with a large
// mean, and a non-default eps), backward vs the double closed form and
// central finite differences.
#include <sstream>
#include <string>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

using test::randn;
using test::to_double;

struct LnReference {
  std::vector<double> out, mean, rstd;
};

LnReference reference_forward(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& b,
                              int64_t N, int C, double eps = 1e-5) {
  LnReference r{std::vector<double>(N * C), std::vector<double>(N), std::vector<double>(N)};
  for (int64_t i = 0; i < N; ++i) {
    double m = 0.0;
    for (int c = 0; c < C; ++c) m += x[i * C + c];
    m /= C;
    double v = 0.0;
    for (int c = 0; c < C; ++c) v += (x[i * C + c] - m) * (x[i * C + c] - m);
    v /= C;
    const double s = 1.0 / std::sqrt(v + eps);
    for (int c = 0; c < C; ++c) r.out[i * C + c] = (x[i * C + c] - m) * s * w[c] + b[c];
    r.mean[i] = m;
    r.rstd[i] = s;
  }
  return r;
}

TEST(LayerNorm, ForwardMatchesReference) {
  const int64_t N = 37;
  const int C = 96;
  auto x = randn(N * C, 1, 2.0f), w = randn(C, 2), b = randn(C, 3);
  // Rows 0..3 sit far from zero (mean 1000, std 0.1): E[x²]-E[x]² would lose
  // all digits there, the two-pass variance does not.
  for (int64_t i = 0; i < 4 * C; ++i) x[i] = 1000.0f + 0.1f * x[i];
  std::vector<float> out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  const auto ref = reference_forward(to_double(x), to_double(w), to_double(b), N, C);
  test::expect_close(mean, ref.mean, 1e-5, 1e-6, "mean");
  // Thanks to the shifted sums the far-from-zero rows are as accurate as the others.
  test::expect_close(rstd, ref.rstd, 0.0, 1e-5, "rstd");
  test::expect_close(out, ref.out, 2e-5, 2e-5, "out");
}

TEST(LayerNorm, BackwardMatchesFiniteDifferencesAndReference) {
  const int64_t N = 5;
  const int C = 24;
  auto x = randn(N * C, 4, 1.5f, 0.3f), w = randn(C, 5, 1.0f, 1.0f), b = randn(C, 6), R = randn(N * C, 7);
  auto x_d = to_double(x), w_d = to_double(w), b_d = to_double(b), R_d = to_double(R);
  auto loss = [&] { return test::dot(R_d, reference_forward(x_d, w_d, b_d, N, C).out); };
  const auto fd_x = test::finite_difference(x_d, loss, 1e-5);
  const auto fd_w = test::finite_difference(w_d, loss, 1e-5);
  const auto fd_b = test::finite_difference(b_d, loss, 1e-5);

  // Closed form in double (the formula of ops.h).
  const auto fwd = reference_forward(x_d, w_d, b_d, N, C);
  std::vector<double> ref_x(N * C), ref_w(C, 0.0), ref_b(C, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    double mean_g = 0.0, mean_gx = 0.0;
    for (int c = 0; c < C; ++c) {
      const double xhat = (x_d[i * C + c] - fwd.mean[i]) * fwd.rstd[i];
      const double g = R_d[i * C + c] * w_d[c];
      mean_g += g / C;
      mean_gx += g * xhat / C;
      ref_w[c] += R_d[i * C + c] * xhat;
      ref_b[c] += R_d[i * C + c];
    }
    for (int c = 0; c < C; ++c) {
      const double xhat = (x_d[i * C + c] - fwd.mean[i]) * fwd.rstd[i];
      ref_x[i * C + c] = fwd.rstd[i] * (R_d[i * C + c] * w_d[c] - mean_g - xhat * mean_gx);
    }
  }
  test::expect_close_d(ref_x, fd_x, 1e-7, 1e-6, "reference dx vs FD");
  test::expect_close_d(ref_w, fd_w, 1e-7, 1e-6, "reference dw vs FD");
  test::expect_close_d(ref_b, fd_b, 1e-7, 1e-6, "reference db vs FD");

  std::vector<float> out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  // dinp ACCUMULATES: start from 1 and subtract it afterwards.
  std::vector<float> dx(N * C, 1.0f), dw(C, 0.0f), db(C, 0.0f);
  layernorm_backward_input(dx.data(), R.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  for (auto& v : dx) v -= 1.0f;
  layernorm_backward_weight(dw.data(), db.data(), R.data(), x.data(), mean.data(), rstd.data(), N, C);
  test::expect_close(dx, fd_x, 2e-5, 1e-4, "dx vs FD");
  test::expect_close(dw, fd_w, 1e-5, 1e-4, "dw vs FD");
  test::expect_close(db, fd_b, 1e-5, 1e-5, "db vs FD");
  test::expect_close(dx, ref_x, 2e-5, 1e-4, "dx vs reference");
  test::expect_close(dw, ref_w, 1e-5, 1e-4, "dw vs reference");

  layernorm_backward_weight(dw.data(), db.data(), R.data(), x.data(), mean.data(), rstd.data(), N, C);
  for (auto& v : ref_w) v *= 2;
  for (auto& v : ref_b) v *= 2;
  test::expect_close(dw, ref_w, 2e-5, 1e-4, "dw accumulated twice");
  test::expect_close(db, ref_b, 2e-5, 1e-5, "db accumulated twice");

  // accumulate = false overwrites and never reads the old values (NaN here).
  std::vector<float> dw2(C, NAN), db2(C, NAN);
  layernorm_backward_weight(dw2.data(), db2.data(), R.data(), x.data(), mean.data(), rstd.data(), N, C,
                            /*accumulate=*/false);
  for (auto& v : ref_w) v /= 2;
  for (auto& v : ref_b) v /= 2;
  test::expect_close(dw2, ref_w, 1e-5, 1e-4, "dw overwritten");
  test::expect_close(db2, ref_b, 1e-5, 1e-5, "db overwritten");
}

// A float-only check that the kernel's own forward and backward agree:
// central differences of Σ R ⊙ layernorm_forward(x) at a few coordinates.
TEST(LayerNorm, KernelBackwardMatchesKernelFiniteDifferences) {
  const int64_t N = 3;
  const int C = 16;
  auto x = randn(N * C, 8), w = randn(C, 9, 0.5f, 1.0f), b = randn(C, 10), R = randn(N * C, 11);
  std::vector<float> out(N * C), mean(N), rstd(N), dx(N * C, 0.0f);
  auto loss = [&] {
    layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    double s = 0.0;
    for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(R[i]) * out[i];
    return s;
  };
  loss();
  layernorm_backward_input(dx.data(), R.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  test::expect_float_finite_differences(x, {0, 7, 20, 47}, loss, dx.data(), 2e-3, "dx");
}

TEST(LayerNorm, ThreadCountIndependent) {
  const int64_t N = 257;
  const int C = 768;
  auto x = randn(N * C, 12), w = randn(C, 13), b = randn(C, 14), dy = randn(N * C, 15);
  std::vector<float> out[2], mean[2], rstd[2], dx[2], dw[2], db[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    out[t].resize(N * C), mean[t].resize(N), rstd[t].resize(N), dx[t].assign(N * C, 0.0f), dw[t].assign(C, 0.0f),
        db[t].assign(C, 0.0f);
    layernorm_forward(out[t].data(), mean[t].data(), rstd[t].data(), x.data(), w.data(), b.data(), N, C);
    layernorm_backward_input(dx[t].data(), dy.data(), x.data(), w.data(), mean[t].data(), rstd[t].data(), N, C);
    layernorm_backward_weight(dw[t].data(), db[t].data(), dy.data(), x.data(), mean[t].data(), rstd[t].data(), N, C);
  }
  EXPECT_TRUE(test::bitwise_equal(out[0], out[1]));
  EXPECT_TRUE(test::bitwise_equal(rstd[0], rstd[1]));
  EXPECT_TRUE(test::bitwise_equal(dx[0], dx[1]));
  EXPECT_TRUE(test::bitwise_equal(dw[0], dw[1]));
  EXPECT_TRUE(test::bitwise_equal(db[0], db[1]));
}

// A non-default eps (a config's norm_eps) against the double reference with
// that eps. Rows of std ~0.1 (variance 1e-2 = eps) make eps half of every
// row's denominator, so a kernel that ignored it would be off by ~30%; the
// input gradient, which sees eps only through the stored rstd, is checked
// against the double closed form at the same eps.
TEST(LayerNorm, NonDefaultEpsMatchesReference) {
  const int64_t N = 21;
  const int C = 64;
  const float eps = 1e-2f;
  auto x = randn(N * C, 16, 0.1f, 0.5f), w = randn(C, 17, 1.0f, 1.0f), b = randn(C, 18), R = randn(N * C, 19);
  std::vector<float> out(N * C), mean(N), rstd(N), dx(N * C, 0.0f);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, eps);
  const auto x_d = to_double(x), w_d = to_double(w), R_d = to_double(R);
  const auto ref = reference_forward(x_d, w_d, to_double(b), N, C, static_cast<double>(eps));
  test::expect_close(mean, ref.mean, 1e-6, 1e-6, "mean");
  test::expect_close(rstd, ref.rstd, 0.0, 2e-6, "rstd");
  test::expect_close(out, ref.out, 2e-6, 2e-6, "out");

  std::vector<double> ref_x(N * C);
  for (int64_t i = 0; i < N; ++i) {
    double mean_g = 0.0, mean_gx = 0.0;
    for (int c = 0; c < C; ++c) {
      const double xhat = (x_d[i * C + c] - ref.mean[i]) * ref.rstd[i];
      mean_g += R_d[i * C + c] * w_d[c] / C;
      mean_gx += R_d[i * C + c] * w_d[c] * xhat / C;
    }
    for (int c = 0; c < C; ++c) {
      const double xhat = (x_d[i * C + c] - ref.mean[i]) * ref.rstd[i];
      ref_x[i * C + c] = ref.rstd[i] * (R_d[i * C + c] * w_d[c] - mean_g - xhat * mean_gx);
    }
  }
  layernorm_backward_input(dx.data(), R.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  test::expect_close(dx, ref_x, 2e-5, 1e-5, "dx");

  // The default is 1e-5, bitwise.
  std::vector<float> out_default(N * C), out_explicit(N * C);
  layernorm_forward(out_default.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  layernorm_forward(out_explicit.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f);
  EXPECT_TRUE(test::bitwise_equal(out_default, out_explicit));
}

TEST(LayerNorm, RejectsNonPositiveEps) {
  std::vector<float> buf(8);
  for (float eps : {0.0f, -1e-5f, NAN}) {
    try {
      layernorm_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), 1, 8, eps);
      ADD_FAILURE() << "eps=" << eps << " was accepted";
    } catch (const Error& e) {
      std::ostringstream value;
      value << eps;
      EXPECT_EQ(std::string(e.what()), "layernorm_forward: eps=" + value.str() +
                                           " must be a finite number > 0 (a constant row would give 0/0)");
    }
  }
}

}  // namespace
}  // namespace lattice::kernels
