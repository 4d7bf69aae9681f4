// The pipeline executor under mpiexec (2 and 4 ranks): every schedule trains
// the model of one process with the same global batch — 10 steps, losses to
// 1e-5 relative, every parameter (both copies of the tied embedding
// included) to 1e-4 absolute (equivalence.h's tolerance) — and its measured
// timeline holds every action.
//
// Both sides are driven here, with the same recipe (AdamW, clipping at 1,
// warm-up and cosine), on token batches that depend only on (step,
// micro-batch): the one-process model over m micro-batches, and the
// pipeline's stage models through the executor.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "lattice/core/threads.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/parallel/pipeline/executor.h"
#include "lattice/parallel/pipeline/partition.h"
#include "lattice/parallel/pipeline/timeline.h"
#include "mpi_ranks.h"

using namespace lattice;
using namespace lattice::pipeline;

namespace {

using mpitest::world;

const bool kOneThread = (set_num_threads(1), true);
constexpr int kSteps = 10, B = 2, T = 16;

using mpitest::groups_of;

model::ModelConfig tiny(int layers) {
  model::ModelConfig c;
  c.n_layer = layers;
  c.n_head = 4;
  c.n_embd = 32;
  c.vocab_size = 101;
  c.seq_len = T;
  return c;
}

std::vector<int32_t> tokens(int step, int micro, int salt) {
  std::vector<int32_t> v(B * T);
  for (int i = 0; i < B * T; i++) v[i] = static_cast<int32_t>((i * 31 + step * 17 + micro * 7 + salt) % 101);
  return v;
}

struct PipeRun {
  std::vector<double> losses, norms;
  std::vector<std::pair<std::string, std::vector<float>>> groups;  // name -> parameters
};

float lr_of(int step) { return optim::lr_at(step, kSteps, 3, 1e-2f, 1e-3f); }

PipeRun one_process(int layers, int m) {
  model::GPT g(tiny(layers), 5);
  optim::AdamW adam(g.groups(), optim::AdamWConfig{});
  PipeRun r;
  for (int step = 0; step < kSteps; step++) {
    g.zero_grad();
    double loss = 0;
    for (int k = 0; k < m; k++) {
      const auto in = tokens(step, k, 0), tg = tokens(step, k, 3);
      loss += g.forward(0, in.data(), tg.data(), B, T, 1.0f / static_cast<float>(m));
      g.backward(0);
    }
    const double norm = optim::global_grad_norm(g.groups());
    adam.step(lr_of(step), optim::clip_scale(norm, 1.0f));
    r.losses.push_back(loss / m);
    r.norms.push_back(norm);
  }
  for (const model::ParamGroup& p : g.groups())
    r.groups.push_back({p.name(), std::vector<float>(p.data(), p.data() + p.numel())});
  return r;
}

// The pipeline: stage s runs chunk s of the balanced partition, on the rank the schedule places it.
PipeRun pipelined(const Schedule& s, int layers, comm::Communicator& group, std::vector<std::vector<Interval>>* timeline) {
  const model::ModelConfig c = tiny(layers);
  const std::vector<ChunkLayers> cut = balanced_partition(layer_costs(c, T), s.stages);
  std::vector<std::unique_ptr<model::GPT>> models;
  std::vector<std::unique_ptr<optim::AdamW>> adams;
  std::vector<model::GPT*> mine;
  for (int st = 0; st < s.stages; st++) {
    if (s.rank_of_stage[st] != group.rank()) continue;
    models.push_back(std::make_unique<model::GPT>(c, 5, nullptr, model::StageLayers{cut[st].first, cut[st].last}));
    adams.push_back(std::make_unique<optim::AdamW>(models.back()->groups(), optim::AdamWConfig{}));
    mine.push_back(models.back().get());
  }
  Executor ex(s, mine, group);
  PipeRun r;
  for (int step = 0; step < kSteps; step++) {
    for (auto& g : models) g->zero_grad();
    std::vector<std::vector<int32_t>> in, tg;
    std::vector<MicroBatch> batches;
    for (int k = 0; k < s.micro_batches; k++) in.push_back(tokens(step, k, 0)), tg.push_back(tokens(step, k, 3));
    for (int k = 0; k < s.micro_batches; k++) batches.push_back({in[k].data(), tg[k].data()});
    const double loss = ex.run_step(batches, B, T);
    const double norm = std::sqrt(ex.grad_sum_squares());
    for (auto& a : adams) a->step(lr_of(step), optim::clip_scale(norm, 1.0f));
    r.losses.push_back(loss);
    r.norms.push_back(norm);
  }
  for (auto& g : models)
    for (const model::ParamGroup& p : g->groups())
      r.groups.push_back({p.name(), std::vector<float>(p.data(), p.data() + p.numel())});
  if (timeline) *timeline = ex.gather_timelines();
  return r;
}

void expect_same(const PipeRun& got, const PipeRun& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); i++) {
    EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5 * std::fabs(want.losses[i])) << what << " step " << i + 1;
    EXPECT_NEAR(got.norms[i], want.norms[i], 1e-4 * std::fabs(want.norms[i])) << what << " norm, step " << i + 1;
  }
  for (const auto& [name, values] : got.groups) {
    const std::vector<float>* w = nullptr;
    for (const auto& [n, v] : want.groups)
      if (n == name) w = &v;
    ASSERT_TRUE(w) << what << ": group " << name;
    ASSERT_EQ(w->size(), values.size());
    double worst = 0;
    for (size_t i = 0; i < values.size(); i++) worst = std::max(worst, std::fabs(double(values[i]) - (*w)[i]));
    EXPECT_LE(worst, 1e-4) << what << ": group " << name;
  }
}

