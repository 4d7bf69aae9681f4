// RunConfig: everything a run is told, from one TOML file plus --set overrides.
//
//   [train]
//   steps = 100
//   lattice train -c run.toml --set train.steps=10 --set parallel.tp=2
//
// Every key is declared once, in a table in config.cpp (name, type, default,
// valid range, help). Loading applies the file, then the overrides in order,
// checking each value as it is set; unknown sections or keys, values of the
// wrong type and values out of range are refused with one line naming the key
// and what would be valid. Cross-key checks that need only the config
// (model.n_embd % model.n_head, optim.min_lr <= optim.lr, and every key that
// applies only under another setting: conditional_keys()) run last. Checks that
// need the world size (dp*tp*pp*cp == ranks), and the model's own (whether its
// parts fit together, whether parallel.tp can cut it: model::ModelConfig, which
// io may not include), belong to the trainer (train::checked_model_config).
//
// The structs are plain data with the defaults below, so code and tests can
// also build a RunConfig directly.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lattice::io {

// The [model] section as written. `family` ("gpt2" | "llama") gives every
// part key its default; a part key left unset — "" for the strings, 0 for
// n_kv_head and ffn_hidden, no value for the numbers and switches — takes
// the family's (model::ModelConfig::defaults, through train's
// model_config_of, the one conversion). The io library checks spellings and
// ranges only; whether the parts fit together (a GPT-2 with SwiGLU, rope with
// an odd head size, tp against the heads) is ModelConfig::validate's and
// check_tensor_parallel's, run by the trainer when the config is loaded.
struct ModelSection {
  std::string family = "gpt2";
  int n_layer = 12;
  int n_head = 12;
  int n_embd = 768;
  int vocab_size = 50257;
  int seq_len = 1024;
  std::string norm;      // "" | "layernorm" | "rmsnorm"
  std::string mlp;       // "" | "gelu" | "swiglu"
  std::string position;  // "" | "learned" | "rope"
  int n_kv_head = 0;     // key/value heads; 0: n_head
  int ffn_hidden = 0;    // the MLP's hidden width; 0: the family's
  std::optional<double> rope_theta;
  std::optional<double> norm_eps;
  std::optional<bool> bias;
  std::optional<bool> tie_embeddings;
  // Mixture of experts (docs/moe.md): 0 experts is a dense MLP everywhere.
  int n_experts = 0;
  int top_k = 2;             // experts per token
  int moe_every = 1;         // layer l is an MoE layer when (l + 1) % moe_every == 0
  int n_shared_experts = 0;  // experts every token goes through
  int moe_ffn_hidden = 0;    // each expert's hidden width; 0: the family's ffn width
  bool operator==(const ModelSection&) const = default;
};

struct TrainSection {
  int micro_batch_size = 4;
  int grad_accum_steps = 1;
  // Sequences per optimizer step over all data-parallel ranks; 0 means
  // dp × micro_batch_size × grad_accum_steps. When set, grad_accum_steps is
  // derived from it (global_batch_size / (dp × micro_batch_size)), so the same
  // value trains the same model at any dp.
  int global_batch_size = 0;
  int64_t steps = 100;
  int64_t seed = 1337;
  int64_t eval_every = 0;  // 0 = never
  int eval_steps = 10;
  int threads = 0;  // 0 = all cores
  bool operator==(const TrainSection&) const = default;
};

struct OptimSection {
  double lr = 6e-4;
  double min_lr = 6e-5;
  int64_t warmup_steps = 0;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // 0 = no clipping
  bool operator==(const OptimSection&) const = default;
};

struct ParallelSection {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  int cp = 1;
  std::string cp_mode = "ring";  // ring | all_to_all (layers/context/context_parallel.h)
  int ep = 1;
  int zero_stage = 0;  // 0..3
  bool sequence_parallel = false;
  std::string schedule = "1f1b";  // gpipe | 1f1b | interleaved | zb-h1
  int virtual_stages = 1;
  // Layers of each pipeline stage, comma-separated ("5,4,3"); empty: balanced
  // by estimated cost.
  std::string partition;
  int microbatches = 1;
  // Largest data-parallel reduction call, MiB (fractions allowed for tiny
  // tests). 4 MiB: the bucket sweep in docs/performance.md.
  double bucket_mb = 4;
  bool operator==(const ParallelSection&) const = default;
};

// ZeRO-Infinity's offload tier (parallel.zero_stage says what is sharded).
struct ZeroSection {
  std::string offload = "none";  // none | disk
  std::string offload_dir;       // where a rank's files live (offload = disk)
  double offload_window_mb = 64;  // resident window per rank for the streamed state, MiB
  bool operator==(const ZeroSection&) const = default;
};

struct PrecisionSection {
  std::string compute = "f32";  // f32 | bf16 | f16
  // The TOML value is "dynamic" or a positive number (a fixed scale); here
  // 0 stands for "dynamic".
  double loss_scale = 0;
  double loss_scale_init = 65536;
  int loss_scale_window = 1000;
  double loss_scale_backoff = 0.5;
  double loss_scale_growth = 2.0;
  double loss_scale_min = 1.0;
  bool dynamic_loss_scale() const { return loss_scale == 0; }
  bool operator==(const PrecisionSection&) const = default;
};

// Activation recomputation (model/recompute.h, docs/recompute.md): which
// layers keep less for their backward and compute the rest again there.
struct RecomputeSection {
  std::string mode = "none";  // none | selective | full
  int every = 1;              // the layers l with l % every == 0 ...
  int first = 0;              // ... and, when > 0, a stage-local index below first
  bool operator==(const RecomputeSection&) const = default;
};

