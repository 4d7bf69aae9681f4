#include "lattice/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "lattice/core/error.h"

namespace lattice::optim {

LossScaler::LossScaler(const LossScalerConfig& config) : config_(config), scale_(config.scale) {
  LATTICE_CHECK(config.scale > 0 && std::isfinite(config.scale), "loss scale must be positive, got " << config.scale);
  LATTICE_CHECK(!config.dynamic || (config.backoff > 0 && config.backoff < 1 && config.growth > 1 &&
                                    config.window >= 1 && config.min_scale > 0 && config.min_scale <= config.scale),
                "dynamic loss scale needs 0 < backoff < 1, growth > 1, window >= 1 and 0 < min_scale <= the "
                "initial scale");
}

bool LossScaler::update(bool finite) {
  last_skipped_ = !finite;
  in_a_row_ = finite ? 0 : in_a_row_ + 1;
  if (!finite) {
    skipped_++;
    clean_ = 0;
    if (config_.dynamic) scale_ = std::max(scale_ * config_.backoff, config_.min_scale);
    return false;
  }
  if (config_.dynamic && ++clean_ >= config_.window) {
    scale_ *= config_.growth;
    clean_ = 0;
  }
  return true;
}

std::string LossScaler::describe() const {
  std::ostringstream s;
  if (!config_.dynamic) {
    s << "static loss scale " << scale_;
  } else {
    s << "dynamic loss scale " << scale_ << " (x" << config_.backoff << " on overflow, x" << config_.growth << " after "
      << config_.window << " clean steps, floor " << config_.min_scale << ")";
  }
  return s.str();
}

void LossScaler::restore(double scale, int64_t clean, int64_t skipped, int64_t skipped_in_a_row) {
  LATTICE_CHECK(scale > 0 && std::isfinite(scale) && clean >= 0 && skipped >= 0 && skipped_in_a_row >= 0 &&
                    skipped_in_a_row <= skipped,
                "malformed loss-scaler state: scale " << scale << ", clean steps " << clean << ", skipped " << skipped);
  scale_ = scale;
  clean_ = clean;
  skipped_ = skipped;
  in_a_row_ = skipped_in_a_row;
}

}  // namespace lattice::optim
