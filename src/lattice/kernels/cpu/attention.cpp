// Causal multi-head self-attention, blocked by query rows (flash-attention
// style: the T×T probabilities are never stored; the forward keeps only the
// output and the log-sum-exp of each row, the backward recomputes P from it).
//
// For batch b, head h (hs = C/NH, scale = 1/√hs) and a block of query rows
// i ∈ [i0, i1) (kQueryBlock rows), only keys j < i1 can be visible, so key
// blocks entirely in the future are never touched:
//   S  = scale · Q[i0:i1] · K[0:i1]ᵀ                  small GEMM into a per-thread tile
//   S_ij = -inf for j > i ; m_i = max_j S_ij ; l_i = Σ_j exp(S_ij - m_i)
//   E  = exp(S - m) ; lse_i = m_i + log l_i
//   out[i0:i1] = (E · V[0:i1]) / l                      small GEMM, then a row scale
// The tile is [kQueryBlock, i1] floats (256 KiB at T = 1024), so it stays in
// L2 between the two GEMMs and the softmax; with the whole visible key range in
// one tile the softmax is exact in one step (no online rescaling is needed).
//
// Backward for one (b, h), D_i = Σ_d dout_id·out_id, for each query block:
//   P   = exp(scale · Q Kᵀ - lse)  (masked)             recomputed
//   dV[0:i1] += Pᵀ · dout[i0:i1]
//   dP  = dout[i0:i1] · V[0:i1]ᵀ
//   dS  = P ⊙ (dP - D)
//   dQ[i0:i1]  = scale · dS · K[0:i1]
//   dK[0:i1]  += scale · dSᵀ · Q[i0:i1]
// Forward tasks are (b, h, query block); backward tasks are (b, h), because
// dK and dV of a head collect contributions from all of its query blocks.
// Every task writes disjoint memory and runs its GEMMs on one thread, so the
// result is the same for every thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/kernels/cpu/gemm_internal.h"
#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/cpu/vec_math.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

constexpr int kQueryBlock = 64;

// Per-thread tiles, owned by the calling thread (so two threads calling
// attention at once do not share them) and grown once to the largest T seen.
float* workspace(int64_t floats_per_thread, int threads) {
  thread_local Buffer buffer;
  const size_t bytes = sizeof(float) * static_cast<size_t>(floats_per_thread) * threads;
  if (buffer.bytes() < bytes) buffer.ensure(bytes, MemCategory::Workspace);
  return buffer.as<float>();
}

void check_args(int B, int T, int C, int NH) {
  LATTICE_CHECK(B > 0 && T > 0 && C > 0 && NH > 0,
                "attention: sizes must be positive, got B=" << B << " T=" << T << " C=" << C << " NH=" << NH);
  LATTICE_CHECK(C % NH == 0, "attention: C=" << C << " is not divisible by NH=" << NH);
}

// kCausalMask[kQueryBlock - 1 - r + c] is 0 for c ≤ r and -inf for c > r: row
// r of a diagonal block, shifted, masks the future keys with one add per
// element, so the loops below have no branches or per-row split points and
// vectorise over whole rows (rows are only 64..T floats long; scalar
// remainder loops at every causal boundary cost as much as the vector work).
struct CausalMask {
  float values[2 * kQueryBlock];
  CausalMask() {
    for (int i = 0; i < 2 * kQueryBlock; ++i) values[i] = i < kQueryBlock ? 0.0f : -INFINITY;
  }
};
const CausalMask kCausalMask;

// The tile's columns [i0, keys) are the diagonal block: adds -inf above the
// diagonal (key j > query i0 + r).
void mask_future(float* S, int rows, int keys, int i0) {
  const int width = keys - i0;
  for (int r = 0; r < rows; ++r) {
    float* s = S + static_cast<int64_t>(r) * keys + i0;
    const float* mask = kCausalMask.values + (kQueryBlock - 1 - r);
    for (int c = 0; c < width; ++c) s[c] += mask[c];
  }
}

// Row r of the [rows, keys] tile S (future keys already -inf). Replaces S by
// the unnormalised E = exp(S - m) and writes inv_l = 1/l and lse = m + log l
// per row; the 1/l is applied to the hs-wide output rows after the PV product
// instead of to the keys-wide tile.
void softmax_rows(float* S, float* lse, float* inv_l, int rows, int keys) {
  for (int r = 0; r < rows; ++r) {
    float* s = S + static_cast<int64_t>(r) * keys;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int j = 0; j < keys; ++j) m = s[j] > m ? s[j] : m;
    float l = 0.0f;
#pragma omp simd reduction(+ : l)
    for (int j = 0; j < keys; ++j) {
      const float e = cpu::exp_nonpositive(s[j] - m);  // exp(-inf) = 0
      s[j] = e;
      l += e;
    }
    inv_l[r] = 1.0f / l;
    lse[r] = m + std::log(l);
  }
}

