// Activation storage of the model (model/gpt.h): what one micro-batch's
// forward keeps for its backward (a Slot), the gradients its backward passes
// from backward_input to backward_weight, the f32 work arrays of 16-bit
// storage, and how each is carved out of one allocation.
//
// Sizes are this rank's (GPT::Dims): under tensor parallelism the head and
// MLP widths are its slices; with sequence parallelism the arrays outside
// the parallel regions (the residual stream, the norms' inputs and outputs
// and their statistics) hold rows(N) = N/t rows and the rest all N.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "lattice/core/dtype.h"
#include "lattice/core/memory.h"
#include "lattice/model/parts/moe.h"
#include "lattice/model/recompute.h"

namespace lattice::model {

// The sizes the carvers work with: this rank's widths, N rows in all and R of
// them kept between the parallel regions. L: the stage's layers; head: it
// runs the final norm, the head and the loss.
struct CarveSizes {
  int64_t C;    // model width
  int64_t NH;   // query heads here (the lse rows)
  int64_t A;    // attention width here (NH·hs: atty)
  int64_t QKV;  // the attention's projection width here (queries, keys and values)
  int64_t FU;   // the MLP's first projection width here (F; gate and up: 2F)
  int64_t F;    // the MLP's hidden width here
  int64_t V;    // vocabulary rows of the head here
  int64_t L, N, R;
  int64_t HO;   // context parallelism, all-to-all: the head-sharded output's width per row here (A), else 0
  bool sp, head;
  DType store = DType::F32;  // of the activations kept (statistics stay f32)
  bool keep_logits = true;   // 16-bit storage: dlogits kept (else recomputed in the backward)
  // Recomputation of each of the L layers (recompute.h); null: none. A
  // field a layer does not store is carved as null there.
  const Recompute* recompute = nullptr;
  Recompute policy(int64_t l) const { return recompute ? recompute[l] : Recompute::None; }
  // Per layer: 1 where the MLP is a mixture of experts, whose arrays are its
  // own (parts/moe.h): fch and hid are not carved there. Null: all dense.
  const uint8_t* moe = nullptr;
  bool dense_field(int64_t l, LayerField f) const {
    return !(moe && moe[l] && (f == LayerField::Fch || f == LayerField::Hid));
  }
};

// What one layer's forward keeps for backward, arrays of element type T
// (float, or uint16_t for 16-bit storage) ...
template <typename T>
struct LayerArrays {
  T* ln1;   // norm₁(x_l) [R, C]
  T* qkv;   // queries, keys, values [N, QKV] (rotated, with rotary positions)
  T* atty;  // attention output before the output projection [N, A]
  T* res1;  // r_l = x_l + Attn(...) [R, C]
  T* ln2;   // norm₂(r_l) [R, C]
  T* fch;   // the MLP's first projection [N, FU] (GELU: its input; SwiGLU: gate | up)
  T* hid;   // the MLP's hidden activation [N, F] (GELU(fch) or SiLU(gate)·up)
  T* heads_out;  // context parallelism, all-to-all: the head-sharded attention output [N, HO] (else empty)
};
// ... and their statistics, always f32.
struct LayerActs : LayerArrays<float> {
  float *ln1_mean, *ln1_rstd;  // of norm₁ (mean: LayerNorm only)
  float* lse;                  // [B, NH, T] log-sum-exp of the scores (all-to-all CP: head-sharded, the same count)
  float *ln2_mean, *ln2_rstd;  // of norm₂
};

// Gradients that backward_input produces and backward_weight consumes. Every
// [N, C] one is full-sized; under sequence parallelism dln1/dln2 hold this
// rank's rows of the reduced gradient in their first rows(N) rows (the
// reduce-scatter's place), and dres1 and dx hold their slice at first_row(N)
// (the all-gather's place, so gathering is in place).
struct LayerGrads {
  float* dfch;   // dL/d fch [N, FU]     (first MLP projection's weight gradient)
  float* dln2;   // dL/d norm₂ output    (norm₂'s weight gradient)
  float* dres1;  // dL/d r_l             (output projection's weight gradient; whole once gathered)
  float* dqkv;   // dL/d qkv [N, QKV]    (before the rotation: the qkv projection's weight gradient)
  float* dln1;   // dL/d norm₁ output    (norm₁'s weight gradient)
};

// The 16-bit copies of a LayerActs' arrays (precision.compute = bf16 | f16).
using PackedLayer = LayerArrays<uint16_t>;

struct Slot;

// The f32 arrays one layer computes in when activations are stored in 16
// bits: the layer's forward runs here and is stored rounded; its backward
// loads it back here. One per model, shared by the slots (one layer
// computes at a time); `holds` says which slot's layer is loaded.
// Recomputation uses the same arrays at any storage: what a layer does not
// store (recompute.h) is computed here, in its forward and again in its
// backward (at f32 only those arrays are carved, and no head arrays).
struct Work16 {
  Buffer mem;
  int64_t carved_tokens = 0;         // the micro-batch size the arrays are carved for
  LayerActs own{};                   // the carved arrays (statistics: those some layer does not store)
  // The layer computing now: each field the split backward's kept copy
  // (Slot::kept), else the slot's own (f32 storage; statistics), else `own`.
  LayerActs layer{};
  bool holds_kept = false;           // `layer` was composed with the slot's kept copy
  float* x[2] = {nullptr, nullptr};  // the residual stream in and out of a layer [R, C]
  float* lnf = nullptr;              // [N, C]
  float* logits = nullptr;           // [head_rows, Vw]
  float* losses = nullptr;           // [head_rows]: the recomputation's (discarded)
  int64_t head_rows = 0;             // rows of logits computed at a time
  const Slot* holds = nullptr;
  int holds_layer = -1;
  const Slot* holds_x = nullptr;
  int holds_x_index = -1;
  const Slot* holds_lnf = nullptr;  // whose final norm output `lnf` holds (loaded by lnf_of)
  void forget() {
    holds = nullptr, holds_layer = -1, holds_kept = false, holds_x = nullptr, holds_x_index = -1, holds_lnf = nullptr;
  }
};

struct Slot {
  int B = 0, T = 0;
  int64_t capacity_tokens = 0;
  bool split_capacity = false;  // grads sized for every layer (split backward)
  Buffer act_mem, grad_mem, token_mem;
  // Activations.
  std::vector<float*> x;  // x_0 .. x_L, the residual stream [R, C]
  std::vector<LayerActs> layers;
  float *lnf, *lnf_mean, *lnf_rstd;
  float* logits;  // [N, Vw] (this rank's vocabulary rows); after forward(): dlogits
  float* losses;  // [N]
  float* work;    // [N, C] sequence parallelism: a gathered input or a partial output
  int32_t* inputs;
  int32_t* rows;     // inputs as rows of this rank's embedding (-1: another rank's)
  int32_t* targets;  // 16-bit storage without logits: the targets, for the head's recomputation
  float dloss = 0;   // and the loss gradient's factor
  // Gradients.
  std::vector<float*> dx;  // dL/dx_0 .. dL/dx_L (split) or two ping-pong buffers (fused)
  std::vector<LayerGrads> dlayers;
  // Split backward: of each recomputed layer, what backward_input computed
  // again and backward_weight reads (recompute.h kept_for_weight; f32 at any
  // storage), carved with the gradients; null fields elsewhere.
  std::vector<LayerActs> kept;
  float *dlnf, *scratch4c, *scratch_c, *ln_scratch;
  // 16-bit storage: x, the layers' arrays, lnf and dlogits live here instead
  // (s.x, s.lnf and s.logits are then null; s.layers keep the statistics).
  DType store = DType::F32;
  bool keep_logits = true;  // 16-bit: dlogits stored (false: the head's backward recomputes them)
  std::vector<uint16_t*> x16;
  std::vector<PackedLayer> packed;
  uint16_t *lnf16 = nullptr, *logits16 = nullptr;
  float* out32 = nullptr;  // not the last stage: the output activation in f32 [R, C]
  // Pipeline stages: the output's gradient given before the backward (not the
  // last stage), and whether the input's gradient is ready (not the first).
  const float* output_grad = nullptr;  // set_stage_output_grad's, until the backward reads it
  bool input_grad_ready = false;
  // Mixture of experts: each MoE layer's routing and expert arrays (null for dense layers).
  std::vector<std::unique_ptr<parts::MoeActs>> moe;
  // State.
  bool has_forward = false, has_backward_input = false, split = false;
};

// The key/value cache and work arrays of GPT::decode (decode.cpp).
struct DecodeState {
  std::vector<int32_t> tokens;  // the tokens of cached positions [0, tokens.size())
  int64_t window_start = 0;     // next_logits(): context index of position 0
  // Layer l: keys [seq_len, KV], then values [seq_len, KV] (KV = kv_heads·hs).
  Buffer cache;
  // One chunk of up to seq_len new positions: the residual stream and one
  // block's intermediates (reused by every layer; the two norms share buffers).
  Buffer work;
  float *x, *logits;
  LayerActs block;
  parts::MoeActs moe;  // an MoE layer's arrays, reused by every layer
};

// Carves a buffer into consecutive arrays, each 64-byte aligned. With a null
// base it only counts: used() is then the bytes the arrays need.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)), p_(base_) {}
  template <typename T = float>
  T* take(int64_t n) {
    T* r = reinterpret_cast<T*>(p_);
    p_ += (static_cast<int64_t>(sizeof(T)) * n + 63) / 64 * 64;
    return r;
  }
  int64_t used() const { return p_ - base_; }

