// The model as pipeline stages: a GPT built for layers [first, last) runs
// exactly its share of the whole model's arithmetic. Chained (output
// activation forward, input gradient backward) the stages give the whole
// model's loss and every gradient bitwise — a tied token embedding's as the
// sum of the first stage's lookup share and the last stage's head share; an
// untied head lives in the final group of the last stage. Recomputation
// per stage changes nothing. On every model variant of model_variants.h
// (in CTest PipelineStages.X/gpt2, /llama_gqa, ...).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../io/test_util.h"
#include "lattice/core/error.h"
#include "lattice/model/gpt.h"
#include "lattice/model/recompute.h"
#include "model_variants.h"

using namespace lattice;
using namespace lattice::model;
using lattice::model::testing::as_variant;
using lattice::model::testing::four_layers;
using lattice::model::testing::Variant;

namespace {

constexpr int B = 2, T = 16;

std::vector<int32_t> ids(int seed) {
  std::vector<int32_t> v(B * T);
  for (int i = 0; i < B * T; i++) v[i] = (i * 37 + seed * 11 + 1) % 101;
  return v;
}

const ParamGroup* group_named(const GPT& g, const std::string& name) {
  for (const ParamGroup& p : g.groups())
    if (p.name() == name) return &p;
  return nullptr;
}

// Runs `micro` micro-batches through the stages (cuts: layer boundaries),
// split (backward_input, then backward_weight) or fused; returns the losses.
std::vector<float> run_stages(std::vector<std::unique_ptr<GPT>>& stages, int micro, bool split) {
  for (auto& s : stages) s->zero_grad();
  std::vector<float> losses;
  for (int m = 0; m < micro; m++) {
    const std::vector<int32_t> in = ids(m), tg = ids(m + 50);
    float loss = 0;
    for (size_t i = 0; i < stages.size(); i++) {
      const bool last = i + 1 == stages.size();
      loss =
          stages[i]->forward_stage(0, i == 0 ? in.data() : nullptr, i == 0 ? nullptr : stages[i - 1]->stage_output(0),
                                   last ? tg.data() : nullptr, B, T, 1.0f / static_cast<float>(micro));
    }
    losses.push_back(loss);
    for (size_t i = stages.size(); i-- > 0;) {
      if (i + 1 < stages.size()) stages[i]->set_stage_output_grad(0, stages[i + 1]->stage_input_grad(0));
      if (split) {
        stages[i]->backward_input(0);
        stages[i]->backward_weight(0);
      } else {
        stages[i]->backward(0);
      }
    }
  }
  return losses;
}

std::vector<float> run_whole(GPT& whole, int micro) {
  whole.zero_grad();
  std::vector<float> losses;
  for (int m = 0; m < micro; m++) {
    const std::vector<int32_t> in = ids(m), tg = ids(m + 50);
    losses.push_back(whole.forward(0, in.data(), tg.data(), B, T, 1.0f / static_cast<float>(micro)));
    whole.backward(0);
  }
  return losses;
}

class PipelineStages : public ::testing::TestWithParam<Variant> {
 protected:
  static ModelConfig config() { return as_variant(four_layers(), GetParam()); }
};
INSTANTIATE_TEST_SUITE_P(, PipelineStages, lattice::model::testing::kAllVariants);

TEST_P(PipelineStages, ChainedStagesAreTheWholeModel) {
  const ModelConfig c = config();
  const bool tied = c.tie_embeddings;
  GPT whole(c, 7);
  for (const std::vector<int>& cuts : {std::vector<int>{0, 2, 4}, std::vector<int>{0, 1, 3, 4}})
    for (bool split : {false, true})
      for (int micro : {1, 2}) {
        std::string what = "cuts";
        for (int x : cuts) what += " " + std::to_string(x);
        what += split ? " split" : " fused";
        what += " micro-batches " + std::to_string(micro);
        std::vector<std::unique_ptr<GPT>> stages;
        for (size_t i = 0; i + 1 < cuts.size(); i++)
          stages.push_back(std::make_unique<GPT>(c, 7, nullptr, StageLayers{cuts[i], cuts[i + 1]}));
        // The same initial values, group by group.
        for (auto& s : stages)
          for (const ParamGroup& g : s->groups()) {
            const ParamGroup* w = group_named(whole, g.name());
            ASSERT_TRUE(w) << g.name();
            ASSERT_EQ(g.numel(), w->numel());
            EXPECT_EQ(std::memcmp(g.data(), w->data(), sizeof(float) * g.numel()), 0) << what << " " << g.name();
          }
        // A tied embedding on the first and the last stage; untied, on the
        // first only, and lm_head in the last stage's final group.
        if (tied) {
          EXPECT_TRUE(stages.front()->has_embedding() && stages.back()->has_embedding());
        } else {
          EXPECT_TRUE(stages.front()->has_embedding());
          EXPECT_FALSE(stages.back()->has_embedding());
          for (size_t i = 0; i < stages.size(); i++) {
            const ParamGroup* head = stages[i]->find_param("lm_head.weight").first;
            if (i + 1 == stages.size()) {
              EXPECT_EQ(head, &stages[i]->final_group()) << what;
            } else {
              EXPECT_EQ(head, nullptr) << what << " stage " << i;
            }
          }
        }
        if (stages.size() == 3) {
          EXPECT_FALSE(stages[1]->has_embedding());
        }
        const std::vector<float> got = run_stages(stages, micro, split), want = run_whole(whole, micro);
        EXPECT_EQ(got, want) << what;
        for (auto& s : stages)
          for (const ParamGroup& g : s->groups()) {
            if (tied && g.name() == "embedding") continue;
            const ParamGroup* w = group_named(whole, g.name());
            EXPECT_EQ(std::memcmp(g.grad(), w->grad(), sizeof(float) * g.numel()), 0) << what << " " << g.name();
          }
        if (!tied) continue;  // the embedding, on the first stage alone, compared above
        // wte: the lookup's share (first stage) + the head's (last stage);
        // with one micro-batch the same single addition as the whole model.
        ParamGroup& first = stages.front()->embedding_group();
        ParamGroup& last = stages.back()->embedding_group();
        ParamGroup& w = whole.embedding_group();
        const int64_t n_wte = w.params()[0].numel();
        double worst = 0;
        bool bitwise = true;
        for (int64_t i = 0; i < n_wte; i++) {
          const float sum = first.param_grad(0)[i] + last.param_grad(0)[i];
          bitwise = bitwise && sum == w.param_grad(0)[i];
          worst = std::max(worst, std::fabs(static_cast<double>(sum) - w.param_grad(0)[i]));
        }
        if (micro == 1) {
          EXPECT_TRUE(bitwise) << what;
        }
        EXPECT_LE(worst, 1e-7) << what;
        if (!c.learned_positions()) {
          EXPECT_EQ(w.params().size(), 1u) << "rotary positions: no position table";
          continue;
        }
        const int64_t n_wpe = w.params()[1].numel();
        EXPECT_EQ(std::memcmp(first.param_grad(1), w.param_grad(1), sizeof(float) * n_wpe), 0)
            << what << " wpe (the first stage's alone)";
        EXPECT_FALSE(last.grad_written(1)) << "the last stage never touches wpe";
      }
}

// As zero-bubble schedules run it: the input backwards of micro-batches 0 and
// 1, then the weight backwards of 1 and 0 (two slots in flight), against the
// fused backward of 0 then 1. The weight gradients then add in the other
// order (g1 + g0 instead of g0 + g1): equal for the blocks' GEMMs and
// LayerNorms up to that one reassociation.
TEST_P(PipelineStages, SplitBackwardInAnyOrderOfWeightPasses) {
  const ModelConfig c = config();
  GPT fused(c, 9), split(c, 9);
  const std::vector<int32_t> in0 = ids(0), tg0 = ids(50), in1 = ids(1), tg1 = ids(51);
  fused.zero_grad();
  fused.forward(0, in0.data(), tg0.data(), B, T, 0.5f);
  fused.backward(0);
  fused.forward(0, in1.data(), tg1.data(), B, T, 0.5f);
  fused.backward(0);
  split.zero_grad();
  split.forward(0, in0.data(), tg0.data(), B, T, 0.5f);
  split.forward(1, in1.data(), tg1.data(), B, T, 0.5f);
  split.backward_input(0);
  split.backward_input(1);
  split.backward_weight(1);
  split.backward_weight(0);
  for (size_t g = 0; g < fused.groups().size(); g++) {
    const ParamGroup& a = fused.groups()[g];
    const ParamGroup& b = split.groups()[g];
    double worst = 0, scale = 0;
    for (int64_t i = 0; i < a.numel(); i++) {
      worst = std::max(worst, std::fabs(static_cast<double>(a.grad()[i]) - b.grad()[i]));
      scale = std::max(scale, std::fabs(static_cast<double>(a.grad()[i])));
    }
    EXPECT_LE(worst, 1e-6 * scale + 1e-12) << a.name();
  }
}

// Recomputation per stage (model/recompute.h): Megatron's "first N layers
// of each stage" and every k-th layer over stages cut {0, 1, 3, 4}, fused
// and split, at f32 and bf16: the stages' losses and gradients are those of
// the stages without recomputation, bit for bit.
TEST_P(PipelineStages, RecomputedStagesAreBitIdentical) {
  const ModelConfig c = config();
  const std::vector<int> cuts = {0, 1, 3, 4};
  const RecomputeSpec specs[] = {{Recompute::Full, 1, 1}, {Recompute::Selective, 2, 0}, {Recompute::Full, 1, 0}};
  for (DType dtype : {DType::F32, DType::BF16})
    for (bool split : {false, true}) {
      auto make = [&](const RecomputeSpec* spec) {
        std::vector<std::unique_ptr<GPT>> stages;
        for (size_t i = 0; i + 1 < cuts.size(); i++) {
          stages.push_back(std::make_unique<GPT>(c, 7, nullptr, StageLayers{cuts[i], cuts[i + 1]}));
          stages.back()->set_compute_dtype(dtype);
          if (spec) stages.back()->set_recompute(recompute_policy(*spec, cuts[i], cuts[i + 1]));
        }
        return stages;
      };
      std::vector<std::unique_ptr<GPT>> plain = make(nullptr);
      const std::vector<float> want = run_stages(plain, 2, split);
      for (const RecomputeSpec& spec : specs) {
        const std::string what = std::string(dtype_name(dtype)) + (split ? " split " : " fused ") +
                                 recompute_name(spec.mode) + " every " + std::to_string(spec.every) + " first " +
                                 std::to_string(spec.first);
        std::vector<std::unique_ptr<GPT>> stages = make(&spec);
        EXPECT_EQ(run_stages(stages, 2, split), want) << what;
        for (size_t i = 0; i < stages.size(); i++)
          for (size_t g = 0; g < stages[i]->groups().size(); g++) {
            ParamGroup &a = stages[i]->groups()[g], &b = plain[i]->groups()[g];
            for (size_t p = 0; p < a.params().size(); p++) {
              if (!b.grad_written(p)) continue;  // wpe of the last stage's tied embedding
              EXPECT_EQ(0, std::memcmp(a.param_grad(p), b.param_grad(p), sizeof(float) * a.params()[p].numel()))
                  << what << " stage " << i << " " << a.params()[p].name;
            }
          }
      }
    }
}

TEST_P(PipelineStages, MisuseIsRefusedWithAMessage) {
  const ModelConfig c = config();
  using io::testing::error_of;
  EXPECT_NE(error_of([&] {
              GPT g(c, 1, nullptr, StageLayers{2, 2});
            }).find("0 <= first < last <= model.n_layer=4"),
            std::string::npos);
  EXPECT_NE(error_of([&] { GPT g(c, 1, nullptr, StageLayers{0, 5}); }).find("got [0, 5)"), std::string::npos);
  GPT first(c, 1, nullptr, StageLayers{0, 2}), last(c, 1, nullptr, StageLayers{2, 4});
  const std::vector<int32_t> in = ids(0);
  EXPECT_NE(error_of([&] { first.forward(0, in.data(), in.data(), B, T, 1.0f); }).find("runs forward_stage()"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              last.forward_stage(0, nullptr, nullptr, in.data(), B, T, 1.0f);
            }).find("needs its input activation"),
            std::string::npos);
  first.forward_stage(0, in.data(), nullptr, nullptr, B, T, 1.0f);
  EXPECT_NE(error_of([&] { first.backward(0); }).find("before set_stage_output_grad"), std::string::npos);
  EXPECT_NE(error_of([&] { first.stage_input_grad(0); }).find("no input gradient"), std::string::npos);
  EXPECT_NE(error_of([&] { last.stage_output(0); }).find("no output activation"), std::string::npos);
  EXPECT_NE(error_of([&] { first.evaluate(in.data(), in.data(), B, T); }).find("runs the whole model"),
            std::string::npos);
}

}  // namespace
