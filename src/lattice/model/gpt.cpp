#include "lattice/model/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "lattice/layers/context/context_parallel.h"
#include "lattice/layers/expert/expert_parallel.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/layers/tensor/vocab_parallel.h"
#include "lattice/model/activations.h"
#include "lattice/model/parts/attention.h"
#include "lattice/model/parts/mlp.h"
#include "lattice/model/parts/moe.h"

namespace lattice::model {

namespace k = lattice::kernels;
using Pass = GroupHooks::Pass;

static Slot& existing_slot(std::vector<std::unique_ptr<Slot>>& slots, int index);

// bf16 compute: the GEMMs of a pass multiply bf16 operands on the bf16 path
// chosen by measurement (kernels::Bf16GemmScope); f16 and f32 multiply f32.
struct GemmPrecision {
  std::optional<k::Bf16GemmScope> scope;
  explicit GemmPrecision(DType compute) {
    if (compute == DType::BF16) scope.emplace();
  }
};

GPT::GPT(const ModelConfig& config, uint64_t seed, tensor::TensorParallel* tp, StageLayers stage)
    : GPT(Build{}, config, &seed, true, tp, stage) {}

GPT::GPT(const ModelConfig& config, NoInit, tensor::TensorParallel* tp, StageLayers stage)
    : GPT(Build{}, config, nullptr, true, tp, stage) {}

GPT::GPT(const ModelConfig& config, Unallocated, tensor::TensorParallel* tp, StageLayers stage)
    : GPT(Build{}, config, nullptr, false, tp, stage) {}

int GPT::tp_size() const { return tp_ ? tp_->size() : 1; }
int GPT::tp_rank() const { return tp_ ? tp_->rank() : 0; }
int64_t GPT::rows(int64_t N) const { return tp_ ? tp_->local_rows(N) : N; }
int64_t GPT::first_row(int64_t N) const { return tp_ ? tp_->first_row(N) : 0; }

GPT::~GPT() = default;

CarveSizes GPT::sizes_for(int64_t N) const {
  const int64_t heads_out = cp_ && cp_->stores_heads_out() ? dims_.A : 0;
  CarveSizes z{dims_.C, dims_.NH, dims_.A, dims_.QKV, dims_.FU, dims_.F, dims_.V, local_layers(), N, rows(N),
               heads_out, tp_ && tp_->sequence_parallel(), last_stage(), compute_, !local_head(),
               recompute_.empty() ? nullptr : recompute_.data()};
  if (config_.n_experts > 0) z.moe = moe_flags_.data();
  return z;
}

void GPT::set_context_parallel(context::ContextParallel* cp) {
  for (const auto& s : slots_)
    LATTICE_CHECK(!s || !s->has_forward, "set_context_parallel with a micro-batch in flight");
  if (cp) cp->check_heads({dims_.NH, dims_.NKV, dims_.hs});
  cp_ = cp;
  positions_.clear();
  slots_.clear(), eval_slot_.reset(), work16_.reset();  // carved again (all-to-all stores more)
}

const int32_t* GPT::positions_for(int T) {
  if (positions_.size() != static_cast<size_t>(T)) {
    positions_.resize(static_cast<size_t>(T));
    if (cp_) {
      cp_->positions(positions_.data(), T);
    } else {
      for (int t = 0; t < T; t++) positions_[t] = t;
    }
  }
  return positions_.data();
}


// A slot's token ids: the inputs and their rows of wte, and at 16-bit the
// targets (the head's recomputation reads them).
size_t GPT::token_arrays() const { return compute_ != DType::F32 ? 3 : 2; }

void GPT::set_tied_embedding(TiedEmbedding* embedding) {
  for (const auto& s : slots_)
    LATTICE_CHECK(!s || !s->has_forward, "set_tied_embedding with a micro-batch in flight");
  custom_embedding_ = embedding;
  // The 16-bit head depends on it (local_head): slots and work arrays are carved again at their next use.
  if (compute_ != DType::F32) slots_.clear(), eval_slot_.reset(), work16_.reset();
}

size_t GPT::slot_bytes(int B, int T) const {
  const CarveSizes z = sizes_for(static_cast<int64_t>(B) * T);
  return static_cast<size_t>(carve_activations(nullptr, nullptr, z) + carve_grads(nullptr, nullptr, z, false));
}

size_t GPT::stored_activation_bytes(int B, int T) const {
  const int64_t N = static_cast<int64_t>(B) * T;
  size_t moe_bytes = 0;  // each MoE layer's own state (parts/moe.h), kept under every recompute mode
  for (int l = first_layer_; l < last_layer_; l++)
    if (moe_layer(l)) moe_bytes += static_cast<size_t>(const_cast<GPT*>(this)->moe(l).stored_bytes(N));
  return static_cast<size_t>(carve_activations(nullptr, nullptr, sizes_for(N))) +
         token_arrays() * static_cast<size_t>(N) * sizeof(int32_t) + moe_bytes;
}

size_t GPT::work16_bytes(int B, int T) const {
  if (compute_ == DType::F32 && recompute_.empty()) return 0;
  const int64_t N = static_cast<int64_t>(B) * T;
  return static_cast<size_t>(carve_work16(nullptr, nullptr, sizes_for(N), head_rows(N)));
}

void GPT::set_compute_dtype(DType t) {
  for (const auto& s : slots_)
    LATTICE_CHECK(!s || !s->has_forward, "set_compute_dtype with a micro-batch in flight");
  for (ParamGroup& g : groups_) g.set_compute_dtype(t);
  if (t == compute_) return;
  compute_ = t;
  // Every slot is carved again at its next use, in the new storage.
  slots_.clear();
  eval_slot_.reset();
  work16_.reset();
}

void GPT::set_recompute(std::vector<Recompute> per_layer) {
  for (const auto& s : slots_)
    LATTICE_CHECK(!s || !s->has_forward, "set_recompute with a micro-batch in flight");
  LATTICE_CHECK(per_layer.empty() || per_layer.size() == static_cast<size_t>(local_layers()),
                "set_recompute: " << per_layer.size() << " entries for the " << local_layers()
                                  << " layers of stage [" << first_layer_ << ", " << last_layer_ << ")");
  if (std::all_of(per_layer.begin(), per_layer.end(), [](Recompute r) { return r == Recompute::None; }))
    per_layer.clear();
  if (per_layer == recompute_) return;
  recompute_ = std::move(per_layer);
  // Every slot and the work arrays are carved again at their next use, for the new policy.
  slots_.clear();
  eval_slot_.reset();
  work16_.reset();
}

void GPT::params_changed() {
  for (ParamGroup& g : groups_) g.params_changed();
}

Slot& GPT::slot(int index, int B, int T) {
  LATTICE_CHECK(B >= 1 && T >= 1, "micro-batch must have B >= 1 and T >= 1, got B=" << B << " T=" << T);
  LATTICE_CHECK(T <= config_.seq_len,
                "sequence length " << T << " exceeds model.seq_len=" << config_.seq_len);
  std::unique_ptr<Slot>* holder;
  if (index < 0) {
    holder = &eval_slot_;
  } else {
    if (static_cast<size_t>(index) >= slots_.size()) slots_.resize(index + 1);
    holder = &slots_[index];
  }
  if (!*holder) *holder = std::make_unique<Slot>();
  Slot& s = **holder;
  const int64_t N = static_cast<int64_t>(B) * T;
  if (tp_) tp_->check_rows(N);
  if (cp_) cp_->check_local_length(T);
  const CarveSizes z = sizes_for(N);
  if (N > s.capacity_tokens) {
    // First use (or a larger batch): allocate once, reused by every later step.
    s.act_mem = Buffer(carve_activations(nullptr, nullptr, z), MemCategory::Activations);
    s.token_mem = Buffer(token_arrays() * N * sizeof(int32_t), MemCategory::Activations);
    s.grad_mem.reset();
    s.capacity_tokens = N;
  }
  s.B = B;
  s.T = T;
  carve_activations(&s, s.act_mem.data(), z);
  if (compute_ != DType::F32) work16_for(s).forget();  // a new forward: the work arrays hold nothing yet
  s.inputs = s.token_mem.as<int32_t>();
  s.rows = s.inputs + N;
  s.targets = compute_ != DType::F32 ? s.rows + N : nullptr;
  return s;
}

// Every id of a batch must be a row of wte, checked before any work so the
// message names the model's vocabulary rather than a kernel's argument.
static void check_ids(const char* what, const int32_t* ids, int64_t n, int vocab_size) {
  for (int64_t i = 0; i < n; i++) {
    LATTICE_CHECK(ids[i] >= 0 && ids[i] < vocab_size, what << " id " << ids[i] << " at position " << i
                                                            << " is outside the vocabulary [0, " << vocab_size
                                                            << ")");
  }
}

// One block on the B·T rows of x into x_next (which may be x itself),
// keeping its intermediates in a; the parts do the math (model/parts/), this
// composes them with the residual stream. `attend` fills a.atty from a.qkv:
// the training forward's causal attention, or decode()'s cached attention.
// Under tensor parallelism the parts are Megatron's column- and row-parallel
// layers on this rank's slices, and with sequence parallelism x, x_next, the
// norms and the residual hold this rank's rows only; `work` [N, C] then takes
// the gathered norm output and the row-parallel partial sums.
// Mixed precision (q = bf16 | f16): every activation is rounded to q as soon
// as it is produced, so each operation reads what a kernel storing q would
// have left (and the backward, which loads the stored copies, sees exactly
// what the forward used); the arithmetic inside each operation, GEMM sums
// and norm/softmax statistics included, stays f32.
void GPT::block_forward(int layer, const LayerActs& a, const float* x, float* x_next, int B, int T,
                        int first_position, float* work, DType q, const std::function<void()>& attend,
                        parts::MoeActs* moe_state, bool record, bool recompute) {
  ParamGroup& g = block_group(layer);
  const int C = dims_.C;
  const int64_t N = static_cast<int64_t>(B) * T, R = rows(N);
  const bool sp = tp_ && tp_->sequence_parallel();
  auto w = [&g](size_t i) { return g.compute_param(i); };
  auto bias = [&](size_t norm) { return norm_.has_bias() ? w(norm + 1) : nullptr; };
  // r = x + Attn(Norm₁(x))
  norm_.forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, w(layout_.norm1), bias(layout_.norm1), R);
  k::round_to(q, a.ln1, R * C);
  const parts::Attention attn = attention(g);
  attn.project(a.qkv, a.ln1, work, B, T, first_position, q);
  attend();
  k::round_to(q, a.atty, N * dims_.A);
  // All-to-all context parallelism's head-sharded copy of it, which its
  // backward reads (the same values, rounded the same way).
  if (cp_ && cp_->stores_heads_out()) k::round_to(q, a.heads_out, N * dims_.A);
  attn.output(a.res1, sp ? work : a.res1, a.atty, N);
  k::add_inplace(a.res1, x, R * C);
  k::round_to(q, a.res1, R * C);
  // x' = r + MLP(Norm₂(r))
  norm_.forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res1, w(layout_.norm2), bias(layout_.norm2), R);
  k::round_to(q, a.ln2, R * C);
  if (moe_layer(layer)) {
    // Recomputing: the MoE's arrays (routing, experts, shared experts) were
    // kept, and x_next is not used: nothing to run again, nothing routed twice.
    if (recompute) return;
    LATTICE_CHECK(moe_state, "internal: MoE layer " << layer << " without its state");
    if (!moe_work_) moe_work_ = std::make_unique<parts::MoeWork>();
    moe(layer).forward(*moe_state, *moe_work_, x_next, a.ln2, work, N, q, moe_scale_, record);
  } else {
    mlp(g).forward(x_next, a.fch, a.hid, a.ln2, work, N, q);
  }
  k::add_inplace(x_next, a.res1, R * C);
  k::round_to(q, x_next, R * C);
}

