// ModelConfig: the shape of a decoder-only transformer and the choice of
// each of its parts, and the derived quantities (padded vocabulary,
// parameter count, FLOPs per token) everything else uses.
//
// Two families share one block (model/gpt.h): GPT-2 (LayerNorm, learned
// positions, GELU MLP, biases, the LM head tied to the token embedding) and
// Llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no
// biases, an untied head). `family` sets the defaults of every part key
// (ModelConfig::defaults) and the names the parameters and checkpoints use
// (HF GPT-2's or HF Llama's); each part key can then be set on its own.
#pragma once

#include <cstdint>
#include <string>

namespace lattice::model {

enum class Family { GPT2, Llama };
enum class NormKind { LayerNorm, RMSNorm };
enum class MlpKind { GELU, SwiGLU };
enum class PositionKind { Learned, Rope };

// The config spellings ("gpt2", "llama", "layernorm", "rmsnorm", "gelu",
// "swiglu", "learned", "rope") and back; the parsers throw lattice::Error
// naming `key` and the valid values.
const char* name_of(Family f);
const char* name_of(NormKind n);
const char* name_of(MlpKind m);
const char* name_of(PositionKind p);
Family parse_family(const std::string& s, const char* key = "model.family");
NormKind parse_norm(const std::string& s, const char* key = "model.norm");
MlpKind parse_mlp(const std::string& s, const char* key = "model.mlp");
PositionKind parse_position(const std::string& s, const char* key = "model.position");

struct ModelConfig {
  Family family = Family::GPT2;
  int n_layer = 12;
  int n_head = 12;
  int n_embd = 768;
  int vocab_size = 50257;
  int seq_len = 1024;  // maximum sequence length (rows of the learned position embedding)

  // The parts. The defaults here are GPT-2's; defaults(Family::Llama) gives Llama's.
  NormKind norm = NormKind::LayerNorm;
  MlpKind mlp = MlpKind::GELU;
  PositionKind position = PositionKind::Learned;
  int n_kv_head = 0;   // key/value heads; 0: n_head (multi-head attention)
  int ffn_hidden = 0;  // the MLP's hidden width; 0: the family's (GPT-2 4C; Llama 8C/3 rounded up to 256)
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  bool bias = true;            // biases of every Linear (a LayerNorm always has its bias)
  bool tie_embeddings = true;  // the LM head is the token embedding
  // Mixture of experts (docs/moe.md): the MLP of every moe_every-th layer is
  // n_experts MLPs of the family's kind behind a top-k router (0: dense everywhere).
  int n_experts = 0;
  int top_k = 2;
  int moe_every = 1;
  int n_shared_experts = 0;
  int moe_ffn_hidden = 0;  // each expert's hidden width; 0: ffn()

  // A config of `family` with its defaults (the shape keys as above).
  static ModelConfig defaults(Family family);

  // The vocabulary rounded up to a multiple of 128, so the LM-head GEMM has a
  // friendly shape. Rows V..Vp-1 of the embedding (and head) are zero, never
  // receive gradient, and their logits are excluded from the softmax.
  int padded_vocab() const { return (vocab_size + 127) / 128 * 128; }
  int head_size() const { return n_embd / n_head; }
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int ffn() const;
  // Widths of the attention's projections: queries n_head·hs (= n_embd), keys and values kv_heads()·hs each.
  int64_t q_width() const { return static_cast<int64_t>(n_head) * head_size(); }
  int64_t kv_width() const { return static_cast<int64_t>(kv_heads()) * head_size(); }
  bool learned_positions() const { return position == PositionKind::Learned; }
  // Whether layer l's MLP is a mixture of experts: (l + 1) % moe_every == 0.
  bool is_moe_layer(int l) const { return n_experts > 0 && (l + 1) % moe_every == 0; }
  int moe_layers() const { return n_experts > 0 ? n_layer / moe_every : 0; }
  int moe_ffn() const { return moe_ffn_hidden > 0 ? moe_ffn_hidden : ffn(); }
  // The shared experts' width (one dense MLP): n_shared_experts · moe_ffn().
  int shared_ffn() const { return n_shared_experts * moe_ffn(); }
  // Parameters of one expert, and of one MoE layer's router.
  int64_t expert_params() const;
  int64_t shared_params() const;

  // Throws lattice::Error naming the offending key(s): shapes out of range,
  // n_head not a multiple of n_kv_head, rope with an odd head size, a GPT-2
  // family model with grouped heads or a SwiGLU MLP (GPT-2's fused c_attn and
  // c_fc have no place for them: use model.family = "llama"), ...
  void validate() const;
  // Throws lattice::Error naming the keys when tensor parallelism over t
  // ranks cannot cut this model: t must divide n_head (query heads are split
  // whole) and ffn() (the MLP's hidden columns), and either divide n_kv_head
  // (key/value heads split) or be a multiple of it (each key/value head kept
  // whole on the t / n_kv_head ranks of its query heads).
  void check_tensor_parallel(int t) const;

  // Parameters of the logical model, a tied embedding counted once, without
  // the vocabulary padding (every expert counted).
  int64_t num_params() const;
  // Of which a token's forward multiplies: each MoE layer's router, top_k
  // experts and the shared ones instead of all n_experts (num_params() for a dense model).
  int64_t active_params() const;
  // Of which the tables that are looked up, not multiplied: the learned
  // position embedding and, when the head is untied, the token embedding.
  int64_t lookup_params() const;

  // Model FLOPs per trained token (forward + backward) at sequence length T,
  // the PaLM / nanoGPT convention: 6·N + 12·L·C·T, where N = num_params()
  // minus lookup_params() (a tied token embedding counts: it is the head's
  // weight). 6N counts the multiply-adds of every weight (2 forward, 4
  // backward); 12·L·C·T counts the attention score and value products (QKᵀ
  // and PV, 2·T·C each per token forward with C = n_head·hs, ×3 with
  // backward), without discounting the causal mask; grouped key/value heads
  // do not change them.
  double flops_per_token(int T) const;
};

}  // namespace lattice::model
