// The memory model: what each rank of a layout holds, per pipeline stage
// (never averaged over stages), in lattice's own accounting — the
// MemoryTracker categories the trainer prints (params, grads, optimizer,
// activations, comm, workspace) — plus what lies outside them (the
// allocator's fragmentation, a device runtime).
//
// It is lattice's allocation code read as formulas, not a textbook estimate:
// every term below names the code that allocates it, and the planner's test
// (tests/plan/plan_memory_test.cpp) holds the sum to the MemoryTracker of
// real runs on this machine. The textbook figures are the special cases:
//
//   model state, ZeRO (Rajbhandari et al. 2020, Table 1; Ψ parameters, N_d
//   data-parallel ranks, K bytes of optimizer state per parameter): stage 0
//   (2 + 2 + K)Ψ, stage 1 (2 + 2)Ψ + KΨ/N_d, stage 2 2Ψ + (2 + K)Ψ/N_d,
//   stage 3 (2 + 2 + K)Ψ/N_d — with 16-bit weights and gradients, K = 12
//   (f32 master, momentum, variance): 16Ψ at stage 0.
//   lattice keeps f32 weights and gradients (DataParallel, data_parallel.h):
//   4 + 4 + 8 = 16 bytes a parameter at f32 (the masters are the weights),
//   plus the compute copy at bf16/f16 (docs/precision.md: 4 bytes on this
//   CPU, f32 storage holding 16-bit values, and 2 more for oneDNN's bf16
//   copy of each weight matrix; a 16-bit GPU backend would keep 2): so
//   16Ψ (f32), 22Ψ (bf16 on the CPU), 18Ψ (bf16, Backend::Gpu).
//
//   activations per layer (Korthikanti et al. 2022, "Reducing Activation
//   Recomputation in Large Transformer Models", §4; s sequence, b micro-
//   batch, h hidden, a heads, t tensor-parallel size, 16-bit values with
//   dropout masks and the a·s·s scores): sbh(34 + 5as/h) bytes; with TP
//   sbh(10 + 24/t + 5as/(ht)); TP + SP sbh(34/t + 5as/(ht)); selective
//   recomputation 34sbh/t (TP+SP); full 2sbh. lattice stores no scores
//   (flash-style attention keeps the log-sum-exp) and no dropout masks, so
//   its stored set is docs/recompute.md's table — e·(4RC + N·(QKV + A + FU
//   + F)) + 4·(4R + N·NH) bytes per layer with no recomputation (e bytes per
//   stored value, N tokens, R = N or N/t rows of the residual stream) — and
//   korthikanti_layer_bytes() below gives the paper's for comparison.
//
// Everything here is per rank. Every rank of a pipeline rank's tp × dp × cp
// replicas holds the same, except world rank 0 on the CPU (`rank0_extra`).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "lattice/core/memory.h"
#include "lattice/parallel/pipeline/partition.h"
#include "lattice/parallel/pipeline/schedule.h"
#include "lattice/plan/layout.h"