// The f32 arrays of slot s's stage layer l for its backward: the slot's own
// at f32; with 16-bit storage the work arrays, loaded from the slot unless
// they hold that layer already, with the slot's statistics. A recomputed
// layer (recompute.h) has what it did not store computed again here — in
// the fused backward and backward_input — into the work arrays, and under
// the split backward those backward_weight reads into the slot's kept
// copy, where backward_weight finds them (it recomputes nothing).
const LayerActs& GPT::layer_acts(Slot& s, int l) {
  const Recompute r = recompute_of(l);
  if (s.store == DType::F32 && r == Recompute::None) return s.layers[l];
  Work16& w = work16_for(s);
  const LayerActs* kept = s.split && r != Recompute::None ? &s.kept[l] : nullptr;
  if (w.holds == &s && w.holds_layer == l && w.holds_kept == (kept != nullptr)) return w.layer;
  const LayerActs& a = work_layer(s, l, kept);
  if (s.store != DType::F32) load_layer(s.store, s.packed[l], a, sizes_for(static_cast<int64_t>(s.B) * s.T));
  const bool weight_half = s.split && s.has_backward_input;
  if (r != Recompute::None && !weight_half) recompute_layer(s, l, a);
  return a;
}

// Stage layer l's fields that slot s's forward did not store, computed again
// into a by the forward's own calls on the forward's own inputs (x_l, and
// under selective r_l and fch, stored), so with the same bits.
void GPT::recompute_layer(Slot& s, int l, const LayerActs& a) {
  const int C = dims_.C;
  const int64_t N = static_cast<int64_t>(s.B) * s.T, R = rows(N);
  const float* x = x_of(s, l);
  if (recompute_of(l) == Recompute::Full) {
    // The block's forward again, from x_l (its output, x_{l+1}, is stored: discarded).
    layer_forward(s, l, a, x, work16_for(s).x[1], true);
    return;
  }
  // Selective: block_forward's norm₁ and norm₂ calls and the MLP's activation.
  ParamGroup& g = block_group(first_layer_ + l);
  auto w = [&g](size_t i) { return g.compute_param(i); };
  auto bias = [&](size_t norm) { return norm_.has_bias() ? w(norm + 1) : nullptr; };
  norm_.forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, w(layout_.norm1), bias(layout_.norm1), R);
  k::round_to(compute_, a.ln1, R * C);
  norm_.forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res1, w(layout_.norm2), bias(layout_.norm2), R);
  k::round_to(compute_, a.ln2, R * C);
  if (!moe_layer(first_layer_ + l)) mlp(g).activation(a.hid, a.fch, N, compute_);  // (an MoE layer keeps its own)
}

