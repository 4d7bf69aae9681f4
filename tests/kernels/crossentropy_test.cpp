// Softmax cross-entropy with a padded vocabulary.
#include <algorithm>
#include <cmath>
#include <limits>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

using test::randn;

// Loss and dlogits in double over the first V columns; padding gets 0.
void reference(const std::vector<float>& logits, const std::vector<int32_t>& targets, int64_t N, int V, int Vp,
               double dloss, std::vector<double>& losses, std::vector<double>& dlogits) {
  losses.assign(N, 0.0);
  dlogits.assign(N * Vp, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    const float* z = &logits[i * Vp];
    double m = -INFINITY;
    for (int j = 0; j < V; ++j) m = std::max(m, static_cast<double>(z[j]));
    double s = 0.0;
    for (int j = 0; j < V; ++j) s += std::exp(z[j] - m);
    losses[i] = m + std::log(s) - z[targets[i]];
    for (int j = 0; j < V; ++j) dlogits[i * Vp + j] = dloss * (std::exp(z[j] - m) / s - (j == targets[i] ? 1 : 0));
  }
}

struct Case {
  int64_t N;
  int V, Vp;
  float scale;
};

std::vector<float> padded_logits(const Case& c, uint64_t seed) {
  auto z = randn(c.N * c.Vp, seed, c.scale);
  // Huge and non-finite padding: it must never take part.
  for (int64_t i = 0; i < c.N; ++i)
    for (int j = c.V; j < c.Vp; ++j)
      z[i * c.Vp + j] = (j % 3 == 0)   ? std::numeric_limits<float>::infinity()
                        : (j % 3 == 1) ? 1e30f
                                       : std::numeric_limits<float>::quiet_NaN();
  return z;
}

std::vector<int32_t> targets_for(const Case& c) {
  std::vector<int32_t> t(c.N);
  for (int64_t i = 0; i < c.N; ++i) t[i] = static_cast<int32_t>((i * 7919) % c.V);
  t[0] = c.V - 1;  // the last real class
  return t;
}

const Case kCases[] = {{5, 10, 16, 1.0f}, {7, 33, 33, 3.0f}, {4, 50257, 50304, 5.0f}, {3, 1000, 1024, 40.0f}};

TEST(CrossEntropy, ForwardMatchesReferenceAndIgnoresPadding) {
  uint64_t seed = 1;
  for (const Case& c : kCases) {
    const auto z = padded_logits(c, seed++);
    const auto targets = targets_for(c);
    std::vector<float> losses(c.N);
    crossentropy_forward(losses.data(), z.data(), targets.data(), c.N, c.V, c.Vp);
    std::vector<double> ref_losses, ref_d;
    reference(z, targets, c.N, c.V, c.Vp, 1.0, ref_losses, ref_d);
    test::expect_close(losses, ref_losses, 1e-5, 1e-5, "losses V=" + std::to_string(c.V));
  }
}

TEST(CrossEntropy, FusedForwardBackwardMatchesReference) {
  uint64_t seed = 10;
  for (const Case& c : kCases) {
    auto z = padded_logits(c, seed++);
    const auto targets = targets_for(c);
    const float dloss = 1.0f / static_cast<float>(c.N);
    std::vector<double> ref_losses, ref_d;
    reference(z, targets, c.N, c.V, c.Vp, dloss, ref_losses, ref_d);
    std::vector<float> losses(c.N);
    crossentropy_forward_backward(z.data(), losses.data(), targets.data(), c.N, c.V, c.Vp, dloss);
    const std::string what = " V=" + std::to_string(c.V) + " Vp=" + std::to_string(c.Vp);
    test::expect_close(losses, ref_losses, 1e-5, 1e-5, "losses" + what);
    test::expect_close(z, ref_d, 1e-8, 1e-5, "dlogits" + what);
    for (int64_t i = 0; i < c.N; ++i)
      for (int j = c.V; j < c.Vp; ++j) ASSERT_EQ(z[i * c.Vp + j], 0.0f) << "padding dlogit (" << i << "," << j << ")";
  }
}