namespace lattice::plan {

// Whose kernels hold the memory: lattice's CPU kernels (what runs today,
// and what the MemoryTracker test checks), or a GPU backend with 16-bit
// kernels (compute copies of 2 bytes, no oneDNN copies, no CPU scratch; the
// device's runtime and allocator terms from the cluster description).
enum class Backend { Cpu, Gpu };

struct MemoryOptions {
  Backend backend = Backend::Cpu;
  int threads = 1;                 // CPU threads per rank (the attention kernel keeps tiles per thread)
  bool bf16_weight_copies = true;  // CPU at bf16: oneDNN's bf16 matmul is the path (it keeps bf16 weight copies)
  double offload_window_mb = 64;   // zero.offload_window_mb
  double fragmentation = 0;        // share of the tracked bytes the allocator loses (caching allocators: ~5-10%)
  double runtime_bytes = 0;        // per device, outside every allocation (a CUDA context, NCCL's buffers)
};

// One named term of a rank's memory, in the MemoryTracker category that counts it.
struct MemoryTerm {
  MemCategory category = MemCategory::Workspace;
  std::string what;  // "master weights (f32): 4 B x 1.2M, 5 groups"
  double bytes = 0;
};

// The memory of one pipeline rank (its chunks: one stage, or v under
// interleaving).
struct RankMemory {
  int pp_rank = 0;
  std::vector<int> stages;                    // the pipeline stages (chunks) it runs
  std::vector<pipeline::ChunkLayers> layers;  // their layers
  std::vector<int> in_flight;                 // micro-batches each chunk holds at most (its activation slots)
  std::array<double, static_cast<size_t>(MemCategory::kCount)> by_category{};  // steady, tracked
  double transient = 0;    // tracked too: a growing buffer's old copy, alive at the peak (ring scratch)
  double rank0_extra = 0;  // world rank 0 only (CPU: the buffers of the bf16 GEMM path's start-up timing)
  double fragmentation = 0, runtime = 0;  // untracked
  std::vector<MemoryTerm> terms;          // filled with `detail`
  double category(MemCategory c) const { return by_category[static_cast<size_t>(c)]; }
  // Model state: params + grads + optimizer.
  double model_state() const;
  // What the MemoryTracker's peak total reads on this rank (rank0: world rank 0).
  double tracked(bool rank0 = false) const;
  // What the device must hold: tracked (the worst rank: rank 0's extra
  // included) + fragmentation + runtime.
  double total() const;
};

struct MemoryPlan {
  std::vector<RankMemory> ranks;  // one per pipeline rank
  // The pipeline rank that needs the most, and its need.
  int worst_rank() const;
  double max_total() const;
};

// The pipeline of a layout: its schedule (pipeline::make_schedule), the
// trainer's cut of the layers into the schedule's stages (balanced by
// layer_costs, refined by simulation: Trainer::build does the same), and the
// activation slots each stage's executor holds (pipeline/executor.cpp: a
// slot is taken by F and given back after B, or after W of a split backward).
struct PipelineShape {
  pipeline::Schedule schedule;
  std::vector<pipeline::ChunkLayers> cut;
  std::vector<int> slots;  // per stage
  double unit_bubble = 0;  // the simulator's bubble at unit costs (F = I = W = 1)
  // False for the search's first pass (pipeline_shape_estimate): the cut is
  // balanced but not refined, and past 4·p·v micro-batches the schedule is
  // that many (the slots no longer grow) and the bubble the schedule's
  // formula. Only an exact shape may be simulated.
  bool exact = true;
};
PipelineShape pipeline_shape(const model::ModelConfig& model, const Layout& layout);
// The first pass's shape: what pipeline_shape gives, cheaply for large
// pipelines. The same refusals (the schedule generator sees a micro-batch
// count with the same remainder modulo p).
PipelineShape pipeline_shape_estimate(const model::ModelConfig& model, const Layout& layout);
// Shapes remembered per (schedule, pp, virtual stages, micro-batches) for
// one model: the search asks for the same pipelines many times. `exact`
// false: pipeline_shape_estimate's.
class PipelineShapes {
 public:
  explicit PipelineShapes(const model::ModelConfig& model, bool exact = true) : model_(model), exact_(exact) {}
  const PipelineShape& get(const Layout& layout);

 private:
  model::ModelConfig model_;
  bool exact_;
  // By (schedule, pp, virtual stages, micro-batches), the schedule by its place in names_.
  std::map<std::tuple<int, int, int, int>, std::unique_ptr<PipelineShape>> cache_;
  std::vector<std::string> names_;
};

// The activation slots a stage's executor needs: the most micro-batches
// between their F and their last backward (B or W) at once, read off the
// rank's action order.
std::vector<int> activation_slots(const pipeline::Schedule& s);

// Every pipeline rank's memory. `shapes` (optional) caches pipelines across
// calls; `detail` fills RankMemory::terms.
MemoryPlan predict_memory(const Workload& workload, const Layout& layout, const MemoryOptions& options,
                          PipelineShapes* shapes = nullptr, bool detail = false);

// Parameters of one rank's slices, by group kind, with lattice's padding
// (each parameter starts on 16 floats, parameters of one packed matrix
// excepted: model/param_group.h), under tensor parallelism over t.
struct GroupNumels {
  int64_t embedding = 0;  // wte slice (+ wpe)
  int64_t block = 0;      // a dense block
  int64_t moe_block = 0;  // a block whose MLP is experts: norms, attention, router, shared experts
  int64_t experts = 0;    // one MoE layer's experts on one of ep ranks (whole, not TP-cut)
  int64_t final = 0;      // final norm (+ lm_head slice when untied)
};
GroupNumels group_numels(const model::ModelConfig& model, int tp, int ep);

// Model-state bytes per device in the ZeRO paper's accounting (Rajbhandari
// et al. 2020, §5 and Table 1): 2Ψ of 16-bit weights, 2Ψ of 16-bit
// gradients and KΨ of optimizer state (K = 12 for mixed-precision Adam),
// over N_d data-parallel ranks at stage 0 (baseline), 1 (P_os), 2 (P_os+g)
// or 3 (P_os+g+p). For comparison with lattice's own.
double zero_paper_bytes(double psi, double K, int Nd, int stage);

// Bytes of activations per layer per micro-batch in Korthikanti et al. 2022
// (16-bit values, §4, Table 2): none sbh(34 + 5as/h) (TP: sbh(10 + 24/t +
// 5as/(ht)); TP+SP: sbh(34/t + 5as/(ht))), selective 34sbh (/t with SP; TP
// alone sbh(10 + 24/t)), full 2sbh. For comparison with lattice's own.
double korthikanti_layer_bytes(double s, double b, double h, double a, int t, bool sp, model::Recompute r);

// lattice's bytes per layer per micro-batch stored for the backward (the
// slot's share of one layer, its input x_l included: docs/recompute.md's
// table), for the layout's N tokens of this rank, R rows of the residual
// stream, this rank's widths (a dense layer).
double lattice_layer_bytes(const model::ModelConfig& model, const Layout& layout);

}  // namespace lattice::plan
