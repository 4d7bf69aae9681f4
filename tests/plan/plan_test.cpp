// The planner on hand-computed cases: the presets' parameter counts against
// the published ones, the seeds' figures (175B in fp16, 7B at 20 bytes a
// parameter), every cell of ZeRO's Table 1, Korthikanti et al.'s activation
// formulas, lattice's own bytes per layer against docs/recompute.md's
// measured table, the bubble, the seeds' 70B case; layouts and their names,
// lattice's refusals, cluster files and their refusals, the search.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "lattice/core/error.h"
#include "lattice/parallel/pipeline/schedule.h"
#include "lattice/parallel/pipeline/simulator.h"
#include "lattice/plan/cost.h"
#include "lattice/plan/layout.h"
#include "lattice/plan/memory.h"
#include "lattice/plan/presets.h"
#include "lattice/plan/search.h"
#include "lattice/train/trainer.h"

using namespace lattice;
using model::Recompute;

namespace {

// The message of the lattice::Error `fn` throws ("" when it throws none).
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

plan::Workload preset_workload(const std::string& name, int64_t global_batch) {
  plan::Workload w;
  w.name = name;
  w.model = plan::model_preset(name).model;
  w.global_batch = global_batch;
  w.section = train::model_section_of(w.model);
  return w;
}

// ---- presets ----

TEST(PlanPresets, ParameterCountsAreThePublishedOnes) {
  // Hugging Face's counts of the same checkpoints (sum of every tensor, a
  // tied embedding once).
  const std::pair<const char*, int64_t> published[] = {
      {"gpt2", 124439808},           {"gpt2-medium", 354823168},   {"gpt2-large", 774030080},
      {"gpt2-xl", 1557611200},       {"llama2-7b", 6738415616},    {"llama2-13b", 13015864320},
      {"llama2-70b", 68976648192},   {"llama3-8b", 8030261248},    {"llama3-70b", 70553706496},
      {"llama3-405b", 405853388800}, {"mixtral-8x7b", 46702792704}};
  for (const auto& [name, count] : published) EXPECT_EQ(plan::model_preset(name).model.num_params(), count) << name;
  // Mixtral: 12.9B active (Jiang et al. 2024: "13B active parameters").
  EXPECT_EQ(plan::model_preset("mixtral-8x7b").model.active_params(), 12879925248);
  // GPT-3 "175B" (Brown et al. 2020): 174.6B with GPT-2's vocabulary.
  EXPECT_NEAR(static_cast<double>(plan::model_preset("gpt3-175b").model.num_params()), 175e9, 0.005 * 175e9);
}

TEST(PlanPresets, UnknownPresetsAreNamedWithTheValidOnes) {
  const std::string m = error_of([] { plan::model_preset("llama4-1t"); });
  EXPECT_NE(m.find("unknown model preset 'llama4-1t'"), std::string::npos) << m;
  EXPECT_NE(m.find("llama2-70b"), std::string::npos) << m;
  const std::string c = error_of([] { plan::cluster_preset("tpu-v5", 1); });
  EXPECT_NE(c.find("unknown cluster preset 'tpu-v5'"), std::string::npos) << c;
  EXPECT_NE(c.find("a100-80gb"), std::string::npos) << c;
}

// ---- the seeds' figures ----

TEST(PlanFormulas, Gpt3In16BitsIs350GBOfWeights) {
  // 175B parameters × 2 bytes = 350 GB (the seeds' figure); the preset's 174.6B give 349.2 GB.
  const double weights = 2.0 * static_cast<double>(plan::model_preset("gpt3-175b").model.num_params());
  EXPECT_NEAR(weights, 350e9, 0.005 * 350e9);
}

TEST(PlanFormulas, SevenBIs140GBAtTwentyBytesAndLatticeKeepsItsOwn) {
  // The seeds' convention: ~20 bytes a parameter (16-bit weights 2 and
  // gradients 2, f32 master 4, Adam m and v 8, and 4 for f32 gradients):
  // 7B x 20 = 140 GB; Llama 2 7B's 6.74B x 20 = 134.8 GB.
  const double psi = static_cast<double>(plan::model_preset("llama2-7b").model.num_params());
  EXPECT_NEAR(7e9 * 20, 140e9, 1);
  EXPECT_NEAR(psi * 20, 134.8e9, 0.1e9);
  // lattice's own, predicted for one device at ZeRO 0 (padding to 16
  // floats and whole buckets is all that is added): f32 16 B (masters are
  // the weights, f32 gradients, Adam's f32 m and v), bf16 on a 16-bit GPU
  // backend 18 B (a 2-byte compute copy), bf16 on lattice's CPU kernels 22 B
  // (a 4-byte compute copy and oneDNN's 2-byte bf16 copy of each matrix).
  const plan::Workload w = preset_workload("llama2-7b", 1);
  const double p2 = static_cast<double>(w.model.num_params());
  plan::Layout l;
  plan::MemoryOptions gpu, cpu;
  gpu.backend = plan::Backend::Gpu;
  auto per_param = [&](DType t, const plan::MemoryOptions& o) {
    l.compute = t;
    const plan::RankMemory r = plan::predict_memory(w, l, o).ranks[0];
    return (r.model_state() + (o.backend == plan::Backend::Cpu ? r.category(MemCategory::Workspace) : 0)) / p2;
  };
  EXPECT_NEAR(per_param(DType::F32, gpu), 16.0, 0.02);
  EXPECT_NEAR(per_param(DType::BF16, gpu), 18.0, 0.02);
  EXPECT_NEAR(per_param(DType::BF16, cpu), 22.0, 0.1);  // (+ the attention tiles and other scratch)
}

// ---- ZeRO, Table 1 ----

TEST(PlanFormulas, ZeroTableOneEveryCell) {
  // Rajbhandari et al. 2020, Table 1: GB per device for Ψ = 7.5B, 128B, 1T
  // (K = 12) at N_d = 1, 4, 16, 64, 256, 1024, for baseline, P_os, P_os+g,
  // P_os+g+p, as printed (3 significant digits).
  struct Row {
    double psi;
    int nd;
    double cells[4];
  };
  const Row table[] = {
      {7.5e9, 1, {120, 120, 120, 120}},        {7.5e9, 4, {120, 52.5, 41.3, 30}},
      {7.5e9, 16, {120, 35.6, 21.6, 7.5}},     {7.5e9, 64, {120, 31.4, 16.6, 1.88}},
      {7.5e9, 256, {120, 30.4, 15.4, 0.47}},   {7.5e9, 1024, {120, 30.1, 15.1, 0.12}},
      {128e9, 1, {2048, 2048, 2048, 2048}},    {128e9, 4, {2048, 896, 704, 512}},
      {128e9, 16, {2048, 608, 368, 128}},      {128e9, 64, {2048, 536, 284, 32}},
      {128e9, 256, {2048, 518, 263, 8}},       {128e9, 1024, {2048, 513, 257, 2}},
      {1e12, 1, {16000, 16000, 16000, 16000}}, {1e12, 4, {16000, 7000, 5500, 4000}},
      {1e12, 16, {16000, 4750, 2875, 1000}},   {1e12, 64, {16000, 4187, 2218, 250}},
      {1e12, 256, {16000, 4046, 2054, 62.5}},  {1e12, 1024, {16000, 4011, 2013, 15.6}},
  };
  for (const Row& r : table)
    for (int stage = 0; stage < 4; stage++) {
      const double gb = plan::zero_paper_bytes(r.psi, 12, r.nd, stage) / 1e9;
      EXPECT_NEAR(gb, r.cells[stage], 0.006 * r.cells[stage] + 0.005)
          << "Psi " << r.psi << ", N_d " << r.nd << ", stage " << stage;
    }
}

TEST(PlanFormulas, LatticesModelStateFollowsItsZeroFormulasPlusItsBorrowedBuffers) {
  // data_parallel.h: at f32 16Ψ, 8Ψ + 8Ψ/n, 4Ψ + 12Ψ/n, 16Ψ/n bytes (Ψ this
  // rank's parameters) plus the borrowed buffers of stages 2-3 (one block
  // of gradients; two blocks of parameters at stage 3; the embedding's
  // working pieces), each group padded to whole buckets.
  plan::Workload w = preset_workload("llama2-7b", 64);
  plan::MemoryOptions o;
  o.backend = plan::Backend::Gpu;
  const double psi = static_cast<double>(w.model.num_params());
  const plan::GroupNumels g = plan::group_numels(w.model, 1, 1);
  const double block = 4.0 * static_cast<double>(g.block), final = 4.0 * static_cast<double>(g.final);
  const double emb_piece = 2 * 2.0 * (1 << 20);  // two 2 MiB chunks of the embedding
  for (int n : {8, 64}) {
    plan::Layout l;
    l.dp = n;
    l.micro_batches = static_cast<int>(64 / n);
    const double expect[4] = {16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n + block + final + emb_piece,
                              16 * psi / n + 2 * block + final + block + final + 2 * emb_piece};
    for (int z = 0; z < 4; z++) {
      l.zero_stage = z;
      const double got = plan::predict_memory(w, l, o).ranks[0].model_state();
      EXPECT_NEAR(got, expect[z], 0.002 * expect[z]) << "dp " << n << ", ZeRO " << z;
    }
  }
}

// ---- activations ----

TEST(PlanFormulas, KorthikantiActivationsPerLayer) {
  // §4, Table 2 of Korthikanti et al. 2022, at GPT-3's shape (s = 2048,
  // b = 1, h = 12288, a = 96) and t = 8: 5as/(ht) = 5·96·2048/(12288·8) = 10.
  const double s = 2048, b = 1, h = 12288, a = 96, sbh = s * b * h;
  EXPECT_DOUBLE_EQ(plan::korthikanti_layer_bytes(s, b, h, a, 1, false, Recompute::None), sbh * (34 + 5 * a * s / h));
  EXPECT_DOUBLE_EQ(plan::korthikanti_layer_bytes(s, b, h, a, 8, false, Recompute::None), sbh * (10 + 3 + 10));
  EXPECT_DOUBLE_EQ(plan::korthikanti_layer_bytes(s, b, h, a, 8, true, Recompute::None), sbh * (34.0 / 8 + 10));
  EXPECT_DOUBLE_EQ(plan::korthikanti_layer_bytes(s, b, h, a, 8, false, Recompute::Selective), sbh * 13);
  EXPECT_DOUBLE_EQ(plan::korthikanti_layer_bytes(s, b, h, a, 8, true, Recompute::Selective), sbh * 34 / 8);
  EXPECT_DOUBLE_EQ(plan::korthikanti_layer_bytes(s, b, h, a, 8, true, Recompute::Full), 2 * sbh);
}

TEST(PlanFormulas, LatticesStoredBytesPerLayerAreDocsRecomputeTable) {
  // docs/recompute.md's tables, each measured by the MemoryTracker
  // (recompute_test, tp_test): GPT-2 b=2 s=32 h=64 a=4 at f32 and bf16, and
  // b=2 s=16 h=32 a=4 at t=2 with and without SP.
  model::ModelConfig m;
  m.n_layer = 2, m.n_head = 4, m.n_embd = 64, m.vocab_size = 128, m.seq_len = 32;
  plan::Layout l;
  l.micro_batch_size = 2;
  const std::pair<Recompute, double> f32[] = {
      {Recompute::None, 264192}, {Recompute::Selective, 164864}, {Recompute::Full, 16384}};
  for (const auto& [r, bytes] : f32) {
    l.recompute = r;
    l.compute = DType::F32;
    EXPECT_EQ(plan::lattice_layer_bytes(m, l), bytes) << model::recompute_name(r);
    l.compute = DType::BF16;
    EXPECT_EQ(plan::lattice_layer_bytes(m, l), bytes / 2 + (r == Recompute::None        ? 1024
                                                            : r == Recompute::Selective ? 512
                                                                                        : 0))
        << model::recompute_name(r) << " bf16";
  }
  m.n_embd = 32, m.seq_len = 16;
  l.tp = 2, l.compute = DType::F32;
  const std::tuple<bool, Recompute, double> tp2[] = {
      {false, Recompute::None, 41728}, {false, Recompute::Selective, 24832}, {false, Recompute::Full, 4096},
      {true, Recompute::None, 33280},  {true, Recompute::Selective, 20736},  {true, Recompute::Full, 2048}};
  for (const auto& [sp, r, bytes] : tp2) {
    l.sequence_parallel = sp, l.recompute = r;
    EXPECT_EQ(plan::lattice_layer_bytes(m, l), bytes) << "tp2 sp " << sp << " " << model::recompute_name(r);
  }
}

// ---- the pipeline ----

TEST(PlanFormulas, BubbleIsPMinusOneOverMPlusPMinusOne) {
  for (int p : {2, 4, 8})
    for (int m : {4, 16, 32}) {
      plan::Layout l;
      l.pp = p, l.micro_batches = m;
      model::ModelConfig c;
      c.n_layer = 16;
      const plan::PipelineShape s = plan::pipeline_shape(c, l);
      EXPECT_NEAR(s.unit_bubble, static_cast<double>(p - 1) / (m + p - 1), 1e-12) << "p " << p << " m " << m;
      // 1F1B holds p - r micro-batches on rank r (at most m).
      for (int r = 0; r < p; r++) EXPECT_EQ(s.slots[static_cast<size_t>(r)], std::min(p - r, m));
    }
  plan::Layout l;
  l.pp = 4, l.micro_batches = 16;
  EXPECT_NEAR(plan::pipeline_shape(model::ModelConfig{}, l).unit_bubble, 0.158, 0.0005);  // the seeds' 15.8%
}

TEST(PlanFormulas, ActivationSlotsAreTheSimulatorsPeakInFlight) {
  // Read off the action order; the simulator's peak (stage equivalents per
  // rank) is the same count for one chunk per rank.
  for (const char* name : {"gpipe", "1f1b", "zb-h1"}) {
    const pipeline::Schedule s = pipeline::make_schedule(name, 4, 1, 8);
    const std::vector<int> slots = plan::activation_slots(s);
    const pipeline::Simulation sim = pipeline::simulate(s);
    for (int r = 0; r < 4; r++)
      EXPECT_EQ(slots[static_cast<size_t>(r)], sim.peak_in_flight[static_cast<size_t>(r)]) << name;
  }
}

// ---- the seeds' 70B case ----

TEST(PlanSeeds, Llama70BOnFourNodesOfA100NeedsSequenceParallelismOrRecomputation) {
  // 80 layers, hidden 8192, sequence 4096, 4 nodes x 8 A100-80GB, TP 8 x PP
  // 4 x DP 1, 1F1B, 16 micro-batches of one sequence, bf16.
  const plan::Workload w = preset_workload("llama2-70b", 16);
  const plan::Cluster cl = plan::cluster_preset("a100-80gb", 4);
  plan::Layout l = plan::parse_layout("dp1.tp8.pp4.v1.z0.mb1.m16.1f1b.bf16.rc-none");
  ASSERT_EQ(plan::invalid_reason(w, l, cl.devices()), "");
  plan::MemoryPlan mem;
  const plan::Candidate bare = plan::evaluate(w, l, cl, nullptr, &mem);
  // Activations otherwise ~35 GB per GPU on the first stage: it holds 4
  // micro-batches of 20 layers (Korthikanti without the scores, which
  // flash-style attention never stores: sbh(10 + 24/8) = 13sbh a layer).
  const double sbh = 4096.0 * 8192, korthikanti = 20 * 4 * 13 * sbh;
  EXPECT_NEAR(korthikanti, 34.9e9, 0.1e9);
  EXPECT_NEAR(mem.ranks[0].category(MemCategory::Activations), korthikanti, 0.05 * korthikanti);
  EXPECT_EQ(mem.ranks[0].in_flight[0], 4);
  EXPECT_EQ(mem.ranks[3].in_flight[0], 1);
  // Per stage, never averaged: the first stage is the one that does not fit.
  EXPECT_FALSE(bare.fits());
  EXPECT_EQ(bare.worst_stage, 0);
  EXPECT_LT(mem.ranks[3].total(), cl.device_memory);
  // With SP, or with selective or full recomputation, it fits.
  for (const char* name :
       {"dp1.tp8.pp4.v1.z0.mb1.m16.1f1b.sp.bf16.rc-none", "dp1.tp8.pp4.v1.z0.mb1.m16.1f1b.bf16.rc-selective",
        "dp1.tp8.pp4.v1.z0.mb1.m16.1f1b.bf16.rc-full"}) {
    const plan::Candidate c = plan::evaluate(w, plan::parse_layout(name), cl);
    EXPECT_TRUE(c.fits()) << name << " needs " << c.memory / 1e9 << " GB";
  }
  // The bubble at m = 16: 3/19 = 15.8% at unit costs; with the last stage's
  // head and the sends the simulator gives a little more.
  EXPECT_NEAR(plan::PipelineShapes(w.model).get(l).unit_bubble, 0.158, 0.0005);
  EXPECT_GT(bare.time.bubble, 0.158);
  EXPECT_LT(bare.time.bubble, 0.2);
}

TEST(PlanSeeds, TheSearchFindsAFittingLayoutAndNamesTheAlternatives) {
  const plan::Workload w = preset_workload("llama2-70b", 16);
  const plan::Cluster cl = plan::cluster_preset("a100-80gb", 4);
  plan::SearchOptions o;
  o.top = 5;
  const plan::SearchResult r = plan::search(w, cl, o);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_GT(r.valid, 10000);
  for (const plan::Candidate& c : r.ranked) {
    EXPECT_TRUE(c.fits());
    EXPECT_TRUE(c.time.simulated);
    EXPECT_EQ(plan::invalid_reason(w, c.layout, cl.devices()), "") << plan::layout_name(c.layout);
  }
  for (size_t i = 1; i < r.ranked.size(); i++) EXPECT_LE(r.ranked[i - 1].time.step, r.ranked[i].time.step);
  // TP never spans nodes in the winner, and the layout that makes it do so is slower.
  EXPECT_LE(r.ranked[0].layout.tp, 8);
  for (const plan::Alternative& a : r.alternatives) {
    if (a.name != "tensor parallelism across nodes") continue;
    ASSERT_TRUE(a.found);
    EXPECT_GT(a.best.time.tp_comm, r.ranked[0].time.tp_comm);
    EXPECT_GT(a.best.time.step, r.ranked[0].time.step);
  }
}

TEST(PlanSeeds, AModelThatFitsNowhereSaysHowFar) {
  // Llama 3 405B on one node of A100-80GB: 405B x 16 B of state alone is 81x a device.
  const plan::Workload w = preset_workload("llama3-405b", 8);
  const plan::Cluster cl = plan::cluster_preset("a100-80gb", 1);
  plan::SearchOptions o;
  o.offload = false;
  const plan::SearchResult r = plan::search(w, cl, o);
  EXPECT_TRUE(r.ranked.empty());
  EXPECT_GT(r.valid, 0);
  EXPECT_GT(r.closest.memory, cl.device_memory);
}

// ---- layouts ----

TEST(PlanLayout, NamesReadBack) {
  plan::Layout l;
  l.dp = 2, l.tp = 8, l.pp = 4, l.cp = 2, l.ep = 2, l.virtual_stages = 2, l.zero_stage = 1, l.offload = true;
  l.micro_batch_size = 2, l.micro_batches = 16, l.schedule = "interleaved", l.sequence_parallel = true;
  l.cp_mode = "all_to_all", l.compute = DType::BF16, l.recompute = Recompute::Selective;
  const std::string name = plan::layout_name(l);
  EXPECT_EQ(name, "dp2.tp8.pp4.cp2.ep2.v2.z1.mb2.m16.interleaved.sp.a2a.offload.bf16.rc-selective");
  EXPECT_EQ(plan::parse_layout(name), l);
  plan::Layout short_name;
  short_name.tp = 2, short_name.micro_batches = 4;  // every knob left out takes its default
  EXPECT_EQ(plan::parse_layout("tp2.m4"), short_name);
}

TEST(PlanLayout, BadNamesSayWhichPiece) {
  const std::string m = error_of([] { plan::parse_layout("dp2.tp8.pq4"); });
  EXPECT_NE(m.find("cannot read 'pq4'"), std::string::npos) << m;
  EXPECT_NE(m.find("dpN tpN ppN"), std::string::npos) << m;
  EXPECT_NE(error_of([] { plan::parse_layout("dp0"); }).find("'dp0' must be at least 1"), std::string::npos);
  EXPECT_NE(error_of([] { plan::parse_layout("rc-some"); }).find("not a recompute mode"), std::string::npos);
}

TEST(PlanLayout, InvalidLayoutsGetLatticesOwnRefusal) {
  const plan::Workload w = preset_workload("gpt2", 8);
  auto reason = [&](const std::string& name, int devices) {
    return plan::invalid_reason(w, plan::parse_layout(name), devices);
  };
  EXPECT_EQ(reason("dp2.tp2.mb1.m4", 4), "");
  // tp x cp x pp x dp against the devices.
  EXPECT_NE(reason("dp2.tp2.mb1.m4", 8).find("does not equal"), std::string::npos) << reason("dp2.tp2.mb1.m4", 8);
  // The global batch not divisible by dp x micro-batch size.
  EXPECT_NE(reason("dp3.mb1.m3", 3).find("train.global_batch_size=8 is not divisible by parallel.dp=3"),
            std::string::npos);
  // TP that does not divide the heads (GPT-2 has 12).
  EXPECT_NE(reason("tp8.mb1.m8", 8).find("parallel.tp=8 must divide model.n_head=12"), std::string::npos);
  // Sequence parallelism without TP, a schedule at pp = 1 that needs a pipeline.
  EXPECT_NE(reason("dp2.mb1.m4.sp", 2).find("sequence_parallel"), std::string::npos);
  EXPECT_EQ(reason("pp2.v2.mb1.m8.zb-v", 2), "");
  EXPECT_NE(reason("pp2.v3.mb1.m8.zb-v", 2).find("two chunks per rank"), std::string::npos);
  // More chunks than layers (12).
  EXPECT_NE(reason("pp8.v2.mb1.m8.interleaved", 8).find("every chunk needs"), std::string::npos)
      << reason("pp8.v2.mb1.m8.interleaved", 8);
}

// ---- clusters ----

TEST(PlanCluster, FileStartsFromAPresetAndOverrides) {
  const plan::Cluster c = plan::parse_cluster(
      "[cluster]\npreset = \"a100-80gb\"\nnodes = 2\n[device]\nmemory_gib = 40\n[network]\ninter_gbps = 12.5\n",
      "mine.toml");
  EXPECT_EQ(c.devices(), 16);
  EXPECT_DOUBLE_EQ(c.device_memory, 40.0 * 1024 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(c.inter.bandwidth, 12.5e9);
  EXPECT_DOUBLE_EQ(c.peak_bf16, 312e12);  // the preset's
}

TEST(PlanCluster, ImpossibleClustersAreRefusedByName) {
  auto refusal = [](const std::string& text) { return error_of([&] { plan::parse_cluster(text, "c.toml"); }); };
  EXPECT_NE(refusal("[cluster]\nnodes = 0\n").find("cluster.nodes=0 is out of range"), std::string::npos)
      << refusal("[cluster]\nnodes = 0\n");
  EXPECT_NE(refusal("[cluster]\npreset = \"a100-80gb\"\n[device]\nmemory_gib = 0\n").find("device.memory_gib=0"),
            std::string::npos);
  EXPECT_NE(refusal("[device]\nmemory_gib = 80\n").find("every peak must be > 0"), std::string::npos)
      << refusal("[device]\nmemory_gib = 80\n");
  EXPECT_NE(refusal("[cluster]\npreset = \"h100-sxm\"\n[device]\nmemry_gib = 80\n")
                .find("device.memry_gib is not a key of [device]"),
            std::string::npos);
  EXPECT_NE(refusal("[gpu]\nx = 1\n").find("[gpu] is not a section"), std::string::npos);
  EXPECT_NE(refusal("[cluster]\npreset = \"a100-80gb\"\n[device]\ngemm_efficiency = 1.5\n").find("gemm_efficiency"),
            std::string::npos);
  EXPECT_NE(refusal("[cluster]\npreset = \"a100-80gb\"\nnodes = 2\n[network]\ninter_gbps = 0\n").find("inter_gbps"),
            std::string::npos);
}

// ---- the cost model ----

TEST(PlanCost, CollectivesFollowTheAlphaBetaFormulas) {
  const plan::Link link{100e9, 5e-6};
  const double S = 1e9;
  EXPECT_DOUBLE_EQ(plan::collective_seconds(plan::Collective::AllReduce, S, 8, link),
                   2 * 7.0 / 8 * S / 100e9 + 14 * 5e-6);
  EXPECT_DOUBLE_EQ(plan::collective_seconds(plan::Collective::ReduceScatter, S, 8, link),
                   7.0 / 8 * S / 100e9 + 7 * 5e-6);
  EXPECT_DOUBLE_EQ(plan::collective_seconds(plan::Collective::SendRecv, S, 2, link), S / 100e9 + 5e-6);
  EXPECT_EQ(plan::collective_seconds(plan::Collective::AllReduce, S, 1, link), 0);
  // A group inside a node uses NVLink, one spanning nodes InfiniBand.
  const plan::Cluster cl = plan::cluster_preset("a100-80gb", 2);
  EXPECT_EQ(&plan::group_link(cl, 1, 8), &cl.intra);
  EXPECT_EQ(&plan::group_link(cl, 1, 16), &cl.inter);
  EXPECT_EQ(&plan::group_link(cl, 8, 2), &cl.inter);
}

TEST(PlanCost, MfuIsModelFlopsOverTimeAndPeak) {
  const plan::Workload w = preset_workload("llama2-7b", 64);
  const plan::Cluster cl = plan::cluster_preset("a100-80gb", 1);
  const plan::Layout l = plan::parse_layout("dp8.z1.mb1.m8.bf16.rc-full");
  const plan::StepTime t = plan::predict_time(w, l, cl);
  EXPECT_DOUBLE_EQ(t.model_flops, w.model.flops_per_token(4096) * 64 * 4096);
  EXPECT_NEAR(t.mfu, t.model_flops / (t.step * 8 * 312e12), 1e-12);
  // Full recomputation runs the forward again: more time for the same model FLOPs.
  const plan::StepTime none = plan::predict_time(w, plan::parse_layout("dp8.z1.mb1.m8.bf16.rc-none"), cl);
  EXPECT_GT(t.compute, none.compute * 1.2);
  EXPECT_DOUBLE_EQ(t.model_flops, none.model_flops);
}

}  // namespace
