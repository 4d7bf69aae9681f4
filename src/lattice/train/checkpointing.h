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

namespace lattice::train {

// A model for inference from
//   a lattice checkpoint (a run dir with `latest`, or a step dir): its
//     config.json (a checkpoint older than that: its meta.json's config);
//   a Hugging Face model directory (model.safetensors + config.json, e.g. a
//     Llama from the Hub) or a .safetensors file with config.json beside it;
//   a bare .safetensors file with HF GPT-2 names, whose shape is read off the
//     tensors (n_head from the file's metadata, else n_head_hint).
std::unique_ptr<model::GPT> load_model_for_inference(const std::string& path, int n_head_hint);

}  // namespace lattice::train
