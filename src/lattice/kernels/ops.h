// Every numerical operation lattice's GPT needs, CPU implementations in cpu/.
//
// Conventions (all tensors row-major and contiguous unless a leading dimension
// is given):
//   N      rows (= B*T tokens of a micro-batch)
//   Linear weight W is [OC, IC] (as torch.nn.Linear); out = inp · Wᵀ + b.
//   qkv    [B, T, 3C]: Q = [..., 0:C], K = [..., C:2C], V = [..., 2C:3C];
//          head h owns columns h*hs .. (h+1)*hs of each part (hs = C / NH).
//          Grouped-query attention: [Q: NH·hs | K: NKV·hs | V: NKV·hs] (see Causal self-attention).
//   *_backward_* functions ACCUMULATE (+=) into parameter gradients, so that
//   gradient accumulation over micro-batches is free; input gradients are
//   written (=) unless the signature says otherwise.
// Threads: OpenMP regions and the GEMM library use lattice::set_num_threads().
// Every function may be called from several threads at once: scratch memory
// is per calling thread (Buffers counted as MemCategory::Workspace, grown to
// the largest shape seen and kept). Called inside an OpenMP parallel region a
// function runs on the calling thread alone.
// Determinism: on a given CPU every result except gemm / linear_* is bitwise
// the same for any thread count; gemm may change by f32 reassociation when
// the thread count changes (oneDNN splits the work differently).
// docs/kernels.md has the algorithms, the numerics and the measurements.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "lattice/core/cpu.h"
#include "lattice/core/dtype.h"
#include "lattice/core/memory.h"

namespace lattice::kernels {

// ---- GEMM -------------------------------------------------------------------
// C[M,N] = alpha · op(A)[M,K] · op(B)[K,N] + beta · C, row-major, with leading
// dimensions lda/ldb/ldc (elements). A and B are f32 or bf16 (both the same),
// C is always f32. With beta = 0, C is not read (it may hold NaN). Backed by
// oneDNN (see cpu/gemm.cpp for why).
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const void* A, int64_t lda, const void* B, int64_t ldb, float beta, float* C, int64_t ldc,
          DType ab_type = DType::F32);

// Which implementation serves each A/B dtype, chosen once per process from
// what the CPU and oneDNN support (cpu/gemm.cpp explains the candidates).
struct GemmPaths {
  const char* f32 = "dnnl_sgemm";
  const char* bf16 = "widen+dnnl_sgemm";  // or "dnnl_matmul_bf16"
  bool bf16_primitive_available = false;  // oneDNN has a (non-reference) bf16 matmul here
  double bf16_primitive_speedup = 0;      // its measured rate / the widened path's (0: not measured)
  std::string dnnl_isa;                   // oneDNN's effective ISA, e.g. "avx512_core_bf16"
  bool bf16_uses_primitive() const { return bf16[0] == 'd'; }
};
// The first call decides (and, where both bf16 paths exist, times them once: a few ms).
const GemmPaths& gemm_paths();
// Decides instead of timing, before the first gemm_paths(): the ranks of one
// job take rank 0's decision, so they all compute alike (a timing taken on
// every rank at once could come out differently on a loaded machine).
// Repeating the process's decision is allowed; changing it is refused.
void set_bf16_gemm_path(bool primitive, double measured_speedup);
// "f32 dnnl_sgemm, bf16 dnnl_matmul_bf16 (oneDNN's bf16 matmul ran 1.93x ...); oneDNN ISA avx512_core_bf16"
std::string describe_gemm_paths();

