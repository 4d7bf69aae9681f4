#include "lattice/train/checkpointing.h"

#include <cstring>
#include <filesystem>
#include <optional>

#include "lattice/comm/process_mesh.h"
#include "lattice/core/error.h"
#include "lattice/io/checkpoint.h"
#include "lattice/io/config.h"
#include "lattice/io/file_util.h"
#include "lattice/io/safetensors.h"
#include "lattice/parallel/data/data_parallel.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/train/hf_config.h"
#include "lattice/train/model_io.h"
#include "lattice/train/trainer.h"

namespace lattice::train {

namespace fs = std::filesystem;

static const char* kMomentSuffix[2] = {".exp_avg", ".exp_avg_sq"};

// The metadata entry of a checkpoint's model.safetensors that records the
// model (its [model] section, every key written out), so the file alone —
// given to checkpoint.init_from or `lattice generate` — says what it holds.
static const char* kModelMetadata = "lattice.model";

// The [model] section of a model as TOML, every key written out.
static std::string model_toml(const model::ModelConfig& c) {
  io::RunConfig r;
  r.model = model_section_of(c);
  std::string out = "[model]\n";
  for (const auto& [key, value] : io::config_items(r))
    if (key.rfind("model.", 0) == 0 && value != "\"\"") out += key.substr(6) + " = " + value + "\n";
  return out;
}

static parallel::DataParallel::State state_of(ModelBuffer which) {
  switch (which) {
    case ModelBuffer::Params: return parallel::DataParallel::State::Params;
    case ModelBuffer::AdamM: return parallel::DataParallel::State::AdamM;
    case ModelBuffer::AdamV: break;
  }
  return parallel::DataParallel::State::AdamV;
}

std::vector<HfTensor> Trainer::assemble_group(const model::ParamGroup& group, const float* local, size_t n,
                                              bool wanted) {
  if (!tp_) return wanted ? export_hf_group(group, local) : std::vector<HfTensor>{};
  // Every TP rank's buffer (the same layout on each), then each sliced
  // parameter assembled from them.
  const int t = tp_->size();
  std::vector<float> all(n * static_cast<size_t>(t));
  mesh_->tp().all_gather(local, all.data(), n, DType::F32);
  if (!wanted) return {};
  std::vector<const float*> bases;
  for (int r = 0; r < t; r++) bases.push_back(all.data() + static_cast<size_t>(r) * n);
  return export_hf_group(group, local, bases);
}

namespace {

size_t numel_of(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

}  // namespace

std::vector<HfTensor> Trainer::group_tensors(size_t g, ModelBuffer which, bool all_ranks) {
  const model::ParamGroup& shape = layout_model_->groups()[g];
  // The stage that holds it (the embedding: the first stage's copy).
  // (layout_model_ is the whole model: group 0 the embedding, 1 + l block l,
  // the final group, then each MoE layer's experts).
  int stage = 0, layer = -1;
  if (layout_model_->is_expert_group(g)) {
    for (int l = 0; l < model_config_.n_layer; l++)
      if (layout_model_->expert_index(l) == g) layer = l;
  } else if (g == layout_model_->final_index()) {
    stage = schedule_.stages - 1;
  } else if (g != layout_model_->embedding_index()) {
    layer = static_cast<int>(g - layout_model_->block_index(0));
  }
  if (layer >= 0)
    for (int s = 0; s < schedule_.stages; s++)
      if (cut_[s].first <= layer && layer < cut_[s].last) stage = s;
  const int owner = schedule_.rank_of_stage[stage], me = mesh_->coord().pp;
  // Only the TP group of the world's root (dp 0, cp 0) needs them, unless every rank does.
  const bool wanted = all_ranks || (mesh_->coord().dp == 0 && mesh_->coord().cp == 0 && mesh_->coord().tp == 0);
  std::vector<HfTensor> tensors;
  if (me == owner && layout_model_->is_expert_group(g)) {
    // An MoE layer's experts: whole over the ranks that hold the same ones
    // (the expert engine), then every expert-parallel rank's share — the
    // same group layout on each, experts [r·E/ep, (r+1)·E/ep) — in expert
    // order, the layout model's. Experts are whole on every TP rank.
    const size_t j = static_cast<size_t>(part_of_stage_[stage]);
    const model::GPT& part = *parts_[j];
    const size_t i = part.expert_index(layer);
    const model::ParamGroup& local = part.groups()[i];
    std::vector<float> buffer(static_cast<size_t>(local.capacity()));
    expert_dp_->gather_full(j, i, state_of(which), buffer.data());
    const int ep = mesh_->ep().size(), per_rank = model_config_.n_experts / ep;
    std::vector<float> all = buffer;
    if (ep > 1) {
      all.resize(buffer.size() * static_cast<size_t>(ep));
      mesh_->ep().all_gather(buffer.data(), all.data(), buffer.size(), DType::F32);
    }
    if (wanted)
      for (int r = 0; r < ep; r++) {
        const model::ParamGroup shard = model::declare_experts(model_config_, layer, r * per_rank, per_rank);
        for (HfTensor& t : export_hf_group(shard, all.data() + static_cast<size_t>(r) * buffer.size()))
          tensors.push_back(std::move(t));
      }
  } else if (me == owner) {
    const size_t j = static_cast<size_t>(part_of_stage_[stage]);
    const model::GPT& part = *parts_[j];
    size_t i = 0;
    while (part.groups()[i].name() != shape.name()) i++;
    const model::ParamGroup& local = part.groups()[i];
    std::vector<float> buffer(static_cast<size_t>(local.capacity()));
    dp_->gather_full(j, i, state_of(which), buffer.data());  // this TP rank's slices, whole over DP
    if (!tp_ || all_ranks || mesh_->coord().dp == 0)
      tensors = assemble_group(local, buffer.data(), buffer.size(), wanted);
  }
  if (schedule_.ranks == 1) return tensors;
  // From the owner's pipeline rank to the others (all_ranks) or to the root's.
  if (!wanted) return {};
  std::vector<float> flat;
  for (const model::ParamInfo& p : shape.params()) flat.resize(flat.size() + numel_of(hf_shape(p)));
  if (me == owner) {
    size_t at = 0;
    for (const HfTensor& t : tensors) {
      std::copy(t.data.begin(), t.data.end(), flat.begin() + static_cast<std::ptrdiff_t>(at));
      at += t.data.size();
    }
  }
  if (all_ranks) {
    mesh_->pp().broadcast(flat.data(), flat.size(), DType::F32, owner);
  } else if (owner != 0) {
    if (me == owner) mesh_->pp().send(flat.data(), flat.size(), DType::F32, 0, 7);
    if (me == 0) mesh_->pp().recv(flat.data(), flat.size(), DType::F32, owner, 7);
  }
  if (!all_ranks && !is_root_) return {};
  std::vector<HfTensor> out;
  size_t at = 0;
  for (const model::ParamInfo& p : shape.params()) {
    HfTensor t;
    t.name = p.name;
    t.shape = hf_shape(p);
    const size_t n = numel_of(t.shape);
    t.data.assign(flat.begin() + static_cast<std::ptrdiff_t>(at), flat.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<HfTensor> Trainer::full_tensors(ModelBuffer which) {
  std::vector<HfTensor> out;
  for (size_t g = 0; g < layout_model_->groups().size(); g++)
    for (HfTensor& t : group_tensors(g, which, true)) out.push_back(std::move(t));
  return out;
}

void Trainer::load_state(const HfSource* sources, int count) {
  const parallel::DataParallel::State which[3] = {parallel::DataParallel::State::Params,
                                                  parallel::DataParallel::State::AdamM,
                                                  parallel::DataParallel::State::AdamV};
  for (size_t j = 0; j < parts_.size(); j++)
    for (size_t i = 0; i < parts_[j]->groups().size(); i++) {
      const model::ParamGroup& group = parts_[j]->groups()[i];
      std::vector<float> full(static_cast<size_t>(group.capacity()), 0.0f);
      for (int k = 0; k < count; k++) {
        import_hf_group(group, full.data(), sources[k]);
        engine_of(j, i).load_full(j, i, which[k], full.data());
      }
    }
}

// Whatever the layout, a checkpoint holds full logical tensors by HF name:
// every group's parameters and moments are gathered over the data-parallel
// ranks one group at a time (DataParallel::gather_full), the slices of
// tensor parallelism assembled into whole tensors, and rank 0 streams them
// into the files as they come (io::SafeTensorsStream), so no rank ever holds
// more than one group's worth (times tp); the directory is committed
// atomically (io/checkpoint.h). So any layout loads any checkpoint.
std::string Trainer::save_checkpoint() {
  LATTICE_CHECK(!config_.checkpoint.dir.empty(), "save_checkpoint needs checkpoint.dir");
  const ModelBuffer which[3] = {ModelBuffer::Params, ModelBuffer::AdamM, ModelBuffer::AdamV};
  std::unique_ptr<io::CheckpointWriter> w;
  std::unique_ptr<io::SafeTensorsStream> files[2];  // model, optimizer
  // The whole model's groups, in order (a pipeline stage holds some of them).
  const model::GPT& layout_model = *layout_model_;
  if (is_root_) {
    // The headers first: every tensor's name and HF shape is known.
    io::SafeTensorsWriter layout[2];
    layout[0].set_metadata("format", "pt");
    layout[0].set_metadata("n_head", std::to_string(config_.model.n_head));
    layout[0].set_metadata(kModelMetadata, model_toml(model_config_));
    for (const model::ParamGroup& group : layout_model.groups())
      for (const model::ParamInfo& p : group.params()) {
        layout[0].add(p.name, DType::F32, hf_shape(p), nullptr);
        for (int k = 0; k < 2; k++) layout[1].add(p.name + kMomentSuffix[k], DType::F32, hf_shape(p), nullptr);
      }
    // Each MoE layer's selection bias (state, not a parameter: no moments).
    for (int l = 0; l < model_config_.n_layer; l++)
      if (model_config_.is_moe_layer(l))
        layout[0].add(expert_bias_name(model_config_, l), DType::F32, {model_config_.n_experts}, nullptr);
    w = std::make_unique<io::CheckpointWriter>(config_.checkpoint.dir, step_);
    files[0] = std::make_unique<io::SafeTensorsStream>(layout[0], w->path("model.safetensors"));
    files[1] = std::make_unique<io::SafeTensorsStream>(layout[1], w->path("optimizer.safetensors"));
  }
  for (size_t g = 0; g < layout_model.groups().size(); g++) {
    std::vector<HfTensor> tensors[3];
    for (int k = 0; k < 3; k++) tensors[k] = group_tensors(g, which[k], false);
    if (!is_root_) continue;
    for (size_t i = 0; i < tensors[0].size(); i++) {
      files[0]->append(tensors[0][i].data.data(), tensors[0][i].data.size() * sizeof(float));
      for (int k = 1; k < 3; k++) files[1]->append(tensors[k][i].data.data(), tensors[k][i].data.size() * sizeof(float));
    }
  }
  if (!is_root_) return "";
  for (int l = 0; l < model_config_.n_layer; l++)
    if (model_config_.is_moe_layer(l))
      files[0]->append(expert_bias_.data() + static_cast<size_t>(l) * model_config_.n_experts,
                       static_cast<size_t>(model_config_.n_experts) * sizeof(float));
  files[0]->finish();
  files[1]->finish();
  // model.safetensors + config.json make the step directory a Hugging Face model directory.
  w->write_file("config.json", hf_config_json(model_config_, config_.moe.bias_update_rate > 0));
  io::JsonValue meta = io::JsonValue::object();
  // The model section with every family default written out.
  io::RunConfig recorded = config_;
  recorded.model = model_section_of(model_config_);
  meta.set("config", io::JsonValue::string(io::config_to_toml(recorded)));
  meta.set("adam_steps", io::JsonValue::integer(optimizer().steps_taken()));
  // 1-bit Adam past its warm-up: how many updates the frozen v had seen.
  if (dp_->variance_steps() > 0) meta.set("adam_variance_steps", io::JsonValue::integer(dp_->variance_steps()));
  meta.set("tokens_seen", io::JsonValue::unsigned_integer(tokens_seen_));
  meta.set("seed", io::JsonValue::integer(config_.train.seed));
  // The loss scaler's state (f16; 1 and never moving otherwise).
  meta.set("loss_scale", io::JsonValue::number(scaler_.scale()));
  meta.set("loss_scale_clean_steps", io::JsonValue::integer(scaler_.clean_steps()));
  meta.set("loss_scale_skipped", io::JsonValue::integer(scaler_.skipped()));
  meta.set("loss_scale_skipped_in_a_row", io::JsonValue::integer(scaler_.skipped_in_a_row()));
  meta.set("train_loader", train_data_->state());
  meta.set("saved_by", io::JsonValue::string("parallel.pp=" + std::to_string(config_.parallel.pp) +
                                             " parallel.dp=" + std::to_string(config_.parallel.dp) +
                                             " parallel.tp=" + std::to_string(config_.parallel.tp) +
                                             " parallel.sequence_parallel=" +
                                             (config_.parallel.sequence_parallel ? "true" : "false") +
                                             " parallel.zero_stage=" + std::to_string(config_.parallel.zero_stage)));
  return w->commit(std::move(meta), config_.checkpoint.keep);
}

// The model a checkpoint holds must be this run's: refused naming every key
// that differs ("checkpoint 'x' was trained with model.family="gpt2",
// model.norm="layernorm" but this run has model.family="llama",
// model.norm="rmsnorm"). `what` names the checkpoint; the key `ignored` may differ.
static void check_same_model(const model::ModelConfig& have, const model::ModelConfig& want, const std::string& what,
                             const std::string& ignored = "") {
  const std::vector<ModelDifference> differences = model_differences(have, want);
  auto differs = [&](const char* key) {
    for (const ModelDifference& d : differences)
      if (d.key == key) return true;
    return false;
  };
  std::string there, here;
  for (const ModelDifference& d : differences) {
    if (d.key == ignored) continue;
    // A width this run leaves to the family follows from the keys it derives
    // from: they are named, it is not.
    if (d.key == "model.ffn_hidden" && want.ffn_hidden == 0 && (differs("model.family") || differs("model.n_embd")))
      continue;
    if (d.key == "model.n_kv_head" && want.n_kv_head == 0 && differs("model.n_head")) continue;
    there += (there.empty() ? "" : ", ") + d.key + "=" + d.have;
    here += (here.empty() ? "" : ", ") + d.key + "=" + d.want;
  }
  LATTICE_CHECK(there.empty(), what << " was trained with " << there << " but this run has " << here);
}

// A model file's [model] section, when lattice wrote it (kModelMetadata).
static std::optional<model::ModelConfig> recorded_model(const io::SafeTensorsReader& r) {
  const auto it = r.metadata().find(kModelMetadata);
  if (it == r.metadata().end()) return std::nullopt;
  return model_config_of(io::parse_saved_config(it->second, r.path() + " metadata " + kModelMetadata).model);
}

// Whether tensors a and b of `file` hold the same bytes (same dtype and shape).
static bool same_tensor(const io::SafeTensorsReader& file, const io::TensorEntry& a, const io::TensorEntry& b) {
  return a.dtype_name == b.dtype_name && a.shape == b.shape && a.end - a.begin == b.end - b.begin &&
         std::memcmp(file.raw(a.name), file.raw(b.name), a.end - a.begin) == 0;
}

void check_init_from(const std::string& what, const HfModelFiles& files, const io::SafeTensorsReader& file,
                     const model::ModelConfig& want) {
  if (const std::optional<model::ModelConfig> have = recorded_model(file)) {
    // The shapes say the rest; a longer position table than seq_len is fine
    // (import_hf_group), and rotary positions have none.
    check_same_model(*have, want, what, "model.seq_len");
    return;
  }
  if (!files.config_json.empty()) {  // a Hugging Face directory: its config.json in its own words
    const std::string source = "config.json '" + files.config_json + "'";
    const io::JsonValue json = io::parse_json(io::read_whole_file(files.config_json, "config.json"), source);
    std::string joined;
    for (const std::string& d : model_config_differences(json, model_config_from_hf(json, source), want))
      joined += (joined.empty() ? "" : "; ") + d;
    LATTICE_CHECK(joined.empty(), what << ": its config.json has " << joined);
  }
  // A file from elsewhere: its names say its family.
  check_tensor_family(file, want.family, what);
  // Without a record or a config.json to say the head is tied, a separate
  // head in the file would be silently dropped by a tied run (a copy of the
  // embedding is not separate).
  if (files.config_json.empty() && want.tie_embeddings) {
    const io::TensorEntry* head = find_hf_tensor(file, "lm_head.weight");
    const io::TensorEntry* embedding =
        find_hf_tensor(file, want.family == model::Family::Llama ? "model.embed_tokens.weight" : "wte.weight");
    LATTICE_CHECK(!head || (embedding && same_tensor(file, *head, *embedding)),
                  what << " has its own lm_head.weight (an untied LM head) but model.tie_embeddings = true: set "
                          "model.tie_embeddings=false to load it");
  }
}

static HfSource source_of(const io::SafeTensorsReader& r, const std::string& suffix) {
  HfSource src;
  src.source = "checkpoint file '" + r.path() + "'";
  src.shape_of = [&r, suffix](const std::string& name, std::vector<int64_t>* shape) {
    const io::TensorEntry* e = r.find(name + suffix);
    if (!e) return false;
    *shape = e->shape;
    return true;
  };
  src.read = [&r, suffix](const std::string& name, int64_t first, int64_t count, float* out) {
    LATTICE_CHECK(first == 0 && count == r.get(name + suffix).numel(),
                  r.path() << ": tensor '" << name + suffix << "' has a different size than the model needs");
    r.read_f32(name + suffix, out, static_cast<size_t>(count));
  };
  return src;
}

// Each MoE layer's selection bias from a model file into table [n_layer][E]
// (zeros where the file has none: a Mixtral file from elsewhere).
static void read_expert_bias(const io::SafeTensorsReader& file, const model::ModelConfig& config, float* table) {
  const int E = config.n_experts;
  for (int l = 0; l < config.n_layer; l++) {
    if (!config.is_moe_layer(l)) continue;
    const std::string name = model::expert_bias_name(config, l);
    float* bias = table + static_cast<size_t>(l) * E;
    const io::TensorEntry* e = file.find(name);
    if (!e) {
      std::fill(bias, bias + E, 0.0f);
      continue;
    }
    LATTICE_CHECK(e->numel() == E, file.path() << ": tensor '" << name << "' has " << e->numel()
                                               << " values, but model.n_experts=" << E);
    file.read_f32(name, bias, static_cast<size_t>(E));
  }
}

void Trainer::load_expert_bias(const io::SafeTensorsReader& file) {
  read_expert_bias(file, model_config_, expert_bias_.data());
  for (auto& part : parts_) part->expert_bias() = expert_bias_;
}

void Trainer::load_checkpoint(const std::string& step_dir) {
  // Every rank reads the directory (one filesystem for the job) and keeps its
  // part of each full tensor.
  io::verify_checkpoint(step_dir);
  io::JsonValue meta = io::read_checkpoint_meta(step_dir);
  io::RunConfig saved = io::parse_saved_config(meta.at("config").as_string(), step_dir + "/meta.json config");
  check_same_model(model_config_of(saved.model), model_config_, "checkpoint '" + step_dir + "'");
  const std::string model_path = (fs::path(step_dir) / "model.safetensors").string();
  io::SafeTensorsReader model_file(model_path);
  io::SafeTensorsReader opt((fs::path(step_dir) / "optimizer.safetensors").string());
  const HfSource sources[3] = {safetensors_source(model_file, model_path), source_of(opt, kMomentSuffix[0]),
                               source_of(opt, kMomentSuffix[1])};
  load_state(sources, 3);
  int64_t step = 0, adam = 0;
  uint64_t tokens = 0;
  LATTICE_CHECK(meta.at("step").get_i64(&step) && meta.at("adam_steps").get_i64(&adam) &&
                    meta.at("tokens_seen").get_u64(&tokens),
                "checkpoint '" << step_dir << "/meta.json' has a malformed step, adam_steps or tokens_seen");
  step_ = step;
  optimizer().set_steps_taken(adam);
  if (expert_dp_) expert_dp_->optimizer().set_steps_taken(adam);
  if (const io::JsonValue* v = meta.find("adam_variance_steps")) {
    int64_t frozen = 0;
    LATTICE_CHECK(v->get_i64(&frozen) && frozen >= 1 && frozen <= adam,
                  "checkpoint '" << step_dir << "/meta.json' has a malformed adam_variance_steps");
    dp_->restore_variance_steps(frozen);
  }
  load_expert_bias(model_file);
  tokens_seen_ = tokens;
  train_data_->restore(meta.at("train_loader"));
  params_changed();
  // f16: the loss scale goes on where it was (a checkpoint of another
  // precision, or one from before the scaler was saved, starts it afresh).
  if (compute_ == DType::F16 && saved.precision.compute == "f16" && meta.find("loss_scale_clean_steps")) {
    int64_t clean = 0, skipped = 0, in_a_row = 0;
    const io::JsonValue* row = meta.find("loss_scale_skipped_in_a_row");
    LATTICE_CHECK(meta.at("loss_scale_clean_steps").get_i64(&clean) && meta.at("loss_scale_skipped").get_i64(&skipped) &&
                      (!row || row->get_i64(&in_a_row)),
                  "checkpoint '" << step_dir << "/meta.json' has a malformed loss-scaler state");
    scaler_.restore(meta.at("loss_scale").as_double(), clean, skipped, in_a_row);
  }
  if (is_root_ && options_.print) {
    std::printf("lattice: resumed from %s (step %lld)\n", step_dir.c_str(), static_cast<long long>(step));
  }
}

std::unique_ptr<model::GPT> load_model_for_inference(const std::string& path, int n_head_hint) {
  LATTICE_CHECK(fs::exists(path), "checkpoint path '" << path << "' does not exist");
  const std::string what = "'" + path + "'";
  const HfModelFiles files = find_hf_model(path, what);
  io::SafeTensorsReader r(files.safetensors);
  model::ModelConfig mc;
  if (const std::optional<model::ModelConfig> recorded = recorded_model(r)) {
    mc = *recorded;
  } else if (!files.config_json.empty()) {
    mc = read_hf_config(files.config_json);
  } else if (!files.step_dir.empty()) {
    // A checkpoint from before either was written: its run config.
    io::JsonValue meta = io::read_checkpoint_meta(files.step_dir);
    io::RunConfig cfg = io::parse_saved_config(meta.at("config").as_string(), files.step_dir + "/meta.json config");
    mc = model_config_of(cfg.model);
  } else {
    // A bare GPT-2 safetensors file: read the shape off the tensors.
    check_tensor_family(r, model::Family::GPT2, what);
    auto find = [&r](const std::string& name) { return find_hf_tensor(r, name); };
    const io::TensorEntry* wte = find("wte.weight");
    const io::TensorEntry* wpe = find("wpe.weight");
    LATTICE_CHECK(wte && wpe && wte->shape.size() == 2 && wpe->shape.size() == 2,
                  what << " is not a GPT-2 model file: it needs 2-D wte.weight and wpe.weight (a model of other "
                          "parts needs its config.json beside it)");
    mc.vocab_size = static_cast<int>(wte->shape[0]);
    mc.n_embd = static_cast<int>(wte->shape[1]);
    mc.seq_len = static_cast<int>(wpe->shape[0]);
    mc.n_layer = 0;
    while (find("h." + std::to_string(mc.n_layer) + ".ln_1.weight")) mc.n_layer++;
    mc.tie_embeddings = find("lm_head.weight") == nullptr;
    auto it = r.metadata().find("n_head");
    if (it != r.metadata().end()) {
      mc.n_head = std::atoi(it->second.c_str());
    } else {
      LATTICE_CHECK(n_head_hint > 0,
                    what << " does not record n_head in its metadata: pass --n-head (12 for GPT-2 124M)");
      mc.n_head = n_head_hint;
    }
  }
  check_tensor_family(r, mc.family, what);
  auto gpt = std::make_unique<model::GPT>(mc, model::GPT::NoInit{});
  import_hf(*gpt, params_of(*gpt), safetensors_source(r, files.safetensors));
  if (mc.n_experts > 0) read_expert_bias(r, mc, gpt->expert_bias().data());  // it chooses the experts
  return gpt;
}

}  // namespace lattice::train
