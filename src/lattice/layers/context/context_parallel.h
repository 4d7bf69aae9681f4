// Context parallelism: attention over a sequence cut along its length.
//
// A cp group of ranks shares every sequence of a micro-batch: each rank holds
// T/cp of its tokens through the whole block — the norms, the projections,
// the MLP and the loss are row-wise and need nothing from the other ranks —
// and only the attention, where every query reads every earlier key, talks.
// Two ways of doing that attention:
//
//   ring        (Liu et al. 2023, "Ring Attention"; Megatron-core's CP) the
//               key/value blocks travel around the ring; each rank attends its
//               queries to the block it holds while the next one arrives, and
//               merges the partial results with their log-sum-exps:
//                 m = max(lse, lse_b)
//                 lse' = m + log(exp(lse − m) + exp(lse_b − m))
//                 out' = exp(lse − lse')·out + exp(lse_b − lse')·out_b
//               The backward sends the blocks around again with their dK/dV
//               accumulators (f32) travelling with them, one more hop home.
//               Bytes per rank per layer, h_kv = key/value width (NKV·hs):
//                 forward  2·b·s·h_kv·(cp−1)/cp      (K and V, cp−1 hops)
//                 backward 2·b·s·h_kv·(cp−1)/cp + 2·b·s·h_kv   (again, + dK/dV cp hops)
//               elements. Grouped-query attention sends only the NKV heads.
//   all_to_all  (Jacobs et al. 2023, DeepSpeed-Ulysses) one all-to-all turns
//               sequence-sharded Q/K/V into head-sharded ones over the whole
//               sequence, each rank runs the ordinary causal kernel on NH/cp
//               query heads (and NKV/cp key/value heads), and a second
//               all-to-all turns the output back. Per rank per layer:
//                 2·(2h + 2h_kv)·b·s·(cp−1)/cp²   elements, forward + backward
//               Needs cp to divide the (local) query and key/value heads. The
//               attention of a head is then computed by the very kernel, on the
//               very rows, of one process: bitwise the same output.
//
// The split: causal attention makes the last tokens' queries the most
// expensive, so a contiguous cut gives the last rank (2cp−1)/cp times the
// mean work. lattice cuts each sequence into 2·cp chunks of c = T/(2cp) and
// gives rank r chunks r and 2cp−1−r (the "zig-zag" / load-balanced split of
// Megatron-core and ring-flash-attention): at every ring step every rank
// computes two chunk blocks' worth of scores (ring_step_pairs), and the
// token count per rank is the same. A rank's local rows are [chunk r |
// chunk 2cp−1−r] for each sequence; position(t) maps them back, for rotary
// and learned positions. Both modes use this split, so the data, positions
// and loss are the same for either.
//
// Gradients: a cp rank's parameter gradients are its tokens' share; the
// data-parallel engine reduces over dp×cp (the mesh's dp_cp group), each
// rank's loss being the mean over its own tokens, so the average over dp·cp
// ranks is the mean over the global batch (equal tokens per rank). Nothing
// here scales anything.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lattice/comm/communicator.h"
#include "lattice/core/memory.h"

