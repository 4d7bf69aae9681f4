// The model (and optimizer state) as Hugging Face GPT-2 tensors.
//
// lattice keeps Linear weights as [out, in] and pads wte to a multiple of 128
// rows; Hugging Face's GPT-2 `model.safetensors` stores its Conv1D weights as
// [in, out] and wte as [vocab_size, C], with the LM head tied to wte and not
// stored. These functions translate, so GPT-2 weights from the Hub load into
// lattice and a lattice checkpoint opens in transformers.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "lattice/model/gpt.h"

namespace lattice::train {

// Which buffer of the groups to read or write.
enum class ModelBuffer { Params, AdamM, AdamV };

struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;  // HF layout
  std::vector<float> data;
};

// `state(g)` returns the flat buffer of group g for `which` (params, m or v).
using GroupBuffer = std::function<float*(size_t group)>;

// HF shape of a parameter: Conv1D weights transposed, wte without its padding rows.
std::vector<int64_t> hf_shape(const model::ParamInfo& p);

// Every parameter as a full logical tensor in HF layout.
std::vector<HfTensor> export_hf(model::GPT& model, const GroupBuffer& buffer);
// The parameters of one group, from `base`, its flat buffer in lattice layout.
// Under tensor parallelism `base` is one rank's buffer and `tp_bases` (when
// not empty) every TP rank's, in rank order: sliced parameters are assembled
// into their full tensors.
std::vector<HfTensor> export_hf_group(const model::ParamGroup& group, const float* base,
                                      const std::vector<const float*>& tp_bases = {});
// One parameter from its full logical tensor (lattice layout, full_shape).
HfTensor export_hf_param(const model::ParamInfo& p, const float* full);

// Fills every parameter from `lookup(name)`, which returns nullptr when the
// tensor is absent (an error naming it) or a pointer to its shape and f32 data.
// Shapes must match HF layout exactly, except that wpe may have more rows than
// model.seq_len (the first rows are used, so 1024-position GPT-2 weights can
// fine-tune at a shorter context). `source` names the file in errors.
struct HfSource {
  // Shape of tensor `name`, or false if absent.
  std::function<bool(const std::string& name, std::vector<int64_t>* shape)> shape_of;
  // Reads `count` f32 values of tensor `name` starting at element `first`.
  std::function<void(const std::string& name, int64_t first, int64_t count, float* out)> read;
  std::string source;
};
void import_hf(model::GPT& model, const GroupBuffer& buffer, const HfSource& src);
// One group's parameters into `base`, its flat buffer in lattice layout; a
// sliced parameter (tensor parallelism) gets this rank's slice of the full tensor.
void import_hf_group(const model::ParamGroup& group, float* base, const HfSource& src);

// Convenience wrappers over safetensors files.
void save_model_safetensors(model::GPT& model, const GroupBuffer& buffer, const std::string& path,
                            const std::vector<std::pair<std::string, std::string>>& metadata = {});
void load_model_safetensors(model::GPT& model, const GroupBuffer& buffer, const std::string& path);

GroupBuffer params_of(model::GPT& model);

}  // namespace lattice::train

namespace lattice::io {
class SafeTensorsReader;
struct TensorEntry;
}  // namespace lattice::io

namespace lattice::train {

// Tensor `name` of a HF GPT-2 file, with or without the "transformer." prefix
// that GPT2LMHeadModel files put on their names; nullptr when absent.
const io::TensorEntry* find_hf_tensor(const io::SafeTensorsReader& file, const std::string& name);
// The tensors of an open safetensors file (r must outlive the source); `path` names it in errors.
HfSource safetensors_source(const io::SafeTensorsReader& r, const std::string& path);

// A model to load, as given to checkpoint.init_from or `lattice generate`:
//   a safetensors file            config.json beside it is its config, if there is one
//   an HF model directory         model.safetensors + config.json
//   a lattice checkpoint          a run directory (its newest step) or a step directory,
//                                 whose files are verified against meta.json's checksums
// `what` names the path in errors ("checkpoint.init_from='x'").
struct HfModelFiles {
  std::string safetensors;
  std::string config_json;  // empty: none
  std::string step_dir;     // a lattice checkpoint's step directory (its meta.json lists the files); else empty
};
HfModelFiles find_hf_model(const std::string& path, const std::string& what);

// Refuses a file whose tensors are named for the other family than
// `family`, before the generic missing-tensor error: "<what> has GPT-2 tensor
// names (h.0.attn.c_attn.weight) but model.family = "llama": set
// model.family="gpt2"".
void check_tensor_family(const io::SafeTensorsReader& file, model::Family family, const std::string& what);

}  // namespace lattice::train
