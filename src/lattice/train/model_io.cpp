#include "lattice/train/model_io.h"

#include <cstring>
#include <filesystem>

#include "lattice/core/error.h"
#include "lattice/core/tensor.h"
#include "lattice/io/checkpoint.h"
#include "lattice/io/file_util.h"
#include "lattice/io/safetensors.h"
#include "lattice/train/hf_config.h"

namespace lattice::train {

GroupBuffer params_of(model::GPT& model) {
  return [&model](size_t g) { return model.groups()[g].data(); };
}

std::vector<int64_t> hf_shape(const model::ParamInfo& p) {
  std::vector<int64_t> s = p.full_shape;
  if (p.real_rows >= 0) s[0] = p.real_rows;
  if (p.hf_conv1d) std::swap(s[0], s[1]);
  return s;
}

HfTensor export_hf_param(const model::ParamInfo& p, const float* full) {
  HfTensor t;
  t.name = p.name;
  t.shape = hf_shape(p);
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  t.data.resize(n);
  if (p.hf_conv1d) {
    // lattice [out, in] → HF [in, out]
    const int64_t rows = p.full_shape[0], cols = p.full_shape[1];
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = 0; c < cols; c++) t.data[c * rows + r] = full[r * cols + c];
  } else {
    std::memcpy(t.data.data(), full, n * sizeof(float));  // wte: its first real_rows rows
  }
  return t;
}

std::vector<HfTensor> export_hf_group(const model::ParamGroup& group, const float* base,
                                      const std::vector<const float*>& tp_bases) {
  std::vector<HfTensor> out;
  std::vector<float> full;
  for (const model::ParamInfo& p : group.params()) {
    if (p.shard.split_dim < 0) {
      out.push_back(export_hf_param(p, base + p.offset));
      continue;
    }
    LATTICE_CHECK(!tp_bases.empty(), "export of sliced parameter " << p.name << " needs every rank's slice");
    std::vector<const float*> slices;
    for (const float* b : tp_bases) slices.push_back(b + p.offset);
    int64_t n = 1;
    for (int64_t d : p.full_shape) n *= d;
    full.assign(static_cast<size_t>(n), 0.0f);
    model::assemble_full(p, slices, full.data());
    out.push_back(export_hf_param(p, full.data()));
  }
  return out;
}

std::vector<HfTensor> export_hf(model::GPT& model, const GroupBuffer& buffer) {
  std::vector<HfTensor> out;
  for (size_t g = 0; g < model.groups().size(); g++) {
    std::vector<HfTensor> part = export_hf_group(model.groups()[g], buffer(g));
    for (HfTensor& t : part) out.push_back(std::move(t));
  }
  return out;
}

// The learned position embedding of either family.
static bool is_position_table(const std::string& name) {
  return name == "wpe.weight" || name == "model.embed_positions.weight";
}

void import_hf_group(const model::ParamGroup& group, float* base, const HfSource& src) {
  for (const model::ParamInfo& p : group.params()) {
    std::vector<int64_t> want = hf_shape(p), have;
    LATTICE_CHECK(src.shape_of(p.name, &have), src.source << ": no tensor '" << p.name << "' (shape "
                                                          << shape_string(want) << ") for this model");
    bool ok = have == want;
    // A longer position table is accepted: the first model.seq_len rows are used.
    if (!ok && is_position_table(p.name) && have.size() == 2 && have[1] == want[1] && have[0] > want[0]) ok = true;
    LATTICE_CHECK(ok, src.source << ": tensor '" << p.name << "' has shape " << shape_string(have)
                                 << " but this model needs " << shape_string(want)
                                 << " (check model.n_layer/n_head/n_kv_head/n_embd/ffn_hidden/vocab_size/seq_len)");
    // A sliced parameter is read whole, then this rank's slice taken.
    std::vector<float> whole;
    if (p.shard.split_dim >= 0) {
      int64_t total = 1;
      for (int64_t d : p.full_shape) total *= d;
      whole.assign(static_cast<size_t>(total), 0.0f);
    }
    float* dst = whole.empty() ? base + p.offset : whole.data();
    int64_t n = 1;
    for (int64_t d : want) n *= d;
    if (p.hf_conv1d) {
      std::vector<float> tmp(n);
      src.read(p.name, 0, n, tmp.data());
      const int64_t rows = p.full_shape[0], cols = p.full_shape[1];  // lattice [out, in]
      for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) dst[r * cols + c] = tmp[c * rows + r];
    } else {
      src.read(p.name, 0, n, dst);
      if (p.real_rows >= 0) {  // padding rows stay zero
        const int64_t row = p.full_shape[1];
        std::memset(dst + p.real_rows * row, 0, (p.full_shape[0] - p.real_rows) * row * sizeof(float));
      }
    }
    if (!whole.empty()) model::extract_slice(p, whole.data(), base + p.offset);
  }
}

void import_hf(model::GPT& model, const GroupBuffer& buffer, const HfSource& src) {
  for (size_t g = 0; g < model.groups().size(); g++) import_hf_group(model.groups()[g], buffer(g), src);
}

const io::TensorEntry* find_hf_tensor(const io::SafeTensorsReader& file, const std::string& name) {
  if (const io::TensorEntry* e = file.find(name)) return e;
  return file.find("transformer." + name);
}

