// config.json: a model's Hugging Face configuration, written beside every
// model.safetensors lattice writes, and read from Hugging Face model
// directories.
//
// A model that a transformers class computes exactly gets that class's keys:
//   Llama family, RMSNorm + SwiGLU + RoPE   LlamaForCausalLM (model_type "llama")
//   GPT-2 family, LayerNorm + GELU + learned positions + biases
//                                            GPT2LMHeadModel (model_type "gpt2")
// Any other choice of parts (a Llama with LayerNorm, a GPT-2 with RoPE or
// without biases, ...) keeps the HF keys that still describe it but neither
// "architectures" nor "model_type": transformers picks its class from
// model_type, so without one it refuses the directory instead of loading it
// into a model that computes something else. Every config.json also holds a
// "lattice" object with every key of the model section, which lattice reads
// first, so its own files come back exactly.
#pragma once

#include <string>
#include <vector>

#include "lattice/io/json.h"
#include "lattice/model/config.h"

namespace lattice::train {

// Whether transformers' class for c.family computes exactly this model.
bool hf_class_computes(const model::ModelConfig& c);

// The config.json text (pretty-printed, keys sorted as transformers writes them).
// selection_bias: an MoE model whose routing has the auxiliary-loss-free
// bias (moe.bias_update_rate > 0), which HF's Mixtral does not compute.
std::string hf_config_json(const model::ModelConfig& c, bool selection_bias = false);

// A ModelConfig from a parsed config.json: its "lattice" object when it has
// one, else the HF keys of model_type "llama" or "gpt2" (HF's defaults for
// absent optional keys). Refuses, naming the key and `source`: another
// model_type, a rope_scaling (or rope_parameters) other than the default
// rotation, a llama hidden_act other than "silu", a gpt2 activation_function
// other than the tanh GELU, a head_dim other than hidden_size /
// num_attention_heads, attention_bias != mlp_bias, and a model that
// ModelConfig::validate refuses.
model::ModelConfig model_config_from_hf(const io::JsonValue& json, const std::string& source);
// The same from a config.json file.
model::ModelConfig read_hf_config(const std::string& path);

// Where a config.json and a run's model section disagree, one entry per
// differing key, in the file's own names: "num_key_value_heads=2 but
// model.n_kv_head=4" (or "lattice.n_kv_head=2 ..." for a file read through its
// lattice object). `file` is model_config_from_hf(json). Keys are compared by
// what they compute (n_kv_head 0 is n_head, ffn_hidden 0 the family's width,
// rope_theta only with rotary positions). The context is not compared, as
// for a file lattice wrote: a learned position table is checked by its shape
// on loading (a longer one is used in part), rotary positions have none.
std::vector<std::string> model_config_differences(const io::JsonValue& json, const model::ModelConfig& file,
                                                  const model::ModelConfig& run);

}  // namespace lattice::train
