// The search: every layout lattice would accept for a workload on a
// cluster, the ones whose every pipeline stage fits its devices' memory,
// ranked by predicted step time — and the obvious alternatives to the
// winner, each with why it loses.
//
// Two passes. The first predicts memory and an estimated step time (the
// schedule's unit-cost bubble) for every valid layout; the second runs the
// pipeline simulator with each stage's costs on the best `simulate` of the
// fitting layouts and ranks them by that. Validity is lattice's own: the
// same checks `lattice train` runs on the layout's config (the config's
// cross-key rules, the mesh, tensor parallelism's cut of the model, the
// schedule generator, the partition), remembered per distinct shape so
// that a search of 10^5 layouts stays under a second.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "lattice/plan/cost.h"
#include "lattice/plan/layout.h"
#include "lattice/plan/memory.h"
#include "lattice/plan/presets.h"

namespace lattice::plan {

// What `lattice train` would say about this layout of this workload on
// `devices` ranks: "" when it accepts it, else its one-line refusal (naming
// the key). The layout's offload directory is taken as given.
// `shapes` (optional): where the layout's pipeline is built (and kept for the search).
std::string invalid_reason(const Workload& workload, const Layout& layout, int devices,
                           PipelineShapes* shapes = nullptr);

// The memory options of a cluster's devices (backend, threads, runtime, fragmentation).
MemoryOptions memory_options(const Cluster& cluster);

struct SearchOptions {
  std::vector<DType> precisions = {DType::BF16};  // compute dtypes to try
  bool offload = true;                            // try zero.offload = disk (when the cluster has a disk bandwidth)
  int max_micro_batch_size = 16;
  int simulate = 64;  // the second pass's candidates
  int top = 10;
};

struct Candidate {
  Layout layout;
  double memory = 0;    // the worst pipeline rank's need, bytes (RankMemory::total)
  int worst_stage = 0;  // its pipeline rank
  double capacity = 0;  // the device's memory
  StepTime time;
  bool fits() const { return memory <= capacity; }
};

// A well-known alternative to the winner (pure data parallelism with
// ZeRO-3, no pipeline, no tensor parallelism, ...): the best layout of its
// kind, or the one closest to fitting when none does.
struct Alternative {
  std::string name;     // "ZeRO-3 data parallelism over every device"
  bool found = false;   // some valid layout is of this kind
  Candidate best;       // fastest fitting; else smallest memory
  std::string refusal;  // none found: why lattice refuses the first layout of this kind
};

struct SearchResult {
  std::vector<Candidate> ranked;  // fitting layouts, fastest first (at most options.top)
  Candidate closest;              // when none fits: the layout that needs the least memory
  std::vector<Alternative> alternatives;
  int64_t enumerated = 0, valid = 0, fitting = 0, simulated = 0;
  double seconds = 0;                       // wall time of the search
  std::map<std::string, int64_t> refusals;  // invalid layouts by the first line of their reason's key
};

SearchResult search(const Workload& workload, const Cluster& cluster, const SearchOptions& options);

// One candidate, evaluated: memory (with its per-stage plan) and the simulated step time.
Candidate evaluate(const Workload& workload, const Layout& layout, const Cluster& cluster,
                   PipelineShapes* shapes = nullptr, MemoryPlan* plan = nullptr);

}  // namespace lattice::plan
