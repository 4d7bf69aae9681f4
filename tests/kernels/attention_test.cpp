// Causal attention: forward (out and lse) vs a naive double implementation
// that materialises the full T×T softmax; backward vs the double closed form
// and central finite differences of the double forward. Grouped-query
// attention (AttentionGqa.*) against multi-head attention on repeated K/V
// heads, the double reference, float finite differences and decoding.
#include <algorithm>
#include <functional>
#include <string>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

using test::error_message;
using test::randn;
using test::to_double;

struct AttnReference {
  std::vector<double> out, lse;
};

// The grouped-query layout of ops.h: a row is [Q: NH·hs | K: NKV·hs | V: NKV·hs],
// query head h reads key/value head h / (NH / NKV). NKV = NH is multi-head.
struct Heads {
  int NH, NKV, hs;
  int64_t ld() const { return static_cast<int64_t>(NH + 2 * NKV) * hs; }
  int64_t width() const { return static_cast<int64_t>(NH) * hs; }  // out's row
  int kv(int h) const { return h / (NH / NKV); }
  // Offset of head h of part (0 = Q, 1 = K, 2 = V) within a row.
  int64_t col(int part, int h) const {
    return part == 0 ? static_cast<int64_t>(h) * hs
                     : width() + (part - 1) * static_cast<int64_t>(NKV) * hs + static_cast<int64_t>(kv(h)) * hs;
  }
};

AttnReference reference_forward(const std::vector<double>& qkv, int B, int T, Heads H) {
  const int hs = H.hs;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  AttnReference r{std::vector<double>(B * T * H.width(), 0.0), std::vector<double>(B * H.NH * T)};
  std::vector<double> s(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H.NH; ++h)
      for (int i = 0; i < T; ++i) {
        const double* q = &qkv[(static_cast<size_t>(b) * T + i) * H.ld() + H.col(0, h)];
        double m = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          const double* k = &qkv[(static_cast<size_t>(b) * T + j) * H.ld() + H.col(1, h)];
          double dot = 0.0;
          for (int d = 0; d < hs; ++d) dot += q[d] * k[d];
          s[j] = scale * dot;
          m = std::max(m, s[j]);
        }
        double l = 0.0;
        for (int j = 0; j <= i; ++j) l += std::exp(s[j] - m);
        r.lse[(b * H.NH + h) * T + i] = m + std::log(l);
        double* o = &r.out[(static_cast<size_t>(b) * T + i) * H.width() + h * hs];
        for (int j = 0; j <= i; ++j) {
          const double p = std::exp(s[j] - m) / l;
          const double* v = &qkv[(static_cast<size_t>(b) * T + j) * H.ld() + H.col(2, h)];
          for (int d = 0; d < hs; ++d) o[d] += p * v[d];
        }
      }
  return r;
}
AttnReference reference_forward(const std::vector<double>& qkv, int B, int T, int C, int NH) {
  return reference_forward(qkv, B, T, Heads{NH, NH, C / NH});
}

