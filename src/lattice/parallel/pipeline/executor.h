// The pipeline executor: runs one rank's list of a schedule (schedule.h) on
// the stage models this rank holds (model::GPT built with StageLayers, one
// per stage — v of them with interleaving).
//
// Per action:
//   F(s, k)   the input: micro-batch k's tokens (stage 0), or stage s-1's
//             output — from this rank's own chunk, or received from its rank
//             (the receive posted as early as the previous action, waited for
//             here); forward_stage into a free activation slot; the output
//             sent on to stage s+1's rank (non-blocking).
//   B/I(s, k) the output's gradient from stage s+1 (received likewise, or
//             taken from this rank's chunk); backward or backward_input; the
//             input's gradient sent to stage s-1's rank.
//   W(s, k)   backward_weight; the slot is free again.
// Sends copy their payload (the slot may be reused at once) and are waited
// for at the end of the step; receives name (stage, micro-batch, direction)
// in their tag, so any valid order matches. The loss is scaled by 1/m (every
// micro-batch's gradient is that of the step's mean loss). The tied
// embedding's two shares of gradient (the lookup's on the first stage, the
// head's on the last) stay where they are: whoever reduces the gradients
// sums them, over sum_tied().
//
// Activation slots come from a pool per stage and return to it after the
// micro-batch's last backward, so a rank holds only its in-flight
// micro-batches (1F1B: at most p, GPipe: m).
//
// Every action is timed (seconds from the step's start): timeline() is the
// measured counterpart of the simulator's, for pipeline::chrome_trace and the
// measured bubble.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "lattice/comm/communicator.h"
#include "lattice/model/gpt.h"
#include "lattice/parallel/pipeline/schedule.h"
#include "lattice/parallel/pipeline/simulator.h"

namespace lattice::pipeline {

struct MicroBatch {
  const int32_t* inputs = nullptr;   // [B·T] token ids (read by stage 0)
  const int32_t* targets = nullptr;  // [B·T] (read by the last stage)
};

class Executor {
 public:
  // `group`: the pipeline ranks, rank i running row i of `schedule` (which
  // is validated here). `stages[j]`: the model of the j-th stage this rank
  // holds, in increasing stage order, each built for that stage's layers.
  // Collective over `group` (the ranks holding the first and last stage get
  // a communicator for the tied embedding).
  Executor(const Schedule& schedule, std::vector<model::GPT*> stages, comm::Communicator& group);
  ~Executor();

  // One step: every action of this rank's list on `batches` (m micro-batches
  // of B × T tokens). Gradients accumulate into the stage models' groups
  // (the caller zeroes them before). Returns the step's mean loss, on every rank.
  double run_step(const std::vector<MicroBatch>& batches, int B, int T);
  // The loss of each micro-batch is multiplied by `scale` before the backward
  // (f16's loss scale: the gradients come out `scale` times larger; 1 by default).
  void set_loss_scale(float scale) { loss_scale_ = scale; }
  // Mean loss of `batches` without a backward (evaluation): every rank runs
  // the forwards of its stages micro-batch by micro-batch, as GPipe's fill
  // does, and drops each activation slot once its output has gone on (a
  // whole model, one stage, stores nothing: GPT::evaluate).
  double evaluate(const std::vector<MicroBatch>& batches, int B, int T);

  // This rank's actions of the last step, timed (seconds from its start).
  const std::vector<Interval>& timeline() const { return timeline_; }
  // Every rank's timeline of the last step (collective): for the trace and
  // the measured bubble.
  std::vector<std::vector<Interval>> gather_timelines();

  const Schedule& schedule() const { return schedule_; }

  // Called during run_step right before each action that writes `stage`'s
  // weight gradients (B or W), with whether it is this rank's last such
  // action of the stage in the step: data parallelism reduces a stage's
  // gradients as that last backward writes them, overlapping the rest of it
  // and of the schedule.
  void on_backward(std::function<void(int stage, bool last)> begin) { backward_begins_ = std::move(begin); }
  // Called right after this rank's last backward of `stage` in the step (the
  // stage's gradients are final — but for the tied embedding's, whose two
  // shares the data-parallel engine sums in finish_gradients).
  void on_stage_done(std::function<void(int stage)> done) { stage_done_ = std::move(done); }
  // Sums n floats of the tied embedding between the first and the last
  // stage: `first` / `last` are this rank's buffers for those stages, null
  // where the stage is elsewhere (collective over the two stages' ranks).
  // The data-parallel engine calls it (DataParallel::set_tied_sum): the two
  // shares of the tied wte's gradient — the lookup's on the first stage, the
  // head's on the last — are its business, summed before or after its
  // reductions as the ZeRO stage needs.
  void sum_tied(float* first, float* last, size_t n);
  // Bytes this rank has sent between pipeline stages so far: activations and
  // their gradients, and the tied embedding's sum (the Communicators' counts).
  uint64_t bytes_sent() const {
    return group_.stats().bytes_sent + (embedding_group_ ? embedding_group_->stats().bytes_sent : 0);
  }

 private:
  struct Pending;
  // Runs `actions` (this rank's, valid for the schedule's placement); with
  // `training` false the list holds forwards only and each slot is dropped
  // after its forward. Returns the sum of the last stage's losses.
  double run_actions(const std::vector<Action>& actions, const std::vector<MicroBatch>& batches, int B, int T,
                     bool training);
  model::GPT& stage_model(int stage);
  int tag(int stage, int micro, bool backward) const;

  Schedule schedule_;
  comm::Communicator& group_;
  std::vector<model::GPT*> stage_of_;                    // by stage index: this rank's model, or null
  std::unique_ptr<comm::Communicator> embedding_group_;  // first and last stage's ranks (if two)
  std::vector<Interval> timeline_;
  std::function<void(int, bool)> backward_begins_;
  std::function<void(int)> stage_done_;
  float loss_scale_ = 1.0f;
};

}  // namespace lattice::pipeline