void save_model_safetensors(model::GPT& model, const GroupBuffer& buffer, const std::string& path,
                            const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::vector<HfTensor> tensors = export_hf(model, buffer);
  io::SafeTensorsWriter w;
  for (const HfTensor& t : tensors) w.add(t.name, DType::F32, t.shape, t.data.data());
  for (const auto& [k, v] : metadata) w.set_metadata(k, v);
  w.write(path);
}

void load_model_safetensors(model::GPT& model, const GroupBuffer& buffer, const std::string& path) {
  io::SafeTensorsReader r(path);
  import_hf(model, buffer, safetensors_source(r, path));
}

HfSource safetensors_source(const io::SafeTensorsReader& file, const std::string& path) {
  const io::SafeTensorsReader* r = &file;  // the lambdas outlive this call; the reader must outlive them
  HfSource src;
  src.source = "checkpoint file '" + path + "'";
  src.shape_of = [r](const std::string& name, std::vector<int64_t>* shape) {
    const io::TensorEntry* e = find_hf_tensor(*r, name);
    if (!e) return false;
    *shape = e->shape;
    return true;
  };
  src.read = [r](const std::string& name, int64_t first, int64_t count, float* out) {
    const io::TensorEntry* e = find_hf_tensor(*r, name);
    int64_t total = e->numel();
    if (first == 0 && count == total) {
      r->read_f32(e->name, out, static_cast<size_t>(count));
      return;
    }
    std::vector<float> all(total);
    r->read_f32(e->name, all.data(), static_cast<size_t>(total));
    std::memcpy(out, all.data() + first, count * sizeof(float));
  };
  return src;
}

namespace fs = std::filesystem;

HfModelFiles find_hf_model(const std::string& path, const std::string& what) {
  LATTICE_CHECK(fs::exists(path), what << " does not exist");
  HfModelFiles files;
  auto beside = [](const fs::path& p) {
    const fs::path config = p.parent_path() / "config.json";
    return fs::is_regular_file(config) ? config.string() : std::string();
  };
  if (!fs::is_directory(path)) {
    files.safetensors = path;
    files.config_json = beside(path);
    return files;
  }
  const fs::path dir(path);
  if (fs::exists(dir / "model.safetensors") && !fs::exists(dir / "meta.json")) {  // an HF model directory
    files.safetensors = (dir / "model.safetensors").string();
    files.config_json = beside(files.safetensors);
    return files;
  }
  LATTICE_CHECK(!fs::exists(dir / "model.safetensors.index.json"),
                what << " holds a sharded model (model.safetensors.index.json): lattice reads one "
                        "model.safetensors; merge the shards into one file first");
  // A lattice checkpoint: a step directory, or a run directory's newest step.
  LATTICE_CHECK(fs::exists(dir / "meta.json") || fs::exists(dir / "latest") || !io::list_checkpoints(path).empty(),
                what << " is a directory without model.safetensors: give a safetensors file, a Hugging Face model "
                        "directory (model.safetensors + config.json) or a lattice checkpoint directory");
  files.step_dir = io::resolve_checkpoint(path);
  io::verify_checkpoint(files.step_dir);
  files.safetensors = (fs::path(files.step_dir) / "model.safetensors").string();
  files.config_json = beside(files.safetensors);
  return files;
}

namespace {

std::string without_transformer_prefix(const std::string& name) {
  return name.rfind("transformer.", 0) == 0 ? name.substr(12) : name;
}
bool is_gpt2_name(const std::string& stored) {
  const std::string n = without_transformer_prefix(stored);
  return n == "wte.weight" || n == "wpe.weight" || n.rfind("h.", 0) == 0 || n.rfind("ln_f.", 0) == 0;
}
bool is_llama_name(const std::string& n) {
  return n.rfind("model.layers.", 0) == 0 || n == "model.embed_tokens.weight" || n.rfind("model.norm.", 0) == 0;
}

// A name of the file's that `is_family` accepts, `preferred` if the file has
// it; empty when none.
std::string example_name(const io::SafeTensorsReader& file, bool (*is_family)(const std::string&),
                         const std::string& preferred) {
  if (const io::TensorEntry* e = find_hf_tensor(file, preferred)) return e->name;
  for (const io::TensorEntry& e : file.tensors())
    if (is_family(e.name)) return e.name;
  return "";
}

}  // namespace

void check_tensor_family(const io::SafeTensorsReader& file, model::Family family, const std::string& what) {
  const std::string gpt2 = example_name(file, is_gpt2_name, "h.0.attn.c_attn.weight");
  const std::string llama = example_name(file, is_llama_name, "model.layers.0.self_attn.q_proj.weight");
  if (family == model::Family::Llama) {
    LATTICE_CHECK(gpt2.empty() || !llama.empty(), what << " has GPT-2 tensor names (" << gpt2
                                                       << ") but model.family = \"llama\": set model.family=\"gpt2\"");
  } else {
    LATTICE_CHECK(llama.empty() || !gpt2.empty(), what << " has Llama tensor names (" << llama
                                                       << ") but model.family = \"gpt2\": set model.family=\"llama\"");
  }
}

}  // namespace lattice::train
