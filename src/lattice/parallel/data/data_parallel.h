// DataParallel: data parallelism and ZeRO stages 0-3 for one model replica
// per rank of a data-parallel group, with optional disk offload.
//
// The model never sees any of it: DataParallel is the model's GroupHooks and
// acts when the model says a group's parameters are needed or its gradients
// are final. Per stage (Ψ = parameters, n = ranks; fp32, so 16Ψ bytes of
// model state without ZeRO):
//
//   stage 0  every rank keeps parameters, gradients and Adam moments whole.
//            Gradients are all-reduced bucket by bucket as the backward
//            finishes each group (on the last micro-batch of the step).
//   stage 1  Adam moments sharded: each rank keeps and updates 1/n of every
//            group (ShardLayout). Gradients are reduce-scattered on the last
//            micro-batch (each rank receives the sum of its slices), the
//            updated slices all-gathered after the step.       8Ψ + 8Ψ/n
//   stage 2  gradients sharded too: each micro-batch's gradient of a group
//            lives in a borrowed buffer only until its reduce-scatter is
//            done; a rank accumulates just its slices.          4Ψ + 12Ψ/n
//   stage 3  parameters sharded too: a group is all-gathered into a
//            borrowed buffer before its forward and again before its
//            backward, the next group's gather prefetched, and released
//            after use.                                         16Ψ/n
// plus the borrowed buffers: two gathered blocks (one in use, one prefetched),
// one block of gradients, and ln_f; the embedding — a third of GPT-2 — is
// never gathered or reduced whole but two 2 MiB chunks at a time
// (sharded_embedding.h). See "ZeRO" in docs/parallel.md.
//
// Bytes each rank sends per step (one micro-batch): stages 0-2 2Ψ(n-1)/n
// (an all-reduce is a reduce-scatter plus an all-gather), stage 3 3Ψ(n-1)/n.
// Stages 2-3 reduce every micro-batch (their full gradient never exists);
// stages 0-1 only the last. Plus the embedding's sparse exchange of the
// lookup's gradient rows and tokens, (n-1)·B·T·(C+1) floats: once per step
// at stages 0-1, every micro-batch at stage 2, twice per micro-batch at
// stage 3 (the lookup's rows too). tests/parallel/dp_test.cpp checks all of it.
//
// Offload (zero.offload = disk): the optimizer state (and at stage 3 the
// parameter shard) is kept in a DiskStore instead of memory.
//
// Every rank of the group must run the same steps with the same calls; all
// communication goes through one CommStream (comm_stream.h) on the group.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lattice/comm/communicator.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/parallel/compress/gradient_reducer.h"
#include "lattice/parallel/data/comm_stream.h"
#include "lattice/parallel/zero/shard_layout.h"
#include "lattice/parallel/zero/sharded_embedding.h"

namespace lattice::parallel {

struct DataParallelOptions {
  int zero_stage = 0;                  // 0..3
  double bucket_bytes = 4.0 * (1 << 20);
  Progress progress = Progress::Thread;
  bool offload_to_disk = false;
  std::string offload_dir;
  double offload_window_bytes = 64.0 * (1 << 20);
  optim::AdamWConfig adam;
  // Whether grad_sum_squares counts parameters that are whole on every rank
  // of a tensor-parallel group (ShardSpec split_dim < 0). Under tensor
  // parallelism only TP rank 0 counts them, so the sum over the TP group
  // counts each replicated parameter once and each slice once.
  bool count_replicated = true;
  // Gradient compression with error feedback (gradient_reducer.h); codec None: off.
  CompressionOptions compression;
};

class DataParallel final : public model::GroupHooks {
 public:
  // Gives the model's groups the buffers this stage keeps whole (a model
  // built GPT::Unallocated gets nothing it does not keep; an allocated one is
  // padded to whole buckets and trimmed, its values kept) and builds the
  // optimizer over this rank's shard. Installs itself as the model's hooks.
  DataParallel(model::GPT& model, comm::Communicator& dp, const DataParallelOptions& options);
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int ranks() const { return layout_.ranks(); }
  int stage() const { return options_.zero_stage; }
  const ShardLayout& layout() const { return layout_; }
  optim::AdamW& optimizer() { return *optimizer_; }
  CommStream& stream() { return *stream_; }
  GradientReducer& reducer() { return *reducer_; }
  std::string describe() const;

  // Initial parameters from (seed, name, index in the full tensor), the same
  // values as GPT(config, seed) whatever the layout; at stage 3 each rank
  // computes only its slices.
  void initialize(uint64_t seed);

