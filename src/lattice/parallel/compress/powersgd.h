// PowerSGD (Vogels, Karimireddy and Jaggi 2019; compression.grad = "powersgd"):
// data parallelism's gradient sum, each weight matrix approximated by a
// rank-r product. It needs the matrices' shapes, so unlike the block codecs
// (gradient_codec.h) it works on a whole buffer whose layout it is told —
// a parameter group's gradient, or one row chunk of the embedding — not on
// anonymous chunks of n·k floats.
//
// For each matrix M (m×n, the slice this rank holds, lattice's [out, in])
// with r(m+n) < mn, and Q (n×r) kept from the previous step (warm start),
// on every rank w of the group:
//
//   M_w = grad_w + e_w                        (error feedback)
//   P   = Σ_w M_w Q                           all-reduce 1 (m×r)
//   P   = orthonormalize(P)                   Gram-Schmidt, f64, identical everywhere
//   Q_w = M_wᵀ P ;  Q = Σ_w Q_w               all-reduce 2 (n×r)
//   M̂   = P Qᵀ = P Pᵀ Σ_w M_w                 the summed gradient, projected on span(P)
//   e_w = M_w − P Q_wᵀ = (I − P Pᵀ) M_w       this rank's residual
//
// M̂ is what the all-reduce sum of the matrix would give, approximated: the
// ranks' matrices enter only through their sum (every step is linear in
// them for a given Q), so a rank-r matrix sum comes back exact. Every rank
// computes M̂ from the same P and Q with the same loops, so the result is
// bit-identical on every rank. Everything else in the buffer — biases,
// LayerNorm, matrices too small to gain (r(m+n) >= mn, as PyTorch's
// min_compression_rate) — is summed exactly, bundled into all-reduce 1.
// Gaps between parameters (padding) are neither sent nor written.
//
// Error feedback keeps the invariant of the other codecs: Σ_w e_w =
// Σ_w M_w − M̂, so over steps the sum of what was delivered equals the sum of
// the gradients less Σ_w e_w. PyTorch's powerSGD_hook keeps e_w = M_w − M̂/W
// instead; its M̂ is the same (only the sum of the errors matters), but each
// rank's error then also accumulates its own deviation from the mean, a
// random walk over steps, where the projection residual is bounded by |M_w|.
//
// Warm start: Q is the previous step's (all-reduced, then orthonormalized
// before use, as PyTorch does), the same on every rank; a column that is
// zero — the first step, or a zero gradient's — is drawn from a seeded
// normal (the key, the matrix and a draw counter: the same on every rank).
//
// Bytes per rank: the two ring all-reduces of Σ r(m+n) + (exact values)
// floats, against the mn of every matrix uncompressed: per matrix the share
// is r(m+n)/(mn), 1/120 for GPT-2's block matrices at r = 4.
//
// The products run on the communication thread, single-threaded like the
// block codecs (gradient_reducer.h), about 6·r·mn flops per matrix.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "lattice/comm/communicator.h"
#include "lattice/core/memory.h"
#include "lattice/model/param_group.h"

namespace lattice::parallel {

// Which parts of a buffer PowerSGD compresses, and which it sums exactly.
struct LowRankLayout {
  struct Matrix {
    int64_t offset = 0, rows = 0, cols = 0;  // row-major rows×cols at offset
  };
  struct Span {
    int64_t offset = 0, n = 0;
  };
  int64_t rank = 4;              // r
  std::vector<Matrix> matrices;  // compressed
  std::vector<Span> exact;       // summed uncompressed
  int64_t extent = 0;            // one past the last element of either
  int64_t p_floats() const;      // Σ r·rows: all-reduce 1, with exact_floats()
  int64_t q_floats() const;      // Σ r·cols: all-reduce 2
  int64_t exact_floats() const;  // Σ exact n
};

// Whether a rows×cols matrix gains from rank r: r(rows + cols) < rows·cols.
bool worth_compressing(int64_t rows, int64_t cols, int64_t rank);
// A group's parameters: each 2-D one worth compressing is a matrix (its
// local shape), every other parameter an exact span.
LowRankLayout lowrank_layout(const model::ParamGroup& group, int64_t rank);
// Row ranges [first, last) of a buffer of rows of `cols` floats, each one
// matrix (or an exact span when it does not gain): the embedding's row
// chunks (sharded_embedding.h), cut where wte's rows end and wpe's begin so
// that each parameter's approximation depends on its own gradient alone.
LowRankLayout lowrank_rows(const std::vector<std::pair<int64_t, int64_t>>& row_ranges, int64_t cols, int64_t rank);

// An error-feedback buffer times f, or zeroed at f = 0 (the loss scale moved
// by f, or the step was skipped): PowerSgd's errors and GradientReducer's.
void scale_error_buffer(Buffer& errors, float f);

class PowerSgd {
 public:
  // What a buffer keeps across steps: its Qs and its error.
  struct State {
    int64_t key = 0;
    Buffer q;      // per matrix, Qᵀ (r×cols, row-major: a column of Q a row)
    Buffer error;  // layout.extent floats (error feedback only)
    uint64_t draws = 0;
    size_t matrices = 0;
  };
  // The state of the buffer named `key` (allocated on first use; the layout
  // of a key must not change). Call it where the operation is posted, not
  // inside it: the map is the posting thread's.
  State& state(int64_t key, const LowRankLayout& layout, bool error_feedback);

  // Sums `data` (layout.extent floats) over `comm`'s ranks in place, as
  // above: blocking collectives, so it runs inside a comm::CommStream operation.
  // Error feedback when `state` holds an error.
  void reduce(comm::Communicator& comm, State& state, float* data, const LowRankLayout& layout);

  // Bytes of state held: the Qs and the errors (MemCategory::Grads).
  size_t state_bytes() const;
  // The errors times f (the loss scale moved by f), or zeroed (f = 0: a skipped step's).
  void scale_errors(float f);

 private:
  std::map<int64_t, State> states_;
};

}  // namespace lattice::parallel
