// DistributedOptimizer: data parallelism and ZeRO stages 0-3 for models whose
// gradients are final only when a whole schedule has run — the stage models
// of a pipeline (parallel/pipeline/). Megatron-LM's "distributed optimizer"
// is the stage-1 idea.
//
// Under a pipeline the micro-batches' forwards and backwards interleave, so a
// stage's gradient accumulates over the step and is final after the stage's
// last backward. Per stage (Ψ = this rank's parameters: its stages', and
// under tensor parallelism its slices of them; n = replicas):
//
//   stage 0  parameters, gradients and Adam moments whole; each bucket is
//            all-reduced once the stage's last backward of the step has run
//            (the executor calls back there), overlapping the rest of the
//            schedule.                                          16Ψ per rank
//   stage 1  the same gradients reduce-scattered into this rank's slices;
//            AdamW updates the slices, which are all-gathered back into the
//            whole parameters.                                  8Ψ + 12Ψ/n
//   stage 2  gradients sharded too: each group's gradient exists only while
//            a backward writes it (a buffer borrowed from a pool) and is
//            reduce-scattered into the slices after every micro-batch's
//            backward of the stage, as the model's hooks report it done —
//            m reductions per step where stages 0-1 make one.  4Ψ + 12Ψ/n
//   stage 3  parameters sharded too: each group is all-gathered into a
//            borrowed buffer for every pass that reads it (each chunk's F
//            and B or I of every micro-batch: W reads none) and released
//            after it.                                            16Ψ/n
// plus the borrowed buffers (at stages 2-3 the tied embedding is gathered
// and reduced whole: DataParallel's piece-by-piece ShardedEmbedding is for a
// model that runs both lookup and head). The tied embedding's two copies
// (first and last stage) are summed after the reductions — on the whole
// gradient by the executor at stages 0-1, on the slices here at stages 2-3
// (the tied_sum the caller gives). Under PowerSGD (compression.grad =
// powersgd) each group is reduced as one operation, its matrices compressed
// (powersgd.h; the embedding's wte whole, as one matrix).
//
// Bytes each rank sends per step: stages 0-1 2Ψ(n-1)/n; stage 2 m·Ψ(n-1)/n
// plus Ψ(n-1)/n of parameter gathers; stage 3 m·Ψ(n-1)/n of gradients plus
// 2·m·Ψ(n-1)/n of gathers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "lattice/comm/communicator.h"
#include "lattice/core/memory.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/parallel/compress/gradient_reducer.h"
#include "lattice/parallel/data/comm_stream.h"
#include "lattice/parallel/zero/shard_layout.h"

namespace lattice::parallel {

class DistributedOptimizer {
 public:
  // `models`: this rank's stage models; their groups are padded to whole
  // buckets (values kept). `bucket_bytes`: the largest reduction call.
  DistributedOptimizer(std::vector<model::GPT*> models, comm::Communicator& dp, int zero_stage, double bucket_bytes,
                       const optim::AdamWConfig& adam, const CompressionOptions& compression = {},
                       Progress progress = Progress::Thread);
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  int stage() const { return stage_; }
  int ranks() const { return dp_.size(); }
  optim::AdamW& optimizer() { return *optimizer_; }
  GradientReducer& reducer() { return *reducer_; }
  CommStream& stream() { return *stream_; }

  // Before each step (index from 0): compression on after its warm-up, byte counters reset.
  void begin_step(int64_t step);
  // Sum over the replicas (through the stream, after what is posted).
  double sum_over_ranks(double x);

  // Posts the reduction of models[j]'s groups: the embedding group alone
  // (`embedding` true), or every other group. Non-blocking; a group whose
  // gradient was never written this step (a stage's unused share) counts as
  // zeros. With one rank it does nothing.
  void reduce(size_t j, bool embedding);
  // Waits for every posted reduction: then this rank's slices (stage 1) or
  // whole gradients (stage 0) hold the sum over the replicas.
  void finish_reductions();
  // Σ g² of the summed gradient over the parameters `counted(j, group,
  // param)` admits, each element once over the data-parallel group (stage 1
  // adds this rank's slices and all-reduces the scalar).
  double grad_sum_squares(const std::function<bool(size_t, size_t, const model::ParamInfo&)>& counted);
  // AdamW (grad_scale multiplies every gradient first), then at stage 1 the
  // updated slices all-gathered: every replica holds the same whole parameters.
  void step(float lr, float grad_scale);

  // Checkpoints: the whole array (StateStore::kP for the parameters, kM or
  // kV) of models[j]'s group g, capacity() floats — collective over the
  // group where it is sharded — and taking this rank's part of a whole one.
  void gather_state(size_t j, size_t g, int array, float* out);
  void load_state(size_t j, size_t g, int array, const float* full);

  // Stages 2-3: sums the tied embedding's gradient slices between the first
  // and the last stage (either may be null: that copy is on another rank).
  using TiedSum = std::function<void(float* first, float* last, size_t n)>;
  void set_tied_sum(TiedSum sum) { tied_sum_ = std::move(sum); }

 private:
  class StageHooks;
  struct Group {
    model::ParamGroup* group;
    int64_t key = 0;     // GradientReducer key group
    GroupShard buckets;  // the reduction's chunks over the dp ranks
    GroupShard shard;    // what this rank's optimizer updates (the whole group at stage 0)
    std::vector<ShardLayout::Run> runs;
    int64_t state_base = 0;      // offset of its shard in the optimizer state
    Buffer shard_grad;           // stages 1-3: this rank's summed slices
    bool shard_written = false;  // stages 2-3: this step's first reduction overwrites
    int param_users = 0;         // stage 3: passes reading the gathered buffer
    LowRankLayout lowrank;       // compression.grad = powersgd: its matrices
  };
  // Stages 2-3: borrowed whole-group buffers, by capacity.
  float* borrow(int64_t capacity, MemCategory category);
  void give_back(int64_t capacity, float* p);
  void reap();
  void gather_params(size_t j, size_t g);
  void release_params(size_t j, size_t g);
  void borrow_grads(size_t j, size_t g);
  void reduce_grads(size_t j, size_t g);
  void post_reduction(Group& e, float* chunk_base, bool accumulate);
  std::vector<std::vector<Group>> models_;  // per model, per group
  std::vector<model::GPT*> gpts_;
  comm::Communicator& dp_;
  int stage_;
  std::unique_ptr<optim::AdamW> optimizer_;
  std::unique_ptr<CommStream> stream_;
  std::unique_ptr<GradientReducer> reducer_;
  std::vector<std::unique_ptr<StageHooks>> hooks_;
  struct Pooled {
    int64_t capacity;
    MemCategory category;
    std::vector<Buffer> buffers;
    std::vector<float*> free;
  };
  std::vector<Pooled> pool_;
  struct Release {
    CommStream::Ticket ticket;
    int64_t capacity;
    float* buffer;
  };
  std::vector<Release> pending_releases_;
  TiedSum tied_sum_;
};

}  // namespace lattice::parallel
