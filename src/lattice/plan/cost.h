// The cost model: the time of one optimizer step of a layout on a cluster,
// and what it is made of.
//
// Compute: each layer's FLOPs per micro-batch on one rank (its tensor-
// parallel slices, its share of the sequence under context parallelism,
// its routed rows under experts) over the device's peak for the compute
// dtype times a GEMM efficiency curve (Cluster::gemm_efficiency at the
// GEMM's smallest dimension). The split is the schedule's: F (forward), I
// (input gradient: the same GEMMs again, attention's backward at 2.5 times
// its forward — flash attention recomputes the scores — and, under full
// recomputation, the forward once more) and W (weight gradients: the GEMMs
// once more).
//
// FLOP conventions. Time counts the FLOPs the kernels run: causal attention
// halved (lattice's kernel skips the masked key blocks), recomputation
// included. Model FLOPs — what MFU divides — are lattice's own convention
// (model::ModelConfig::flops_per_token: 6N + 12·L·C·T per token, the PaLM /
// nanoGPT count, causal attention not halved, recomputation not counted).
//
// Communication: an α-β model per link and collective (ring algorithms):
// all-reduce 2(n−1)/n·S/β + 2(n−1)α, reduce-scatter and all-gather
// (n−1)/n·S/β + (n−1)α, all-to-all (n−1)/n·S/β + (n−1)α, send/recv S/β + α;
// a group inside one node uses the intra-node link, one spanning nodes the
// inter-node link. Tensor parallelism's collectives (2 all-reduces of the
// activations per layer forward and 2 backward; with SP 2 all-gathers and 2
// reduce-scatters each way, the same bytes), context parallelism's ring
// (hidden behind the attention blocks it overlaps) or all-to-alls, and
// expert parallelism's dispatch and combine sit on the critical path; the
// pipeline's sends are the simulator's transfer time; data parallelism's
// reductions overlap the backward as the engine does (data_parallel.h:
// stages 0-1 during the last micro-batch's backward, 2-3 during every
// backward, stage 3's gathers during the passes they prefetch for) and only
// what does not fit is exposed.
//
// The pipeline: the schedule simulated (pipeline::simulate) with each
// stage's F, I and W — the first stage's embedding, the last stage's head —
// and the transfers: the makespan and the bubble. Then the exposed data-
// parallel tail and the optimizer step (AdamW reads and writes 28 bytes a
// parameter of this rank's shard; offload moves the moments to disk and back).
#pragma once

#include <string>

#include "lattice/plan/layout.h"
#include "lattice/plan/memory.h"
#include "lattice/plan/presets.h"

namespace lattice::plan {

struct StepTime {
  double step = 0;          // s, one optimizer step
  double makespan = 0;      // the pipeline's schedule (compute, TP/CP/EP communication, transfers, bubble)
  double compute = 0;       // the busiest pipeline rank's compute per step (recomputation included)
  double tp_comm = 0;       // exposed per step on the busiest rank: tensor parallelism
  double cp_comm = 0;       //   context parallelism (what the attention does not hide)
  double ep_comm = 0;       //   expert parallelism's all-to-alls
  double pp_comm = 0;       //   the pipeline's sends (on the critical path of the fill and drain)
  double bubble = 0;        // idle share of the pipeline (simulator: 1 − Σ busy / (p · makespan))
  double dp_comm = 0;       // data-parallel/ZeRO communication per step, all of it
  double dp_exposed = 0;    //   of which not hidden behind the backward
  double optimizer = 0;     // AdamW on this rank's shard (and offload I/O)
  double model_flops = 0;   // per step, lattice's MFU convention
  double mfu = 0;           // model FLOPs / (step · devices · peak)
  double tokens_per_s = 0;  // the whole job's
  bool simulated = false;   // the makespan is the simulator's (else the estimate from the unit-cost bubble)
};

// Seconds of a collective of `bytes` (what each rank contributes: the whole
// buffer for all-reduce, the gathered result for all-gather, the input for
// reduce-scatter and all-to-all) over n ranks on `link`.
enum class Collective { AllReduce, ReduceScatter, AllGather, AllToAll, SendRecv };
double collective_seconds(Collective c, double bytes, int n, const Link& link);

// The link a group of `size` ranks whose members are `stride` ranks apart
// uses on this cluster (the mesh puts tp fastest, then cp, dp, pp).
const Link& group_link(const Cluster& cluster, int stride, int size);

// The step time of `layout`. `simulate` false: the makespan is estimated
// from the schedule's unit-cost bubble (the search's first pass); true: the
// simulator runs the schedule with each stage's costs.
StepTime predict_time(const Workload& workload, const Layout& layout, const Cluster& cluster,
                      PipelineShapes* shapes = nullptr, bool simulate = true);

}  // namespace lattice::plan
