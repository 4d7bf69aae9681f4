// The embedding's and the head's operations, and the model's head: the final
// norm's output through the head into logits, the loss, and their backward
// with the hooks around them.
#include "lattice/model/head.h"

#include <algorithm>
#include <cstring>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/layers/tensor/vocab_parallel.h"
#include "lattice/model/activations.h"
#include "lattice/model/gpt.h"

namespace lattice::model {

namespace k = lattice::kernels;
using Pass = GroupHooks::Pass;

void LocalHead::head_forward(float* logits, const float* lnf, int64_t rows, int64_t ld) {
  const int Vw = vocab_rows();
  k::gemm(false, true, rows, Vw, C_, 1.0f, lnf, ld, g_.compute_param(i_), C_, 0.0f, logits, Vw);
}

void LocalHead::head_backward_input(float* dlnf, const float* dlogits, int64_t N) {
  k::linear_backward_input(dlnf, dlogits, g_.compute_param(i_), N, C_, vocab_rows(), false);
}

void LocalHead::head_backward_weight(const float* dlogits, const float* lnf, int64_t N) {
  bool acc = false;
  float* dw = g_.write_grad(i_, &acc);
  k::linear_backward_weight(dw, nullptr, dlogits, lnf, N, C_, vocab_rows(), acc);
}

void for_each_position_run(const int32_t* positions, int T, const std::function<void(int, int, int)>& fn) {
  for (int t = 0; t < T;) {
    int end = t + 1;
    while (end < T && positions[end] == positions[end - 1] + 1) end++;
    fn(t, positions[t], end - t);
    t = end;
  }
}

void embedding_forward_at(float* x, const int32_t* rows, const float* wte, const float* wpe, const int32_t* positions,
                          int B, int T, int C) {
  if (!wpe || positions[T - 1] - positions[0] == T - 1) {  // one run (always, without context parallelism)
    k::embedding_forward(x, rows, wte, wpe ? wpe + static_cast<int64_t>(positions[0]) * C : nullptr, B, T, C);
    return;
  }
  for (int b = 0; b < B; b++)
    for_each_position_run(positions, T, [&](int t, int position, int n) {
      const int64_t row = static_cast<int64_t>(b) * T + t;
      k::embedding_forward(x + row * C, rows + row, wte, wpe + static_cast<int64_t>(position) * C, 1, n, C);
    });
}

void embedding_backward_at(float* dwte, float* dwpe, const float* dx, const int32_t* rows, const int32_t* positions,
                           int B, int T, int C) {
  if (!dwpe || positions[T - 1] - positions[0] == T - 1) {
    k::embedding_backward(dwte, dwpe ? dwpe + static_cast<int64_t>(positions[0]) * C : nullptr, dx, rows, B, T, C);
    return;
  }
  for (int b = 0; b < B; b++)
    for_each_position_run(positions, T, [&](int t, int position, int n) {
      const int64_t row = static_cast<int64_t>(b) * T + t;
      k::embedding_backward(dwte, dwpe + static_cast<int64_t>(position) * C, dx + row * C, rows + row, 1, n, C);
    });
}

void LocalEmbedding::lookup(float* x, const int32_t* rows, int B, int T, const int32_t* positions) {
  embedding_forward_at(x, rows, e_.compute_param(0), positions && wpe_ ? e_.compute_param(1) : nullptr, positions, B,
                       T, C_);
}

void LocalEmbedding::lookup_backward(const float* dx, const int32_t* rows, int B, int T, const int32_t* positions) {
  // A scatter-add cannot overwrite: a gradient nobody has written since
  // zero_grad() is cleared first. A tied wte normally already holds the
  // head's share (head_backward_weight runs first); wpe is cleared here on
  // the first micro-batch of a step (T·C floats).
  float* d[2] = {nullptr, nullptr};
  for (size_t p = 0; p < (wpe_ ? 2u : 1u); p++) {
    bool acc = false;
    d[p] = e_.write_grad(p, &acc);
    if (!acc) std::memset(d[p], 0, sizeof(float) * e_.params()[p].numel());
  }
  embedding_backward_at(d[0], d[1], dx, rows, positions, B, T, C_);
}

HeadOps& GPT::head() {
  if (tied_head()) return tied();
  return *untied_head_;
}

// The head at 16-bit storage. Where its operations are local (no tensor
// parallelism, the model's own embedding: not ZeRO-2/3's), the f32 logits
// never exist whole (206 MB at GPT-2's vocabulary and 1024 tokens) and
// dlogits are not kept at all: the forward computes the logits and the loss
// kHeadRows rows at a time, and the backward recomputes each chunk's
// dlogits from the stored final norm output and the targets (one more head
// GEMM, as activation recomputation trades FLOPs for memory: ~9% of GPT-2
// 124M's step at T=256). Under tensor parallelism or with a custom
// embedding, whose head operations communicate on every call, all rows at
// once, and dlogits are stored in 16 bits. Either way the backward reads the
// same values: dlogits rounded to the compute dtype.
bool GPT::local_head() const { return !tp_ && (!tied_head() || !custom_embedding_); }

int64_t GPT::head_rows(int64_t N) const { return local_head() ? std::min(N, GPT::kHeadRows) : N; }

void GPT::loss(float* logits, float* losses, const int32_t* targets, int64_t N, bool backward, float dloss) {
  const int V = config_.vocab_size;
  if (!tp_) {
    if (backward)
      k::crossentropy_forward_backward(logits, losses, targets, N, V, dims_.V, dloss);
    else
      k::crossentropy_forward(losses, logits, targets, N, V, dims_.V);
    return;
  }
  tensor::vocab_parallel_cross_entropy(tp_, logits, losses, targets, N, {vocab_first_, dims_.V, vocab_real_},
                                       backward, dloss);
}

// logits = Norm_f(x_L) · Wᵀ and the loss into s.losses; with `backward` the
// logits become dloss · (softmax - onehot) in the same pass (kept in the
// slot for the head's backward). With 16-bit storage the f32 logits exist
// head_rows(N) rows at a time and dlogits are stored rounded.
void GPT::head_and_loss(Slot& s, const int32_t* targets, bool backward, float dloss) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  const int C = config_.n_embd;
  if (s.store == DType::F32) {
    head().head_forward(s.logits, s.lnf, N, C);
    params_out(head_index(), Pass::Forward);
    loss(s.logits, s.losses, targets, N, backward, dloss);
    return;
  }
  Work16& w = work16_for(s);
  const float* lnf = w.lnf;  // the forward's, still there
  const int64_t Vw = dims_.V;
  const bool keep = backward && s.keep_logits;
  for (int64_t r0 = 0; r0 < N; r0 += w.head_rows) {
    const int64_t n = std::min(w.head_rows, N - r0);
    head().head_forward(w.logits, lnf + r0 * C, n, C);
    loss(w.logits, s.losses + r0, targets + r0, n, keep, dloss);
    if (keep) k::store_16bit(s.store, w.logits, s.logits16 + r0 * Vw, n * Vw);
  }
  if (backward && !s.keep_logits) {
    std::memcpy(s.targets, targets, static_cast<size_t>(N) * sizeof(int32_t));
    s.dloss = dloss;
  }
  params_out(head_index(), Pass::Forward);
}

