// Causal self-attention with NH query heads sharing NKV key/value heads
// (grouped-query; NKV = NH is multi-head attention), blocked by query rows
// (flash-attention style: the T×T probabilities are never stored; the forward
// keeps only the output and the log-sum-exp of each row, the backward
// recomputes P from it). A qkv row is [Q: NH·hs | K: NKV·hs | V: NKV·hs];
// query head h reads key/value head j = h / group, group = NH / NKV. Nothing
// is expanded: the GEMMs read K_j and V_j in place for every query head.
//
// For batch b, query head h (scale = 1/√hs) and a block of query rows
// i ∈ [i0, i1) (kQueryBlock rows), only keys k < i1 can be visible, so key
// blocks entirely in the future are never touched:
//   S  = scale · Q_h[i0:i1] · K_j[0:i1]ᵀ               small GEMM into a per-thread tile
//   S_ik = -inf for k > i ; m_i = max_k S_ik ; l_i = Σ_k exp(S_ik - m_i)
//   E  = exp(S - m) ; lse_i = m_i + log l_i
//   out_h[i0:i1] = (E · V_j[0:i1]) / l                  small GEMM, then a row scale
// The tile is [kQueryBlock, i1] floats (256 KiB at T = 1024), so it stays in
// L2 between the two GEMMs and the softmax; with the whole visible key range in
// one tile the softmax is exact in one step (no online rescaling is needed).
//
// Backward for one (b, h), D_i = Σ_d dout_id·out_id, for each query block:
//   P   = exp(scale · Q_h K_jᵀ - lse)  (masked)         recomputed
//   dV_j[0:i1] += Pᵀ · dout_h[i0:i1]
//   dP  = dout_h[i0:i1] · V_j[0:i1]ᵀ
//   dS  = P ⊙ (dP - D)
//   dQ_h[i0:i1] = scale · dS · K_j[0:i1]
//   dK_j[0:i1] += scale · dSᵀ · Q_h[i0:i1]
// Forward tasks are (b, h, query block). Backward tasks are (b, j): dK_j and
// dV_j collect contributions from every query block of every query head of
// the group, so one task owns them and adds the query heads in ascending
// order, each head's query blocks in ascending order (beta = 1 GEMMs into
// the zeroed dK_j, dV_j). Every task writes disjoint memory and runs its
// GEMMs on one thread, so the result is the same for every thread count. With
// NKV = NH a task is one head: exactly the multi-head kernel.
//
// The loops are written for one block of ring attention (ops.h: a query
// chunk against a key/value chunk, any strides, attention_block.cpp): the
// causal entry points run them on the diagonal block of the whole sequence;
// an off-diagonal block sees all Tk keys (no mask, keys = Tk for every query
// block), and a merging forward combines its rows with the earlier blocks'
// by their log-sum-exp. The backward takes D precomputed per (b, h)
// (attention_delta), because with ring attention it comes from the final
// merged output, not from the block's.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/kernels/cpu/attention_internal.h"
#include "lattice/kernels/cpu/gemm_internal.h"
#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/cpu/vec_math.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

constexpr int kQueryBlock = 64;

// Per-thread tiles, owned by the calling thread (so two threads calling
// attention at once do not share them) and grown once to the largest T seen.
// Slot 0 holds the tiles, slot 1 the backward's D, which lives beside them.
float* workspace(int slot, int64_t floats_per_thread, int threads) {
  thread_local Buffer buffers[2];
  Buffer& buffer = buffers[slot];
  const size_t bytes = sizeof(float) * static_cast<size_t>(floats_per_thread) * threads;
  if (buffer.bytes() < bytes) buffer.ensure(bytes, MemCategory::Workspace);
  return buffer.as<float>();
}

