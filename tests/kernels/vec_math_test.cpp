// The vectorisable exp and sqrt the kernels are built on, against libm.
#include <limits>

#include "lattice/kernels/cpu/vec_math.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

// Distance in units in the last place between two positive floats.
int64_t ulps(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return std::llabs(static_cast<int64_t>(ia) - ib);
}

// Expects exp_fn within 2 ulps of exp (in double, rounded) on [lo, hi].
template <typename Exp>
void expect_exp_within_two_ulps(Exp exp_fn, float lo, float hi) {
  int64_t worst = 0;
  float worst_x = 0;
  for (float x = lo; x <= hi; x += 0.000731f) {
    const float want = static_cast<float>(std::exp(static_cast<double>(x)));
    const int64_t u = ulps(exp_fn(x), want);
    if (u > worst) worst = u, worst_x = x;
  }
  EXPECT_LE(worst, 2) << "at x=" << worst_x;
}

TEST(VecMath, ExpWithinTwoUlpsAndSaturates) {
  expect_exp_within_two_ulps([](float x) { return cpu::exp_approx(x); }, -87.0f, 88.5f);
  EXPECT_EQ(cpu::exp_approx(0.0f), 1.0f);
  EXPECT_EQ(cpu::exp_approx(-88.0f), 0.0f);  // flushed below -87.3
  EXPECT_EQ(cpu::exp_approx(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isfinite(cpu::exp_approx(88.7f)));
  EXPECT_TRUE(std::isfinite(cpu::exp_approx(1000.0f)));  // clamped, never inf
}

TEST(VecMath, ExpNonPositiveWithinTwoUlps) {
  expect_exp_within_two_ulps([](float x) { return cpu::exp_nonpositive(x); }, -87.0f, 0.0f);
  EXPECT_EQ(cpu::exp_nonpositive(0.0f), 1.0f);
  EXPECT_EQ(cpu::exp_nonpositive(-88.0f), 0.0f);
  EXPECT_EQ(cpu::exp_nonpositive(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isnan(cpu::exp_nonpositive(std::numeric_limits<float>::quiet_NaN())));
}

TEST(VecMath, SqrtWithinTwoUlps) {
  int64_t worst = 0;
  float worst_x = 0;
  for (float x = 1e-30f; x < 1e30f; x *= 1.0007f) {
    const int64_t u = ulps(cpu::sqrt_approx(x), std::sqrt(x));
    if (u > worst) worst = u, worst_x = x;
  }
  EXPECT_LE(worst, 2) << "at x=" << worst_x;
  EXPECT_EQ(cpu::sqrt_approx(0.0f), 0.0f);
  EXPECT_LE(ulps(cpu::sqrt_approx(4.0f), 2.0f), 2);
}

}  // namespace
}  // namespace lattice::kernels