// dqkv by the closed form of ops.h, with the full P materialised; a shared
// key/value head collects the gradients of all of its query heads.
std::vector<double> reference_backward(const std::vector<double>& qkv, const std::vector<double>& dout, int B, int T,
                                       Heads H) {
  const int hs = H.hs;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  const auto fwd = reference_forward(qkv, B, T, H);
  std::vector<double> dqkv(qkv.size(), 0.0);
  auto at = [&](const std::vector<double>& x, int b, int t, int part, int h) {
    return &x[(static_cast<size_t>(b) * T + t) * H.ld() + H.col(part, h)];
  };
  auto grad = [&](int b, int t, int part, int h) {
    return &dqkv[(static_cast<size_t>(b) * T + t) * H.ld() + H.col(part, h)];
  };
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H.NH; ++h)
      for (int i = 0; i < T; ++i) {
        const double* dy = &dout[(static_cast<size_t>(b) * T + i) * H.width() + h * hs];
        const double* y = &fwd.out[(static_cast<size_t>(b) * T + i) * H.width() + h * hs];
        double D = 0.0;
        for (int d = 0; d < hs; ++d) D += dy[d] * y[d];
        for (int j = 0; j <= i; ++j) {
          double s = 0.0, dp = 0.0;
          for (int d = 0; d < hs; ++d) {
            s += at(qkv, b, i, 0, h)[d] * at(qkv, b, j, 1, h)[d];
            dp += dy[d] * at(qkv, b, j, 2, h)[d];
          }
          const double p = std::exp(scale * s - fwd.lse[(b * H.NH + h) * T + i]);
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
std::vector<double> reference_backward(const std::vector<double>& qkv, const std::vector<double>& dout, int B, int T,
                                       int C, int NH) {
  return reference_backward(qkv, dout, B, T, Heads{NH, NH, C / NH});
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

// ---- Grouped-query attention ---------------------------------------------------

struct GqaShape {
  int B, T;
  Heads H;
  std::string name() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " NH=" + std::to_string(H.NH) +
           " NKV=" + std::to_string(H.NKV) + " hs=" + std::to_string(H.hs);
  }
};

// T across the 64-row query blocks (dK/dV collect several blocks of several
// heads), groups of 1 (multi-head), 2, 3 and 6 (multi-query).
const GqaShape kGqaShapes[] = {
    {2, 70, {4, 2, 8}}, {1, 130, {6, 1, 16}}, {2, 65, {6, 2, 8}}, {1, 5, {4, 4, 8}}, {2, 129, {8, 4, 16}}};

// The multi-head qkv [B, T, 3·NH·hs] whose K and V heads are the grouped
// layout's repeated: head h of the expanded K is key/value head h / group.
std::vector<float> expand_kv(const std::vector<float>& qkv, int B, int T, Heads H) {
  const Heads mha{H.NH, H.NH, H.hs};
  std::vector<float> x(static_cast<size_t>(B) * T * mha.ld());
  for (int64_t r = 0; r < static_cast<int64_t>(B) * T; ++r)
    for (int part = 0; part < 3; ++part)
      for (int h = 0; h < H.NH; ++h)
        std::copy_n(&qkv[r * H.ld() + H.col(part, h)], H.hs, &x[r * mha.ld() + mha.col(part, h)]);
  return x;
}

// Grouped-query attention is multi-head attention on repeated K/V heads
// (what HF's repeat_kv does). Forward: the kernel runs the same GEMMs on the
// same values, only the leading dimension differs, so the results agree to
// a few f32 ulp (oneDNN promises no bitwise independence of the leading
// dimension, hence a tolerance rather than equality).
TEST(AttentionGqa, ForwardEqualsMhaOnRepeatedKvHeads) {
  uint64_t seed = 300;
  for (const GqaShape& s : kGqaShapes) {
    const Heads mha{s.H.NH, s.H.NH, s.H.hs};
    auto qkv = randn(s.B * s.T * s.H.ld(), seed++, 1.5f);
    const auto expanded = expand_kv(qkv, s.B, s.T, s.H);
    std::vector<float> out(s.B * s.T * s.H.width(), 7.0f), lse(s.B * s.H.NH * s.T, 7.0f);
    std::vector<float> out_mha(out.size()), lse_mha(lse.size());
    attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.H.NH, s.H.NKV, s.H.hs);
    attention_forward(out_mha.data(), lse_mha.data(), expanded.data(), s.B, s.T, mha.NH, mha.NKV, mha.hs);
    test::expect_close(out, to_double(out_mha), 1e-6, 1e-6, "out " + s.name());
    test::expect_close(lse, to_double(lse_mha), 1e-6, 1e-6, "lse " + s.name());
  }
}

// Backward: dQ equals the multi-head dQ (same GEMMs, as above); dK_j and dV_j
// equal the sums over the group's query heads of the multi-head dK_h, dV_h.
// The kernel adds the same per-block GEMM products in another order (one
// running sum over heads and blocks instead of per head, then over heads), so
// the difference is f32 reassociation of at most g·⌈T/64⌉ ≤ 18 terms: a few
// ε = 6e-8 relative to the magnitudes summed, hence 1e-6 of the largest
// gradient plus 2e-6 relative. Dropping a head's term moves them by O(1).
TEST(AttentionGqa, BackwardEqualsSummedMhaGradients) {
  uint64_t seed = 400;
  for (const GqaShape& s : kGqaShapes) {
    const Heads mha{s.H.NH, s.H.NH, s.H.hs};
    auto qkv = randn(s.B * s.T * s.H.ld(), seed++);
    auto dout = randn(s.B * s.T * s.H.width(), seed++);
    const auto expanded = expand_kv(qkv, s.B, s.T, s.H);
    std::vector<float> out(dout.size()), lse(s.B * s.H.NH * s.T), dqkv(qkv.size(), 42.0f);
    std::vector<float> out_mha(dout.size()), lse_mha(lse.size()), dqkv_mha(expanded.size(), 42.0f);
    attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.H.NH, s.H.NKV, s.H.hs);
    attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.H.NH, s.H.NKV, s.H.hs);
    attention_forward(out_mha.data(), lse_mha.data(), expanded.data(), s.B, s.T, mha.NH, mha.NKV, mha.hs);
    attention_backward(dqkv_mha.data(), dout.data(), expanded.data(), out_mha.data(), lse_mha.data(), s.B, s.T, mha.NH,
                       mha.NKV, mha.hs);
    // Fold the expanded gradient: dQ copied, dK/dV of the repeated heads summed in head order (in float).
    std::vector<float> want(qkv.size(), 0.0f);
    for (int64_t r = 0; r < static_cast<int64_t>(s.B) * s.T; ++r)
      for (int part = 0; part < 3; ++part)
        for (int h = 0; h < s.H.NH; ++h)
          for (int d = 0; d < s.H.hs; ++d)
            want[r * s.H.ld() + s.H.col(part, h) + d] += dqkv_mha[r * mha.ld() + mha.col(part, h) + d];
    double largest = 0.0;
    for (float g : want) largest = std::max(largest, std::fabs(static_cast<double>(g)));
    ASSERT_GT(largest, 0.1) << s.name();
    test::expect_close(dqkv, to_double(want), 1e-6 * largest, 2e-6, "dqkv " + s.name());
  }
}

