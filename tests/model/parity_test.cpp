// Parity with an independent implementation: tools/make_parity_fixture.py
// trains the same GPT-2 in PyTorch (same initial weights, same batches, same
// AdamW recipe) and saved per-step losses, the first step's gradients and the
// final parameters. lattice must reproduce them: losses to 1e-5 relative,
// gradients and parameters to 1e-4.
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

static const std::string kDir = std::string(LATTICE_SOURCE_DIR) + "/tests/model/fixtures/";

static io::JsonValue read_json(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return io::parse_json(ss.str(), path);
}

// Max |a - b| over every tensor of `file` vs the model buffer, in HF layout.
static void expect_close(model::GPT& gpt, const train::GroupBuffer& buffer, const std::string& file, double atol,
                         const char* what) {
  io::SafeTensorsReader ref(kDir + file);
  std::vector<train::HfTensor> ours = train::export_hf(gpt, buffer);
  ASSERT_EQ(ours.size(), ref.tensors().size());
  for (const train::HfTensor& t : ours) {
    const io::TensorEntry& e = ref.get(t.name);
    ASSERT_EQ(e.shape, t.shape) << t.name;
    std::vector<float> want(t.data.size());
    ref.read_f32(t.name, want.data(), want.size());
    double max_err = 0;
    for (size_t i = 0; i < want.size(); i++) max_err = std::max(max_err, std::fabs(double(want[i]) - t.data[i]));
    EXPECT_LE(max_err, atol) << what << " " << t.name;
  }
}

TEST(Parity, TenAdamWStepsMatchPyTorch) {
  set_num_threads(1);
  io::JsonValue expected = read_json(kDir + "expected.json");
  const io::JsonValue& mc = expected.at("model");
  model::ModelConfig cfg;
  cfg.n_layer = static_cast<int>(mc.at("n_layer").as_double());
  cfg.n_head = static_cast<int>(mc.at("n_head").as_double());
  cfg.n_embd = static_cast<int>(mc.at("n_embd").as_double());
  cfg.vocab_size = static_cast<int>(mc.at("vocab_size").as_double());
  cfg.seq_len = static_cast<int>(mc.at("seq_len").as_double());
  const io::JsonValue& tc = expected.at("train");
  const int B = static_cast<int>(tc.at("micro_batch_size").as_double());
  const int T = static_cast<int>(tc.at("seq_len").as_double());
  const int accum = static_cast<int>(tc.at("grad_accum_steps").as_double());
  const int steps = static_cast<int>(tc.at("steps").as_double());
  const io::JsonValue& oc = expected.at("optim");

  model::GPT gpt(cfg, 0);
  train::load_model_safetensors(gpt, train::params_of(gpt), kDir + "init.safetensors");

  io::SafeTensorsReader batch(kDir + "batch.safetensors");
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
  const int warmup = static_cast<int>(oc.at("warmup_steps").as_double());
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
    EXPECT_NEAR(loss, want_loss[s].as_double(), 1e-5 * want_loss[s].as_double()) << "step " << s;
    EXPECT_NEAR(norm, want_norm[s].as_double(), 1e-4 * want_norm[s].as_double()) << "step " << s;
    if (s == 0) {
      expect_close(gpt, [&gpt](size_t g) { return gpt.groups()[g].grad(); }, "grads_step1.safetensors", 1e-6,
                   "first-step gradient");
    }
    opt.step(lr, optim::clip_scale(norm, clip));
  }
  expect_close(gpt, train::params_of(gpt), "final.safetensors", 1e-4, "final parameter");
}
