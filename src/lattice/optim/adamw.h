// AdamW over ParamGroups, the learning-rate schedule, and global grad-norm
// clipping.
//
// Weight decay (the GPT-2 / nanoGPT recipe): decoupled decay on every 2-D
// tensor — the token and position embeddings and all Linear weights; none on
// biases and LayerNorm parameters. (ParamInfo::weight_decay carries the flag.)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "lattice/core/memory.h"
#include "lattice/model/param_group.h"
#include "lattice/optim/state_store.h"

namespace lattice::optim {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
};

// One contiguous run of elements that AdamW updates with one weight-decay
// flag: the parameters, their gradients, and their state at `state_offset`
// in the StateStore. Under ZeRO a rank's segments cover only its shard; a
// weight-decay flag is per run, so a shard boundary inside a tensor is fine.
struct AdamWSegment {
  float* param = nullptr;  // ignored when the store holds the parameters (kP)
  const float* grad = nullptr;
  int64_t n = 0;
  int64_t state_offset = 0;
  bool decay = false;
  // Ranks of the tensor-parallel group that hold these values alike: 0 (every
  // rank: a parameter whole everywhere, ShardSpec split_dim < 0), r > 1 (a
  // piece held by r consecutive ranks, ShardSpec::replicas: key/value heads
  // kept whole on the ranks of their query heads), or 1 (a slice of its own).
  int replicas = 1;
};

class AdamW {
 public:
  // Updates `segments` (sorted by state_offset, not overlapping), with the
  // moments (and, with 3 arrays, the parameters) in `store`.
  AdamW(std::vector<AdamWSegment> segments, std::unique_ptr<StateStore> store, const AdamWConfig& config);
  // Every parameter of `groups`, whole, with moments in memory laid out like
  // the groups' flat buffers one after another (m(g), v(g) below).
  AdamW(std::vector<model::ParamGroup>& groups, const AdamWConfig& config);

  // One update with learning rate `lr`; every gradient is multiplied by
  // grad_scale first (clipping, data-parallel averaging and loss-scale
  // removal fold in here). `updated(end)`, if given, is called as the update
  // goes: every state element below `end` is done (ZeRO starts gathering
  // updated parameters while the rest are being updated).
  void step(float lr, float grad_scale, const std::function<void(int64_t end)>& updated = {});
  // 1-bit Adam's step after its warm-up (compression.momentum): each
  // segment's `grad` holds the momentum itself, formed and averaged over the
  // data-parallel ranks by the caller; it becomes the state's m, and v stays
  // frozen as it was after `variance_steps` updates (its bias correction
  // 1 - β2^variance_steps). Otherwise as step().
  void step_momentum(float lr, int64_t variance_steps, const std::function<void(int64_t end)>& updated = {});

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t t) { step_ = t; }
  const AdamWConfig& config() const { return config_; }
  StateStore& store() { return *store_; }
  const std::vector<AdamWSegment>& segments() const { return segments_; }

  // Moments of group g, for the groups constructor (memory store, whole groups).
  float* m(size_t g) { return group_state(StateStore::kM, g); }
  float* v(size_t g) { return group_state(StateStore::kV, g); }

 private:
  float* group_state(int array, size_t g);
  // fn(segment, offset in it, n, p, m, v) over every run of a segment in
  // each window of the store; updated(end) after each (see step).
  void for_each_run(const std::function<void(const AdamWSegment&, int64_t in_seg, int64_t n, float* p, float* m,
                                             float* v)>& fn,
                    const std::function<void(int64_t end)>& updated);

  std::vector<AdamWSegment> segments_;
  std::unique_ptr<StateStore> store_;
  AdamWConfig config_;
  std::vector<int64_t> group_offsets_;  // groups constructor only
  int64_t step_ = 0;
};

// Linear warm-up to max_lr over warmup_steps, then cosine decay to min_lr at
// the last step:
//   s < W:  lr = max_lr·(s+1)/W
//   else:   r = (s-W)/(S-W), lr = min_lr + ½(1 + cos πr)(max_lr - min_lr)
// for step index s in [0, S).
float lr_at(int64_t step, int64_t total_steps, int64_t warmup_steps, float max_lr, float min_lr);

// √(Σ g²) over every gradient of the groups, accumulated in double (one process).
double global_grad_norm(const std::vector<model::ParamGroup>& groups);
// Σ g² of one group's gradients (the local part of a distributed norm).
double grad_sum_squares(const model::ParamGroup& group);

// The factor clip_grad_norm_ applies: max_norm / (norm + 1e-6) when that is
// below 1, else 1 (max_norm <= 0 disables clipping).
float clip_scale(double norm, float max_norm);

}  // namespace lattice::optim