// ---- bf16 GEMM operands (mixed precision) ------------------------------------
// Inside a Bf16GemmScope on the calling thread, every f32 gemm (and so
// linear_*) multiplies its A and B rounded to bf16, on the bf16 path
// gemm_paths() chose by measurement: oneDNN's bf16 matmul where it is faster
// (2x f32 on a Zen 5), else the widened-block sgemm — the same bf16 products
// summed in f32 either way, only the order differs. Operands that hold
// bf16 values already (precision.compute = bf16's weights and activations)
// are exact; gradients are rounded. Operands inside a range registered as a
// GemmConstant (the weights' compute copies) are converted once per
// registration and reused; others are converted on every call into this
// thread's workspace. The attention kernel's own products are not affected.
class Bf16GemmScope {
 public:
  Bf16GemmScope();
  ~Bf16GemmScope();
  Bf16GemmScope(const Bf16GemmScope&) = delete;
  Bf16GemmScope& operator=(const Bf16GemmScope&) = delete;

 private:
  bool previous_;
};
bool bf16_gemm_scope_active();

// A range of f32 values that stays unchanged until it is registered again or
// reset (movable, not copyable; the registration ends with the object).
class GemmConstant {
 public:
  GemmConstant() = default;
  GemmConstant(GemmConstant&& o) noexcept : begin_(o.begin_) { o.begin_ = nullptr; }
  GemmConstant& operator=(GemmConstant&& o) noexcept;
  GemmConstant(const GemmConstant&) = delete;
  GemmConstant& operator=(const GemmConstant&) = delete;
  ~GemmConstant() { reset(); }
  // [begin, begin + n) holds new values (an earlier registration of this object ends).
  void set(const float* begin, int64_t n);
  void reset();

 private:
  const float* begin_ = nullptr;
};
// Bytes of bf16 copies the registered constants hold (MemCategory::Workspace).
size_t gemm_constant_bytes();

// ---- Embedding --------------------------------------------------------------
// out[b,t,:] = wte[tokens[b,t], :] + wpe[t, :]
// A negative token is a row this table does not hold (the vocabulary-parallel
// embedding of tensor parallelism: another rank's range): its wte term is 0.
// wpe may be null: no position term.
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B, int T, int C);
// dwte[tokens[b,t], :] += dout[b,t,:] (negative tokens skipped) ; dwpe[t,:] += sum_b dout[b,t,:]
// (dwpe may be null: no position embedding)
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B, int T, int C);

// ---- LayerNorm ---------------------------------------------------------------
// mean_i = (1/C) Σ_c x_ic ; rstd_i = 1/sqrt((1/C) Σ_c (x_ic - mean_i)² + eps)
// out_ic = (x_ic - mean_i) · rstd_i · w_c + b_c        (mean, rstd: [N])
// eps > 0 (GPT-2 and torch.nn.LayerNorm use 1e-5, the default; a config's
// norm_eps may say otherwise). The backward reads eps only through rstd.
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int C, float eps = 1e-5f);
// With x̂ = (x - mean)·rstd and g = dout ⊙ w:
// dinp_ic += rstd_i · (g_ic - mean_c(g_i) - x̂_ic · mean_c(g_i ⊙ x̂_i))   (ACCUMULATES into dinp)
void layernorm_backward_input(float* dinp, const float* dout, const float* inp, const float* weight,
                              const float* mean, const float* rstd, int64_t N, int C);
// dweight_c (+)= Σ_i dout_ic · x̂_ic ; dbias_c (+)= Σ_i dout_ic
// (accumulate = true adds, false overwrites: the first write after zero_grad)
void layernorm_backward_weight(float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* mean, const float* rstd, int64_t N, int C, bool accumulate = true);

// ---- Linear -----------------------------------------------------------------
// out[N,OC] = inp[N,IC] · W[OC,IC]ᵀ + bias (bias may be null)
void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int IC, int OC);
// dinp[N,IC] (= or += when accumulate) dout[N,OC] · W[OC,IC]
void linear_backward_input(float* dinp, const float* dout, const float* weight, int64_t N, int IC, int OC,
                           bool accumulate);
// dW[OC,IC] (+)= doutᵀ · inp ; dbias[OC] (+)= Σ_n dout[n,:] (dbias may be null)
// (accumulate = true adds, false overwrites: GEMM beta = 0, dW is not read)
void linear_backward_weight(float* dweight, float* dbias, const float* dout, const float* inp, int64_t N, int IC,
                            int OC, bool accumulate = true);

