// Checkpoints as Hugging Face model directories: config.json (train/hf_config.h)
// for both families and mixed parts, its round trip, the refusals of
// config.json and of model files that do not fit the run, and Hugging Face
// Llama files (vocab_size rows, bf16) loading into lattice.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "lattice/core/dtype.h"
#include "lattice/core/error.h"
#include "lattice/io/checkpoint.h"
#include "lattice/io/config.h"
#include "lattice/io/file_util.h"
#include "lattice/io/json.h"
#include "lattice/io/safetensors.h"
#include "lattice/train/checkpointing.h"
#include "lattice/train/hf_config.h"
#include "lattice/train/model_io.h"
#include "lattice/train/trainer.h"

using namespace lattice;
namespace fs = std::filesystem;
using model::Family;
using model::ModelConfig;

namespace {

fs::path scratch(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("lattice_hf_test_" + std::to_string(::getpid())) / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

#define EXPECT_HAS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

io::JsonValue parsed(const std::string& text) { return io::parse_json(text, "test config.json"); }

std::string number_text(const io::JsonValue& o, const char* key) { return o.at(key).number_text(); }
int64_t int_at(const io::JsonValue& o, const char* key) {
  int64_t v = -1;
  EXPECT_TRUE(o.at(key).get_i64(&v)) << key;
  return v;
}

// Every field, exactly.
void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.family, b.family);
  EXPECT_EQ(a.n_layer, b.n_layer);
  EXPECT_EQ(a.n_head, b.n_head);
  EXPECT_EQ(a.n_embd, b.n_embd);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.seq_len, b.seq_len);
  EXPECT_EQ(a.norm, b.norm);
  EXPECT_EQ(a.mlp, b.mlp);
  EXPECT_EQ(a.position, b.position);
  EXPECT_EQ(a.n_kv_head, b.n_kv_head);
  EXPECT_EQ(a.ffn_hidden, b.ffn_hidden);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.bias, b.bias);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
}

// The same model by what it computes (an HF config spells n_kv_head and the
// MLP width out where lattice may leave them 0 for "the default").
void expect_same_model(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.family, b.family);
  EXPECT_EQ(a.n_layer, b.n_layer);
  EXPECT_EQ(a.n_head, b.n_head);
  EXPECT_EQ(a.n_embd, b.n_embd);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.seq_len, b.seq_len);
  EXPECT_EQ(a.norm, b.norm);
  EXPECT_EQ(a.mlp, b.mlp);
  EXPECT_EQ(a.position, b.position);
  EXPECT_EQ(a.kv_heads(), b.kv_heads());
  EXPECT_EQ(a.ffn(), b.ffn());
  if (a.position == model::PositionKind::Rope) {
    EXPECT_EQ(a.rope_theta, b.rope_theta);
  }
  EXPECT_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.bias, b.bias);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
}

// A Llama 3.2 1B shape (with a vocabulary lattice's uint16 shards hold).
ModelConfig llama_1b() {
  ModelConfig c = ModelConfig::defaults(Family::Llama);
  c.n_layer = 16;
  c.n_head = 32;
  c.n_kv_head = 8;
  c.n_embd = 2048;
  c.ffn_hidden = 8192;
  c.vocab_size = 50257;
  c.seq_len = 2048;
  c.rope_theta = 500000.0f;
  c.norm_eps = 1e-5f;
  c.tie_embeddings = true;
  return c;
}

// Parts no single HF class computes.
ModelConfig llama_with_gpt2_parts() {
  ModelConfig c = ModelConfig::defaults(Family::Llama);
  c.n_layer = 3;
  c.n_head = 4;
  c.n_embd = 64;
  c.vocab_size = 300;
  c.seq_len = 32;
  c.norm = model::NormKind::LayerNorm;
  c.mlp = model::MlpKind::GELU;
  c.position = model::PositionKind::Learned;
  c.bias = true;
  c.norm_eps = 3.3e-7f;
  return c;
}

ModelConfig gpt2_with_llama_parts() {
  ModelConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 64;
  c.vocab_size = 300;
  c.seq_len = 32;
  c.norm = model::NormKind::RMSNorm;
  c.position = model::PositionKind::Rope;
  c.rope_theta = 123456.7f;
  c.norm_eps = 1e-6f;
  c.bias = false;
  c.tie_embeddings = false;
  c.ffn_hidden = 96;
  return c;
}

// The object without its "lattice" member: what transformers itself would write.
io::JsonValue hf_keys_only(const io::JsonValue& o) {
  io::JsonValue out = io::JsonValue::object();
  for (const auto& [k, v] : o.as_object())
    if (k != "lattice") out.set(k, v);
  return out;
}

void write_text(const fs::path& path, const std::string& text) { io::write_file_atomic(path.string(), text); }

}  // namespace

// ---------------------------------------------------------------- config.json

TEST(HfConfig, Gpt2_124MHasGpt2LMHeadModelKeys) {
  const ModelConfig c;  // GPT-2 124M
  const io::JsonValue j = parsed(train::hf_config_json(c));
  ASSERT_TRUE(j.at("architectures").is_array());
  ASSERT_EQ(j.at("architectures").size(), 1u);
  EXPECT_EQ(j.at("architectures").as_array()[0].as_string(), "GPT2LMHeadModel");
  EXPECT_EQ(j.at("model_type").as_string(), "gpt2");
  EXPECT_EQ(int_at(j, "n_embd"), 768);
  EXPECT_EQ(int_at(j, "n_head"), 12);
  EXPECT_EQ(int_at(j, "n_layer"), 12);
  EXPECT_EQ(int_at(j, "n_positions"), 1024);
  EXPECT_EQ(int_at(j, "n_ctx"), 1024);
  EXPECT_EQ(int_at(j, "vocab_size"), 50257);  // not the padded 50304
  EXPECT_EQ(number_text(j, "layer_norm_epsilon"), "1e-05");
  EXPECT_EQ(j.at("activation_function").as_string(), "gelu_new");
  EXPECT_TRUE(j.at("n_inner").is_null());
  EXPECT_TRUE(j.at("tie_word_embeddings").as_bool());
  EXPECT_EQ(j.at("torch_dtype").as_string(), "float32");
  EXPECT_EQ(j.at("lattice").at("family").as_string(), "gpt2");
  // Keys sorted, as transformers writes them; the lattice object last.
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.as_object()) keys.push_back(k);
  EXPECT_EQ(keys.back(), "lattice");
  keys.pop_back();
  EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
}

