// Causal attention: forward (out and lse) vs a naive double implementation
// that materialises the full T×T softmax; backward vs the double closed form
// and central finite differences of the double forward.
#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

using test::randn;
using test::to_double;

struct AttnReference {
  std::vector<double> out, lse;
};

AttnReference reference_forward(const std::vector<double>& qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  AttnReference r{std::vector<double>(static_cast<size_t>(B) * T * C, 0.0), std::vector<double>(B * NH * T)};
  std::vector<double> s(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < T; ++i) {
        const double* q = &qkv[(static_cast<size_t>(b) * T + i) * 3 * C + h * hs];
        double m = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          const double* k = &qkv[(static_cast<size_t>(b) * T + j) * 3 * C + C + h * hs];
          double dot = 0.0;
          for (int d = 0; d < hs; ++d) dot += q[d] * k[d];
          s[j] = scale * dot;
          m = std::max(m, s[j]);
        }
        double l = 0.0;
        for (int j = 0; j <= i; ++j) l += std::exp(s[j] - m);
        r.lse[(b * NH + h) * T + i] = m + std::log(l);
        double* o = &r.out[(static_cast<size_t>(b) * T + i) * C + h * hs];
        for (int j = 0; j <= i; ++j) {
          const double p = std::exp(s[j] - m) / l;
          const double* v = &qkv[(static_cast<size_t>(b) * T + j) * 3 * C + 2 * C + h * hs];
          for (int d = 0; d < hs; ++d) o[d] += p * v[d];
        }
      }
  return r;
}

// dqkv by the closed form of ops.h, with the full P materialised.
std::vector<double> reference_backward(const std::vector<double>& qkv, const std::vector<double>& dout, int B, int T,
                                       int C, int NH) {
  const int hs = C / NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  const auto fwd = reference_forward(qkv, B, T, C, NH);
  std::vector<double> dqkv(qkv.size(), 0.0);
  auto at = [&](const std::vector<double>& x, int b, int t, int part, int h) {
    return &x[(static_cast<size_t>(b) * T + t) * 3 * C + part * C + h * hs];
  };
  auto grad = [&](int b, int t, int part, int h) {
    return &dqkv[(static_cast<size_t>(b) * T + t) * 3 * C + part * C + h * hs];
  };
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < T; ++i) {
        const double* dy = &dout[(static_cast<size_t>(b) * T + i) * C + h * hs];
        const double* y = &fwd.out[(static_cast<size_t>(b) * T + i) * C + h * hs];
        double D = 0.0;
        for (int d = 0; d < hs; ++d) D += dy[d] * y[d];
        for (int j = 0; j <= i; ++j) {
          double s = 0.0, dp = 0.0;
          for (int d = 0; d < hs; ++d) {
            s += at(qkv, b, i, 0, h)[d] * at(qkv, b, j, 1, h)[d];
            dp += dy[d] * at(qkv, b, j, 2, h)[d];
          }
          const double p = std::exp(scale * s - fwd.lse[(b * NH + h) * T + i]);
          const double ds = p * (dp - D);
          for (int d = 0; d < hs; ++d) {
            grad(b, j, 2, h)[d] += p * dy[d];
            grad(b, i, 0, h)[d] += scale * ds * at(qkv, b, j, 1, h)[d];
            grad(b, j, 1, h)[d] += scale * ds * at(qkv, b, i, 0, h)[d];
          }
        }
      }
  return dqkv;
}

struct Shape {
  int B, T, C, NH;
};

// T around and away from multiples of the 64-row query block, several heads.
const Shape kShapes[] = {{1, 1, 8, 1}, {2, 5, 12, 3}, {1, 64, 16, 2}, {2, 65, 32, 4}, {1, 130, 24, 1},
                         {1, 200, 64, 4}};

TEST(Attention, ForwardMatchesNaiveReference) {
  uint64_t seed = 1;
  for (const Shape& s : kShapes) {
    auto qkv = randn(static_cast<size_t>(s.B) * s.T * 3 * s.C, seed++, 1.5f);
    std::vector<float> out(static_cast<size_t>(s.B) * s.T * s.C, 7.0f), lse(s.B * s.NH * s.T, 7.0f);
    attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.C, s.NH);
    const auto ref = reference_forward(to_double(qkv), s.B, s.T, s.C, s.NH);
    const std::string what = "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
                             " NH=" + std::to_string(s.NH);
    test::expect_close(out, ref.out, 1e-5, 1e-4, "out " + what);
    test::expect_close(lse, ref.lse, 1e-5, 1e-5, "lse " + what);
  }
}

TEST(Attention, LargeScoresDoNotOverflow) {
  const Shape s{1, 70, 16, 2};
  auto qkv = randn(static_cast<size_t>(s.B) * s.T * 3 * s.C, 50, 12.0f);  // scores in the hundreds
  std::vector<float> out(static_cast<size_t>(s.B) * s.T * s.C), lse(s.B * s.NH * s.T);
  attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.C, s.NH);
  const auto ref = reference_forward(to_double(qkv), s.B, s.T, s.C, s.NH);
  test::expect_close(out, ref.out, 1e-3, 1e-3, "out");
  test::expect_close(lse, ref.lse, 1e-3, 1e-5, "lse");
}

