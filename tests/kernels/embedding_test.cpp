// Token + position embedding forward and backward (with repeated tokens).
#include "lattice/kernels/ops.h"
#include "test_util.h"

namespace lattice::kernels {
namespace {

using test::randn;

TEST(Embedding, ForwardAndBackwardWithRepeatedTokens) {
  const int B = 3, T = 7, C = 130, V = 11;  // C not a multiple of the column block
  auto wte = randn(V * C, 1), wpe = randn(T * C, 2), dout = randn(B * T * C, 3);
  std::vector<int32_t> tokens(B * T);
  for (int i = 0; i < B * T; ++i) tokens[i] = (i * 5) % 4;  // tokens 0..3, each many times
  std::vector<float> out(B * T * C);
  embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c)
        ASSERT_EQ(out[(b * T + t) * C + c], wte[tokens[b * T + t] * C + c] + wpe[t * C + c]);

  std::vector<double> ref_wte(V * C, 0.0), ref_wpe(T * C, 0.0);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) {
        ref_wte[tokens[b * T + t] * C + c] += dout[(b * T + t) * C + c];
        ref_wpe[t * C + c] += dout[(b * T + t) * C + c];
      }
  std::vector<float> dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  test::expect_close(dwte, ref_wte, 1e-5, 1e-5, "dwte");
  test::expect_close(dwpe, ref_wpe, 1e-5, 1e-5, "dwpe");
  for (int c = 0; c < C; ++c) EXPECT_EQ(dwte[7 * C + c], 0.0f);  // unused token row untouched
  // Accumulates.
  embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  for (auto& v : ref_wte) v *= 2;
  for (auto& v : ref_wpe) v *= 2;
  test::expect_close(dwte, ref_wte, 2e-5, 1e-5, "dwte twice");
  test::expect_close(dwpe, ref_wpe, 2e-5, 1e-5, "dwpe twice");
}

// Σ R ⊙ out differentiated by central differences of the double forward.
TEST(Embedding, BackwardMatchesFiniteDifferences) {
  const int B = 2, T = 3, C = 5, V = 4;
  auto wte = randn(V * C, 5), wpe = randn(T * C, 6), R = randn(B * T * C, 7);
  const std::vector<int32_t> tokens = {1, 3, 1, 0, 1, 2};
  auto wte_d = test::to_double(wte), wpe_d = test::to_double(wpe), R_d = test::to_double(R);
  auto loss = [&] {
    double s = 0.0;
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c)
          s += R_d[(b * T + t) * C + c] * (wte_d[tokens[b * T + t] * C + c] + wpe_d[t * C + c]);
    return s;
  };
  const auto fd_wte = test::finite_difference(wte_d, loss), fd_wpe = test::finite_difference(wpe_d, loss);
  std::vector<float> dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  embedding_backward(dwte.data(), dwpe.data(), R.data(), tokens.data(), B, T, C);
  test::expect_close(dwte, fd_wte, 1e-6, 1e-6, "dwte vs FD");
  test::expect_close(dwpe, fd_wpe, 1e-6, 1e-6, "dwpe vs FD");
}

TEST(Embedding, BackwardThreadCountIndependent) {
  const int B = 4, T = 64, C = 768, V = 50;
  auto dout = randn(B * T * C, 4);
  std::vector<int32_t> tokens(B * T);
  for (int i = 0; i < B * T; ++i) tokens[i] = (i * 7) % V;
  std::vector<float> dwte[2], dwpe[2];
  for (int t = 0; t < 2; ++t) {
    test::ThreadScope threads(t + 1);
    dwte[t].assign(V * C, 0.0f), dwpe[t].assign(T * C, 0.0f);
    embedding_backward(dwte[t].data(), dwpe[t].data(), dout.data(), tokens.data(), B, T, C);
  }
  EXPECT_TRUE(test::bitwise_equal(dwte[0], dwte[1]));
  EXPECT_TRUE(test::bitwise_equal(dwpe[0], dwpe[1]));
}

// The vocabulary-parallel conventions: a negative token is a row another rank
// holds (zero wte term, no wte gradient), a null wpe adds no positions.
TEST(Embedding, NegativeTokensAndNoPositions) {
  const int B = 1, T = 3, C = 5, V = 4;
  auto wte = randn(V * C, 5), wpe = randn(T * C, 6), dout = randn(B * T * C, 7);
  const std::vector<int32_t> tokens = {2, -1, 0};
  std::vector<float> out(B * T * C), bare(B * T * C);
  embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  embedding_forward(bare.data(), tokens.data(), wte.data(), nullptr, B, T, C);
  for (int c = 0; c < C; ++c) {
    EXPECT_EQ(out[c], wte[2 * C + c] + wpe[c]);
    EXPECT_EQ(out[C + c], wpe[C + c]);  // another rank's token: positions only
    EXPECT_EQ(bare[c], wte[2 * C + c]);
    EXPECT_EQ(bare[C + c], 0.0f);
    EXPECT_EQ(bare[2 * C + c], wte[c]);
  }
  std::vector<float> dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  for (int c = 0; c < C; ++c) {
    EXPECT_EQ(dwte[2 * C + c], dout[c]);
    EXPECT_EQ(dwte[c], dout[2 * C + c]);
    EXPECT_EQ(dwte[1 * C + c], 0.0f);
    EXPECT_EQ(dwte[3 * C + c], 0.0f);
    EXPECT_EQ(dwpe[C + c], dout[C + c]);  // wpe's gradient counts every position
  }
}

}  // namespace
}  // namespace lattice::kernels
