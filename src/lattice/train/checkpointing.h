// Checkpoints of a training run (Trainer::save_checkpoint / load_checkpoint
// live in checkpointing.cpp) and loading a model for inference.
//
// A step directory holds
//   model.safetensors      the parameters as HF tensors (GPT-2's or Llama's names; full logical tensors)
//   config.json            the model as Hugging Face reads it (train/hf_config.h), so the step
//                          directory is an HF model directory
//   optimizer.safetensors  AdamW moments: "<name>.exp_avg", "<name>.exp_avg_sq", HF layout
//   meta.json              step, the run's config (TOML), AdamW step count, tokens seen,
//                          the loader position, the seed, the loss scale; CRC32C of each file
#pragma once

#include <memory>
#include <string>

#include "lattice/model/gpt.h"
#include "lattice/train/model_io.h"

namespace lattice::io {
class SafeTensorsReader;
}

namespace lattice::train {

// Refuses (naming the keys) a checkpoint.init_from model that is another
// model than `want`, before a tensor is read. `files` is find_hf_model's
// answer for it, `file` its open model.safetensors, `what` names it in
// errors ("checkpoint.init_from='x'"). In order:
//   - a file lattice wrote records its [model] section (metadata
//     "lattice.model"): every key but seq_len must match;
//   - else a config.json (a Hugging Face directory): every key but the
//     context must match, named in the file's spelling ("its config.json has
//     num_key_value_heads=2 but model.n_kv_head=4");
//   - the tensor names must be of want.family ("has GPT-2 tensor names
//     (h.0.attn.c_attn.weight) but model.family = "llama"");
//   - a file with neither record nor config.json holding its own
//     lm_head.weight is refused for a tied run (its head would be dropped).
// Shapes are checked tensor by tensor on loading (import_hf_group).
void check_init_from(const std::string& what, const HfModelFiles& files, const io::SafeTensorsReader& file,
                     const model::ModelConfig& want);

// A model for inference from
//   a lattice checkpoint (a run dir with `latest`, or a step dir), checksums verified;
//   a Hugging Face model directory (model.safetensors + config.json, e.g. a
//     Llama from the Hub) or a .safetensors file with config.json beside it;
//   a bare .safetensors file: the model lattice recorded in its metadata, else
//     HF GPT-2 names whose shape is read off the tensors (n_head from the
//     file's metadata, else n_head_hint).
// The model is the file's recorded one, else config.json's, else (a
// checkpoint from before either) meta.json's config.
std::unique_ptr<model::GPT> load_model_for_inference(const std::string& path, int n_head_hint);

}  // namespace lattice::train