TEST(HfConfig, LlamaHasLlamaForCausalLMKeys) {
  const ModelConfig c = llama_1b();
  const io::JsonValue j = parsed(train::hf_config_json(c));
  EXPECT_EQ(j.at("architectures").as_array().at(0).as_string(), "LlamaForCausalLM");
  EXPECT_EQ(j.at("model_type").as_string(), "llama");
  EXPECT_EQ(int_at(j, "hidden_size"), 2048);
  EXPECT_EQ(int_at(j, "intermediate_size"), 8192);
  EXPECT_EQ(int_at(j, "num_hidden_layers"), 16);
  EXPECT_EQ(int_at(j, "num_attention_heads"), 32);
  EXPECT_EQ(int_at(j, "num_key_value_heads"), 8);
  EXPECT_EQ(int_at(j, "head_dim"), 64);
  EXPECT_EQ(int_at(j, "max_position_embeddings"), 2048);
  EXPECT_EQ(int_at(j, "vocab_size"), 50257);
  EXPECT_EQ(number_text(j, "rms_norm_eps"), "1e-05");
  EXPECT_EQ(number_text(j, "rope_theta"), "500000.0");  // a float, as Python writes it
  EXPECT_TRUE(j.at("rope_scaling").is_null());
  EXPECT_TRUE(j.at("tie_word_embeddings").as_bool());
  EXPECT_FALSE(j.at("attention_bias").as_bool());
  EXPECT_FALSE(j.at("mlp_bias").as_bool());
  EXPECT_EQ(j.at("hidden_act").as_string(), "silu");
  EXPECT_EQ(j.at("torch_dtype").as_string(), "float32");

  // The defaults: n_kv_head 0 and ffn_hidden 0 are written out as HF needs them.
  ModelConfig d = ModelConfig::defaults(Family::Llama);
  d.n_embd = 768;
  d.n_head = 12;
  const io::JsonValue k = parsed(train::hf_config_json(d));
  EXPECT_EQ(int_at(k, "num_key_value_heads"), 12);
  EXPECT_EQ(int_at(k, "intermediate_size"), 2048);  // 8·768/3 rounded up to 256
  EXPECT_FALSE(k.at("tie_word_embeddings").as_bool());
  EXPECT_EQ(int_at(k.at("lattice"), "n_kv_head"), 0);  // lattice's own object keeps what was set
}

TEST(HfConfig, MixedPartsKeepHfKeysButNoArchitectureOrModelType) {
  for (const ModelConfig& c : {llama_with_gpt2_parts(), gpt2_with_llama_parts()}) {
    EXPECT_FALSE(train::hf_class_computes(c));
    const io::JsonValue j = parsed(train::hf_config_json(c));
    EXPECT_EQ(j.find("architectures"), nullptr);
    EXPECT_EQ(j.find("model_type"), nullptr);
    EXPECT_EQ(int_at(j, "vocab_size"), 300);
    ASSERT_NE(j.find("lattice"), nullptr);
    EXPECT_EQ(j.at("lattice").at("family").as_string(), model::name_of(c.family));
  }
  const io::JsonValue llama = parsed(train::hf_config_json(llama_with_gpt2_parts()));
  EXPECT_EQ(int_at(llama, "hidden_size"), 64);
  EXPECT_EQ(llama.find("hidden_act"), nullptr);    // a GELU MLP: not silu
  EXPECT_EQ(llama.find("rope_theta"), nullptr);    // learned positions
  EXPECT_EQ(llama.find("rms_norm_eps"), nullptr);  // LayerNorm
  const io::JsonValue gpt2 = parsed(train::hf_config_json(gpt2_with_llama_parts()));
  EXPECT_EQ(int_at(gpt2, "n_embd"), 64);
  EXPECT_EQ(int_at(gpt2, "n_inner"), 96);
  EXPECT_FALSE(gpt2.at("tie_word_embeddings").as_bool());
  // A GPT-2 that is only untied, or of another MLP width, is still GPT2LMHeadModel's.
  ModelConfig untied;
  untied.tie_embeddings = false;
  untied.ffn_hidden = 1000;
  EXPECT_TRUE(train::hf_class_computes(untied));
  EXPECT_EQ(int_at(parsed(train::hf_config_json(untied)), "n_inner"), 1000);
}

TEST(HfConfig, RoundTripIsTheIdentity) {
  ModelConfig odd_eps = llama_1b();
  odd_eps.norm_eps = 1.2345678e-6f;
  odd_eps.rope_theta = 10000.5f;
  odd_eps.n_kv_head = 0;
  odd_eps.ffn_hidden = 0;
  odd_eps.bias = true;
  ModelConfig gpt2_untied;
  gpt2_untied.tie_embeddings = false;
  for (const ModelConfig& c :
       {ModelConfig{}, llama_1b(), odd_eps, gpt2_untied, llama_with_gpt2_parts(), gpt2_with_llama_parts()}) {
    SCOPED_TRACE(train::hf_config_json(c));
    expect_same(train::model_config_from_hf(parsed(train::hf_config_json(c)), "test"), c);
  }
  // A class transformers computes reads back from its HF keys alone.
  for (const ModelConfig& c : {ModelConfig{}, llama_1b(), odd_eps, gpt2_untied}) {
    SCOPED_TRACE(train::hf_config_json(c));
    expect_same_model(train::model_config_from_hf(hf_keys_only(parsed(train::hf_config_json(c))), "test"), c);
  }
}

