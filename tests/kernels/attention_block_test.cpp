// Ring (context-parallel) attention blocks: a causal sequence cut into
// chunks, each query chunk computed against its diagonal chunk and the
// earlier ones and merged by the log-sum-exp, must give attention_forward /
// attention_backward of the whole sequence; so must lattice's balanced ring
// split emulated in one process. The diagonal block alone is the causal
// kernel bit for bit; results do not depend on the thread count; the
// backward of merged full blocks matches float finite differences; every
// argument check has its message.
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

// The grouped-query qkv row of ops.h: [Q: NH·hs | K: NKV·hs | V: NKV·hs].
struct Heads {
  int NH, NKV, hs;
  int64_t ld() const { return static_cast<int64_t>(NH + 2 * NKV) * hs; }
  int64_t width() const { return static_cast<int64_t>(NH) * hs; }
  int64_t kv_width() const { return static_cast<int64_t>(NKV) * hs; }
  std::string name() const {
    return "NH=" + std::to_string(NH) + " NKV=" + std::to_string(NKV) + " hs=" + std::to_string(hs);
  }
};

// A buffer of B problems of `rows` qkv rows each (the whole sequence, or one rank's chunks).
struct QkvRows {
  float* data;
  int rows;
};

// The block of `len` query rows from row q_row of qkv_q against `len` key/value rows from row k_row of qkv_kv.
AttentionBlock chunk_block(QkvRows qkv_q, int q_row, QkvRows qkv_kv, int k_row, int len, int B, Heads H,
                           bool causal) {
  const float* k = qkv_kv.data + k_row * H.ld() + H.width();
  return AttentionBlock{qkv_q.data + q_row * H.ld(), H.ld(), qkv_q.rows * H.ld(), k, k + H.kv_width(), H.ld(),
                        qkv_kv.rows * H.ld(), B, len, len, H.NH, H.NKV, H.hs, causal};
}

// Gradient pointers with the block's strides, into dqkv buffers laid out like the qkv ones.
struct BlockGrads {
  float *dq, *dk, *dv;
};
BlockGrads chunk_grads(QkvRows dqkv_q, int q_row, QkvRows dqkv_kv, int k_row, Heads H) {
  float* dk = dqkv_kv.data + k_row * H.ld() + H.width();
  return BlockGrads{dqkv_q.data + q_row * H.ld(), dk, dk + H.kv_width()};
}

struct Whole {
  std::vector<float> out, lse, dqkv;
};
Whole whole_sequence(const std::vector<float>& qkv, const std::vector<float>& dout, int B, int T, Heads H) {
  Whole w{std::vector<float>(dout.size()), std::vector<float>(static_cast<size_t>(B) * H.NH * T),
          std::vector<float>(qkv.size())};
  attention_forward(w.out.data(), w.lse.data(), qkv.data(), B, T, H.NH, H.NKV, H.hs);
  attention_backward(w.dqkv.data(), dout.data(), qkv.data(), w.out.data(), w.lse.data(), B, T, H.NH, H.NKV, H.hs);
  return w;
}

// The whole causal sequence of 4 chunks of cs rows by blocks: query chunk c
// against its diagonal chunk (causal) and every earlier chunk (full), merged
// in ascending key order or in descending order (the diagonal first, as a
// ring delivers them). The backward runs the same blocks with the final lse
// and D, accumulating into a zeroed dqkv.
Whole chunked(std::vector<float>& qkv, const std::vector<float>& dout, int B, int cs, Heads H, bool descending) {
  const int chunks = 4, T = chunks * cs;
  const QkvRows rows{qkv.data(), T};
  Whole r{std::vector<float>(dout.size()), std::vector<float>(static_cast<size_t>(B) * H.NH * T),
          std::vector<float>(qkv.size(), 0.0f)};
  const QkvRows grad_rows{r.dqkv.data(), T};
  const int64_t out_batch = T * H.width();
  for (int c = 0; c < chunks; ++c) {
    std::vector<float> lse(static_cast<size_t>(B) * H.NH * cs), delta(lse.size());
    std::vector<int> order;
    for (int k = 0; k <= c; ++k) order.push_back(descending ? c - k : k);
    float* out = r.out.data() + c * cs * H.width();
    const float* dy = dout.data() + c * cs * H.width();
    for (size_t n = 0; n < order.size(); ++n)
      attention_block_forward(chunk_block(rows, c * cs, rows, order[n] * cs, cs, B, H, order[n] == c), out,
                              H.width(), out_batch, lse.data(), n > 0);
    attention_delta(delta.data(), dy, out, H.width(), out_batch, B, cs, H.NH, H.hs);
    for (int k : order) {
      const BlockGrads g = chunk_grads(grad_rows, c * cs, grad_rows, k * cs, H);
      attention_block_backward(chunk_block(rows, c * cs, rows, k * cs, cs, B, H, k == c), dy, H.width(), out_batch,
                               lse.data(), delta.data(), g.dq, g.dk, g.dv);
    }
    for (int bh = 0; bh < B * H.NH; ++bh) std::copy_n(&lse[bh * cs], cs, &r.lse[bh * T + c * cs]);
  }
  return r;
}

