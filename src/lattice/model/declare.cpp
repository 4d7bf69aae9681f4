// Which parameters a model has: their names (HF GPT-2's or HF Llama's, by
// family), full shapes, the slice of each this rank holds, and how each
// starts. Parameter i of a full tensor starts at a value that depends only
// on (seed, name, i), whatever the layout.
#include <cmath>

#include "lattice/core/error.h"
#include "lattice/layers/context/context_parallel.h"
#include "lattice/layers/expert/expert_parallel.h"
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
  expert_shards_ = stage.expert_shards;
  expert_shard_ = stage.expert_shard;
  LATTICE_CHECK(expert_shards_ == 1 || (config_.n_experts > 0 && config_.n_experts % expert_shards_ == 0 &&
                                        0 <= expert_shard_ && expert_shard_ < expert_shards_),
                "expert parallelism over " << expert_shards_ << " ranks needs model.n_experts="
                                           << config_.n_experts << " divisible by it");
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
  if (config_.n_experts > 0) {
    own_ep_ = std::make_unique<expert::ExpertParallel>(nullptr, config_.n_experts);
    expert_bias_.assign(static_cast<size_t>(config_.n_layer) * config_.n_experts, 0.0f);
    reset_moe_stats();
  }
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
    if (config_.is_moe_layer(static_cast<int>(l))) {
      declare_moe_block(g, static_cast<int>(l), h);
      groups_.push_back(std::move(g));
      continue;
    }
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
  // The experts of each MoE layer, after every dense group: this rank's share.
  final_index_ = groups_.size() - 1;
  expert_group_.assign(static_cast<size_t>(local_layers()), static_cast<size_t>(-1));
  moe_flags_.assign(static_cast<size_t>(local_layers()), 0);
  for (int l = first_layer_; l < last_layer_; l++) {
    if (!config_.is_moe_layer(l)) continue;
    expert_group_[static_cast<size_t>(l - first_layer_)] = groups_.size();
    moe_flags_[static_cast<size_t>(l - first_layer_)] = 1;
    const int local = config_.n_experts / expert_shards_;
    groups_.push_back(declare_experts(config_, l, expert_shard_ * local, local, &moe_layout_.per_expert));
  }
}

// One MoE block's own parameters after norm₂: the router [E, C] (stored so
// in HF files too: Mixtral's gate is an nn.Linear), then the shared experts,
// a dense MLP cut by tensor parallelism like parts/mlp.h's.
void GPT::declare_moe_block(ParamGroup& g, int layer, const std::string& h) {
  (void)layer;
  const bool gpt2 = config_.family == Family::GPT2, swiglu = config_.mlp == MlpKind::SwiGLU;
  const int t = tp_size(), r = tp_rank();
  const int64_t C = config_.n_embd, E = config_.n_experts, F = config_.shared_ffn();
  const float std_proj = 0.02f / std::sqrt(2.0f * static_cast<float>(config_.n_layer));
  auto cut = [t, r](int dim) {
    ShardSpec spec;
    if (t == 1) return spec;
    spec.split_dim = dim, spec.num_shards = t, spec.shard_index = r;
    return spec;
  };
  auto linear = [&](const std::string& name, std::vector<int64_t> shape, float std, ShardSpec spec, bool packed,
                    bool conv1d) {
    ParamInfo p;
    p.name = name, p.full_shape = std::move(shape), p.init = {InitSpec::Normal, std}, p.weight_decay = true;
    p.hf_conv1d = conv1d, p.shard = spec, p.packed = packed;
    return p;
  };
  auto zeros = [](const std::string& name, int64_t n, ShardSpec spec, bool packed) {
    ParamInfo p;
    p.name = name, p.full_shape = {n}, p.init = {InitSpec::Constant, 0.0f}, p.shard = spec, p.packed = packed;
    return p;
  };
  MoeLayout& y = moe_layout_;
  const std::string m = h + (gpt2 ? "mlp." : "block_sparse_moe.");
  y.router = g.params().size();
  g.add(linear(m + (gpt2 ? "router.weight" : "gate.weight"), {E, C}, 0.02f, {}, false, false));
  if (F == 0) return;
  const std::string s = m + "shared_experts.";
  const std::string up = gpt2 ? "c_fc" : "up_proj", down = gpt2 ? "c_proj" : "down_proj";
  y.sh_up_w = g.params().size(), y.sh_up_n = swiglu ? 2 : 1;
  if (swiglu) g.add(linear(s + "gate_proj.weight", {F, C}, 0.02f, cut(0), false, gpt2));
  g.add(linear(s + up + ".weight", {F, C}, 0.02f, cut(0), swiglu, gpt2));
  y.sh_up_b = config_.bias ? static_cast<int>(g.params().size()) : -1;
  if (config_.bias) {
    if (swiglu) g.add(zeros(s + "gate_proj.bias", F, cut(0), false));
    g.add(zeros(s + up + ".bias", F, cut(0), swiglu));
  }
  y.sh_down_w = g.params().size();
  g.add(linear(s + down + ".weight", {C, F}, std_proj, cut(1), false, gpt2));
  y.sh_down_b = config_.bias ? static_cast<int>(g.params().size()) : -1;
  if (config_.bias) g.add(zeros(s + down + ".bias", C, {}, false));
}

