#include "lattice/parallel/pipeline/simulator.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "lattice/core/error.h"

namespace lattice::pipeline {

double Costs::of(Op op) const {
  switch (op) {
    case Op::F:
      return forward;
    case Op::B:
      return backward_input + backward_weight;
    case Op::I:
      return backward_input;
    case Op::W:
      break;
  }
  return backward_weight;
}

double Costs::of(Op op, int stage) const {
  if (stage < 0 || static_cast<size_t>(stage) >= by_stage.size()) return of(op);
  const std::array<double, 3>& c = by_stage[static_cast<size_t>(stage)];
  switch (op) {
    case Op::F:
      return c[0];
    case Op::B:
      return c[1] + c[2];
    case Op::I:
      return c[1];
    case Op::W:
      break;
  }
  return c[2];
}

double Simulation::max_peak_in_flight() const {
  double m = 0;
  for (double x : peak_in_flight) m = std::max(m, x);
  return m;
}

namespace {

constexpr double kNotYet = -1;

// End times of every action, by (stage, micro-batch, kind). The input
// gradient of (s, k) is its B or its I, whichever the schedule has.
struct Ends {
  int micro;
  std::vector<double> t;  // [stage][micro][op]
  Ends(int stages, int micro_batches)
      : micro(micro_batches), t(static_cast<size_t>(stages) * micro_batches * 4, kNotYet) {}
  double& at(int stage, int k, Op op) { return t[(static_cast<size_t>(stage) * micro + k) * 4 + static_cast<int>(op)]; }
  double input_grad(int stage, int k) {
    const double b = at(stage, k, Op::B);
    return b >= 0 ? b : at(stage, k, Op::I);
  }
};

// The actions `a` waits for, other than its rank's previous one: (stage, micro, op-or-input-grad).
struct Dep {
  int stage, micro;
  bool input_grad;  // B or I of (stage, micro)
  Op op;
};
int deps_of(const Action& a, int stages, Dep out[2]) {
  int n = 0;
  switch (a.op) {
    case Op::F:
      if (a.stage > 0) out[n++] = {a.stage - 1, a.micro, false, Op::F};
      break;
    case Op::B:
    case Op::I:
      out[n++] = {a.stage, a.micro, false, Op::F};
      if (a.stage + 1 < stages) out[n++] = {a.stage + 1, a.micro, true, Op::I};
      break;
    case Op::W:
      out[n++] = {a.stage, a.micro, false, Op::I};
      break;
  }
  return n;
}

std::string dep_name(const Dep& d) {
  return d.input_grad ? std::to_string(d.stage) + "B" + std::to_string(d.micro) + " or " + std::to_string(d.stage) +
                            "I" + std::to_string(d.micro)
                      : to_string(Action{d.stage, d.op, d.micro});
}

}  // namespace

Simulation simulate(const Schedule& s, const Costs& costs) {
  validate_structure(s);
  const int p = s.ranks;
  Ends ends(s.stages, s.micro_batches);
  Simulation sim;
  sim.timeline.assign(static_cast<size_t>(p), {});
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<double> free_at(static_cast<size_t>(p), 0.0);
  size_t remaining = 0;
  for (const auto& row : s.actions) remaining += row.size();
  // Replay: each rank runs its list in order; an action runs once what it
  // waits for has run. Times depend only on those, so the order in which
  // ranks are visited does not matter.
  while (remaining > 0) {
    bool progress = false;
    for (int r = 0; r < p; r++) {
      while (next[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][next[r]];
        Dep deps[2];
        const int n = deps_of(a, s.stages, deps);
        double start = free_at[r];
        bool ready = true;
        for (int i = 0; i < n && ready; i++) {
          const double e = deps[i].input_grad ? ends.input_grad(deps[i].stage, deps[i].micro)
                                              : ends.at(deps[i].stage, deps[i].micro, deps[i].op);
          if (e < 0) {
            ready = false;
          } else {
            start = std::max(start, e + (s.rank_of_stage[deps[i].stage] != r ? costs.transfer : 0.0));
          }
        }
        if (!ready) break;
        const double end = start + costs.of(a.op, a.stage);
        ends.at(a.stage, a.micro, a.op) = end;
        sim.timeline[r].push_back({a, start, end});
        free_at[r] = end;
        next[r]++;
        remaining--;
        progress = true;
      }
    }
    if (!progress) {
      // Name the first blocked action and the first thing it waits for.
      for (int r = 0; r < p; r++) {
        if (next[r] >= s.actions[r].size()) continue;
        const Action& a = s.actions[r][next[r]];
        Dep deps[2];
        const int n = deps_of(a, s.stages, deps);
        for (int i = 0; i < n; i++) {
          const double e = deps[i].input_grad ? ends.input_grad(deps[i].stage, deps[i].micro)
                                              : ends.at(deps[i].stage, deps[i].micro, deps[i].op);
          if (e >= 0) continue;
          LATTICE_FAIL("schedule " << s.name << ": deadlock: rank " << r << " action " << next[r] + 1 << " '"
                                   << to_string(a) << "' waits for " << dep_name(deps[i]) << " on rank "
                                   << s.rank_of_stage[deps[i].stage] << ", which waits (directly or not) for rank " << r
                                   << " to get past it");
        }
      }
      LATTICE_FAIL("schedule " << s.name << ": deadlock");
    }
  }
  double busy = 0;
  for (const auto& row : sim.timeline)
    for (const Interval& iv : row) {
      sim.makespan = std::max(sim.makespan, iv.end);
      busy += iv.end - iv.start;
    }
  sim.bubble = sim.makespan > 0 ? 1.0 - busy / (p * sim.makespan) : 0.0;
  // Activations held: from the start of F to the end of B or W; at equal
  // times a release comes before an allocation.
  const double chunks = s.chunks_per_rank();
  sim.peak_in_flight.assign(static_cast<size_t>(p), 0.0);
  for (int r = 0; r < p; r++) {
    std::vector<std::pair<double, int>> events;
    for (const Interval& iv : sim.timeline[r]) {
      if (iv.action.op == Op::F) events.push_back({iv.start, +1});
      if (iv.action.op == Op::B || iv.action.op == Op::W) events.push_back({iv.end, -1});
    }
    std::sort(events.begin(), events.end());
    int held = 0, peak = 0;
    for (const auto& [t, d] : events) peak = std::max(peak, held += d);
    sim.peak_in_flight[r] = peak / chunks;
  }
  return sim;
}

Costs measured_costs(const std::vector<std::vector<Interval>>& timelines, int stages) {
  const size_t S = static_cast<size_t>(stages);
  std::vector<std::array<double, 3>> sum(S, {0, 0, 0}), count(S, {0, 0, 0});
  auto add = [&](size_t stage, int kind, double d) { sum[stage][kind] += d, count[stage][kind]++; };
  for (const auto& row : timelines)
    for (const Interval& iv : row) {
      const size_t st = static_cast<size_t>(iv.action.stage);
      const double d = iv.end - iv.start;
      switch (iv.action.op) {
        case Op::F: add(st, 0, d); break;
        case Op::I: add(st, 1, d); break;
        case Op::W: add(st, 2, d); break;
        case Op::B: add(st, 1, d / 2), add(st, 2, d / 2); break;
      }
    }
  Costs costs;
  costs.by_stage.resize(S);
  for (size_t st = 0; st < S; st++)
    for (int k = 0; k < 3; k++) costs.by_stage[st][k] = count[st][k] ? sum[st][k] / count[st][k] : 0.0;
  return costs;
}

}  // namespace lattice::pipeline
