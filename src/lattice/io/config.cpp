#include "lattice/io/config.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <type_traits>

#include <toml++/toml.h>

#include "lattice/core/error.h"
#include "lattice/io/file_util.h"
#include "lattice/io/json.h"

namespace lattice::io {

namespace {

// ---------------------------------------------------------------- key table

// OptFloat and OptBool are the family keys' numbers and switches: unset
// (written "") means the family's default.
enum class Kind { Int, Int64, Float, Bool, String, LossScale, OptFloat, OptBool };

// Valid values of one key: a numeric interval (ends open or closed) or, for
// strings, a list of choices (empty = any string).
struct Constraint {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;
  bool hi_open = false;
  std::vector<const char*> choices;
};

Constraint any() { return {}; }
Constraint at_least(double lo) { return {lo, Constraint().hi, false, false, {}}; }
Constraint above(double lo) { return {lo, Constraint().hi, true, false, {}}; }
Constraint closed(double lo, double hi) { return {lo, hi, false, false, {}}; }
Constraint closed_open(double lo, double hi) { return {lo, hi, false, true, {}}; }
Constraint open_closed(double lo, double hi) { return {lo, hi, true, false, {}}; }
Constraint open_open(double lo, double hi) { return {lo, hi, true, true, {}}; }
Constraint one_of(std::vector<const char*> choices) {
  Constraint c;
  c.choices = std::move(choices);
  return c;
}

struct Key {
  const char* section;
  const char* name;
  Kind kind;
  void* (*field)(RunConfig&);
  Constraint valid;
  const char* help;
  // The default depends on model.family (family_defaults()): "" (strings,
  // numbers, switches) or 0 (integers) stands for the family's.
  bool by_family = false;