// config.json files as transformers writes them (SmolLM-135M's Llama, GPT-2's
// from the Hub, a transformers 5 Llama with rope_parameters).
TEST(HfConfig, ReadsTransformersFiles) {
  const char* smollm = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576,
  "initializer_range": 0.02, "intermediate_size": 1536, "max_position_embeddings": 2048,
  "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
  "use_cache": true, "vocab_size": 49152})";
  ModelConfig c = train::model_config_from_hf(parsed(smollm), "smollm");
  EXPECT_EQ(c.family, Family::Llama);
  EXPECT_EQ(c.n_embd, 576);
  EXPECT_EQ(c.n_layer, 30);
  EXPECT_EQ(c.n_head, 9);
  EXPECT_EQ(c.kv_heads(), 3);
  EXPECT_EQ(c.ffn(), 1536);
  EXPECT_EQ(c.seq_len, 2048);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.norm_eps, 1e-5f);
  EXPECT_EQ(c.rope_theta, 10000.0f);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_FALSE(c.bias);
  EXPECT_EQ(c.norm, model::NormKind::RMSNorm);
  EXPECT_EQ(c.mlp, model::MlpKind::SwiGLU);
  EXPECT_EQ(c.position, model::PositionKind::Rope);

  // LlamaConfig's defaults for what is absent: kv heads = heads, untied, eps 1e-6.
  ModelConfig d = train::model_config_from_hf(
      parsed(R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "intermediate_size": 128, "vocab_size": 1000,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})"),
      "transformers 5");
  EXPECT_EQ(d.kv_heads(), 4);
  EXPECT_FALSE(d.tie_embeddings);
  EXPECT_EQ(d.norm_eps, 1e-6f);
  EXPECT_EQ(d.seq_len, 2048);
  EXPECT_EQ(d.rope_theta, 500000.0f);

  const char* gpt2 = R"({
  "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
  "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
  "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
  "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null,
  "summary_first_dropout": 0.1, "summary_proj_to_labels": true, "summary_type": "cls_index",
  "summary_use_proj": true, "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},
  "vocab_size": 50257})";
  expect_same(train::model_config_from_hf(parsed(gpt2), "gpt2"), ModelConfig{});
}

TEST(HfConfig, RefusesWhatLatticeDoesNotCompute) {
  const fs::path dir = scratch("refusals");
  const std::string base = R"("hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "intermediate_size": 128, "vocab_size": 1000)";
  auto refusal = [&](const std::string& name, const std::string& keys) {
    const fs::path path = dir / name / "config.json";
    fs::create_directories(path.parent_path());
    write_text(path, "{" + keys + "}");
    const std::string msg = error_of([&] { train::read_hf_config(path.string()); });
    EXPECT_HAS(msg, path.string());  // every refusal names the file
    return msg;
  };
  EXPECT_HAS(refusal("mistral", R"("model_type": "mistral", )" + base),
             "model_type = \"mistral\" is not a model lattice can load");
  EXPECT_HAS(
      refusal("scaled", R"("model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}, )" + base),
      "rope_scaling = {\"rope_type\":\"llama3\",\"factor\":8.0} is not supported");
  EXPECT_HAS(refusal("gelu", R"("model_type": "llama", "hidden_act": "gelu", )" + base),
             "hidden_act = \"gelu\" is not supported");
  EXPECT_HAS(refusal("erf", R"("model_type": "gpt2", "activation_function": "gelu", "n_embd": 64, "n_head": 4,
                               "n_layer": 2, "vocab_size": 1000)"),
             "activation_function = \"gelu\" is not supported");
  EXPECT_HAS(refusal("head_dim", R"("model_type": "llama", "head_dim": 32, )" + base),
             "head_dim=32 but hidden_size=64 / num_attention_heads=4 = 16");
  EXPECT_HAS(refusal("mlp_bias", R"("model_type": "llama", "attention_bias": true, "mlp_bias": false, )" + base),
             "attention_bias=true but mlp_bias=false");
  EXPECT_HAS(refusal("missing", R"("model_type": "llama", "hidden_size": 64)"), "missing key 'num_hidden_layers'");
  EXPECT_HAS(refusal("none", base), "no model_type (and no \"lattice\" object)");
  EXPECT_HAS(refusal("gqa_gpt2", R"("lattice": {"family": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64,
                                                "vocab_size": 300, "seq_len": 16, "n_kv_head": 2})"),
             "model.n_kv_head=2 differs from model.n_head=4");
  EXPECT_HAS(refusal("newer", R"("lattice": {"family": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64,
                                             "vocab_size": 300, "seq_len": 16, "experts": 8})"),
             "unknown key 'lattice.experts'");
  EXPECT_HAS(refusal("float_layers", R"("model_type": "llama", "hidden_size": 64.5, "num_hidden_layers": 2,
                                        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000)"),
             "hidden_size must be a non-negative integer, got 64.5");
}

