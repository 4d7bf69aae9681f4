// The pipeline simulator: given a schedule and the cost of each kind of
// action, when does every action run?
//
// Each rank runs its list in order; an action starts when its rank is free
// and its dependencies (schedule.h) have ended, and takes its cost. Transfers
// between ranks are free (or add `transfer` time to each cross-rank
// dependency). From the timeline:
//   makespan       the end of the last action
//   bubble         the idle share of p × makespan: 1 - Σ busy / (p · makespan)
//   peak in flight per rank, the most micro-batch activations held at once,
//                  in stage equivalents (a chunk's count over the chunks per
//                  rank): a stage's activations are held from the start of
//                  its F to the end of its B, or of its W (I keeps what W needs)
// The planner reuses it; the executor's measured timeline is compared with
// it fed the measured costs.
#pragma once

#include <array>
#include <vector>

#include "lattice/parallel/pipeline/schedule.h"

namespace lattice::pipeline {

struct Costs {
  double forward = 1.0;
  double backward_input = 1.0;   // I; a full B costs I + W
  double backward_weight = 1.0;  // W
  double transfer = 0.0;         // added to every dependency between two ranks
  // Optional, per stage: {F, I, W} of that stage (stages differ: the first
  // holds the embedding, the last the head and loss); when set for a stage it
  // replaces the three above.
  std::vector<std::array<double, 3>> by_stage;
  double of(Op op) const;
  double of(Op op, int stage) const;
};

struct Interval {
  Action action;
  double start = 0, end = 0;
};

struct Simulation {
  double makespan = 0;
  double bubble = 0;
  std::vector<std::vector<Interval>> timeline;  // per rank, in execution order
  std::vector<double> peak_in_flight;           // per rank, stage equivalents
  double max_peak_in_flight() const;
};

// Throws (as validate() does) on a schedule that cannot run.
Simulation simulate(const Schedule& s, const Costs& costs = {});

// The mean measured cost of each kind of action on each of `stages` stages
// from every rank's timeline (the executor's gather_timelines): what the
// simulator is fed to predict the measured bubble. A full B counts as equal
// I and W halves; a kind a stage never ran costs 0.
Costs measured_costs(const std::vector<std::vector<Interval>>& timelines, int stages);

}  // namespace lattice::pipeline