void GPT::layer_forward(Slot& s, int i, const LayerActs& a, const float* x, float* x_next, bool recompute) {
  const int l = first_layer_ + i;
  block_forward(l, a, x, x_next, s.B, s.T, 0, s.work, compute_,
                [&] { attention(block_group(l)).attend(a.atty, a.lse, a.qkv, a.heads_out, s.B, s.T, DType::F32); },
                moe_layer(l) ? &moe_acts(s, i) : nullptr, moe_record_, recompute);
}

parts::MoeActs& GPT::moe_acts(Slot& s, int i) {
  if (s.moe.size() != static_cast<size_t>(local_layers())) s.moe.resize(static_cast<size_t>(local_layers()));
  auto& p = s.moe[static_cast<size_t>(i)];
  if (!p) p = std::make_unique<parts::MoeActs>();
  return *p;
}


// The residual stream x_i of slot s in f32 (rows(N) × C).
const float* GPT::x_of(Slot& s, int i) {
  if (s.store == DType::F32) return s.x[i];
  Work16& w = work16_for(s);
  if (w.holds_x != &s || w.holds_x_index != i) {
    const int64_t N = static_cast<int64_t>(s.B) * s.T;
    k::load_16bit(s.store, s.x16[i], w.x[0], rows(N) * config_.n_embd);
    w.holds_x = &s, w.holds_x_index = i;
  }
  return w.x[0];
}