TEST(HfConfig, DifferencesNameTheFilesKeys) {
  ModelConfig file = ModelConfig::defaults(Family::Llama);
  file.n_layer = 2;
  file.n_head = 4;
  file.n_kv_head = 2;
  file.n_embd = 64;
  file.vocab_size = 300;
  file.seq_len = 64;
  ModelConfig run = file;
  run.n_kv_head = 4;
  const io::JsonValue with_lattice = parsed(train::hf_config_json(file));
  const io::JsonValue hf = hf_keys_only(with_lattice);
  auto joined = [](const std::vector<std::string>& v) {
    std::string s;
    for (const std::string& d : v) s += d + "\n";
    return s;
  };
  std::vector<std::string> d = train::model_config_differences(hf, train::model_config_from_hf(hf, "t"), run);
  ASSERT_EQ(d.size(), 1u) << joined(d);
  EXPECT_EQ(d[0], "num_key_value_heads=2 but model.n_kv_head=4");
  d = train::model_config_differences(with_lattice, file, run);
  ASSERT_EQ(d.size(), 1u) << joined(d);
  EXPECT_EQ(d[0], "lattice.n_kv_head=2 but model.n_kv_head=4");

  // Several keys, each named; defaults compare by what they compute.
  run = file;
  run.n_kv_head = 0;  // 4 heads of keys and values
  run.rope_theta = 500000.0f;
  run.tie_embeddings = true;
  run.norm = model::NormKind::LayerNorm;
  d = train::model_config_differences(hf, train::model_config_from_hf(hf, "t"), run);
  EXPECT_EQ(joined(d),
            "model_type=\"llama\" (norm) = \"rmsnorm\" but model.norm=\"layernorm\"\n"
            "num_key_value_heads=2 but model.n_kv_head=4\n"
            "rope_theta=10000.0 but model.rope_theta=500000.0\n"
            "tie_word_embeddings=false but model.tie_embeddings=true\n");

  // The context is not compared (a learned table is checked by its shape).
  run = file;
  run.seq_len = 16;
  EXPECT_TRUE(train::model_config_differences(hf, file, run).empty());
  run.seq_len = 128;
  EXPECT_TRUE(train::model_config_differences(hf, file, run).empty());

  // n_kv_head 0 and the family's MLP width spelled out are the same model.
  run = file;
  run.n_kv_head = 2;
  run.ffn_hidden = file.ffn();
  EXPECT_TRUE(train::model_config_differences(hf, file, run).empty());
}

// ---------------------------------------------------------------- refusals of init_from (no model needed)

namespace {

// A GPT-2-named file (as the Hub's: no lm_head), a few tensors.
std::string write_gpt2_names(const fs::path& path) {
  const std::vector<float> x(32 * 96, 0.25f), wte(300 * 32, 0.5f);
  io::SafeTensorsWriter w;  // references the data until write()
  w.add("wte.weight", DType::F32, {300, 32}, wte.data());
  w.add("h.0.attn.c_attn.weight", DType::F32, {32, 96}, x.data());
  w.write(path.string());
  return path.string();
}

ModelConfig tiny_llama() {
  ModelConfig c = ModelConfig::defaults(Family::Llama);
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 4;
  c.n_embd = 32;
  c.vocab_size = 300;
  c.seq_len = 16;
  return c;
}

}  // namespace

TEST(HfInitFrom, RefusesAConfigJsonOfAnotherModelNamingEachKey) {
  const fs::path dir = scratch("other_config");
  write_gpt2_names(dir / "model.safetensors");
  ModelConfig file = tiny_llama();
  file.n_kv_head = 2;
  write_text(dir / "config.json", io::to_json(hf_keys_only(parsed(train::hf_config_json(file))), 2));
  const std::string what = "checkpoint.init_from='" + dir.string() + "'";
  const train::HfModelFiles files = train::find_hf_model(dir.string(), what);
  EXPECT_EQ(files.safetensors, (dir / "model.safetensors").string());
  EXPECT_EQ(files.config_json, (dir / "config.json").string());
  io::SafeTensorsReader r(files.safetensors);
  EXPECT_EQ(error_of([&] { train::check_init_from(what, files, r, tiny_llama()); }),
            what + ": its config.json has num_key_value_heads=2 but model.n_kv_head=4");
}

TEST(HfInitFrom, RefusesGpt2TensorNamesForALlamaRun) {
  const fs::path dir = scratch("gpt2_to_llama");
  const std::string file = write_gpt2_names(dir / "gpt2.safetensors");
  const train::HfModelFiles files = train::find_hf_model(file, "x");
  EXPECT_TRUE(files.config_json.empty());
  io::SafeTensorsReader r(file);
  const std::string what = "checkpoint.init_from='" + file + "'";
  EXPECT_EQ(error_of([&] { train::check_init_from(what, files, r, tiny_llama()); }),
            what +
                " has GPT-2 tensor names (h.0.attn.c_attn.weight) but model.family = \"llama\": set "
                "model.family=\"gpt2\"");
  // The Hub's GPT2LMHeadModel files put "transformer." before the names.
  io::SafeTensorsWriter w;
  std::vector<float> x(32 * 96);
  w.add("transformer.h.0.attn.c_attn.weight", DType::F32, {32, 96}, x.data());
  const std::string prefixed = (dir / "prefixed.safetensors").string();
  w.write(prefixed);
  io::SafeTensorsReader p(prefixed);
  EXPECT_HAS(error_of([&] { train::check_init_from(what, files, p, tiny_llama()); }),
             "has GPT-2 tensor names (transformer.h.0.attn.c_attn.weight) but model.family = \"llama\"");
  // And the other way round.
  io::SafeTensorsWriter l;
  l.add("model.layers.0.self_attn.q_proj.weight", DType::F32, {32, 32}, x.data());
  const std::string llama = (dir / "llama.safetensors").string();
  l.write(llama);
  io::SafeTensorsReader lr(llama);
  EXPECT_HAS(error_of([&] { train::check_init_from(what, files, lr, ModelConfig{}); }),
             "has Llama tensor names (model.layers.0.self_attn.q_proj.weight) but model.family = \"gpt2\"");
  EXPECT_NO_THROW(train::check_init_from(what, files, r, ModelConfig{}));
}

