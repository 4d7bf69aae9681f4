// Expert parallelism: the E experts of an MoE layer spread over the ep ranks
// of an ep group (carved from dp×cp, comm/process_mesh.h), E/ep whole experts
// each; rank r holds experts [r·E/ep, (r+1)·E/ep). The tokens move to their
// experts and back with all-to-alls (GShard; Megatron-core's
// MoEAlltoAllTokenDispatcher; DeepSpeed-MoE):
//
//   counts    every rank's count of pairs per expert, all-gathered ([ep][E]):
//             every rank then knows every rank's send and receive sizes (and a
//             router past the memory bound stops the whole group alike)
//   dispatch  the (token, choice) rows, ordered by expert then token, go to
//             their expert's rank (all_to_all_v); the receiver reorders them
//             from (source, expert) blocks to (expert, source) blocks, so each
//             local expert reads its rows in a canonical order — source rank,
//             then the source's token order — whatever the arrival order
//   combine   the reverse: expert outputs reordered to (source, expert) blocks
//             and sent home (all_to_all_v)
//
// The backward of dispatch is a combine and the backward of combine a
// dispatch: the same two functions move the gradients. Bytes per rank per
// layer (fp32, h = n_embd, T rows, k choices, uniform routing):
//   forward  dispatch + combine  2·T·k·h·4·(ep−1)/ep
//   backward the same again      2·T·k·h·4·(ep−1)/ep
// (exactly: the rows sent to other ranks times h·4, from the routing counts).
#pragma once

#include <cstdint>
#include <vector>

#include "lattice/comm/communicator.h"

namespace lattice::expert {

class ExpertParallel {
 public:
  // `group`: the ep group (not owned); null for one rank holding every expert.
  ExpertParallel(comm::Communicator* group, int n_experts);

  int size() const { return size_; }
  int rank() const { return rank_; }
  int experts() const { return E_; }
  int local_experts() const { return E_ / size_; }
  int first_expert() const { return rank_ * local_experts(); }
  comm::Communicator* group() const { return group_; }

  // The exchange of one micro-batch's routing counts and the block layout
  // that follows from them.
  struct Plan {
    std::vector<int64_t> counts;      // [ep][E]: pairs rank s sends to expert e
    std::vector<size_t> send_rows;    // [ep]: rows this rank sends to rank r
    std::vector<size_t> recv_rows;    // [ep]: rows this rank receives from rank s
    int64_t sent = 0, received = 0;   // their sums
    // Rows of this rank's local expert le from source s: counts[s][first + le].
    int64_t rows_of(int s, int le) const;
    int64_t expert_rows(int le) const;  // from every source
    int64_t received_by(int rank) const;  // what rank `rank` receives
    int E = 0, ep = 1, first = 0, local = 0;
  };
  // All-gathers this rank's pairs per expert (E counts) into a Plan.
  Plan plan(const int64_t* my_counts) const;
  // The Plan of an exchange already made (its [ep][E] counts): no communication.
  Plan plan_of(std::vector<int64_t> counts) const;
  // fn(local expert, its first row, its rows) for each local expert with rows
  // in the plan, in the order dispatch() lays them out.
  template <typename Fn>
  static void for_each_expert(const Plan& plan, Fn fn) {
    int64_t first = 0;
    for (int le = 0; le < plan.local; le++) {
      const int64_t n = plan.expert_rows(le);
      if (n > 0) fn(le, first, n);
      first += n;
    }
  }

  // send [plan.sent, width] (rows by expert, then token) → rows [plan.received, width]
  // by (local expert, source, token), through `scratch` (plan.received × width floats).
  void dispatch(const Plan& plan, const float* send, float* rows, float* scratch, int64_t width);
  // rows [plan.received, width] by (local expert, source, token) → back [plan.sent, width]
  // in the senders' order, through `scratch`.
  void combine(const Plan& plan, const float* rows, float* back, float* scratch, int64_t width);

  // Bytes this rank sent to other ranks and seconds spent in the all-to-alls since the last reset.
  uint64_t bytes() const { return bytes_; }
  double seconds() const { return seconds_; }
  void reset_counters() { bytes_ = 0, seconds_ = 0; }

 private:
  void all_to_all(const float* send, const std::vector<size_t>& send_rows, float* recv,
                  const std::vector<size_t>& recv_rows, int64_t width);
  comm::Communicator* group_;
  int E_, size_ = 1, rank_ = 0;
  uint64_t bytes_ = 0;
  double seconds_ = 0;
};

}  // namespace lattice::expert