std::string expert_bias_name(const ModelConfig& config, int layer) {
  return config.family == Family::GPT2
             ? "h." + std::to_string(layer) + ".mlp.router.expert_bias"
             : "model.layers." + std::to_string(layer) + ".block_sparse_moe.gate.e_score_correction_bias";
}

ParamGroup declare_experts(const ModelConfig& config, int layer, int first, int count, size_t* per_expert) {
  const bool gpt2 = config.family == Family::GPT2, swiglu = config.mlp == MlpKind::SwiGLU;
  const int64_t C = config.n_embd, F = config.moe_ffn();
  const float std_proj = 0.02f / std::sqrt(2.0f * static_cast<float>(config.n_layer));
  const std::string h = gpt2 ? "h." + std::to_string(layer) + ".mlp.experts"
                             : "model.layers." + std::to_string(layer) + ".block_sparse_moe.experts";
  ParamGroup g(h);
  auto linear = [&](const std::string& name, std::vector<int64_t> shape, float std, bool packed) {
    ParamInfo p;
    p.name = name, p.full_shape = std::move(shape), p.init = {InitSpec::Normal, std}, p.weight_decay = true;
    p.hf_conv1d = gpt2, p.packed = packed;
    return p;
  };
  auto zeros = [](const std::string& name, int64_t n, bool packed) {
    ParamInfo p;
    p.name = name, p.full_shape = {n}, p.init = {InitSpec::Constant, 0.0f}, p.packed = packed;
    return p;
  };
  // Per expert: the first projection (Llama: w1 = gate | w3 = up, packed), its
  // biases, the second projection (w2), its bias — HF Mixtral's names.
  for (int e = first; e < first + count; e++) {
    const size_t before = g.params().size();
    const std::string x = h + "." + std::to_string(e) + ".";
    const std::string up = gpt2 ? "c_fc" : "w3", gate = "w1", down = gpt2 ? "c_proj" : "w2";
    if (swiglu) g.add(linear(x + gate + ".weight", {F, C}, 0.02f, false));
    g.add(linear(x + up + ".weight", {F, C}, 0.02f, swiglu));
    if (config.bias) {
      if (swiglu) g.add(zeros(x + gate + ".bias", F, false));
      g.add(zeros(x + up + ".bias", F, swiglu));
    }
    g.add(linear(x + down + ".weight", {C, F}, std_proj, false));
    if (config.bias) g.add(zeros(x + down + ".bias", C, false));
    if (per_expert) *per_expert = g.params().size() - before;
  }
  return g;
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

size_t GPT::expert_index(int layer) const {
  const int i = layer - first_layer_;
  return i >= 0 && i < local_layers() ? expert_group_[static_cast<size_t>(i)] : static_cast<size_t>(-1);
}

int GPT::layer_of_group(size_t g) const {
  for (int l = first_layer_; l < last_layer_; l++)
    if (g == block_index(l) || g == expert_index(l)) return l;
  return -1;
}

std::vector<size_t> GPT::group_order(GroupHooks::Pass pass) const {
  // As the passes read them: each MoE layer's experts right after its block
  // (the backward reads the MLP's parameters first, with the block's).
  std::vector<size_t> order;
  const bool forward = pass == GroupHooks::Pass::Forward;
  auto block = [&](int l) {
    order.push_back(block_index(l));
    if (expert_index(l) != static_cast<size_t>(-1)) order.push_back(expert_index(l));
  };
  if (forward) {
    if (first_stage()) order.push_back(embedding_index());
    for (int l = first_layer_; l < last_layer_; l++) block(l);
    if (last_stage()) order.push_back(final_index());
  } else {
    if (last_stage()) {
      if (tied_head()) order.push_back(embedding_index());
      order.push_back(final_index());
    }
    for (int l = last_layer_ - 1; l >= first_layer_; l--) block(l);
  }
  return order;
}

parts::Moe GPT::moe(int layer) {
  ParamGroup& g = block_group(layer);
  ParamGroup& x = groups_[expert_index(layer)];
  const MoeLayout& y = moe_layout_;
  parts::MoeParams p;
  p.router = {&g, y.router, 1, -1};
  const bool swiglu = config_.mlp == MlpKind::SwiGLU;
  const size_t up_n = swiglu ? 2 : 1, stride = y.per_expert;
  const int local = config_.n_experts / expert_shards_;
  for (int le = 0; le < local; le++) {
    const size_t base = static_cast<size_t>(le) * stride;
    const int up_b = config_.bias ? static_cast<int>(base + up_n) : -1;
    const size_t down = base + up_n * (config_.bias ? 2 : 1);
    p.up.push_back({&x, base, up_n, up_b});
    p.down.push_back({&x, down, 1, config_.bias ? static_cast<int>(down + 1) : -1});
  }
  const int F_sh = config_.shared_ffn() / tp_size();
  if (F_sh > 0) {
    p.shared = true;
    p.shared_up = {&g, y.sh_up_w, y.sh_up_n, y.sh_up_b};
    p.shared_down = {&g, y.sh_down_w, 1, y.sh_down_b};
  }
  const float* bias = expert_bias_.data() + static_cast<size_t>(layer) * config_.n_experts;
  return parts::Moe(tp_, cp_ ? &cp_->group() : nullptr, ep_ ? ep_ : own_ep_.get(), config_.mlp, dims_.C,
                    config_.n_experts, config_.top_k, config_.moe_ffn(), F_sh, std::move(p), moe_options_, bias,
                    &moe_stats_[static_cast<size_t>(layer - first_layer_)], layer);
}

void GPT::set_expert_parallel(expert::ExpertParallel* ep) {
  for (const auto& s : slots_)
    LATTICE_CHECK(!s || !s->has_forward, "set_expert_parallel with a micro-batch in flight");
  const int size = ep ? ep->size() : 1, rank = ep ? ep->rank() : 0;
  LATTICE_CHECK(size == expert_shards_ && rank == expert_shard_,
                "internal: expert parallelism over " << size << " ranks (this one " << rank
                                                     << ") but the model declared shard " << expert_shard_ << " of "
                                                     << expert_shards_);
  LATTICE_CHECK(!ep || ep->experts() == config_.n_experts, "internal: an ep group for " << ep->experts()
                                                                                       << " experts, model has "
                                                                                       << config_.n_experts);
  ep_ = ep;
}

void GPT::reset_moe_stats() {
  moe_stats_.assign(static_cast<size_t>(local_layers()), {});
  for (int l = first_layer_; l < last_layer_; l++)
    if (config_.is_moe_layer(l)) moe_stats_[static_cast<size_t>(l - first_layer_)].reset(config_.n_experts);
  if (ep_) ep_->reset_counters();
}

const std::vector<int64_t>& GPT::routing_counts(int slot, int stage_layer) const {
  LATTICE_CHECK(slot >= 0 && static_cast<size_t>(slot) < slots_.size() && slots_[slot] &&
                    static_cast<size_t>(stage_layer) < slots_[slot]->moe.size() && slots_[slot]->moe[stage_layer],
                "routing_counts: no MoE forward of slot " << slot << " through stage layer " << stage_layer);
  return slots_[slot]->moe[stage_layer]->counts;
}


parts::Mlp GPT::mlp(ParamGroup& g) {
  const Layout& y = layout_;
  return parts::Mlp(tp_, config_.mlp, dims_.C, dims_.F, {&g, y.up_w, y.up_n, y.up_b}, {&g, y.down_w, 1, y.down_b});
}

}  // namespace lattice::model
