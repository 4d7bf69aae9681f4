// Linear layer: forward vs a double loop; backward vs the double reference and
// vs central finite differences of the double forward.
#include "lattice/kernels/ops.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

using test::randn;
using test::to_double;

constexpr int64_t kN = 13;
constexpr int kIC = 11, kOC = 7;

// out = inp·Wᵀ + b
std::vector<double> reference_forward(const std::vector<double>& inp, const std::vector<double>& w,
                                      const std::vector<double>* bias) {
  std::vector<double> out(kN * kOC);
  for (int64_t n = 0; n < kN; ++n)
    for (int o = 0; o < kOC; ++o) {
      double acc = bias ? (*bias)[o] : 0.0;
      for (int i = 0; i < kIC; ++i) acc += inp[n * kIC + i] * w[o * kIC + i];
      out[n * kOC + o] = acc;
    }
  return out;
}

TEST(Linear, ForwardMatchesReference) {
  auto inp = randn(kN * kIC, 1), w = randn(kOC * kIC, 2), b = randn(kOC, 3);
  std::vector<float> out(kN * kOC, 99.0f);
  linear_forward(out.data(), inp.data(), w.data(), b.data(), kN, kIC, kOC);
  auto bd = to_double(b);
  test::expect_close(out, reference_forward(to_double(inp), to_double(w), &bd), 1e-5, 1e-5, "with bias");
  linear_forward(out.data(), inp.data(), w.data(), nullptr, kN, kIC, kOC);
  test::expect_close(out, reference_forward(to_double(inp), to_double(w), nullptr), 1e-5, 1e-5, "no bias");
}

// L = Σ R ⊙ out, so dout = R; gradients checked against finite differences of
// L computed with the double forward, and against the closed forms.
TEST(Linear, BackwardMatchesFiniteDifferencesAndReference) {
  auto inp = randn(kN * kIC, 4), w = randn(kOC * kIC, 5), b = randn(kOC, 6), R = randn(kN * kOC, 7);
  auto inp_d = to_double(inp), w_d = to_double(w), b_d = to_double(b), R_d = to_double(R);
  auto loss = [&] { return test::dot(R_d, reference_forward(inp_d, w_d, &b_d)); };
  const auto fd_inp = test::finite_difference(inp_d, loss);
  const auto fd_w = test::finite_difference(w_d, loss);
  const auto fd_b = test::finite_difference(b_d, loss);

  // Closed forms in double: dinp = R·W, dW = Rᵀ·inp, db = Σ_n R.
  std::vector<double> ref_inp(kN * kIC, 0.0), ref_w(kOC * kIC, 0.0), ref_b(kOC, 0.0);
  for (int64_t n = 0; n < kN; ++n)
    for (int o = 0; o < kOC; ++o) {
      ref_b[o] += R_d[n * kOC + o];
      for (int i = 0; i < kIC; ++i) {
        ref_inp[n * kIC + i] += R_d[n * kOC + o] * w_d[o * kIC + i];
        ref_w[o * kIC + i] += R_d[n * kOC + o] * inp_d[n * kIC + i];
      }
    }
  test::expect_close_d(ref_inp, fd_inp, 1e-6, 1e-6, "reference dinp vs FD");
  test::expect_close_d(ref_w, fd_w, 1e-6, 1e-6, "reference dW vs FD");
  test::expect_close_d(ref_b, fd_b, 1e-6, 1e-6, "reference db vs FD");

  std::vector<float> dinp(kN * kIC, 123.0f), dw(kOC * kIC, 0.0f), db(kOC, 0.0f);
  linear_backward_input(dinp.data(), R.data(), w.data(), kN, kIC, kOC, /*accumulate=*/false);
  test::expect_close(dinp, fd_inp, 1e-5, 1e-5, "dinp vs FD");
  test::expect_close(dinp, ref_inp, 1e-5, 1e-5, "dinp vs reference");
  linear_backward_weight(dw.data(), db.data(), R.data(), inp.data(), kN, kIC, kOC);
  test::expect_close(dw, fd_w, 1e-5, 1e-5, "dW vs FD");
  test::expect_close(db, fd_b, 1e-5, 1e-5, "db vs FD");
  test::expect_close(dw, ref_w, 1e-5, 1e-5, "dW vs reference");

  // Accumulation: a second call doubles dW, db; accumulate=true doubles dinp.
  linear_backward_weight(dw.data(), db.data(), R.data(), inp.data(), kN, kIC, kOC);
  linear_backward_input(dinp.data(), R.data(), w.data(), kN, kIC, kOC, /*accumulate=*/true);
  auto twice = [](std::vector<double> v) {
    for (auto& x : v) x *= 2;
    return v;
  };
  test::expect_close(dw, twice(ref_w), 1e-5, 1e-5, "dW accumulated twice");
  test::expect_close(db, twice(ref_b), 1e-5, 1e-5, "db accumulated twice");
  test::expect_close(dinp, twice(ref_inp), 1e-5, 1e-5, "dinp accumulated");

  // dbias may be null.
  std::vector<float> dw2(kOC * kIC, 0.0f);
  linear_backward_weight(dw2.data(), nullptr, R.data(), inp.data(), kN, kIC, kOC);
  test::expect_close(dw2, ref_w, 1e-5, 1e-5, "dW without dbias");

  // accumulate = false overwrites and never reads the old values (NaN here).
  std::vector<float> dw3(kOC * kIC, NAN), db3(kOC, NAN);
  linear_backward_weight(dw3.data(), db3.data(), R.data(), inp.data(), kN, kIC, kOC, /*accumulate=*/false);
  EXPECT_TRUE(test::bitwise_equal(dw3, dw2)) << "overwrite equals accumulate into zero";
  test::expect_close(db3, ref_b, 1e-5, 1e-5, "db overwritten");
}

// The bias reduction and the bias pre-fill are ours; at a size where they run
// in parallel they must give identical bits for 1 and 2 threads.
TEST(Linear, BiasReductionIsThreadCountIndependent) {
  const int64_t N = 300;
  const int IC = 64, OC = 1000;
  auto inp = randn(N * IC, 8), dout = randn(N * OC, 9);
  std::vector<float> db1(OC, 0.5f), db2(OC, 0.5f), dw(OC * IC, 0.0f);
  {
    test::ThreadScope one(1);
    linear_backward_weight(dw.data(), db1.data(), dout.data(), inp.data(), N, IC, OC);
  }
  {
    test::ThreadScope two(2);
    linear_backward_weight(dw.data(), db2.data(), dout.data(), inp.data(), N, IC, OC);
  }
  EXPECT_TRUE(test::bitwise_equal(db1, db2));
  std::vector<double> want(OC, 0.5);
  for (int64_t n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) want[o] += dout[n * OC + o];
  test::expect_close(db1, want, 1e-4, 1e-5, "dbias over 300 rows");
}

}  // namespace
}  // namespace lattice::kernels
