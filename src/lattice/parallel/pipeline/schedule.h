// Pipeline schedules as data.
//
// A pipeline cuts the model into S stages (contiguous ranges of layers) on p
// ranks; each rank holds v = S/p of them ("chunks"). A schedule says, for each
// rank, the order in which it runs its actions on the m micro-batches of a
// step:
//
//   F  forward of a stage on a micro-batch
//   B  its full backward (input and weight gradients together)
//   I  its backward for the input only (the dX chain the upstream stage waits for)
//   W  its backward for the weights only (nobody waits for it: zero-bubble
//      schedules move it into the bubbles)
//
// written as PyTorch's torch.distributed.pipelining does: a cell "1F3" is
// stage 1, forward, micro-batch 3; "2B0", "1I3", "1W3" likewise. Its
// compute-only CSV has one row per rank and one cell per action, in order
// (an empty cell is an idle slot and is skipped), so a schedule written for
// torchtitan, or by hand, reads in (from_csv) and every generated one writes
// out (to_csv).
//
// The dependencies every schedule must respect (validate() checks them, and
// simulate() times them):
//   F(s, k)        after F(s-1, k)               the stage's input, from upstream
//   B/I(s, k)      after F(s, k) and the input gradient of (s+1, k): B or I(s+1, k)
//   W(s, k)        after I(s, k)
// plus each rank's own order. Communication is implicit: an action's inputs
// from another rank travel as soon as they are produced (the executor posts
// its receives early), so a list deadlocks only if these dependencies and the
// per-rank orders form a cycle — which validate() finds and names.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lattice::pipeline {

enum class Op : uint8_t { F, B, I, W };
char op_letter(Op op);  // 'F', 'B', 'I', 'W'

struct Action {
  int stage = 0;
  Op op = Op::F;
  int micro = 0;
  bool operator==(const Action& o) const { return stage == o.stage && op == o.op && micro == o.micro; }
};
std::string to_string(const Action& a);  // "1F3"
// Parses one cell ("1F3"); `where` names it in the error (file, rank, column).
Action parse_action(std::string_view cell, const std::string& where);

struct Schedule {
  std::string name;                          // "1f1b", or the CSV's path
  int ranks = 0;                             // p
  int stages = 0;                            // S = p·v
  int micro_batches = 0;                     // m
  std::vector<std::vector<Action>> actions;  // per rank, in execution order
  std::vector<int> rank_of_stage;            // which rank holds each stage

  int chunks_per_rank() const { return ranks > 0 ? stages / ranks : 0; }
};

// ---- the generators (pure functions of p, v, m) ----
// GPipe: every forward, then every backward (micro-batch order); bubble
// (p-1)/(m+p-1), all m micro-batches' activations held.
Schedule gpipe(int p, int m);
// 1F1B (PipeDream-Flush, Megatron): rank r runs min(p-1-r, m) warm-up
// forwards, then alternates one forward and one backward, then drains; same
// bubble as GPipe, at most p - r micro-batches in flight.
Schedule one_f_one_b(int p, int m);
// Interleaved 1F1B (Megatron, Narayanan et al. 2021): v chunks per rank,
// stage c·p + r on rank r; m must be a multiple of p; bubble
// (p-1)/(v·m + p - 1) at equal per-chunk costs.
Schedule interleaved_1f1b(int p, int v, int m);
// ZB-H1 (Qi et al. 2024, "handcrafted 1"): 1F1B with the backward split into
// I and W. Only I is on the critical path (the dX chain upstream), so it
// travels back one I per hop instead of one B; rank r keeps up to r W passes
// back in the steady state (its activations stay in flight: at most p, as on
// rank 0 of 1F1B, so the peak memory is 1F1B's) and runs one after each I of
// the drain, filling the waits. With F = I = W its bubble is
// (p-1)/(3m+p-1), a third of 1F1B's plus 2(p-1)/(3(3m+p-1)) of it.
Schedule zb_h1(int p, int m);
// ZB-V (Qi et al. 2024, the V-shaped zero-bubble schedule): two chunks per
// rank placed as a V — stage r and stage 2p-1-r on rank r, so rank 0 holds
// the first and the last stage and rank p-1 hands stage p-1's output to its
// own stage p — with the backward split into I and W. The order comes from
// list scheduling at unit costs (schedule.cpp): input backwards first, then
// the V's return-leg forwards, then its downward forwards, deferred W's
// filling every wait they fit, at most 2p chunks' activations held per rank
// (p stage equivalents: 1F1B's peak). Every rank runs 6m unit actions and
// rank p-1's first input arrives after p-1 forwards, so no schedule beats a
// bubble of (p-1)/(6m+p-1); this one reaches it, or comes within two
// actions of it for p <= 8 and m >= 2p (about 0.2x of 1F1B's bubble at m = 2p).
Schedule zb_v(int p, int m);
// By name: "gpipe", "1f1b", "zb-h1", "interleaved" (v >= 2), "zb-v" (v = 2).
// Clear errors for a bad p, v or m and an unknown name.
Schedule make_schedule(const std::string& name, int p, int v, int m);

// ---- PyTorch's compute-only CSV ----
std::string to_csv(const Schedule& s);
// Rows are ranks; every cell an action or empty. The stage-to-rank placement
// and m are read off the actions (each stage must live on one rank). Throws
// naming the source, row and column of a malformed cell. Does not validate
// the dependencies: call validate().
Schedule from_csv(const std::string& text, const std::string& source);

// ---- the validator ----
// Throws lattice::Error naming the first bad action: an action outside the
// stages or micro-batches, a stage on two ranks, an action twice, a forward
// or backward missing (B, or both I and W), a backward before its forward or
// a W before its I on the rank, or a deadlock (the blocked action and what it
// waits for). validate_structure() is the part before the deadlock search.
void validate(const Schedule& s);
void validate_structure(const Schedule& s);

}  // namespace lattice::pipeline
