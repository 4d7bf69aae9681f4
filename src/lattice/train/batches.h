// Where a trainer's token batches come from: .bin shards through the data
// loader, or a synthetic learnable stream when no data is configured.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "lattice/io/json.h"

namespace lattice::train {

// Both sources follow the loader's contract (data/loader.h): a step is a
// global batch of G = dp_size·B·micro_batches sequences, micro-batch a of DP
// rank r reads the B sequences at offset (a·dp_size + r)·B of it, so what a
// step sees depends on (seed, data, G) only; positions are saved in steps
// with G, and restore at another (dp_size, B, micro_batches) with the same G
// continues the same stream.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Fills inputs[B·T] and targets[B·T] (targets = inputs shifted by one) with
  // this rank's next micro-batch; micro_batches calls make a step.
  virtual void next(int32_t* inputs, int32_t* targets) = 0;
  // Back to the first batch (evaluation restarts the val stream every time).
  virtual void reset() = 0;
  // Position, for checkpoints: resuming from it continues bit-identically.
  virtual io::JsonValue state() const = 0;
  virtual void restore(const io::JsonValue& state) = 0;
  virtual std::string describe() const = 0;
};

// Where a rank reads within each global batch.
struct BatchLayout {
  int B = 1, T = 1;  // sequences per micro-batch, tokens per sequence
  int dp_rank = 0, dp_size = 1;
  int micro_batches = 1;  // per step on each rank
  int64_t global() const { return static_cast<int64_t>(dp_size) * B * micro_batches; }
};

// Shards matching `pattern` (llm.c .bin layout), this DP rank's share.
std::unique_ptr<BatchSource> make_shard_source(const std::string& pattern, const BatchLayout& layout,
                                               int vocab_size, uint64_t seed, bool shuffle);

// A learnable synthetic task, deterministic in (seed, stream, batch index):
// each sequence is an arithmetic progression mod V, (start + k·stride) mod V,
// with random start and stride in [1, 8]. Once two tokens are seen the rest
// is determined, so a working model drives the loss towards (the cost of the
// first two positions)/T.
// Refuses to continue a saved position (state() of either source) under
// another global batch, with a message that says how to resume; a position
// saved before global batches were recorded resumes only at one micro-batch
// per step (it counted micro-batches).
void check_global_batch(const io::JsonValue& state, int64_t global, int micro_batches);

std::unique_ptr<BatchSource> make_synthetic_source(const BatchLayout& layout, int vocab_size, uint64_t seed,
                                                   uint64_t stream);

}  // namespace lattice::train