// LN_f's output of slot s in f32 (N × C), loaded once per backward.
const float* GPT::lnf_of(Slot& s) {
  if (s.store == DType::F32) return s.lnf;
  Work16& w = work16_for(s);
  if (w.holds_lnf != &s) {
    const int64_t N = static_cast<int64_t>(s.B) * s.T;
    k::load_16bit(s.store, s.lnf16, w.lnf, N * config_.n_embd);
    w.holds_lnf = &s;
  }
  return w.lnf;
}

void GPT::params_in(size_t g, Pass pass) {
  if (hooks_) hooks_->before_params(g, pass);
}
void GPT::params_out(size_t g, Pass pass) {
  if (hooks_) hooks_->after_params(g, pass);
}
void GPT::grads_in(size_t g) {
  if (hooks_) hooks_->before_grads(g);
}
void GPT::grads_out(size_t g) {
  if (hooks_) hooks_->grads_done(g);
}

// A block's groups in the backward: the block's, then (MoE) its experts'.
void GPT::block_params_in(int l) {
  params_in(block_index(l), Pass::Backward);
  if (moe_layer(l)) params_in(expert_index(l), Pass::Backward);
}
void GPT::block_params_out(int l) {
  if (moe_layer(l)) params_out(expert_index(l), Pass::Backward);
  params_out(block_index(l), Pass::Backward);
}
void GPT::block_grads_in(int l) {
  grads_in(block_index(l));
  if (moe_layer(l)) grads_in(expert_index(l));
}
void GPT::block_grads_out(int l) {
  if (moe_layer(l)) grads_out(expert_index(l));
  grads_out(block_index(l));
}