// out against the whole-sequence kernel: both are f32 with different
// summation orders (one softmax over all keys against per-block softmaxes
// rescaled by exp(lse_b - lse)), and an output element is a weighted sum of
// V entries up to ~5 in size, so they differ by a few 1e-6 (2.1e-6 the
// worst measured); a missing, doubled or wrongly weighted block is off by
// 1e-2 or more. lse agrees to 1e-6 relative, dqkv to 1e-5.
constexpr double kOutAtol = 5e-6, kOutRtol = 1e-6;

const Heads kHeadLayouts[] = {{4, 4, 8}, {4, 2, 8}, {4, 1, 8}, {4, 4, 16}, {4, 2, 16}, {4, 1, 16}};

TEST(AttentionBlock, ChunkedCausalSequenceMatchesWholeSequence) {
  const int B = 2;
  uint64_t seed = 1;
  for (const Heads& H : kHeadLayouts)
    for (int cs : {24, 37, 80}) {
      const int T = 4 * cs;
      auto qkv = randn(B * T * H.ld(), seed++, 1.5f), dout = randn(B * T * H.width(), seed++);
      const Whole want = whole_sequence(qkv, dout, B, T, H);
      for (bool descending : {false, true}) {
        const Whole got = chunked(qkv, dout, B, cs, H, descending);
        const std::string what = H.name() + " chunk=" + std::to_string(cs) + (descending ? " descending" : " ascending");
        test::expect_close(got.out, to_double(want.out), kOutAtol, kOutRtol, "out " + what);
        test::expect_close(got.lse, to_double(want.lse), 1e-6, 1e-6, "lse " + what);
        test::expect_close(got.dqkv, to_double(want.dqkv), 1e-5, 1e-5, "dqkv " + what);
      }
    }
}