// out[r, :] *= inv_l[r] for the rows of one block of one head.
void scale_rows(float* out, const float* inv_l, int rows, int hs, int64_t ld) {
  for (int r = 0; r < rows; ++r) {
    float* o = out + r * ld;
    const float f = inv_l[r];
    for (int d = 0; d < hs; ++d) o[d] *= f;
  }
}

// S (future keys already -inf) ← P = exp(S - lse_i); dP ← dS = P ⊙ (dP - D_i).
void recompute_p_and_ds(float* S, float* dP, const float* lse, const float* D, int rows, int keys) {
  for (int r = 0; r < rows; ++r) {
    float* s = S + static_cast<int64_t>(r) * keys;
    float* dp = dP + static_cast<int64_t>(r) * keys;
    const float l = lse[r], d = D[r];
    for (int j = 0; j < keys; ++j) {
      const float p = cpu::exp_nonpositive(s[j] - l);
      s[j] = p;
      dp[j] = p * (dp[j] - d);
    }
  }
}

// D_i = Σ_d dout_id · out_id for the T rows of one head.
void row_dots(float* D, const float* dout, const float* out, int T, int hs, int64_t ld) {
  for (int i = 0; i < T; ++i) {
    const float* a = dout + i * ld;
    const float* b = out + i * ld;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int d = 0; d < hs; ++d) acc += a[d] * b[d];
    D[i] = acc;
  }
}

// The small per-block GEMMs (rows ≤ 64, inner or outer size hs) run on the
// calling OpenMP thread. dnnl_sgemm and a cached matmul primitive measured the
// same here; dnnl_sgemm needs no per-shape cache.
void small_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cpu::gemm_dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void zero_rows(float* x, int rows, int cols, int64_t ld) {
  for (int i = 0; i < rows; ++i) std::fill(x + i * ld, x + i * ld + cols, 0.0f);
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) {
  check_args(B, T, C, NH);
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t ld_qkv = 3 * static_cast<int64_t>(C);
  const int query_blocks = (T + kQueryBlock - 1) / kQueryBlock;
  const int64_t heads = static_cast<int64_t>(B) * NH;
  const int64_t tile = static_cast<int64_t>(kQueryBlock) * T;
  const int64_t per_thread = tile + kQueryBlock;  // exp(S - m) tile, 1/l
  float* tiles = workspace(per_thread, omp_get_max_threads());

  // Largest query blocks (most keys) first, for the dynamic schedule.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < heads * query_blocks; ++task) {
    const int qb = query_blocks - 1 - static_cast<int>(task / heads);
    const int64_t bh = task % heads;
    const int64_t b = bh / NH, h = bh % NH;
    const int i0 = qb * kQueryBlock, i1 = std::min(T, i0 + kQueryBlock), rows = i1 - i0, keys = i1;
    const float* q = qkv + (b * T + i0) * ld_qkv + h * hs;
    const float* k = qkv + b * T * ld_qkv + C + h * hs;
    const float* v = qkv + b * T * ld_qkv + 2 * C + h * hs;
    float* S = tiles + omp_get_thread_num() * per_thread;
    float* inv_l = S + tile;
    float* o = out + (b * T + i0) * C + h * hs;
    small_gemm(false, true, rows, keys, hs, scale, q, ld_qkv, k, ld_qkv, 0.0f, S, keys);
    cpu::simd([&] { return mask_future(S, rows, keys, i0); });
    cpu::simd([&] { return softmax_rows(S, lse + bh * T + i0, inv_l, rows, keys); });
    small_gemm(false, false, rows, hs, keys, 1.0f, S, keys, v, ld_qkv, 0.0f, o, C);
    cpu::simd([&] { return scale_rows(o, inv_l, rows, hs, C); });
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int C, int NH) {
  check_args(B, T, C, NH);
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t ld_qkv = 3 * static_cast<int64_t>(C);
  const int query_blocks = (T + kQueryBlock - 1) / kQueryBlock;
  const int64_t heads = static_cast<int64_t>(B) * NH;
  const int64_t tile = static_cast<int64_t>(kQueryBlock) * T;
  const int64_t per_thread = 2 * tile + T;  // P tile, dP tile, D
  float* tiles = workspace(per_thread, omp_get_max_threads());

#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / NH, h = bh % NH;
    float* P = tiles + omp_get_thread_num() * per_thread;
    float* dP = P + tile;
    float* D = dP + tile;
    const float* q = qkv + b * T * ld_qkv + h * hs;
    const float* k = q + C;
    const float* v = q + 2 * C;
    float* dq = dqkv + b * T * ld_qkv + h * hs;
    float* dk = dq + C;
    float* dv = dq + 2 * C;
    const float* dy = dout + b * T * C + h * hs;
    const float* lse_bh = lse + bh * T;
    cpu::simd([&] { return row_dots(D, dy, out + b * T * C + h * hs, T, hs, C); });
    zero_rows(dk, T, hs, ld_qkv);
    zero_rows(dv, T, hs, ld_qkv);
    for (int qb = 0; qb < query_blocks; ++qb) {
      const int i0 = qb * kQueryBlock, i1 = std::min(T, i0 + kQueryBlock), rows = i1 - i0, keys = i1;
      const float* q_blk = q + i0 * ld_qkv;
      const float* dy_blk = dy + static_cast<int64_t>(i0) * C;
      small_gemm(false, true, rows, keys, hs, scale, q_blk, ld_qkv, k, ld_qkv, 0.0f, P, keys);
      small_gemm(false, true, rows, keys, hs, 1.0f, dy_blk, C, v, ld_qkv, 0.0f, dP, keys);
      cpu::simd([&] { return mask_future(P, rows, keys, i0); });
      cpu::simd([&] { return recompute_p_and_ds(P, dP, lse_bh + i0, D + i0, rows, keys); });
      small_gemm(true, false, keys, hs, rows, 1.0f, P, keys, dy_blk, C, 1.0f, dv, ld_qkv);
      small_gemm(false, false, rows, hs, keys, scale, dP, keys, k, ld_qkv, 0.0f, dq + i0 * ld_qkv, ld_qkv);
      small_gemm(true, false, keys, hs, rows, scale, dP, keys, q_blk, ld_qkv, 1.0f, dk, ld_qkv);
    }
  }
}

