#include "lattice/train/hf_config.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "lattice/core/error.h"
#include "lattice/io/file_util.h"

namespace lattice::train {

using io::JsonValue;
using model::Family;
using model::ModelConfig;

namespace {

// The shortest decimal that reads back as the same float, as a JSON number
// in Python's spelling (1e-05, 500000.0, 123456.7): written from the float,
// not from its double widening (9.999999747378752e-06), so HF and a reader
// see the value that was set. Python writes positional notation for decimal
// exponents -4 to 15, with a ".0" on integral values so they read as floats.
JsonValue float_number(float x) {
  char text[48];
  int digits = 1;
  for (; digits < 9; digits++) {
    std::snprintf(text, sizeof text, "%.*e", digits - 1, static_cast<double>(x));
    if (std::strtof(text, nullptr) == x) break;
  }
  std::snprintf(text, sizeof text, "%.*e", digits - 1, static_cast<double>(x));
  const int exponent = std::atoi(std::strchr(text, 'e') + 1);
  std::string s;
  if (x == 0.0f) {
    s = "0.0";
  } else if (exponent >= -4 && exponent < 16) {
    std::snprintf(text, sizeof text, "%.*f", std::max(0, digits - 1 - exponent), static_cast<double>(x));
    s = text;
    if (s.find('.') == std::string::npos) s += ".0";
  } else {
    std::snprintf(text, sizeof text, "%.*g", digits, static_cast<double>(x));
    s = text;
  }
  return JsonValue::number_with_text(std::strtod(s.c_str(), nullptr), s);
}

// A float as written in the file: strtof of the literal, so "1e-05" is the
// float nearest 1e-5 (not the float nearest the double nearest it).
float float_of(const JsonValue& v, const std::string& key, const std::string& source) {
  LATTICE_CHECK(v.is_number(), source << ": " << key << " must be a number, got " << io::to_json(v));
  return std::strtof(v.number_text().c_str(), nullptr);
}

int int_of(const JsonValue& v, const std::string& key, const std::string& source) {
  int64_t i = 0;
  LATTICE_CHECK(v.is_number() && v.get_i64(&i) && i >= 0 && i <= std::numeric_limits<int>::max(),
                source << ": " << key << " must be a non-negative integer, got " << io::to_json(v));
  return static_cast<int>(i);
}

bool bool_of(const JsonValue& v, const std::string& key, const std::string& source) {
  LATTICE_CHECK(v.is_bool(), source << ": " << key << " must be true or false, got " << io::to_json(v));
  return v.as_bool();
}

const std::string& string_of(const JsonValue& v, const std::string& key, const std::string& source) {
  LATTICE_CHECK(v.is_string(), source << ": " << key << " must be a string, got " << io::to_json(v));
  return v.as_string();
}

const JsonValue& required(const JsonValue& obj, const std::string& key, const std::string& prefix,
                          const std::string& source) {
  const JsonValue* v = obj.find(key);
  LATTICE_CHECK(v && !v->is_null(), source << ": missing key '" << prefix << key << "'");
  return *v;
}

// Present and not null.
const JsonValue* optional(const JsonValue& obj, const std::string& key) {
  const JsonValue* v = obj.find(key);
  return v && !v->is_null() ? v : nullptr;
}

JsonValue sorted(const JsonValue& obj) {
  std::vector<JsonValue::Member> members = obj.as_object();
  std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  JsonValue out = JsonValue::object();
  for (auto& [k, v] : members) out.set(k, v);
  return out;
}

// Every key of the model section, in its order (io/config.h).
JsonValue lattice_object(const ModelConfig& c) {
  JsonValue o = JsonValue::object();
  o.set("family", JsonValue::string(model::name_of(c.family)));
  o.set("n_layer", JsonValue::integer(c.n_layer));
  o.set("n_head", JsonValue::integer(c.n_head));
  o.set("n_embd", JsonValue::integer(c.n_embd));
  o.set("vocab_size", JsonValue::integer(c.vocab_size));
  o.set("seq_len", JsonValue::integer(c.seq_len));
  o.set("norm", JsonValue::string(model::name_of(c.norm)));
  o.set("mlp", JsonValue::string(model::name_of(c.mlp)));
  o.set("position", JsonValue::string(model::name_of(c.position)));
  o.set("n_kv_head", JsonValue::integer(c.n_kv_head));
  o.set("ffn_hidden", JsonValue::integer(c.ffn_hidden));
  o.set("rope_theta", float_number(c.rope_theta));
  o.set("norm_eps", float_number(c.norm_eps));
  o.set("bias", JsonValue::boolean(c.bias));
  o.set("tie_embeddings", JsonValue::boolean(c.tie_embeddings));
  if (c.n_experts > 0) {
    o.set("n_experts", JsonValue::integer(c.n_experts));
    o.set("top_k", JsonValue::integer(c.top_k));
    o.set("moe_every", JsonValue::integer(c.moe_every));
    o.set("n_shared_experts", JsonValue::integer(c.n_shared_experts));
    o.set("moe_ffn_hidden", JsonValue::integer(c.moe_ffn()));
  }
  return o;
}

ModelConfig from_lattice_object(const JsonValue& o, const std::string& source) {
  LATTICE_CHECK(o.is_object(), source << ": \"lattice\" must be an object, got " << io::to_json(o));
  const std::string p = "lattice.";
  for (const JsonValue::Member& m : o.as_object()) {
    static const char* const kKeys[] = {"family",     "n_layer",    "n_head",   "n_embd",   "vocab_size",
                                        "seq_len",    "norm",       "mlp",      "position", "n_kv_head",
                                        "ffn_hidden", "rope_theta", "norm_eps", "bias",     "tie_embeddings",
                                        "n_experts",  "top_k",      "moe_every", "n_shared_experts", "moe_ffn_hidden"};
    LATTICE_CHECK(std::find_if(std::begin(kKeys), std::end(kKeys), [&](const char* k) { return m.first == k; }) !=
                      std::end(kKeys),
                  source << ": unknown key '" << p << m.first
                         << "' (written by a newer lattice? this one knows the model keys of docs/config.md)");
  }
  const std::string family_key = p + "family";
  ModelConfig c = ModelConfig::defaults(
      model::parse_family(string_of(required(o, "family", p, source), family_key, source), family_key.c_str()));
  c.n_layer = int_of(required(o, "n_layer", p, source), p + "n_layer", source);
  c.n_head = int_of(required(o, "n_head", p, source), p + "n_head", source);
  c.n_embd = int_of(required(o, "n_embd", p, source), p + "n_embd", source);
  c.vocab_size = int_of(required(o, "vocab_size", p, source), p + "vocab_size", source);
  c.seq_len = int_of(required(o, "seq_len", p, source), p + "seq_len", source);
  // The part keys: the family's defaults when absent.
  if (const JsonValue* v = optional(o, "norm"))
    c.norm = model::parse_norm(string_of(*v, p + "norm", source), "lattice.norm");
  if (const JsonValue* v = optional(o, "mlp"))
    c.mlp = model::parse_mlp(string_of(*v, p + "mlp", source), "lattice.mlp");
  if (const JsonValue* v = optional(o, "position"))
    c.position = model::parse_position(string_of(*v, p + "position", source), "lattice.position");
  if (const JsonValue* v = optional(o, "n_kv_head")) c.n_kv_head = int_of(*v, p + "n_kv_head", source);
  if (const JsonValue* v = optional(o, "ffn_hidden")) c.ffn_hidden = int_of(*v, p + "ffn_hidden", source);
  if (const JsonValue* v = optional(o, "rope_theta")) c.rope_theta = float_of(*v, p + "rope_theta", source);
  if (const JsonValue* v = optional(o, "norm_eps")) c.norm_eps = float_of(*v, p + "norm_eps", source);
  if (const JsonValue* v = optional(o, "bias")) c.bias = bool_of(*v, p + "bias", source);
  if (const JsonValue* v = optional(o, "tie_embeddings")) c.tie_embeddings = bool_of(*v, p + "tie_embeddings", source);
  if (const JsonValue* v = optional(o, "n_experts")) c.n_experts = int_of(*v, p + "n_experts", source);
  if (const JsonValue* v = optional(o, "top_k")) c.top_k = int_of(*v, p + "top_k", source);
  if (const JsonValue* v = optional(o, "moe_every")) c.moe_every = int_of(*v, p + "moe_every", source);
  if (const JsonValue* v = optional(o, "n_shared_experts")) c.n_shared_experts = int_of(*v, p + "n_shared_experts", source);
  if (const JsonValue* v = optional(o, "moe_ffn_hidden")) c.moe_ffn_hidden = int_of(*v, p + "moe_ffn_hidden", source);
  return c;
}

// rope_scaling / rope_parameters: absent, null, or the plain rotation.
// transformers >= 4.56 writes {"rope_type": "default", "rope_theta": ...} as
// rope_parameters; returns its rope_theta if it has one.
const JsonValue* check_rope_scaling(const JsonValue& json, const char* key, const std::string& source) {
  const JsonValue* v = optional(json, key);
  if (!v) return nullptr;
  const JsonValue* type = v->is_object() ? v->find("rope_type") : nullptr;
  if (v->is_object() && !type) type = v->find("type");
  LATTICE_CHECK(type && type->is_string() && type->as_string() == "default",
                source << ": " << key << " = " << io::to_json(*v)
                       << " is not supported: lattice's RoPE is the plain rotation (rope_scaling null, or rope_type "
                          "\"default\")");
  return v->find("rope_theta");
}

ModelConfig from_llama_keys(const JsonValue& j, const std::string& s) {
  ModelConfig c = ModelConfig::defaults(Family::Llama);
  c.n_embd = int_of(required(j, "hidden_size", "", s), "hidden_size", s);
  c.n_layer = int_of(required(j, "num_hidden_layers", "", s), "num_hidden_layers", s);
  c.n_head = int_of(required(j, "num_attention_heads", "", s), "num_attention_heads", s);
  c.vocab_size = int_of(required(j, "vocab_size", "", s), "vocab_size", s);
  c.ffn_hidden = int_of(required(j, "intermediate_size", "", s), "intermediate_size", s);
  // LlamaConfig's defaults for the rest.
  c.n_kv_head = c.n_head;
  if (const JsonValue* v = optional(j, "num_key_value_heads")) c.n_kv_head = int_of(*v, "num_key_value_heads", s);
  c.seq_len = 2048;
  if (const JsonValue* v = optional(j, "max_position_embeddings")) c.seq_len = int_of(*v, "max_position_embeddings", s);
  c.norm_eps = 1e-6f;
  if (const JsonValue* v = optional(j, "rms_norm_eps")) c.norm_eps = float_of(*v, "rms_norm_eps", s);
  c.rope_theta = 10000.0f;
  if (const JsonValue* v = optional(j, "rope_theta")) c.rope_theta = float_of(*v, "rope_theta", s);
  check_rope_scaling(j, "rope_scaling", s);
  if (const JsonValue* theta = check_rope_scaling(j, "rope_parameters", s))
    c.rope_theta = float_of(*theta, "rope_parameters.rope_theta", s);
  if (const JsonValue* v = optional(j, "hidden_act")) {
    const std::string& act = string_of(*v, "hidden_act", s);
    LATTICE_CHECK(act == "silu", s << ": hidden_act = \"" << act
                                   << "\" is not supported: lattice's Llama MLP is SwiGLU, hidden_act \"silu\"");
  }
  c.tie_embeddings = false;
  if (const JsonValue* v = optional(j, "tie_word_embeddings")) c.tie_embeddings = bool_of(*v, "tie_word_embeddings", s);
  c.bias = false;
  if (const JsonValue* v = optional(j, "attention_bias")) c.bias = bool_of(*v, "attention_bias", s);
  if (const JsonValue* v = optional(j, "mlp_bias")) {
    const bool mlp_bias = bool_of(*v, "mlp_bias", s);
    LATTICE_CHECK(mlp_bias == c.bias, s << ": attention_bias=" << (c.bias ? "true" : "false")
                                        << " but mlp_bias=" << (mlp_bias ? "true" : "false")
                                        << ": lattice's model.bias gives every Linear a bias or none");
  }
  if (const JsonValue* v = optional(j, "head_dim")) {
    const int head_dim = int_of(*v, "head_dim", s);
    LATTICE_CHECK(c.n_head > 0 && head_dim * c.n_head == c.n_embd,
                  s << ": head_dim=" << head_dim << " but hidden_size=" << c.n_embd
                    << " / num_attention_heads=" << c.n_head << " = " << (c.n_head > 0 ? c.n_embd / c.n_head : 0)
                    << ": lattice's head size is model.n_embd / model.n_head");
  }
  return c;
}

ModelConfig from_gpt2_keys(const JsonValue& j, const std::string& s) {
  ModelConfig c = ModelConfig::defaults(Family::GPT2);
  c.n_embd = int_of(required(j, "n_embd", "", s), "n_embd", s);
  c.n_layer = int_of(required(j, "n_layer", "", s), "n_layer", s);
  c.n_head = int_of(required(j, "n_head", "", s), "n_head", s);
  c.vocab_size = int_of(required(j, "vocab_size", "", s), "vocab_size", s);
  // GPT2Config's defaults for the rest.
  c.seq_len = 1024;
  if (const JsonValue* v = optional(j, "n_positions")) c.seq_len = int_of(*v, "n_positions", s);
  if (const JsonValue* v = optional(j, "n_inner")) c.ffn_hidden = int_of(*v, "n_inner", s);
  if (const JsonValue* v = optional(j, "layer_norm_epsilon")) c.norm_eps = float_of(*v, "layer_norm_epsilon", s);
  if (const JsonValue* v = optional(j, "tie_word_embeddings")) c.tie_embeddings = bool_of(*v, "tie_word_embeddings", s);
  if (const JsonValue* v = optional(j, "activation_function")) {
    const std::string& act = string_of(*v, "activation_function", s);
    LATTICE_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh",
                  s << ": activation_function = \"" << act
                    << "\" is not supported: lattice's GELU is the tanh approximation (\"gelu_new\")");
  }
  if (const JsonValue* v = optional(j, "scale_attn_weights"))
    LATTICE_CHECK(bool_of(*v, "scale_attn_weights", s),
                  s << ": scale_attn_weights=false is not supported (lattice scales scores by 1/sqrt(head size))");
  for (const char* key : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"})
    if (const JsonValue* v = optional(j, key))
      LATTICE_CHECK(!bool_of(*v, key, s), s << ": " << key << "=true is not supported");
  return c;
}

// The HF keys a family's class reads, for a model of that family (those of
// its parts that class does not have are left out).
void set_hf_keys(JsonValue& o, const ModelConfig& c) {
  const JsonValue tie = JsonValue::boolean(c.tie_embeddings);
  o.set("vocab_size", JsonValue::integer(c.vocab_size));
  o.set("tie_word_embeddings", tie);
  o.set("torch_dtype", JsonValue::string("float32"));
  if (c.family == Family::Llama) {
    o.set("hidden_size", JsonValue::integer(c.n_embd));
    o.set("intermediate_size", JsonValue::integer(c.ffn()));
    o.set("num_hidden_layers", JsonValue::integer(c.n_layer));
    o.set("num_attention_heads", JsonValue::integer(c.n_head));
    o.set("num_key_value_heads", JsonValue::integer(c.kv_heads()));
    o.set("head_dim", JsonValue::integer(c.head_size()));
    o.set("max_position_embeddings", JsonValue::integer(c.seq_len));
    o.set("attention_bias", JsonValue::boolean(c.bias));
    o.set("mlp_bias", JsonValue::boolean(c.bias));
    if (c.norm == model::NormKind::RMSNorm) o.set("rms_norm_eps", float_number(c.norm_eps));
    if (c.position == model::PositionKind::Rope) {
      o.set("rope_theta", float_number(c.rope_theta));
      o.set("rope_scaling", JsonValue::null());
    }
    if (c.mlp == model::MlpKind::SwiGLU) o.set("hidden_act", JsonValue::string("silu"));
  } else {
    o.set("n_embd", JsonValue::integer(c.n_embd));
    o.set("n_head", JsonValue::integer(c.n_head));
    o.set("n_layer", JsonValue::integer(c.n_layer));
    o.set("n_positions", JsonValue::integer(c.seq_len));
    o.set("n_ctx", JsonValue::integer(c.seq_len));
    o.set("n_inner", c.ffn_hidden > 0 ? JsonValue::integer(c.ffn_hidden) : JsonValue::null());
    if (c.norm == model::NormKind::LayerNorm) o.set("layer_norm_epsilon", float_number(c.norm_eps));
    o.set("activation_function", JsonValue::string("gelu_new"));
  }
}

std::string quoted(const std::string& s) { return "\"" + s + "\""; }
std::string text_of(bool b) { return b ? "true" : "false"; }
std::string text_of(float x) { return float_number(x).number_text(); }

}  // namespace

bool hf_class_computes(const ModelConfig& c) {
  // Experts: HF's Mixtral when every layer is a plain top-k mixture of SwiGLU experts
  // (Mixtral renormalises its top-k weights as lattice does for top_k >= 2).
  if (c.n_experts > 0)
    return c.family == Family::Llama && c.moe_every == 1 && c.n_shared_experts == 0 && c.top_k >= 2 && !c.bias &&
           c.norm == model::NormKind::RMSNorm && c.mlp == model::MlpKind::SwiGLU &&
           c.position == model::PositionKind::Rope;
  if (c.family == Family::Llama)
    return c.norm == model::NormKind::RMSNorm && c.mlp == model::MlpKind::SwiGLU &&
           c.position == model::PositionKind::Rope;
  return c.norm == model::NormKind::LayerNorm && c.mlp == model::MlpKind::GELU &&
         c.position == model::PositionKind::Learned && c.bias && c.kv_heads() == c.n_head;
}

std::string hf_config_json(const ModelConfig& c, bool selection_bias) {
  JsonValue o = JsonValue::object();
  set_hf_keys(o, c);
  // (Mixtral has no selection bias: with one, its routing would differ.)
  if (hf_class_computes(c) && !(c.n_experts > 0 && selection_bias)) {
    const bool llama = c.family == Family::Llama;
    const bool mixtral = c.n_experts > 0;
    o.set("architectures", JsonValue::array().push_back(JsonValue::string(
                               mixtral ? "MixtralForCausalLM" : llama ? "LlamaForCausalLM" : "GPT2LMHeadModel")));
    o.set("model_type", JsonValue::string(mixtral ? "mixtral" : llama ? "llama" : "gpt2"));
    if (mixtral) {
      o.set("num_local_experts", JsonValue::integer(c.n_experts));
      o.set("num_experts_per_tok", JsonValue::integer(c.top_k));
      o.set("intermediate_size", JsonValue::integer(c.moe_ffn()));
    }
  }
  o = sorted(o);
  o.set("lattice", lattice_object(c));
  return io::to_json(o, 2) + "\n";
}

ModelConfig model_config_from_hf(const JsonValue& json, const std::string& source) {
  LATTICE_CHECK(json.is_object(), source << ": a config.json must hold a JSON object");
  ModelConfig c;
  if (const JsonValue* lattice = json.find("lattice")) {
    c = from_lattice_object(*lattice, source);
  } else {
    const JsonValue* type = json.find("model_type");
    LATTICE_CHECK(type, source << ": no model_type (and no \"lattice\" object): lattice reads model_type \"llama\" "
                                  "or \"gpt2\"");
    const std::string& t = string_of(*type, "model_type", source);
    LATTICE_CHECK(t == "llama" || t == "gpt2" || t == "mixtral",
                  source << ": model_type = \"" << t
                         << "\" is not a model lattice can load (\"llama\", \"mixtral\" or \"gpt2\")");
    c = t == "gpt2" ? from_gpt2_keys(json, source) : from_llama_keys(json, source);
    if (t == "mixtral") {
      // HF's Mixtral: a Llama whose every MLP is num_local_experts SwiGLU experts
      // of intermediate_size, top num_experts_per_tok, weights renormalised (docs/moe.md).
      c.n_experts = int_of(required(json, "num_local_experts", "", source), "num_local_experts", source);
      c.top_k = 2;
      if (const JsonValue* v = optional(json, "num_experts_per_tok")) c.top_k = int_of(*v, "num_experts_per_tok", source);
      c.moe_ffn_hidden = c.ffn_hidden;
    }
  }
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(source + ": the model it describes is refused: " + e.what());
  }
  return c;
}

