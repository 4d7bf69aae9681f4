// Which parameters a model has: their names (HF GPT-2's or HF Llama's, by
// family), full shapes, the slice of each this rank holds, and how each
// starts. Parameter i of a full tensor starts at a value that depends only
// on (seed, name, i), whatever the layout.
#include <cmath>

#include "lattice/core/error.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/layers/tensor/vocab_parallel.h"
#include "lattice/model/activations.h"
#include "lattice/model/gpt.h"
#include "lattice/model/parts/attention.h"
#include "lattice/model/parts/mlp.h"

namespace lattice::model {

GPT::GPT(Build, const ModelConfig& config, const uint64_t* seed, bool allocate, tensor::TensorParallel* tp,
         StageLayers stage)
    : config_(config), tp_(tp && tp->size() > 1 ? tp : nullptr) {
  config_.validate();
  first_layer_ = stage.first_layer;
  last_layer_ = stage.last_layer < 0 ? config_.n_layer : stage.last_layer;
  LATTICE_CHECK(0 <= first_layer_ && first_layer_ < last_layer_ && last_layer_ <= config_.n_layer,
                "a pipeline stage runs layers [first, last) with 0 <= first < last <= model.n_layer="
                    << config_.n_layer << ", got [" << first_layer_ << ", " << last_layer_ << ")");
  const int t = tp_size(), r = tp_rank();
  config_.check_tensor_parallel(t);
  vocab_full_ = tensor::padded_vocab(config_.vocab_size, t);
  const tensor::VocabRange range = tensor::vocab_range(config_.vocab_size, vocab_full_, t, r);
  vocab_first_ = range.first;
  vocab_real_ = range.real;
  const int KV = config_.kv_heads();
  dims_.C = config_.n_embd;
  dims_.hs = config_.head_size();
  dims_.NH = config_.n_head / t;
  dims_.NKV = KV >= t ? KV / t : 1;
  dims_.kv_replicas = KV >= t ? 1 : t / KV;
  dims_.A = dims_.NH * dims_.hs;
  dims_.QKV = (dims_.NH + 2 * dims_.NKV) * dims_.hs;
  dims_.F = config_.ffn() / t;
  dims_.FU = config_.mlp == MlpKind::SwiGLU ? 2 * dims_.F : dims_.F;
  dims_.V = range.rows;
  norm_ = parts::Norm(config_.norm, config_.n_embd, config_.norm_eps);
  if (config_.position == PositionKind::Rope) rope_ = kernels::RopeTable(dims_.hs, config_.seq_len, config_.rope_theta);
  declare_params();
  if (has_embedding())
    own_embedding_ = std::make_unique<LocalEmbedding>(groups_.front(), dims_.C, config_.learned_positions());
  if (last_stage() && !tied_head())
    untied_head_ = std::make_unique<LocalHead>(final_group(), static_cast<size_t>(layout_.lm_head), dims_.C);
  if (!allocate) return;
  for (ParamGroup& g : groups_) {
    g.allocate();
    if (seed) g.initialize(*seed);
  }
}

void GPT::declare_params() {
  const int t = tp_size(), r = tp_rank();
  const bool gpt2 = config_.family == Family::GPT2;
  const bool swiglu = config_.mlp == MlpKind::SwiGLU;
  const int64_t C = config_.n_embd, L = config_.n_layer, F = config_.ffn();
  const int64_t Q = config_.q_width(), KV = config_.kv_width(), Vp = vocab_full_;
  // The slices of tensor parallelism (whole tensors at t = 1): Megatron's
  // column-parallel weights split by output rows (dim 0 of lattice's [out,
  // in]), row-parallel ones by input columns (dim 1); GPT-2's c_attn rows are
  // Q, K, V blocks, each split by heads (parts = 3).
  auto cut = [t, r](int dim, int parts = 1) {
    ShardSpec spec;
    if (t == 1) return spec;
    spec.split_dim = dim;
    spec.num_shards = t;
    spec.shard_index = r;
    spec.parts = parts;
    return spec;
  };
  // Key/value heads: split like the query heads, or (fewer heads than
  // ranks) each whole on the ranks of its query heads.
  auto cut_kv = [&]() {
    ShardSpec spec = cut(0);
    if (t > 1 && dims_.kv_replicas > 1) {
      spec.num_shards = config_.kv_heads();
      spec.replicas = dims_.kv_replicas;
      spec.shard_index = r / dims_.kv_replicas;
    }
    return spec;
  };
  // Initialisation (both families, GPT-2's scheme): weights N(0, 0.02²); the
  // projections that write into the residual stream (attention output, MLP
  // down) N(0, (0.02/√(2L))²) so the stream's variance does not grow with
  // depth; biases 0; norm weights 1 (LayerNorm bias 0).
  const float std_w = 0.02f;
  const float std_proj = 0.02f / std::sqrt(2.0f * static_cast<float>(L));
  auto weight = [&](const std::string& name, std::vector<int64_t> shape, float std, ShardSpec spec = {},
                    bool packed = false) {
    ParamInfo p;
    p.name = name;
    p.full_shape = std::move(shape);
    p.init = {InitSpec::Normal, std};
    p.weight_decay = true;
    p.hf_conv1d = gpt2 && p.name.rfind("h.", 0) == 0;  // every GPT-2 block weight is a Conv1D in HF
    p.shard = spec;
    p.packed = packed;
    return p;
  };
  auto constant = [](const std::string& name, int64_t n, float value, ShardSpec spec = {}, bool packed = false) {
    ParamInfo p;
    p.name = name;
    p.full_shape = {n};
    p.init = {InitSpec::Constant, value};
    p.shard = spec;
    p.packed = packed;
    return p;
  };
  auto add_norm = [&](ParamGroup& g, const std::string& name) {
    const size_t at = g.params().size();
    g.add(constant(name + ".weight", C, 1.0f));
    if (norm_.has_bias()) g.add(constant(name + ".bias", C, 0.0f));
    return at;
  };
  // The vocabulary-parallel tables: rows past vocab_size are padding, kept at zero.
  auto vocab_table = [&](const std::string& name) {
    ParamInfo p = weight(name, {Vp, C}, std_w, cut(0));
    p.real_rows = config_.vocab_size;
    return p;
  };

  if (has_embedding()) {
    ParamGroup embed("embedding");
    layout_.wte = 0;
    embed.add(vocab_table(gpt2 ? "wte.weight" : "model.embed_tokens.weight"));
    if (config_.learned_positions()) {
      layout_.wpe = 1;
      embed.add(weight(gpt2 ? "wpe.weight" : "model.embed_positions.weight", {config_.seq_len, C}, std_w));
    }
    groups_.push_back(std::move(embed));
  }

  for (int64_t l = first_layer_; l < last_layer_; l++) {
    const std::string h = gpt2 ? "h." + std::to_string(l) + "." : "model.layers." + std::to_string(l) + ".";
    ParamGroup g(h.substr(0, h.size() - 1));
    Layout& y = layout_;
    auto at = [&g]() { return g.params().size(); };
    y.norm1 = add_norm(g, h + (gpt2 ? "ln_1" : "input_layernorm"));
    if (gpt2) {
      y.qkv_w = at(), y.qkv_n = 1;
      g.add(weight(h + "attn.c_attn.weight", {3 * C, C}, std_w, cut(0, 3)));  // column-parallel, by heads
      y.qkv_b = config_.bias ? static_cast<int>(at()) : -1;
      if (config_.bias) g.add(constant(h + "attn.c_attn.bias", 3 * C, 0.0f, cut(0, 3)));
      y.out_w = at();
      g.add(weight(h + "attn.c_proj.weight", {C, C}, std_proj, cut(1)));  // row-parallel
      y.out_b = config_.bias ? static_cast<int>(at()) : -1;
      if (config_.bias) g.add(constant(h + "attn.c_proj.bias", C, 0.0f));
    } else {
      const std::string a = h + "self_attn.";
      y.qkv_w = at(), y.qkv_n = 3;
      g.add(weight(a + "q_proj.weight", {Q, C}, std_w, cut(0)));  // column-parallel, by heads
      g.add(weight(a + "k_proj.weight", {KV, C}, std_w, cut_kv(), true));
      g.add(weight(a + "v_proj.weight", {KV, C}, std_w, cut_kv(), true));
      y.qkv_b = config_.bias ? static_cast<int>(at()) : -1;
      if (config_.bias) {
        g.add(constant(a + "q_proj.bias", Q, 0.0f, cut(0)));
        g.add(constant(a + "k_proj.bias", KV, 0.0f, cut_kv(), true));
        g.add(constant(a + "v_proj.bias", KV, 0.0f, cut_kv(), true));
      }
      y.out_w = at();
      g.add(weight(a + "o_proj.weight", {C, Q}, std_proj, cut(1)));  // row-parallel
      y.out_b = config_.bias ? static_cast<int>(at()) : -1;
      if (config_.bias) g.add(constant(a + "o_proj.bias", C, 0.0f));
    }
    y.norm2 = add_norm(g, h + (gpt2 ? "ln_2" : "post_attention_layernorm"));
    const std::string m = h + "mlp.";
    const std::string up = gpt2 ? "c_fc" : "up_proj", down = gpt2 ? "c_proj" : "down_proj";
    y.up_w = at(), y.up_n = swiglu ? 2 : 1;
    if (swiglu) g.add(weight(m + "gate_proj.weight", {F, C}, std_w, cut(0)));  // column-parallel with up
    g.add(weight(m + up + ".weight", {F, C}, std_w, cut(0), swiglu));
    y.up_b = config_.bias ? static_cast<int>(at()) : -1;
    if (config_.bias) {
      if (swiglu) g.add(constant(m + "gate_proj.bias", F, 0.0f, cut(0)));
      g.add(constant(m + up + ".bias", F, 0.0f, cut(0), swiglu));
    }
    y.down_w = at();
    g.add(weight(m + down + ".weight", {C, F}, std_proj, cut(1)));  // row-parallel
    y.down_b = config_.bias ? static_cast<int>(at()) : -1;
    if (config_.bias) g.add(constant(m + down + ".bias", C, 0.0f));
    groups_.push_back(std::move(g));
  }

  if (last_stage()) {
    ParamGroup fin(gpt2 ? "ln_f" : "model.norm");
    layout_.norm_f = add_norm(fin, gpt2 ? "ln_f" : "model.norm");
    if (!tied_head()) {
      layout_.lm_head = static_cast<int>(fin.params().size());
      fin.add(vocab_table("lm_head.weight"));
    }
    groups_.push_back(std::move(fin));
  }
}

bool GPT::counts_in_norm(size_t group, const ParamInfo& info) const {
  if (has_embedding() && group == embedding_index() && !first_stage()) return false;
  if (info.shard.split_dim < 0) return tp_rank() == 0;
  return tp_rank() % info.shard.replicas == 0;  // a replicated slice once per piece
}

std::pair<ParamGroup*, size_t> GPT::find_param(const std::string& name) {
  for (ParamGroup& g : groups_)
    for (size_t i = 0; i < g.params().size(); i++)
      if (g.params()[i].name == name) return {&g, i};
  return {nullptr, 0};
}

parts::Attention GPT::attention(ParamGroup& g) {
  const Layout& y = layout_;
  const parts::AttentionShape shape{dims_.C, dims_.NH, dims_.NKV, dims_.hs, dims_.kv_replicas};
  return parts::Attention(tp_, shape, config_.position == PositionKind::Rope ? &rope_ : nullptr,
                          {&g, y.qkv_w, y.qkv_n, y.qkv_b}, {&g, y.out_w, 1, y.out_b}, &kv_scratch_, cp_);
}

parts::Mlp GPT::mlp(ParamGroup& g) {
  const Layout& y = layout_;
  return parts::Mlp(tp_, config_.mlp, dims_.C, dims_.F, {&g, y.up_w, y.up_n, y.up_b}, {&g, y.down_w, 1, y.down_b});
}

}  // namespace lattice::model
