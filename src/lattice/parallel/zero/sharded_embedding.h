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
// So per micro-batch the table crosses the wire three times at stage 3 (two
// gathers, one reduce-scatter, as ZeRO-3's 3Ψ counts it), plus O(n·B·T·C)
// for the sparse exchanges. At stage 2 the parameters are whole on every
// rank, so the forward and the head's input gradient use them directly.
#pragma once

#include <cstdint>
#include <vector>

#include "lattice/core/memory.h"
#include "lattice/model/gpt.h"
#include "lattice/parallel/data/comm_stream.h"
#include "lattice/parallel/zero/shard_layout.h"

namespace lattice::parallel {

class ShardedEmbedding final : public model::TiedEmbedding {
 public:
  // `group`: the embedding group (wte then wpe, laid out by rows of C).
  // `params`: this rank's parameter shard of it at stage 3, or null when the
  // group's buffer is whole on every rank (stage 2). `grad_shard`: this
  // rank's gradient shard; `first_write` says whether this micro-batch's
  // contribution overwrites it (the step's first) or adds to it.
  ShardedEmbedding(model::ParamGroup& group, const model::ModelConfig& config, const GroupShard& shard,
                   CommStream& stream, const float* params, float* grad_shard);

  // Before each micro-batch's backward: overwrite (first of the step) or accumulate.
  void set_first_write(bool first) { first_write_ = first; }
  // Waits for every collective this object posted (the optimizer reads the
  // gradient shard after it).
  void finish();
  // Memory it keeps (piece buffers; exchange buffers are MemCategory::Comm).
  size_t param_buffer_bytes() const;
  size_t grad_buffer_bytes() const;

  void lookup(float* x, const int32_t* tokens, int B, int T, int first_position) override;
  void head_forward(float* logits, const float* lnf, int64_t rows, int64_t ld) override;
  void head_backward_input(float* dlnf, const float* dlogits, int64_t N) override;
  void head_backward_weight(const float* dlogits, const float* lnf, int64_t N) override;
  void lookup_backward(const float* dx, const int32_t* tokens, int B, int T) override;

 private:
  // Posts the gather of chunk c into piece buffer c % 2.
  CommStream::Ticket gather_chunk(int64_t c);
  // Rows [first, last) of wte that chunk c holds (empty past the vocabulary).
  void wte_rows(int64_t c, int64_t* first, int64_t* last) const;
  // out[0, C) += the elements of flat row `row` that this rank owns (src: its shard).
  void add_owned_row(float* out, int64_t row, const float* src) const;
  // dst (this rank's shard) += the elements of `values` (flat row `row`) it owns.
  void add_to_owned(float* dst, int64_t row, const float* values) const;
  void exchange_tokens(const int32_t* tokens, int64_t count);

  model::ParamGroup& group_;
  const int C_, Vp_;
  const GroupShard& shard_;
  CommStream& stream_;
  const float* params_;  // stage 3 shard, or null
  float* grad_shard_;
  int64_t wpe_row_;      // flat row where wpe starts (= Vp)
  bool first_write_ = true;
  Buffer pieces_;        // two chunks of parameters (stage 3)
  Buffer grad_pieces_;   // two chunks of gradient
  CommStream::Ticket grad_ticket_[2] = {0, 0};
  CommStream::Ticket last_ticket_ = 0;
  Buffer tokens_all_;    // all ranks' tokens, as floats (exact below 2^24)
  Buffer rows_;          // n·B·T rows of C: the exchanges
};

}  // namespace lattice::parallel
