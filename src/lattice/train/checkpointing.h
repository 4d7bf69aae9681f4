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

namespace lattice::train {

// A model from a checkpoint directory (a run dir with `latest`, or a step
// dir) or from a bare .safetensors file with HF GPT-2 names, whose shape is
// read off the tensors (n_head from the file's metadata, else n_head_hint).
std::unique_ptr<model::GPT> load_model_for_inference(const std::string& path, int n_head_hint);

}  // namespace lattice::train
