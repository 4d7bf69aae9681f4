// Pipeline schedules as data (parallel/pipeline/): the generators, the
// validator, PyTorch's compute-only CSV, the simulator with unit costs, and
// the layer partition. One process: schedules are pure functions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../io/test_util.h"
#include "lattice/core/error.h"
#include "lattice/parallel/pipeline/partition.h"
#include "lattice/parallel/pipeline/schedule.h"
#include "lattice/parallel/pipeline/simulator.h"

using namespace lattice;
using namespace lattice::pipeline;

namespace {

TEST(PipelineSchedule, EveryGeneratedListIsValid) {
  for (int p = 1; p <= 8; p++)
    for (int m = 1; m <= 32; m++) {
      EXPECT_NO_THROW(validate(gpipe(p, m))) << "gpipe p=" << p << " m=" << m;
      EXPECT_NO_THROW(validate(one_f_one_b(p, m))) << "1f1b p=" << p << " m=" << m;
      EXPECT_NO_THROW(validate(zb_h1(p, m))) << "zb-h1 p=" << p << " m=" << m;
      EXPECT_NO_THROW(validate(zb_v(p, m))) << "zb-v p=" << p << " m=" << m;
      if (m % p == 0)
        for (int v : {2, 3, 4})
          EXPECT_NO_THROW(validate(interleaved_1f1b(p, v, m))) << "interleaved p=" << p << " v=" << v << " m=" << m;
    }
}

// With F = I = W = 1 (a full B costs 2), GPipe and 1F1B leave (p-1)/(m+p-1)
// of p × makespan idle, exactly; interleaving v chunks (each action a chunk's
// cost) cuts it to (p-1)/(v·m+p-1).
TEST(PipelineSchedule, UnitCostBubblesAreTheTextbookFormulas) {
  for (int p = 1; p <= 8; p++)
    for (int m = 1; m <= 32; m++) {
      const double want = static_cast<double>(p - 1) / (m + p - 1);
      EXPECT_NEAR(simulate(gpipe(p, m)).bubble, want, 1e-12) << "gpipe p=" << p << " m=" << m;
      EXPECT_NEAR(simulate(one_f_one_b(p, m)).bubble, want, 1e-12) << "1f1b p=" << p << " m=" << m;
      if (m % p == 0)
        for (int v : {2, 3}) {
          const double inter = static_cast<double>(p - 1) / (v * m + p - 1);
          EXPECT_NEAR(simulate(interleaved_1f1b(p, v, m)).bubble, inter, 1e-12)
              << "interleaved p=" << p << " v=" << v << " m=" << m;
        }
    }
}

// ZB-H1 with F = I = W: bubble (p-1)/(3m+p-1) for m >= p, which is 1F1B's
// times (m+p-1)/(3m+p-1) = 1/3 + 2(p-1)/(3(3m+p-1)) — a third plus a
// tolerance that vanishes as m grows (the p-1 forwards of the fill, which
// nothing can overlap, are a larger share of a shorter step). Below m = p it
// is still no worse than 1F1B.
TEST(PipelineSchedule, ZbH1HasAThirdOf1F1BsBubble) {
  for (int p = 1; p <= 8; p++)
    for (int m = 1; m <= 32; m++) {
      const double zb = simulate(zb_h1(p, m)).bubble, f1b = simulate(one_f_one_b(p, m)).bubble;
      EXPECT_LE(zb, f1b + 1e-12) << "p=" << p << " m=" << m;
      if (m < p || p == 1) continue;
      EXPECT_NEAR(zb, static_cast<double>(p - 1) / (3 * m + p - 1), 1e-12) << "p=" << p << " m=" << m;
      EXPECT_LE(zb, f1b / 3 + f1b * 2.0 * (p - 1) / (3.0 * (3 * m + p - 1)) + 1e-12) << "p=" << p << " m=" << m;
    }
}

// ZB-V with F = I = W: each rank runs 6m unit actions (F, I, W of two
// chunks) and the V's turning rank p-1 receives its first input only after
// the p-1 forwards above it, so makespan >= 6m + p - 1 and bubble >=
// (p-1)/(6m+p-1) for any order. That bound is (m+p-1)/(6m+p-1) of 1F1B's
// bubble: 0.2 at p=2, m=2p, and never below 1/6 — so the "0.1x of 1F1B" of
// the zero-bubble paper's figures (which leave out each rank's wait for its
// first input) cannot be met by a bubble counted over the whole step, as
// lattice counts it for every schedule. The generated list is at the bound or
// within two actions of it (p <= 8, m >= 2p), and always no worse than
// ZB-H1's and 1F1B's.
TEST(PipelineSchedule, ZbVIsAtTheBubbleBound) {
  for (int p = 1; p <= 8; p++)
    for (int m = 1; m <= 32; m++) {
      const Schedule v = zb_v(p, m);
      ASSERT_EQ(v.chunks_per_rank(), 2);
      for (int r = 0; r < p; r++) {
        EXPECT_EQ(v.rank_of_stage[r], r);
        EXPECT_EQ(v.rank_of_stage[2 * p - 1 - r], r);  // the V
      }
      const Simulation sim = simulate(v);
      const double bound = static_cast<double>(p - 1) / (6 * m + p - 1);
      EXPECT_GE(sim.makespan, 6 * m + p - 1) << "p=" << p << " m=" << m;
      EXPECT_GE(sim.bubble, bound - 1e-12) << "p=" << p << " m=" << m;
      EXPECT_LE(sim.bubble, simulate(zb_h1(p, m)).bubble + 1e-12) << "p=" << p << " m=" << m;
      if (m < 2 * p) continue;
      EXPECT_LE(sim.makespan, 6 * m + p - 1 + 2) << "p=" << p << " m=" << m;
      const double f1b = simulate(one_f_one_b(p, m)).bubble;
      EXPECT_LE(sim.bubble, 0.3 * f1b) << "p=" << p << " m=" << m;
      if (p <= 4) EXPECT_LE(sim.bubble, 0.25 * f1b) << "p=" << p << " m=" << m;
    }
  // At p = 2 it is exactly the bound (from m = 2: one micro-batch is a single chain).
  for (int m = 2; m <= 32; m++) EXPECT_NEAR(simulate(zb_v(2, m)).bubble, 1.0 / (6 * m + 1), 1e-12) << "m=" << m;
}

// GPipe holds every micro-batch's activations; 1F1B at most p - r on rank r;
// ZB-H1 at most p on any rank (1F1B's peak); ZB-V at most 2p chunks, which
// are p stage equivalents (each chunk is half a rank's layers): 1F1B's peak.
TEST(PipelineSchedule, PeakInFlightMicroBatches) {
  for (int p = 1; p <= 8; p++)
    for (int m = 1; m <= 32; m++) {
      const Simulation g = simulate(gpipe(p, m)), f = simulate(one_f_one_b(p, m));
      EXPECT_EQ(g.max_peak_in_flight(), m) << "gpipe p=" << p << " m=" << m;
      EXPECT_LE(f.max_peak_in_flight(), p) << "1f1b p=" << p << " m=" << m;
      for (int r = 0; r < p; r++) EXPECT_EQ(f.peak_in_flight[r], std::min(p - r, m)) << "1f1b rank " << r;
      EXPECT_LE(simulate(zb_h1(p, m)).max_peak_in_flight(), p) << "zb-h1 p=" << p << " m=" << m;
      EXPECT_LE(simulate(zb_v(p, m)).max_peak_in_flight(), p) << "zb-v p=" << p << " m=" << m;
    }
}

Schedule csv(const std::string& text) { return from_csv(text, "test.csv"); }

TEST(PipelineSchedule, CsvRoundTripIsIdentity) {
  for (const Schedule& s :
       {gpipe(4, 8), one_f_one_b(3, 7), zb_h1(4, 8), interleaved_1f1b(4, 2, 8), interleaved_1f1b(2, 3, 4), zb_v(4, 8)}) {
    const Schedule back = from_csv(to_csv(s), "round trip");
    EXPECT_EQ(back.actions, s.actions) << s.name;
    EXPECT_EQ(back.rank_of_stage, s.rank_of_stage) << s.name;
    EXPECT_EQ(back.stages, s.stages);
    EXPECT_EQ(back.micro_batches, s.micro_batches);
    EXPECT_EQ(to_csv(back), to_csv(s));
  }
}

// PyTorch-format CSVs written by hand (empty cells are idle slots, as
// torch.distributed.pipelining writes them) load, validate and are the lists
// lattice generates.
TEST(PipelineSchedule, HandWrittenPyTorchCsvsLoad) {
  const Schedule f = csv("0F0,,0F1,0B0,0F2,0B1,0B2\n,1F0,1B0,1F1,1B1,1F2,1B2\n");
  EXPECT_NO_THROW(validate(f));
  EXPECT_EQ(f.actions, one_f_one_b(2, 3).actions);
  const Schedule i = csv("0F0,0F1,2F0,2F1,,,2B0,2B1,0B0,0B1\r\n,1F0,1F1,3F0,3B0,3F1,3B1,1B0,1B1\r\n\r\n");
  EXPECT_NO_THROW(validate(i));
  EXPECT_EQ(i.actions, interleaved_1f1b(2, 2, 2).actions);
  EXPECT_EQ(i.rank_of_stage, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(i.chunks_per_rank(), 2);
  // A split backward (I then W), as zero-bubble schedules write it.
  const Schedule z = csv("0F0,0F1,0I0,0I1,0W0,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n");
  EXPECT_NO_THROW(validate(z));
  const Simulation sim = simulate(z);
  EXPECT_GT(sim.makespan, 0);
}

TEST(PipelineSchedule, BrokenListsAreRefusedNamingTheAction) {
  EXPECT_ERROR_CONTAINS(validate(csv("0B0,0F0\n")), "rank 0 action 1 '0B0': a backward before its forward 0F0");
  EXPECT_ERROR_CONTAINS(validate(csv("0F0,0I0\n")), "stage 0 micro-batch 0 (rank 0) has no weight backward 0W0");
  EXPECT_ERROR_CONTAINS(validate(csv("0F0,0W0,0I0\n")), "'0W0': a weight backward before its input backward 0I0");
  EXPECT_ERROR_CONTAINS(validate(csv("0F0,0F1,0B0\n")), "stage 0 micro-batch 1 (rank 0) has no backward");
  EXPECT_ERROR_CONTAINS(validate(csv("0F0,0B0,0F0\n")), "'0F0': appears twice");
  EXPECT_ERROR_CONTAINS(validate(csv("0F0,0B0,0I0,0W0\n")), "both a full backward (B) and a split one");
  // Each rank waits for the other: rank 1 starts micro-batch 1, whose input
  // rank 0 produces only after the backward of micro-batch 0, which waits for
  // rank 1's backward of micro-batch 0, which rank 1 runs after micro-batch 1.
  EXPECT_ERROR_CONTAINS(validate(csv("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")),
                        "deadlock: rank 0 action 2 '0B0' waits for 1B0 or 1I0 on rank 1");
  EXPECT_ERROR_CONTAINS(csv("0F0,1F0\n1B0\n"), "stage 1 is on rank 0");
  EXPECT_ERROR_CONTAINS(csv("0F0,0X0\n"), "test.csv row 1 (rank 0) column 2: '0X0' is not an action");
  EXPECT_ERROR_CONTAINS(csv("0F0,F1\n"), "'F1' is not an action");
  EXPECT_ERROR_CONTAINS(csv("\n\n"), "no schedule");
  EXPECT_ERROR_CONTAINS(csv("0F0,0B0\n2F0,2B0\n"), "stage 1 has no action on any rank");
  EXPECT_ERROR_CONTAINS(validate(csv("0F0,0B0\n1F1,1B1\n")), "has no forward");
}

TEST(PipelineSchedule, NamesAndSizesAreChecked) {
  EXPECT_EQ(make_schedule("1f1b", 4, 1, 8).actions, one_f_one_b(4, 8).actions);
  EXPECT_EQ(make_schedule("interleaved", 2, 2, 4).actions, interleaved_1f1b(2, 2, 4).actions);
  EXPECT_ERROR_CONTAINS(make_schedule("pipedream", 2, 1, 4), "unknown pipeline schedule 'pipedream'");
  EXPECT_EQ(make_schedule("zb-h1", 4, 1, 8).actions, zb_h1(4, 8).actions);
  EXPECT_EQ(make_schedule("zb-v", 2, 2, 4).actions, zb_v(2, 4).actions);
  EXPECT_ERROR_CONTAINS(make_schedule("zb-v", 2, 1, 4), "zb-v schedule: two chunks per rank");
  EXPECT_ERROR_CONTAINS(make_schedule("interleaved", 4, 2, 6), "must be a multiple of parallel.pp=4");
  EXPECT_ERROR_CONTAINS(make_schedule("interleaved", 4, 1, 8), "needs parallel.virtual_stages >= 2");
  EXPECT_ERROR_CONTAINS(make_schedule("gpipe", 4, 2, 8), "one chunk per rank");
  EXPECT_ERROR_CONTAINS(make_schedule("1f1b", 0, 1, 8), "needs at least one rank");
  EXPECT_ERROR_CONTAINS(make_schedule("1f1b", 2, 1, 0), "needs at least one micro-batch");
}

// Transfers between ranks lengthen the critical path: GPipe's makespan grows
// by exactly 2(p-1) transfers (the forward fill and the backward drain; its
// streams are otherwise back to back). 1F1B's by more: in its steady state
// each forward waits for the backward that frees its slot, a round trip.
TEST(PipelineSimulator, TransferTimeIsOnTheCriticalPath) {
  const int p = 4, m = 8;
  Costs c;
  const double gpipe_base = simulate(gpipe(p, m), c).makespan, base = simulate(one_f_one_b(p, m), c).makespan;
  c.transfer = 0.25;
  EXPECT_NEAR(simulate(gpipe(p, m), c).makespan, gpipe_base + 2 * (p - 1) * 0.25, 1e-12);
  EXPECT_GT(simulate(one_f_one_b(p, m), c).makespan, base + 2 * (p - 1) * 0.25);
  // Measured-style costs: backward twice the forward.
  c = {1.0, 1.2, 0.8, 0.0};
  const Simulation s = simulate(one_f_one_b(p, m), c);
  EXPECT_NEAR(s.makespan, (m + p - 1) * 3.0, 1e-12);
}

// Per-stage costs: a slower last stage (the head) sets 1F1B's steady pace.
TEST(PipelineSimulator, PerStageCostsReplaceTheCommonOnes) {
  const int p = 2, m = 8;
  Costs c;
  c.by_stage = {{1, 1, 1}, {2, 2, 2}};  // stage 1 twice as slow
  const Simulation s = simulate(one_f_one_b(p, m), c);
  // Rank 1 is busy 6 per micro-batch and waits only for the first forward (1).
  EXPECT_NEAR(s.makespan, 1 + 6.0 * m + 2, 1e-12);
  EXPECT_NEAR(s.timeline[1].back().end, s.makespan - 2, 1e-12);  // rank 0's last backward follows
}

TEST(PipelinePartition, BalancedByCostWithTheHeadOnTheLastChunk) {
  model::ModelConfig gpt2;  // 124M: the head costs about 4.5 blocks at T=1024, 5.2 at T=256
  const std::vector<double> costs = layer_costs(gpt2, 1024);
  ASSERT_EQ(costs.size(), 14u);
  const std::vector<ChunkLayers> four = balanced_partition(costs, 4);
  ASSERT_EQ(four.size(), 4u);
  EXPECT_EQ(four.front().first, 0);
  EXPECT_EQ(four.back().last, 12);
  for (size_t c = 1; c < four.size(); c++) EXPECT_EQ(four[c].first, four[c - 1].last);
  EXPECT_LT(four.back().last - four.back().first, four.front().last - four.front().first)
      << "the chunk with the LM head takes fewer blocks";
  // Uniform costs without embedding or head: equal chunks.
  std::vector<double> flat(14, 1.0);
  flat.front() = flat.back() = 0.0;
  EXPECT_EQ(balanced_partition(flat, 3), (std::vector<ChunkLayers>{{0, 4}, {4, 8}, {8, 12}}));
  EXPECT_ERROR_CONTAINS(balanced_partition(costs, 13), "13 chunks for 12 layers");
  // Placed as ZB-V places them (chunks 0 and 3 on rank 0), the cut balances
  // the ranks: rank 0, holding embedding and head, gets fewer blocks. At
  // T=256 the per-chunk cut [0,3) [3,7) [7,11) [11,12) loads rank 0 with
  // 9.2 blocks' worth against rank 1's 8; the placed cut moves a block over.
  const std::vector<double> c256 = layer_costs(gpt2, 256);
  auto loads = [&](const std::vector<ChunkLayers>& cut, const std::vector<int>& rank) {
    std::vector<double> load(2, 0.0);
    for (size_t k = 0; k < cut.size(); k++) {
      double x = (k == 0 ? c256.front() : 0) + (k + 1 == cut.size() ? c256.back() : 0);
      for (int l = cut[k].first; l < cut[k].last; l++) x += c256[l + 1];
      load[rank[k]] += x;
    }
    return load;
  };
  const std::vector<int> v_shape{0, 1, 1, 0};
  const std::vector<ChunkLayers> by_chunk = balanced_partition(c256, 4), by_rank = balanced_partition(c256, 4, v_shape);
  const std::vector<double> before = loads(by_chunk, v_shape), after = loads(by_rank, v_shape);
  EXPECT_LT(std::max(after[0], after[1]), std::max(before[0], before[1]));
  EXPECT_LT(std::fabs(after[0] - after[1]), c256[1] * 1.5) << "within about a block of each other";
  for (size_t c = 1; c < by_rank.size(); c++) EXPECT_EQ(by_rank[c].first, by_rank[c - 1].last);
  EXPECT_EQ(by_rank.front().first, 0);
  EXPECT_EQ(by_rank.back().last, 12);
  // Refined by simulating the schedule: never slower than where it starts,
  // and for ZB-V at pp=2 strictly faster (the short first chunk starves the
  // long second one the V hands it to).
  for (const Schedule& s : {zb_v(2, 4), one_f_one_b(4, 8), interleaved_1f1b(2, 2, 4)}) {
    const std::vector<ChunkLayers> start = balanced_partition(c256, s.stages, s.rank_of_stage);
    const std::vector<ChunkLayers> refined = refine_partition(c256, start, s);
    EXPECT_LE(simulated_makespan(c256, refined, s), simulated_makespan(c256, start, s)) << s.name;
    for (size_t c = 1; c < refined.size(); c++) EXPECT_EQ(refined[c].first, refined[c - 1].last) << s.name;
    EXPECT_EQ(refined.back().last, 12);
  }
  const Schedule v = zb_v(2, 4);
  EXPECT_LT(simulated_makespan(c256, refine_partition(c256, by_rank, v), v), simulated_makespan(c256, by_rank, v));
  EXPECT_EQ(explicit_partition({3, 4, 5}, 12, 3, "parallel.partition"),
            (std::vector<ChunkLayers>{{0, 3}, {3, 7}, {7, 12}}));
  EXPECT_ERROR_CONTAINS(explicit_partition({3, 4}, 12, 3, "parallel.partition"),
                        "lists 2 chunks but the pipeline has 3");
  EXPECT_ERROR_CONTAINS(explicit_partition({3, 4, 4}, 12, 3, "parallel.partition"),
                        "covers 11 layers but the model has 12");
  EXPECT_ERROR_CONTAINS(explicit_partition({0, 6, 6}, 12, 3, "parallel.partition"), "chunk 0 has 0 layers");
}

}  // namespace
