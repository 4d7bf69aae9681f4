#include "lattice/model/config.h"

#include <cmath>

#include "lattice/core/error.h"

namespace lattice::model {

const char* name_of(Family f) { return f == Family::GPT2 ? "gpt2" : "llama"; }
const char* name_of(NormKind n) { return n == NormKind::LayerNorm ? "layernorm" : "rmsnorm"; }
const char* name_of(MlpKind m) { return m == MlpKind::GELU ? "gelu" : "swiglu"; }
const char* name_of(PositionKind p) { return p == PositionKind::Learned ? "learned" : "rope"; }

template <typename E>
static E parse_choice(const std::string& s, const char* key, E a, E b) {
  if (s == name_of(a)) return a;
  if (s == name_of(b)) return b;
  throw Error(std::string(key) + " must be \"" + name_of(a) + "\" or \"" + name_of(b) + "\", got \"" + s + "\"");
}

Family parse_family(const std::string& s, const char* key) { return parse_choice(s, key, Family::GPT2, Family::Llama); }
NormKind parse_norm(const std::string& s, const char* key) {
  return parse_choice(s, key, NormKind::LayerNorm, NormKind::RMSNorm);
}
MlpKind parse_mlp(const std::string& s, const char* key) { return parse_choice(s, key, MlpKind::GELU, MlpKind::SwiGLU); }
PositionKind parse_position(const std::string& s, const char* key) {
  return parse_choice(s, key, PositionKind::Learned, PositionKind::Rope);
}

ModelConfig ModelConfig::defaults(Family family) {
  ModelConfig c;
  c.family = family;
  if (family == Family::Llama) {
    c.norm = NormKind::RMSNorm;
    c.mlp = MlpKind::SwiGLU;
    c.position = PositionKind::Rope;
    c.bias = false;
    c.tie_embeddings = false;
  }
  return c;
}

int ModelConfig::ffn() const {
  if (ffn_hidden > 0) return ffn_hidden;
  if (family == Family::GPT2) return 4 * n_embd;
  // Llama: two thirds of 4C (SwiGLU has three matrices where GELU has two),
  // rounded up to a multiple of 256 — 2048 at C = 768, 11008 at C = 4096.
  const int64_t f = (8LL * n_embd / 3 + 255) / 256 * 256;
  return static_cast<int>(f);
}

void ModelConfig::validate() const {
  LATTICE_CHECK(n_layer >= 1, "model.n_layer must be >= 1, got " << n_layer);
  LATTICE_CHECK(n_head >= 1, "model.n_head must be >= 1, got " << n_head);
  LATTICE_CHECK(n_embd >= 1, "model.n_embd must be >= 1, got " << n_embd);
  LATTICE_CHECK(vocab_size >= 2, "model.vocab_size must be >= 2, got " << vocab_size);
  LATTICE_CHECK(vocab_size <= 65536,
                "model.vocab_size=" << vocab_size << " exceeds 65536, the most that uint16 token shards can hold");
  LATTICE_CHECK(seq_len >= 1, "model.seq_len must be >= 1, got " << seq_len);
  LATTICE_CHECK(n_embd % n_head == 0,
                "model.n_embd=" << n_embd << " is not divisible by model.n_head=" << n_head);
  LATTICE_CHECK(n_kv_head >= 0, "model.n_kv_head must be >= 1 (or 0: model.n_head), got " << n_kv_head);
  LATTICE_CHECK(n_head % kv_heads() == 0, "model.n_head=" << n_head << " is not a multiple of model.n_kv_head="
                                                          << kv_heads()
                                                          << ": each key/value head serves a whole group of query heads");
  LATTICE_CHECK(ffn_hidden >= 0, "model.ffn_hidden must be >= 1 (or 0: the family's default), got " << ffn_hidden);
  LATTICE_CHECK(std::isfinite(norm_eps) && norm_eps > 0 && norm_eps < 1,
                "model.norm_eps must be in (0, 1), got " << norm_eps);
  if (position == PositionKind::Rope) {
    LATTICE_CHECK(head_size() % 2 == 0, "model.position = \"rope\" needs an even head size, but model.n_embd="
                                            << n_embd << " / model.n_head=" << n_head << " = " << head_size()
                                            << " (the rotation pairs element i with i + head_size/2)");
    LATTICE_CHECK(std::isfinite(rope_theta) && rope_theta > 0,
                  "model.rope_theta must be a finite number > 0, got " << rope_theta);
  }
  if (family == Family::GPT2) {
    LATTICE_CHECK(kv_heads() == n_head, "model.n_kv_head=" << kv_heads() << " differs from model.n_head=" << n_head
                                                           << ", but model.family = \"gpt2\" keeps Q, K and V of "
                                                              "equal width in one attn.c_attn; grouped-query "
                                                              "attention needs model.family = \"llama\"");
    LATTICE_CHECK(mlp == MlpKind::GELU, "model.mlp = \"swiglu\" needs model.family = \"llama\" (GPT-2's c_fc and "
                                        "c_proj have no gate projection to name)");
  }
  LATTICE_CHECK(n_experts >= 0, "model.n_experts must be >= 0, got " << n_experts);
  if (n_experts > 0) {
    LATTICE_CHECK(n_experts >= 2, "model.n_experts=" << n_experts << ": a mixture needs at least 2 experts (0: dense)");
    LATTICE_CHECK(top_k >= 1 && top_k <= n_experts,
                  "model.top_k=" << top_k << " must be in [1, model.n_experts=" << n_experts << "]");
    LATTICE_CHECK(moe_every >= 1 && moe_every <= n_layer,
                  "model.moe_every=" << moe_every << " must be in [1, model.n_layer=" << n_layer
                                     << "] (layer l is an MoE layer when (l + 1) % moe_every == 0)");
    LATTICE_CHECK(n_shared_experts >= 0, "model.n_shared_experts must be >= 0, got " << n_shared_experts);
    LATTICE_CHECK(moe_ffn_hidden >= 0, "model.moe_ffn_hidden must be >= 0, got " << moe_ffn_hidden);
  }
}

void ModelConfig::check_tensor_parallel(int t) const {
  LATTICE_CHECK(t >= 1, "parallel.tp must be >= 1, got " << t);
  LATTICE_CHECK(n_head % t == 0, "parallel.tp=" << t << " must divide model.n_head=" << n_head
                                                << ": attention is split by whole query heads");
  LATTICE_CHECK(kv_heads() % t == 0 || t % kv_heads() == 0,
                "parallel.tp=" << t << " must divide model.n_kv_head=" << kv_heads()
                               << " or be a multiple of it: key/value heads are split whole, or each kept whole "
                                  "on the ranks of its query heads");
  LATTICE_CHECK(ffn() % t == 0, "parallel.tp=" << t << " must divide the MLP's hidden width " << ffn()
                                               << (ffn_hidden > 0 ? " (model.ffn_hidden)" : " (the family's default of model.ffn_hidden)")
                                               << ": it is split by columns");
  LATTICE_CHECK(n_experts == 0 || shared_ffn() % t == 0,
                "parallel.tp=" << t << " must divide the shared experts' hidden width " << shared_ffn()
                               << " (model.n_shared_experts x the expert width): it is split by columns like the "
                                  "dense MLP's (each routed expert stays whole on a rank)");
}

int64_t ModelConfig::num_params() const {
  const int64_t C = n_embd, L = n_layer, V = vocab_size, F = ffn();
  const int64_t q = q_width(), kv = kv_width();
  const int64_t b = bias ? 1 : 0;
  const int64_t norm_params = norm == NormKind::LayerNorm ? 2 * C : C;
  const int64_t attn = C * (q + 2 * kv) + b * (q + 2 * kv) + q * C + b * C;
  const int64_t up = mlp == MlpKind::SwiGLU ? 2 * F : F;
  const int64_t mlp_params = C * up + b * up + F * C + b * C;
  const int64_t block = 2 * norm_params + attn + mlp_params;
  const int64_t embeddings = V * C * (tie_embeddings ? 1 : 2) + (learned_positions() ? int64_t{seq_len} * C : 0);
  // An MoE layer: the router, every expert and the shared experts instead of the dense MLP.
  const int64_t moe = moe_layers();
  const int64_t moe_mlp = static_cast<int64_t>(n_experts) * C + n_experts * expert_params() + shared_params();
  return embeddings + L * block + moe * (moe_mlp - mlp_params) + norm_params;
}

// One MLP of hidden width F of this family (GELU: up, down; SwiGLU: gate, up, down), with its biases.
static int64_t mlp_params_of(const ModelConfig& c, int64_t F) {
  const int64_t C = c.n_embd, b = c.bias ? 1 : 0;
  const int64_t up = c.mlp == MlpKind::SwiGLU ? 2 * F : F;
  return F > 0 ? C * up + b * up + F * C + b * C : 0;
}

int64_t ModelConfig::expert_params() const { return mlp_params_of(*this, moe_ffn()); }
int64_t ModelConfig::shared_params() const { return mlp_params_of(*this, shared_ffn()); }

int64_t ModelConfig::active_params() const {
  const int64_t moe = moe_layers();
  return num_params() - moe * static_cast<int64_t>(n_experts - top_k) * expert_params();
}

int64_t ModelConfig::lookup_params() const {
  const int64_t C = n_embd;
  return (learned_positions() ? int64_t{seq_len} * C : 0) + (tie_embeddings ? 0 : int64_t{vocab_size} * C);
}

double ModelConfig::flops_per_token(int T) const {
  const double n = static_cast<double>(active_params() - lookup_params());
  return 6.0 * n + 12.0 * n_layer * static_cast<double>(n_embd) * T;
}

}  // namespace lattice::model
