// ShardLayout: how each parameter group's flat buffer is cut into reduction
// buckets and ZeRO shards over the n ranks of a data-parallel group.
//
// A group of P elements is cut into C equal chunks of n·k elements (the tail
// of the last one is padding, kept at zero), with n·k·4 bytes at most
// parallel.bucket_mb: a chunk is one reduction call (all_reduce,
// reduce_scatter or all_gather), and large MPI messages run several times
// slower than a few MiB here (docs/comm.md). Within chunk c, rank r owns the
// k elements
//
//     [c·n·k + r·k, c·n·k + (r+1)·k)        (its "slice" c, 64-byte aligned)
//
// so a reduce_scatter of chunk c hands every rank exactly its slice and an
// all_gather of the slices rebuilds the chunk, both on contiguous buffers
// with no packing. A rank's shard of the group is its C slices, stored one
// after another (slice c at shard offset c·k): the optimizer state, the
// sharded gradient (stage 2) and the parameter shard (stage 3).
//
// With n = 1 the single rank owns everything and the same chunks are just
// the buckets. Groups smaller than one bucket get one chunk sized to fit.
#pragma once

#include <cstdint>
#include <vector>

#include "lattice/model/param_group.h"

namespace lattice::parallel {

struct GroupShard {
  int64_t numel = 0;     // P: elements in use (ParamGroup::numel)
  int64_t chunks = 0;    // C
  int64_t slice = 0;     // k: elements of one slice (a multiple of 16)
  int64_t capacity() const { return chunks * slice * ranks; }  // C·n·k >= P
  int64_t shard_numel() const { return chunks * slice; }       // C·k
  int64_t chunk_numel() const { return slice * ranks; }        // n·k
  // Start of this rank's slice c in the group's flat buffer.
  int64_t slice_begin(int64_t c) const { return c * slice * ranks + static_cast<int64_t>(rank) * slice; }
  // Which rank owns flat element f, and where it sits in that rank's shard.
  int owner(int64_t f) const { return static_cast<int>((f % chunk_numel()) / slice); }
  int64_t shard_offset(int64_t f) const { return (f / chunk_numel()) * slice + f % slice; }
  int ranks = 1, rank = 0;
};

// How one group of `numel` elements is cut over `ranks` ranks, seen from
// `rank`: what ShardLayout does for each of its groups (the planner,
// plan/memory.h, calls it without building the groups).
GroupShard cut_group(int64_t numel, int ranks, int rank, double bucket_bytes, int64_t row_elems = 0);

class ShardLayout {
 public:
  // `bucket_bytes`: the largest chunk (one call), in bytes. `row_elems[g]`,
  // when given and > 0, makes every chunk of group g a whole number of rows
  // of that many elements (the embedding: ZeRO works on it row block by row
  // block, sharded_embedding.h).
  // `chunk_bytes[g]`, when given and > 0, replaces bucket_bytes for group g.
  ShardLayout(const std::vector<model::ParamGroup>& groups, int ranks, int rank, double bucket_bytes,
              const std::vector<int64_t>& row_elems = {}, const std::vector<double>& chunk_bytes = {});

  const GroupShard& group(size_t g) const { return groups_[g]; }
  size_t num_groups() const { return groups_.size(); }
  int ranks() const { return ranks_; }
  int rank() const { return rank_; }
  // Σ shard_numel over groups, and Σ capacity.
  int64_t shard_numel() const;
  int64_t capacity() const;

  // One run of elements of a parameter inside this rank's shard of group g:
  // flat [begin, begin + n) in the group buffer, at `shard_offset` in the
  // shard; `param` indexes ParamGroup::params(). Runs of padding (between
  // parameters, past the last) are not listed.
  struct Run {
    size_t param;
    int64_t begin, n, shard_offset;
  };
  // Every parameter run of this rank's shard of group g, in buffer order.
  std::vector<Run> runs(const model::ParamGroup& group, size_t g) const;

 private:
  std::vector<GroupShard> groups_;
  int ranks_, rank_;
};

}  // namespace lattice::parallel