// lattice's balanced split over cp ranks: 2cp chunks, rank r holds chunks r
// and 2cp-1-r (its local sequence, 2·cs rows a problem). At ring step s rank
// r holds the keys/values of rank (r - s) mod cp; a query chunk meets a key
// chunk causally when they are the same, fully when the key chunk is
// earlier, not at all when it is later. Every step after the first does two
// full blocks on every rank (the balance the split is for). dK, dV go back
// to the chunk's owner, as the ring returns them.
TEST(AttentionBlock, BalancedRingSplitMatchesWholeSequence) {
  const int B = 2;
  uint64_t seed = 100;
  for (int cp : {2, 4})
    for (const Heads& H : {Heads{4, 4, 8}, Heads{4, 2, 16}, Heads{4, 1, 8}})
      for (int cs : {24, 37}) {
        const int T = 2 * cp * cs, local = 2 * cs;
        auto qkv = randn(B * T * H.ld(), seed++, 1.5f), dout = randn(B * T * H.width(), seed++);
        const Whole want = whole_sequence(qkv, dout, B, T, H);
        auto chunk_of = [&](int rank, int a) { return a == 0 ? rank : 2 * cp - 1 - rank; };
        // Each rank's local qkv, dout, out, lse and delta per local chunk, dqkv.
        std::vector<std::vector<float>> lqkv(cp), ldout(cp), lout(cp), ldqkv(cp);
        std::vector<std::vector<float>> llse(2 * cp), ldelta(2 * cp);  // [rank·2 + local chunk]
        for (int r = 0; r < cp; ++r) {
          lqkv[r].resize(B * local * H.ld());
          ldout[r].resize(B * local * H.width());
          lout[r].assign(ldout[r].size(), 0.0f);
          ldqkv[r].assign(lqkv[r].size(), 0.0f);
          for (int b = 0; b < B; ++b)
            for (int a = 0; a < 2; ++a) {
              const int g = chunk_of(r, a);
              std::copy_n(&qkv[(b * T + g * cs) * H.ld()], cs * H.ld(), &lqkv[r][(b * local + a * cs) * H.ld()]);
              std::copy_n(&dout[(b * T + g * cs) * H.width()], cs * H.width(),
                          &ldout[r][(b * local + a * cs) * H.width()]);
            }
          for (int a = 0; a < 2; ++a) {
            llse[2 * r + a].resize(B * H.NH * cs);
            ldelta[2 * r + a].resize(B * H.NH * cs);
          }
        }
        const int64_t out_batch = local * H.width();
        // Calls f(r, a, src, a2, causal) for every block the ring computes, step by step.
        auto for_each_block = [&](const std::function<void(int, int, int, int, bool)>& f) {
          for (int s = 0; s < cp; ++s)
            for (int r = 0; r < cp; ++r) {
              const int src = (r - s + cp) % cp;
              int full_blocks = 0;
              for (int a = 0; a < 2; ++a)
                for (int a2 = 0; a2 < 2; ++a2) {
                  const int gq = chunk_of(r, a), gk = chunk_of(src, a2);
                  if (gk > gq) continue;
                  full_blocks += gk < gq;
                  f(r, a, src, a2, gk == gq);
                }
              EXPECT_EQ(full_blocks, s == 0 ? 1 : 2) << "cp=" << cp << " rank " << r << " step " << s;
            }
        };
        std::vector<bool> started(2 * cp, false);
        for_each_block([&](int r, int a, int src, int a2, bool causal) {
          const AttentionBlock blk =
              chunk_block({lqkv[r].data(), local}, a * cs, {lqkv[src].data(), local}, a2 * cs, cs, B, H, causal);
          attention_block_forward(blk, lout[r].data() + a * cs * H.width(), H.width(), out_batch,
                                  llse[2 * r + a].data(), started[2 * r + a]);
          started[2 * r + a] = true;
        });
        for (int r = 0; r < cp; ++r)
          for (int a = 0; a < 2; ++a)
            attention_delta(ldelta[2 * r + a].data(), ldout[r].data() + a * cs * H.width(),
                            lout[r].data() + a * cs * H.width(), H.width(), out_batch, B, cs, H.NH, H.hs);
        for_each_block([&](int r, int a, int src, int a2, bool causal) {
          const AttentionBlock blk =
              chunk_block({lqkv[r].data(), local}, a * cs, {lqkv[src].data(), local}, a2 * cs, cs, B, H, causal);
          const BlockGrads g = chunk_grads({ldqkv[r].data(), local}, a * cs, {ldqkv[src].data(), local}, a2 * cs, H);
          attention_block_backward(blk, ldout[r].data() + a * cs * H.width(), H.width(), out_batch,
                                   llse[2 * r + a].data(), ldelta[2 * r + a].data(), g.dq, g.dk, g.dv);
        });
        // Gather the ranks' pieces into whole-sequence layouts.
        std::vector<float> out(want.out.size()), lse(want.lse.size()), dqkv(want.dqkv.size());
        for (int r = 0; r < cp; ++r)
          for (int a = 0; a < 2; ++a) {
            const int g = chunk_of(r, a);
            for (int b = 0; b < B; ++b) {
              std::copy_n(&lout[r][(b * local + a * cs) * H.width()], cs * H.width(),
                          &out[(b * T + g * cs) * H.width()]);
              std::copy_n(&ldqkv[r][(b * local + a * cs) * H.ld()], cs * H.ld(), &dqkv[(b * T + g * cs) * H.ld()]);
            }
            for (int bh = 0; bh < B * H.NH; ++bh)
              std::copy_n(&llse[2 * r + a][bh * cs], cs, &lse[bh * T + g * cs]);
          }
        const std::string what = "cp=" + std::to_string(cp) + " " + H.name() + " chunk=" + std::to_string(cs);
        test::expect_close(out, to_double(want.out), kOutAtol, kOutRtol, "out " + what);
        test::expect_close(lse, to_double(want.lse), 1e-6, 1e-6, "lse " + what);
        test::expect_close(dqkv, to_double(want.dqkv), 1e-5, 1e-5, "dqkv " + what);
      }
}