namespace lattice::context {

enum class Mode { Ring, AllToAll };
// "ring" | "all_to_all" (lattice::Error naming parallel.cp_mode otherwise).
Mode parse_mode(const std::string& name);
const char* name_of(Mode mode);

// How the sequence is cut: lattice runs Balanced; Contiguous (rank r holds
// tokens [r·T/cp, (r+1)·T/cp)) exists for the counters' contrast only.
enum class Split { Balanced, Contiguous };

// One block of a ring step: query chunk `q_half` of this rank (0 or 1: the
// first or second half of its local rows) against key/value chunk `kv_half`
// of the block it holds. causal: the same chunk (the diagonal); else every key
// is visible.
struct BlockPair {
  int q_half = 0, kv_half = 0;
  bool causal = false;
};
// The blocks rank `rank` computes at ring step `step` (holding the keys and
// values of rank (rank − step) mod cp), in the order they are merged. With a
// Contiguous split each rank's rows are one chunk of 2c: halves 0 and 1 are
// its two halves, and the pairs say the same thing in those units.
std::vector<BlockPair> ring_step_pairs(int cp, int rank, int step, Split split = Split::Balanced);
// Global position of local row t of rank `rank`'s T_local rows (the balanced split).
int position_of(int cp, int rank, int t, int T_local);
// Scores computed by a pair of c-row chunks (c² full; c(c+1)/2 on the diagonal).
int64_t pair_scores(const BlockPair& p, int64_t c);

// The attention's sizes here (after tensor parallelism's cut of the heads).
struct HeadShape {
  int NH = 0, NKV = 0, hs = 0;
  int64_t A() const { return static_cast<int64_t>(NH) * hs; }
  int64_t KV() const { return static_cast<int64_t>(NKV) * hs; }
  int64_t QKV() const { return A() + 2 * KV(); }
};

class ContextParallel {
 public:
  // `group`: the cp communicator (not owned; outlives this object).
  ContextParallel(comm::Communicator& group, Mode mode);

  int size() const { return group_.size(); }
  int rank() const { return group_.rank(); }
  Mode mode() const { return mode_; }
  comm::Communicator& group() { return group_; }

  // ---- the split ----
  // Refuses a local length that is not two whole chunks per rank.
  void check_local_length(int T_local) const;
  // Global position of local row t of a sequence of T_local rows here.
  int position(int t, int T_local) const;
  // positions[t] = position(t, T_local) for t < T_local.
  void positions(int32_t* positions, int T_local) const;
  // This rank's T/cp tokens of each of B sequences of T: out [B, T/cp].
  void local_tokens(int32_t* out, const int32_t* in, int B, int T) const;

  // ---- attention over the whole sequence ----
  // From this rank's qkv [B, T_local, QKV] (queries, keys, values of its
  // rows, rotated at their global positions): out [B, T_local, A] and what the
  // backward needs.
  //   ring        lse [B, NH, T_local] of this rank's rows; qkv unchanged.
  //   all_to_all  qkv is overwritten with the head-sharded Q/K/V [B, T, W]
  //               (W = QKV/cp; the same count), lse with the head-sharded
  //               lse [B, NH/cp, T], and heads_out [B, T, A/cp] (A values per
  //               row here: the same count as out) gets the head-sharded output.
  void forward(float* out, float* lse, float* qkv, float* heads_out, int B, int T_local, const HeadShape& s);
  // dqkv [B, T_local, QKV] (written) from dout [B, T_local, A], given what
  // forward left in qkv, out, lse and heads_out.
  void backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                const float* heads_out, int B, int T_local, const HeadShape& s);
  // Whether the mode stores the head-sharded output (heads_out) per layer.
  bool stores_heads_out() const { return mode_ == Mode::AllToAll; }
  // Refuses head counts the mode cannot cut, naming the keys.
  void check_heads(const HeadShape& s) const;

  // ---- counters of the latest forward (ring): scores computed at each step ----
  const std::vector<int64_t>& step_scores() const { return step_scores_; }

 private:
  void ring_forward(float* out, float* lse, const float* qkv, int B, int T_local, const HeadShape& s);
  void ring_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                     int T_local, const HeadShape& s);
  void a2a_forward(float* out, float* lse, float* qkv, float* heads_out, int B, int T_local, const HeadShape& s);
  void a2a_backward(float* dqkv, const float* dout, const float* qkv, const float* heads_out, const float* lse,
                    int B, int T_local, const HeadShape& s);
  // Starts sending `send` to the next rank and receiving `recv` from the previous one.
  comm::WorkPtr ring_exchange(const float* send, float* recv, size_t count, int tag);
  float* scratch(size_t i, size_t floats, MemCategory category);

  comm::Communicator& group_;
  Mode mode_;
  std::vector<Buffer> scratch_;
  std::vector<int64_t> step_scores_;
};

}  // namespace lattice::context
