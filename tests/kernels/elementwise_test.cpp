// GELU, residual/add/scale, sum_squares and the 16-bit storage casts.
#include <cstring>

#include "lattice/core/cpu.h"
#include "lattice/core/dtype.h"
#include "lattice/kernels/ops.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

using test::randn;
using test::to_double;

double gelu_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
double gelu_grad_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  const double t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

std::vector<float> gelu_inputs() {
  auto x = randn(100003, 1, 3.0f);  // odd length: vector tails; > the parallel threshold
  const float extremes[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-8f, 5.0f, -5.0f, 10.0f, -10.0f, 30.0f, -30.0f,
                            100.0f, -100.0f, 1e4f, -1e4f, 3e38f, -3e38f};
  for (size_t i = 0; i < std::size(extremes); ++i) x[i * 977] = extremes[i];
  return x;
}

TEST(Gelu, ForwardMatchesReference) {
  const auto x = gelu_inputs();
  std::vector<float> out(x.size());
  gelu_forward(out.data(), x.data(), x.size());
  std::vector<double> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = gelu_ref(x[i]);
  test::expect_close(out, want, 1e-6, 2e-6, "gelu forward");
}

TEST(Gelu, BackwardMatchesReferenceAndFiniteDifferences) {
  const auto x = gelu_inputs();
  const auto dout = randn(x.size(), 2);
  std::vector<float> dx(x.size());
  gelu_backward(dx.data(), x.data(), dout.data(), x.size());
  std::vector<double> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = dout[i] * gelu_grad_ref(x[i]);
  test::expect_close(dx, want, 1e-6, 1e-5, "gelu backward vs closed form");
  // Closed form vs central differences of the double forward, on a grid.
  for (double v = -8.0; v <= 8.0; v += 0.0625) {
    const double h = 1e-5;
    EXPECT_NEAR(gelu_grad_ref(v), (gelu_ref(v + h) - gelu_ref(v - h)) / (2 * h), 1e-8) << v;
  }
  // Kernel backward vs differences of the kernel forward (float, loose).
  std::vector<float> pts, up(1), down(1), g(1);
  for (float v = -6.0f; v <= 6.0f; v += 0.25f) {
    const float h = 1e-2f, one = 1.0f, a = v + h, b = v - h;
    gelu_forward(up.data(), &a, 1);
    gelu_forward(down.data(), &b, 1);
    gelu_backward(g.data(), &v, &one, 1);
    EXPECT_NEAR(g[0], (up[0] - down[0]) / (2 * h), 2e-4) << v;
  }
}

TEST(Gelu, ThreadCountIndependent) {
  const auto x = gelu_inputs();
  const auto dout = randn(x.size(), 3);
  std::vector<float> out[2], dx[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    out[t].resize(x.size()), dx[t].resize(x.size());
    gelu_forward(out[t].data(), x.data(), x.size());
    gelu_backward(dx[t].data(), x.data(), dout.data(), x.size());
  }
  EXPECT_TRUE(test::bitwise_equal(out[0], out[1]));
  EXPECT_TRUE(test::bitwise_equal(dx[0], dx[1]));
}

TEST(Elementwise, ResidualAddScale) {
  for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{100001}}) {
    auto a = randn(n, 4), b = randn(n, 5);
    std::vector<float> out(n);
    residual_forward(out.data(), a.data(), b.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], a[i] + b[i]);
    auto a2 = a;
    add_inplace(a2.data(), b.data(), n);
    EXPECT_TRUE(test::bitwise_equal(a2, out));
    scale_inplace(a2.data(), 0.25f, n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(a2[i], out[i] * 0.25f);
  }
}

TEST(SumSquares, MatchesDoubleAndIsThreadCountIndependent) {
  const int64_t n = (1 << 20) + 12345;  // several 64Ki chunks and a tail
  auto x = randn(n, 6, 3.0f);
  double want = 0.0;
  for (float v : x) want += static_cast<double>(v) * v;
  double got[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    got[t] = sum_squares(x.data(), n);
  }
  EXPECT_NEAR(got[0], want, 1e-12 * want);
  EXPECT_EQ(got[0], got[1]) << "sum_squares depends on the thread count";
  // Values whose squares are far beyond float's range still sum in double.
  std::vector<float> big(1000, 1e30f);
  const double big_sq = static_cast<double>(1e30f) * static_cast<double>(1e30f);
  EXPECT_NEAR(sum_squares(big.data(), big.size()), 1000 * big_sq, 1e-12 * 1000 * big_sq);
  EXPECT_EQ(sum_squares(x.data(), 0), 0.0);
  // Split anywhere, the parts add up (to double rounding).
  EXPECT_NEAR(sum_squares(x.data(), 1000) + sum_squares(x.data() + 1000, n - 1000), want, 1e-12 * want);
}


