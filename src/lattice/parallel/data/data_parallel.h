// DataParallel: data parallelism and ZeRO stages 0-3, with optional disk
// offload and gradient compression, for the N model parts this rank runs —
// the whole model (one part, pipeline size 1) or the pipeline stages it holds
// (several with interleaving). One engine serves every layout: the executor
// runs a schedule over the parts and tells this engine, through the trainer's
// wiring, when a part's backward begins and whether it is the part's last of
// the step (before_backward) and when that last one has finished (part_done).
//
// The model never sees any of it: the engine installs itself as every part's
// GroupHooks and acts when a part says a group's parameters are needed or
// its gradients are final. Per stage (Ψ = this rank's parameters: its parts',
// under tensor parallelism its slices of them; n = ranks; fp32, so 16Ψ bytes
// of model state without ZeRO):
//
//   stage 0  every rank keeps parameters, gradients and Adam moments whole.
//            A part's gradients are all-reduced group by group (bucketed) as
//            its last backward of the step finishes each group, overlapping
//            the rest of that backward and of the schedule.     16Ψ
//   stage 1  Adam moments sharded: each rank keeps and updates 1/n of every
//            group (ShardLayout). Gradients are reduce-scattered in the last
//            backward (each rank receives the sum of its slices, in place),
//            the updated slices all-gathered after the step.    8Ψ + 8Ψ/n
//   stage 2  gradients sharded too: each backward's gradient of a group lives
//            in a borrowed buffer only until its reduce-scatter into this
//            rank's slices is done.                             4Ψ + 12Ψ/n
//   stage 3  parameters sharded too: a group is all-gathered into a borrowed
//            buffer for every pass that reads it (F, and B or I: W reads
//            none), the part's next group prefetched, and released after.
//                                                               16Ψ/n
// plus the borrowed buffers: two gathered groups of a size (one in use, one
// prefetched), one group of gradients of a size. The embedding group — a
// third of GPT-2 — is never gathered or reduced whole at stages 2-3 but in
// 2 MiB chunks (sharded_embedding.h), on the whole model and on a pipeline's
// first and last stages alike; at stages 0-1 a whole model with more than one
// rank reduces it early the same way (its lookup's share is final only at
// the very end of the backward). See "ZeRO" in docs/parallel.md.
//
// The tied embedding under pipelines: the first stage's copy (the lookup's
// gradient) and the last stage's (the head's) are summed between the two
// stages by the TiedSum the trainer wires to the executor — at stages 0-1
// their whole gradients after the schedule, each copy then reduced over the
// replicas (so a codec compresses the sum; one reduction, copied, when both
// copies are on this rank); at stages 2-3, which never hold
// a whole embedding gradient, the slices each copy was reduced into. Both
// copies then hold the same sum and stay equal after the update.
//
// Bytes each rank sends per step (one micro-batch): stages 0-2 2Ψ(n-1)/n
// (an all-reduce is a reduce-scatter plus an all-gather), stage 3 3Ψ(n-1)/n.
// Stages 2-3 reduce every micro-batch's backward; stages 0-1 only the last.
// Plus the embedding's sparse exchanges of the lookup's gradient rows and
// tokens (sharded_embedding.h). tests/parallel/dp_test.cpp checks all of it.
//
// 1-bit Adam (compression.momentum; Tang et al. 2021, DeepSpeed's OneBitAdam).
// A biased codec (onebit, topk) with error feedback on the *gradient* fights
// Adam: what an encoding drops arrives in a burst steps later and v, which
// normalises by the recent squared gradient, remembers it. 1-bit Adam runs
// compression.warmup_steps ordinary steps, then freezes v and reduces the
// momentum instead, which is smooth enough for the codec:
//   each rank  μ_r ← β1·μ_r + (1-β1)·g_r     (its own gradient, clipped, the
//                                             loss scale out; μ_r starts as m)
//   m = Σ_r μ_r / n, through the codec with error feedback on μ_r/n
//       (reduce_momentum: all-reduce at stage 0, reduce-scatter at stage 1)
//   p ← p - lr·(m̂ / (√max(v̂, m̂²) + ε) + wd·p)   v frozen at t_v updates,
//       m̂ = m/(1-β1^t), v̂ = v/(1-β2^t_v); the max caps each step at lr
//       where a gradient outgrew its frozen v (kernels/ops.h)
// The mean of the μ_r is exactly Adam's averaged momentum, so an exact codec
// (none) gives the same model at every data-parallel degree (without
// clipping, below); nothing is reduced in the backward. Unlike DeepSpeed's
// OneBitAdam, each rank keeps its own μ_r (rather than taking back the
// compressed average, which ZeRO-1's slices would not give it), the bias
// corrections stay, and the max is added. Gradient clipping uses the root mean square of the
// ranks' gradient norms (one scalar all-reduce), an upper bound of the mean
// gradient's norm, which is never formed.
// Per ZeRO stage: 0 sends the codec's share of an all-reduce (both halves
// compressed); 1 compresses the reduce-scatter and all-gathers the updated
// parameters in f32, as it always does — the bytes of that gather are ZeRO's,
// not the gradient's. Memory: μ_r is one more whole-model f32 buffer per rank
// (MemCategory::Optimizer), beside error feedback's. Stages 2-3 are refused:
// they exist not to hold a rank's whole gradient, and 1-bit Adam needs it
// (with μ_r and its error, a whole model twice over) — folding each
// micro-batch into μ_r as it is written would need the clip factor before
// the backward ends. A resumed run restarts each μ_r from the saved m and
// the errors at zero.
//
// Every rank of the group must run the same steps with the same calls; all
// communication goes through one CommStream on the group (comm/comm_stream.h).
//
// Several engines can serve one model, each owning some of its groups
// (DataParallelOptions::owns) over its own communicator: mixture-of-experts
// reduces the dense groups over dp×cp and each layer's experts group over the
// ranks that hold the same experts (comm::MeshGroup::ExpertReplicas). An
// engine then allocates, shards, reduces, gathers and updates its groups
// only; the others are another engine's business. Their hooks are composed
// by a GroupHooksRouter (group_hooks_router.h) installed on each part instead
// of either engine's (install_hooks = false). The step is the same calls on
// every engine, the global gradient norm the sum of their grad_sum_squares,
// and every engine's optimizer_step gets the same grad_scale.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "lattice/comm/comm_stream.h"
#include "lattice/comm/communicator.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/parallel/compress/gradient_reducer.h"
#include "lattice/parallel/zero/shard_layout.h"