// [moe]: how an MoE model's router is trained (docs/moe.md); the shape is [model]'s.
struct MoeSection {
  double aux_loss_coef = 0.01;     // alpha of the load-balancing loss
  double z_loss_coef = 0.0;        // beta of the router z-loss
  double bias_update_rate = 0.0;   // u of the auxiliary-loss-free selection bias (0: off)
  double capacity_factor = 0.0;    // 0: dropless; else each expert takes at most ceil(N*k*cf/E) pairs
  double token_bound = 0.0;        // EP: rows a rank's experts take per layer, x its own N*k (0: the worst case)
  bool operator==(const MoeSection&) const = default;
};

struct CompressionSection {
  std::string grad = "none";  // none | bf16 | f16 | int8 | onebit | topk | powersgd
  bool error_feedback = true;
  double topk_ratio = 0.01;
  int64_t rank = 4;  // powersgd: the rank of each matrix's approximation
  int64_t warmup_steps = 0;  // uncompressed steps first
  bool momentum = false;     // 1-bit Adam: the momentum reduced after warmup_steps, v frozen
  bool operator==(const CompressionSection&) const = default;
};

struct DataSection {
  std::string train;  // glob of .bin shards; empty = synthetic tokens
  std::string val;
  bool operator==(const DataSection&) const = default;
};

struct CheckpointSection {
  std::string dir;
  int64_t every = 0;  // 0 = never
  int keep = 3;       // 0 = keep all
  std::string resume;     // "" | "latest" | path to a step directory or a checkpoint dir
  std::string init_from;  // a safetensors file (e.g. HF GPT-2 weights)
  bool operator==(const CheckpointSection&) const = default;
};

struct LogSection {
  int64_t every = 1;
  std::string metrics_file;
  std::string trace_file;
  bool operator==(const LogSection&) const = default;
};

struct RunConfig {
  ModelSection model;
  TrainSection train;
  OptimSection optim;
  ParallelSection parallel;
  ZeroSection zero;
  PrecisionSection precision;
  RecomputeSection recompute;
  MoeSection moe;
  CompressionSection compression;
  DataSection data;
  CheckpointSection checkpoint;
  LogSection log;
  bool operator==(const RunConfig&) const = default;
};

// Reads `path` (empty = start from the defaults), then applies overrides, each
// "section.key=value" (the text after --set; the value needs no quotes).
RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides);
// Same from TOML text; source_name names it in errors ("config file 'x.toml' line 3: ...").
RunConfig parse_config_text(const std::string& toml_text, const std::string& source_name,
                            const std::vector<std::string>& overrides);
// A config recorded by an earlier run (a checkpoint's meta.json): every key
// and value checked as parse_config_text does, but not the cross-key rules,
// which a newer lattice may have added since it was written — a checkpoint
// reads the model and the recipe from it, and is not refused for them.
RunConfig parse_saved_config(const std::string& toml_text, const std::string& source_name);
// Applies one "section.key=value" override to cfg (checking the value). Cross-key
// checks are not run; call validate_config afterwards.
void apply_override(RunConfig& cfg, const std::string& override_text);
// Cross-key checks (n_embd % n_head, min_lr <= lr) plus every per-key range check,
// for configs built in code.
void validate_config(const RunConfig& cfg);

// Micro-batches each data-parallel rank runs per optimizer step:
// train.global_batch_size / (dp × micro_batch_size) when the global batch is
// set, else train.grad_accum_steps.
int micro_batches_per_step(const RunConfig& cfg);
// Sequences per optimizer step over all ranks: dp × micro_batch_size × micro_batches_per_step.
int64_t global_batch_size(const RunConfig& cfg);

// Refuses, naming the key, every setting whose feature has not landed yet (a
// value other than the key's default for parallel.cp, parallel.ep, ...): a key
// is never accepted and ignored. "parallel.cp=2: context parallelism is not
// implemented yet; set parallel.cp=1". The trainer calls it before it builds
// the process mesh, so the refusal is the same at any number of ranks.
void check_landed(const RunConfig& cfg);

// A key that applies only under another setting (`when`, in words): set to
// anything but its default where `when` does not hold, it is refused by the
// cross-key checks with one line naming it, its value and what would make it
// apply, e.g. "checkpoint.every=100 applies only when checkpoint.dir is set:
// ...". One entry per (key, condition), in the order they are checked; a key
// may have several (parallel.virtual_stages needs pp > 1 and a generated
// schedule). For --help-config, docs/config.md and tests.
struct ConditionalKey {
  std::string key;   // "train.eval_every"
  std::string when;  // "data.val is set or data.train is empty"
};
std::vector<ConditionalKey> conditional_keys();

// The keys whose default depends on model.family, with what
// model::ModelConfig::defaults gives each family, in words or as TOML
// literals ("\"rmsnorm\"", "false", "n_head"): what --help-config and
// docs/config.md show as their defaults, and what the conditional rows read
// (model.rope_theta applies to rotary positions, llama's by default).
// tests/train/config_model_test.cpp holds it to ModelConfig::defaults.
struct FamilyDefault {
  std::string key;  // "model.norm"
  std::string gpt2;
  std::string llama;
};
const std::vector<FamilyDefault>& family_defaults();

// Every key as TOML, section by section; parse_config_text(config_to_toml(c)) == c.
// A family key left unset is written as its unset value ("" or 0).
std::string config_to_toml(const RunConfig& cfg);
// ("model.n_layer", "12"), ("data.train", "\"data/*.bin\"") ... in table order;
// values are TOML literals (strings quoted).
std::vector<std::pair<std::string, std::string>> config_items(const RunConfig& cfg);
// Every key with its default, type/range and meaning (for --help-config and docs/config.md).
std::string config_help();

}  // namespace lattice::io