// The same shapes against the double closed form (independent of the
// multi-head kernel): tolerances as the multi-head tests above.
TEST(AttentionGqa, MatchesDoubleReference) {
  uint64_t seed = 500;
  for (const GqaShape& s : kGqaShapes) {
    auto qkv = randn(s.B * s.T * s.H.ld(), seed++);
    auto dout = randn(s.B * s.T * s.H.width(), seed++);
    std::vector<float> out(dout.size()), lse(s.B * s.H.NH * s.T), dqkv(qkv.size(), 42.0f);
    attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.H.NH, s.H.NKV, s.H.hs);
    attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.H.NH, s.H.NKV, s.H.hs);
    const auto ref = reference_forward(to_double(qkv), s.B, s.T, s.H);
    test::expect_close(out, ref.out, 1e-5, 1e-4, "out " + s.name());
    test::expect_close(lse, ref.lse, 1e-5, 1e-5, "lse " + s.name());
    test::expect_close(dqkv, reference_backward(to_double(qkv), to_double(dout), s.B, s.T, s.H), 2e-5, 1e-4,
                       "dqkv " + s.name());
  }
}

// The float kernel's backward against central differences of its own
// forward, L = Σ R ⊙ out, at multi-head, two query heads per key/value head,
// and one shared key/value head. The probed elements cover Q, K and V of
// every key/value head, in the first rows (seen by every later query) and
// the last. h = 1e-2: f32 rounding of L (≈1e-6 here) over 2h stays below
// 1e-4, the O(h²) truncation about 1e-4; 1e-3 is far below the gradients
// (~0.1-1) a missing or doubled head contribution would change.
TEST(AttentionGqa, BackwardMatchesFloatFiniteDifferences) {
  const int B = 2, T = 67, NH = 4, hs = 4;
  for (int NKV : {NH, NH / 2, 1}) {
    const Heads H{NH, NKV, hs};
    auto qkv = randn(B * T * H.ld(), 600 + NKV), R = randn(B * T * H.width(), 610 + NKV);
    std::vector<float> out(R.size()), lse(B * NH * T), dqkv(qkv.size());
    auto loss = [&] {
      attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, hs);
      double l = 0.0;
      for (size_t i = 0; i < out.size(); ++i) l += static_cast<double>(R[i]) * out[i];
      return l;
    };
    loss();
    attention_backward(dqkv.data(), R.data(), qkv.data(), out.data(), lse.data(), B, T, NH, NKV, hs);
    std::vector<int> elements;
    for (int64_t row : {int64_t{0}, int64_t{1}, int64_t{T + 2}, int64_t{2 * T - 1}})
      for (int part = 0; part < 3; ++part)
        for (int h = 0; h < NH; h += part == 0 ? 1 : NH / NKV)  // every Q head, every K/V head
          elements.push_back(static_cast<int>(row * H.ld() + H.col(part, h) + (row + h) % hs));
    test::expect_float_finite_differences(qkv, elements, loss, dqkv.data(), 1e-3, "NKV=" + std::to_string(NKV));
  }
}