ModelConfig read_hf_config(const std::string& path) {
  const std::string source = "config.json '" + path + "'";
  return model_config_from_hf(io::parse_json(io::read_whole_file(path, "config.json"), source), source);
}

std::vector<std::string> model_config_differences(const JsonValue& json, const ModelConfig& file,
                                                  const ModelConfig& run) {
  const bool own = json.find("lattice") != nullptr;
  const bool llama = file.family == Family::Llama;
  // The file's name for a key: its lattice object's, or the HF key that gave
  // it, or (a part an HF class fixes) model_type with what it implies.
  auto key = [&](const char* lattice_key, const char* llama_key, const char* gpt2_key) -> std::string {
    if (own) return std::string("lattice.") + lattice_key;
    const char* k = llama ? llama_key : gpt2_key;
    if (k) return k;
    return std::string("model_type=") + quoted(llama ? "llama" : "gpt2") + " (" + lattice_key + ")";
  };
  std::vector<std::string> out;
  auto differ = [&](const std::string& file_key, const std::string& file_value, const char* run_key,
                    const std::string& run_value) {
    if (file_value == run_value) return;
    // A key the file spells through model_type reads "model_type="llama" (norm) = "rmsnorm"".
    const std::string sep = file_key.back() == ')' ? " = " : "=";
    out.push_back(file_key + sep + file_value + " but model." + run_key + "=" + run_value);
  };
  auto ints = [&](const char* lk, const char* llama_key, const char* gpt2_key, int a, int b) {
    differ(key(lk, llama_key, gpt2_key), std::to_string(a), lk, std::to_string(b));
  };
  differ(own ? "lattice.family" : "model_type", quoted(model::name_of(file.family)), "family",
         quoted(model::name_of(run.family)));
  ints("n_layer", "num_hidden_layers", "n_layer", file.n_layer, run.n_layer);
  ints("n_head", "num_attention_heads", "n_head", file.n_head, run.n_head);
  ints("n_embd", "hidden_size", "n_embd", file.n_embd, run.n_embd);
  ints("vocab_size", "vocab_size", "vocab_size", file.vocab_size, run.vocab_size);
  // Not the context: a learned position table is checked by its shape (a
  // longer one is used in part), rotary positions have none.
  differ(key("norm", nullptr, nullptr), quoted(model::name_of(file.norm)), "norm", quoted(model::name_of(run.norm)));
  differ(key("mlp", "hidden_act", nullptr), quoted(model::name_of(file.mlp)), "mlp", quoted(model::name_of(run.mlp)));
  differ(key("position", nullptr, nullptr), quoted(model::name_of(file.position)), "position",
         quoted(model::name_of(run.position)));
  // Both left at 0 ("the default"), these follow n_head and n_embd, already compared.
  if (file.n_kv_head != 0 || run.n_kv_head != 0)
    ints("n_kv_head", "num_key_value_heads", "n_head", file.kv_heads(), run.kv_heads());
  if (file.ffn_hidden != 0 || run.ffn_hidden != 0)
    ints("ffn_hidden", "intermediate_size", "n_inner", file.ffn(), run.ffn());
  if (file.position == model::PositionKind::Rope && run.position == model::PositionKind::Rope)
    differ(key("rope_theta", "rope_theta", nullptr), text_of(file.rope_theta), "rope_theta", text_of(run.rope_theta));
  differ(key("norm_eps", "rms_norm_eps", "layer_norm_epsilon"), text_of(file.norm_eps), "norm_eps",
         text_of(run.norm_eps));
  differ(key("bias", "attention_bias", nullptr), text_of(file.bias), "bias", text_of(run.bias));
  differ(key("tie_embeddings", "tie_word_embeddings", "tie_word_embeddings"), text_of(file.tie_embeddings),
         "tie_embeddings", text_of(run.tie_embeddings));
  return out;
}

}  // namespace lattice::train
