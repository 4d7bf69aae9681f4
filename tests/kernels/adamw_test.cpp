// AdamW against a scalar reference written as PyTorch's torch.optim.AdamW
// (foreach=False, maximize=False, amsgrad=False) does it, step by step.
#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

using test::randn;

struct Hyper {
  float lr = 3e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f;
};

// PyTorch's _single_tensor_adamw, in float like the tensors it updates:
//   param.mul_(1 - lr*wd); exp_avg = β1·m + (1-β1)·g; exp_avg_sq = β2·v + (1-β2)·g²
//   denom = sqrt(exp_avg_sq)/sqrt(bc2) + eps ; param.addcdiv_(exp_avg, denom, -lr/bc1)
void pytorch_adamw_scalar(float& p, float g, float& m, float& v, const Hyper& h, int64_t t) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), t);
  p *= static_cast<float>(1.0 - static_cast<double>(h.lr) * h.wd);
  m = h.beta1 * m + (1.0f - h.beta1) * g;
  v = h.beta2 * v + (1.0f - h.beta2) * g * g;
  const float denom = std::sqrt(v) / static_cast<float>(std::sqrt(bc2)) + h.eps;
  p = p - static_cast<float>(h.lr / bc1) * (m / denom);
}

TEST(AdamW, MatchesPyTorchFormulaOverSteps) {
  const int64_t n = 100003;  // > the parallel threshold, odd tail
  auto p = randn(n, 1), m = std::vector<float>(n, 0.0f), v = std::vector<float>(n, 0.0f);
  auto p_ref = p, m_ref = m, v_ref = v;
  Hyper h;
  const float grad_scale = 0.5f;
  for (int64_t t = 1; t <= 5; ++t) {
    auto g = randn(n, 100 + t, t == 3 ? 1e-6f : 1.0f);  // a step of tiny gradients (eps matters)
    adamw_update(p.data(), g.data(), m.data(), v.data(), n, h.lr, h.beta1, h.beta2, h.eps, h.wd, t, grad_scale);
    for (int64_t i = 0; i < n; ++i) pytorch_adamw_scalar(p_ref[i], g[i] * grad_scale, m_ref[i], v_ref[i], h, t);
  }
  // m = β1·m + (1-β1)·g cancels to values far below its terms; the kernel
  // may fuse the multiply-add (FMA), so allow a few ulps of the terms (~0.3).
  test::expect_close(m, test::to_double(m_ref), 1e-7, 2e-6, "m");
  test::expect_close(v, test::to_double(v_ref), 0.0, 2e-6, "v");
  test::expect_close(p, test::to_double(p_ref), 1e-9, 1e-6, "param");
}

// The same update in double with the formula as ops.h writes it.
TEST(AdamW, MatchesOpsFormulaInDouble) {
  const int64_t n = 257;
  auto p = randn(n, 2), g = randn(n, 3), m = randn(n, 4, 0.1f), v = randn(n, 5, 0.1f);
  for (auto& x : v) x = x * x;
  Hyper h;
  h.lr = 1e-2f;
  const int64_t t = 7;
  std::vector<double> want(n);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = g[i];
    const double mi = h.beta1 * static_cast<double>(m[i]) + (1 - static_cast<double>(h.beta1)) * gi;
    const double vi = h.beta2 * static_cast<double>(v[i]) + (1 - static_cast<double>(h.beta2)) * gi * gi;
    const double mhat = mi / (1 - std::pow(static_cast<double>(h.beta1), t));
    const double vhat = vi / (1 - std::pow(static_cast<double>(h.beta2), t));
    want[i] = p[i] - h.lr * (mhat / (std::sqrt(vhat) + h.eps) + h.wd * static_cast<double>(p[i]));
  }
  adamw_update(p.data(), g.data(), m.data(), v.data(), n, h.lr, h.beta1, h.beta2, h.eps, h.wd, t, 1.0f);
  test::expect_close(p, want, 1e-7, 1e-6, "param");
}

TEST(AdamW, ThreadCountIndependentAndRejectsStepZero) {
  const int64_t n = 200000;
  auto p0 = randn(n, 6), g = randn(n, 7);
  std::vector<float> p[2], m[2], v[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    p[t] = p0, m[t].assign(n, 0.0f), v[t].assign(n, 0.0f);
    adamw_update(p[t].data(), g.data(), m[t].data(), v[t].data(), n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f);
  }
  EXPECT_TRUE(test::bitwise_equal(p[0], p[1]));
  EXPECT_TRUE(test::bitwise_equal(v[0], v[1]));
  EXPECT_THROW(adamw_update(p[0].data(), g.data(), m[0].data(), v[0].data(), n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 0,
                            1.0f),
               Error);
}

// 1-bit Adam's update after its warm-up: m becomes the given momentum, v is
// left as it was, and p moves by Adam's formula with bc2 of the step at
// which v was frozen and v̂ lifted to m̂² where that is larger (in double, as
// ops.h writes it; about half the elements here take each branch).
TEST(AdamW, MomentumUpdateTakesTheMomentumAndLeavesVFrozen) {
  const int64_t n = 100003;  // > the parallel threshold, odd tail
  auto p = randn(n, 8), momentum = randn(n, 9, 0.1f), m = randn(n, 10), v = randn(n, 11, 0.1f);
  for (auto& x : v) x = x * x + 1e-4f;  // (a v near 0 makes the step ~1 and its rounding ~1e-7)
  const auto v_before = v, p_before = p;
  Hyper h;
  h.lr = 1e-2f;
  const int64_t t = 40, t_v = 12;
  std::vector<double> want(n);
  int64_t lifted = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double mhat = momentum[i] / (1 - std::pow(static_cast<double>(h.beta1), t));
    const double vhat = std::max(v[i] / (1 - std::pow(static_cast<double>(h.beta2), t_v)), mhat * mhat);
    lifted += vhat == mhat * mhat;
    want[i] = p[i] - h.lr * (mhat / (std::sqrt(vhat) + h.eps) + h.wd * static_cast<double>(p[i]));
  }
  adamw_momentum_update(p.data(), momentum.data(), m.data(), v.data(), n, h.lr, h.beta1, h.beta2, h.eps, h.wd, t, t_v);
  test::expect_close(p, want, 1e-7, 1e-6, "param");
  EXPECT_GT(lifted, n / 5);
  EXPECT_LT(lifted, n - n / 5);
  EXPECT_TRUE(test::bitwise_equal(m, momentum));
  EXPECT_TRUE(test::bitwise_equal(v, v_before));
  // With t_v = t it is Adam's step whose new m and v are the given ones (v lifted).
  auto p2 = p_before, m2 = m, v2 = v;
  adamw_momentum_update(p2.data(), momentum.data(), m2.data(), v2.data(), n, h.lr, h.beta1, h.beta2, h.eps, h.wd, t, t);
  for (int64_t i = 0; i < n; ++i) {
    const double mhat = momentum[i] / (1 - std::pow(static_cast<double>(h.beta1), t));
    const double vhat = std::max(v[i] / (1 - std::pow(static_cast<double>(h.beta2), t)), mhat * mhat);
    want[i] = p_before[i] - h.lr * (mhat / (std::sqrt(vhat) + h.eps) + h.wd * static_cast<double>(p_before[i]));
  }
  test::expect_close(p2, want, 1e-7, 1e-6, "param (t_v = t)");
  EXPECT_THROW(adamw_momentum_update(p.data(), momentum.data(), m.data(), v.data(), n, h.lr, h.beta1, h.beta2, h.eps,
                                     h.wd, t, 0),
               Error);
}

}  // namespace
}  // namespace lattice::kernels
