// GradientReducer: how data parallelism sums a gradient chunk over its
// group — plain, or compressed with error feedback (compression.grad).
//
// A chunk is n blocks of k floats (n = the group's ranks, ShardLayout's
// chunks): rank r owns block r. Two operations, posted on the comm::CommStream:
//
//   reduce_scatter  rank r ends with the sum over ranks of block r (ZeRO 1-3,
//                   and the first half of all_reduce)
//   all_reduce      every rank ends with the whole summed chunk (ZeRO 0)
//
// Uncompressed they are the Communicator's collectives. Compressed, the
// collective is built so that every rank ends with identical values, and
// each rank sends 2(n-1)/n of what the f32 all-reduce sends, times the
// codec's payload share (gradient_codec.h) — as 1-bit Adam's compressed
// all-reduce does:
//
//   1. x = chunk + e_w        (e_w: this rank's worker error for the chunk)
//   2. encode each block of x; e_w = x - decoded(x)        (error feedback)
//   3. all_to_all of the payloads: rank r receives every rank's block r
//   4. decode and sum them, in rank order, into block r    (the scatter's result)
//   all_reduce goes on:
//   5. y = block r + e_s      (e_s: the server error of this rank's block)
//   6. encode y; e_s = y - decoded(y); all_gather the payloads
//   7. every rank decodes all n payloads into the chunk    (identical everywhere)
//
// Bytes per rank: (n-1)·P (all_to_all) [+ (n-1)·P (all_gather)] with P the
// payload of k floats, against (n-1)·4k [+ (n-1)·4k] uncompressed.
//
// Error feedback (compression.error_feedback, on by default) carries what
// each encoding dropped into the next step's same chunk, so over steps the
// sum of what was sent equals the sum of the gradients less the last
// error: training converges where a biased compressor (topk, onebit)
// without it stalls. The errors are kept per chunk (a key the caller gives):
// e_w holds the chunk's n·k floats (so under ZeRO-2/3 it is a whole
// gradient's worth of memory again), e_s its k. They are not saved in
// checkpoints: a resumed run starts them at zero.
//
// The first `warmup_steps` steps (compression.warmup_steps) run
// uncompressed, as 1-bit Adam's warm-up does.
//
// PowerSGD (codec PowerSgd, powersgd.h) compresses matrices, so it cannot
// work on chunks: while lowrank() holds, callers reduce a whole buffer of
// known layout (a group's gradient, an embedding chunk) with
// all_reduce_lowrank or reduce_scatter_lowrank instead of the chunk
// operations, and the chunk operations refuse it. Both leave the summed
// approximation where the chunk operations they replace would have left the
// sum; bytes() counts what its two all-reduces sent against what those
// chunk operations send uncompressed (at ZeRO 1-3 a reduce-scatter, half an
// all-reduce: the share is then twice the all-reduce's).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "lattice/core/memory.h"
#include "lattice/optim/adamw.h"
#include "lattice/parallel/compress/gradient_codec.h"
#include "lattice/parallel/compress/powersgd.h"
#include "lattice/comm/comm_stream.h"

namespace lattice::parallel {

struct CompressionOptions {
  CodecSpec spec;              // codec None: no compression
  bool error_feedback = true;  // compression.error_feedback
  int64_t warmup_steps = 0;    // compression.warmup_steps
  // compression.momentum: 1-bit Adam. From step warmup_steps on, the
  // data-parallel engine reduces each rank's momentum instead of its
  // gradient, and Adam's second moment is frozen (data_parallel.h).
  bool momentum = false;
};

class GradientReducer {
 public:
  GradientReducer(comm::CommStream& stream, const CompressionOptions& options);

  const CompressionOptions& options() const { return options_; }
  // Before a step: compression applies from step index warmup_steps on (and
  // never over one rank, which sends nothing).
  void begin_step(int64_t step) {
    compressing_ = options_.spec.codec != GradCodec::None && step >= options_.warmup_steps && stream_.comm().size() > 1;
  }
  bool compressing() const { return compressing_; }
  // This step reduces with PowerSGD: callers use the *_lowrank operations.
  bool lowrank() const { return compressing_ && options_.spec.codec == GradCodec::PowerSgd; }

