#include "lattice/optim/adamw.h"

#include <cmath>

#include "lattice/kernels/ops.h"

namespace lattice::optim {

AdamW::AdamW(std::vector<model::ParamGroup>& groups, const AdamWConfig& config) : groups_(groups), config_(config) {
  for (const model::ParamGroup& g : groups_) {
    m_.emplace_back(static_cast<size_t>(g.numel()) * sizeof(float), MemCategory::Optimizer);
    v_.emplace_back(static_cast<size_t>(g.numel()) * sizeof(float), MemCategory::Optimizer);
  }
}

void AdamW::step(float lr, float grad_scale) {
  step_++;
  for (size_t gi = 0; gi < groups_.size(); gi++) {
    model::ParamGroup& g = groups_[gi];
    for (size_t p = 0; p < g.params().size(); p++) {
      const model::ParamInfo& info = g.params()[p];
      kernels::adamw_update(g.param(p), g.param_grad(p), m(gi) + info.offset, v(gi) + info.offset, info.numel(),
                            lr, config_.beta1, config_.beta2, config_.eps,
                            info.weight_decay ? config_.weight_decay : 0.0f, step_, grad_scale);
    }
  }
}

float lr_at(int64_t step, int64_t total_steps, int64_t warmup_steps, float max_lr, float min_lr) {
  if (step < warmup_steps) return max_lr * static_cast<float>(step + 1) / static_cast<float>(warmup_steps);
  if (total_steps <= warmup_steps) return max_lr;
  double ratio = static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
  if (ratio > 1.0) ratio = 1.0;
  double coeff = 0.5 * (1.0 + std::cos(M_PI * ratio));
  return static_cast<float>(min_lr + coeff * (static_cast<double>(max_lr) - min_lr));
}

double grad_sum_squares(const model::ParamGroup& group) {
  return kernels::sum_squares(group.grad(), group.numel());
}

double global_grad_norm(const std::vector<model::ParamGroup>& groups) {
  double sum = 0;
  for (const model::ParamGroup& g : groups) sum += grad_sum_squares(g);
  return std::sqrt(sum);
}

float clip_scale(double norm, float max_norm) {
  if (max_norm <= 0.0f) return 1.0f;
  double scale = static_cast<double>(max_norm) / (norm + 1e-6);
  return scale < 1.0 ? static_cast<float>(scale) : 1.0f;
}

}  // namespace lattice::optim
