// The [model] section as a model: the one conversion (train::model_config_of)
// gives each family ModelConfig::defaults and each part key that is set; the
// config path refuses the combinations ModelConfig::validate and
// check_tensor_parallel refuse, with their messages, when a config is loaded;
// a checkpoint's recorded section reads back the same model; the run header's
// one-line description; and the parameter counts of the two shipped sizes.
#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lattice/core/error.h"
#include "lattice/io/config.h"
#include "lattice/model/config.h"
#include "lattice/train/trainer.h"

using namespace lattice;

namespace {

model::ModelConfig model_of(const std::vector<std::string>& overrides) {
  return train::model_config_of(io::parse_config_text("", "x.toml", overrides).model);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// What the config path says of `overrides`: io's checks (parse_config_text),
// then the model's (checked_model_config), as `lattice train` and the
// Trainer run them.
std::string refusal_of(const std::vector<std::string>& overrides) {
  return error_of([&] { train::checked_model_config(io::parse_config_text("", "x.toml", overrides)); });
}

void expect_same_model(const model::ModelConfig& a, const model::ModelConfig& b) {
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
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.bias, b.bias);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_TRUE(train::model_differences(a, b).empty());
}

}  // namespace

// `family` alone gives ModelConfig::defaults(family): nothing written is a
// GPT-2, family = "llama" is a Llama.
TEST(ModelConfigOf, EachFamilyGivesItsDefaults) {
  expect_same_model(model_of({}), model::ModelConfig::defaults(model::Family::GPT2));
  expect_same_model(model_of({"model.family=llama"}), model::ModelConfig::defaults(model::Family::Llama));
  const model::ModelConfig gpt2 = model_of({});
  EXPECT_EQ(gpt2.norm, model::NormKind::LayerNorm);
  EXPECT_EQ(gpt2.position, model::PositionKind::Learned);
  EXPECT_EQ(gpt2.ffn(), 3072);  // 4 x 768
  EXPECT_TRUE(gpt2.bias);
  EXPECT_TRUE(gpt2.tie_embeddings);
  const model::ModelConfig llama = model_of({"model.family=llama"});
  EXPECT_EQ(llama.norm, model::NormKind::RMSNorm);
  EXPECT_EQ(llama.mlp, model::MlpKind::SwiGLU);
  EXPECT_EQ(llama.position, model::PositionKind::Rope);
  EXPECT_EQ(llama.kv_heads(), 12);  // n_head
  EXPECT_EQ(llama.ffn(), 2048);     // 8 x 768 / 3 = 2048, a multiple of 256 already
  EXPECT_FALSE(llama.bias);
  EXPECT_FALSE(llama.tie_embeddings);
}

// io::family_defaults() (what --help-config and docs/config.md show, and what
// io's conditional rows read) says what ModelConfig::defaults does: writing
// a family's documented default explicitly changes nothing.
TEST(ModelConfigOf, DocumentedFamilyDefaultsAreModelConfigDefaults) {
  for (const char* family : {"gpt2", "llama"}) {
    SCOPED_TRACE(family);
    const std::string f = std::string("model.family=") + family;
    const model::ModelConfig unset = model_of({f});
    for (const io::FamilyDefault& d : io::family_defaults()) {
      const std::string& text = std::string(family) == "llama" ? d.llama : d.gpt2;
      if (d.key == "model.n_kv_head") {
        EXPECT_EQ(text, "n_head");
        EXPECT_EQ(unset.kv_heads(), unset.n_head);
      } else if (d.key == "model.ffn_hidden") {
        // Checked at two widths: 4C, or 8C/3 rounded up to 256.
        for (const auto& [C, H] : {std::pair{768, 12}, std::pair{4096, 32}}) {
          const model::ModelConfig m =
              model_of({f, "model.n_embd=" + std::to_string(C), "model.n_head=" + std::to_string(H)});
          const int want = std::string(family) == "gpt2" ? 4 * C : (8 * C / 3 + 255) / 256 * 256;
          EXPECT_EQ(m.ffn(), want) << C;
        }
        EXPECT_EQ(model_of({"model.family=llama", "model.n_embd=4096", "model.n_head=32"}).ffn(), 11008);
      } else {
        SCOPED_TRACE(d.key + "=" + text);
        std::vector<std::string> overrides = {f, d.key + "=" + text};
        if (d.key == "model.rope_theta" && std::string(family) == "gpt2") overrides.push_back("model.position=rope");
        const model::ModelConfig written = model_of(overrides);
        if (d.key == "model.rope_theta") {
          EXPECT_EQ(written.rope_theta, unset.rope_theta);
        } else {
          expect_same_model(written, unset);
        }
      }
    }
  }
}