  // ---- one step ----
  // Before the first micro-batch of step index `step` (from 0): gradients
  // marked stale, counters reset, compression on once past its warm-up.
  void begin_step(int64_t step = 0);
  // Before each micro-batch's forward: whether it is the step's last (stages
  // 0-1 reduce only then).
  void begin_micro_batch(bool last);
  // After the last backward: waits for every reduction. This rank's
  // gradient slices (all of them at stage 0) then hold the sum over ranks.
  void finish_gradients();
  // Σ g² of the summed gradient over every parameter, counted once (each
  // rank adds its slices, then one all-reduce of a scalar; stage 0 needs none);
  // without options.count_replicated, over the tensor-sliced parameters only.
  double grad_sum_squares();
  // AdamW on this rank's shard (grad_scale multiplies every gradient: the
  // 1/(n·...) averaging and clipping), then the parameters made whole again
  // where the stage keeps them whole (stages 1-2 all-gather).
  void optimizer_step(float lr, float grad_scale);
  // Sum over the group's ranks (through the stream, in order).
  double sum_over_ranks(double x);

  // Communication of the last step.
  struct StepComm {
    double ran_s = 0;       // time the collectives took
    double exposed_s = 0;   // time the compute thread waited for them
    uint64_t bytes = 0;     // bytes this rank sent (Communicator's ring formulas)
    double hidden() const { return ran_s > 0 ? std::max(0.0, 1.0 - exposed_s / ran_s) : 1.0; }
  };
  StepComm last_step_comm() const { return last_comm_; }

  // ---- checkpoints: full logical group buffers ----
  enum class State { Params, AdamM, AdamV };
  // The whole group buffer (capacity() floats) of `which`, on every rank.
  // Collective: every rank calls it for the same groups in the same order.
  void gather_full(size_t g, State which, float* out);
  // Takes this rank's part of a whole group buffer (every rank holds it).
  void load_full(size_t g, State which, const float* full);

  // ---- model::GroupHooks ----
  void before_params(size_t g, Pass pass) override;
  void after_params(size_t g, Pass pass) override;
  void before_grads(size_t g) override;
  void grads_done(size_t g) override;

 private:
  struct Pool;  // borrowed group-sized buffers, by size
  bool reduce_now() const;
  void reduce_group(size_t g);
  void post_gather(size_t g);
  void reap();
  // Where this rank's part of group g lives for `which` (memory), or null
  // when it is only on disk.
  float* shard_of(size_t g, State which);
  int64_t shard_base(size_t g) const { return shard_base_[g]; }

  model::GPT& model_;
  std::vector<model::ParamGroup>& groups_;
  DataParallelOptions options_;
  ShardLayout layout_;      // over the dp ranks: buckets and shards
  ShardLayout opt_layout_;  // what this rank's optimizer updates (= layout_, or whole groups at stage 0)
  std::vector<int64_t> shard_base_;  // offset of group g in the optimizer state
  std::unique_ptr<CommStream> stream_;
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<optim::AdamW> optimizer_;
  // Without count_replicated: the optimizer's segments grad_sum_squares counts.
  std::vector<std::pair<const float*, int64_t>> norm_segments_;
  std::unique_ptr<Pool> param_pool_, grad_pool_;
  // The embedding group, piece by piece: at stages 2-3 always (sharded), at
  // stages 0-1 with more than one rank (its gradient reduced early); else null.
  std::unique_ptr<ShardedEmbedding> embedding_;
  Buffer embedding_staging_;                      // stage 3 with offload: the embedding's shard, read from disk
  std::vector<Buffer> shard_grads_;  // stages 2-3: this rank's gradient slices per group
  std::vector<LowRankLayout> lowrank_;  // compression.grad = powersgd: each group's matrices
  std::vector<uint8_t> shard_grad_written_;
  Buffer staging_;                   // stage 3 with offload: a shard read from disk before its gather

  // Per group: stage-3 gather state, and pending releases of borrowed buffers.
  std::vector<CommStream::Ticket> gather_ticket_;  // 0: not gathered / not in flight
  std::vector<uint8_t> gathered_;                   // attached and complete
  struct Release {
    CommStream::Ticket ticket;
    size_t group;
  };
  std::vector<Release> pending_grad_releases_;
  bool last_micro_ = true;
  uint64_t bytes_at_step_start_ = 0;
  StepComm last_comm_;
};

}  // namespace lattice::parallel