// The diagonal block, merge == false and zeroed gradients, is the causal
// kernel on that chunk alone, bit for bit: for the whole sequence, and for a
// chunk inside a longer buffer (other strides) against a copy of the chunk.
TEST(AttentionBlock, DiagonalBlockIsCausalAttentionBitwise) {
  const int B = 2;
  for (const Heads& H : {Heads{4, 4, 16}, Heads{6, 2, 8}})
    for (int cs : {37, 150}) {
      const int T = 3 * cs, c = 1;  // the middle chunk of three
      auto qkv = randn(B * T * H.ld(), 300 + cs, 1.5f), dout = randn(B * T * H.width(), 400 + cs);
      std::vector<float> chunk_qkv(B * cs * H.ld()), chunk_dout(B * cs * H.width());
      for (int b = 0; b < B; ++b) {
        std::copy_n(&qkv[(b * T + c * cs) * H.ld()], cs * H.ld(), &chunk_qkv[b * cs * H.ld()]);
        std::copy_n(&dout[(b * T + c * cs) * H.width()], cs * H.width(), &chunk_dout[b * cs * H.width()]);
      }
      const Whole want = whole_sequence(chunk_qkv, chunk_dout, B, cs, H);
      const std::string what = H.name() + " chunk=" + std::to_string(cs);
      // In place in the longer buffer, and the chunk alone as a whole sequence.
      for (bool alone : {false, true}) {
        std::vector<float>& x = alone ? chunk_qkv : qkv;
        const std::vector<float>& dy = alone ? chunk_dout : dout;
        const int rows = alone ? cs : T, row = alone ? 0 : c * cs;
        std::vector<float> out(dy.size(), 7.0f), lse(B * H.NH * cs, 7.0f), delta(lse.size());
        std::vector<float> dqkv(x.size(), 0.0f);
        const AttentionBlock blk = chunk_block({x.data(), rows}, row, {x.data(), rows}, row, cs, B, H, true);
        float* o = out.data() + row * H.width();
        attention_block_forward(blk, o, H.width(), rows * H.width(), lse.data(), false);
        attention_delta(delta.data(), dy.data() + row * H.width(), o, H.width(), rows * H.width(), B, cs, H.NH,
                        H.hs);
        const BlockGrads g = chunk_grads({dqkv.data(), rows}, row, {dqkv.data(), rows}, row, H);
        attention_block_backward(blk, dy.data() + row * H.width(), H.width(), rows * H.width(), lse.data(),
                                 delta.data(), g.dq, g.dk, g.dv);
        std::vector<float> got_out(want.out.size()), got_dqkv(want.dqkv.size());
        for (int b = 0; b < B; ++b) {
          std::copy_n(&out[(b * rows + row) * H.width()], cs * H.width(), &got_out[b * cs * H.width()]);
          std::copy_n(&dqkv[(b * rows + row) * H.ld()], cs * H.ld(), &got_dqkv[b * cs * H.ld()]);
        }
        const std::string where = what + (alone ? " alone" : " in place");
        EXPECT_TRUE(test::bitwise_equal(got_out, want.out)) << where;
        EXPECT_TRUE(test::bitwise_equal(lse, want.lse)) << where;
        EXPECT_TRUE(test::bitwise_equal(got_dqkv, want.dqkv)) << where;
      }
    }
}

