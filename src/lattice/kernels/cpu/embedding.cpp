// Token + position embedding.
//   out[b,t,:] = wte[tokens[b,t], :] + wpe[t, :]
//   dwte[tokens[b,t], :] += dout[b,t,:] ; dwpe[t, :] += Σ_b dout[b,t,:]
#include <algorithm>

#include "lattice/core/error.h"
#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/cpu/vec_math.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

constexpr int64_t kColumnBlock = 64;  // columns per task in the scatter-add

void forward_row(float* out, const float* wte_row, const float* wpe_row, int C) {
  if (wte_row && wpe_row) {
    for (int c = 0; c < C; ++c) out[c] = wte_row[c] + wpe_row[c];
  } else if (wte_row || wpe_row) {
    const float* row = wte_row ? wte_row : wpe_row;
    for (int c = 0; c < C; ++c) out[c] = row[c];
  } else {
    for (int c = 0; c < C; ++c) out[c] = 0.0f;
  }
}

// The same token may occur many times, so the rows of dwte cannot be split
// among threads; the columns can. Each task owns a block of columns of every
// row and walks the tokens in order: no races, and the same sums for any
// thread count.
void backward_columns(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B, int T, int C,
                      int64_t col_begin, int64_t col_end) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const float* dy = dout + (static_cast<int64_t>(b) * T + t) * C;
      const int32_t token = tokens[b * T + t];
      if (token >= 0) {
        float* dw = dwte + static_cast<int64_t>(token) * C;
        for (int64_t c = col_begin; c < col_end; ++c) dw[c] += dy[c];
      }
      if (dwpe) {
        float* dp = dwpe + static_cast<int64_t>(t) * C;
        for (int64_t c = col_begin; c < col_end; ++c) dp[c] += dy[c];
      }
    }
}

}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B, int T, int C) {
  LATTICE_CHECK(B >= 0 && T >= 0 && C >= 0, "embedding_forward: negative size B=" << B << " T=" << T << " C=" << C);
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < static_cast<int64_t>(B) * T; ++bt) {
    const int64_t t = bt % T;
    const float* wte_row = tokens[bt] >= 0 ? wte + static_cast<int64_t>(tokens[bt]) * C : nullptr;
    cpu::simd([&] { return forward_row(out + bt * C, wte_row, wpe ? wpe + t * C : nullptr, C); });
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B, int T, int C) {
  const int64_t blocks = (C + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk)
    cpu::simd([&] { return backward_columns(dwte, dwpe, dout, tokens, B, T, C, blk * kColumnBlock,
                     std::min<int64_t>(C, (blk + 1) * kColumnBlock)); });
}

}  // namespace lattice::kernels
