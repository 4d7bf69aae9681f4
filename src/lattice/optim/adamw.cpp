#include "lattice/optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "lattice/core/error.h"

#include "lattice/kernels/ops.h"

namespace lattice::optim {

AdamW::AdamW(std::vector<AdamWSegment> segments, std::unique_ptr<StateStore> store, const AdamWConfig& config)
    : segments_(std::move(segments)), store_(std::move(store)), config_(config) {
  int64_t end = 0;
  for (const AdamWSegment& s : segments_) {
    LATTICE_CHECK(s.state_offset >= end && s.n >= 0, "AdamW segments must be sorted and disjoint");
    end = s.state_offset + s.n;
  }
  LATTICE_CHECK(end <= store_->numel(), "AdamW segments reach element " << end << " of a state of "
                                                                         << store_->numel());
}

static std::vector<AdamWSegment> whole_groups(std::vector<model::ParamGroup>& groups, std::vector<int64_t>* offsets,
                                              int64_t* total) {
  std::vector<AdamWSegment> segs;
  int64_t base = 0;
  for (model::ParamGroup& g : groups) {
    offsets->push_back(base);
    for (size_t p = 0; p < g.params().size(); p++) {
      const model::ParamInfo& info = g.params()[p];
      segs.push_back({g.param(p), nullptr, info.numel(), base + info.offset, info.weight_decay});
    }
    base += g.numel();
  }
  *total = base;
  return segs;
}

AdamW::AdamW(std::vector<model::ParamGroup>& groups, const AdamWConfig& config) : config_(config) {
  int64_t total = 0;
  segments_ = whole_groups(groups, &group_offsets_, &total);
  store_ = make_memory_store(total, 2);
  // Gradient pointers are taken at each step (they are written after construction).
  size_t i = 0;
  for (model::ParamGroup& g : groups)
    for (size_t p = 0; p < g.params().size(); p++, i++) segments_[i].grad = g.grad_storage() + g.params()[p].offset;
}

float* AdamW::group_state(int array, size_t g) {
  LATTICE_CHECK(g < group_offsets_.size() && store_->resident(array),
                "AdamW::m/v(group) needs the whole-groups optimizer with its state in memory");
  return store_->resident(array) + group_offsets_[g];
}

void AdamW::for_each_run(const std::function<void(const AdamWSegment&, int64_t in_seg, int64_t n, float* p, float* m,
                                                 float* v)>& fn,
                         const std::function<void(int64_t end)>& updated) {
  const bool store_has_params = store_->arrays() == 3;
  size_t first = 0;  // segments are sorted: each window starts where the last stopped
  store_->update_in_windows([&](int64_t begin, int64_t n, float* const* window) {
    const int64_t end = begin + n;
    while (first < segments_.size() && segments_[first].state_offset + segments_[first].n <= begin) first++;
    for (size_t i = first; i < segments_.size() && segments_[i].state_offset < end; i++) {
      const AdamWSegment& s = segments_[i];
      const int64_t lo = std::max(begin, s.state_offset), hi = std::min(end, s.state_offset + s.n);
      if (lo >= hi) continue;
      const int64_t in_seg = lo - s.state_offset, in_win = lo - begin;
      float* p = store_has_params ? window[StateStore::kP] + in_win : s.param + in_seg;
      fn(s, in_seg, hi - lo, p, window[StateStore::kM] + in_win, window[StateStore::kV] + in_win);
      if (updated) updated(hi);
    }
  });
}

void AdamW::step(float lr, float grad_scale, const std::function<void(int64_t end)>& updated) {
  step_++;
  for_each_run(
      [&](const AdamWSegment& s, int64_t in_seg, int64_t n, float* p, float* m, float* v) {
        kernels::adamw_update(p, s.grad + in_seg, m, v, n, lr, config_.beta1, config_.beta2, config_.eps,
                              s.decay ? config_.weight_decay : 0.0f, step_, grad_scale);
      },
      updated);
}

void AdamW::step_momentum(float lr, int64_t variance_steps, const std::function<void(int64_t end)>& updated) {
  step_++;
  for_each_run(
      [&](const AdamWSegment& s, int64_t in_seg, int64_t n, float* p, float* m, float* v) {
        kernels::adamw_momentum_update(p, s.grad + in_seg, m, v, n, lr, config_.beta1, config_.beta2, config_.eps,
                                       s.decay ? config_.weight_decay : 0.0f, step_, variance_steps);
      },
      updated);
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