TEST(AttentionBlock, ThreadCountIndependent) {
  const int B = 2, cs = 80;
  const Heads H{6, 2, 16};
  auto qkv = randn(B * 4 * cs * H.ld(), 500), dout = randn(B * 4 * cs * H.width(), 501);
  Whole got[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    got[t] = chunked(qkv, dout, B, cs, H, true);
  }
  EXPECT_TRUE(test::bitwise_equal(got[0].out, got[1].out));
  EXPECT_TRUE(test::bitwise_equal(got[0].lse, got[1].lse));
  EXPECT_TRUE(test::bitwise_equal(got[0].dqkv, got[1].dqkv));
}

// Queries [B, Tq, NH·hs] against one or two full (not causal) key/value
// blocks [B, Tk, 2·NKV·hs] (K then V), merged; the loss Σ R ⊙ out. The
// backward of each block uses the final lse and D, so with two blocks this
// also checks that the merged gradient splits over the blocks. h = 1e-2 and
// 1e-3 tolerance as in AttentionGqa.BackwardMatchesFloatFiniteDifferences.
TEST(AttentionBlock, BackwardMatchesFloatFiniteDifferences) {
  const int B = 2, Tq = 5, Tk = 7, NH = 4, NKV = 2, hs = 4;
  const int64_t qw = NH * hs, kvw = 2 * NKV * hs;
  for (int blocks : {1, 2}) {
    auto q = randn(B * Tq * qw, 900 + blocks);
    std::vector<std::vector<float>> kv = {randn(B * Tk * kvw, 910 + blocks), randn(B * Tk * kvw, 920 + blocks)};
    auto R = randn(B * Tq * qw, 930 + blocks);
    std::vector<float> out(R.size()), lse(B * NH * Tq), delta(lse.size());
    auto block = [&](int n) {
      return AttentionBlock{q.data(),  qw, Tq * qw, kv[n].data(), kv[n].data() + NKV * hs, kvw, Tk * kvw, B, Tq,
                            Tk,        NH, NKV,     hs,           false};
    };
    auto loss = [&] {
      for (int n = 0; n < blocks; ++n) attention_block_forward(block(n), out.data(), qw, Tq * qw, lse.data(), n > 0);
      double l = 0.0;
      for (size_t i = 0; i < out.size(); ++i) l += static_cast<double>(R[i]) * out[i];
      return l;
    };
    loss();
    attention_delta(delta.data(), R.data(), out.data(), qw, Tq * qw, B, Tq, NH, hs);
    std::vector<float> dq(q.size(), 0.0f);
    std::vector<std::vector<float>> dkv = {std::vector<float>(kv[0].size(), 0.0f),
                                           std::vector<float>(kv[1].size(), 0.0f)};
    for (int n = 0; n < blocks; ++n)
      attention_block_backward(block(n), R.data(), qw, Tq * qw, lse.data(), delta.data(), dq.data(), dkv[n].data(),
                               dkv[n].data() + NKV * hs);
    auto every = [](size_t n) {
      std::vector<int> e(n);
      for (size_t i = 0; i < n; ++i) e[i] = static_cast<int>(i);
      return e;
    };
    const std::string what = std::to_string(blocks) + " block(s)";
    test::expect_float_finite_differences(q, every(q.size()), loss, dq.data(), 1e-3, "dq " + what);
    for (int n = 0; n < blocks; ++n)
      test::expect_float_finite_differences(kv[n], every(kv[n].size()), loss, dkv[n].data(), 1e-3,
                                            "dk|dv of block " + std::to_string(n) + ", " + what);
  }
}

// The gradients accumulate: a second backward adds the same amount again.
TEST(AttentionBlock, BackwardAccumulates) {
  const int B = 1, T = 70;
  const Heads H{4, 2, 8};
  auto qkv = randn(B * T * H.ld(), 950), dout = randn(B * T * H.width(), 951);
  const Whole want = whole_sequence(qkv, dout, B, T, H);
  std::vector<float> delta(B * H.NH * T), dqkv(qkv.size(), 0.0f);
  attention_delta(delta.data(), dout.data(), want.out.data(), H.width(), T * H.width(), B, T, H.NH, H.hs);
  const AttentionBlock blk = chunk_block({qkv.data(), T}, 0, {qkv.data(), T}, 0, T, B, H, true);
  const BlockGrads g = chunk_grads({dqkv.data(), T}, 0, {dqkv.data(), T}, 0, H);
  for (int n = 0; n < 2; ++n)
    attention_block_backward(blk, dout.data(), H.width(), T * H.width(), want.lse.data(), delta.data(), g.dq, g.dk,
                             g.dv);
  std::vector<double> twice(want.dqkv.size());
  for (size_t i = 0; i < twice.size(); ++i) twice[i] = 2.0 * want.dqkv[i];
  test::expect_close(dqkv, twice, 1e-6, 1e-6, "two backwards");
}

