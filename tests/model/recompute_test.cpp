// Activation recomputation (model/recompute.h, docs/recompute.md): on every
// model variant of model_variants.h, at f32, bf16 and f16, with the fused and
// the split backward, every policy (selective, full, the first N layers,
// every k-th, a mix) trains bit for bit as recompute none does — losses,
// every gradient, and the parameters after a few AdamW steps — while the
// activations a slot stores per layer, measured by the MemoryTracker, are
// what the formula of docs/recompute.md says.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "lattice/core/dtype.h"
#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/model/gpt.h"
#include "lattice/model/recompute.h"
#include "lattice/optim/adamw.h"
#include "activation_formulas.h"
#include "model_variants.h"

using namespace lattice;
using namespace lattice::model;
using lattice::model::testing::as_variant;
using lattice::model::testing::korthikanti_bytes;
using lattice::model::testing::stored_bytes_per_layer;
using lattice::model::testing::widths_of;
using lattice::model::testing::four_layers;
using lattice::model::testing::random_tokens;
using lattice::model::testing::Variant;

namespace {

constexpr int B = 4, T = 16;

struct Policy {
  const char* name;
  RecomputeSpec spec;
};

// Selective and full everywhere, full on the first layer only (first = 1),
// selective on every other layer (0 and 2), and full on layers 0 and 3 with
// selective on 1: a policy that mixes the three modes layer by layer.
const Policy kPolicies[] = {
    {"selective", {Recompute::Selective, 1, 0}},
    {"full", {Recompute::Full, 1, 0}},
    {"full first 1", {Recompute::Full, 1, 1}},
    {"selective every 2", {Recompute::Selective, 2, 0}},
};

std::vector<Recompute> mixed() { return {Recompute::Full, Recompute::Selective, Recompute::None, Recompute::Full}; }

// What a run leaves to compare: each step's two losses, the gradients of the
// last step and the parameters at the end.
struct Trace {
  std::vector<float> losses;
  std::vector<std::vector<float>> grads, params;
};

// Three AdamW steps of two micro-batches each, both in flight at once: fused
// (F0 F1 B1 B0) or split (F0 F1 I1 I0 W0 W1: the weight halves after both
// input halves, as zero-bubble schedules order them).
Trace train(const ModelConfig& c, DType dtype, bool split, const std::vector<Recompute>& policy) {
  GPT gpt(c, 5);
  gpt.set_compute_dtype(dtype);
  gpt.set_recompute(policy);
  optim::AdamW opt(gpt.groups(), optim::AdamWConfig{0.9f, 0.95f, 1e-8f, 0.1f});
  Trace t;
  for (int step = 0; step < 3; step++) {
    const auto in0 = random_tokens(B * T, c.vocab_size, 10 * step + 1);
    const auto tg0 = random_tokens(B * T, c.vocab_size, 10 * step + 2);
    const auto in1 = random_tokens(B * T, c.vocab_size, 10 * step + 3);
    const auto tg1 = random_tokens(B * T, c.vocab_size, 10 * step + 4);
    gpt.zero_grad();
    t.losses.push_back(gpt.forward(0, in0.data(), tg0.data(), B, T, 0.5f));
    t.losses.push_back(gpt.forward(1, in1.data(), tg1.data(), B, T, 0.5f));
    if (split) {
      gpt.backward_input(1);
      gpt.backward_input(0);
      gpt.backward_weight(0);
      gpt.backward_weight(1);
    } else {
      gpt.backward(1);
      gpt.backward(0);
    }
    t.grads.clear();
    for (ParamGroup& g : gpt.groups()) t.grads.emplace_back(g.grad(), g.grad() + g.numel());
    opt.step(1e-2f, 1.0f);
    gpt.params_changed();
  }
  for (ParamGroup& g : gpt.groups()) t.params.emplace_back(g.data(), g.data() + g.numel());
  return t;
}

void expect_bitwise(const Trace& got, const Trace& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t i = 0; i < want.losses.size(); i++) EXPECT_EQ(got.losses[i], want.losses[i]) << what << " loss " << i;
  ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
  for (size_t g = 0; g < want.grads.size(); g++)
    EXPECT_EQ(0, std::memcmp(got.grads[g].data(), want.grads[g].data(), 4 * want.grads[g].size()))
        << what << " gradient of group " << g;
  for (size_t g = 0; g < want.params.size(); g++)
    EXPECT_EQ(0, std::memcmp(got.params[g].data(), want.params[g].data(), 4 * want.params[g].size()))
        << what << " parameters of group " << g;
}