// One query row against keys [0, visible): scores into s, then out = softmax(s)·V.
void decode_row(float* out, const float* q, const float* keys, const float* values, int64_t ld_kv, int visible,
                int hs, float scale, float* s) {
  float m = -INFINITY;
  for (int j = 0; j < visible; ++j) {
    const float* k = keys + j * ld_kv;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int d = 0; d < hs; ++d) dot += q[d] * k[d];
    s[j] = scale * dot;
    m = s[j] > m ? s[j] : m;
  }
  float l = 0.0f;
#pragma omp simd reduction(+ : l)
  for (int j = 0; j < visible; ++j) {
    s[j] = cpu::exp_nonpositive(s[j] - m);
    l += s[j];
  }
  for (int d = 0; d < hs; ++d) out[d] = 0.0f;
  for (int j = 0; j < visible; ++j) {
    const float* v = values + j * ld_kv;
    const float p = s[j];
    for (int d = 0; d < hs; ++d) out[d] += p * v[d];
  }
  const float inv_l = 1.0f / l;
  for (int d = 0; d < hs; ++d) out[d] *= inv_l;
}

void attention_decode(float* out, const float* q, int64_t ldq, const float* keys, const float* values,
                      int64_t ld_kv, int n, int pos, int C, int NH) {
  check_args(1, n, C, NH);
  LATTICE_CHECK(pos >= 0, "attention_decode: position must be >= 0, got " << pos);
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t visible_max = static_cast<int64_t>(pos) + n;
  float* scores = workspace(visible_max, omp_get_max_threads());
#pragma omp parallel for schedule(dynamic, 1) if (static_cast<int64_t>(n) * NH * visible_max * hs > (1 << 16))
  for (int64_t task = 0; task < static_cast<int64_t>(n) * NH; ++task) {
    const int i = static_cast<int>(task / NH), h = static_cast<int>(task % NH);
    cpu::simd([&] { return decode_row(out + static_cast<int64_t>(i) * C + h * hs, q + i * ldq + h * hs, keys + h * hs, values + h * hs,
               ld_kv, pos + i + 1, hs, scale, scores + omp_get_thread_num() * visible_max); });
  }
}

}  // namespace lattice::kernels
