// ModelConfig: the shape of a GPT-2-style model, and the derived quantities
// (padded vocabulary, parameter count, FLOPs per token) everything else uses.
#pragma once

#include <cstdint>

namespace lattice::model {

struct ModelConfig {
  int n_layer = 12;
  int n_head = 12;
  int n_embd = 768;
  int vocab_size = 50257;
  int seq_len = 1024;  // maximum sequence length = rows of wpe

  // The vocabulary rounded up to a multiple of 128, so the LM-head GEMM has a
  // friendly shape. Rows V..Vp-1 of wte are zero, never receive gradient, and
  // their logits are excluded from the softmax, so they never win.
  int padded_vocab() const { return (vocab_size + 127) / 128 * 128; }
  int head_size() const { return n_embd / n_head; }

  // Throws lattice::Error naming the offending key (model.n_embd, ...).
  void validate() const;

  // Parameters of the logical model, tied embedding counted once, without
  // the vocabulary padding: V·C + Tmax·C + L·(12C² + 13C) + 2C.
  int64_t num_params() const;

  // Model FLOPs per trained token (forward + backward) at sequence length T,
  // the PaLM / nanoGPT convention: 6·N + 12·L·C·T, where N = num_params()
  // minus the position embedding (a lookup, not a product; the tied wte is
  // counted because it is the LM head's weight). 6N counts the multiply-adds
  // of every weight (2 forward, 4 backward); 12·L·C·T counts the attention
  // score and value products (QKᵀ and PV, 2·T·C each per token forward, ×3
  // with backward), without discounting the causal mask.
  double flops_per_token(int T) const;
};

}  // namespace lattice::model