// ---- GELU, tanh approximation -------------------------------------------------
// gelu(x) = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
void gelu_forward(float* out, const float* inp, int64_t n);
// dinp = dout · gelu'(inp)   (written)
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);

// ---- RMSNorm (Llama) -------------------------------------------------------------
// rstd_i = 1/sqrt((1/C) Σ_c x_ic² + eps) ; out_ic = (x_ic · rstd_i) · w_c      (rstd: [N])
// No mean subtraction and no bias (HF LlamaRMSNorm, computed in f32). eps > 0
// (Llama 2/3 use 1e-5, Llama 1 1e-6: the caller's config says which).
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int C, float eps);
// With x̂ = x·rstd and g = dout ⊙ w:
// dinp_ic (= or += when accumulate) rstd_i · (g_ic - x̂_ic · mean_c(g_i ⊙ x̂_i))
// (accumulate = true adds into dinp, as layernorm_backward_input always does:
// the block's residual gradient; false writes it)
void rmsnorm_backward_input(float* dinp, const float* dout, const float* inp, const float* weight,
                            const float* rstd, int64_t N, int C, bool accumulate);
// dweight_c (+)= Σ_i dout_ic · x̂_ic   (accumulate = false overwrites, as layernorm_backward_weight)
void rmsnorm_backward_weight(float* dweight, const float* dout, const float* inp, const float* rstd, int64_t N,
                             int C, bool accumulate = true);

// ---- SwiGLU (Llama MLP) -------------------------------------------------------------
// The fused gate/up projection's output inp is [N, 2F]: row n holds the gate
// g = inp[n, 0:F] then the up projection u = inp[n, F:2F] (the fused weight
// [2F, C] is gate_proj.weight stacked over up_proj.weight; tensor parallelism
// splits each half by rows, so a rank's slice has the same layout).
//   out[n, f] = silu(g_nf) · u_nf ,  silu(g) = g·σ(g) ,  σ(g) = 1/(1 + e^{-g})   (out: [N, F])
// σ is evaluated from e^{-|g|} ≤ 1, so no exponential overflows for any
// finite g (σ → 0 or 1 without NaN); inputs must be finite.
void swiglu_forward(float* out, const float* inp, int64_t N, int F);
// dinp [N, 2F] is written (=): with σ = σ(g),
//   dg = dout · u · σ·(1 + g·(1 - σ)) ;  du = dout · g·σ
void swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int F);

// ---- Rotary position embedding (RoPE, Llama) -----------------------------------------
// HF's rotate-half convention (transformers' LlamaRotaryEmbedding and
// apply_rotary_pos_emb): for head size hs (even) and i ∈ [0, hs/2),
//   inv_freq_i = 1 / theta^(2i/hs) ;  a_pi = p · inv_freq_i   (position p)
// and every head vector x = [x1, x2] (halves of hs/2) becomes
//   x·cos + rotate_half(x)·sin ,  rotate_half(x) = [-x2, x1],  i.e.
//   y1_i = x1_i·cos a_pi - x2_i·sin a_pi ;  y2_i = x2_i·cos a_pi + x1_i·sin a_pi
// (cos and sin of the same angle for element i and i + hs/2).
//
// The table of cos/sin, built once per (head_size, max_positions, theta).
// The angles are computed as HF and Meta's reference compute them, in f32:
// inv_freq_i = f32(1 / f32(theta^f32(2i/hs))), a_pi = f32(p · inv_freq_i); cos
// and sin of that f32 angle are then rounded from double. So a checkpoint
// trained with HF sees the angles it was trained with; the exact angle
// differs from them by up to p·2⁻²⁴ rad (docs/kernels.md).
class RopeTable {
 public:
  RopeTable() = default;
  // Refuses an odd head_size (the rotation pairs element i with i + hs/2),
  // max_positions < 1, and theta that is not finite and > 0 (each with a
  // lattice::Error naming the value).
  RopeTable(int head_size, int max_positions, float theta);
  // A moved-from table is empty (head_size() == 0), which rope_* refuse.
  RopeTable(RopeTable&& o) noexcept { *this = std::move(o); }
  RopeTable& operator=(RopeTable&& o) noexcept;

