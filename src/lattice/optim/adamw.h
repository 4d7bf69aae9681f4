// AdamW over ParamGroups, the learning-rate schedule, and global grad-norm
// clipping.
//
// Weight decay (the GPT-2 / nanoGPT recipe): decoupled decay on every 2-D
// tensor — the token and position embeddings and all Linear weights; none on
// biases and LayerNorm parameters. (ParamInfo::weight_decay carries the flag.)
#pragma once

#include <cstdint>
#include <vector>

#include "lattice/core/memory.h"
#include "lattice/model/param_group.h"

namespace lattice::optim {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
};

class AdamW {
 public:
  // Allocates fp32 first and second moments (zero) for every group.
  AdamW(std::vector<model::ParamGroup>& groups, const AdamWConfig& config);

  // One update with learning rate `lr`; every gradient is multiplied by
  // grad_scale first (clipping and loss-scale removal fold in here).
  void step(float lr, float grad_scale);

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t t) { step_ = t; }
  // Moments of group g (same layout as the group's flat buffer).
  float* m(size_t g) { return m_[g].as<float>(); }
  float* v(size_t g) { return v_[g].as<float>(); }
  const AdamWConfig& config() const { return config_; }

 private:
  std::vector<model::ParamGroup>& groups_;
  AdamWConfig config_;
  std::vector<Buffer> m_, v_;
  int64_t step_ = 0;
};

// Linear warm-up to max_lr over warmup_steps, then cosine decay to min_lr at
// the last step:
//   s < W:  lr = max_lr·(s+1)/W
//   else:   r = (s-W)/(S-W), lr = min_lr + ½(1 + cos πr)(max_lr - min_lr)
// for step index s in [0, S).
float lr_at(int64_t step, int64_t total_steps, int64_t warmup_steps, float max_lr, float min_lr);

// √(Σ g²) over every gradient of the groups, accumulated in double.
double global_grad_norm(const std::vector<model::ParamGroup>& groups);
// Σ g² of one group's gradients (the local part of a distributed norm).
double grad_sum_squares(const model::ParamGroup& group);

// The factor clip_grad_norm_ applies: max_norm / (norm + 1e-6) when that is
// below 1, else 1 (max_norm <= 0 disables clipping).
float clip_scale(double norm, float max_norm);

}  // namespace lattice::optim