namespace lattice::parallel {

// The embedding's chunks are its working buffers at stages 2-3 (two of
// parameters, two of gradient): small, so the working set stays a few
// percent of the model (at GPT-2's vocabulary the table is a third of it),
// and large enough for its GEMMs (2 MiB = 682 rows of 768) and messages.
inline constexpr double kEmbeddingChunkBytes = 2.0 * (1 << 20);

struct DataParallelOptions {
  int zero_stage = 0;  // 0..3
  double bucket_bytes = 4.0 * (1 << 20);
  comm::Progress progress = comm::Progress::Thread;
  bool offload_to_disk = false;
  std::string offload_dir;
  double offload_window_bytes = 64.0 * (1 << 20);
  optim::AdamWConfig adam;
  // Gradient compression with error feedback (gradient_reducer.h); codec None: off.
  CompressionOptions compression;
  // The group is dp×cp ranks ordered (dp, cp) when > 1: context-parallel
  // ranks hold other positions of the same sequences (the sharded
  // embedding's learned positions need to know whose rows are whose).
  int context_parallel = 1;
  // The groups this engine serves, by part and index in GPT::groups(); empty:
  // every group. An unowned group is not allocated, initialised, reduced,
  // gathered, updated or counted in the norm by this engine: another engine
  // (with its own communicator) must own it. The embedding group's special
  // path (ShardedEmbedding, the tied sum under pipelines) is the engine's that
  // owns it.
  std::function<bool(const model::GPT& part, size_t group)> owns;
  // The order in which a pass reads the part's groups, which ZeRO-3's
  // prefetch follows (filtered to the owned groups); empty: the dense model's
  // (forward: embedding, blocks, final; backward: (embedding,) final, blocks
  // from the last). A model with more groups (experts) passes its own.
  std::function<std::vector<size_t>(const model::GPT& part, model::GroupHooks::Pass pass)> order;
  // Installs the engine as every part's GroupHooks. False when several
  // engines serve the model: a GroupHooksRouter over their hooks(part) is
  // installed instead.
  bool install_hooks = true;
  // The engine's group holds each element of its groups once among its
  // ranks (experts: whole on every TP rank, and the group spans the TP
  // ranks): grad_sum_squares counts every element of this rank's shards
  // (not GPT::counts_in_norm's TP rank 0 only), at stage 0 on the group's
  // rank 0 only (every rank holds the whole sum there).
  bool whole_group_norm = false;
  // Names this engine's offload files (two engines on one rank offloading to
  // one directory need different names) and its describe(); "" for the only one.
  std::string name;
};

class DataParallel {
 public:
  // `parts`: this rank's model parts, in the executor's order, each built
  // GPT::Unallocated (its owned groups not allocated yet): the engine
  // allocates what the stage keeps whole (padded to whole buckets), builds
  // the optimizer over this rank's shard and installs itself as every part's
  // hooks (unless options.install_hooks is false). Draw the initial values
  // with initialize() or load them with load_full().
  DataParallel(std::vector<model::GPT*> parts, comm::Communicator& dp, const DataParallelOptions& options);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int ranks() const { return ranks_; }
  int stage() const { return options_.zero_stage; }
  size_t num_parts() const { return parts_.size(); }
  // Buckets and shards of part j's groups over the data-parallel ranks.
  const ShardLayout& layout(size_t part = 0) const;
  optim::AdamW& optimizer() { return *optimizer_; }
  comm::CommStream& stream() { return *stream_; }
  GradientReducer& reducer() { return *reducer_; }
  std::string describe() const;
  // Whether group g of part j is this engine's (DataParallelOptions::owns).
  bool owns(size_t part, size_t g) const;
  // Part j's model (for GroupHooksRouter).
  const model::GPT& part_model(size_t part) const;
  // The engine's GroupHooks for part j: what it installs as the part's hooks,
  // or, with install_hooks = false, what a GroupHooksRouter forwards the
  // calls for this engine's groups to (a call for another group is refused).
  model::GroupHooks& hooks(size_t part);

