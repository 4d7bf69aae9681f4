// The model's two ends: the token (and learned position) embedding that
// starts the residual stream, and the LM head that ends it in logits.
//
// The head is either tied — its weight is the token embedding (GPT-2) — or
// its own lm_head weight in the final group (Llama). Under tensor
// parallelism both the embedding and the head are vocabulary-parallel: a
// rank holds rows [first, first + Vw) of the padded vocabulary, looks up only
// the tokens in its range (the model sums the ranks' lookups) and computes
// only its columns of the logits (the loss then needs per-row statistics
// only: tensor/vocab_parallel.h).
#pragma once

#include <cstdint>
#include <functional>

#include "lattice/model/param_group.h"

namespace lattice::model {

// The three things the model does with a head's weight W [Vw, C].
class HeadOps {
 public:
  virtual ~HeadOps() = default;
  // logits[i, 0:Vw] = lnf_i · Wᵀ for `rows` rows of lnf (leading dimension
  // ld); logits has leading dimension Vw.
  virtual void head_forward(float* logits, const float* lnf, int64_t rows, int64_t ld) = 0;
  // dlnf[N, C] = dlogits[N, Vw] · W   (written)
  virtual void head_backward_input(float* dlnf, const float* dlogits, int64_t N) = 0;
  // dW (+)= dlogitsᵀ · lnf
  virtual void head_backward_weight(const float* dlogits, const float* lnf, int64_t N) = 0;
};

// The token embedding (wte, or Llama's embed_tokens) and the learned position
// embedding wpe when the model has one; when the head is tied, also the head
// (its share of wte's gradient joins the lookup's). The model has its own
// implementation over the embedding group's buffers; ZeRO-2/3 install one
// that works on a sharded embedding (piece by piece, never holding the whole
// table: parallel/zero/sharded_embedding.h). The model maps token ids to rows
// of this rank's slice (Vw rows: the whole padded vocabulary on one
// process), a negative row meaning a token another rank holds.
class TiedEmbedding : public HeadOps {
 public:
  // x[b,t,:] = wte[rows[b,t]] (0 for a negative row) + wpe[positions[t]]
  // (only with `positions` [T], and only when there is a wpe)          x: [B·T, C]
  // positions[t] is the place of row t in the whole sequence: t, or under
  // context parallelism this rank's chunks' places (layers/context).
  virtual void lookup(float* x, const int32_t* rows, int B, int T, const int32_t* positions) = 0;
  // d wte[rows[b,t]] += dx[b,t,:] (negative rows skipped) ;  d wpe[positions[t]] (+)= Σ_b dx[b,t,:]
  virtual void lookup_backward(const float* dx, const int32_t* rows, int B, int T, const int32_t* positions) = 0;
};

// A head over parameter `index` of a group, whole on this rank (its slice
// under tensor parallelism): the untied lm_head, and the tied head of the
// model's own embedding.
// Calls fn(first_row, first_position, rows) for each run of consecutive
// positions in positions[0, T) (one run: 0..T-1 without context parallelism).
void for_each_position_run(const int32_t* positions, int T, const std::function<void(int, int, int)>& fn);

// kernels::embedding_forward / embedding_backward with the wpe rows of
// positions[t] (positions may be null when wpe is).
void embedding_forward_at(float* x, const int32_t* rows, const float* wte, const float* wpe, const int32_t* positions,
                          int B, int T, int C);
void embedding_backward_at(float* dwte, float* dwpe, const float* dx, const int32_t* rows, const int32_t* positions,
                           int B, int T, int C);

class LocalHead final : public HeadOps {
 public:
  LocalHead(ParamGroup& group, size_t index, int C) : g_(group), i_(index), C_(C) {}
  void head_forward(float* logits, const float* lnf, int64_t rows, int64_t ld) override;
  void head_backward_input(float* dlnf, const float* dlogits, int64_t N) override;
  void head_backward_weight(const float* dlogits, const float* lnf, int64_t N) override;

 private:
  int vocab_rows() const { return static_cast<int>(g_.params()[i_].shape[0]); }
  ParamGroup& g_;
  size_t i_;
  int C_;
};

// The model's own TiedEmbedding: wte (parameter 0) and wpe (parameter 1,
// when `positions`) whole in the embedding group.
class LocalEmbedding final : public TiedEmbedding {
 public:
  LocalEmbedding(ParamGroup& group, int C, bool positions) : e_(group), head_(group, 0, C), C_(C), wpe_(positions) {}
  void lookup(float* x, const int32_t* rows, int B, int T, const int32_t* positions) override;
  void lookup_backward(const float* dx, const int32_t* rows, int B, int T, const int32_t* positions) override;
  void head_forward(float* logits, const float* lnf, int64_t rows, int64_t ld) override {
    head_.head_forward(logits, lnf, rows, ld);
  }
  void head_backward_input(float* dlnf, const float* dlogits, int64_t N) override {
    head_.head_backward_input(dlnf, dlogits, N);
  }
  void head_backward_weight(const float* dlogits, const float* lnf, int64_t N) override {
    head_.head_backward_weight(dlogits, lnf, N);
  }

 private:
  ParamGroup& e_;
  LocalHead head_;
  int C_;
  bool wpe_;
};

}  // namespace lattice::model