  int head_size() const { return head_size_; }
  int max_positions() const { return max_positions_; }
  float theta() const { return theta_; }
  // hs/2 values: cos a_pi (then sin a_pi at row + hs/2), for 0 ≤ p < max_positions.
  const float* cos_row(int64_t p) const { return table_.as<float>() + p * head_size_; }
  const float* sin_row(int64_t p) const { return cos_row(p) + head_size_ / 2; }
  // inv_freq_i, the f32 value the table was built from (hs/2 values).
  const float* inv_freq() const { return inv_freq_.as<float>(); }

 private:
  int head_size_ = 0, max_positions_ = 0;
  float theta_ = 0;
  Buffer table_;     // [max_positions, hs]: row p = cos a_p0..a_p(hs/2-1), then sin of the same (Workspace)
  Buffer inv_freq_;  // [hs/2]
};
// Rotates, in place, n_heads consecutive heads of table.head_size() values at
// the start of each row of x: row r = b·T + t (b < B, t < T) begins at
// x + r·ld (ld ≥ n_heads·hs) and holds position first_position + t, which
// must be below table.max_positions(). For attention's qkv [B, T, 3C] layout,
// Q and K are the first 2C columns, so one call with x = qkv, ld = 3C,
// n_heads = 2·NH rotates both (V is left alone); for decoding, B = 1, T = n
// new rows, first_position = pos. Each row is independent: bitwise the same
// for any thread count.
void rope_forward(float* x, int64_t ld, const RopeTable& table, int B, int T, int n_heads, int first_position);
// The transpose (= inverse) rotation, in place on the gradient: the forward
// with -sin, i.e. dx1 = dy1·cos + dy2·sin ; dx2 = dy2·cos - dy1·sin.
void rope_backward(float* dx, int64_t ld, const RopeTable& table, int B, int T, int n_heads, int first_position);

// ---- Elementwise ----------------------------------------------------------------
void residual_forward(float* out, const float* a, const float* b, int64_t n);  // out = a + b
void add_inplace(float* a, const float* b, int64_t n);                         // a += b
void scale_inplace(float* a, float s, int64_t n);                               // a *= s
// Σ x², accumulated in double so the global grad norm is independent of chunking.
double sum_squares(const float* x, int64_t n);

// ---- 16-bit storage (mixed precision) ---------------------------------------------
// precision.compute = bf16 | f16 keeps activations and the compute copies of
// the weights at 16-bit precision while the arithmetic runs in f32 (this
// CPU's kernels read f32; docs/precision.md). All three convert exactly as
// core/dtype.h's scalar converters: round to nearest even, overflow to ±inf,
// f16 subnormals kept, NaN stays a (quiet) NaN.
// x ← f32(t(x)) in place: the value a kernel storing t would leave (t = F32: nothing).
void round_to(DType t, float* x, int64_t n);
// dst (n values of t, bf16 or f16) ← t(x)
void store_16bit(DType t, const float* x, void* dst, int64_t n);
// x ← f32(src) (exact)
void load_16bit(DType t, const void* src, float* x, int64_t n);