// Each key, set, reaches the model (the other family's part, where it has one).
TEST(ModelConfigOf, EachPartKeyOverridesTheFamily) {
  const model::ModelConfig g =
      model_of({"model.norm=rmsnorm", "model.position=rope", "model.rope_theta=500000", "model.ffn_hidden=1000",
                "model.norm_eps=1e-6", "model.bias=false", "model.tie_embeddings=false", "model.n_kv_head=12"});
  EXPECT_EQ(g.family, model::Family::GPT2);
  EXPECT_EQ(g.norm, model::NormKind::RMSNorm);
  EXPECT_EQ(g.position, model::PositionKind::Rope);
  EXPECT_EQ(g.rope_theta, 500000.0f);
  EXPECT_EQ(g.ffn(), 1000);
  EXPECT_EQ(g.norm_eps, 1e-6f);
  EXPECT_FALSE(g.bias);
  EXPECT_FALSE(g.tie_embeddings);
  EXPECT_EQ(g.kv_heads(), 12);
  const model::ModelConfig l =
      model_of({"model.family=llama", "model.norm=layernorm", "model.mlp=gelu", "model.position=learned",
                "model.n_kv_head=4", "model.bias=true", "model.tie_embeddings=true"});
  EXPECT_EQ(l.family, model::Family::Llama);
  EXPECT_EQ(l.norm, model::NormKind::LayerNorm);
  EXPECT_EQ(l.mlp, model::MlpKind::GELU);
  EXPECT_EQ(l.position, model::PositionKind::Learned);
  EXPECT_EQ(l.kv_heads(), 4);
  EXPECT_TRUE(l.bias);
  EXPECT_TRUE(l.tie_embeddings);
  EXPECT_NO_THROW(
      train::checked_model_config(io::parse_config_text("", "x.toml", {"model.family=llama", "model.n_kv_head=4"})));
}

// Each ModelConfig::validate and check_tensor_parallel message, as the config
// path produces it: one line naming the keys.
TEST(ModelConfigOf, TheConfigPathRefusesWhatTheModelRefuses) {
  EXPECT_EQ(refusal_of({"model.family=llama", "model.n_kv_head=5"}),
            "model.n_head=12 is not a multiple of model.n_kv_head=5: each key/value head serves a whole group of "
            "query heads");
  EXPECT_EQ(refusal_of({"model.family=llama", "model.n_embd=36"}),
            "model.position = \"rope\" needs an even head size, but model.n_embd=36 / model.n_head=12 = 3 (the "
            "rotation pairs element i with i + head_size/2)");
  // The same under GPT-2 with rope asked for.
  EXPECT_EQ(refusal_of({"model.position=rope", "model.n_embd=36"}),
            refusal_of({"model.family=llama", "model.n_embd=36"}));
  EXPECT_EQ(refusal_of({"model.n_kv_head=4"}),
            "model.n_kv_head=4 differs from model.n_head=12, but model.family = \"gpt2\" keeps Q, K and V of equal "
            "width in one attn.c_attn; grouped-query attention needs model.family = \"llama\"");
  EXPECT_EQ(refusal_of({"model.mlp=swiglu"}),
            "model.mlp = \"swiglu\" needs model.family = \"llama\" (GPT-2's c_fc and c_proj have no gate projection "
            "to name)");
  // Tensor parallelism: query heads, key/value heads (divided, or each kept
  // whole on a multiple of them), MLP columns.
  EXPECT_EQ(refusal_of({"parallel.tp=5"}),
            "parallel.tp=5 must divide model.n_head=12: attention is split by whole query heads");
  EXPECT_EQ(refusal_of({"model.family=llama", "model.n_kv_head=4", "parallel.tp=6"}),
            "parallel.tp=6 must divide model.n_kv_head=4 or be a multiple of it: key/value heads are split whole, "
            "or each kept whole on the ranks of its query heads");
  EXPECT_EQ(refusal_of({"model.family=llama", "model.n_kv_head=4", "model.ffn_hidden=2302", "parallel.tp=4"}),
            "parallel.tp=4 must divide the MLP's hidden width 2302 (model.ffn_hidden): it is split by columns");
  EXPECT_EQ(refusal_of({"model.family=llama", "model.n_kv_head=4", "parallel.tp=2"}), "(no error)");  // divides
  EXPECT_EQ(refusal_of({"model.family=llama", "model.n_kv_head=4", "model.ffn_hidden=2304", "parallel.tp=12"}),
            "(no error)");  // a multiple
  EXPECT_EQ(refusal_of({"model.family=llama", "model.n_kv_head=2", "parallel.tp=4"}), "(no error)");
  // io's own refusals come first, as they did.
  EXPECT_EQ(refusal_of({"model.family=llama", "model.n_embd=100"}),
            "model.n_embd=100 is not divisible by model.n_head=12");
  // The Trainer refuses the same, before it builds anything.
  io::RunConfig cfg = io::parse_config_text("", "x.toml", {"model.family=llama", "model.n_kv_head=5"});
  EXPECT_EQ(error_of([&] { train::Trainer t(cfg, {false}); }),
            "model.n_head=12 is not a multiple of model.n_kv_head=5: each key/value head serves a whole group of "
            "query heads");
}

