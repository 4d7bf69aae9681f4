// DistributedOptimizer: data parallelism, and ZeRO stage 1, for models whose
// gradients are final only when a whole schedule has run — the stage models
// of a pipeline (parallel/pipeline/). Megatron-LM's "distributed optimizer"
// is the same idea.
//
// Under a pipeline the micro-batches' forwards and backwards interleave, so a
// stage's gradient accumulates over the step and is final after the stage's
// last backward; DataParallel's hooks (which reduce group by group inside
// one micro-batch's backward) do not apply. Here a model's groups are
// reduced when the caller says they are final — the executor calls back
// after each stage's last backward, so the reductions overlap the rest of
// the schedule (the drain) — in buckets of the ShardLayout (shard_layout.h):
//
//   stage 0  every rank keeps parameters, gradients and Adam moments whole;
//            the buckets are all-reduced.                     16Ψ per rank
//   stage 1  Adam moments sharded: each bucket is reduce-scattered into this
//            rank's slice (a buffer of Ψ/n), AdamW updates the slices, and
//            the updated slices are all-gathered back into the whole
//            parameters.                                      8Ψ + 12Ψ/n
//
// (Ψ = this rank's parameters: its stages', and under tensor parallelism its
// slices of them.) Bytes each rank sends per step: 2Ψ(n-1)/n at both stages.
// Stages 2 and 3 — sharding the gradient and the parameters — would reduce
// every micro-batch's gradient and gather every chunk's parameters for each
// of its 2m passes; they are not implemented for pipelines (DeepSpeed's
// pipeline engine also runs ZeRO-1 only) and the trainer refuses them.
//
// Every rank of the data-parallel group must make the same calls in the same
// order (replicas run the same schedule, so the stages finish alike).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "lattice/comm/communicator.h"
#include "lattice/core/memory.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/parallel/zero/shard_layout.h"

namespace lattice::parallel {

class DistributedOptimizer {
 public:
  // `models`: this rank's stage models; their groups are padded to whole
  // buckets (values kept). `bucket_bytes`: the largest reduction call.
  DistributedOptimizer(std::vector<model::GPT*> models, comm::Communicator& dp, int zero_stage, double bucket_bytes,
                       const optim::AdamWConfig& adam);
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  int stage() const { return stage_; }
  int ranks() const { return dp_.size(); }
  optim::AdamW& optimizer() { return *optimizer_; }

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

  // Checkpoints: the whole moment array (StateStore::kM or kV) of models[j]'s
  // group g, capacity() floats — collective over the group at stage 1 — and
  // taking this rank's part of a whole one.
  void gather_moments(size_t j, size_t g, int array, float* out);
  void load_moments(size_t j, size_t g, int array, const float* full);

 private:
  struct Group {
    model::ParamGroup* group;
    GroupShard shard;
    std::vector<ShardLayout::Run> runs;
    int64_t state_base = 0;  // offset of its shard in the optimizer state
    Buffer shard_grad;       // stage 1: this rank's summed slices
  };
  std::vector<std::vector<Group>> models_;  // per model, per group
  std::vector<model::GPT*> gpts_;
  comm::Communicator& dp_;
  int stage_;
  std::unique_ptr<optim::AdamW> optimizer_;
  std::vector<comm::WorkPtr> pending_;
};

}  // namespace lattice::parallel