// ---- Causal self-attention (multi-head and grouped-query) ------------------------
// NH query heads share NKV key/value heads (NH % NKV == 0, group = NH / NKV):
// query head h attends with key/value head h / group. NKV = NH is multi-head
// attention (GPT-2), NKV = 1 multi-query, anything between grouped-query
// (Llama 2 70B, Llama 3). Every head is hs wide. A qkv row of one token is
//   [ Q: NH·hs | K: NKV·hs | V: NKV·hs ]     (row stride NH·hs + 2·NKV·hs)
// with head h of each part at columns h·hs .. (h+1)·hs of that part.
// For each batch b and query head h, with j = h / group and scale = 1/sqrt(hs):
//   S = scale · Q_h K_jᵀ (causal: S_ik = -inf for k > i), P = softmax_row(S), out_h = P V_j
// out is [B, T, NH·hs]; only out and lse_i = log Σ_k exp(S_ik) ([B, NH, T])
// are stored; the T×T probabilities are never kept (backward recomputes them
// from lse). Refuses non-positive sizes and NH % NKV != 0 (lattice::Error).
void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int NKV, int hs);
// With D_i = Σ_d dout_id · out_id, P recomputed from lse, per query head h:
//   dV_h = Pᵀ dout ; dP = dout Vᵀ ; dS = P ⊙ (dP - D) ; dQ = scale·dS K ; dK_h = scale·dSᵀ Q
// and dK_j = Σ_{h: h/group = j} dK_h, dV_j likewise (a shared head gets the
// sum over its query heads, in ascending h). dqkv has qkv's layout and is
// written (=). Bitwise the same for any thread count: one task owns a (b, j)
// pair and adds its query heads' contributions in a fixed order.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int NH, int NKV, int hs);
// Incremental (key/value-cached) attention of one sequence, for generation:
// n new queries at positions [pos, pos + n) attend to the cached keys and
// values of positions [0, pos + n) (causal: query pos + i sees keys ≤ pos + i).
// q row i holds the NH query heads of position pos + i, head h at columns
// h·hs (leading dimension ldq ≥ NH·hs); keys/values row k holds the NKV heads
// of position k, head j at columns j·hs (leading dimension ld_kv ≥ NKV·hs).
// out [n, NH·hs] is written. Same math as attention_forward; the scores of one
// query row are summed in key order. Refuses what attention_forward refuses,
// pos < 0, and leading dimensions below those widths.
void attention_decode(float* out, const float* q, int64_t ldq, const float* keys, const float* values, int64_t ld_kv,
                      int n, int pos, int NH, int NKV, int hs);

// The multi-head forms (NKV = NH, hs = C / NH): qkv [B, T, 3C] with Q, K, V at
// columns [0, C), [C, 2C), [2C, 3C); out [B, T, C]; decode's keys/values rows
// hold C values. Bitwise the same results as the grouped-query forms with
// NKV = NH (they are those calls).
// C / NH, refusing C % NH != 0 and non-positive C or NH (lattice::Error).
int attention_head_size(int C, int NH);
inline void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) {
  attention_forward(out, lse, qkv, B, T, NH, NH, attention_head_size(C, NH));
}
inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                               int B, int T, int C, int NH) {
  attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NH, attention_head_size(C, NH));
}
inline void attention_decode(float* out, const float* q, int64_t ldq, const float* keys, const float* values,
                             int64_t ld_kv, int n, int pos, int C, int NH) {
  attention_decode(out, q, ldq, keys, values, ld_kv, n, pos, NH, NH, attention_head_size(C, NH));
}

