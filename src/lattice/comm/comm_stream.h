// CommStream: the collectives of one communicator, run in the order they are
// posted, off the compute thread, so that data parallelism's gradient
// reductions (and ZeRO's gathers) overlap the backward pass.
//
// Open MPI's non-blocking collectives make progress only while some thread is
// inside MPI (docs/comm.md: they ran 2-2.5x slower than blocking ones here).
// Three ways to get progress, measured in docs/performance.md ("Overlap"):
//   Thread  a communication thread takes posted operations in order and runs
//           each as a blocking collective: progress is continuous and the
//           compute thread only ever waits for results it needs. (default)
//   Poll    the posting thread starts non-blocking collectives and drives them
//           with test() whenever progress() is called (the model calls it
//           between layers through the hooks).
//   Inline  the blocking collective runs at once, on the posting thread: no
//           overlap; the baseline the other two are measured against.
// LATTICE_DP_PROGRESS=thread|poll|inline picks one (benchmarks).
//
// Every rank of the communicator must post the same operations in the same
// order. While a stream exists, nobody else may use its communicator. An
// operation that fails on the communication thread is rethrown by the next
// wait (or post) on the posting thread.
//
// Timing: for each operation the stream records how long it ran and how long
// the posting thread waited for it; hidden = 1 - waited / ran is the share of
// communication that overlapped computation.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lattice/comm/communicator.h"

namespace lattice::comm {

enum class Progress { Thread, Poll, Inline };

// The label of chunk c of `chunks` of a group's operation, for the event log
// and errors: "grad h.3 0/2".
std::string chunk_label(const char* what, const std::string& group, int64_t c, int64_t chunks);
const char* progress_name(Progress p);  // "thread", "poll", "inline"
// LATTICE_DP_PROGRESS, default Thread; a bad value is an error naming it.
Progress progress_from_env();

class CommStream {
 public:
  using Ticket = uint64_t;  // operations are numbered from 1 in posting order

  CommStream(comm::Communicator& comm, Progress progress);
  ~CommStream();  // waits for every posted operation
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;

  comm::Communicator& comm() { return comm_; }
  Progress progress() const { return progress_; }

  // The operations (same semantics as Communicator's, sums; buffers must
  // stay valid and untouched until the ticket is done). `label` names the
  // operation in the event log ("grad h.3 0/2"). `then`, if given, runs right
  // after the collective completes — on the communication thread in Thread
  // mode — and counts as part of the operation (e.g. moving a reduced slice
  // into place).
  using Then = std::function<void()>;
  Ticket all_reduce(void* data, size_t count, DType dtype, std::string label, Then then = {});
  Ticket reduce_scatter(const float* send, float* recv, size_t recv_count, std::string label, Then then = {});
  Ticket all_gather(const float* send, float* recv, size_t send_count, std::string label, Then then = {});
  // Any sequence of blocking calls on the communicator (and the computation
  // between them) as one operation, e.g. a compressed all-reduce
  // (gradient_reducer.h). Poll mode cannot start it non-blocking: it waits
  // for the operations before it and runs inline.
  Ticket run(std::string label, std::function<void(comm::Communicator&)> body, Then then = {});

  // Blocks until operation t (and every one before it) is done.
  void wait(Ticket t);
  void wait_all() { wait(posted_); }
  bool done(Ticket t);  // never blocks; drives progress in Poll mode
  // Poll mode: tests every started operation (lets MPI advance them).
  void progress_point();

  Ticket last_posted() const { return posted_; }

  struct Times {
    double ran_s = 0;     // sum of the operations' durations
    double waited_s = 0;  // time the posting thread spent in wait()
    uint64_t ops = 0;
  };
  // Since the last reset_times().
  Times times() const;
  void reset_times();

  // Event log, for tests of ordering: "post <label>" as each is posted.
  // Off unless enabled (costs a string per operation).
  void record_events(bool on) { record_ = on; }
  std::vector<std::string> take_events();
  // Adds an event from the caller (e.g. "backward h.2"), in posting order.
  void note(const std::string& event);

 private:
  struct Op {
    Ticket ticket = 0;
    std::function<void()> run_blocking;            // Thread, Inline
    std::function<comm::WorkPtr()> start_nonblocking;  // Poll
    Then then;
    comm::WorkPtr work;                             // Poll: started
    double started = 0;
  };
  Ticket post(Op op, const std::string& label);
  void rethrow_if_failed();
  void retire_front();  // Poll: the oldest started operation is complete
  static double now();

  comm::Communicator& comm_;
  const Progress progress_;
  Ticket posted_ = 0;

  // Thread mode: shared with the worker, which holds its own reference, so
  // that a stream destroyed while an exception unwinds can detach a worker
  // blocked in MPI and the queue and flags it reads stay valid. The buffers
  // of the collective it is in do not: an unwinding multi-rank job must end
  // before they are freed, which the Trainer ensures (comm::abort_job before
  // rethrowing); on the normal path ~DataParallel waits for the stream.
  struct Shared {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Op> queue;
    Ticket completed = 0;
    std::exception_ptr error;
    bool stop = false;
    double ran_s = 0;
  };
  std::shared_ptr<Shared> shared_;
  std::thread worker_;
  static void thread_main(std::shared_ptr<Shared> shared);

  // Poll mode: started, not yet known complete (oldest first).
  std::deque<Op> in_flight_;

  mutable std::mutex times_mutex_;
  Times times_;

  bool record_ = false;
  std::vector<std::string> events_;
};

}  // namespace lattice::comm
