#include "lattice/parallel/zero/shard_layout.h"

#include <algorithm>

#include "lattice/core/error.h"

namespace lattice::parallel {

static int64_t gcd(int64_t a, int64_t b) { return b == 0 ? a : gcd(b, a % b); }

GroupShard cut_group(int64_t numel, int ranks, int rank, double bucket_bytes, int64_t row_elems) {
  LATTICE_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "shard layout: rank " << rank << " of " << ranks);
  LATTICE_CHECK(bucket_bytes > 0, "shard layout: bucket size must be positive, got " << bucket_bytes);
  // The largest slice a bucket allows: n·k·4 bytes <= bucket, k a multiple
  // of 16 floats (64 bytes), at least 16.
  const int64_t max_slice = std::max<int64_t>(16, static_cast<int64_t>(bucket_bytes / (4.0 * ranks)) / 16 * 16);
  GroupShard s;
  s.ranks = ranks, s.rank = rank;
  s.numel = numel;
  // A chunk is a multiple of `granule` elements: n slices of 16-float
  // multiples, and, for a group cut by rows, whole rows.
  int64_t granule = 16 * static_cast<int64_t>(ranks);
  if (row_elems > 0) granule = granule / gcd(granule, row_elems) * row_elems;
  const int64_t per_chunk = std::max(granule, max_slice * ranks / granule * granule);
  s.chunks = std::max<int64_t>(1, (s.numel + per_chunk - 1) / per_chunk);
  // Equal chunks with the least padding: the smallest multiple of the
  // granule that C chunks need.
  const int64_t chunk = (s.numel + s.chunks * granule - 1) / (s.chunks * granule) * granule;
  s.slice = chunk / ranks;
  return s;
}

ShardLayout::ShardLayout(const std::vector<model::ParamGroup>& groups, int ranks, int rank, double bucket_bytes,
                         const std::vector<int64_t>& row_elems, const std::vector<double>& chunk_bytes)
    : ranks_(ranks), rank_(rank) {
  LATTICE_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "shard layout: rank " << rank << " of " << ranks);
  LATTICE_CHECK(bucket_bytes > 0, "shard layout: bucket size must be positive, got " << bucket_bytes);
  for (size_t gi = 0; gi < groups.size(); gi++) {
    const double bytes = gi < chunk_bytes.size() && chunk_bytes[gi] > 0 ? chunk_bytes[gi] : bucket_bytes;
    const int64_t row = gi < row_elems.size() ? row_elems[gi] : 0;
    groups_.push_back(cut_group(groups[gi].numel(), ranks, rank, bytes, row));
  }
}

int64_t ShardLayout::shard_numel() const {
  int64_t n = 0;
  for (const GroupShard& s : groups_) n += s.shard_numel();
  return n;
}

int64_t ShardLayout::capacity() const {
  int64_t n = 0;
  for (const GroupShard& s : groups_) n += s.capacity();
  return n;
}

std::vector<ShardLayout::Run> ShardLayout::runs(const model::ParamGroup& group, size_t g) const {
  const GroupShard& s = groups_[g];
  std::vector<Run> out;
  const auto& params = group.params();
  for (int64_t c = 0; c < s.chunks; c++) {
    const int64_t lo = s.slice_begin(c), hi = lo + s.slice;
    for (size_t p = 0; p < params.size(); p++) {
      const int64_t b = std::max(lo, params[p].offset), e = std::min(hi, params[p].offset + params[p].numel());
      if (b < e) out.push_back({p, b, e - b, c * s.slice + (b - lo)});
    }
  }
  return out;
}

}  // namespace lattice::parallel
