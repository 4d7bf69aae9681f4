// DataLoader: batches of token windows from .bin shards, for one DP rank.
//
// The sampler contract (what the trainer relies on):
// - The stream is the concatenation of all shards matching the pattern, in
//   sorted file-name order; N tokens in all.
// - Sequence i is the window of T+1 tokens starting at i*T: neighbouring
//   windows share their boundary token (as in llm.c), so every token but the
//   first is a target exactly once per epoch. There are S = (N-1)/T sequences;
//   a window may span two shards.
// - Each epoch visits the S sequences in an order that depends only on
//   (seed, epoch): a Fisher-Yates permutation drawn from Rng(seed, stream
//   kShuffleStream + epoch) when shuffle is on, the identity otherwise.
// - The unit is the global batch: G = dp_size*B*micro_batches sequences per
//   optimizer step. Step k of an epoch takes perm[k*G, (k+1)*G). Within it,
//   micro-batch a (0 <= a < micro_batches) of rank r takes the B sequences
//   starting at k*G + (a*dp_size + r)*B. So the sequences of a step — the
//   only thing the averaged gradient depends on — are a function of
//   (seed, data, G) alone, whatever the factoring of G into dp_size, B and
//   micro_batches; and for every micro-batch index the rank-major
//   concatenation of the ranks' batches is what one process with
//   B*dp_size would read.
// - An epoch ends when fewer than G sequences are left (those few are
//   skipped this epoch; another permutation skips others next epoch).
// - Ranks of one TP or CP group build their loaders with the same dp_rank and
//   so read the same sequences (a CP rank slices its part of the T positions
//   itself). Under pipeline parallelism only the first stage (inputs) and the
//   last (targets) need a loader; the others never touch tokens.
// - state() is (epoch, steps taken in the epoch), taken between steps;
//   restore() of a saved state continues bit-identically, at any dp_size, B
//   and micro_batches with the same G.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lattice/data/shard.h"

namespace lattice::data {

struct LoaderOptions {
  std::string pattern;  // glob of .bin shards, e.g. "data/moby/train_*.bin"
  int B = 0;            // sequences per batch on this rank
  int T = 0;            // sequence length
  int dp_rank = 0;
  int dp_size = 1;
  int micro_batches = 1;  // per optimizer step on each rank
  uint64_t seed = 0;
  bool shuffle = true;
  int vocab_size = 50257;  // every token read is checked to be below this
};

class DataLoader {
 public:
  // Expands the glob (error naming the pattern when nothing matches), maps
  // and validates every shard's header, checks the options.
  explicit DataLoader(const LoaderOptions& options);
  DataLoader(DataLoader&&) noexcept;
  DataLoader& operator=(DataLoader&&) noexcept;
  ~DataLoader();

  // Fills inputs[B*T] and targets[B*T] with this rank's next micro-batch:
  // row b is window w, inputs[b*T+t] = w[t] and targets[b*T+t] = w[t+1].
  // Every micro_batches calls make one step.
  void next_batch(int32_t* inputs, int32_t* targets);
  // The same micro-batch as B windows of T+1 tokens each: windows[B*(T+1)].
  void next_windows(int32_t* windows);

  int64_t sequences_per_epoch() const;  // S
  int64_t steps_per_epoch() const;      // S / G
  int64_t global_batch() const;         // G = dp_size*B*micro_batches
  int64_t epoch() const;
  int64_t num_tokens() const;           // N
  const std::vector<ShardInfo>& shards() const;

  struct State {
    uint64_t epoch;
    uint64_t position;  // steps (global batches) already taken in this epoch
  };
  // Between steps only (after a multiple of micro_batches calls).
  State state() const;
  void restore(const State& state);
  void reset();  // epoch 0, step 0 (a val loader restarts at each evaluation)

  // Rng stream of the epoch permutations: kShuffleStream + epoch.
  static constexpr uint64_t kShuffleStream = 0xDA7A000000000000ull;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lattice::data