TEST(AttentionBlock, RejectsBadArguments) {
  const int NH = 6, NKV = 2, hs = 2, T = 3, B = 2;
  const int64_t ld = (NH + 2 * NKV) * hs, ow = NH * hs;  // 20, 12
  std::vector<float> buf(B * T * ld * 4), results(B * T * ld * 4);
  float* x = buf.data();
  float* r = results.data();  // out and lse of the calls that run
  const AttentionBlock good{x, ld, T * ld, x, x, ld, T * ld, B, T, T, NH, NKV, hs, true};
  auto both = [&](const AttentionBlock& blk, int64_t ldo, int64_t out_batch, const std::string& want) {
    EXPECT_EQ(error_message([&] { attention_block_forward(blk, x, ldo, out_batch, x, false); }),
              "attention_block_forward: " + want);
    EXPECT_EQ(error_message([&] { attention_block_backward(blk, x, ldo, out_batch, x, x, x, x, x); }),
              "attention_block_backward: " + want);
  };
  AttentionBlock b = good;
  b.Tk = 0;
  both(b, ow, T * ow, "sizes must be positive, got B=2 Tq=3 Tk=0 NH=6 NKV=2 hs=2");
  b = good, b.NKV = 4;
  both(b, ow, T * ow, "NH=6 query heads cannot share NKV=4 key/value heads (NH must be a multiple of NKV)");
  b = good, b.Tk = 4;
  both(b, ow, T * ow, "a causal (diagonal) block needs Tq == Tk, got Tq=3 Tk=4");
  b.causal = false, b.kv_batch = b.Tk * ld;  // a full block may have Tq != Tk
  EXPECT_EQ(error_message([&] { attention_block_forward(b, r, ow, T * ow, r + B * T * ow, false); }), "(no error)");
  b = good, b.ldkv = 3;
  both(b, ow, T * ow, "leading dimensions ldq=20 ldkv=3 ldo=12 must be at least NH·hs=12, NKV·hs=4 and NH·hs=12");
  b = good;
  both(b, 11, T * 11, "leading dimensions ldq=20 ldkv=20 ldo=11 must be at least NH·hs=12, NKV·hs=4 and NH·hs=12");
  both(b, ow, T * ow - 1,
       "batch strides q_batch=60 kv_batch=60 out_batch=35 must be at least Tq·ldq=60, Tk·ldkv=60 and Tq·ldo=36");
  b.q_batch = 2 * ld;
  both(b, ow, T * ow,
       "batch strides q_batch=40 kv_batch=60 out_batch=36 must be at least Tq·ldq=60, Tk·ldkv=60 and Tq·ldo=36");
  b = good, b.B = 1, b.q_batch = 0, b.kv_batch = 0;  // one problem: the batch strides are not used
  EXPECT_EQ(error_message([&] { attention_block_forward(b, r, ow, 0, r + T * ow, false); }), "(no error)");

  EXPECT_EQ(error_message([&] { attention_delta(x, x, x, ow, T * ow, B, 0, NH, hs); }),
            "attention_delta: sizes must be positive, got B=2 T=0 NH=6 hs=2");
  EXPECT_EQ(error_message([&] { attention_delta(x, x, x, ow - 1, T * ow, B, T, NH, hs); }),
            "attention_delta: leading dimension ld=11 must be at least NH·hs=12");
  EXPECT_EQ(error_message([&] { attention_delta(x, x, x, ow, T * ow - 1, B, T, NH, hs); }),
            "attention_delta: batch stride 35 must be at least T·ld=36");
}

}  // namespace
}  // namespace lattice::kernels