// ---- Ring (context-parallel) attention blocks -------------------------------------
// Context parallelism splits the sequence into chunks held by different ranks;
// a rank's query chunk meets the key/value chunks one at a time as they travel
// round the ring, and the partial results are merged by their log-sum-exp.
// For one block (a query chunk against one key/value chunk), per problem b,
// query head h, key/value head j = h / group, scale = 1/sqrt(hs):
//   S = scale · Q_h K_jᵀ (causal block: S_ik = -inf for k > i), lse_b = log Σ_k exp(S_ik),
//   out_b = softmax_row(S) V_j
// Attention over the union of key blocks K1 ∪ K2 is the merge of the two:
//   lse = log(exp(lse_1) + exp(lse_2)), out = exp(lse_1 - lse)·out_1 + exp(lse_2 - lse)·out_2
// and the backward of the merged attention splits by key block: with the
// FINAL lse and D, each block's P = exp(scale·Q Kᵀ - lse) is its share of the
// full softmax, so the usual gradient formulas, summed over the blocks, give
// the gradient of the whole. The diagonal (causal) block alone is exactly
// attention_forward / attention_backward of that chunk (the same code).
//
// One block of ring attention: B independent problems.
// Query row i of problem b is q + b*q_batch + i*ldq (query head h at columns h*hs);
// key/value row k of problem b is k|v + b*kv_batch + k*ldkv (head j at j*hs).
struct AttentionBlock {
  const float* q;
  int64_t ldq, q_batch;
  const float* k;
  const float* v;
  int64_t ldkv, kv_batch;
  int B, Tq, Tk, NH, NKV, hs;
  bool causal;  // the diagonal block: Tq == Tk and query i sees keys 0..i; else every key is visible
};
// out row i of problem b at out + b*out_batch + i*ldo (head h at h*hs); lse [B, NH, Tq].
// merge == false: out, lse = this block's attention alone (normalised output and its log-sum-exp).
// merge == true: out, lse already hold the attention over earlier key blocks; they become the attention
// over the union, in a numerically safe form (no log(1+exp) of a large argument):
//   m = max(lse, lse_b); lse' = m + log(exp(lse - m) + exp(lse_b - m)); out' = exp(lse - lse')·out + exp(lse_b - lse')·out_b
// (one of the two exponentials is exp(0) = 1, so lse' = m + log1p(exp(min(lse, lse_b) - m))). lse = -inf with
// out = 0 is a valid "no keys yet" state. Bitwise the same for any thread count; with merge == false and a
// causal block, bitwise attention_forward of that chunk.
// Refuses (lattice::Error) non-positive sizes, NH % NKV != 0, a causal block with Tq != Tk, leading
// dimensions below the row widths (ldq, ldo < NH·hs, ldkv < NKV·hs) and, when B > 1, batch strides
// below rows × leading dimension (q_batch < Tq·ldq, kv_batch < Tk·ldkv, out_batch < Tq·ldo).
void attention_block_forward(const AttentionBlock& blk, float* out, int64_t ldo, int64_t out_batch, float* lse,
                             bool merge);
// D_i = Σ_d dout_id·out_id per (b, query head h, row i): delta [B, NH, T]. dout and out rows at
// b*batch + i*ld (head h at h*hs). Refuses non-positive sizes, ld < NH·hs and, when B > 1, batch < T·ld.
void attention_delta(float* delta, const float* dout, const float* out, int64_t ld, int64_t batch, int B, int T,
                     int NH, int hs);
// The block's share of the backward, with lse and delta of the FINAL (merged) attention:
//   P = exp(scale·Q Kᵀ - lse) (masked), dV += Pᵀ dout, dS = P ⊙ (dout Vᵀ - D), dQ += scale·dS K, dK += scale·dSᵀ Q
// dout has out's strides (ldo, out_batch); lse and delta are [B, NH, Tq].
// dq has q's strides (ldq, q_batch); dk and dv have k/v's (ldkv, kv_batch). All three ACCUMULATE (+=).
// dK_j, dV_j sum their query heads in ascending h as attention_backward does; bitwise the same for any
// thread count. With a causal block and dq, dk, dv zero, bitwise attention_backward of that chunk.
// Refuses what attention_block_forward refuses.
void attention_block_backward(const AttentionBlock& blk, const float* dout, int64_t ldo, int64_t out_batch,
                              const float* lse, const float* delta, float* dq, float* dk, float* dv);

// ---- Softmax + cross-entropy ------------------------------------------------------
// Rows of logits [N, Vp]; only the first V columns are real classes (columns
// V..Vp-1 are padding and never take part). targets in [0, V).
// losses[i] = logsumexp(logits_i[0:V]) - logits_i[targets_i]
void crossentropy_forward(float* losses, const float* logits, const int32_t* targets, int64_t N, int V, int Vp);
// Fused forward + backward, in place: writes losses as above and replaces
// logits by dlogits = dloss · (softmax(logits_i) - onehot(targets_i)), with the
// padding columns set to 0. One pass over the largest tensor of the model.
void crossentropy_forward_backward(float* logits_inout, float* losses, const int32_t* targets, int64_t N, int V,
                                   int Vp, float dloss);
