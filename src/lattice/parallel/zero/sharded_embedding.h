// ShardedEmbedding: the tied embedding (wte, wpe) under ZeRO-2/3 without the
// whole table ever on one rank.
//
// GPT-2's embedding group is a third of the model (50304 x 768 of 124M);
// gathering it whole for the head, or holding its whole gradient through the
// backward, would cost more than every other working buffer together. So the
// group is laid out in chunks of whole rows (ShardLayout's row alignment) and
// handled chunk by chunk, the next chunk's collective in flight while the
// current one computes:
//
//   head forward    (stage 3) gather chunk c; logits[:, rows of c] = lnf · chunkᵀ
//   head backward   (stage 3) gather chunk c; dlnf += dlogits[:, rows of c] · chunk
//                   then, every stage >= 2: dchunk = dlogits[:, rows of c]ᵀ · lnf,
//                   reduce-scattered into this rank's gradient shard
//   lookup          (stage 3) the rows of other ranks' tokens are not here: all
//                   ranks' tokens are all-gathered, each rank writes the parts of
//                   those rows it owns (zeros elsewhere), and one reduce-scatter
//                   hands every rank its own rows, summed: (n-1)·B·T·C floats
//                   instead of the table.
//   lookup backward (every stage >= 2) the lookup's gradient is sparse: all
//                   ranks' (token, dx row) pairs are all-gathered and each rank
//                   adds the parts it owns to its gradient shard.
//
// Under PowerSGD (powersgd.h) each gradient chunk is reduced on its own, its
// wte rows as one matrix (rows × C: the table's gradient cut by rows) and its
// wpe rows as another; at GPT-2's 682 rows a chunk the share is
// r(682 + 768)/(682·768), 1.1% at r = 4.
//
// So per micro-batch the table crosses the wire three times at stage 3 (two
// gathers, one reduce-scatter, as ZeRO-3's 3Ψ counts it), plus O(n·B·T·C)
// for the sparse exchanges. At stage 2 the parameters are whole on every
// rank, so the forward and the head's input gradient use them directly.
//
// Stages 0-1 (Gradients::AllReduce, Gradients::Scatter; only with more than
// one rank) use it for the timing alone: the embedding's gradient is final
// only after the lookup's scatter-add at the very end of the backward, so
// reducing the whole group then would sit on the critical path. Instead, on
// the last micro-batch of a step, the group's chunks are reduced (all-reduce,
// or reduce-scatter at stage 1) right after the head's share is added,
// overlapping the whole backward, and the lookup's share is exchanged
// sparsely at the end and added by every rank (stage 0) or by each slice's
// owner (stage 1). Earlier micro-batches accumulate locally.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "lattice/core/memory.h"
#include "lattice/model/gpt.h"
#include "lattice/parallel/compress/gradient_reducer.h"
#include "lattice/comm/comm_stream.h"
#include "lattice/parallel/zero/shard_layout.h"

namespace lattice::parallel {

class ShardedEmbedding final : public model::TiedEmbedding {
 public:
  enum class Gradients {
    Sharded,    // stages 2-3: into this rank's gradient shard, every micro-batch
    AllReduce,  // stage 0: the group's whole gradient buffer, summed on every rank
    Scatter,    // stage 1: the whole buffer, each slice summed at its owner (its home position)
  };
  // `group`: the embedding group (wte then wpe, laid out by rows of C).
  // `params`: this rank's parameter shard of it at stage 3, or null when the
  // group's buffer is whole on every rank. `grad_shard`: this rank's gradient
  // shard (Gradients::Sharded; null otherwise).
  // Its gradient chunks are summed through `reducer` (plain or compressed,
  // gradient_reducer.h), under the keys of group `key_group`.
  ShardedEmbedding(model::ParamGroup& group, const model::ModelConfig& config, const GroupShard& shard,
                   comm::CommStream& stream, GradientReducer& reducer, int64_t key_group, const float* params,
                   Gradients gradients, float* grad_shard);

