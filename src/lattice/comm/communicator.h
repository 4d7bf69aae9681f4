// Communicator: one group of ranks and the operations they perform together.
//
// Every parallel dimension (DP, ZeRO, TP, SP, CP, PP, EP) talks through this
// interface; MpiCommunicator (mpi_communicator.h) implements it on Open MPI and
// a later NCCL implementation will sit behind the same calls.
//
// Conventions shared by every call:
//  - Counts are in elements of `dtype`; ranks and peers are ranks *in this
//    group* (0 .. size()-1); world_ranks() translates them.
//  - Blocking calls return when this rank's buffers may be reused. Every rank
//    of the group must call the same collectives in the same order, from one
//    thread at a time per communicator.
//  - Reductions on bf16/f16 keep 2 bytes per element on the wire; the reduction
//    operator widens each pair of operands to f32, combines them in f32 and
//    rounds back to nearest even (as NCCL does). The result is identical on
//    every rank. Callers that want a single rounding over an f32 sum convert
//    to f32 first and reduce f32.
//  - Send and receive buffers of one call must not overlap (all_reduce and
//    broadcast work in place on one buffer; all_gather is in place when
//    `send` points at this rank's own block of `recv`).
//  - A call that waits longer than the watchdog timeout (watchdog.h) aborts
//    the whole job with a message naming the operation, the group and the
//    ranks that did not arrive; it never hangs.
//
// Byte accounting: each call adds to stats() the bytes *this rank sends* under
// the bandwidth-optimal ring algorithm, whatever algorithm the engine picks
// underneath, so tests can compare the volume a parallel layer asks for with
// its formula. With N ranks, S the bytes of the full buffer and c_j the bytes
// of rank j's block (for all_reduce the blocks of an even split of S, the
// first S mod N elements one larger):
//   all_reduce        (S - c_r) + (S - c_{r+1})    = 2(N-1)/N * S when N | count
//   reduce_scatter    S - c_r                       = (N-1)/N * S
//   all_gather        S - c_{r+1}                   = (N-1)/N * S
//   broadcast         S, except the last rank of the chain root, root+1, ...,
//                     root-1, which sends 0
//   all_to_all        the bytes addressed to the other ranks
//   send / recv       S / 0
// (indices mod N). Summed over ranks these are exactly 2(N-1)S, (N-1)S,
// (N-1)S and (N-1)S. A group of one sends nothing.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "lattice/core/dtype.h"

namespace lattice::comm {

enum class ReduceOp : uint8_t { Sum, Max };
const char* reduce_op_name(ReduceOp op);  // "sum", "max"

// The kinds of call a Communicator counts (index into CommStats arrays).
enum class CommOp : uint8_t { AllReduce, ReduceScatter, AllGather, Broadcast, AllToAll, Send, Recv, Barrier };
inline constexpr size_t kCommOpCount = 8;
const char* comm_op_name(CommOp op);  // "all_reduce", ...

// A started non-blocking operation. Its buffers must stay untouched until
// wait() returns or test() has returned true; the communicator that started it
// must outlive it. Destroying an unfinished Work waits for it.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation is complete. The watchdog timeout counts from
  // the start of wait(), not from the start of the operation.
  virtual void wait() = 0;
  // True once the operation is complete; never blocks. Also drives progress.
  virtual bool test() = 0;
};
using WorkPtr = std::unique_ptr<Work>;

// One element of a batched point-to-point exchange (batch_isend_irecv).
struct P2POp {
  enum class Kind : uint8_t { Send, Recv };
  Kind kind = Kind::Send;
  void* data = nullptr;  // read for Send, written for Recv
  size_t count = 0;
  DType dtype = DType::F32;
  int peer = 0;  // rank in the group
  int tag = 0;   // >= 0; a receive matches a send of the same tag, in order

  static P2POp send(const void* data, size_t count, DType dtype, int peer, int tag = 0) {
    return {Kind::Send, const_cast<void*>(data), count, dtype, peer, tag};
  }
  static P2POp recv(void* data, size_t count, DType dtype, int peer, int tag = 0) {
    return {Kind::Recv, data, count, dtype, peer, tag};
  }
};

// What a communicator has sent so far (see "Byte accounting" above).
struct CommStats {
  uint64_t bytes_sent = 0;
  uint64_t calls = 0;
  std::array<uint64_t, kCommOpCount> bytes_by_op{};
  std::array<uint64_t, kCommOpCount> calls_by_op{};
  uint64_t bytes(CommOp op) const { return bytes_by_op[static_cast<size_t>(op)]; }
  uint64_t calls_of(CommOp op) const { return calls_by_op[static_cast<size_t>(op)]; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(world_ranks_.size()); }
  // "world", "tp", "dp", ... as given at creation; used in messages.
  const std::string& name() const { return name_; }
  // world_ranks()[i] is the MPI_COMM_WORLD rank of group rank i.
  const std::vector<int>& world_ranks() const { return world_ranks_; }

  // ---- collectives (blocking) ----