void GPT::forward_body(Slot& s, const int32_t* inputs, const float* input) {
  const int B = s.B, T = s.T, C = config_.n_embd, L = local_layers();
  const int64_t N = static_cast<int64_t>(B) * T, R = rows(N);
  const bool sp = tp_ && tp_->sequence_parallel();
  if (work16_) work16_->forget();
  if (first_stage()) {
    LATTICE_CHECK(inputs, "the first pipeline stage's forward needs the token ids");
    check_ids("token", inputs, N, config_.vocab_size);
    std::memcpy(s.inputs, inputs, N * sizeof(int32_t));
    // Token ids as rows of this rank's slice of wte (-1: held by another rank).
    const tensor::VocabRange range{vocab_first_, dims_.V, vocab_real_};
    tensor::local_tokens(s.rows, inputs, N, range);
    // The embedding's parameters stay in until the caller's head is done with wte.
    params_in(embedding_index(), Pass::Forward);
    // x₀ = embed[tokens] (+ wpe[0..T)). Vocabulary-parallel: each rank looks up
    // the tokens it holds (zero rows for the rest), rank 0 adds wpe, and the
    // sum over the group (reduce-scattered into this rank's rows under SP) is the lookup.
    float* x0 = sp ? s.work : x_buf(s, 0);
    tied().lookup(x0, s.rows, B, T, tp_rank() == 0 ? positions_for(T) : nullptr);
    if (tp_) tp_->reduce(x0, x_buf(s, 0), N, C, "embedding");
    if (!last_stage() || !tied_head()) params_out(embedding_index(), Pass::Forward);
  } else {
    LATTICE_CHECK(input, "pipeline stage [" << first_layer_ << ", " << last_layer_ << ") needs its input activation");
    std::memcpy(x_buf(s, 0), input, R * C * sizeof(float));
  }
  keep_x(s, 0);
  const CarveSizes z = sizes_for(N);
  for (int i = 0; i < L; i++) {
    const int l = first_layer_ + i;
    const bool own = s.store == DType::F32 && recompute_of(i) == Recompute::None;
    const LayerActs& a = own ? s.layers[i] : work_layer(s, i);
    params_in(block_index(l), Pass::Forward);
    if (moe_layer(l)) params_in(expert_index(l), Pass::Forward);
    layer_forward(s, i, a, x_buf(s, i), x_buf(s, i + 1));
    if (moe_layer(l)) params_out(expert_index(l), Pass::Forward);
    params_out(block_index(l), Pass::Forward);
    if (s.store != DType::F32) store_layer(s.store, a, s.packed[i], z);
    keep_x(s, i + 1);
  }
  if (!last_stage()) {
    if (s.out32) std::memcpy(s.out32, x_buf(s, L), R * C * sizeof(float));
    return;
  }
  params_in(final_index(), Pass::Forward);
  ParamGroup& f = final_group();
  // LN_f into this rank's rows of lnf, then (SP) gathered in place: the head
  // is column-parallel over the vocabulary and reads every row.
  float* lnf = s.store == DType::F32 ? s.lnf : work16_for(s).lnf;
  float* lnf_rows = lnf + first_row(N) * C;
  norm_.forward(lnf_rows, s.lnf_mean, s.lnf_rstd, x_buf(s, L), f.compute_param(layout_.norm_f),
                norm_.has_bias() ? f.compute_param(layout_.norm_f + 1) : nullptr, R);
  k::round_to(compute_, lnf_rows, R * C);
  if (tp_) tp_->gather(lnf_rows, lnf, N, C, "final LayerNorm output");
  if (s.store != DType::F32) k::store_16bit(s.store, lnf, s.lnf16, N * C);
  if (!tied_head()) return;  // the untied head is in the final group, which stays in for it
  params_out(final_index(), Pass::Forward);
  if (!first_stage()) params_in(embedding_index(), Pass::Forward);  // the tied head's wte
}

// The forward's residual stream x_i: the slot's own at f32; with 16-bit
// storage one of the two work buffers (a layer reads x_i and writes x_{i+1}).
float* GPT::x_buf(Slot& s, int i) { return s.store == DType::F32 ? s.x[i] : work16_for(s).x[i % 2]; }