  // Initial parameters from (seed, name, index in the full tensor), the same
  // values as GPT(config, seed) whatever the layout; at stage 3 each rank
  // computes only its slices (no rank ever holds a whole group it does not own).
  void initialize(uint64_t seed);

  // ---- one step ----
  // Before the first action of step index `step` (from 0): gradients marked
  // stale, counters reset, compression on once past its warm-up.
  void begin_step(int64_t step = 0);
  // Before each backward action that writes part j's weight gradients (B or
  // W): whether it is the part's last of the step (stages 0-1 reduce only
  // in that one).
  void before_backward(size_t part, bool last);
  // After part j's last backward of the step: whatever of it is not posted
  // yet (a group no backward wrote counts as zeros) is posted now.
  void part_done(size_t part);
  // After the schedule: waits for every reduction, then sums the tied
  // embedding's copies (tied_sum). This rank's gradient slices (all of them
  // at stage 0) then hold the sum over ranks.
  void finish_gradients();
  // Sums n floats of the tied embedding between the pipeline's first and last
  // stage: `first` / `last` are this rank's buffers for those stages' copies,
  // null where that stage is on another rank (collective over the two
  // stages' ranks; the executor's sum_tied).
  using TiedSum = std::function<void(float* first, float* last, size_t n)>;
  void set_tied_sum(TiedSum sum) { tied_sum_ = std::move(sum); }
  // Σ g² of the summed gradient over every parameter counted once
  // (model::GPT::counts_in_norm: the tied embedding on its first stage,
  // tensor-replicated parameters on TP rank 0), summed over the data-parallel
  // ranks where they hold slices. To be summed over the pipeline and TP groups.
  double grad_sum_squares();
  // AdamW on this rank's shard (grad_scale multiplies every gradient: the
  // 1/(n·...) averaging and clipping), then the parameters made whole again
  // where the stage keeps them whole (stages 1-2 all-gather, each group as
  // soon as its slices are updated).
  void optimizer_step(float lr, float grad_scale);
  // 1-bit Adam (compression.momentum) past its warm-up: this step reduces
  // momenta, not gradients (see "1-bit Adam" above).
  bool momentum_phase() const { return momentum_phase_; }
  // The momentum phase's reduction, which optimizer_step does first when it
  // has not been done: each rank's μ ← β1·μ + (1-β1)·n·grad_scale·g from its
  // own gradient g, and μ/n summed over the ranks (compressed, with the
  // codec and error feedback) where the summed gradient would be. A caller
  // that must act on the averaged momentum before the update (the trainer's
  // average_replicated_grads under tensor parallelism) calls it first.
  void reduce_momentum(float grad_scale);
  // The Adam updates v had seen when it froze (0: not frozen yet), which a
  // checkpoint keeps: a resumed run's optimizer has taken more steps since.
  int64_t variance_steps() const { return variance_steps_; }
  void restore_variance_steps(int64_t t) { variance_steps_ = t; }
  // Sum over the group's ranks (through the stream, in order).
  double sum_over_ranks(double x);