TEST(CrossEntropy, GradientMatchesFiniteDifferences) {
  const Case c{3, 12, 16, 2.0f};
  auto z = padded_logits(c, 20);
  const auto targets = targets_for(c);
  std::vector<double> z_d(z.begin(), z.end());
  // Mean loss over the rows, in double, over the real columns only.
  auto loss = [&] {
    double total = 0.0;
    for (int64_t i = 0; i < c.N; ++i) {
      double m = -INFINITY, s = 0.0;
      for (int j = 0; j < c.V; ++j) m = std::max(m, z_d[i * c.Vp + j]);
      for (int j = 0; j < c.V; ++j) s += std::exp(z_d[i * c.Vp + j] - m);
      total += m + std::log(s) - z_d[i * c.Vp + targets[i]];
    }
    return total / c.N;
  };
  std::vector<double> fd(z.size(), 0.0);
  for (int64_t i = 0; i < c.N; ++i)
    for (int j = 0; j < c.V; ++j) {
      const size_t k = i * c.Vp + j;
      const double saved = z_d[k], h = 1e-6;
      z_d[k] = saved + h;
      const double up = loss();
      z_d[k] = saved - h;
      const double down = loss();
      z_d[k] = saved;
      fd[k] = (up - down) / (2 * h);
    }
  std::vector<double> ref_losses, ref_d;
  reference(z, targets, c.N, c.V, c.Vp, 1.0 / c.N, ref_losses, ref_d);
  test::expect_close_d(ref_d, fd, 1e-8, 1e-6, "reference vs FD");
  std::vector<float> losses(c.N);
  crossentropy_forward_backward(z.data(), losses.data(), targets.data(), c.N, c.V, c.Vp, 1.0f / c.N);
  test::expect_close(z, fd, 1e-7, 1e-5, "kernel vs FD");
}

TEST(CrossEntropy, ThreadCountIndependent) {
  const Case c{64, 5000, 5008, 4.0f};
  const auto z = padded_logits(c, 30);
  const auto targets = targets_for(c);
  std::vector<float> losses[2], dz[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    losses[t].resize(c.N);
    dz[t] = z;
    crossentropy_forward_backward(dz[t].data(), losses[t].data(), targets.data(), c.N, c.V, c.Vp, 0.5f);
  }
  EXPECT_TRUE(test::bitwise_equal(losses[0], losses[1]));
  EXPECT_TRUE(test::bitwise_equal(dz[0], dz[1]));
}

// The vocabulary-parallel pieces on one "rank" holding every column (the
// statistics need no reduction) give the fused kernel's loss and dlogits, and
// on two halves with the statistics combined by hand, the same again.
TEST(CrossEntropy, LocalPiecesCombineToTheWholeSoftmax) {
  const int64_t N = 5;
  const int V = 70, Vp = 80, half = Vp / 2;
  auto logits = randn(N * Vp, 31);
  std::vector<int32_t> targets = {0, 69, 35, 40, 12};
  std::vector<float> want = logits, want_loss(N);
  crossentropy_forward_backward(want.data(), want_loss.data(), targets.data(), N, V, Vp, 0.25f);
  // Two halves: columns [0, 40) all real, [40, 80) 30 real.
  std::vector<float> part[2], m[2];
  std::vector<double> tl[2], se[2];
  const int real[2] = {half, V - half};
  for (int r = 0; r < 2; r++) {
    part[r].resize(N * half);
    for (int64_t i = 0; i < N; i++)
      for (int j = 0; j < half; j++) part[r][i * half + j] = logits[i * Vp + r * half + j];
    m[r].resize(N), tl[r].resize(N), se[r].resize(N);
    crossentropy_local_max(m[r].data(), tl[r].data(), part[r].data(), targets.data(), N, r * half, real[r], half);
  }
  std::vector<float> gm(N);
  for (int64_t i = 0; i < N; i++) gm[i] = std::max(m[0][i], m[1][i]);
  for (int r = 0; r < 2; r++) crossentropy_local_exp(part[r].data(), se[r].data(), gm.data(), N, real[r], half);
  std::vector<double> s(N);
  for (int64_t i = 0; i < N; i++) {
    s[i] = se[0][i] + se[1][i];
    const double loss = gm[i] + std::log(s[i]) - (tl[0][i] + tl[1][i]);
    EXPECT_NEAR(loss, want_loss[i], 1e-5 * std::fabs(want_loss[i])) << "row " << i;
  }
  for (int r = 0; r < 2; r++) {
    crossentropy_local_grad(part[r].data(), s.data(), targets.data(), N, r * half, real[r], half, 0.25f);
    for (int64_t i = 0; i < N; i++)
      for (int j = 0; j < half; j++)
        EXPECT_NEAR(part[r][i * half + j], want[i * Vp + r * half + j], 1e-7) << "row " << i << " column " << r * half + j;
  }
}

TEST(CrossEntropy, RejectsTargetsOutsideVocabulary) {
  std::vector<float> z(2 * 16), losses(2);
  std::vector<int32_t> targets = {3, 12};  // 12 is a padding column
  try {
    crossentropy_forward(losses.data(), z.data(), targets.data(), 2, 10, 16);
    FAIL() << "target in the padding accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("targets[1]=12"), std::string::npos) << e.what();
  }
  EXPECT_THROW(crossentropy_forward(losses.data(), z.data(), targets.data(), 2, 17, 16), Error);
}

}  // namespace
}  // namespace lattice::kernels