// The 16-bit path's work arrays, carved for slot s's micro-batch (two slots
// of different sizes may be in flight: carving for the other one forgets
// what the arrays held).
Work16& GPT::work16_for(const Slot& s) {
  if (!work16_) work16_ = std::make_unique<Work16>();
  Work16& w = *work16_;
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  if (w.carved_tokens == N) return w;
  const CarveSizes z = sizes_for(N);
  const size_t bytes = static_cast<size_t>(carve_work16(nullptr, nullptr, z, head_rows(N)));
  if (w.mem.bytes() < bytes) w.mem = Buffer(bytes, MemCategory::Activations);
  carve_work16(&w, w.mem.data(), z, head_rows(N));
  w.carved_tokens = N;
  w.forget();
  return w;
}

// x_i is complete: with 16-bit storage it is rounded and stored.
void GPT::keep_x(Slot& s, int i) {
  if (s.store == DType::F32) return;
  const int64_t n = rows(static_cast<int64_t>(s.B) * s.T) * config_.n_embd;
  float* x = x_buf(s, i);
  k::round_to(s.store, x, n);
  k::store_16bit(s.store, x, s.x16[i], n);
}

// The arrays slot s's layer l computes in: each field from `kept` (the
// split backward's copy of a recomputed layer) if it has it, else the
// slot's own (f32 storage; the statistics at any storage) if it stores it,
// else the work arrays.
const LayerActs& GPT::work_layer(Slot& s, int l, const LayerActs* kept) {
  Work16& w = work16_for(s);
  const LayerActs& mine = s.layers[l];
  auto pick = [&](float* LayerActs::*field) {
    float* p = kept ? kept->*field : nullptr;
    if (!p) p = mine.*field;
    w.layer.*field = p ? p : w.own.*field;
  };
  for (float* LayerActs::*f : {&LayerActs::ln1, &LayerActs::qkv, &LayerActs::atty, &LayerActs::res1,
                               &LayerActs::ln2, &LayerActs::fch, &LayerActs::hid, &LayerActs::heads_out})
    pick(f);
  for (float* LayerActs::*f : {&LayerActs::ln1_mean, &LayerActs::ln1_rstd, &LayerActs::lse, &LayerActs::ln2_mean,
                               &LayerActs::ln2_rstd})
    pick(f);
  w.holds = &s, w.holds_layer = l, w.holds_kept = kept != nullptr;
  w.holds_x = nullptr;  // x_buf is being rewritten
  return w.layer;
}

static float mean_of(const float* x, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; i++) sum += x[i];
  return static_cast<float>(sum / static_cast<double>(n));
}

float GPT::forward(int slot_index, const int32_t* inputs, const int32_t* targets, int B, int T,
                   float loss_grad_scale) {
  LATTICE_CHECK(whole_model(), "forward() runs the whole model; pipeline stage [" << first_layer_ << ", "
                                                                                  << last_layer_
                                                                                  << ") runs forward_stage()");
  return forward_stage(slot_index, inputs, nullptr, targets, B, T, loss_grad_scale);
}

float GPT::forward_stage(int slot_index, const int32_t* inputs, const float* input, const int32_t* targets, int B,
                         int T, float loss_grad_scale) {
  LATTICE_CHECK(slot_index >= 0, "slot index must be >= 0, got " << slot_index);
  const GemmPrecision gemms(compute_);
  Slot& s = slot(slot_index, B, T);
  LATTICE_CHECK(!s.has_forward, "forward on micro-batch slot " << slot_index << " whose backward has not run");
  const int64_t N = static_cast<int64_t>(B) * T;
  const int V = config_.vocab_size;
  if (last_stage()) {
    LATTICE_CHECK(targets, "the last pipeline stage's forward needs the targets");
    check_ids("target", targets, N, V);
  }
  moe_scale_ = loss_grad_scale, moe_record_ = !evaluation_;
  forward_body(s, inputs, input);
  moe_record_ = false;
  s.has_forward = true;
  s.output_grad = nullptr;
  s.input_grad_ready = false;
  if (!last_stage()) return 0.0f;
  // logits = LN_f(x_L) · wteᵀ, then loss and dlogits in one pass:
  // dlogits = (loss_grad_scale / N) · (softmax - onehot).
  head_and_loss(s, targets, true, loss_grad_scale / static_cast<float>(N));
  return mean_of(s.losses, N);
}

const float* GPT::stage_output(int slot_index) {
  LATTICE_CHECK(!last_stage(), "the last pipeline stage has no output activation (it ends in the loss)");
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward, "stage_output of micro-batch slot " << slot_index << " before its forward");
  return s.store == DType::F32 ? s.x[local_layers()] : s.out32;
}