  std::string full_name() const { return std::string(section) + "." + name; }
  template <typename T>
  T& ref(RunConfig& c) const { return *static_cast<T*>(field(c)); }
  template <typename T>
  const T& ref(const RunConfig& c) const { return *static_cast<T*>(field(const_cast<RunConfig&>(c))); }
};

template <auto Section, auto Member>
void* field_of(RunConfig& c) {
  return &((c.*Section).*Member);
}

template <typename T>
constexpr Kind kind_of() {
  if constexpr (std::is_same_v<T, int>) return Kind::Int;
  else if constexpr (std::is_same_v<T, int64_t>) return Kind::Int64;
  else if constexpr (std::is_same_v<T, double>) return Kind::Float;
  else if constexpr (std::is_same_v<T, bool>) return Kind::Bool;
  else if constexpr (std::is_same_v<T, std::optional<double>>) return Kind::OptFloat;
  else if constexpr (std::is_same_v<T, std::optional<bool>>) return Kind::OptBool;
  else return Kind::String;
}

// key<&RunConfig::train, &TrainSection::steps>("train", "steps", at_least(1), "...")
template <auto Section, auto Member>
Key key(const char* section, const char* name, Constraint valid, const char* help) {
  using T = std::remove_cvref_t<decltype(std::declval<RunConfig&>().*Section.*Member)>;
  static_assert(std::is_same_v<T, int> || std::is_same_v<T, int64_t> || std::is_same_v<T, double> ||
                std::is_same_v<T, bool> || std::is_same_v<T, std::string> || std::is_same_v<T, std::optional<double>> ||
                std::is_same_v<T, std::optional<bool>>);
  return Key{section, name, kind_of<T>(), &field_of<Section, Member>, std::move(valid), help};
}

// A key whose default is model.family's (its row of family_defaults()).
Key by_family(Key k) {
  k.by_family = true;
  return k;
}

const std::vector<const char*>& section_names() {
  static const std::vector<const char*> names = {"model",     "parallel",  "zero",        "train",
                                                 "optim",     "precision", "recompute",   "moe",         "compression",
                                                 "data",      "checkpoint", "log"};
  return names;
}

const std::vector<Key>& keys() {
  using R = RunConfig;
  static const std::vector<Key> table = [] {
    std::vector<Key> k = {
        key<&R::model, &ModelSection::family>(
            "model", "family", one_of({"gpt2", "llama"}),
            "the model's family: GPT-2 (LayerNorm, learned positions, GELU, biases, tied head; HF GPT-2 names) or "
            "Llama (RMSNorm, rotary positions, SwiGLU, no biases, untied head; HF Llama names); sets the default "
            "of each part key below"),
        key<&R::model, &ModelSection::n_layer>("model", "n_layer", at_least(1), "number of transformer blocks"),
        key<&R::model, &ModelSection::n_head>("model", "n_head", at_least(1), "attention heads per block"),
        key<&R::model, &ModelSection::n_embd>("model", "n_embd", at_least(1),
                                              "width of the residual stream; a multiple of n_head"),
        key<&R::model, &ModelSection::vocab_size>("model", "vocab_size", at_least(1),
                                                  "vocabulary size; the GPT-2 BPE has 50257"),
        key<&R::model, &ModelSection::seq_len>("model", "seq_len", at_least(1),
                                               "context length in tokens (number of positions)"),
        by_family(key<&R::model, &ModelSection::norm>("model", "norm", one_of({"layernorm", "rmsnorm"}),
                                                      "the norm before attention, before the MLP and at the end")),
        by_family(key<&R::model, &ModelSection::mlp>("model", "mlp", one_of({"gelu", "swiglu"}),
                                                     "the MLP: GELU(x W1) W2, or SwiGLU (SiLU(x Wg) * x Wu) Wd "
                                                     "(llama only)")),
        by_family(key<&R::model, &ModelSection::position>("model", "position", one_of({"learned", "rope"}),
                                                          "positions: a learned table of seq_len rows, or "
                                                          "rotary embeddings of the queries and keys")),
        by_family(key<&R::model, &ModelSection::n_kv_head>(
            "model", "n_kv_head", at_least(0),
            "key/value heads; fewer than n_head (a divisor of it) is grouped-query attention (llama only)")),
        by_family(
            key<&R::model, &ModelSection::ffn_hidden>("model", "ffn_hidden", at_least(0), "hidden width of the MLP")),
        by_family(key<&R::model, &ModelSection::rope_theta>("model", "rope_theta", above(0),
                                                            "base of the rotary embedding's frequencies")),
        by_family(
            key<&R::model, &ModelSection::norm_eps>("model", "norm_eps", open_open(0, 1), "epsilon of the norms")),
        by_family(key<&R::model, &ModelSection::bias>("model", "bias", any(),
                                                      "biases in every linear layer (a LayerNorm always has one)")),
        by_family(key<&R::model, &ModelSection::tie_embeddings>(
            "model", "tie_embeddings", any(), "the LM head is the token embedding (one matrix, counted once)")),
        key<&R::model, &ModelSection::n_experts>(
            "model", "n_experts", at_least(0),
            "mixture of experts (docs/moe.md): experts per MoE layer, each an MLP of the family's kind; 0: a "
            "dense MLP everywhere"),
        key<&R::model, &ModelSection::top_k>("model", "top_k", at_least(1),
                                             "experts each token is routed to (1 <= top_k <= n_experts)"),
        key<&R::model, &ModelSection::moe_every>(
            "model", "moe_every", at_least(1), "layer l (from 0) is an MoE layer when (l + 1) % moe_every == 0"),
        key<&R::model, &ModelSection::n_shared_experts>(
            "model", "n_shared_experts", at_least(0),
            "experts every token goes through besides its top_k (one dense MLP n_shared_experts x moe_ffn_hidden "
            "wide)"),
        key<&R::model, &ModelSection::moe_ffn_hidden>("model", "moe_ffn_hidden", at_least(0),
                                                      "hidden width of each expert; 0: the family's ffn width"),

        key<&R::parallel, &ParallelSection::dp>(
            "parallel", "dp", at_least(1), "data-parallel degree: model replicas, each on its own part of the batch"),
        key<&R::parallel, &ParallelSection::tp>("parallel", "tp", at_least(1),
                                                "tensor-parallel degree: each weight matrix split over tp ranks"),
        key<&R::parallel, &ParallelSection::pp>("parallel", "pp", at_least(1),
                                                "pipeline-parallel degree: stages of consecutive layers"),
        key<&R::parallel, &ParallelSection::cp>("parallel", "cp", at_least(1),
                                                "context-parallel degree: each sequence cut over cp ranks (the "
                                                "attention talks: parallel.cp_mode)"),
        key<&R::parallel, &ParallelSection::cp_mode>(
            "parallel", "cp_mode", one_of({"ring", "all_to_all"}),
            "how context parallelism attends: key/value blocks around a ring, or all-to-all from sequence- to "
            "head-sharded (needs the heads divisible by cp)"),
        key<&R::parallel, &ParallelSection::ep>("parallel", "ep", at_least(1),
                                                "expert-parallel degree: MoE experts spread over ranks"),
        key<&R::parallel, &ParallelSection::zero_stage>(
            "parallel", "zero_stage", closed(0, 3),
            "ZeRO stage: 0 replicated, 1 shards optimizer state, 2 also gradients, 3 also parameters"),
        key<&R::parallel, &ParallelSection::sequence_parallel>(
            "parallel", "sequence_parallel", any(),
            "keep the LayerNorm and residual activations as sequence slices over the TP group"),
        key<&R::parallel, &ParallelSection::schedule>(
            "parallel", "schedule", any(),
            "pipeline schedule: gpipe, 1f1b, interleaved, zb-h1, zb-v, or csv:FILE (PyTorch's compute-only format)"),
        key<&R::parallel, &ParallelSection::virtual_stages>(
            "parallel", "virtual_stages", at_least(1), "model chunks per pipeline rank (interleaved: >= 2; zb-v: 2)"),
        key<&R::parallel, &ParallelSection::partition>(
            "parallel", "partition", any(),
            "layers per pipeline stage, comma-separated, e.g. \"5,4,3\" (empty = balanced by estimated cost)"),
        key<&R::parallel, &ParallelSection::microbatches>(
            "parallel", "microbatches", at_least(1),
            "not a separate knob: the micro-batches of a step are train.grad_accum_steps"),
        key<&R::parallel, &ParallelSection::bucket_mb>(
            "parallel", "bucket_mb", above(0),
            "largest data-parallel gradient bucket in MiB (one reduction call; a group larger than this is cut)"),

        key<&R::zero, &ZeroSection::offload>("zero", "offload", one_of({"none", "disk"}),
                                             "where a rank's optimizer state (and, at stage 3, its parameter "
                                             "shard) lives: in memory, or in files streamed through a window"),
        key<&R::zero, &ZeroSection::offload_dir>("zero", "offload_dir", any(),
                                                 "directory of the offload files; must exist"),
        key<&R::zero, &ZeroSection::offload_window_mb>("zero", "offload_window_mb", above(0),
                                                       "resident window per rank for offloaded state, MiB"),

        key<&R::train, &TrainSection::micro_batch_size>("train", "micro_batch_size", at_least(1),
                                                        "sequences per micro-batch on each data-parallel rank"),
        key<&R::train, &TrainSection::grad_accum_steps>(
            "train", "grad_accum_steps", at_least(1),
            "micro-batches each data-parallel rank runs per optimizer step (the pipeline's micro-batches too)"),
        key<&R::train, &TrainSection::global_batch_size>(
            "train", "global_batch_size", at_least(0),
            "sequences per optimizer step over all ranks (0 = dp x micro_batch_size x grad_accum_steps); "
            "when set, grad_accum_steps is derived from it"),
        key<&R::train, &TrainSection::steps>("train", "steps", at_least(1), "optimizer steps to run"),
        key<&R::train, &TrainSection::seed>("train", "seed", at_least(0),
                                            "seed of parameter init, synthetic data and sampling"),
        key<&R::train, &TrainSection::eval_every>("train", "eval_every", at_least(0),
                                                  "evaluate on the validation data every N steps (0 = never)"),
        key<&R::train, &TrainSection::eval_steps>("train", "eval_steps", at_least(1), "batches per evaluation"),
        key<&R::train, &TrainSection::threads>("train", "threads", at_least(0),
                                               "CPU threads per process (0 = the node's cores shared among its ranks)"),

        key<&R::optim, &OptimSection::lr>("optim", "lr", at_least(0), "peak learning rate (reached after warmup)"),
        key<&R::optim, &OptimSection::min_lr>("optim", "min_lr", at_least(0),
                                              "learning rate at the end of the cosine decay; <= lr"),
        key<&R::optim, &OptimSection::warmup_steps>("optim", "warmup_steps", at_least(0),
                                                    "steps of linear warmup from 0 to lr"),
        key<&R::optim, &OptimSection::weight_decay>("optim", "weight_decay", at_least(0),
                                                    "AdamW decoupled weight decay"),
        key<&R::optim, &OptimSection::beta1>("optim", "beta1", closed_open(0, 1), "Adam first-moment decay"),
        key<&R::optim, &OptimSection::beta2>("optim", "beta2", closed_open(0, 1), "Adam second-moment decay"),
        key<&R::optim, &OptimSection::eps>("optim", "eps", above(0), "Adam epsilon in the denominator"),
        key<&R::optim, &OptimSection::grad_clip>("optim", "grad_clip", at_least(0),
                                                 "clip the global gradient L2 norm to this (0 = no clipping)"),

        key<&R::precision, &PrecisionSection::compute>(
            "precision", "compute", one_of({"f32", "bf16", "f16"}),
            "compute dtype of weights and activations; master weights and optimizer state stay f32"),
        Key{"precision", "loss_scale", Kind::LossScale, &field_of<&R::precision, &PrecisionSection::loss_scale>,
            above(0), "\"dynamic\" or a fixed positive loss scale"},
        key<&R::precision, &PrecisionSection::loss_scale_init>("precision", "loss_scale_init", above(0),
                                                               "initial dynamic loss scale"),
        key<&R::precision, &PrecisionSection::loss_scale_window>("precision", "loss_scale_window", at_least(1),
                                                                 "overflow-free steps before the dynamic scale grows"),
        key<&R::precision, &PrecisionSection::loss_scale_backoff>("precision", "loss_scale_backoff", open_open(0, 1),
                                                                  "factor on the dynamic scale after an overflow"),
        key<&R::precision, &PrecisionSection::loss_scale_growth>(
            "precision", "loss_scale_growth", above(1),
            "factor on the dynamic scale after loss_scale_window clean steps"),
        key<&R::precision, &PrecisionSection::loss_scale_min>("precision", "loss_scale_min", above(0),
                                                              "the dynamic scale never backs off below this"),

        key<&R::recompute, &RecomputeSection::mode>(
            "recompute", "mode", one_of({"none", "selective", "full"}),
            "activation recomputation (docs/recompute.md): none keeps every activation for the backward; selective "
            "drops the norms' outputs and the MLP's activation, computed again in the backward (elementwise work); "
            "full keeps only each layer's input and runs its forward again in the backward. Bit-identical results"),
        key<&R::recompute, &RecomputeSection::every>("recompute", "every", at_least(1),
                                                     "recompute the layers whose index l has l % every == 0"),
        key<&R::recompute, &RecomputeSection::first>(
            "recompute", "first", at_least(0),
            "recompute only the first N layers of each pipeline stage (0 = all of them)"),
        key<&R::moe, &MoeSection::aux_loss_coef>(
            "moe", "aux_loss_coef", at_least(0),
            "alpha of the load-balancing loss alpha*E*sum_i f_i*P_i (alpha at uniform routing, alpha*E at collapse)"),
        key<&R::moe, &MoeSection::z_loss_coef>("moe", "z_loss_coef", at_least(0),
                                               "beta of the router z-loss beta*mean(logsumexp(logits)^2)"),
        key<&R::moe, &MoeSection::bias_update_rate>(
            "moe", "bias_update_rate", at_least(0),
            "u of the auxiliary-loss-free selection bias: b_i += u*sign(mean load - load_i) after each step "
            "(DeepSeek-V3); 0: off"),
        key<&R::moe, &MoeSection::capacity_factor>(
            "moe", "capacity_factor", at_least(0),
            "0: dropless; > 0: each expert takes at most ceil(N*k*cf/E) of a rank's pairs, the lowest router "
            "probabilities dropped (layout-dependent under tp and cp: refused there)"),
        key<&R::moe, &MoeSection::token_bound>(
            "moe", "token_bound", at_least(0),
            "expert parallelism: the rows a rank's experts may receive per layer, as a multiple of its own N*top_k "
            "(memory is sized for it; a router past it stops the job naming the layer); 0: the worst case"),

        key<&R::compression, &CompressionSection::grad>(
            "compression", "grad", one_of({"none", "bf16", "f16", "int8", "onebit", "topk", "powersgd"}),
            "codec of the data-parallel gradient reduction: 16-bit floats, int8 with a scale per 256, "
            "signs with a scale per 256 (onebit), the largest values with their indices (topk), or each "
            "weight matrix as a rank-r product (powersgd)"),
        key<&R::compression, &CompressionSection::error_feedback>(
            "compression", "error_feedback", any(), "carry each step's compression error into the next step"),
        key<&R::compression, &CompressionSection::topk_ratio>("compression", "topk_ratio", open_closed(0, 1),
                                                              "fraction of gradient entries kept by topk"),
        key<&R::compression, &CompressionSection::rank>(
            "compression", "rank", at_least(1),
            "PowerSGD's rank r: each weight matrix's gradient is sent as two factors of r columns"),
        key<&R::compression, &CompressionSection::warmup_steps>(
            "compression", "warmup_steps", at_least(0),
            "steps reduced uncompressed before compression starts (with compression.momentum: before Adam's second "
            "moment is frozen)"),
        key<&R::compression, &CompressionSection::momentum>(
            "compression", "momentum", any(),
            "1-bit Adam: after compression.warmup_steps steps, freeze Adam's second moment and reduce each rank's "
            "momentum (through compression.grad's codec) instead of its gradient; ZeRO stage 0 or 1"),

        key<&R::data, &DataSection::train>("data", "train", any(),
                                           "glob of training .bin shards (empty = synthetic random tokens)"),
        key<&R::data, &DataSection::val>("data", "val", any(), "glob of validation .bin shards (empty = none)"),

        key<&R::checkpoint, &CheckpointSection::dir>("checkpoint", "dir", any(),
                                                     "directory of checkpoints (empty = no checkpoints)"),
        key<&R::checkpoint, &CheckpointSection::every>(
            "checkpoint", "every", at_least(0), "write a checkpoint every N steps (0 = only at the end of the run)"),
        key<&R::checkpoint, &CheckpointSection::keep>("checkpoint", "keep", at_least(0),
                                                      "keep the newest N checkpoints (0 = keep all)"),
        key<&R::checkpoint, &CheckpointSection::resume>(
            "checkpoint", "resume", any(),
            "\"\" starts fresh, \"latest\" resumes from the newest checkpoint in dir, or a checkpoint path"),
        key<&R::checkpoint, &CheckpointSection::init_from>(
            "checkpoint", "init_from", any(),
            "initialise weights from a safetensors file, a Hugging Face model directory (model.safetensors + "
            "config.json) or a lattice checkpoint, in the family's HF names"),

        key<&R::log, &LogSection::every>("log", "every", at_least(1), "print a step line every N steps"),
        key<&R::log, &LogSection::metrics_file>("log", "metrics_file", any(),
                                                "append one JSON object per step to this file (empty = none)"),
        key<&R::log, &LogSection::trace_file>(
            "log", "trace_file", any(),
            "write the pipeline timeline of the latest step here, Chrome trace JSON (empty = none)"),
    };
    return k;
  }();
  return table;
}

const Key* find_key(std::string_view section, std::string_view name) {
  for (const Key& k : keys())
    if (section == k.section && name == k.name) return &k;
  return nullptr;
}

bool is_section(std::string_view name) {
  for (const char* s : section_names())
    if (name == s) return true;
  return false;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// Closest candidate within a small edit distance, or "" when nothing is close.
std::string closest(std::string_view word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::max<size_t>(2, word.size() / 3) + 1;
  for (const std::string& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out;
}

std::string unknown_section_message(const std::string& section) {
  std::vector<std::string> names(section_names().begin(), section_names().end());
  std::string msg = "unknown section '[" + section + "]' (valid sections: " + join(names) + ")";
  std::string guess = closest(section, names);
  if (!guess.empty()) msg += "; did you mean '[" + guess + "]'?";
  return msg;
}

std::string unknown_key_message(const std::string& section, const std::string& name) {
  std::vector<std::string> names;
  for (const Key& k : keys())
    if (section == k.section) names.push_back(k.name);
  std::string msg = "unknown key '" + section + "." + name + "' (valid keys in [" + section + "]: " + join(names) + ")";
  std::string guess;
  for (const Key& k : keys())
    if (name == k.name) guess = k.full_name();  // right name, wrong section
  if (guess.empty()) {
    std::string near = closest(name, names);
    if (!near.empty()) guess = section + "." + near;
  }
  if (!guess.empty()) msg += "; did you mean '" + guess + "'?";
  return msg;
}

// ---------------------------------------------------------------- values

std::string format_double(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  std::string s = json_number(x);
  // TOML needs a '.' or an exponent to read a float back as a float.
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

std::string toml_quote(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04X", c);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

// A value as it arrived (from TOML or from --set text), before it is checked
// against a key. `shown` is how the error message quotes it.
struct RawValue {
  enum class Type { Int, Float, Bool, String, Other } type = Type::Other;
  int64_t i = 0;
  double f = 0;
  bool b = false;
  std::string s;
  std::string shown;
};

std::string format_bound(double x) {
  if (x == std::floor(x) && std::fabs(x) < 1e15) return std::to_string(static_cast<int64_t>(x));
  return format_double(x);
}

// "an integer >= 1", "a number in [0, 1)", "one of f32, bf16, f16" ...
std::string describe_value(const Key& k);
std::string describe(const Key& k) {
  std::string s = describe_value(k);
  if (k.by_family) s += k.kind == Kind::Int ? " (0: the family's)" : " (\"\": the family's)";
  return s;
}

std::string describe_value(const Key& k) {
  const Constraint& v = k.valid;
  bool has_lo = std::isfinite(v.lo), has_hi = std::isfinite(v.hi);
  std::string range;
  bool integer = k.kind == Kind::Int || k.kind == Kind::Int64;
  if (has_lo && has_hi) {
    if (integer) range = " in " + format_bound(v.lo) + ".." + format_bound(v.hi);
    else
      range = std::string(" in ") + (v.lo_open ? "(" : "[") + format_bound(v.lo) + ", " + format_bound(v.hi) +
              (v.hi_open ? ")" : "]");
  } else if (has_lo) {
    range = std::string(v.lo_open ? " > " : " >= ") + format_bound(v.lo);
  } else if (has_hi) {
    range = std::string(v.hi_open ? " < " : " <= ") + format_bound(v.hi);
  }
  switch (k.kind) {
    case Kind::Int:
    case Kind::Int64: return "an integer" + range;
    case Kind::Float:
    case Kind::OptFloat: return "a number" + range;
    case Kind::Bool:
    case Kind::OptBool: return "true or false";
    case Kind::LossScale: return "\"dynamic\" or a number" + range;
    case Kind::String:
      if (v.choices.empty()) return "a string";
      {
        std::string s = "one of ";
        for (size_t i = 0; i < v.choices.size(); ++i) s += (i ? ", " : "") + std::string(v.choices[i]);
        return s;
      }
  }
  return "?";
}

bool in_range(const Constraint& v, double x) {
  if (!std::isfinite(x)) return false;
  if (v.lo_open ? !(x > v.lo) : !(x >= v.lo)) return false;
  if (v.hi_open ? !(x < v.hi) : !(x <= v.hi)) return false;
  return true;
}

[[noreturn]] void bad_value(const Key& k, const std::string& shown, const std::string& where) {
  LATTICE_FAIL(k.full_name() << " must be " << describe(k) << ", got " << shown << where);
}

// Checks raw against k and stores it in cfg. `where` is appended to errors.
void assign(const Key& k, RunConfig& cfg, const RawValue& raw, const std::string& where) {
  using T = RawValue::Type;
  switch (k.kind) {
    case Kind::Int:
    case Kind::Int64: {
      if (raw.type != T::Int || !in_range(k.valid, static_cast<double>(raw.i))) bad_value(k, raw.shown, where);
      if (k.kind == Kind::Int) {
        LATTICE_CHECK(raw.i <= INT_MAX && raw.i >= INT_MIN,
                      k.full_name() << " must be " << describe(k) << " and at most " << INT_MAX << ", got "
                                    << raw.shown << where);
        k.ref<int>(cfg) = static_cast<int>(raw.i);
      } else {
        k.ref<int64_t>(cfg) = raw.i;
      }
      return;
    }
    case Kind::Float: {
      double x = raw.type == T::Int ? static_cast<double>(raw.i) : raw.f;
      if ((raw.type != T::Int && raw.type != T::Float) || !in_range(k.valid, x)) bad_value(k, raw.shown, where);
      k.ref<double>(cfg) = x;
      return;
    }
    case Kind::Bool:
      if (raw.type != T::Bool) bad_value(k, raw.shown, where);
      k.ref<bool>(cfg) = raw.b;
      return;
    case Kind::OptFloat: {
      if (raw.type == T::String && raw.s.empty()) {
        k.ref<std::optional<double>>(cfg).reset();
        return;
      }
      double x = raw.type == T::Int ? static_cast<double>(raw.i) : raw.f;
      if ((raw.type != T::Int && raw.type != T::Float) || !in_range(k.valid, x)) bad_value(k, raw.shown, where);
      k.ref<std::optional<double>>(cfg) = x;
      return;
    }
    case Kind::OptBool:
      if (raw.type == T::String && raw.s.empty()) {
        k.ref<std::optional<bool>>(cfg).reset();
        return;
      }
      if (raw.type != T::Bool) bad_value(k, raw.shown, where);
      k.ref<std::optional<bool>>(cfg) = raw.b;
      return;
    case Kind::String: {
      if (raw.type != T::String) bad_value(k, raw.shown, where);
      if (!k.valid.choices.empty() && !(k.by_family && raw.s.empty()) &&
          std::none_of(k.valid.choices.begin(), k.valid.choices.end(), [&](const char* c) { return raw.s == c; }))
        bad_value(k, raw.shown, where);
      k.ref<std::string>(cfg) = raw.s;
      return;
    }
    case Kind::LossScale: {
      if (raw.type == T::String && raw.s == "dynamic") {
        k.ref<double>(cfg) = 0;
        return;
      }
      double x = raw.type == T::Int ? static_cast<double>(raw.i) : raw.f;
      if ((raw.type != T::Int && raw.type != T::Float) || !in_range(k.valid, x)) bad_value(k, raw.shown, where);
      k.ref<double>(cfg) = x;
      return;
    }
  }
}

// The TOML literal of a key's current value.
std::string value_literal(const Key& k, const RunConfig& cfg) {
  switch (k.kind) {
    case Kind::Int: return std::to_string(k.ref<int>(cfg));
    case Kind::Int64: return std::to_string(k.ref<int64_t>(cfg));
    case Kind::Float: return format_double(k.ref<double>(cfg));
    case Kind::Bool: return k.ref<bool>(cfg) ? "true" : "false";
    case Kind::String: return toml_quote(k.ref<std::string>(cfg));
    case Kind::LossScale: {
      double x = k.ref<double>(cfg);
      return x == 0 ? "\"dynamic\"" : format_double(x);
    }
    case Kind::OptFloat: {
      const std::optional<double>& x = k.ref<std::optional<double>>(cfg);
      return x ? format_double(*x) : "\"\"";
    }
    case Kind::OptBool: {
      const std::optional<bool>& b = k.ref<std::optional<bool>>(cfg);
      return b ? (*b ? "true" : "false") : "\"\"";
    }
  }
  return "?";
}

// The current value as a RawValue, to re-check a config built in code.
RawValue current_raw(const Key& k, const RunConfig& cfg) {
  RawValue r;
  r.shown = value_literal(k, cfg);
  switch (k.kind) {
    case Kind::Int: r.type = RawValue::Type::Int; r.i = k.ref<int>(cfg); break;
    case Kind::Int64: r.type = RawValue::Type::Int; r.i = k.ref<int64_t>(cfg); break;
    case Kind::Float: r.type = RawValue::Type::Float; r.f = k.ref<double>(cfg); break;
    case Kind::Bool: r.type = RawValue::Type::Bool; r.b = k.ref<bool>(cfg); break;
    case Kind::String: r.type = RawValue::Type::String; r.s = k.ref<std::string>(cfg); break;
    case Kind::LossScale:
      if (k.ref<double>(cfg) == 0) {
        r.type = RawValue::Type::String;
        r.s = "dynamic";
      } else {
        r.type = RawValue::Type::Float;
        r.f = k.ref<double>(cfg);
      }
      break;
    case Kind::OptFloat:
      if (const std::optional<double>& x = k.ref<std::optional<double>>(cfg)) {
        r.type = RawValue::Type::Float;
        r.f = *x;
      } else {
        r.type = RawValue::Type::String;
      }
      break;
    case Kind::OptBool:
      if (const std::optional<bool>& b = k.ref<std::optional<bool>>(cfg)) {
        r.type = RawValue::Type::Bool;
        r.b = *b;
      } else {
        r.type = RawValue::Type::String;
      }
      break;
  }
  return r;
}

RawValue raw_from_toml(const toml::node& node) {
  RawValue r;
  if (auto v = node.as_integer()) {
    r.type = RawValue::Type::Int;
    r.i = v->get();
    r.shown = std::to_string(r.i);
  } else if (auto v = node.as_floating_point()) {
    r.type = RawValue::Type::Float;
    r.f = v->get();
    r.shown = format_double(r.f);
  } else if (auto v = node.as_boolean()) {
    r.type = RawValue::Type::Bool;
    r.b = v->get();
    r.shown = r.b ? "true" : "false";
  } else if (auto v = node.as_string()) {
    r.type = RawValue::Type::String;
    r.s = v->get();
    r.shown = toml_quote(r.s);
  } else if (node.is_array()) {
    r.shown = "an array";
  } else if (node.is_table()) {
    r.shown = "a table";
  } else {
    r.shown = "a date/time";
  }
  return r;
}

bool parse_int(std::string_view text, int64_t* out) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size() && !text.empty();
}

bool parse_float(std::string_view text, double* out) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size() && !text.empty();
}

// --set values are typed by the key: "10" is an integer for train.steps and a
// string for data.train; strings need no quotes (surrounding quotes are removed).
RawValue raw_from_text(const Key& k, std::string text) {
  RawValue r;
  if (text.size() >= 2 && text.front() == '"' && text.back() == '"') text = text.substr(1, text.size() - 2);
  r.shown = toml_quote(text);
  switch (k.kind) {
    case Kind::Int:
    case Kind::Int64:
    case Kind::Float:
    case Kind::LossScale:
    case Kind::OptFloat:
      if (parse_int(text, &r.i)) {
        r.type = RawValue::Type::Int;
        r.shown = text;
      } else if (parse_float(text, &r.f)) {
        r.type = RawValue::Type::Float;
        r.shown = text;
      } else {
        r.type = RawValue::Type::String;
        r.s = text;
      }
      break;
    case Kind::Bool:
    case Kind::OptBool:
      if (text == "true" || text == "false") {
        r.type = RawValue::Type::Bool;
        r.b = text == "true";
        r.shown = text;
      } else {
        r.type = RawValue::Type::String;
        r.s = text;
      }
      break;
    case Kind::String:
      r.type = RawValue::Type::String;
      r.s = text;
      break;
  }
  return r;
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

std::string location(const std::string& source, const toml::node& node) {
  std::ostringstream os;
  os << " (config file '" << source << "'";
  if (node.source().begin.line > 0) os << " line " << node.source().begin.line;
  os << ")";
  return os.str();
}

void apply_toml(RunConfig& cfg, const toml::table& root, const std::string& source) {
  for (auto&& [section_key, section_node] : root) {
    std::string section(section_key.str());
    if (!is_section(section)) {
      if (!section_node.is_table()) {
        // A key outside any section: point at the section it belongs to.
        std::string msg = "key '" + section + "' must be inside a section";
        for (const Key& k : keys())
          if (section == k.name) msg += "; did you mean '" + k.full_name() + "' (under [" + k.section + "])?";
        if (msg.find("did you mean") == std::string::npos)
          msg += " (valid sections: " + join({section_names().begin(), section_names().end()}) + ")";
        LATTICE_FAIL(msg << location(source, section_node));
      }
      LATTICE_FAIL(unknown_section_message(section) << location(source, section_node));
    }
    const toml::table* table = section_node.as_table();
    LATTICE_CHECK(table != nullptr, "'" << section << "' must be a section ([" << section << "]), got "
                                        << raw_from_toml(section_node).shown << location(source, section_node));
    for (auto&& [name_key, value_node] : *table) {
      std::string name(name_key.str());
      const Key* k = find_key(section, name);
      LATTICE_CHECK(k != nullptr, unknown_key_message(section, name) << location(source, value_node));
      assign(*k, cfg, raw_from_toml(value_node), location(source, value_node));
    }
  }
}

// Keys whose feature has not landed: a value other than the default is
// refused by check_landed. Remove a line when its feature lands. A text
// starting with '=' is the whole reason (a key that is not a feature).
const std::vector<std::pair<const char*, const char*>>& pending_keys() {
  static const std::vector<std::pair<const char*, const char*>> pending = {
      {"parallel.microbatches",
       "=the micro-batches of a step (the pipeline's too) are train.grad_accum_steps, one knob rather than two: "
       "set train.grad_accum_steps instead and leave parallel.microbatches at 1"},
  };
  return pending;
}

// ---------------------------------------------------------------- keys of another setting

// A family key's default in the family `family` names, as family_defaults() has it.
const std::string& family_default(const std::string& key, const std::string& family) {
  for (const FamilyDefault& d : family_defaults())
    if (d.key == key) return family == "llama" ? d.llama : d.gpt2;
  LATTICE_FAIL("internal: " << key << " has no family default");
}

// model.position as written, or the family's.
std::string position_of(const ModelSection& m) {
  if (!m.position.empty()) return m.position;
  const std::string& d = family_default("model.position", m.family);
  return d.substr(1, d.size() - 2);  // unquoted
}

const Key& key_named(const std::string& full) {
  const size_t dot = full.find('.');
  const Key* k = dot == std::string::npos ? nullptr : find_key(full.substr(0, dot), full.substr(dot + 1));
  LATTICE_CHECK(k != nullptr, "internal: " << full << " is not in the key table");
  return *k;
}

// A key as a refusal quotes it: name, current value, default (TOML literals).
struct Setting {
  std::string key;
  std::string value;
  std::string fallback;
};

// Keys that apply only under another setting. Where `applies` is false, a key
// of the row set to anything but its default is refused, naming the key, its
// value and what would make it apply: no key is accepted and ignored. The
// common message is
//   KEY=VALUE applies only when WHEN: REASON; FIX, or leave KEY at DEFAULT
// rows whose wording predates the table keep it (`message`), since users and
// tests know it. `when` is also what --help-config and docs/config.md show.
struct ConditionalRow {
  std::vector<const char*> keys;
  const char* when;
  bool (*applies)(const RunConfig&);
  std::string (*reason)(const RunConfig&);  // why the keys do nothing in this config
  const char* fix;                          // what would make them apply; null: nothing to set
  std::string (*message)(const Setting&, const RunConfig&) = nullptr;
};

const std::vector<ConditionalRow>& conditional_rows() {
  static const std::vector<ConditionalRow> rows = {
      {{"model.rope_theta"},
       "model.position is \"rope\" (set, or the family's)",
       [](const RunConfig& c) { return position_of(c.model) == "rope"; },
       nullptr,
       nullptr,
       [](const Setting& s, const RunConfig& c) {
         return s.key + "=" + s.value + " applies to rotary positions, but model.position is \"" +
                position_of(c.model) + "\"" +
                (c.model.position.empty() ? " (model.family = \"" + c.model.family + "\"'s default)" : "") +
                ": set model.position=\"rope\", or leave model.rope_theta unset";
       }},
      {{"parallel.cp_mode"},
       "parallel.cp > 1",
       [](const RunConfig& c) { return c.parallel.cp > 1; },
       nullptr,
       nullptr,
       [](const Setting& s, const RunConfig&) {
         return s.key + "=" + s.value + " applies to context parallelism: set parallel.cp > 1, or leave it at " +
                s.fallback;
       }},
      {{"parallel.sequence_parallel"},
       "parallel.tp > 1",
       [](const RunConfig& c) { return c.parallel.tp > 1; },
       nullptr,
       nullptr,
       [](const Setting&, const RunConfig& c) {
         return "parallel.sequence_parallel=true needs parallel.tp > 1: it splits the sequence over the "
                "tensor-parallel group (parallel.tp=" +
                std::to_string(c.parallel.tp) + ")";
       }},
      // One stage runs 1F1B (F and B per micro-batch, the default) or ZB-H1
      // (the split backward, I then W): no other schedule means anything there.
      {{"parallel.schedule"},
       "parallel.pp > 1 or parallel.schedule = \"zb-h1\"",
       [](const RunConfig& c) { return c.parallel.pp > 1 || c.parallel.schedule == "zb-h1"; },
       nullptr,
       nullptr,
       [](const Setting& s, const RunConfig&) {
         return s.key + "=" + s.value + " applies to pipeline parallelism: set parallel.pp > 1, or leave it at " +
                s.fallback + " (\"zb-h1\" at pp = 1 runs the split backward)";
       }},
      {{"parallel.virtual_stages", "parallel.partition"},
       "parallel.pp > 1",
       [](const RunConfig& c) { return c.parallel.pp > 1; },
       nullptr,
       nullptr,
       [](const Setting& s, const RunConfig&) {
         return s.key + "=" + s.value + " applies to pipeline parallelism: set parallel.pp > 1, or leave it " +
                (s.fallback == "\"\"" ? "empty" : "at " + s.fallback);
       }},
      {{"parallel.virtual_stages"},
       "parallel.schedule is not csv:FILE",
       [](const RunConfig& c) { return c.parallel.schedule.rfind("csv:", 0) != 0; },
       [](const RunConfig& c) {
         return "parallel.schedule=" + toml_quote(c.parallel.schedule) + " gives each rank's chunks itself";
       },
       nullptr},
      {{"zero.offload_dir", "zero.offload_window_mb"},
       "zero.offload = \"disk\"",
       [](const RunConfig& c) { return c.zero.offload == "disk"; },
       [](const RunConfig& c) { return "zero.offload is " + toml_quote(c.zero.offload); },
       "set zero.offload=\"disk\""},
      {{"train.eval_every", "train.eval_steps"},
       "data.val is set or data.train is empty",
       [](const RunConfig& c) { return c.data.train.empty() || !c.data.val.empty(); },
       [](const RunConfig& c) { return "data.train=" + toml_quote(c.data.train) + " has no data.val"; },
       "set data.val"},
      {{"precision.loss_scale", "precision.loss_scale_init", "precision.loss_scale_window",
        "precision.loss_scale_backoff", "precision.loss_scale_growth", "precision.loss_scale_min"},
       "precision.compute = \"f16\"",
       [](const RunConfig& c) { return c.precision.compute == "f16"; },
       nullptr,
       nullptr,
       [](const Setting& s, const RunConfig& c) {
         return s.key + "=" + s.value + ": precision.loss_scale* apply to precision.compute=\"f16\" (it is \"" +
                c.precision.compute + "\"): " +
                (c.precision.compute == "bf16" ? "bf16 has f32's exponent range and needs no loss scale"
                                               : "f32 needs no loss scale");
       }},
      {{"precision.loss_scale_init", "precision.loss_scale_window", "precision.loss_scale_backoff",
        "precision.loss_scale_growth", "precision.loss_scale_min"},
       "precision.loss_scale = \"dynamic\"",
       [](const RunConfig& c) { return c.precision.dynamic_loss_scale(); },
       nullptr,
       nullptr,
       [](const Setting& s, const RunConfig& c) {
         return s.key + "=" + s.value + ": precision.loss_scale=" + format_double(c.precision.loss_scale) +
                " is a static scale: the loss_scale_init/window/backoff/growth/min keys apply to "
                "loss_scale=\"dynamic\"";
       }},
      {{"recompute.every", "recompute.first"},
       "recompute.mode is not \"none\"",
       [](const RunConfig& c) { return c.recompute.mode != "none"; },
       [](const RunConfig&) -> std::string { return "recompute.mode is \"none\", so no layer recomputes"; },
       "set recompute.mode=\"selective\" or \"full\""},
      {{"model.top_k", "model.moe_every", "model.n_shared_experts", "model.moe_ffn_hidden", "moe.aux_loss_coef",
        "moe.z_loss_coef", "moe.bias_update_rate", "moe.capacity_factor", "moe.token_bound", "parallel.ep"},
       "model.n_experts > 0",
       [](const RunConfig& c) { return c.model.n_experts > 0; },
       [](const RunConfig&) -> std::string { return "model.n_experts is 0, so every MLP is dense"; },
       "set model.n_experts (docs/moe.md)"},
      {{"compression.topk_ratio"},
       "compression.grad = \"topk\"",
       [](const RunConfig& c) { return c.compression.grad == "topk"; },
       nullptr,
       nullptr,
       [](const Setting&, const RunConfig& c) {
         return "compression.topk_ratio applies to compression.grad=\"topk\" (it is \"" + c.compression.grad + "\")";
       }},
      {{"compression.rank"},
       "compression.grad = \"powersgd\"",
       [](const RunConfig& c) { return c.compression.grad == "powersgd"; },
       nullptr,
       nullptr,
       [](const Setting&, const RunConfig& c) {
         return "compression.rank applies to compression.grad=\"powersgd\" (it is \"" + c.compression.grad + "\")";
       }},
      {{"compression.error_feedback"},
       "compression.grad is not \"none\"",
       [](const RunConfig& c) { return c.compression.grad != "none"; },
       nullptr,
       nullptr,
       [](const Setting&, const RunConfig&) -> std::string {
         return "compression.error_feedback applies to a compression.grad codec (it is \"none\")";
       }},
      {{"compression.warmup_steps"},
       "compression.grad is not \"none\" or compression.momentum is true",
       [](const RunConfig& c) { return c.compression.grad != "none" || c.compression.momentum; },
       nullptr,
       nullptr,
       [](const Setting&, const RunConfig&) -> std::string {
         return "compression.warmup_steps applies to a compression.grad codec or to compression.momentum (the codec "
                "is \"none\" and momentum is false)";
       }},
      {{"data.val"},
       "data.train is set",
       [](const RunConfig& c) { return !c.data.train.empty(); },
       [](const RunConfig&) -> std::string {
         return "with data.train empty, training and validation both use synthetic tokens";
       },
       "set data.train"},
      {{"checkpoint.every", "checkpoint.keep"},
       "checkpoint.dir is set",
       [](const RunConfig& c) { return !c.checkpoint.dir.empty(); },
       [](const RunConfig&) -> std::string { return "checkpoint.dir is empty, so no checkpoint is written"; },
       "set checkpoint.dir"},
      {{"log.trace_file"},
       "parallel.pp > 1",
       [](const RunConfig& c) { return c.parallel.pp > 1; },
       nullptr,
       nullptr,
       [](const Setting& s, const RunConfig&) {
         return s.key + "=" + s.value + " records the pipeline's timeline: it needs parallel.pp > 1";
       }},
  };
  return rows;
}

std::string conditional_refusal(const ConditionalRow& row, const Setting& s, const RunConfig& cfg) {
  if (row.message) return row.message(s, cfg);
  std::string msg = s.key + "=" + s.value + " applies only when " + row.when + ": " + row.reason(cfg) + "; ";
  if (row.fix) msg += std::string(row.fix) + ", or ";
  return msg + "leave " + s.key + (s.fallback == "\"\"" ? " empty" : " at " + s.fallback);
}

// The one check of the table: the first key set where its row does not apply.
void check_conditional_keys(const RunConfig& cfg) {
  static const RunConfig defaults;
  for (const ConditionalRow& row : conditional_rows()) {
    if (row.applies(cfg)) continue;
    for (const char* name : row.keys) {
      const Key& k = key_named(name);
      const Setting s{name, value_literal(k, cfg), value_literal(k, defaults)};
      LATTICE_CHECK(s.value == s.fallback, conditional_refusal(row, s, cfg));
    }
  }
}

void check_cross_keys(const RunConfig& cfg) {
  LATTICE_CHECK(cfg.model.n_embd % cfg.model.n_head == 0,
                "model.n_embd=" << cfg.model.n_embd << " is not divisible by model.n_head=" << cfg.model.n_head);
  LATTICE_CHECK(cfg.optim.min_lr <= cfg.optim.lr, "optim.min_lr=" << format_double(cfg.optim.min_lr)
                                                                  << " must be <= optim.lr="
                                                                  << format_double(cfg.optim.lr));
  const TrainSection& t = cfg.train;
  if (t.global_batch_size > 0) {
    const int64_t per_pass = static_cast<int64_t>(cfg.parallel.dp) * t.micro_batch_size;
    LATTICE_CHECK(t.global_batch_size % per_pass == 0,
                  "train.global_batch_size=" << t.global_batch_size << " is not divisible by parallel.dp="
                                             << cfg.parallel.dp << " x train.micro_batch_size="
                                             << t.micro_batch_size << " = " << per_pass);
    LATTICE_CHECK(t.grad_accum_steps == 1 || t.grad_accum_steps * per_pass == t.global_batch_size,
                  "train.grad_accum_steps=" << t.grad_accum_steps << " disagrees with train.global_batch_size="
                                            << t.global_batch_size << " (= parallel.dp x train.micro_batch_size x "
                                            << t.global_batch_size / per_pass
                                            << "); set one of them");
  }
  LATTICE_CHECK(cfg.zero.offload != "disk" || !cfg.zero.offload_dir.empty(),
                "zero.offload=disk needs zero.offload_dir (a directory for each rank's offload files)");
  // Whether tensor parallelism can cut the model's heads and MLP columns is
  // model::ModelConfig::check_tensor_parallel's (the trainer runs it on
  // loading); sequence parallelism's cut of the rows is checked below.
  const int tp = cfg.parallel.tp;
  const ModelSection& m = cfg.model;
  {
    const std::string& s = cfg.parallel.schedule;
    LATTICE_CHECK(s == "gpipe" || s == "1f1b" || s == "interleaved" || s == "zb-h1" || s == "zb-v" ||
                      (s.rfind("csv:", 0) == 0 && s.size() > 4),
                  "parallel.schedule=\"" << s << "\" is not a schedule (gpipe, 1f1b, interleaved, zb-h1, zb-v, "
                                                  "or csv:FILE)");
  }
  check_conditional_keys(cfg);
  const PrecisionSection& pr = cfg.precision;
  LATTICE_CHECK(pr.loss_scale_min <= pr.loss_scale_init || !pr.dynamic_loss_scale(),
                "precision.loss_scale_min=" << format_double(pr.loss_scale_min)
                                            << " must be <= precision.loss_scale_init="
                                            << format_double(pr.loss_scale_init));
  const int cp = cfg.parallel.cp;
  // All-to-all context parallelism gives each cp rank whole heads of this
  // tp rank's: its query heads, and its key/value heads (each kept whole on
  // several tp ranks when tp exceeds them, model/parts/attention.h).
  if (cp > 1 && cfg.parallel.cp_mode == "all_to_all" && m.n_head % tp == 0) {
    const int kv = m.n_kv_head > 0 ? m.n_kv_head : m.n_head;
    const int q_here = m.n_head / tp, kv_here = tp <= kv ? kv / tp : 1;
    LATTICE_CHECK(q_here % cp == 0 && kv_here % cp == 0,
                  "parallel.cp_mode=\"all_to_all\" gives each of the parallel.cp="
                      << cp << " ranks whole heads, but each tensor-parallel rank has " << q_here
                      << " query heads (model.n_head=" << m.n_head << " / parallel.tp=" << tp << ") and " << kv_here
                      << " key/value heads (model.n_kv_head=" << kv << "); use parallel.cp_mode=\"ring\", or a "
                      << "parallel.cp dividing both");
  }
  // Context parallelism cuts each sequence into 2·cp chunks (layers/context).
  LATTICE_CHECK(m.seq_len % (2 * cp) == 0, "parallel.cp=" << cp << " cuts each sequence into 2*cp=" << 2 * cp
                                                           << " chunks, but model.seq_len=" << m.seq_len
                                                           << " is not divisible by " << 2 * cp);
  // Mixture of experts (docs/moe.md).
  if (m.n_experts > 0) {
    LATTICE_CHECK(m.n_experts >= 2, "model.n_experts=" << m.n_experts << ": a mixture needs at least 2 experts (0: a "
                                                        << "dense MLP)");
    LATTICE_CHECK(m.top_k <= m.n_experts, "model.top_k=" << m.top_k << " routes each token to more experts than "
                                                          << "model.n_experts=" << m.n_experts << " has; set "
                                                          << "model.top_k <= " << m.n_experts);
    LATTICE_CHECK(m.moe_every <= m.n_layer, "model.moe_every=" << m.moe_every << " makes no layer an MoE layer: layer l "
                                                                << "is one when (l + 1) % moe_every == 0 and "
                                                                << "model.n_layer=" << m.n_layer
                                                                << "; set model.moe_every <= " << m.n_layer);
    const int ep = cfg.parallel.ep;
    LATTICE_CHECK(m.n_experts % ep == 0, "parallel.ep=" << ep << " does not divide model.n_experts=" << m.n_experts
                                                         << ": each expert-parallel rank holds n_experts/ep whole "
                                                         << "experts");
    LATTICE_CHECK((cfg.parallel.dp * cp) % ep == 0,
                  "parallel.ep=" << ep << " does not divide parallel.dp x parallel.cp = " << cfg.parallel.dp * cp
                                 << ": expert-parallel groups are carved from the data- and context-parallel ranks");
    LATTICE_CHECK(cfg.moe.capacity_factor == 0 || (tp == 1 && cp == 1),
                  "moe.capacity_factor=" << format_double(cfg.moe.capacity_factor)
                                         << " drops tokens by each rank's own rows, and parallel.tp=" << tp
                                         << " / parallel.cp=" << cp
                                         << " cut a micro-batch's rows over ranks: which tokens are dropped would "
                                            "depend on the layout; use moe.capacity_factor=0 (dropless) with tp or "
                                            "cp, or tp=1 and cp=1 with a capacity");
    LATTICE_CHECK(cfg.moe.token_bound == 0 || cfg.moe.token_bound >= 1,
                  "moe.token_bound=" << format_double(cfg.moe.token_bound)
                                     << " is below 1: a rank's experts must at least take as many rows as it routes "
                                        "on average; 0 sizes for the worst case");
  }
  // 1-bit Adam (parallel/data/data_parallel.h).
  if (cfg.compression.momentum) {
    LATTICE_CHECK(cfg.compression.warmup_steps >= 1,
                  "compression.momentum=true freezes Adam's second moment after compression.warmup_steps ordinary "
                  "steps, and compression.warmup_steps is 0: set it (1-bit Adam warms up for 15-25% of training)");
    LATTICE_CHECK(cfg.compression.grad != "powersgd",
                  "compression.momentum=true compresses the momentum with a chunk codec (bf16, f16, int8, onebit, "
                  "topk, or none), not compression.grad=\"powersgd\" (which already converges with error feedback "
                  "on the gradient)");
    LATTICE_CHECK(cfg.parallel.zero_stage <= 1,
                  "compression.momentum=true needs each rank's whole gradient, which parallel.zero_stage="
                      << cfg.parallel.zero_stage << " never holds: use zero_stage 0 or 1 (docs/parallel.md, \"1-bit Adam\")");
    LATTICE_CHECK(m.n_experts == 0, "compression.momentum=true is not built for mixture-of-experts models "
                                    "(model.n_experts="
                                        << m.n_experts << "): their experts are reduced by an engine of their own");
  }
  // (recompute.first against each pipeline stage's layers is the trainer's: it knows the partition.)
  LATTICE_CHECK(cfg.recompute.every <= m.n_layer,
                "recompute.every=" << cfg.recompute.every << " names a layer that does not exist: it recomputes layers 0, "
                                   << cfg.recompute.every << ", " << 2 * cfg.recompute.every
                                   << ", ... and model.n_layer=" << m.n_layer << " has layers 0.." << m.n_layer - 1
                                   << "; set recompute.every <= " << m.n_layer);
  if (cfg.parallel.sequence_parallel)
    LATTICE_CHECK((m.seq_len / cp) % tp == 0,
                  "parallel.sequence_parallel=true needs model.seq_len=" << m.seq_len
                      << (cp > 1 ? " / parallel.cp=" + std::to_string(cp) : std::string())
                      << " divisible by parallel.tp=" << tp);
}

}  // namespace

// ---------------------------------------------------------------- API

void apply_override(RunConfig& cfg, const std::string& override_text) {
  size_t eq = override_text.find('=');
  std::string lhs = eq == std::string::npos ? "" : trim(override_text.substr(0, eq));
  size_t dot = lhs.find('.');
  LATTICE_CHECK(eq != std::string::npos && dot != std::string::npos && dot > 0 && dot + 1 < lhs.size(),
                "--set expects section.key=value, got '" << override_text << "'");
  std::string section = lhs.substr(0, dot), name = lhs.substr(dot + 1);
  std::string where = " (from --set " + override_text + ")";
  LATTICE_CHECK(is_section(section), unknown_section_message(section) << where);
  const Key* k = find_key(section, name);
  LATTICE_CHECK(k != nullptr, unknown_key_message(section, name) << where);
  assign(*k, cfg, raw_from_text(*k, override_text.substr(eq + 1)), where);
}

int micro_batches_per_step(const RunConfig& cfg) {
  if (cfg.train.global_batch_size > 0)
    return cfg.train.global_batch_size / (cfg.parallel.dp * cfg.train.micro_batch_size);
  return cfg.train.grad_accum_steps;
}

int64_t global_batch_size(const RunConfig& cfg) {
  return static_cast<int64_t>(cfg.parallel.dp) * cfg.train.micro_batch_size * micro_batches_per_step(cfg);
}

const std::vector<FamilyDefault>& family_defaults() {
  // As model::ModelConfig::defaults has them.
  static const std::vector<FamilyDefault> table = {
      {"model.norm", "\"layernorm\"", "\"rmsnorm\""},
      {"model.mlp", "\"gelu\"", "\"swiglu\""},
      {"model.position", "\"learned\"", "\"rope\""},
      {"model.n_kv_head", "n_head", "n_head"},
      {"model.ffn_hidden", "4 x n_embd", "8 x n_embd / 3 rounded up to a multiple of 256"},
      {"model.rope_theta", "10000.0", "10000.0"},
      {"model.norm_eps", "0.00001", "0.00001"},
      {"model.bias", "true", "false"},
      {"model.tie_embeddings", "true", "false"},
  };
  return table;
}

std::vector<ConditionalKey> conditional_keys() {
  std::vector<ConditionalKey> out;
  for (const ConditionalRow& row : conditional_rows())
    for (const char* name : row.keys) out.push_back({name, row.when});
  return out;
}

void check_landed(const RunConfig& cfg) {
  const RunConfig defaults;
  for (const auto& [name, what] : pending_keys()) {
    const std::string full = name;
    const Key& k = key_named(full);
    const std::string value = value_literal(k, cfg), fallback = value_literal(k, defaults);
    if (what[0] == '=') {
      LATTICE_CHECK(value == fallback, full << "=" << value << ": " << (what + 1));
    } else {
      LATTICE_CHECK(value == fallback,
                    full << "=" << value << ": " << what << " is not implemented yet; set " << full << "=" << fallback);
    }
  }
}

void validate_config(const RunConfig& cfg) {
  RunConfig scratch;
  for (const Key& k : keys()) assign(k, scratch, current_raw(k, cfg), "");
  check_cross_keys(cfg);
}

RunConfig parse_saved_config(const std::string& toml_text, const std::string& source_name) {
  RunConfig cfg;
  toml::table root;
  try {
    root = toml::parse(toml_text, source_name);
  } catch (const toml::parse_error& e) {
    LATTICE_FAIL("config file '" << source_name << "' line " << e.source().begin.line << ": " << e.description());
  }
  apply_toml(cfg, root, source_name);
  return cfg;
}

RunConfig parse_config_text(const std::string& toml_text, const std::string& source_name,
                            const std::vector<std::string>& overrides) {
  RunConfig cfg = parse_saved_config(toml_text, source_name);
  for (const std::string& o : overrides) apply_override(cfg, o);
  check_cross_keys(cfg);
  return cfg;
}

RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::string text;
  if (!path.empty()) text = read_whole_file(path, "config file");
  return parse_config_text(text, path.empty() ? "<defaults>" : path, overrides);
}

std::string config_to_toml(const RunConfig& cfg) {
  std::string out;
  for (const char* section : section_names()) {
    if (!out.empty()) out += "\n";
    out += '[';
    out += section;
    out += "]\n";
    for (const Key& k : keys())
      if (std::string_view(section) == k.section) out += std::string(k.name) + " = " + value_literal(k, cfg) + "\n";
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> config_items(const RunConfig& cfg) {
  std::vector<std::pair<std::string, std::string>> items;
  for (const char* section : section_names())
    for (const Key& k : keys())
      if (std::string_view(section) == k.section) items.emplace_back(k.full_name(), value_literal(k, cfg));
  return items;
}

std::string config_help() {
  RunConfig defaults;
  std::ostringstream os;
  os << "Config keys (TOML sections; override any with --set section.key=value):\n";
  for (const char* section : section_names()) {
    os << "\n[" << section << "]\n";
    for (const Key& k : keys()) {
      if (std::string_view(section) != k.section) continue;
      std::string value = value_literal(k, defaults);
      if (k.by_family) {
        const std::string &gpt2 = family_default(k.full_name(), "gpt2"),
                          &llama = family_default(k.full_name(), "llama");
        value = gpt2 == llama ? gpt2 : "gpt2 " + gpt2 + ", llama " + llama;
      }
      const std::string lhs = std::string(k.name) + " = " + value;
      // At least two spaces before the meaning (tools/config_tables.py splits there).
      const std::string buf = "  " + lhs + std::string(lhs.size() < 32 ? 33 - lhs.size() : 2, ' ');
      std::string when;
      for (const ConditionalRow& row : conditional_rows())
        for (const char* name : row.keys)
          if (k.full_name() == name) when += (when.empty() ? " (applies only when " : ", and when ") + std::string(row.when);
      if (!when.empty()) when += ")";
      const char* pending = "";
      for (const auto& [name, what] : pending_keys())
        if (k.full_name() == name)
          pending = what[0] == '=' ? " (only the default is accepted)"
                                   : " (not implemented yet: only the default is accepted)";
      os << buf << k.help << when << pending << " [" << describe(k) << "]\n";
    }
  }
  return os.str();
}

}  // namespace lattice::io