void check_args(const char* what, int B, int T, int NH, int NKV, int hs) {
  LATTICE_CHECK(B > 0 && T > 0 && NH > 0 && NKV > 0 && hs > 0, what << ": sizes must be positive, got B=" << B
                                                                    << " T=" << T << " NH=" << NH << " NKV=" << NKV
                                                                    << " hs=" << hs);
  LATTICE_CHECK(NH % NKV == 0, what << ": NH=" << NH << " query heads cannot share NKV=" << NKV
                                    << " key/value heads (NH must be a multiple of NKV)");
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

// Merges a block's rows (out_b, lse_b) into the rows (out, lse) of the
// attention over earlier key blocks. With m = max and n = min of the two
// lse, one of exp(lse - m), exp(lse_b - m) is 1 and the other e = exp(n - m):
//   lse' = m + log1p(e) ; out' = exp(lse - lse')·out + exp(lse_b - lse')·out_b
// where the weights are 1/(1 + e) for the larger lse and e/(1 + e) for the
// smaller. No exponential has a positive argument, and the weights come
// from the difference n - m, not from the rounded lse' (its rounding error,
// ~1e-6 at |lse| ≈ 10, would otherwise scale the whole output row).
// lse = -inf (no keys yet) gives lse_b, out_b.
void merge_rows(float* out, int64_t ldo, float* lse, const float* out_b, const float* lse_b, int rows, int hs) {
  for (int r = 0; r < rows; ++r) {
    const bool earlier_larger = lse[r] >= lse_b[r];
    const float m = earlier_larger ? lse[r] : lse_b[r], n = earlier_larger ? lse_b[r] : lse[r];
    const float e = std::exp(n - m), w_larger = 1.0f / (1.0f + e), w_smaller = e * w_larger;
    const float a = earlier_larger ? w_larger : w_smaller, c = earlier_larger ? w_smaller : w_larger;
    float* o = out + r * ldo;
    const float* o_b = out_b + static_cast<int64_t>(r) * hs;
    for (int d = 0; d < hs; ++d) o[d] = a * o[d] + c * o_b[d];
    lse[r] = m + std::log1p(e);
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

int attention_head_size(int C, int NH) {
  LATTICE_CHECK(C > 0 && NH > 0, "attention: sizes must be positive, got C=" << C << " NH=" << NH);
  LATTICE_CHECK(C % NH == 0, "attention: C=" << C << " is not divisible by NH=" << NH);
  return C / NH;
}

namespace cpu {

// A non-causal block sees every key, so each query block's tile spans all Tk
// keys and needs no mask; the diagonal block sees keys [0, i1) of query block
// [i0, i1). merge == true computes the block into the thread's scratch and
// merges it into out and lse by merge_rows.
void attention_block_forward_unchecked(const AttentionBlock& a, float* out, int64_t ldo, int64_t out_batch,
                                       float* lse, bool merge) {
  const int hs = a.hs, group = a.NH / a.NKV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int query_blocks = (a.Tq + kQueryBlock - 1) / kQueryBlock;
  const int64_t heads = static_cast<int64_t>(a.B) * a.NH;
  const int64_t tile = static_cast<int64_t>(kQueryBlock) * a.Tk;
  const int64_t block_result = merge ? static_cast<int64_t>(kQueryBlock) * (hs + 1) : 0;  // out_b, lse_b
  const int64_t per_thread = tile + kQueryBlock + block_result;                          // exp(S - m) tile, 1/l
  float* tiles = workspace(0, per_thread, omp_get_max_threads());

  // Largest query blocks (most keys) first, for the dynamic schedule.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < heads * query_blocks; ++task) {
    const int qb = query_blocks - 1 - static_cast<int>(task / heads);
    const int64_t bh = task % heads;
    const int64_t b = bh / a.NH, h = bh % a.NH, j = h / group;
    const int i0 = qb * kQueryBlock, i1 = std::min(a.Tq, i0 + kQueryBlock), rows = i1 - i0;
    const int keys = a.causal ? i1 : a.Tk;
    const float* q = a.q + b * a.q_batch + i0 * a.ldq + h * hs;
    const float* k = a.k + b * a.kv_batch + j * hs;
    const float* v = a.v + b * a.kv_batch + j * hs;
    float* S = tiles + omp_get_thread_num() * per_thread;
    float* inv_l = S + tile;
    float* o = out + b * out_batch + i0 * ldo + h * hs;
    float* lse_rows = lse + bh * a.Tq + i0;
    // Where this block's own result goes: straight to out and lse, or to the scratch to be merged.
    float* o_b = merge ? inv_l + kQueryBlock : o;
    float* lse_b = merge ? o_b + kQueryBlock * hs : lse_rows;
    const int64_t ld_b = merge ? hs : ldo;
    small_gemm(false, true, rows, keys, hs, scale, q, a.ldq, k, a.ldkv, 0.0f, S, keys);
    if (a.causal) cpu::simd([&] { return mask_future(S, rows, keys, i0); });
    cpu::simd([&] { return softmax_rows(S, lse_b, inv_l, rows, keys); });
    small_gemm(false, false, rows, hs, keys, 1.0f, S, keys, v, a.ldkv, 0.0f, o_b, ld_b);
    cpu::simd([&] { return scale_rows(o_b, inv_l, rows, hs, ld_b); });
    if (merge) cpu::simd([&] { return merge_rows(o, ldo, lse_rows, o_b, lse_b, rows, hs); });
  }
}

void attention_block_backward_unchecked(const AttentionBlock& a, const float* dout, int64_t ldo, int64_t out_batch,
                                        const float* lse, const float* delta, float* dq, float* dk, float* dv,
                                        bool accumulate) {
  const int hs = a.hs, group = a.NH / a.NKV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int query_blocks = (a.Tq + kQueryBlock - 1) / kQueryBlock;
  const int64_t kv_heads = static_cast<int64_t>(a.B) * a.NKV;
  const int64_t tile = static_cast<int64_t>(kQueryBlock) * a.Tk;
  const int64_t per_thread = 2 * tile;  // P tile, dP tile
  float* tiles = workspace(0, per_thread, omp_get_max_threads());
  const float dq_beta = accumulate ? 1.0f : 0.0f;

#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bj = 0; bj < kv_heads; ++bj) {
    const int64_t b = bj / a.NKV, j = bj % a.NKV;
    float* P = tiles + omp_get_thread_num() * per_thread;
    float* dP = P + tile;
    const float* k = a.k + b * a.kv_batch + j * hs;
    const float* v = a.v + b * a.kv_batch + j * hs;
    float* dk_j = dk + b * a.kv_batch + j * hs;
    float* dv_j = dv + b * a.kv_batch + j * hs;
    if (!accumulate) {
      zero_rows(dk_j, a.Tk, hs, a.ldkv);
      zero_rows(dv_j, a.Tk, hs, a.ldkv);
    }
    // The group's query heads in ascending order: the fixed summation order of dK_j and dV_j.
    for (int64_t h = j * group; h < (j + 1) * group; ++h) {
      const float* q = a.q + b * a.q_batch + h * hs;
      float* dq_h = dq + b * a.q_batch + h * hs;
      const float* dy = dout + b * out_batch + h * hs;
      const float* lse_bh = lse + (b * a.NH + h) * a.Tq;
      const float* D = delta + (b * a.NH + h) * a.Tq;
      for (int qb = 0; qb < query_blocks; ++qb) {
        const int i0 = qb * kQueryBlock, i1 = std::min(a.Tq, i0 + kQueryBlock), rows = i1 - i0;
        const int keys = a.causal ? i1 : a.Tk;
        const float* q_blk = q + i0 * a.ldq;
        const float* dy_blk = dy + i0 * ldo;
        small_gemm(false, true, rows, keys, hs, scale, q_blk, a.ldq, k, a.ldkv, 0.0f, P, keys);
        small_gemm(false, true, rows, keys, hs, 1.0f, dy_blk, ldo, v, a.ldkv, 0.0f, dP, keys);
        if (a.causal) cpu::simd([&] { return mask_future(P, rows, keys, i0); });
        cpu::simd([&] { return recompute_p_and_ds(P, dP, lse_bh + i0, D + i0, rows, keys); });
        small_gemm(true, false, keys, hs, rows, 1.0f, P, keys, dy_blk, ldo, 1.0f, dv_j, a.ldkv);
        small_gemm(false, false, rows, hs, keys, scale, dP, keys, k, a.ldkv, dq_beta, dq_h + i0 * a.ldq, a.ldq);
        small_gemm(true, false, keys, hs, rows, scale, dP, keys, q_blk, a.ldq, 1.0f, dk_j, a.ldkv);
      }
    }
  }
}

void attention_delta_unchecked(float* delta, const float* dout, const float* out, int64_t ld, int64_t batch, int B,
                               int T, int NH, int hs) {
  const int64_t heads = static_cast<int64_t>(B) * NH;
#pragma omp parallel for schedule(static) if (heads * T * hs > (1 << 16))
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / NH, h = bh % NH;
    const int64_t offset = b * batch + h * hs;
    cpu::simd([&] { return row_dots(delta + bh * T, dout + offset, out + offset, T, hs, ld); });
  }
}

}  // namespace cpu