void GPT::set_stage_output_grad(int slot_index, const float* grad) {
  LATTICE_CHECK(!last_stage(), "the last pipeline stage takes no output gradient (its backward starts at the loss)");
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward && !s.has_backward_input,
                "set_stage_output_grad on micro-batch slot " << slot_index << " without a pending forward");
  s.output_grad = grad;
}

const float* GPT::stage_input_grad(int slot_index) {
  LATTICE_CHECK(!first_stage(), "the first pipeline stage has no input gradient (its input is token ids)");
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.input_grad_ready, "stage_input_grad of micro-batch slot " << slot_index
                                                                            << " before its backward");
  return dx_of(s, 0) + first_row(static_cast<int64_t>(s.B) * s.T) * config_.n_embd;
}

Slot& GPT::inference_slot(int B, int T) {
  // Between training steps slot 0 holds nothing: evaluation borrows its
  // memory instead of keeping a second set of activations alive.
  if (!slots_.empty() && slots_[0] && !slots_[0]->has_forward) return slot(0, B, T);
  return slot(-1, B, T);
}

float GPT::evaluate(const int32_t* inputs, const int32_t* targets, int B, int T) {
  LATTICE_CHECK(whole_model(), "evaluate() runs the whole model, not pipeline stage [" << first_layer_ << ", "
                                                                                     << last_layer_ << ")");
  const GemmPrecision gemms(compute_);
  Slot& s = inference_slot(B, T);
  const int64_t N = static_cast<int64_t>(B) * T;
  check_ids("target", targets, N, config_.vocab_size);
  forward_body(s, inputs, nullptr);
  head_and_loss(s, targets, false, 0.0f);
  return mean_of(s.losses, N);
}

// ---------------------------------------------------------------- backward --

void GPT::layer_backward_input(Slot& s, int l) {
  const int B = s.B, T = s.T, C = config_.n_embd;
  const int64_t N = static_cast<int64_t>(B) * T, R = rows(N), first = first_row(N) * C;
  ParamGroup& g = block_group(first_layer_ + l);  // l: this stage's layer index
  const LayerActs& a = layer_acts(s, l);
  LayerGrads& d = dlayer_of(s, l);
  float* dout = dx_of(s, l + 1);  // dL/dx_{l+1}: this rank's rows at `first` (SP), else whole
  float* dx = dx_of(s, l);        // dL/dx_l (written here, the same rows)
  // MLP: x' = r + MLP(Norm₂(r))  (dout gathered in place under SP)
  const int layer = first_layer_ + l;
  if (moe_layer(layer))
    moe(layer).backward_input(moe_acts(s, l), *moe_work_, d.dln2, dout + first, dout, N);
  else
    mlp(g).backward_input(d.dln2, d.dfch, s.scratch4c, dout + first, dout, a.fch, N);
  // dr = dout (residual path) + Norm₂ backward, this rank's rows
  float* dres1 = d.dres1 + first;
  std::memcpy(dres1, dout + first, R * C * sizeof(float));
  norm_.backward_input(dres1, d.dln2, a.res1, g.compute_param(layout_.norm2), a.ln2_mean, a.ln2_rstd, R);
  // Attention: r = x + Attn(Norm₁(x))
  attention(g).backward_input(d.dln1, d.dqkv, s.scratch_c, dres1, d.dres1, a.qkv, a.atty, a.lse, a.heads_out, B, T);
  // dx = dr (residual path) + Norm₁ backward
  std::memcpy(dx + first, dres1, R * C * sizeof(float));
  norm_.backward_input(dx + first, d.dln1, x_of(s, l), g.compute_param(layout_.norm1), a.ln1_mean, a.ln1_rstd, R);
}

