// The planner's memory model against the MemoryTracker of real runs: for
// each layout, the trainer runs 3 steps on this machine and every rank's
// peak (the tracker's peak total, and the model-state and activation
// categories) must be within 5% of plan::predict_memory's for its pipeline
// stage — the first and last stages separately, never an average.
//
// One layout per process (CTest starts each under mpiexec with its own
// --gtest_filter, tests/plan/CMakeLists.txt): the CPU kernels keep their
// per-thread scratch for the life of the process, so a second trainer in
// the same process would find some of it allocated already.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "lattice/comm/process_mesh.h"
#include "lattice/comm/runtime.h"
#include "lattice/core/memory.h"
#include "lattice/core/threads.h"
#include "lattice/io/config.h"
#include "lattice/plan/memory.h"
#include "lattice/train/trainer.h"

using namespace lattice;

namespace {

// A model whose state and activations are a few MB per rank (so the
// kernels' scratch is a small part of the total), fast enough for 4
// oversubscribed ranks: 4 layers, C=128, V=1000 (padded to 1024), T=64,
// micro-batches of 2 sequences.
std::vector<std::string> small_model(const std::string& family = "gpt2") {
  std::vector<std::string> s = {"model.family=" + family,   "model.n_layer=4",       "model.n_head=4",
                                "model.n_embd=128",         "model.vocab_size=1000", "model.seq_len=64",
                                "train.micro_batch_size=2", "train.steps=3",         "train.threads=1"};
  if (family == "llama") s.push_back("model.n_kv_head=2");
  return s;
}

struct Measured {
  double peak_total = 0;
  std::array<double, static_cast<size_t>(MemCategory::kCount)> peak{};
};

// Runs the layout and checks every rank against the plan; rank 0 prints
// the table (measured, predicted, error per rank and stage).
void check_layout(const std::string& name, std::vector<std::string> sets) {
  for (const char* s : {"train.grad_accum_steps=4"})
    if (std::none_of(sets.begin(), sets.end(),
                     [](const std::string& x) { return x.rfind("train.grad_accum", 0) == 0; }))
      sets.push_back(s);
  set_num_threads(1);
  const io::RunConfig config = io::parse_config_text("", name, sets);
  const int rank = comm::world_rank(), size = comm::world_size();
  ASSERT_EQ(config.parallel.dp * config.parallel.tp * config.parallel.pp * config.parallel.cp, size)
      << name << " runs on " << size << " ranks: wrong mpiexec -n in tests/plan/CMakeLists.txt";
  MemoryTracker& tracker = MemoryTracker::instance();
  ASSERT_EQ(tracker.current_total(), 0u) << "a fresh process holds nothing yet";
  int pp_rank = 0;
  Measured got;
  {
    train::TrainerOptions options;
    options.print = false;
    train::Trainer trainer(config, options);
    pp_rank = trainer.mesh().coord().pp;
    // Peaks from the first step on: building the model is not training
    // memory (ZeRO-3 draws its slices; the buffers it keeps are counted
    // either way, they stay allocated).
    tracker.reset_peaks();
    for (int s = 0; s < 3; s++) trainer.train_step();
    got.peak_total = static_cast<double>(tracker.peak_total());
    for (size_t c = 0; c < got.peak.size(); c++)
      got.peak[c] = static_cast<double>(tracker.peak(static_cast<MemCategory>(c)));
  }

  plan::Workload workload{name, train::model_config_of(config.model), io::global_batch_size(config), config.model};
  const plan::Layout layout = plan::layout_of(config);
  plan::MemoryOptions options;
  options.threads = 1;
  const plan::MemoryPlan plan = plan::predict_memory(workload, layout, options);
  const plan::RankMemory& mine = plan.ranks.at(static_cast<size_t>(pp_rank));
  const double predicted = mine.tracked(rank == 0);

  // Everyone's figures to rank 0, for one table.
  const double row[4] = {static_cast<double>(pp_rank), got.peak_total, predicted,
                         mine.model_state() + mine.category(MemCategory::Activations)};
  std::vector<double> rows(static_cast<size_t>(4 * size));
  MPI_Gather(row, 4, MPI_DOUBLE, rows.data(), 4, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    double worst = 0;
    for (int r = 0; r < size; r++) {
      const double* x = &rows[static_cast<size_t>(4 * r)];
      const double err = x[2] / x[1] - 1;
      worst = std::max(worst, std::fabs(err));
      std::printf("[ memory ] %-28s rank %d stage %.0f: measured %10.0f B, predicted %10.0f B (%+.2f%%)\n",
                  name.c_str(), r, x[0], x[1], x[2], 100 * err);
    }
    std::printf("[ memory ] %-28s worst |error| %.2f%%\n", name.c_str(), 100 * worst);
  }

  EXPECT_NEAR(predicted, got.peak_total, 0.05 * got.peak_total)
      << name << ", rank " << rank << " (pipeline stage " << pp_rank << "): peak total";
  for (MemCategory c : {MemCategory::Params, MemCategory::Grads, MemCategory::Optimizer, MemCategory::Activations}) {
    const double want = got.peak[static_cast<size_t>(c)];
    EXPECT_NEAR(mine.category(c), want, 0.05 * want + 64)
        << name << ", rank " << rank << " (pipeline stage " << pp_rank << "): " << mem_category_name(c);
  }
}

std::vector<std::string> with(std::vector<std::string> base, const std::vector<std::string>& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

// ---- one process ----
TEST(PlanMemory, OneProcess) { check_layout("one process", small_model()); }
TEST(PlanMemory, OneProcessBf16) { check_layout("one process bf16", with(small_model(), {"precision.compute=bf16"})); }
TEST(PlanMemory, OneProcessF16Selective) {
  check_layout("f16 selective", with(small_model(), {"precision.compute=f16", "recompute.mode=selective"}));
}
TEST(PlanMemory, RecomputeSelective) {
  check_layout("recompute selective", with(small_model(), {"recompute.mode=selective"}));
}
TEST(PlanMemory, RecomputeFull) { check_layout("recompute full", with(small_model(), {"recompute.mode=full"})); }
TEST(PlanMemory, LlamaOneProcess) { check_layout("llama one process", small_model("llama")); }

// ---- two ranks ----
TEST(PlanMemory, Dp2Zero0) {
  check_layout("dp2 zero0", with(small_model(), {"parallel.dp=2", "parallel.zero_stage=0"}));
}
TEST(PlanMemory, Dp2Zero1) {
  check_layout("dp2 zero1", with(small_model(), {"parallel.dp=2", "parallel.zero_stage=1"}));
}
TEST(PlanMemory, Dp2Zero2) {
  check_layout("dp2 zero2", with(small_model(), {"parallel.dp=2", "parallel.zero_stage=2"}));
}
TEST(PlanMemory, Dp2Zero3) {
  check_layout("dp2 zero3", with(small_model(), {"parallel.dp=2", "parallel.zero_stage=3"}));
}
TEST(PlanMemory, Dp2Zero3Offload) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("lattice_plan_offload_" + std::to_string(getpid()))).string();
  std::filesystem::create_directories(dir);
  check_layout("dp2 zero3 offload", with(small_model(), {"parallel.dp=2", "parallel.zero_stage=3", "zero.offload=disk",
                                                         "zero.offload_dir=" + dir}));
  std::filesystem::remove_all(dir);
}
TEST(PlanMemory, Dp2Zero3Bf16Llama) {
  check_layout("llama dp2 zero3 bf16",
               with(small_model("llama"), {"parallel.dp=2", "parallel.zero_stage=3", "precision.compute=bf16"}));
}
TEST(PlanMemory, Tp2) { check_layout("tp2", with(small_model(), {"parallel.tp=2"})); }
TEST(PlanMemory, Tp2Sp) {
  check_layout("tp2 sp", with(small_model(), {"parallel.tp=2", "parallel.sequence_parallel=true"}));
}
TEST(PlanMemory, Pp2OneFOneB) { check_layout("pp2 1f1b", with(small_model(), {"parallel.pp=2"})); }
TEST(PlanMemory, Pp2Gpipe) {
  check_layout("pp2 gpipe", with(small_model(), {"parallel.pp=2", "parallel.schedule=gpipe"}));
}
TEST(PlanMemory, Pp2ZbH1FullRecompute) {
  check_layout("pp2 zb-h1 recompute full",
               with(small_model(), {"parallel.pp=2", "parallel.schedule=zb-h1", "recompute.mode=full"}));
}
TEST(PlanMemory, Pp2Interleaved) {
  check_layout("pp2 interleaved v2",
               with(small_model(), {"parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"}));
}
TEST(PlanMemory, Cp2Ring) { check_layout("cp2 ring", with(small_model(), {"parallel.cp=2"})); }
TEST(PlanMemory, Cp2AllToAll) {
  check_layout("cp2 all-to-all", with(small_model(), {"parallel.cp=2", "parallel.cp_mode=all_to_all"}));
}
TEST(PlanMemory, MoeEp2) {
  check_layout("moe dp2 ep2 zero1", with(small_model("llama"), {"model.n_experts=4", "model.top_k=2", "parallel.dp=2",
                                                                "parallel.ep=2", "parallel.zero_stage=1"}));
}

// ---- four ranks ----
TEST(PlanMemory, Dp2Pp2Zero1) {
  check_layout("dp2 pp2 zero1", with(small_model(), {"parallel.dp=2", "parallel.pp=2", "parallel.zero_stage=1"}));
}
TEST(PlanMemory, Dp2Pp2Zero3) {
  check_layout("dp2 pp2 zero3", with(small_model(), {"parallel.dp=2", "parallel.pp=2", "parallel.zero_stage=3"}));
}
TEST(PlanMemory, Tp2Pp2Sp) {
  check_layout("tp2 pp2 sp",
               with(small_model(), {"parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"}));
}
TEST(PlanMemory, Pp4OneFOneB) { check_layout("pp4 1f1b", with(small_model(), {"parallel.pp=4"})); }

}  // namespace