TEST(PipelineExecutor, EveryScheduleTrainsTheOneProcessModel) {
  for (int p : {2, 4}) {
    if (p > world().size()) continue;
    for (int m : {4, 8}) {
      const PipeRun want = one_process(4, m), want8 = one_process(8, m);
      for (const char* name : {"gpipe", "1f1b", "zb-h1"}) {
        const Schedule s = make_schedule(name, p, 1, m);
        expect_same(pipelined(s, 4, groups_of(p), nullptr), want,
                    std::string(name) + " pp=" + std::to_string(p) + " m=" + std::to_string(m));
      }
      // Interleaved: 2 chunks per rank, so 2p stages of the 8-layer model.
      const Schedule s = make_schedule("interleaved", p, 2, m);
      expect_same(pipelined(s, 8, groups_of(p), nullptr), want8,
                  "interleaved v=2 pp=" + std::to_string(p) + " m=" + std::to_string(m));
    }
  }
}

// A hand-written PyTorch-format schedule (split backward) runs too, and the
// measured timeline has every action of every rank in order.
TEST(PipelineExecutor, CsvScheduleRunsAndItsTimelineIsRecorded) {
  const Schedule s = from_csv("0F0,0F1,0I0,0I1,0W0,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n", "hand.csv");
  std::vector<std::vector<Interval>> timeline;
  expect_same(pipelined(s, 4, groups_of(2), &timeline), one_process(4, 2), "hand.csv");
  ASSERT_EQ(timeline.size(), 2u);
  for (int r = 0; r < 2; r++) {
    ASSERT_EQ(timeline[r].size(), s.actions[r].size());
    for (size_t i = 0; i < timeline[r].size(); i++) {
      EXPECT_EQ(timeline[r][i].action, s.actions[r][i]);
      EXPECT_LE(timeline[r][i].start, timeline[r][i].end);
      if (i) EXPECT_LE(timeline[r][i - 1].end, timeline[r][i].start);
    }
  }
  const std::string trace = chrome_trace(timeline, 1.0, "hand.csv");
  EXPECT_NE(trace.find("\"name\":\"1W1\""), std::string::npos);
  const double bubble = bubble_of(timeline);
  EXPECT_GE(bubble, 0.0);
  EXPECT_LT(bubble, 1.0);
}

}  // namespace
