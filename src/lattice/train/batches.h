// Where a trainer's token batches come from: .bin shards through the data
// loader, or a synthetic learnable stream when no data is configured.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "lattice/io/json.h"

namespace lattice::train {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Fills inputs[B·T] and targets[B·T] (targets = inputs shifted by one).
  virtual void next(int32_t* inputs, int32_t* targets) = 0;
  // Back to the first batch (evaluation restarts the val stream every time).
  virtual void reset() = 0;
  // Position, for checkpoints: resuming from it continues bit-identically.
  virtual io::JsonValue state() const = 0;
  virtual void restore(const io::JsonValue& state) = 0;
  virtual std::string describe() const = 0;
};

// Shards matching `pattern` (llm.c .bin layout), this DP rank's share.
std::unique_ptr<BatchSource> make_shard_source(const std::string& pattern, int B, int T, int vocab_size,
                                               uint64_t seed, bool shuffle, int dp_rank, int dp_size);

// A learnable synthetic task, deterministic in (seed, stream, batch index):
// each sequence is an arithmetic progression mod V, (start + k·stride) mod V,
// with random start and stride in [1, 8]. Once two tokens are seen the rest
// is determined, so a working model drives the loss towards (the cost of the
// first two positions)/T.
std::unique_ptr<BatchSource> make_synthetic_source(int B, int T, int vocab_size, uint64_t seed, uint64_t stream,
                                                   int dp_rank, int dp_size);

}  // namespace lattice::train