  // Before each step: the step's first contribution to the gradient shard
  // (Sharded) overwrites it.
  void begin_step() { written_ = false; }
  // Before each backward: whether it is the step's last (AllReduce and
  // Scatter reduce only in that one).
  void set_last(bool last) { last_ = last; }
  // Sharded: whether this step wrote the gradient shard yet (a pipeline's
  // first stage has no head: its lookup's share is the first to arrive).
  bool written() const { return written_; }
  // Waits for every collective this object posted (the optimizer reads the
  // gradient shard after it).
  void finish();
  // Memory it keeps (piece buffers; exchange buffers are MemCategory::Comm).
  size_t param_buffer_bytes() const;
  size_t grad_buffer_bytes() const;

  // Context parallelism: the group is dp×cp, ordered (dp, cp), so group rank
  // q holds the tokens of context-parallel rank q % cp, at that rank's
  // positions (the rows of every rank pass through here). 1: none.
  void set_context_parallel(int cp) { cp_ = cp; }
  void lookup(float* x, const int32_t* tokens, int B, int T, const int32_t* positions) override;
  void head_forward(float* logits, const float* lnf, int64_t rows, int64_t ld) override;
  void head_backward_input(float* dlnf, const float* dlogits, int64_t N) override;
  void head_backward_weight(const float* dlogits, const float* lnf, int64_t N) override;
  void lookup_backward(const float* dx, const int32_t* tokens, int B, int T, const int32_t* positions) override;

 private:
  // Posts the gather of chunk c into piece buffer c % 2.
  comm::CommStream::Ticket gather_chunk(int64_t c);
  // fn(piece, first, last, c) for each chunk holding wte rows [first, last),
  // gathered (stage 3), the next chunk's gather in flight meanwhile.
  void for_each_gathered_chunk(const std::function<void(const float*, int64_t, int64_t, int64_t)>& fn);
  // Rows [first, last) of wte that chunk c holds (empty past the vocabulary).
  void wte_rows(int64_t c, int64_t* first, int64_t* last) const;
  // out[0, C) += the elements of flat row `row` that this rank owns (src: its shard).
  void add_owned_row(float* out, int64_t row, const float* src) const;
  // dst += the elements of `values` (flat row `row`) this rank owns; dst is
  // its shard, or with `home` the group's whole buffer (owned positions only).
  void add_to_owned(float* dst, int64_t row, const float* values, bool home = false) const;
  // The group's own gradient buffer, the head's share accumulated (AllReduce, Scatter).
  void head_weight_into_group(const float* dlogits, const float* lnf, int64_t N);
  void lookup_into_group(const float* dx, const int32_t* tokens, int B, int T, const int32_t* positions);
  // Exchanges (token, dx row) pairs of every rank into tokens_all_ / rows_.
  const float* gather_lookup_rows(const float* dx, const int32_t* tokens, int64_t BT);
  void exchange_tokens(const int32_t* tokens, int64_t count);

  model::ParamGroup& group_;
  const int C_, Vp_;
  const GroupShard& shard_;
  comm::CommStream& stream_;
  GradientReducer& reducer_;
  int64_t key_group_;
  const float* params_;  // stage 3 shard, or null
  Gradients gradients_;
  float* grad_shard_;
  int64_t wpe_row_;      // flat row where wpe starts (= Vp; -1: no wpe)
  int cp_ = 1;
  // The flat row of wpe for row j of the n·B·T rows every rank exchanged.
  int64_t wpe_row_of(int64_t j, int64_t BT, int T) const;
  bool has_wpe_ = true;  // learned positions (rotary: the token table alone)
  bool written_ = false, last_ = true;
  Buffer pieces_;        // two chunks of parameters (stage 3)
  Buffer grad_pieces_;   // two chunks of gradient
  comm::CommStream::Ticket grad_ticket_[2] = {0, 0};
  comm::CommStream::Ticket last_ticket_ = 0;
  Buffer tokens_all_;    // all ranks' tokens, as floats (exact below 2^24)
  Buffer rows_;          // n·B·T rows of C: the exchanges
  // compression.grad = powersgd: per chunk, its wte rows and its wpe rows as matrices.
  std::vector<LowRankLayout> lowrank_;
};

}  // namespace lattice::parallel
