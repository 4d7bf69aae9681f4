// Parity with an independent implementation: a PyTorch model trained with the
// same initial weights, the same batches and the same AdamW recipe saved its
// per-step losses, the first step's gradients and the final parameters, and
// lattice must reproduce them. One test per fixture directory:
//   gpt2       tests/model/fixtures/            tools/make_parity_fixture.py
//   llama_kv4  tests/model/fixtures/llama_kv4/  tools/make_llama_parity_fixture.py
//   llama_kv2  ... llama_kv1: the same Llama with 2 and 1 key/value heads
// The model is built from expected.json's "model" section, spelled as
// lattice's model keys (ModelConfig::defaults of its family, then each key).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "lattice/core/threads.h"
#include "lattice/io/json.h"
#include "lattice/io/safetensors.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/train/model_io.h"

using namespace lattice;

namespace {

// How close lattice (fp32) must come to the fixture. Each fixture's
// expected.json has "fp32_vs_fp64_same_run": the same PyTorch run in float64,
// i.e. how far fp32 rounding alone moves each number; the bounds sit above it.
struct Tolerances {
  double loss_rel;       // per-step loss, relative
  double grad_norm_rel;  // per-step pre-clip gradient norm, relative
  double grad_atol;      // first-step gradient, max |Δ| per tensor
  double grad_rel_l2;    // first-step gradient, ‖Δ‖/‖g‖ per tensor (0: not checked)
  double final_atol;     // final parameters, max |Δ| per tensor
  double final_rel_l2;   // final parameters, ‖Δ‖/‖p‖ per tensor (0: not checked)
};

struct Fixture {
  const char* name;    // the test's name
  const char* subdir;  // under tests/model/fixtures/
  Tolerances tol;
};

// GPT-2: the bounds this test has always held it to.
constexpr Tolerances kGpt2Tolerances{1e-5, 1e-4, 1e-6, 0, 1e-4, 0};
// Llama (measurements: tools/README.md): the q_proj and k_proj gradients are
// small (|g| ≤ 2.3e-4: attention is nearly uniform at this init), so 1e-6
// absolute alone would hold them to ~1%; every gradient is also held to 1e-5
// relative per tensor (fp64 study: ≤ 4.3e-7). Final parameters: the fp64
// study moves single elements by up to 7.6e-5 (an element whose gradient is
// near zero in some step: Adam turns its rounding noise into updates), the
// 99.9th percentile by ~1e-5; 3e-4 absolute and 2e-4 ‖Δ‖/‖p‖ (measured
// ≤ 5e-5) leave room for lattice's own rounding. Losses measured ≤ 2.1e-7
// relative, grad norms ≤ 7.4e-6.
constexpr Tolerances kLlamaTolerances{1e-5, 1e-4, 1e-6, 1e-5, 3e-4, 2e-4};

const Fixture kFixtures[] = {
    {"gpt2", "", kGpt2Tolerances},
    {"llama_kv4", "llama_kv4/", kLlamaTolerances},
    {"llama_kv2", "llama_kv2/", kLlamaTolerances},
    {"llama_kv1", "llama_kv1/", kLlamaTolerances},
};

// The case's name in gtest's messages and in CTest's test names.
void PrintTo(const Fixture& f, std::ostream* os) { *os << f.name; }

std::string fixture_dir(const Fixture& f) {
  return std::string(LATTICE_SOURCE_DIR) + "/tests/model/fixtures/" + f.subdir;
}

io::JsonValue read_json(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return io::parse_json(ss.str(), path);
}

int as_int(const io::JsonValue& v) { return static_cast<int>(v.as_double()); }

// expected.json's "model" section as a ModelConfig: the defaults of its
// family (GPT-2 when the key is absent, as in the GPT-2 fixture), then every
// key present. A key this reader does not know fails the test rather than
// being ignored.
model::ModelConfig model_config_of(const io::JsonValue& mc) {
  const io::JsonValue* family = mc.find("family");
  model::ModelConfig cfg =
      model::ModelConfig::defaults(family ? model::parse_family(family->as_string()) : model::Family::GPT2);
  for (const io::JsonValue::Member& m : mc.as_object()) {
    const std::string& key = m.first;
    const io::JsonValue& v = m.second;
    if (key == "family") continue;
    if (key == "n_layer") cfg.n_layer = as_int(v);
    else if (key == "n_head") cfg.n_head = as_int(v);
    else if (key == "n_embd") cfg.n_embd = as_int(v);
    else if (key == "vocab_size") cfg.vocab_size = as_int(v);
    else if (key == "seq_len") cfg.seq_len = as_int(v);
    else if (key == "n_kv_head") cfg.n_kv_head = as_int(v);
    else if (key == "ffn_hidden") cfg.ffn_hidden = as_int(v);
    else if (key == "rope_theta") cfg.rope_theta = static_cast<float>(v.as_double());
    else if (key == "norm_eps") cfg.norm_eps = static_cast<float>(v.as_double());
    else if (key == "norm") cfg.norm = model::parse_norm(v.as_string());
    else if (key == "mlp") cfg.mlp = model::parse_mlp(v.as_string());
    else if (key == "position") cfg.position = model::parse_position(v.as_string());
    else if (key == "bias") cfg.bias = v.as_bool();
    else if (key == "tie_embeddings") cfg.tie_embeddings = v.as_bool();
    else ADD_FAILURE() << "expected.json: model key '" << key << "' is not known to this test";
  }
  return cfg;
}

// Every tensor of `file` against the model buffer, in HF layout: max |a - b|
// within `atol`, and ‖a - b‖ / ‖b‖ within `rel_l2` when that is > 0.
void expect_close(model::GPT& gpt, const train::GroupBuffer& buffer, const std::string& path, double atol,
                  double rel_l2, const char* what) {
  io::SafeTensorsReader ref(path);
  std::vector<train::HfTensor> ours = train::export_hf(gpt, buffer);
  ASSERT_EQ(ours.size(), ref.tensors().size()) << path;
  for (const train::HfTensor& t : ours) {
    const io::TensorEntry& e = ref.get(t.name);
    ASSERT_EQ(e.shape, t.shape) << t.name;
    std::vector<float> want(t.data.size());
    ref.read_f32(t.name, want.data(), want.size());
    double max_err = 0, diff2 = 0, ref2 = 0;
    for (size_t i = 0; i < want.size(); i++) {
      const double d = double(want[i]) - t.data[i];
      max_err = std::max(max_err, std::fabs(d));
      diff2 += d * d;
      ref2 += double(want[i]) * want[i];
    }
    EXPECT_LE(max_err, atol) << what << " " << t.name;
    if (rel_l2 > 0) {
      EXPECT_LE(std::sqrt(diff2 / ref2), rel_l2) << what << " " << t.name << " (relative L2)";
    }
  }
}

class Parity : public ::testing::TestWithParam<Fixture> {};

TEST_P(Parity, TenAdamWStepsMatchPyTorch) {
  const Fixture& fixture = GetParam();
  const Tolerances& tol = fixture.tol;
  const std::string dir = fixture_dir(fixture);
  set_num_threads(1);
  io::JsonValue expected = read_json(dir + "expected.json");
  const model::ModelConfig cfg = model_config_of(expected.at("model"));
  const io::JsonValue& tc = expected.at("train");
  const int B = as_int(tc.at("micro_batch_size"));
  const int T = as_int(tc.at("seq_len"));
  const int accum = as_int(tc.at("grad_accum_steps"));
  const int steps = as_int(tc.at("steps"));
  const io::JsonValue& oc = expected.at("optim");

  model::GPT gpt(cfg, 0);
  train::load_model_safetensors(gpt, train::params_of(gpt), dir + "init.safetensors");

  io::SafeTensorsReader batch(dir + "batch.safetensors");
  std::vector<float> tok(static_cast<size_t>(accum) * B * (T + 1));
  batch.read_f32("tokens", tok.data(), tok.size());
  std::vector<std::vector<int32_t>> inputs(accum), targets(accum);
  for (int m = 0; m < accum; m++)
    for (int b = 0; b < B; b++)
      for (int t = 0; t < T; t++) {
        inputs[m].push_back(static_cast<int32_t>(tok[(m * B + b) * (T + 1) + t]));
        targets[m].push_back(static_cast<int32_t>(tok[(m * B + b) * (T + 1) + t + 1]));
      }

  optim::AdamWConfig ac;
  ac.beta1 = static_cast<float>(oc.at("beta1").as_double());
  ac.beta2 = static_cast<float>(oc.at("beta2").as_double());
  ac.eps = static_cast<float>(oc.at("eps").as_double());
  ac.weight_decay = static_cast<float>(oc.at("weight_decay").as_double());
  optim::AdamW opt(gpt.groups(), ac);
  const float max_lr = static_cast<float>(oc.at("lr").as_double());
  const float min_lr = static_cast<float>(oc.at("min_lr").as_double());
  const int warmup = as_int(oc.at("warmup_steps"));
  const float clip = static_cast<float>(oc.at("grad_clip").as_double());
  const auto& want_loss = expected.at("loss").as_array();
  const auto& want_norm = expected.at("grad_norm").as_array();
  const auto& want_lr = expected.at("lr").as_array();

  for (int s = 0; s < steps; s++) {
    gpt.zero_grad();
    double loss = 0;
    for (int m = 0; m < accum; m++) {
      loss += gpt.forward(0, inputs[m].data(), targets[m].data(), B, T, 1.0f / accum);
      gpt.backward(0);
    }
    loss /= accum;
    double norm = optim::global_grad_norm(gpt.groups());
    float lr = optim::lr_at(s, steps, warmup, max_lr, min_lr);
    EXPECT_NEAR(lr, want_lr[s].as_double(), 1e-7 * want_lr[s].as_double()) << "step " << s;
    EXPECT_NEAR(loss, want_loss[s].as_double(), tol.loss_rel * want_loss[s].as_double()) << "step " << s;
    EXPECT_NEAR(norm, want_norm[s].as_double(), tol.grad_norm_rel * want_norm[s].as_double()) << "step " << s;
    if (s == 0) {
      expect_close(gpt, [&gpt](size_t g) { return gpt.groups()[g].grad(); }, dir + "grads_step1.safetensors",
                   tol.grad_atol, tol.grad_rel_l2, "first-step gradient");
    }
    opt.step(lr, optim::clip_scale(norm, clip));
  }
  expect_close(gpt, train::params_of(gpt), dir + "final.safetensors", tol.final_atol, tol.final_rel_l2,
               "final parameter");
}

// gtest numbers the cases (.../0 is gpt2); CTest names them by PrintTo
// (Fixtures/Parity.TenAdamWStepsMatchPyTorch/llama_kv2).
INSTANTIATE_TEST_SUITE_P(Fixtures, Parity, ::testing::ValuesIn(kFixtures));

}  // namespace
