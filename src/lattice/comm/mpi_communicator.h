// MpiCommunicator: the Communicator on MPI (Open MPI from Debian).
//
// Blocking calls are the blocking MPI calls themselves (MPI_Allreduce, ...),
// so they run Open MPI's tuned algorithms at full speed; the watchdog
// (watchdog.h) watches them from its own thread, which is why lattice needs
// MPI_THREAD_MULTIPLE. Non-blocking calls are the MPI_I* calls; their Work
// waits with MPI_Waitall under the same watchdog.
//
// Type mapping: f32 is MPI_FLOAT. bf16 and f16 travel as MPI_UINT16_T (2
// bytes per element); their reductions use user-defined MPI operations that
// widen each pair to f32, add (or take the max) and round back to nearest even.
// MPI errors are returned, not fatal, and rethrown as lattice::Error naming the
// operation and the group (so run_guarded prints the rank and aborts the job).
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "lattice/comm/communicator.h"
#include "lattice/core/memory.h"
#include "lattice/comm/watchdog.h"

namespace lattice::comm {

// Open MPI 4.1's reduce_scatter_block runs a few times slower than its
// all-reduce of the same size once the blocks pass a few hundred KiB (every
// one of its algorithms: measured in docs/comm.md, "reduce_scatter"), so for
// f32/f64 sums of blocks from this size on lattice runs the bandwidth-optimal
// ring itself (two blocks of scratch, MemCategory::Comm; the planner counts
// them, plan/memory.h).
inline constexpr size_t kRingReduceScatterBytes = 256 * 1024;

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (freed by the destructor). MPI must be
  // initialised (run the program inside run_guarded).
  static std::unique_ptr<MpiCommunicator> adopt(MPI_Comm comm, const std::string& name);
  ~MpiCommunicator() override;

  // The underlying communicator, e.g. for benchmarks against raw MPI calls.
  MPI_Comm mpi_comm() const { return comm_; }

 protected:
  void do_all_reduce(void* data, size_t count, DType dtype, ReduceOp op) override;
  void do_reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op) override;
  void do_reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts, DType dtype,
                           ReduceOp op) override;
  void do_all_gather(const void* send, void* recv, size_t send_count, DType dtype) override;
  void do_all_gather_v(const void* send, void* recv, std::span<const size_t> counts, DType dtype) override;
  void do_broadcast(void* data, size_t count, DType dtype, int root) override;
  void do_all_to_all(const void* send, void* recv, size_t count_per_rank, DType dtype) override;
  void do_all_to_all_v(const void* send, std::span<const size_t> send_counts, void* recv,
                       std::span<const size_t> recv_counts, DType dtype) override;
  void do_barrier() override;
  void do_send(const void* data, size_t count, DType dtype, int peer, int tag) override;
  void do_recv(void* data, size_t count, DType dtype, int peer, int tag) override;
  WorkPtr do_iall_reduce(void* data, size_t count, DType dtype, ReduceOp op) override;
  WorkPtr do_ireduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op) override;
  WorkPtr do_ireduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts, DType dtype,
                               ReduceOp op) override;
  WorkPtr do_iall_gather(const void* send, void* recv, size_t send_count, DType dtype) override;
  WorkPtr do_iall_gather_v(const void* send, void* recv, std::span<const size_t> counts, DType dtype) override;
  WorkPtr do_batch_isend_irecv(std::span<const P2POp> ops) override;
  std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) override;

 private:
  MpiCommunicator(MPI_Comm comm, const std::string& name, int rank, std::vector<int> world_ranks);
  WaitInfo collective(CommOp op, size_t count, DType dtype, const ReduceOp* reduce);
  WaitInfo p2p(CommOp op, size_t count, DType dtype, int peer, int tag) const;
  int to_int(size_t n, const WaitInfo& info) const;
  const void* in_place_block(const void* send, const void* recv, size_t block, DType dtype) const;
  void check(int rc, const WaitInfo& info) const;
  // reduce_scatter as a ring of sendrecv + add (see do_reduce_scatter).
  void ring_reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, const WaitInfo& info);

  MPI_Comm comm_;
  WatchedGroup group_;
  int tag_upper_bound_ = 32767;  // the largest tag callers may use
  int internal_tag_ = 32767;     // above it: the ring's own messages
  Buffer ring_scratch_;          // two blocks (MemCategory::Comm)
};

// The MPI type and reduction that carry `t` (MPI_FLOAT / MPI_SUM for f32; for
// bf16 and f16 MPI_UINT16_T and lattice's widening operations), for code that
// calls MPI directly on lattice data, e.g. `lattice bench comm`'s raw baseline.
MPI_Datatype mpi_wire_type(DType t);
MPI_Op mpi_reduce_op(DType t, ReduceOp op);

// A communicator over every rank: a duplicate of MPI_COMM_WORLD named "world".
std::unique_ptr<MpiCommunicator> make_world_communicator();

}  // namespace lattice::comm