// fn(dlogits, r0, n) over the slot's dlogits in f32, head_rows at a time
// (16-bit storage: loaded into the work buffer), else all N rows at once.
void GPT::for_dlogits(Slot& s, const std::function<void(const float*, int64_t, int64_t)>& fn) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  if (s.store == DType::F32) return fn(static_cast<const float*>(s.logits), int64_t{0}, N);
  Work16& w = work16_for(s);
  const int64_t Vw = dims_.V, C = config_.n_embd;
  const float* lnf = s.keep_logits ? nullptr : lnf_of(s);
  for (int64_t r0 = 0; r0 < N; r0 += w.head_rows) {
    const int64_t n = std::min(w.head_rows, N - r0);
    if (s.keep_logits) {
      k::load_16bit(s.store, s.logits16 + r0 * Vw, w.logits, n * Vw);
    } else {
      // Recomputed exactly as the forward computed them (same rows, same
      // GEMM), then rounded as a stored copy would be.
      head().head_forward(w.logits, lnf + r0 * C, n, C);
      loss(w.logits, w.losses, s.targets + r0, n, true, s.dloss);
      k::round_to(s.store, w.logits, n * Vw);
    }
    fn(static_cast<const float*>(w.logits), r0, n);
  }
}

void GPT::head_backward_input(Slot& s, bool with_head_weight) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T, R = rows(N);
  const int C = config_.n_embd, L = local_layers();
  ParamGroup& f = final_group();
  // dlnf = dlogits · W — under TP this rank's vocabulary columns' share,
  // summed over the group (the head is column-parallel: f's backward). With
  // SP this rank's rows of the sum land in dlnf's first rows.
  // `with_head_weight`: W's gradient in the same pass over dlogits (the fused
  // backward, when dlogits are recomputed: once instead of twice).
  const float* lnf = with_head_weight ? lnf_of(s) : nullptr;
  for_dlogits(s, [&](const float* dlogits, int64_t r0, int64_t n) {
    head().head_backward_input(s.dlnf + r0 * C, dlogits, n);
    if (with_head_weight) head().head_backward_weight(dlogits, lnf + r0 * C, n);
  });
  if (tp_) tp_->reduce(s.dlnf, s.dlnf, N, C, "final LayerNorm output gradient");
  // dx_L = Norm_f backward (accumulating into zero), this rank's rows
  float* dxL = dx_of(s, L) + first_row(N) * C;
  std::memset(dxL, 0, R * C * sizeof(float));
  norm_.backward_input(dxL, s.dlnf, x_of(s, L), f.compute_param(layout_.norm_f), s.lnf_mean, s.lnf_rstd, R);
}

