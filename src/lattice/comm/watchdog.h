// The communication watchdog: no collective or receive waits forever.
//
// Every blocking wait of MpiCommunicator (a blocking call, Work::wait) runs
// inside a WaitScope that records what this thread waits for. A background
// thread, started by run_guarded, checks those records every 20 ms; when one
// has waited longer than the timeout it asks the other ranks of the group what
// they are doing (over a private duplicate of MPI_COMM_WORLD, so it works while
// the main thread sits inside MPI), prints one report on stderr
//
//   rank 0: watchdog: all_reduce #3 (1000 f32, sum) on group 'dp' (world ranks 0,1,2)
//           has waited 2.0 s, longer than the timeout of 2 s (LATTICE_COMM_TIMEOUT_S);
//           waiting in it: ranks 0, 1; not arrived: rank 2; aborting the job
//   rank 0: watchdog:   rank 2: waiting 1.9 s in recv from rank 0 (tag 0, 10 f32) on group 'world'
//
// (one line each) and aborts the whole job with MPI_Abort, exit status
// kWatchdogExitCode. Ranks in watchdog messages are MPI_COMM_WORLD ranks.
// The same thread answers other ranks' questions, so a rank that is busy
// computing is reported as "not in a communication call" rather than silent.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "lattice/comm/communicator.h"

namespace lattice::comm {

// Generous: a pipeline stage can wait for a whole forward of the stages before
// it, and rank 0 may write a checkpoint while the others wait.
inline constexpr double kDefaultWatchdogTimeoutS = 600.0;
// Exit status of a job aborted by the watchdog (exceptions abort with 1).
inline constexpr int kWatchdogExitCode = 3;

// Seconds a single wait may last before the job is aborted; takes effect for
// waits already in progress too. Throws lattice::Error unless > 0.
void set_watchdog_timeout(double seconds);
double watchdog_timeout();
// Applies LATTICE_COMM_TIMEOUT_S if set (run_guarded calls this); throws
// lattice::Error naming the variable when it is not a positive number.
void load_watchdog_timeout_from_env();

// A group of ranks as the watchdog knows it. Each MpiCommunicator owns one;
// it registers itself so other ranks' questions about the group can be
// answered, and numbers the group's collectives (#1, #2, ...) as they start.
class WatchedGroup {
 public:
  WatchedGroup(std::string name, std::vector<int> world_ranks);
  ~WatchedGroup();
  WatchedGroup(const WatchedGroup&) = delete;
  WatchedGroup& operator=(const WatchedGroup&) = delete;

  // Sequence number (from 1) of a collective this rank starts now.
  uint64_t start_collective() { return collectives_started_.fetch_add(1, std::memory_order_relaxed) + 1; }
  uint64_t collectives_started() const { return collectives_started_.load(std::memory_order_relaxed); }
  const std::string& name() const { return name_; }
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  // Equal on every member: derived from name, members and creation order.
  uint64_t key() const { return key_; }

 private:
  std::string name_;
  std::vector<int> world_ranks_;
  uint64_t key_ = 0;
  std::atomic<uint64_t> collectives_started_{0};
};

// What a thread waits for, for the report.
struct WaitInfo {
  static constexpr int kMaxPeers = 8;
  const WatchedGroup* group = nullptr;
  CommOp op = CommOp::Barrier;
  const char* label = nullptr;  // replaces comm_op_name(op) in messages, e.g. "split"
  bool batch = false;          // batch_isend_irecv: op is Send or Recv of the first element
  size_t count = 0;            // elements (of this rank's part)
  DType dtype = DType::F32;
  bool has_reduce = false;
  ReduceOp reduce = ReduceOp::Sum;
  uint64_t seq = 0;            // collective number on the group; 0 for point to point
  int tag = 0;
  int n_peers = 0;             // point to point: world ranks waited on
  int peers[kMaxPeers] = {};
  int more_peers = 0;          // peers beyond kMaxPeers
};

// Marks the calling thread as waiting in `info` for the scope's lifetime; the
// timeout counts from construction. `info.group` must outlive the scope.
class WaitScope {
 public:
  explicit WaitScope(const WaitInfo& info);
  ~WaitScope();
  WaitScope(const WaitScope&) = delete;
  WaitScope& operator=(const WaitScope&) = delete;

 private:
  int slot_ = -1;
};

// Starts the background thread; after MPI_Init, on every rank (collective:
// duplicates MPI_COMM_WORLD for the side channel). run_guarded calls it.
void start_watchdog();
// Stops it; before MPI_Finalize, on every rank.
void stop_watchdog();

// While alive, the watchdog thread neither checks deadlines nor calls MPI.
// For benchmarks that time raw MPI calls against ours in the same process.
class WatchdogPause {
 public:
  WatchdogPause();
  ~WatchdogPause();
  WatchdogPause(const WatchdogPause&) = delete;
  WatchdogPause& operator=(const WatchdogPause&) = delete;
};

// "all_reduce #3 (1000 f32, sum) on group 'dp'"; also used in MPI error messages.
std::string describe_wait(const WaitInfo& info);

}  // namespace lattice::comm
