// Checkpoints of a training run (Trainer::save_checkpoint / load_checkpoint
// live in checkpointing.cpp) and loading a model for inference.
//
// A step directory holds
//   model.safetensors      the parameters as HF GPT-2 tensors (full logical tensors)
//   optimizer.safetensors  AdamW moments: "<name>.exp_avg", "<name>.exp_avg_sq", HF layout
//   meta.json              step, the run's config (TOML), AdamW step count, tokens seen,
//                          the loader position, the seed, the loss scale; CRC32C of each file
#pragma once

#include <memory>
#include <string>

#include "lattice/model/gpt.h"

namespace lattice::io {
class SafeTensorsReader;
}

namespace lattice::train {

// Refuses (naming the keys) a checkpoint.init_from file that holds another
// model than `want`: one lattice wrote records its [model] section, and every
// key but seq_len must match (the tensor shapes are checked on loading); one
// from elsewhere is refused when its names are the other family's (HF GPT-2's
// wte.weight, HF Llama's model.embed_tokens.weight).
void check_init_from(const io::SafeTensorsReader& file, const model::ModelConfig& want);

// A model from a checkpoint directory (a run dir with `latest`, or a step
// dir) or from a bare .safetensors file: the model lattice recorded in its
// metadata, else HF GPT-2 names whose shape is read off the tensors (n_head
// from the file's metadata, else n_head_hint).
std::unique_ptr<model::GPT> load_model_for_inference(const std::string& path, int n_head_hint);

}  // namespace lattice::train