// The local halves of the vocabulary-parallel cross-entropy (tensor
// parallelism, parallel/tensor/vocab_parallel.h): this rank holds columns
// [first, first + ld) of the logits, rows of leading dimension ld, of which
// the first `real` (0 <= real <= ld) are classes. Between the calls the
// caller reduces the statistics over the ranks.
// 1. row_max[i] = max over the real columns (-inf if none); target_logit[i] =
//    the target's logit if this rank holds it, else 0.
void crossentropy_local_max(float* row_max, double* target_logit, const float* logits, const int32_t* targets,
                            int64_t N, int64_t first, int real, int ld);
// 2. With the global row maxima m: z <- exp(z - m) over the real columns, in
//    place; sum_exp[i] = their sum (as crossentropy_forward sums a row).
void crossentropy_local_exp(float* logits_inout, double* sum_exp, const float* row_max, int64_t N, int real, int ld);
// 3. With the global sums s: z <- dloss·(z/s - [column = target]) over the
//    real columns, 0 over the padding.
void crossentropy_local_grad(float* logits_inout, const double* sum_exp, const int32_t* targets, int64_t N,
                             int64_t first, int real, int ld, float dloss);

// ---- AdamW ---------------------------------------------------------------------------
// g = grad·grad_scale ; m = β1 m + (1-β1) g ; v = β2 v + (1-β2) g²
// p -= lr · ( m/(1-β1^t) / (sqrt(v/(1-β2^t)) + eps) + weight_decay · p )     t = step ≥ 1
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, int64_t step, float grad_scale);
// 1-bit Adam after its warm-up (compression.momentum): the momentum is given
// (formed and averaged elsewhere) and v is frozen since step t_v:
// m = momentum ; m̂ = m/(1-β1^t) ; v̂ = v/(1-β2^t_v)
// p -= lr · ( m̂ / (sqrt(max(v̂, m̂²)) + eps) + weight_decay · p )
// The max: live Adam keeps |m̂| ≲ sqrt(v̂) (an average's square is at most the
// average of the squares), so no element moves much more than lr a step; a
// frozen v breaks that wherever the gradient grows after the freeze
// (attention's query and key weights, nearly still at initialisation), and
// those elements would take steps of |m̂|/sqrt(v̂) ≫ 1 times lr. Lifting v̂ to
// m̂² there caps them at lr, and leaves every other element as frozen.
void adamw_momentum_update(float* param, const float* momentum, float* m, const float* v, int64_t n, float lr,
                           float beta1, float beta2, float eps, float weight_decay, int64_t step,
                           int64_t variance_step);

// ---- Peak arithmetic rate (cpu/peak.cpp) ------------------------------------------
// This CPU's peak multiply-add rate for `dtype` at active_isa(), measured:
// `threads` threads each run a register-only FMA loop (VDPBF16PS for bf16)
// for `seconds` of wall time, all at once. gflops_per_core: the mean over the
// threads of FLOPs per second of the thread's own CPU time (time the
// scheduler gave to other processes neither counts nor lowers it; 0 when the
// CPU has no such instructions: bf16 without avx512_bf16 at the AVX-512
// level). on_cpu: the least share of the wall time any thread ran (its CPU
// time / the wall time; below 1 when other work shared its core).
struct PeakSample {
  double gflops_per_core = 0;
  double on_cpu = 0;
};
PeakSample measure_peak(DType dtype, int threads, double seconds);
// False when measure_peak(dtype, ...) would return 0.
bool peak_measurable(DType dtype);
// The most FLOPs per cycle one core can retire of the loop measure_peak runs
// for `dtype` at `isa` (two FMA pipes of the level's width; bf16: two
// VDPBF16PS, 4 FLOPs a lane; baseline: two multiplies and two adds). 0 where
// there is no loop (bf16 below avx512).
double peak_flops_per_cycle(DType dtype, Isa isa);

}  // namespace lattice::kernels
