// LossScaler: the loss scale of f16 mixed precision (precision.loss_scale).
//
// f16 has 5 exponent bits: gradients below 2^-24 underflow to zero and
// values above 65504 overflow to infinity. The trainer multiplies the loss
// by the scale S before the backward (every activation gradient and every
// parameter gradient is S times larger, lifting small ones into range) and
// divides the gradients by S again in the optimizer (AdamW's grad_scale),
// so a step with a finite gradient is the unscaled step.
//
// After each step's gradients are reduced, update(finite) is told whether
// they are finite on every rank (one flag reduced over the world, so every
// rank takes the same decision):
//   not finite  the step is skipped on every rank (no optimizer update, the
//               parameters and moments stay bit-identical) and, when dynamic,
//               S ← max(S · backoff, min_scale), the clean count restarts;
//   finite      the step is applied; when dynamic, after `window` clean
//               steps in a row S ← S · growth (DeepSpeed and PyTorch's
//               GradScaler do the same; defaults: 2^16, 0.5, ×2 after 1000).
// A static scale (precision.loss_scale = a number) never changes; its
// overflowing steps are skipped too. The trainer stops the run, saying
// why, when a step overflows at the dynamic scale's floor (it can go no
// lower) or a static scale overflows kStaticSkipLimit steps in a row. bf16 has f32's exponent range and
// needs no scale (the trainer runs it with S = 1 and says so).
//
// The state (scale, clean count, skipped total) is saved in checkpoints'
// meta.json and restored on resume.
#pragma once

#include <cstdint>
#include <string>

namespace lattice::optim {

// A static scale that overflows this many steps in a row stops the run.
constexpr int64_t kStaticSkipLimit = 10;

struct LossScalerConfig {
  bool dynamic = true;
  double scale = 65536;  // the static scale, or the dynamic one's initial value
  double backoff = 0.5;
  double growth = 2.0;
  int64_t window = 1000;  // clean steps before a growth
  double min_scale = 1.0;
};

class LossScaler {
 public:
  LossScaler() : LossScaler(LossScalerConfig{false, 1.0}) {}  // scale 1, never changes: f32 and bf16
  explicit LossScaler(const LossScalerConfig& config);

  double scale() const { return scale_; }
  // Applies the step (true) or skips it (false), and moves the scale.
  bool update(bool finite);

  int64_t skipped() const { return skipped_; }  // steps skipped so far
  int64_t skipped_in_a_row() const { return in_a_row_; }
  int64_t clean_steps() const { return clean_; }  // finite steps since the scale last changed
  bool last_skipped() const { return last_skipped_; }
  const LossScalerConfig& config() const { return config_; }
  // "dynamic loss scale 65536 (x0.5 on overflow, x2 after 1000 clean steps, floor 1)" or "static loss scale 1024".
  std::string describe() const;

  // Checkpoint state.
  void restore(double scale, int64_t clean, int64_t skipped, int64_t skipped_in_a_row = 0);

 private:
  LossScalerConfig config_;
  double scale_;
  int64_t clean_ = 0, skipped_ = 0, in_a_row_ = 0;
  bool last_skipped_ = false;
};

}  // namespace lattice::optim