class Recomputation : public ::testing::TestWithParam<Variant> {
 protected:
  static ModelConfig config() { return as_variant(four_layers(), GetParam()); }
};
INSTANTIATE_TEST_SUITE_P(, Recomputation, lattice::model::testing::kAllVariants);

TEST_P(Recomputation, EveryPolicyTrainsBitIdenticallyToNone) {
  const ModelConfig c = config();
  for (DType dtype : {DType::F32, DType::BF16, DType::F16})
    for (bool split : {false, true}) {
      const Trace none = train(c, dtype, split, {});
      const std::string where = std::string(dtype_name(dtype)) + (split ? " split" : " fused");
      for (const Policy& p : kPolicies)
        expect_bitwise(train(c, dtype, split, recompute_policy(p.spec, 0, c.n_layer)), none, where + " " + p.name);
      expect_bitwise(train(c, dtype, split, mixed()), none, where + " mixed");
    }
}

// Between a micro-batch's backward_input and backward_weight, another
// micro-batch's forward and an evaluation of another size run (they reuse
// the one-layer work arrays): the weight half reads what the input half kept.
TEST_P(Recomputation, SplitBackwardKeepsWhatTheWeightHalfNeeds) {
  const ModelConfig c = config();
  const auto in = random_tokens(B * T, c.vocab_size, 61), tg = random_tokens(B * T, c.vocab_size, 62);
  for (DType dtype : {DType::F32, DType::BF16})
    for (Recompute mode : {Recompute::Selective, Recompute::Full}) {
      const std::string what = std::string(dtype_name(dtype)) + " " + recompute_name(mode);
      GPT a(c, 11), b(c, 11);
      a.set_compute_dtype(dtype), b.set_compute_dtype(dtype);
      b.set_recompute(std::vector<Recompute>(c.n_layer, mode));
      a.forward(0, in.data(), tg.data(), B, T, 1.0f);
      a.backward(0);
      b.forward(0, in.data(), tg.data(), B, T, 1.0f);
      b.backward_input(0);
      b.forward(1, tg.data(), in.data(), B, T, 1.0f);
      b.evaluate(in.data(), tg.data(), 1, 8);
      b.backward_weight(0);
      for (size_t g = 0; g < a.groups().size(); g++)
        EXPECT_EQ(0, std::memcmp(a.groups()[g].grad(), b.groups()[g].grad(), 4 * a.groups()[g].numel()))
            << what << " group " << g;
      b.release(1);
    }
}

TEST_P(Recomputation, EvaluationIsUnchanged) {
  const ModelConfig c = config();
  const auto in = random_tokens(B * T, c.vocab_size, 71), tg = random_tokens(B * T, c.vocab_size, 72);
  GPT a(c, 3), b(c, 3);
  b.set_recompute(std::vector<Recompute>(c.n_layer, Recompute::Full));
  EXPECT_EQ(a.evaluate(in.data(), tg.data(), B, T), b.evaluate(in.data(), tg.data(), B, T));
}