// What a checkpoint records (model_section_of: every key written out) reads
// back as the same model, through its TOML; a section from before the
// families reads as GPT-2.
TEST(ModelConfigOf, RecordedSectionsReadBackTheSameModel) {
  for (const std::vector<std::string>& overrides :
       {std::vector<std::string>{},
        {"model.family=llama"},
        {"model.family=llama", "model.n_kv_head=4", "model.ffn_hidden=2304", "model.tie_embeddings=true",
         "model.rope_theta=500000", "model.norm_eps=1e-6"},
        {"model.position=rope", "model.norm=rmsnorm", "model.bias=false"}}) {
    const model::ModelConfig c = model_of(overrides);
    io::RunConfig recorded;
    recorded.model = train::model_section_of(c);
    const std::string text = io::config_to_toml(recorded);
    SCOPED_TRACE(text);
    // Valid as a run's config too (rope_theta only under rope).
    const io::RunConfig back = io::parse_config_text(text, "meta.json config", {});
    EXPECT_EQ(back.model, recorded.model);
    expect_same_model(train::model_config_of(back.model), c);
  }
  const io::RunConfig old = io::parse_saved_config(
      "[model]\nn_layer = 2\nn_head = 4\nn_embd = 64\nvocab_size = 512\nseq_len = 64\n", "meta.json config");
  model::ModelConfig gpt2 = model::ModelConfig::defaults(model::Family::GPT2);
  gpt2.n_layer = 2;
  gpt2.n_head = 4;
  gpt2.n_embd = 64;
  gpt2.vocab_size = 512;
  gpt2.seq_len = 64;
  expect_same_model(train::model_config_of(old.model), gpt2);
  // Written out, 1e-5f reads "0.00001", not its double expansion.
  EXPECT_EQ(train::model_section_of(gpt2).norm_eps, std::optional<double>(0.00001));
}

// Two models differ by the keys that say so, in table order (what a resume
// or init_from of another model is refused with).
TEST(ModelConfigOf, DifferencesNameTheKeys) {
  const model::ModelConfig gpt2 = model_of({});
  const model::ModelConfig llama =
      model_of({"model.family=llama", "model.n_kv_head=4", "model.ffn_hidden=2304", "model.tie_embeddings=true"});
  std::vector<std::string> keys;
  for (const train::ModelDifference& d : train::model_differences(gpt2, llama)) keys.push_back(d.key);
  EXPECT_EQ(keys, (std::vector<std::string>{"model.family", "model.norm", "model.mlp", "model.position",
                                            "model.n_kv_head", "model.ffn_hidden", "model.bias"}));
  const std::vector<train::ModelDifference> d = train::model_differences(gpt2, llama);
  EXPECT_EQ(d[0].have, "\"gpt2\"");
  EXPECT_EQ(d[0].want, "\"llama\"");
  EXPECT_EQ(d[4].have, "12");
  EXPECT_EQ(d[4].want, "4");
  EXPECT_TRUE(train::model_differences(llama, llama).empty());
  const model::ModelConfig theta = model_of({"model.family=llama", "model.n_kv_head=4", "model.ffn_hidden=2304",
                                             "model.tie_embeddings=true", "model.rope_theta=500000"});
  ASSERT_EQ(train::model_differences(llama, theta).size(), 1u);
  EXPECT_EQ(train::model_differences(llama, theta)[0].key, "model.rope_theta");
  EXPECT_EQ(train::model_differences(llama, theta)[0].want, "500000.0");
}