TEST(HfInitFrom, RefusesAnUntiedHeadForATiedRunWithoutConfigJson) {
  const fs::path dir = scratch("untied_head");
  std::vector<float> emb(300 * 32, 0.5f), other(300 * 32, 0.25f);
  auto file_with_head = [&](const std::string& name, const std::vector<float>& head) {
    io::SafeTensorsWriter w;
    w.add("wte.weight", DType::F32, {300, 32}, emb.data());
    w.add("lm_head.weight", DType::F32, {300, 32}, head.data());
    w.write((dir / name).string());
    return (dir / name).string();
  };
  ModelConfig run;
  run.n_embd = 32;
  run.vocab_size = 300;
  const std::string untied = file_with_head("untied.safetensors", other);
  io::SafeTensorsReader u(untied);
  EXPECT_HAS(error_of([&] { train::check_init_from("f", train::find_hf_model(untied, "f"), u, run); }),
             "f has its own lm_head.weight (an untied LM head) but model.tie_embeddings = true");
  // A copy of the embedding is the tied head.
  const std::string copy = file_with_head("copy.safetensors", emb);
  io::SafeTensorsReader c(copy);
  EXPECT_NO_THROW(train::check_init_from("f", train::find_hf_model(copy, "f"), c, run));
  run.tie_embeddings = false;
  EXPECT_NO_THROW(train::check_init_from("f", train::find_hf_model(untied, "f"), u, run));
}

TEST(HfInitFrom, FindsTheFilesOfEachKindOfPath) {
  const fs::path dir = scratch("find");
  EXPECT_EQ(error_of([&] { train::find_hf_model((dir / "nothing").string(), "checkpoint.init_from='n'"); }),
            "checkpoint.init_from='n' does not exist");
  fs::create_directories(dir / "sharded");
  write_text(dir / "sharded" / "model.safetensors.index.json", "{}");
  EXPECT_HAS(error_of([&] { train::find_hf_model((dir / "sharded").string(), "w"); }),
             "w holds a sharded model (model.safetensors.index.json)");
  fs::create_directories(dir / "empty");
  EXPECT_HAS(error_of([&] { train::find_hf_model((dir / "empty").string(), "w"); }),
             "w is a directory without model.safetensors");
  // A bare file with no config.json beside it.
  fs::create_directories(dir / "bare");
  write_gpt2_names(dir / "bare" / "weights.safetensors");
  const train::HfModelFiles bare = train::find_hf_model((dir / "bare" / "weights.safetensors").string(), "w");
  EXPECT_TRUE(bare.config_json.empty());
  EXPECT_TRUE(bare.step_dir.empty());
}

// ---------------------------------------------------------------- checkpoints (GPT-2 family)

namespace {

io::RunConfig tiny_run() {
  io::RunConfig c;
  c.model.n_layer = 2;
  c.model.n_head = 2;
  c.model.n_embd = 32;
  c.model.vocab_size = 300;
  c.model.seq_len = 16;
  c.train.micro_batch_size = 2;
  c.train.grad_accum_steps = 1;
  c.train.steps = 2;
  c.train.threads = 1;
  c.optim.lr = 3e-3;
  c.optim.warmup_steps = 1;
  return c;
}

std::vector<float> all_params(model::GPT& m) {
  std::vector<float> out;
  for (auto& g : m.groups()) out.insert(out.end(), g.data(), g.data() + g.numel());
  return out;
}

}  // namespace

TEST(HfCheckpoint, StepDirectoryIsAnHfModelDirectory) {
  const fs::path dir = scratch("step_dir");
  io::RunConfig cfg = tiny_run();
  cfg.checkpoint.dir = (dir / "run").string();
  train::Trainer t(cfg, {false});
  t.run();
  const std::string step = io::resolve_checkpoint("latest", cfg.checkpoint.dir);
  const fs::path config = fs::path(step) / "config.json";
  ASSERT_TRUE(fs::exists(config));
  const std::string text = io::read_whole_file(config.string(), "config.json");
  EXPECT_EQ(text, train::hf_config_json(train::model_config_of(cfg.model)));
  expect_same(train::read_hf_config(config.string()), train::model_config_of(cfg.model));
  // Listed in meta.json with its checksum, so verify_checkpoint covers it.
  const io::JsonValue meta = io::read_checkpoint_meta(step);
  ASSERT_NE(meta.at("files").find("config.json"), nullptr);
  // No temporary or partial file is left beside it.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(step)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names,
            (std::vector<std::string>{"config.json", "meta.json", "model.safetensors", "optimizer.safetensors"}));
  write_text(config, text + " ");
  EXPECT_HAS(error_of([&] { io::verify_checkpoint(step); }), "config.json");

  // The step directory (a config.json of this model), its model.safetensors
  // (config.json beside it) and the run directory initialise another run, and
  // load for inference.
  write_text(config, text);
  const std::vector<float> want = all_params(t.model());
  for (const std::string& from : {step, step + "/model.safetensors", cfg.checkpoint.dir}) {
    SCOPED_TRACE(from);
    io::RunConfig b = tiny_run();
    b.train.seed = 99;
    b.checkpoint.init_from = from;
    train::Trainer tb(b, {false});
    EXPECT_EQ(all_params(tb.model()), want);
    auto gpt = train::load_model_for_inference(from, 0);
    EXPECT_EQ(all_params(*gpt), want);
  }
}