void GPT::layer_backward_weight(Slot& s, int l) {
  const int C = config_.n_embd;
  const int64_t N = static_cast<int64_t>(s.B) * s.T, R = rows(N);
  const bool sp = tp_ && tp_->sequence_parallel();
  ParamGroup& g = block_group(first_layer_ + l);
  const LayerActs& a = layer_acts(s, l);
  LayerGrads& d = dlayer_of(s, l);
  const float* dout = dx_of(s, l + 1);  // whole (gathered by backward_input under SP)
  // The column-parallel layers' inputs are norm outputs, kept as this rank's
  // rows under SP: gathered again here (Megatron does the same) rather than
  // kept whole, which would undo half of SP's saving.
  auto whole = [&](const float* ln) { return sp ? tp_->gather(ln, s.work, N, C, "LayerNorm output (again)") : ln; };
  const int layer = first_layer_ + l;
  if (moe_layer(layer))
    moe(layer).backward_weight(moe_acts(s, l), *moe_work_, dout, whole(a.ln2), N);
  else
    mlp(g).backward_weight(dout, a.hid, d.dfch, whole(a.ln2), N);
  norm_.weight_grads(g, layout_.norm2, d.dln2, a.res1, a.ln2_mean, a.ln2_rstd, R, tp_, s.ln_scratch);
  attention(g).backward_weight(d.dres1, a.atty, d.dqkv, whole(a.ln1), N);
  norm_.weight_grads(g, layout_.norm1, d.dln1, x_of(s, l), a.ln1_mean, a.ln1_rstd, R, tp_, s.ln_scratch);
}


void GPT::embedding_backward_weight(Slot& s) {
  // Every rank needs the whole dx₀: its wte rows may be any token's, and
  // wpe (replicated) gets the same whole gradient on every rank.
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  float* dx0 = dx_of(s, 0);
  if (tp_) tp_->gather(dx0 + first_row(N) * config_.n_embd, dx0, N, config_.n_embd, "embedding gradient");
  tied().lookup_backward(dx0, s.rows, s.B, s.T, positions_for(s.T));
}

// The carve sizes of slot s's micro-batch (or of its capacity).
CarveSizes GPT::grad_sizes(const Slot& s, bool capacity) const {
  return sizes_for(capacity ? s.capacity_tokens : static_cast<int64_t>(s.B) * s.T);
}

static Slot& existing_slot(std::vector<std::unique_ptr<Slot>>& slots, int index) {
  LATTICE_CHECK(index >= 0 && static_cast<size_t>(index) < slots.size() && slots[index],
                "micro-batch slot " << index << " has no forward");
  return *slots[index];
}

void GPT::backward_input(int slot_index) {
  const GemmPrecision gemms(compute_);
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward && !s.has_backward_input,
                "backward_input on micro-batch slot " << slot_index << " without a pending forward");
  prepare_grads(s, grad_sizes(s), grad_sizes(s, true), true);
  head_input_with_hooks(s);
  for (int l = local_layers() - 1; l >= 0; l--) {
    block_params_in(first_layer_ + l);
    layer_backward_input(s, l);
    block_params_out(first_layer_ + l);
  }
  s.has_backward_input = true;
  s.input_grad_ready = !first_stage();
}

void GPT::backward_weight(int slot_index) {
  const GemmPrecision gemms(compute_);
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_backward_input, "backward_weight on micro-batch slot " << slot_index
                                                                           << " before its backward_input");
  // Same order as backward(): head, blocks from last to first, embedding.
  head_weight_with_hooks(s);
  for (int l = local_layers() - 1; l >= 0; l--) {
    block_grads_in(first_layer_ + l);
    layer_backward_weight(s, l);
    block_grads_out(first_layer_ + l);
  }
  embedding_weight_with_hooks(s);
  s.has_forward = s.has_backward_input = false;
}

void GPT::backward(int slot_index) {
  const GemmPrecision gemms(compute_);
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward && !s.has_backward_input,
                "backward on micro-batch slot " << slot_index << " without a pending forward");
  prepare_grads(s, grad_sizes(s), grad_sizes(s, true), false);
  if (last_stage() && s.store != DType::F32 && !s.keep_logits) {
    head_recomputed_with_hooks(s);
  } else {
    head_input_with_hooks(s);
    head_weight_with_hooks(s);
  }
  for (int l = local_layers() - 1; l >= 0; l--) {
    block_params_in(first_layer_ + l);
    layer_backward_input(s, l);
    block_params_out(first_layer_ + l);
    block_grads_in(first_layer_ + l);
    layer_backward_weight(s, l);
    block_grads_out(first_layer_ + l);
  }
  embedding_weight_with_hooks(s);
  s.has_forward = false;
  s.input_grad_ready = !first_stage();
}

void GPT::release(int slot_index) {
  Slot& s = existing_slot(slots_, slot_index);
  s.has_forward = s.has_backward_input = false;
  s.output_grad = nullptr;
}


void GPT::zero_grad() {
  for (ParamGroup& g : groups_) g.zero_grad();
  // A step starts: whatever changed the master weights since the last one
  // (an update, a load), the compute copies follow them.
  params_changed();
}

}  // namespace lattice::model