  // `key` names the chunk across steps (its error buffers); `label` the
  // operation in the stream's log. `then` runs after the result is in place.
  // chunk: n·k floats, summed in place on every rank.
  comm::CommStream::Ticket all_reduce(int64_t key, float* chunk, int64_t k, std::string label);
  // chunk: n·k floats (clobbered); this rank's summed block goes to dst
  // (k floats; it may be the chunk's own block r): copied, or added when
  // `accumulate`.
  comm::CommStream::Ticket reduce_scatter(int64_t key, float* chunk, int64_t k, float* dst, bool accumulate,
                                    std::string label);

  // PowerSGD (lowrank() only) over `data`: `chunks` chunks of n·k floats
  // holding what `layout` describes; `key` names it across steps (its Qs and
  // error). all_reduce_lowrank: every rank ends with the summed
  // approximation in every position the layout covers (ZeRO 0, as
  // all_reduce on each chunk). reduce_scatter_lowrank: then this rank's
  // summed slice c (data + c·n·k + rank·k, k floats) is copied, or added
  // when `accumulate`, to dst + c·dst_stride (ZeRO 1-3, as reduce_scatter
  // on each chunk; dst = data + rank·k with stride n·k leaves it in place).
  // The layout must outlive the operation.
  comm::CommStream::Ticket all_reduce_lowrank(int64_t key, float* data, const LowRankLayout& layout, int64_t chunks,
                                        int64_t k, std::string label);
  comm::CommStream::Ticket reduce_scatter_lowrank(int64_t key, float* data, const LowRankLayout& layout, int64_t chunks,
                                            int64_t k, float* dst, int64_t dst_stride, bool accumulate,
                                            std::string label);

  // f16's loss scale: the errors are of scaled gradients. When the scale
  // moves by f they are multiplied by f; when a step is skipped (its
  // gradients overflowed somewhere) they are zeroed (f = 0): what the
  // skipped step's encodings dropped is not carried.
  void scale_errors(float f);

  // The key of chunk c of group g.
  static int64_t key(int64_t group, int64_t chunk) { return (group << 32) | chunk; }
  // Bytes of error buffers (and PowerSGD's Qs) held (MemCategory::Grads).
  size_t error_bytes() const;

  // Bytes this rank sent in the reductions posted so far (the Communicator's
  // ring accounting) and what the same reductions send uncompressed; read
  // after the stream is drained.
  struct Bytes {
    uint64_t sent = 0, uncompressed = 0;
  };
  Bytes bytes() const { return {sent_.load(), uncompressed_.load()}; }
  void reset_bytes() { sent_ = 0, uncompressed_ = 0; }

 private:
  struct Errors {
    Buffer worker, server;
  };
  Errors& errors_of(int64_t key, int64_t chunk_numel, int64_t k, bool server);
  // Steps 1-4 on the communication thread: block r's sum into `sum` (k floats).
  void compressed_scatter(comm::Communicator& comm, float* chunk, int64_t k, float* sum, Errors* e);
  comm::CommStream::Ticket post_lowrank(int64_t key, float* data, const LowRankLayout& layout, int64_t chunks, int64_t k,
                                  uint64_t uncompressed, comm::CommStream::Then then, std::string label);

  comm::CommStream& stream_;
  CompressionOptions options_;
  bool compressing_ = false;
  std::map<int64_t, Errors> errors_;
  PowerSgd powersgd_;
  std::atomic<uint64_t> sent_{0}, uncompressed_{0};
};

// Tensor parallelism under a codec that encodes a block of values together
// (int8's scale and onebit's mean |x| per 256 values, topk's selection):
// such a block can hold parameters that are whole on every TP rank
// (LayerNorms, row-parallel biases, wpe) beside slices that differ between
// the TP ranks, so each TP rank's data-parallel group decodes slightly
// different gradients for the replicated ones and their copies would drift
// apart. PowerSGD reduces the 1-D replicated values exactly and
// approximates wpe from inputs equal on every TP rank, but its random
// redraws of a degenerate Q are counted per group, which a sliced matrix of
// the same group can put out of step between the TP ranks. bf16 and f16
// round each value alone and need nothing.
//
// After a step's reductions (collective over `tp`, whose ranks have the same
// segments): when `reducer` compressed them with int8, onebit, topk or
// PowerSGD, the reduced gradients of `optimizer`'s replicated segments are
// averaged over the ranks that hold them — `tp` for a parameter whole on
// every rank, the ranks of a key/value head kept whole on several
// (AdamWSegment::replicas) — in one all-reduce of a few percent of the model,
// so each stays one parameter; otherwise nothing happens.
void average_replicated_grads(const GradientReducer& reducer, const optim::AdamW& optimizer, comm::Communicator& tp);

}  // namespace lattice::parallel