TEST(HfCheckpoint, InitFromRefusesAnotherModelsConfigAndNamesAWrongShape) {
  const fs::path dir = scratch("init_refusals");
  io::RunConfig cfg = tiny_run();
  cfg.checkpoint.dir = (dir / "run").string();
  train::Trainer(cfg, {false}).run();
  const std::string step = io::resolve_checkpoint("latest", cfg.checkpoint.dir);

  // A lattice file: its recorded model, in lattice's keys.
  io::RunConfig wider = tiny_run();
  wider.model.n_embd = 64;
  wider.model.seq_len = 32;
  wider.checkpoint.init_from = step;
  EXPECT_EQ(error_of([&] { train::Trainer t(wider, {false}); }),
            "checkpoint.init_from='" + step + "' was trained with model.n_embd=32 but this run has model.n_embd=64");
  // A Hub directory (HF keys only, no record in the file): in the file's keys.
  const fs::path hub = dir / "hub";
  fs::create_directories(hub);
  {
    io::SafeTensorsReader lattice_file(step + "/model.safetensors");
    std::vector<std::vector<float>> values;
    io::SafeTensorsWriter w;
    for (const io::TensorEntry& e : lattice_file.tensors()) {
      values.emplace_back(static_cast<size_t>(e.numel()));
      lattice_file.read_f32(e.name, values.back().data(), values.back().size());
      w.add(e.name, DType::F32, e.shape, values.back().data());
    }
    w.write((hub / "model.safetensors").string());
  }
  write_text(hub / "config.json",
             io::to_json(hf_keys_only(parsed(train::hf_config_json(train::model_config_of(cfg.model)))), 2));
  wider.checkpoint.init_from = hub.string();
  EXPECT_EQ(error_of([&] { train::Trainer t(wider, {false}); }),
            "checkpoint.init_from='" + hub.string() + "': its config.json has n_embd=32 but model.n_embd=64");
  io::RunConfig same = tiny_run();
  same.checkpoint.init_from = hub.string();
  EXPECT_EQ(all_params(train::Trainer(same, {false}).model()), all_params(*train::load_model_for_inference(step, 0)));
  // A shorter context loads (the first rows of wpe).
  io::RunConfig shorter = tiny_run();
  shorter.model.seq_len = 8;
  shorter.checkpoint.init_from = step;
  EXPECT_NO_THROW({ train::Trainer t(shorter, {false}); });

  // A bare file (no config.json) with one tensor of another shape: named, both shapes.
  io::SafeTensorsReader r(step + "/model.safetensors");
  io::SafeTensorsWriter w;
  std::vector<std::vector<float>> data;
  for (const io::TensorEntry& e : r.tensors()) {
    std::vector<int64_t> shape = e.shape;
    if (e.name == "h.1.attn.c_attn.weight") shape[1] = 99;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    data.emplace_back(static_cast<size_t>(n), 0.5f);
    w.add(e.name, DType::F32, shape, data.back().data());
  }
  fs::create_directories(dir / "bare");
  const std::string bad = (dir / "bare" / "bad.safetensors").string();
  w.write(bad);
  io::RunConfig b = tiny_run();
  b.checkpoint.init_from = bad;
  const std::string msg = error_of([&] { train::Trainer t(b, {false}); });
  EXPECT_HAS(msg, "checkpoint file '" + bad +
                      "': tensor 'h.1.attn.c_attn.weight' has shape [32, 99] but this model "
                      "needs [32, 96]");
}

// ---------------------------------------------------------------- Llama (the Llama model parts)

namespace {

// Hugging Face LlamaForCausalLM's state dict, written out from its modules
// (modeling_llama.py), independently of lattice's ParamInfo: name → shape.
std::map<std::string, std::vector<int64_t>> hf_llama_tensors(const ModelConfig& c) {
  const int64_t C = c.n_embd, V = c.vocab_size, F = c.ffn(), hs = c.n_embd / c.n_head;
  const int64_t q = c.n_head * hs, kv = c.kv_heads() * hs;
  std::map<std::string, std::vector<int64_t>> t;
  t["model.embed_tokens.weight"] = {V, C};
  for (int l = 0; l < c.n_layer; l++) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t[p + "input_layernorm.weight"] = {C};
    t[p + "self_attn.q_proj.weight"] = {q, C};
    t[p + "self_attn.k_proj.weight"] = {kv, C};
    t[p + "self_attn.v_proj.weight"] = {kv, C};
    t[p + "self_attn.o_proj.weight"] = {C, q};
    t[p + "post_attention_layernorm.weight"] = {C};
    t[p + "mlp.gate_proj.weight"] = {F, C};
    t[p + "mlp.up_proj.weight"] = {F, C};
    t[p + "mlp.down_proj.weight"] = {C, F};
    if (c.bias) {
      for (const char* m : {"q_proj", "k_proj", "v_proj"}) t[p + "self_attn." + m + ".bias"] = {m[0] == 'q' ? q : kv};
      t[p + "self_attn.o_proj.bias"] = {C};
      t[p + "mlp.gate_proj.bias"] = {F};
      t[p + "mlp.up_proj.bias"] = {F};
      t[p + "mlp.down_proj.bias"] = {C};
    }
  }
  t["model.norm.weight"] = {C};
  if (!c.tie_embeddings) t["lm_head.weight"] = {V, C};
  return t;
}

ModelConfig gqa_llama(bool tied, bool bias) {
  ModelConfig c = ModelConfig::defaults(Family::Llama);
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.n_embd = 32;
  c.ffn_hidden = 64;
  c.vocab_size = 300;  // lattice pads to 384 rows
  c.seq_len = 16;
  c.tie_embeddings = tied;
  c.bias = bias;
  c.rope_theta = 500000.0f;
  return c;
}

// A Hugging Face Llama directory as the Hub has them: bf16 tensors of
// vocab_size rows, no lm_head when tied, a config.json of HF keys only.
// Returns every tensor's values (bf16, widened).
std::map<std::string, std::vector<float>> write_hf_llama(const fs::path& dir, const ModelConfig& c) {
  fs::create_directories(dir);
  std::map<std::string, std::vector<float>> values;
  std::vector<std::vector<uint16_t>> bits;
  io::SafeTensorsWriter w;
  int k = 0;
  for (const auto& [name, shape] : hf_llama_tensors(c)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float>& v = values[name];
    bits.emplace_back();
    for (int64_t i = 0; i < n; i++) {
      const uint16_t b = f32_to_bf16(0.05f * std::sin(0.37f * static_cast<float>(i) + static_cast<float>(++k)));
      bits.back().push_back(b);
      v.push_back(bf16_to_f32(b));
    }
    w.add(name, DType::BF16, shape, bits.back().data());
  }
  w.write((dir / "model.safetensors").string());
  write_text(dir / "config.json",
             std::string(R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",)") +
                 " \"hidden_size\": " + std::to_string(c.n_embd) + ", \"intermediate_size\": " +
                 std::to_string(c.ffn()) + ", \"num_hidden_layers\": " + std::to_string(c.n_layer) +
                 ", \"num_attention_heads\": " + std::to_string(c.n_head) + ", \"num_key_value_heads\": " +
                 std::to_string(c.kv_heads()) + ", \"max_position_embeddings\": " + std::to_string(c.seq_len) +
                 ", \"vocab_size\": " + std::to_string(c.vocab_size) + ", \"rms_norm_eps\": 1e-05" +
                 ", \"rope_theta\": 500000.0, \"rope_scaling\": null, \"torch_dtype\": \"bfloat16\"" +
                 ", \"attention_bias\": " + (c.bias ? "true" : "false") +
                 ", \"tie_word_embeddings\": " + (c.tie_embeddings ? "true" : "false") + "}");
  return values;
}