 private:
  char* base_;
  char* p_;
};

// Bytes of a slot's activations (carved into s when it is not null): f32
// storage fills s->x, s->layers, s->lnf, s->logits; 16-bit storage s->x16,
// s->packed, s->lnf16, s->logits16 (dlogits only where the head keeps them)
// and s->out32; statistics, losses and SP's work buffer are f32 either way.
int64_t carve_activations(Slot* s, void* base, const CarveSizes& z);
// The f32 working arrays of the 16-bit path, or of recomputation at f32,
// for N rows (sizes only when w is null; 0 at f32 without recomputation).
int64_t carve_work16(Work16* w, void* base, const CarveSizes& z, int64_t head_rows);
// The backward's gradients: every layer's (split) or one layer's, reused
// (fused); split, also what recomputed layers keep from I to W (Slot::kept).
int64_t carve_grads(Slot* s, void* base, const CarveSizes& z, bool split);
// Makes sure s's gradient buffers are laid out for the split or fused backward.
void prepare_grads(Slot& s, const CarveSizes& now, const CarveSizes& capacity, bool split);
// Between a slot's 16-bit storage and the f32 arrays a layer computes in
// (the arrays the slot stores: null ones are skipped).
void store_layer(DType t, const LayerActs& a, const PackedLayer& p, const CarveSizes& z);
void load_layer(DType t, const PackedLayer& p, const LayerActs& a, const CarveSizes& z);

// dx index i holds dL/dx_i (fused: ping-pong between two buffers).
inline float* dx_of(Slot& s, int i) { return s.split ? s.dx[i] : s.dx[i % 2]; }
inline LayerGrads& dlayer_of(Slot& s, int l) { return s.split ? s.dlayers[l] : s.dlayers[0]; }

}  // namespace lattice::model