// The run header's line for the model.
TEST(ModelConfigOf, DescribeModelNamesTheFamilyAndParts) {
  EXPECT_EQ(train::describe_model(model_of({})),
            "gpt2: layernorm, learned positions, gelu 3072, mha 12 heads, biases, tied");
  EXPECT_EQ(train::describe_model(model_of({"model.family=llama"})),
            "llama: rmsnorm, rope(θ=10000), swiglu 2048, mha 12 heads, no bias, untied");
  EXPECT_EQ(train::describe_model(model_of({"model.family=llama", "model.n_kv_head=4", "model.ffn_hidden=2304",
                                            "model.tie_embeddings=true", "model.rope_theta=500000"})),
            "llama: rmsnorm, rope(θ=500000), swiglu 2304, gqa 12q/4kv, no bias, tied");
}

// The parameter counts, by hand:
//
// GPT-2 124M (C = 768, L = 12, V = 50257, T = 1024, F = 4C = 3072, biases, LayerNorm, tied):
//   wte V·C = 38,597,376; wpe T·C = 786,432
//   block: ln_1, ln_2 2·2C = 3,072; c_attn C·3C + 3C = 1,771,776; attn.c_proj C·C + C = 590,592;
//          c_fc C·F + F = 2,362,368; mlp.c_proj F·C + C = 2,360,064; together 7,087,872
//   12 blocks 85,054,464; ln_f 2C = 1,536
//   total 38,597,376 + 786,432 + 85,054,464 + 1,536 = 124,439,808
//
// configs/llama-125m.toml (C = 768, L = 12, V = 50257, 12 query heads and 4
// key/value heads of 64, F = 2304, no biases, RMSNorm, rope, tied):
//   embed_tokens V·C = 38,597,376 (the head, tied, counted once; no position table)
//   block: two RMSNorms 2C = 1,536; q_proj C·C = 589,824; k_proj, v_proj 2·C·256 = 393,216;
//          o_proj C·C = 589,824; gate, up, down 3·C·F = 5,308,416; together 6,882,816
//   12 blocks 82,593,792; final norm C = 768
//   total 38,597,376 + 82,593,792 + 768 = 121,191,936
TEST(ModelConfig, NumParamsOfGpt2SmallAndLlama125m) {
  const model::ModelConfig gpt2 = model::ModelConfig::defaults(model::Family::GPT2);
  EXPECT_EQ(gpt2.num_params(), 124439808);
  const io::RunConfig run = io::load_config(std::string(LATTICE_SOURCE_DIR) + "/configs/gpt2-124m.toml", {});
  EXPECT_EQ(train::checked_model_config(run).num_params(), 124439808);
  const io::RunConfig llama_run = io::load_config(std::string(LATTICE_SOURCE_DIR) + "/configs/llama-125m.toml", {});
  const model::ModelConfig llama = train::checked_model_config(llama_run);
  EXPECT_EQ(llama.num_params(), 121191936);
  EXPECT_EQ(train::describe_model(llama), "llama: rmsnorm, rope(θ=10000), swiglu 2304, gqa 12q/4kv, no bias, tied");
  // Untied, the head is a second V·C matrix.
  model::ModelConfig untied = llama;
  untied.tie_embeddings = false;
  EXPECT_EQ(untied.num_params(), 121191936 + 38597376);
  // configs/llama-tiny.toml is a valid Llama with grouped heads, at tp = 1, 2 and 4.
  for (const char* tp : {"parallel.tp=1", "parallel.tp=2", "parallel.tp=4"}) {
    const io::RunConfig tiny = io::load_config(std::string(LATTICE_SOURCE_DIR) + "/configs/llama-tiny.toml", {tp});
    const model::ModelConfig m = train::checked_model_config(tiny);
    EXPECT_EQ(m.family, model::Family::Llama);
    EXPECT_LT(m.kv_heads(), m.n_head);
  }
}