  // Communication of the step so far (since begin_step): after the update,
  // or after a step whose update was skipped, the whole step's.
  struct StepComm {
    double ran_s = 0;      // time the collectives took
    double exposed_s = 0;  // time the compute thread waited for them
    uint64_t bytes = 0;    // bytes this rank sent (Communicator's ring formulas)
    double hidden() const { return ran_s > 0 ? std::max(0.0, 1.0 - exposed_s / ran_s) : 1.0; }
  };
  StepComm step_comm();

  // ---- checkpoints: full logical group buffers ----
  enum class State { Params, AdamM, AdamV };
  // The whole buffer (capacity() floats) of part j's group g, of `which`, on
  // every rank. Collective: every rank calls it for the same groups in the same
  // order. Group g must be this engine's (so must load_full's).
  void gather_full(size_t part, size_t g, State which, float* out);
  // Takes this rank's part of a whole group buffer (every rank holds it).
  void load_full(size_t part, size_t g, State which, const float* full);

 private:
  struct Part;
  class PartHooks;
  struct Pool;  // borrowed group-sized buffers, by size
  friend class PartHooks;
  // The model::GroupHooks of part j.
  void before_params(size_t j, size_t g, model::GroupHooks::Pass pass);
  void after_params(size_t j, size_t g);
  void before_grads(size_t j, size_t g);
  void grads_done(size_t j, size_t g);
  bool is_embedding(const Part& p, size_t g) const;
  // Refuses a group that is not this engine's (`what`: the call, for the message).
  void check_owned(const Part& p, size_t j, size_t g, const char* what) const;
  // Whether group g of p is reduced outside grads_done/part_done.
  bool reduced_at_finish(const Part& p, size_t g) const;
  // The parts holding the tied embedding's first and last pipeline stage
  // copies (parts_.size() where not on this rank).
  void tied_copies(size_t* first, size_t* last) const;
  // 1-bit Adam: at the first step past the warm-up, v frozen and each rank's
  // momentum started from Adam's (averaged) m.
  void start_momentum_phase();
  // The momentum phase's norm: no gradient was summed, so the root mean
  // square of the ranks' own (as the trainer reads the sum it returns).
  double local_grad_sum_squares();
  void reduce_group(size_t j, size_t g);
  // Posts the reduction of group g's buffer chunk by chunk through the
  // reducer (labelled `what`): all-reduce at stage 0, into this rank's slices
  // at stage 1, into `shard` (added when `accumulate`) at stages 2-3. Returns
  // the last chunk's ticket.
  comm::CommStream::Ticket reduce_chunks(Part& p, size_t g, const char* what, float* shard, bool accumulate);
  void post_gather(size_t j, size_t g);
  void reap();
  // Where this rank's part of group g of part p lives for `array`
  // (StateStore::kP, kM, kV) in memory, or null when it is only on disk.
  float* shard_of(const Part& p, size_t g, int array);

  std::vector<std::unique_ptr<Part>> parts_;
  DataParallelOptions options_;
  int ranks_ = 1;
  std::unique_ptr<comm::CommStream> stream_;
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<optim::AdamW> optimizer_;
  std::unique_ptr<Pool> param_pool_, grad_pool_;
  Buffer staging_;  // stage 3 with offload: a shard read from disk before its gather
  struct Release {
    comm::CommStream::Ticket ticket;
    size_t part, group;
  };
  std::vector<Release> pending_grad_releases_;
  TiedSum tied_sum_;
  uint64_t bytes_at_step_start_ = 0;
  bool momentum_phase_ = false, momentum_reduced_ = false, momentum_started_ = false;
  int64_t variance_steps_ = 0;  // 1-bit Adam: v frozen after this many updates (0: not started)
};

}  // namespace lattice::parallel