// Every parameter of `m` equals the file's tensor of its name, padding rows zero.
void expect_holds(model::GPT& m, const std::map<std::string, std::vector<float>>& values) {
  size_t seen = 0;
  for (const model::ParamGroup& g : m.groups())
    for (const model::ParamInfo& p : g.params()) {
      SCOPED_TRACE(p.name);
      auto it = values.find(p.name);
      ASSERT_NE(it, values.end()) << "lattice has a parameter HF Llama does not";
      seen++;
      const float* data = g.data() + p.offset;
      const size_t real = it->second.size();
      ASSERT_GE(static_cast<size_t>(p.numel()), real);
      EXPECT_EQ(std::vector<float>(data, data + real), it->second);
      for (int64_t i = static_cast<int64_t>(real); i < p.numel(); i++) ASSERT_EQ(data[i], 0.0f) << "padding row";
    }
  EXPECT_EQ(seen, values.size()) << "HF Llama has a tensor lattice does not";
}

void set_llama(io::RunConfig& r, const ModelConfig& c) {
  io::apply_override(r, "model.family=\"llama\"");
  io::apply_override(r, "model.n_kv_head=" + std::to_string(c.n_kv_head));
  io::apply_override(r, "model.ffn_hidden=" + std::to_string(c.ffn_hidden));
  io::apply_override(r, "model.rope_theta=500000.0");
  io::apply_override(r, std::string("model.tie_embeddings=") + (c.tie_embeddings ? "true" : "false"));
  io::apply_override(r, std::string("model.bias=") + (c.bias ? "true" : "false"));
  r.model.n_layer = c.n_layer;
  r.model.n_head = c.n_head;
  r.model.n_embd = c.n_embd;
  r.model.vocab_size = c.vocab_size;
  r.model.seq_len = c.seq_len;
}

}  // namespace

// lattice's Llama parameters are HF's, by name and (HF-layout) shape.
TEST(HfLlama, ParameterNamesAndShapesAreHfLlamas) {
  for (bool tied : {false, true})
    for (bool bias : {false, true}) {
      const ModelConfig c = gqa_llama(tied, bias);
      SCOPED_TRACE(train::hf_config_json(c));
      model::GPT m(c, model::GPT::NoInit{});
      std::map<std::string, std::vector<int64_t>> have;
      for (const model::ParamGroup& g : m.groups())
        for (const model::ParamInfo& p : g.params()) {
          EXPECT_FALSE(p.hf_conv1d) << p.name;
          have[p.name] = train::hf_shape(p);
        }
      EXPECT_EQ(have, hf_llama_tensors(c));
    }
}

TEST(HfLlama, HubDirectoryLoadsForInferenceAndInitFrom) {
  for (bool tied : {false, true}) {
    const ModelConfig c = gqa_llama(tied, false);
    const fs::path dir = scratch(tied ? "hub_tied" : "hub");
    const auto values = write_hf_llama(dir, c);
    auto gpt = train::load_model_for_inference(dir.string(), 0);
    expect_same_model(gpt->config(), c);
    expect_holds(*gpt, values);
    std::vector<int32_t> in(16), tg(16);
    for (int i = 0; i < 16; i++) in[i] = (i * 37) % 300, tg[i] = (i * 53 + 1) % 300;
    EXPECT_TRUE(std::isfinite(gpt->evaluate(in.data(), tg.data(), 1, 16)));

    io::RunConfig r = tiny_run();
    set_llama(r, c);
    r.checkpoint.init_from = dir.string();
    train::Trainer t(r, {false});
    expect_holds(t.model(), values);
    EXPECT_EQ(t.model().evaluate(in.data(), tg.data(), 1, 16), gpt->evaluate(in.data(), tg.data(), 1, 16));
  }
}

TEST(HfLlama, CheckpointRoundTripsAndIsAnHfLlamaDirectory) {
  const fs::path dir = scratch("llama_ckpt");
  const ModelConfig c = gqa_llama(false, false);
  io::RunConfig r = tiny_run();
  set_llama(r, c);
  r.checkpoint.dir = (dir / "run").string();
  train::Trainer t(r, {false});
  t.run();
  const std::string step = io::resolve_checkpoint("latest", r.checkpoint.dir);
  const io::JsonValue j = io::parse_json(io::read_whole_file(step + "/config.json", "c"), "c");
  EXPECT_EQ(j.at("model_type").as_string(), "llama");
  EXPECT_EQ(int_at(j, "num_key_value_heads"), 2);
  io::SafeTensorsReader file(step + "/model.safetensors");
  EXPECT_EQ(file.get("model.embed_tokens.weight").shape, (std::vector<int64_t>{300, 32}));
  EXPECT_EQ(file.get("lm_head.weight").shape, (std::vector<int64_t>{300, 32}));
  EXPECT_EQ(file.get("model.layers.1.self_attn.k_proj.weight").shape, (std::vector<int64_t>{16, 32}));
  auto gpt = train::load_model_for_inference(r.checkpoint.dir, 0);
  EXPECT_EQ(all_params(*gpt), all_params(t.model()));
}