TEST(AttentionGqa, ThreadCountIndependent) {
  const int B = 2, T = 150;
  const Heads H{6, 2, 16};
  auto qkv = randn(B * T * H.ld(), 700), dout = randn(B * T * H.width(), 701);
  std::vector<float> out[2], lse[2], dqkv[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    out[t].resize(dout.size()), lse[t].resize(B * H.NH * T), dqkv[t].resize(qkv.size());
    attention_forward(out[t].data(), lse[t].data(), qkv.data(), B, T, H.NH, H.NKV, H.hs);
    attention_backward(dqkv[t].data(), dout.data(), qkv.data(), out[t].data(), lse[t].data(), B, T, H.NH, H.NKV, H.hs);
  }
  EXPECT_TRUE(test::bitwise_equal(out[0], out[1]));
  EXPECT_TRUE(test::bitwise_equal(lse[0], lse[1]));
  EXPECT_TRUE(test::bitwise_equal(dqkv[0], dqkv[1]));
}

// Decoding with a grouped-query cache gives the forward's output at every
// position, whether the positions come all at once, in chunks or one at a
// time, with keys/values read in place from the qkv rows or from a compact
// cache of NKV·hs values a row.
TEST(AttentionGqa, DecodeMatchesForward) {
  const int T = 70;  // > 64: more than one forward query block
  const Heads H{6, 2, 8};
  auto qkv = randn(T * H.ld(), 800, 1.5f);
  std::vector<float> want(T * H.width()), lse(H.NH * T);
  attention_forward(want.data(), lse.data(), qkv.data(), 1, T, H.NH, H.NKV, H.hs);
  const int64_t kv_width = static_cast<int64_t>(H.NKV) * H.hs;
  std::vector<float> keys(T * kv_width), values(T * kv_width);
  for (int t = 0; t < T; ++t) {
    std::copy_n(&qkv[t * H.ld() + H.width()], kv_width, &keys[t * kv_width]);
    std::copy_n(&qkv[t * H.ld() + H.width() + kv_width], kv_width, &values[t * kv_width]);
  }
  for (bool compact : {false, true})
    for (const std::vector<int>& chunks :
         {std::vector<int>{T}, std::vector<int>{5, 1, 58, 6}, std::vector<int>(T, 1)}) {
      std::vector<float> out(T * H.width(), 7.0f);
      int pos = 0;
      for (int n : chunks) {
        const float* k = compact ? keys.data() : qkv.data() + H.width();
        const float* v = compact ? values.data() : qkv.data() + H.width() + kv_width;
        attention_decode(out.data() + pos * H.width(), qkv.data() + pos * H.ld(), H.ld(), k, v,
                         compact ? kv_width : H.ld(), n, pos, H.NH, H.NKV, H.hs);
        pos += n;
      }
      test::expect_close(
          out, to_double(want), 1e-5, 1e-4,
          std::string(compact ? "compact cache, " : "qkv rows, ") + std::to_string(chunks.size()) + " chunks");
    }
}

TEST(AttentionGqa, RejectsQueryHeadsNotMultipleOfKvHeads) {
  const int NH = 6, NKV = 4, hs = 2, T = 3;
  std::vector<float> buf(T * (NH + 2 * NKV) * hs);
  float* x = buf.data();
  const std::string want = "NH=6 query heads cannot share NKV=4 key/value heads (NH must be a multiple of NKV)";
  EXPECT_EQ(error_message([&] { attention_forward(x, x, x, 1, T, NH, NKV, hs); }), "attention_forward: " + want);
  EXPECT_EQ(error_message([&] { attention_backward(x, x, x, x, x, 1, T, NH, NKV, hs); }),
            "attention_backward: " + want);
  EXPECT_EQ(error_message([&] { attention_decode(x, x, NH * hs, x, x, NKV * hs, 1, 0, NH, NKV, hs); }),
            "attention_decode: " + want);
  EXPECT_EQ(error_message([&] { attention_forward(x, x, x, 1, T, NH, 0, hs); }),
            "attention_forward: sizes must be positive, got B=1 T=3 NH=6 NKV=0 hs=2");
  EXPECT_EQ(error_message([&] { attention_decode(x, x, NH * hs, x, x, 2 * hs, 1, 0, NH, 3, hs); }),
            "attention_decode: leading dimensions ldq=12 ld_kv=4 must be at least NH·hs=12 and NKV·hs=6");
}

}  // namespace
}  // namespace lattice::kernels