  // data[i] <- op over all ranks of data[i], in place; the same on every rank.
  void all_reduce(void* data, size_t count, DType dtype, ReduceOp op);
  // send holds size() blocks of recv_count elements; rank j receives in recv
  // the reduction over ranks of block j. In place when send == recv: the
  // buffer holds the size() blocks and this rank's result replaces its
  // first block (MPI's convention).
  void reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op);
  // Variable blocks: send holds sum(recv_counts) elements, block j (of
  // recv_counts[j] elements, consecutive) is reduced into rank j's recv.
  void reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts, DType dtype,
                        ReduceOp op);
  // recv holds size() blocks of send_count elements; block j is rank j's send.
  void all_gather(const void* send, void* recv, size_t send_count, DType dtype);
  // Variable blocks: rank j contributes counts[j] elements; recv holds them
  // all, consecutive in rank order.
  void all_gather_v(const void* send, void* recv, std::span<const size_t> counts, DType dtype);
  // Copies root's data to every rank, in place.
  void broadcast(void* data, size_t count, DType dtype, int root);
  // send and recv hold size() blocks of count_per_rank elements; block j of
  // send goes to rank j, block j of recv comes from rank j.
  void all_to_all(const void* send, void* recv, size_t count_per_rank, DType dtype);
  // Variable blocks: send_counts[j] elements go to rank j (blocks consecutive
  // in send), recv_counts[j] elements come from rank j (consecutive in recv).
  // recv_counts on rank r must equal send_counts[r] of each sender.
  void all_to_all_v(const void* send, std::span<const size_t> send_counts, void* recv,
                    std::span<const size_t> recv_counts, DType dtype);
  void barrier();

  // ---- point to point (blocking) ----
  void send(const void* data, size_t count, DType dtype, int peer, int tag = 0);
  void recv(void* data, size_t count, DType dtype, int peer, int tag = 0);

  // ---- non-blocking forms: same semantics, completion through Work ----
  WorkPtr iall_reduce(void* data, size_t count, DType dtype, ReduceOp op);
  WorkPtr ireduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op);
  WorkPtr ireduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts, DType dtype,
                            ReduceOp op);
  WorkPtr iall_gather(const void* send, void* recv, size_t send_count, DType dtype);
  WorkPtr iall_gather_v(const void* send, void* recv, std::span<const size_t> counts, DType dtype);
  WorkPtr isend(const void* data, size_t count, DType dtype, int peer, int tag = 0);
  WorkPtr irecv(void* data, size_t count, DType dtype, int peer, int tag = 0);
  // Starts every send and receive of `ops` at once (no ordering between them,
  // so exchanges in a ring cannot deadlock); one Work completes them all.
  WorkPtr batch_isend_irecv(std::span<const P2POp> ops);

  // A new communicator over the ranks of this one that pass the same `color`,
  // ordered by `key` (then by rank). Collective over this group. color < 0
  // leaves this rank out (returns nullptr).
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name);

  // ---- byte counters ----
  CommStats stats() const;
  void reset_stats();

 protected:
  Communicator(std::string name, int rank, std::vector<int> world_ranks);

  // Back-end operations. The public methods above validate the arguments and
  // count bytes, then call these; counts are already checked against size().
  virtual void do_all_reduce(void* data, size_t count, DType dtype, ReduceOp op) = 0;
  virtual void do_reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                                   DType dtype, ReduceOp op) = 0;
  virtual void do_reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op) = 0;
  virtual void do_all_gather(const void* send, void* recv, size_t send_count, DType dtype) = 0;
  virtual void do_all_gather_v(const void* send, void* recv, std::span<const size_t> counts, DType dtype) = 0;
  virtual void do_broadcast(void* data, size_t count, DType dtype, int root) = 0;
  virtual void do_all_to_all(const void* send, void* recv, size_t count_per_rank, DType dtype) = 0;
  virtual void do_all_to_all_v(const void* send, std::span<const size_t> send_counts, void* recv,
                               std::span<const size_t> recv_counts, DType dtype) = 0;
  virtual void do_barrier() = 0;
  virtual void do_send(const void* data, size_t count, DType dtype, int peer, int tag) = 0;
  virtual void do_recv(void* data, size_t count, DType dtype, int peer, int tag) = 0;
  virtual WorkPtr do_iall_reduce(void* data, size_t count, DType dtype, ReduceOp op) = 0;
  virtual WorkPtr do_ireduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                     ReduceOp op) = 0;
  virtual WorkPtr do_ireduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                                       DType dtype, ReduceOp op) = 0;
  virtual WorkPtr do_iall_gather(const void* send, void* recv, size_t send_count, DType dtype) = 0;
  virtual WorkPtr do_iall_gather_v(const void* send, void* recv, std::span<const size_t> counts,
                                   DType dtype) = 0;
  virtual WorkPtr do_batch_isend_irecv(std::span<const P2POp> ops) = 0;
  virtual std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) = 0;

 private:
  void count(CommOp op, uint64_t bytes);
  void check_peer(int peer, int tag, const char* what) const;
  void check_counts(std::span<const size_t> counts, const char* what) const;

  std::string name_;
  int rank_;
  std::vector<int> world_ranks_;
  std::array<std::atomic<uint64_t>, kCommOpCount> bytes_by_op_{};
  std::array<std::atomic<uint64_t>, kCommOpCount> calls_by_op_{};
};

}  // namespace lattice::comm