TEST(HfLlama, InitFromRefusesGpt2FilesAndWrongShapes) {
  const fs::path dir = scratch("llama_refusals");
  const ModelConfig c = gqa_llama(false, false);
  io::RunConfig r = tiny_run();
  set_llama(r, c);

  // GPT-2 weights given to a Llama run: named as such, before any missing tensor.
  io::RunConfig g = tiny_run();
  g.model.n_embd = 32;
  model::GPT gpt2(train::model_config_of(g.model), 1);
  const std::string gpt2_file = (dir / "gpt2.safetensors").string();
  train::save_model_safetensors(gpt2, train::params_of(gpt2), gpt2_file);
  r.checkpoint.init_from = gpt2_file;
  EXPECT_HAS(error_of([&] { train::Trainer t(r, {false}); }),
             "checkpoint.init_from='" + gpt2_file +
                 "' has GPT-2 tensor names (h.0.attn.c_attn.weight) but model.family = \"llama\"");

  // k_proj with a row per query head: named, with both shapes.
  const fs::path hub = dir / "hub";
  write_hf_llama(hub, c);
  ModelConfig mha = c;
  mha.n_kv_head = 4;
  const fs::path wrong = dir / "wrong";
  write_hf_llama(wrong, mha);
  fs::remove(wrong / "config.json");  // a bare file: only the shapes can tell
  r.checkpoint.init_from = (wrong / "model.safetensors").string();
  EXPECT_HAS(error_of([&] { train::Trainer t(r, {false}); }),
             "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [32, 32] but this model needs [16, 32]");
  // The same file with its config.json: refused by the key first.
  r.checkpoint.init_from = hub.string();
  io::RunConfig more_heads = r;
  io::apply_override(more_heads, "model.n_kv_head=4");
  EXPECT_HAS(error_of([&] { train::Trainer t(more_heads, {false}); }),
             "its config.json has num_key_value_heads=2 but model.n_kv_head=4");
}

namespace {

// What a command printed on stdout (its exit status must be 0).
std::string output_of(const std::string& command) {
  std::string out;
  FILE* p = ::popen(command.c_str(), "r");
  if (!p) return "(popen failed)";
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  EXPECT_EQ(::pclose(p), 0) << command << "\n" << out;
  return out;
}

// tools/llama_reference.py's mean loss of predicting tokens[1:] from tokens[:-1].
double reference_loss(const std::string& model_dir, const std::vector<int32_t>& tokens) {
  std::string list;
  for (int32_t t : tokens) {
    if (!list.empty()) list += ',';
    list += std::to_string(t);
  }
  const std::string out = output_of("/usr/bin/python3 " + std::string(LATTICE_SOURCE_DIR) +
                                    "/tools/llama_reference.py eval --model " + model_dir + " --tokens " + list);
  return io::parse_json(out, "llama_reference.py").at("loss").as_double();
}

double lattice_loss(model::GPT& m, const std::vector<int32_t>& tokens) {
  const int T = static_cast<int>(tokens.size()) - 1;
  return m.evaluate(tokens.data(), tokens.data() + 1, 1, T);
}

}  // namespace

// An independent reader and writer: tools/llama_reference.py (a PyTorch
// LlamaForCausalLM from transformers' modeling_llama.py, no lattice code)
// evaluates a lattice Llama checkpoint directory to the loss lattice gets,
// and a directory it writes (bf16 tensors, its own config.json, tied head,
// biases) loads into lattice with the loss it gets. Needs Debian's
// python3-torch; skipped where it is not installed.
TEST(HfLlama, DirectoriesAgreeWithThePyTorchLlama) {
  if (std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3-torch is not installed (apt-get install python3-torch)";
  const fs::path dir = scratch("pytorch_llama");
  std::vector<int32_t> tokens;
  for (int i = 0; i < 17; i++) tokens.push_back((i * 131 + 7) % 300);

  // lattice → PyTorch: a trained checkpoint's step directory.
  io::RunConfig r = tiny_run();
  set_llama(r, gqa_llama(false, false));
  r.train.steps = 3;
  r.checkpoint.dir = (dir / "run").string();
  train::Trainer t(r, {false});
  t.run();
  const double ours = lattice_loss(t.model(), tokens);
  const double theirs = reference_loss(io::resolve_checkpoint("latest", r.checkpoint.dir), tokens);
  EXPECT_NEAR(ours, theirs, 1e-5 * std::fabs(theirs));

  // PyTorch → lattice: a directory the reference writes.
  const fs::path hub = dir / "hub";
  fs::create_directories(hub);
  const std::string script =
      "import sys, torch; sys.path.insert(0, '" + std::string(LATTICE_SOURCE_DIR) +
      "/tools'); import llama_reference as ref\n"
      "cfg = ref.LlamaConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=300, max_positions=16, n_kv_head=2, "
      "ffn_hidden=64, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True, attention_bias=True, mlp_bias=True)\n"
      "m = ref.build_model(cfg)\n"
      "with torch.no_grad(): ref.init_params(m, seed=5, weight_std=0.2, norm_noise=0.1, bias_noise=0.05)\n"
      "ref.save_safetensors(m, '" +
      (hub / "model.safetensors").string() +
      "', dtype=torch.bfloat16)\n"
      "ref.write_config(cfg, '" +
      (hub / "config.json").string() + "', torch_dtype='bfloat16')\n";
  std::ofstream(dir / "write_hub.py") << script;
  output_of("/usr/bin/python3 " + (dir / "write_hub.py").string());
  auto gpt = train::load_model_for_inference(hub.string(), 0);
  EXPECT_TRUE(gpt->config().tie_embeddings);
  EXPECT_TRUE(gpt->config().bias);
  EXPECT_EQ(gpt->config().kv_heads(), 2);
  const double loaded = lattice_loss(*gpt, tokens), reference = reference_loss(hub.string(), tokens);
  EXPECT_NEAR(loaded, reference, 1e-5 * std::fabs(reference));
  EXPECT_GT(std::fabs(loaded - std::log(300.0)), 0.01) << "a model that predicts something";
}