namespace {

// The whole sequence of a qkv buffer as the diagonal block of ring attention.
AttentionBlock causal_block(const float* qkv, int B, int T, int NH, int NKV, int hs) {
  const int64_t q_width = static_cast<int64_t>(NH) * hs, kv_width = static_cast<int64_t>(NKV) * hs;
  const int64_t ld_qkv = q_width + 2 * kv_width, batch = T * ld_qkv;
  return AttentionBlock{qkv, ld_qkv, batch, qkv + q_width, qkv + q_width + kv_width, ld_qkv, batch,
                        B,   T,      T,     NH,            NKV,                      hs,     true};
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int NKV, int hs) {
  check_args("attention_forward", B, T, NH, NKV, hs);
  const int64_t q_width = static_cast<int64_t>(NH) * hs;
  cpu::attention_block_forward_unchecked(causal_block(qkv, B, T, NH, NKV, hs), out, q_width, T * q_width, lse,
                                         false);
}

// D for every (b, h) first (a [B, NH, T] scratch, the size of lse), then the
// diagonal block's backward writing dq and dk, dv.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int NH, int NKV, int hs) {
  check_args("attention_backward", B, T, NH, NKV, hs);
  const int64_t q_width = static_cast<int64_t>(NH) * hs, kv_width = static_cast<int64_t>(NKV) * hs;
  float* delta = workspace(1, static_cast<int64_t>(B) * NH * T, 1);
  cpu::attention_delta_unchecked(delta, dout, out, q_width, T * q_width, B, T, NH, hs);
  cpu::attention_block_backward_unchecked(causal_block(qkv, B, T, NH, NKV, hs), dout, q_width, T * q_width, lse,
                                          delta, dqkv, dqkv + q_width, dqkv + q_width + kv_width, false);
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

void attention_decode(float* out, const float* q, int64_t ldq, const float* keys, const float* values, int64_t ld_kv,
                      int n, int pos, int NH, int NKV, int hs) {
  check_args("attention_decode", 1, n, NH, NKV, hs);
  LATTICE_CHECK(pos >= 0, "attention_decode: position must be >= 0, got " << pos);
  const int64_t q_width = static_cast<int64_t>(NH) * hs, kv_width = static_cast<int64_t>(NKV) * hs;
  LATTICE_CHECK(ldq >= q_width && ld_kv >= kv_width,
                "attention_decode: leading dimensions ldq=" << ldq << " ld_kv=" << ld_kv << " must be at least NH·hs="
                                                            << q_width << " and NKV·hs=" << kv_width);
  const int group = NH / NKV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t visible_max = static_cast<int64_t>(pos) + n;
  float* scores = workspace(0, visible_max, omp_get_max_threads());
#pragma omp parallel for schedule(dynamic, 1) if (static_cast<int64_t>(n) * NH * visible_max * hs > (1 << 16))
  for (int64_t task = 0; task < static_cast<int64_t>(n) * NH; ++task) {
    const int i = static_cast<int>(task / NH), h = static_cast<int>(task % NH), j = h / group;
    cpu::simd([&] {
      return decode_row(out + i * q_width + h * hs, q + i * ldq + h * hs, keys + j * hs, values + j * hs, ld_kv,
                        pos + i + 1, hs, scale, scores + omp_get_thread_num() * visible_max);
    });
  }
}

}  // namespace lattice::kernels