void GPT::head_backward_weight(Slot& s, bool head_weight_done) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  const int L = local_layers();
  // dW (+)= dlogitsᵀ · Norm_f(x_L)   (tied: the head's share of wte's gradient)
  if (!head_weight_done) {
    const float* lnf = lnf_of(s);
    for_dlogits(s, [&](const float* dlogits, int64_t r0, int64_t n) {
      head().head_backward_weight(dlogits, lnf + r0 * config_.n_embd, n);
    });
  }
  norm_.weight_grads(final_group(), layout_.norm_f, s.dlnf, x_of(s, L), s.lnf_mean, s.lnf_rstd, rows(N), tp_,
                     s.ln_scratch);
}

// The embedding's gradient is complete after the lookup's scatter-add (first
// stage) — on a last stage that is not the first, after the head's share.
void GPT::embedding_weight_with_hooks(Slot& s) {
  if (!first_stage()) return;
  // (a whole model with a tied head announced it before the head's share)
  if (!last_stage() || !tied_head()) grads_in(embedding_index());
  embedding_backward_weight(s);
  grads_out(embedding_index());
}

// The head's backward reads W and the final norm's weights, then writes
// their gradients (a tied embedding's are completed at the very end, by its
// scatter-add).
void GPT::head_input_with_hooks(Slot& s) {
  if (!last_stage()) {
    // The next stage's gradient of this stage's output starts the backward.
    LATTICE_CHECK(s.output_grad, "backward of pipeline stage [" << first_layer_ << ", " << last_layer_
                                                                << ") before set_stage_output_grad");
    const int64_t N = static_cast<int64_t>(s.B) * s.T;
    std::memcpy(dx_of(s, local_layers()) + first_row(N) * config_.n_embd, s.output_grad,
                rows(N) * config_.n_embd * sizeof(float));
    s.output_grad = nullptr;
    return;
  }
  if (tied_head()) params_in(embedding_index(), Pass::Backward);
  params_in(final_index(), Pass::Backward);
  head_backward_input(s);
  if (tied_head()) params_out(embedding_index(), Pass::Backward);
  params_out(final_index(), Pass::Backward);
}

// The fused backward's head when dlogits are recomputed (16-bit storage,
// local head): one pass over the chunks gives dlnf and W's gradient; the
// hooks see the head's parameters in and its gradients written as usual.
void GPT::head_recomputed_with_hooks(Slot& s) {
  const bool tied = tied_head();
  if (tied) params_in(embedding_index(), Pass::Backward);
  params_in(final_index(), Pass::Backward);
  if (tied) grads_in(embedding_index());
  grads_in(final_index());
  head_backward_input(s, true);
  if (tied) params_out(embedding_index(), Pass::Backward);
  params_out(final_index(), Pass::Backward);
  head_backward_weight(s, true);
  grads_out(final_index());
  if (tied && !first_stage()) grads_out(embedding_index());
}

void GPT::head_weight_with_hooks(Slot& s) {
  if (!last_stage()) return;
  const bool tied = tied_head();
  // Recomputing dlogits (16-bit storage without logits) reads W again.
  const bool reads_w = s.store != DType::F32 && !s.keep_logits;
  if (reads_w) params_in(head_index(), Pass::Backward);
  if (tied) grads_in(embedding_index());
  grads_in(final_index());
  head_backward_weight(s);
  if (reads_w) params_out(head_index(), Pass::Backward);
  grads_out(final_index());
  if (tied && !first_stage()) grads_out(embedding_index());  // no lookup here: the head's share is all of it
}

}  // namespace lattice::model
