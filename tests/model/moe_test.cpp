// Mixture of experts on one process (docs/moe.md): the routing arithmetic
// (top-k and its ties, renormalisation, capacity and what it drops, the
// router's backward against finite differences of the same math in double,
// the selection bias's sign rule), the balancing identities through the
// model (aux = α at uniform routing and α·E at collapse, z = β·mean lse²),
// the names of both families, and the mechanics the layouts build on:
// recomputation and the split backward bit-identical, decoding equal to the
// full forward. The layouts themselves: tests/parallel/ep_test.cpp; an
// independent PyTorch MoE: tests/train/moe_reference_test.py.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "lattice/core/error.h"
#include "lattice/layers/expert/routing.h"
#include "lattice/model/gpt.h"
#include "model_variants.h"

using namespace lattice;
using namespace lattice::model;

namespace {

TEST(Routing, TopKBreaksTiesToTheLowerExpertAndRenormalises) {
  const std::vector<float> p = {0.1f, 0.3f, 0.3f, 0.3f};
  int32_t c[2];
  float w[2];
  expert::top_k(c, w, p.data(), nullptr, 1, 4, 2);
  EXPECT_EQ(c[0], 1);
  EXPECT_EQ(c[1], 2);
  EXPECT_FLOAT_EQ(w[0], 0.5f);
  EXPECT_FLOAT_EQ(w[1], 0.5f);
  // The selection bias chooses; the weights stay the probabilities'.
  const std::vector<float> bias = {0.0f, 0.0f, 0.0f, 0.05f};
  expert::top_k(c, w, p.data(), bias.data(), 1, 4, 2);
  EXPECT_EQ(c[0], 3);
  EXPECT_EQ(c[1], 1);
  EXPECT_FLOAT_EQ(w[0], 0.5f);
  // k = 1 (Switch): the probability itself, not renormalised to 1.
  const std::vector<float> q = {0.2f, 0.7f, 0.1f};
  expert::top_k(c, w, q.data(), nullptr, 1, 3, 1);
  EXPECT_EQ(c[0], 1);
  EXPECT_FLOAT_EQ(w[0], 0.7f);
}

TEST(Routing, CapacityDropsTheLowestProbabilitiesAndThenTheLaterTokens) {
  EXPECT_EQ(expert::expert_capacity(10, 2, 4, 1.0), 5);
  EXPECT_EQ(expert::expert_capacity(7, 2, 4, 1.25), 5);  // ceil(4.375)
  EXPECT_EQ(expert::expert_capacity(8, 1, 8, 1.0), 1);
  // Four tokens, k = 1, all to expert 0, capacity 2: keep the 0.9 and the
  // first of the two 0.5s (the later token is dropped on a tie).
  const int E = 2;
  const std::vector<float> probs = {0.5f, 0.5f, 0.9f, 0.1f, 0.5f, 0.5f, 0.2f, 0.8f};
  const std::vector<int32_t> choice = {0, 0, 0, 0};
  std::vector<uint8_t> kept(4, 1);
  EXPECT_EQ(expert::drop_over_capacity(kept.data(), choice.data(), probs.data(), 4, E, 1, 2), 2);
  EXPECT_EQ(kept, (std::vector<uint8_t>{1, 1, 0, 0}));
}

TEST(Routing, SelectionBiasFollowsTheSignOfMeanMinusLoad) {
  std::vector<float> b = {0, 0, 0, 0};
  const std::vector<double> load = {1, 5, 3, 3};
  expert::update_selection_bias(b.data(), load.data(), 4, 0.01);
  EXPECT_FLOAT_EQ(b[0], 0.01f);
  EXPECT_FLOAT_EQ(b[1], -0.01f);
  EXPECT_FLOAT_EQ(b[2], 0.0f);
  EXPECT_FLOAT_EQ(b[3], 0.0f);
}

// The router's loss as a function of its logits, in double, for a fixed
// choice of experts (top-k is constant between ties): Σ g_tj·w_tj +
// scale·(Σ_e aux_e·Σ_t p_te + (z/2)·Σ_t lse_t²), aux_e = α·E·f_e/N, z = 2β/N.
double router_loss(const std::vector<double>& logits, const std::vector<int32_t>& choice, const std::vector<double>& g,
                   const std::vector<double>& aux, double z, double scale, int R, int E, int k) {
  double L = 0;
  for (int t = 0; t < R; t++) {
    double m = -1e300, sum = 0;
    for (int e = 0; e < E; e++) m = std::max(m, logits[t * E + e]);
    for (int e = 0; e < E; e++) sum += std::exp(logits[t * E + e] - m);
    const double lse = m + std::log(sum);
    std::vector<double> p(E);
    for (int e = 0; e < E; e++) p[e] = std::exp(logits[t * E + e] - lse);
    double S = 0;
    for (int j = 0; j < k; j++) S += p[choice[t * k + j]];
    for (int j = 0; j < k; j++) L += g[t * k + j] * (k == 1 ? p[choice[t * k]] : p[choice[t * k + j]] / S);
    for (int e = 0; e < E; e++) L += scale * aux[e] * p[e];
    L += scale * 0.5 * z * lse * lse;
  }
  return L;
}

TEST(Routing, RouterBackwardMatchesFiniteDifferences) {
  for (int k : {1, 2, 3}) {
    const int R = 5, E = 6;
    std::vector<float> logits(R * E), probs(R * E), lse(R), weight(R * k), dlogits(R * E);
    std::vector<int32_t> choice(R * k);
    for (int i = 0; i < R * E; i++) logits[i] = std::sin(1.7f * i + k) * 2.0f;
    expert::router_softmax(probs.data(), lse.data(), logits.data(), R, E);
    expert::top_k(choice.data(), weight.data(), probs.data(), nullptr, R, E, k);
    std::vector<float> dw(R * k);
    std::vector<double> g(R * k), aux(E);
    for (int i = 0; i < R * k; i++) g[i] = dw[i] = std::cos(0.9f * i) * 0.5f;
    for (int e = 0; e < E; e++) aux[e] = 0.01 * E * (e + 1) / 21.0 / R;
    const double z = 2 * 0.003 / R, scale = 0.75;
    expert::router_backward(dlogits.data(), dw.data(), probs.data(), lse.data(), choice.data(), weight.data(),
                            aux.data(), z, static_cast<float>(scale), R, E, k);
    std::vector<double> x(logits.begin(), logits.end());
    for (int i = 0; i < R * E; i++) {
      const double h = 1e-5;
      std::vector<double> a = x, b = x;
      a[i] += h, b[i] -= h;
      const double fd = (router_loss(a, choice, g, aux, z, scale, R, E, k) -
                         router_loss(b, choice, g, aux, z, scale, R, E, k)) /
                        (2 * h);
      EXPECT_NEAR(dlogits[i], fd, 2e-5 + 1e-4 * std::fabs(fd)) << "k=" << k << " logit " << i;
    }
  }
}

ModelConfig moe_config(Family family, int E, int k) {
  ModelConfig c = family == Family::GPT2 ? ModelConfig{} : ModelConfig::defaults(Family::Llama);
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 32;
  c.vocab_size = 101;
  c.seq_len = 16;
  c.n_experts = E;
  c.top_k = k;
  c.moe_ffn_hidden = 48;
  return c;
}

void set_param(GPT& m, const std::string& name, const std::function<float(int64_t)>& value) {
  auto [g, i] = m.find_param(name);
  ASSERT_NE(g, nullptr) << name;
  float* p = g->param(i);
  for (int64_t j = 0; j < g->params()[i].numel(); j++) p[j] = value(j);
  m.params_changed();
}

// One training forward (and backward) of a micro-batch; returns the loss.
float step(GPT& m, int B, int T, uint64_t seed) {
  const auto in = model::testing::random_tokens(B * T, m.config().vocab_size, seed);
  const auto tg = model::testing::random_tokens(B * T, m.config().vocab_size, seed + 1);
  m.zero_grad();
  const float loss = m.forward(0, in.data(), tg.data(), B, T, 1.0f);
  m.backward(0);
  return loss;
}

TEST(Moe, AuxLossIsAlphaAtUniformRoutingAndAlphaTimesEAtCollapse) {
  const int E = 4;
  ModelConfig c = moe_config(Family::GPT2, E, 2);
  GPT m(c, 7);
  parts::MoeOptions o;
  o.aux_loss_coef = 0.01;
  o.z_loss_coef = 0.001;
  m.set_moe_options(o);
  // A zero router: every p = 1/E, whatever the tokens (P_i = 1/E, Σ f = 1).
  for (int l = 0; l < 2; l++) set_param(m, "h." + std::to_string(l) + ".mlp.router.weight", [](int64_t) { return 0.0f; });
  m.reset_moe_stats();
  step(m, 2, 16, 3);
  for (int l = 0; l < 2; l++) {
    const parts::MoeStats& s = m.moe_stats()[l];
    ASSERT_EQ(s.micro_batches, 1);
    EXPECT_NEAR(s.aux, 0.01, 1e-9) << "layer " << l;
    EXPECT_NEAR(s.z, 0.001 * std::log(4.0) * std::log(4.0), 1e-8) << "layer " << l;  // lse = log E
    // Ties go to the lower experts: 0 and 1 take every pair.
    EXPECT_EQ(s.load, (std::vector<double>{32, 32, 0, 0}));
    EXPECT_EQ(s.pairs, 64);
  }
  // Collapse (k = 1): norm₂'s output is the same vector for every token
  // (weight 0, bias 1) and the router sends it to expert 0 with p ≈ 1.
  ModelConfig c1 = moe_config(Family::GPT2, E, 1);
  GPT m1(c1, 7);
  m1.set_moe_options(o);
  for (int l = 0; l < 2; l++) {
    const std::string h = "h." + std::to_string(l) + ".";
    set_param(m1, h + "ln_2.weight", [](int64_t) { return 0.0f; });
    set_param(m1, h + "ln_2.bias", [](int64_t) { return 1.0f; });
    set_param(m1, h + "mlp.router.weight", [&](int64_t i) { return i < c1.n_embd ? 1.0f : 0.0f; });
  }
  m1.reset_moe_stats();
  step(m1, 2, 16, 3);
  for (int l = 0; l < 2; l++) {
    const parts::MoeStats& s = m1.moe_stats()[l];
    EXPECT_NEAR(s.aux, 0.01 * E, 1e-9) << "layer " << l;
    EXPECT_EQ(s.load, (std::vector<double>{32, 0, 0, 0}));
  }
}

TEST(Moe, NamesAndParameterCountsFollowEachFamily) {
  for (Family f : {Family::GPT2, Family::Llama}) {
    ModelConfig c = moe_config(f, 4, 2);
    c.n_shared_experts = 1;
    c.moe_every = 2;  // layer 1 only
    GPT m(c, GPT::Unallocated{});
    int64_t n = 0;
    std::vector<std::string> names;
    for (const ParamGroup& g : m.groups())
      for (const ParamInfo& p : g.params()) {
        names.push_back(p.name);
        n += p.numel();
      }
    const int64_t padding = static_cast<int64_t>(c.padded_vocab() - c.vocab_size) * c.n_embd *
                            (c.tie_embeddings ? 1 : 2);
    EXPECT_EQ(n - padding, c.num_params()) << name_of(f);
    auto has = [&](const std::string& s) { return std::find(names.begin(), names.end(), s) != names.end(); };
    if (f == Family::GPT2) {
      EXPECT_TRUE(has("h.1.mlp.router.weight"));
      EXPECT_TRUE(has("h.1.mlp.experts.3.c_fc.weight"));
      EXPECT_TRUE(has("h.1.mlp.experts.0.c_proj.bias"));
      EXPECT_TRUE(has("h.1.mlp.shared_experts.c_fc.weight"));
      EXPECT_TRUE(has("h.0.mlp.c_fc.weight"));  // a dense layer
      EXPECT_FALSE(has("h.0.mlp.router.weight"));
    } else {
      EXPECT_TRUE(has("model.layers.1.block_sparse_moe.gate.weight"));
      EXPECT_TRUE(has("model.layers.1.block_sparse_moe.experts.2.w1.weight"));
      EXPECT_TRUE(has("model.layers.1.block_sparse_moe.experts.2.w2.weight"));
      EXPECT_TRUE(has("model.layers.1.block_sparse_moe.experts.2.w3.weight"));
      EXPECT_TRUE(has("model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight"));
      EXPECT_TRUE(has("model.layers.0.mlp.gate_proj.weight"));
    }
    // Active parameters: k of the E experts.
    EXPECT_EQ(c.num_params() - c.active_params(), 2 * c.expert_params());
  }
}

std::vector<float> all_grads(GPT& m) {
  std::vector<float> out;
  for (ParamGroup& g : m.groups()) {
    g.zero_unwritten_grads();
    out.insert(out.end(), g.grad_storage(), g.grad_storage() + g.numel());
  }
  return out;
}

TEST(Moe, RecomputationAndTheSplitBackwardAreBitIdentical) {
  for (Family f : {Family::GPT2, Family::Llama}) {
    ModelConfig c = moe_config(f, 4, 2);
    c.n_shared_experts = 1;
    c.moe_every = 1;
    parts::MoeOptions o;
    o.z_loss_coef = 0.001;
    GPT ref(c, 11);
    ref.set_moe_options(o);
    ref.reset_moe_stats();
    const float loss = step(ref, 2, 16, 5);
    const std::vector<float> want = all_grads(ref);
    for (Recompute r : {Recompute::Selective, Recompute::Full}) {
      GPT m(c, 11);
      m.set_moe_options(o);
      m.set_recompute({r, r});
      m.reset_moe_stats();
      EXPECT_EQ(step(m, 2, 16, 5), loss);
      EXPECT_EQ(all_grads(m), want) << name_of(f) << " recompute " << static_cast<int>(r);
      for (int l = 0; l < 2; l++) {  // routed once: counts and losses not counted again
        EXPECT_EQ(m.moe_stats()[l].load, ref.moe_stats()[l].load);
        EXPECT_EQ(m.moe_stats()[l].aux, ref.moe_stats()[l].aux);
        EXPECT_EQ(m.moe_stats()[l].micro_batches, 1);
      }
    }
    GPT split(c, 11);
    split.set_moe_options(o);
    const auto in = model::testing::random_tokens(32, c.vocab_size, 5), tg = model::testing::random_tokens(32, c.vocab_size, 6);
    split.zero_grad();
    EXPECT_EQ(split.forward(0, in.data(), tg.data(), 2, 16, 1.0f), loss);
    split.backward_input(0);
    split.backward_weight(0);
    EXPECT_EQ(all_grads(split), want) << name_of(f) << " split backward";
  }
}

TEST(Moe, DecodingEqualsTheFullForward) {
  ModelConfig c = moe_config(Family::Llama, 4, 2);
  GPT m(c, 13);
  const auto tokens = model::testing::random_tokens(10, c.vocab_size, 9);
  const float* full = m.last_logits(tokens.data(), 1, 10);
  const std::vector<float> want(full, full + c.padded_vocab());
  m.decode_reset();
  m.decode(tokens.data(), 6);
  const float* got = m.decode(tokens.data() + 6, 4);
  for (int v = 0; v < c.vocab_size; v++) EXPECT_NEAR(got[v], want[v], 1e-4) << v;
}

TEST(Moe, RefusesShapesItCannotBuild) {
  ModelConfig c = moe_config(Family::GPT2, 4, 5);
  EXPECT_THROW(
      {
        try {
          c.validate();
        } catch (const lattice::Error& e) {
          EXPECT_NE(std::string(e.what()).find("model.top_k=5 must be in [1, model.n_experts=4]"), std::string::npos)
              << e.what();
          throw;
        }
      },
      lattice::Error);
}

}  // namespace