// The 16-bit casts of mixed precision against core/dtype.h's scalar
// converters, bit for bit, on every instruction-set level this CPU runs:
// every 16-bit pattern loaded, and f32 values around every rounding case
// (ties, overflow, f16 subnormals, NaN, ±0) stored and rounded.
std::vector<float> cast_inputs() {
  std::vector<float> x = randn(70001, 5, 4.0f);
  uint32_t state = 12345;
  auto next = [&] { return state = state * 1664525u + 1013904223u; };
  for (size_t i = 0; i < 20000; i++) {  // arbitrary bit patterns: every exponent, NaNs, infinities
    const uint32_t u = next();
    std::memcpy(&x[i], &u, 4);
  }
  const float special[] = {0.0f, -0.0f, 65504.0f, 65519.0f, 65520.0f, -65520.0f, 1e-8f, -3e-6f, 6.1e-5f, 5.96e-8f,
                           2.98e-8f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, 1.0f + 1.0f / 256, 3.4e38f};
  for (size_t i = 0; i < std::size(special); i++) x[20000 + i] = special[i];
  return x;
}

bool same_bits(float a, float b) {
  uint32_t ua, ub;
  std::memcpy(&ua, &a, 4), std::memcpy(&ub, &b, 4);
  return ua == ub;
}

TEST(Cast16, MatchesTheScalarConvertersOnEveryLevel) {
  const Isa start = active_isa();
  const std::vector<float> x = cast_inputs();
  for (Isa isa : runnable_isas()) {
    set_active_isa_for_testing(isa);
    for (DType t : {DType::BF16, DType::F16}) {
      const std::string where = std::string(dtype_name(t)) + " on " + isa_name(isa);
      auto scalar_store = [t](float v) { return t == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v); };
      auto scalar_load = [t](uint16_t h) { return t == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h); };
      // store
      std::vector<uint16_t> h(x.size());
      store_16bit(t, x.data(), h.data(), static_cast<int64_t>(x.size()));
      size_t bad = 0;
      for (size_t i = 0; i < x.size(); i++) {
        const uint16_t want = scalar_store(x[i]);
        const bool nan = std::isnan(x[i]);
        // NaN: any quiet NaN of the same sign is right (payloads differ between converters).
        const bool ok = nan ? std::isnan(scalar_load(h[i])) : h[i] == want;
        if (!ok && bad++ < 5) ADD_FAILURE() << where << " store of " << x[i] << ": " << h[i] << " vs " << want;
      }
      // round = store then load
      std::vector<float> r = x;
      round_to(t, r.data(), static_cast<int64_t>(r.size()));
      for (size_t i = 0; i < x.size(); i++) {
        const float want = scalar_load(scalar_store(x[i]));
        const bool ok = std::isnan(x[i]) ? std::isnan(r[i]) : same_bits(r[i], want);
        if (!ok && bad++ < 10) ADD_FAILURE() << where << " round of " << x[i] << ": " << r[i] << " vs " << want;
      }
      // load of every pattern
      std::vector<uint16_t> all(65536);
      for (size_t i = 0; i < all.size(); i++) all[i] = static_cast<uint16_t>(i);
      std::vector<float> back(all.size());
      load_16bit(t, all.data(), back.data(), static_cast<int64_t>(all.size()));
      for (size_t i = 0; i < all.size(); i++) {
        const float want = scalar_load(all[i]);
        const bool ok = std::isnan(want) ? std::isnan(back[i]) : same_bits(back[i], want);
        if (!ok && bad++ < 15) ADD_FAILURE() << where << " load of pattern " << i << ": " << back[i];
      }
      EXPECT_EQ(bad, 0u) << where;
    }
  }
  set_active_isa_for_testing(start);
  // f32 is no rounding at all.
  std::vector<float> r = x;
  round_to(DType::F32, r.data(), static_cast<int64_t>(r.size()));
  EXPECT_EQ(0, std::memcmp(r.data(), x.data(), x.size() * sizeof(float)));
}

TEST(Cast16, RoundingIsIdempotentAndKeepsFiniteValuesClose) {
  std::vector<float> x = randn(10000, 9, 100.0f);
  for (DType t : {DType::BF16, DType::F16}) {
    std::vector<float> r = x;
    round_to(t, r.data(), static_cast<int64_t>(r.size()));
    std::vector<float> again = r;
    round_to(t, again.data(), static_cast<int64_t>(again.size()));
    EXPECT_EQ(0, std::memcmp(r.data(), again.data(), r.size() * sizeof(float))) << dtype_name(t);
    const double rel = t == DType::BF16 ? 1.0 / 256 : 1.0 / 2048;  // half an ulp of an 8- / 11-bit significand
    for (size_t i = 0; i < x.size(); i++) {
      if (std::fabs(x[i]) <= 1e-3) continue;
      ASSERT_LE(std::fabs(r[i] - x[i]), rel * std::fabs(x[i])) << dtype_name(t) << " " << x[i];
    }
  }
}

}  // namespace
}  // namespace lattice::kernels