TEST(RecomputePolicy, ChoosesLayersAndRefusesMisuse) {
  using R = Recompute;
  EXPECT_EQ(recompute_policy({R::Full, 1, 0}, 4, 8), std::vector<R>(4, R::Full));
  EXPECT_EQ(recompute_policy({R::Selective, 3, 0}, 0, 7),
            (std::vector<R>{R::Selective, R::None, R::None, R::Selective, R::None, R::None, R::Selective}));
  // every counts global layer indices; first counts from the stage's first layer.
  EXPECT_EQ(recompute_policy({R::Full, 2, 0}, 3, 7), (std::vector<R>{R::None, R::Full, R::None, R::Full}));
  EXPECT_EQ(recompute_policy({R::Full, 1, 2}, 3, 7), (std::vector<R>{R::Full, R::Full, R::None, R::None}));
  EXPECT_EQ(recompute_policy({R::None, 1, 0}, 0, 3), std::vector<R>(3, R::None));
  EXPECT_EQ(recompute_from_name("selective"), R::Selective);
  try {
    recompute_from_name("some");
    ADD_FAILURE() << "\"some\" was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "recompute.mode must be one of none, selective, full, got \"some\"");
  }
  GPT gpt(four_layers(), 1);
  EXPECT_THROW(gpt.set_recompute(std::vector<R>(3, R::Full)), Error) << "3 entries for 4 layers";
  const auto in = random_tokens(B * T, 101, 1);
  gpt.forward(0, in.data(), in.data(), B, T, 1.0f);
  EXPECT_THROW(gpt.set_recompute(std::vector<R>(4, R::Full)), Error) << "a micro-batch in flight";
}

// ------------------------------------------------------------------ memory --

// Activation bytes a training forward of one micro-batch leaves allocated
// (the slot, its tokens, and the one-layer work arrays), on a model of L
// layers under `r`; the difference of two depths is the per-layer share.
double forward_bytes(ModelConfig c, int L, DType dtype, Recompute r, int b, int s, size_t* stored = nullptr) {
  c.n_layer = L;
  GPT gpt(c, 7);
  gpt.set_compute_dtype(dtype);
  gpt.set_recompute(std::vector<Recompute>(L, r));
  const auto in = random_tokens(b * s, c.vocab_size, 1);
  const size_t before = MemoryTracker::instance().current(MemCategory::Activations);
  gpt.forward(0, in.data(), in.data(), b, s, 1.0f);
  const size_t after = MemoryTracker::instance().current(MemCategory::Activations);
  if (stored) *stored = gpt.stored_activation_bytes(b, s);
  EXPECT_EQ(after - before, gpt.stored_activation_bytes(b, s) + gpt.work16_bytes(b, s));
  return static_cast<double>(after - before);
}

TEST_P(Recomputation, StoredBytesPerLayerFollowTheFormula) {
  ModelConfig c = config();
  c.n_embd = 64, c.seq_len = 32;
  const int b = 2, s = 32;
  GPT dims_of(c, 1);
  const GPT::Dims& d = dims_of.dims();
  const double N = b * s;
  if (GetParam() == Variant::GPT2)
    std::printf("stored activation bytes per layer, b=%d s=%d h=%d a=%d (%s)\n", b, s, d.C, d.NH,
                lattice::model::testing::variant_name(GetParam()));
  for (DType dtype : {DType::F32, DType::BF16}) {
    const double e = dtype == DType::F32 ? 4 : 2;
    for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      const double measured = forward_bytes(c, 3, dtype, r, b, s) - forward_bytes(c, 2, dtype, r, b, s);
      const double formula = stored_bytes_per_layer(r, e, N, N, widths_of(d));
      if (GetParam() == Variant::GPT2)
        std::printf("  %-4s %-9s measured %8.0f  formula %8.0f  Korthikanti (16-bit) %8.0f\n", dtype_name(dtype),
                    recompute_name(r), measured, formula, korthikanti_bytes(r, s, b, d.C, d.NH));
      EXPECT_NEAR(measured, formula, 0.05 * formula) << dtype_name(dtype) << " " << recompute_name(r);
    }
  }
}

// The one-layer work arrays do not grow with depth: at 8 layers full
// recomputation stores less than a third of none's activations in all.
TEST_P(Recomputation, FullRecomputationStoresTheLayerInputsOnly) {
  ModelConfig c = config();
  const double none = forward_bytes(c, 8, DType::F32, Recompute::None, B, T);
  const double full = forward_bytes(c, 8, DType::F32, Recompute::Full, B, T);
  const double selective = forward_bytes(c, 8, DType::F32, Recompute::Selective, B, T);
  EXPECT_LT(full, none / 3) << "full " << full << " none " << none;
  EXPECT_LT(selective, none) << "selective " << selective << " none " << none;
}

}  // namespace