TEST(Attention, BackwardMatchesReference) {
  uint64_t seed = 100;
  for (const Shape& s : kShapes) {
    auto qkv = randn(static_cast<size_t>(s.B) * s.T * 3 * s.C, seed++);
    auto dout = randn(static_cast<size_t>(s.B) * s.T * s.C, seed++);
    std::vector<float> out(dout.size()), lse(s.B * s.NH * s.T), dqkv(qkv.size(), 42.0f);
    attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.C, s.NH);
    attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.C, s.NH);
    const auto ref = reference_backward(to_double(qkv), to_double(dout), s.B, s.T, s.C, s.NH);
    test::expect_close(dqkv, ref, 1e-5, 1e-4, "dqkv T=" + std::to_string(s.T) + " NH=" + std::to_string(s.NH));
  }
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  for (const Shape& s : {Shape{1, 6, 8, 2}, Shape{2, 67, 8, 1}}) {
    auto qkv = randn(static_cast<size_t>(s.B) * s.T * 3 * s.C, 7), R = randn(static_cast<size_t>(s.B) * s.T * s.C, 8);
    auto qkv_d = to_double(qkv), R_d = to_double(R);
    auto loss = [&] { return test::dot(R_d, reference_forward(qkv_d, s.B, s.T, s.C, s.NH).out); };
    const auto ref = reference_backward(qkv_d, R_d, s.B, s.T, s.C, s.NH);
    // Finite differences at every 7th coordinate (the reference is O(T²) per call).
    std::vector<double> fd, ref_sub;
    std::vector<float> got_sub;
    std::vector<float> out(R.size()), lse(s.B * s.NH * s.T), dqkv(qkv.size());
    attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.C, s.NH);
    attention_backward(dqkv.data(), R.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.C, s.NH);
    for (size_t i = 0; i < qkv_d.size(); i += 7) {
      const double saved = qkv_d[i], h = 1e-5;
      qkv_d[i] = saved + h;
      const double up = loss();
      qkv_d[i] = saved - h;
      const double down = loss();
      qkv_d[i] = saved;
      fd.push_back((up - down) / (2 * h));
      ref_sub.push_back(ref[i]);
      got_sub.push_back(dqkv[i]);
    }
    test::expect_close_d(ref_sub, fd, 1e-7, 1e-6, "reference vs FD T=" + std::to_string(s.T));
    test::expect_close(got_sub, fd, 1e-5, 1e-4, "kernel vs FD T=" + std::to_string(s.T));
  }
}

TEST(Attention, ThreadCountIndependent) {
  const Shape s{2, 150, 64, 4};
  auto qkv = randn(static_cast<size_t>(s.B) * s.T * 3 * s.C, 9), dout = randn(static_cast<size_t>(s.B) * s.T * s.C, 10);
  std::vector<float> out[2], lse[2], dqkv[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    out[t].resize(dout.size()), lse[t].resize(s.B * s.NH * s.T), dqkv[t].resize(qkv.size());
    attention_forward(out[t].data(), lse[t].data(), qkv.data(), s.B, s.T, s.C, s.NH);
    attention_backward(dqkv[t].data(), dout.data(), qkv.data(), out[t].data(), lse[t].data(), s.B, s.T, s.C, s.NH);
  }
  EXPECT_TRUE(test::bitwise_equal(out[0], out[1]));
  EXPECT_TRUE(test::bitwise_equal(lse[0], lse[1]));
  EXPECT_TRUE(test::bitwise_equal(dqkv[0], dqkv[1]));
}

TEST(Attention, RejectsHeadsNotDividingChannels) {
  std::vector<float> buf(3 * 10 * 4);
  EXPECT_THROW(attention_forward(buf.data(), buf.data(), buf.data(), 1, 4, 10, 3), Error);
  EXPECT_THROW(attention_decode(buf.data(), buf.data(), 30, buf.data(), buf.data(), 30, 1, 0, 10, 3), Error);
}

// The cached (generation) form gives the forward's output, whether the
// positions come all at once, in chunks or one at a time.
TEST(Attention, DecodeMatchesForward) {
  const int T = 70, C = 48, NH = 3;  // T > 64: more than one forward query block
  auto qkv = randn(static_cast<size_t>(T) * 3 * C, 41, 1.5f);
  const auto ref = reference_forward(to_double(qkv), 1, T, C, NH);
  for (const std::vector<int>& chunks : {std::vector<int>{T}, std::vector<int>{5, 1, 64}, std::vector<int>(T, 1)}) {
    std::vector<float> out(static_cast<size_t>(T) * C, 7.0f);
    int pos = 0;
    for (int n : chunks) {
      // Keys and values straight from the qkv rows (leading dimension 3C), as a cache holds them.
      attention_decode(out.data() + static_cast<size_t>(pos) * C, qkv.data() + static_cast<size_t>(pos) * 3 * C,
                       3 * C, qkv.data() + C, qkv.data() + 2 * C, 3 * C, n, pos, C, NH);
      pos += n;
    }
    test::expect_close(out, ref.out, 1e-5, 1e-4, "decode in " + std::to_string(chunks.size()) + " chunks");
  }
}

}  // namespace
}  // namespace lattice::kernels
