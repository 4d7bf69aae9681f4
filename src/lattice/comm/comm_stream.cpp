#include "lattice/comm/comm_stream.h"

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "lattice/core/error.h"
#include "lattice/core/threads.h"

namespace lattice::comm {

std::string chunk_label(const char* what, const std::string& group, int64_t c, int64_t chunks) {
  return std::string(what) + " " + group + " " + std::to_string(c) + "/" + std::to_string(chunks);
}

const char* progress_name(Progress p) {
  switch (p) {
    case Progress::Thread: return "thread";
    case Progress::Poll: return "poll";
    case Progress::Inline: return "inline";
  }
  return "?";
}

Progress progress_from_env() {
  const char* env = std::getenv("LATTICE_DP_PROGRESS");
  if (!env || !*env || std::strcmp(env, "thread") == 0) return Progress::Thread;
  if (std::strcmp(env, "poll") == 0) return Progress::Poll;
  if (std::strcmp(env, "inline") == 0) return Progress::Inline;
  LATTICE_FAIL("LATTICE_DP_PROGRESS='" << env << "' is not a progress mode (valid: thread, poll, inline)");
}

double CommStream::now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

CommStream::CommStream(comm::Communicator& comm, Progress progress)
    : comm_(comm), progress_(progress), shared_(std::make_shared<Shared>()) {
  if (progress_ == Progress::Thread) worker_ = std::thread(thread_main, shared_);
}

CommStream::~CommStream() {
  if (progress_ == Progress::Thread) {
    if (std::uncaught_exceptions() > 0) {
      // The job is being torn down by an error: the worker may sit in a
      // collective that will never complete. Leave it; MPI_Abort ends it.
      {
        std::lock_guard<std::mutex> lock(shared_->mutex);
        shared_->stop = true;
        shared_->queue.clear();
      }
      shared_->cv.notify_all();
      worker_.detach();
      return;
    }
    try {
      wait_all();
    } catch (...) {
      // Reported by the wait that saw it first; nothing more to do here.
    }
    {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      shared_->stop = true;
    }
    shared_->cv.notify_all();
    worker_.join();
  } else if (std::uncaught_exceptions() == 0) {
    try {
      wait_all();
    } catch (...) {
    }
  }
}

void CommStream::thread_main(std::shared_ptr<Shared> shared) {
  // What runs here (the codecs' loops) runs on this thread alone: an OpenMP
  // team of its own would take the compute threads' cores.
  set_num_threads(1);
  for (;;) {
    Op op;
    {
      std::unique_lock<std::mutex> lock(shared->mutex);
      shared->cv.wait(lock, [&] { return shared->stop || !shared->queue.empty(); });
      if (shared->queue.empty()) return;  // stop with nothing left
      op = std::move(shared->queue.front());
      shared->queue.pop_front();
    }
    const double t0 = now();
    std::exception_ptr error;
    try {
      op.run_blocking();
      if (op.then) op.then();
    } catch (...) {
      error = std::current_exception();
    }
    const double t1 = now();
    {
      std::lock_guard<std::mutex> lock(shared->mutex);
      shared->ran_s += t1 - t0;
      if (error && !shared->error) shared->error = error;
      shared->completed = op.ticket;
      if (error) shared->stop = true, shared->queue.clear();
    }
    shared->cv.notify_all();
    if (error) return;
  }
}

void CommStream::rethrow_if_failed() {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    e = shared_->error;
  }
  if (e) std::rethrow_exception(e);
}

CommStream::Ticket CommStream::post(Op op, const std::string& label) {
  op.ticket = ++posted_;
  if (record_) events_.push_back("post " + label);
  switch (progress_) {
    case Progress::Thread: {
      rethrow_if_failed();
      {
        std::lock_guard<std::mutex> lock(shared_->mutex);
        shared_->queue.push_back(std::move(op));
      }
      shared_->cv.notify_all();
      break;
    }
    case Progress::Poll:
      if (op.start_nonblocking) {
        op.started = now();
        op.work = op.start_nonblocking();
        in_flight_.push_back(std::move(op));
        break;
      }
      // A composite operation: everything before it first, then inline.
      wait(op.ticket - 1);
      [[fallthrough]];
    case Progress::Inline: {
      const double t0 = now();
      op.run_blocking();
      if (op.then) op.then();
      const double dt = now() - t0;
      std::lock_guard<std::mutex> lock(times_mutex_);
      times_.ran_s += dt;
      times_.waited_s += dt;  // nothing overlapped it
      shared_->completed = op.ticket;
      break;
    }
  }
  std::lock_guard<std::mutex> lock(times_mutex_);
  times_.ops++;
  return posted_;
}

void CommStream::progress_point() {
  if (progress_ != Progress::Poll) return;
  done(posted_);
}

bool CommStream::done(Ticket t) {
  switch (progress_) {
    case Progress::Thread: {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      if (shared_->error) return true;  // the next wait rethrows
      return shared_->completed >= t;
    }
    case Progress::Poll: {
      // Test every started operation (each test lets MPI advance it), and
      // retire the completed prefix.
      for (Op& op : in_flight_) op.work->test();
      while (!in_flight_.empty() && in_flight_.front().work->test()) retire_front();
      return shared_->completed >= t;
    }
    case Progress::Inline: return true;
  }
  return true;
}

void CommStream::retire_front() {
  Op& op = in_flight_.front();
  if (op.then) op.then();
  {
    std::lock_guard<std::mutex> lock(times_mutex_);
    times_.ran_s += now() - op.started;
  }
  shared_->completed = op.ticket;
  in_flight_.pop_front();
}

void CommStream::wait(Ticket t) {
  const double t0 = now();
  switch (progress_) {
    case Progress::Thread: {
      std::unique_lock<std::mutex> lock(shared_->mutex);
      shared_->cv.wait(lock, [&] { return shared_->completed >= t || shared_->error; });
      lock.unlock();
      rethrow_if_failed();
      break;
    }
    case Progress::Poll: {
      while (!in_flight_.empty() && in_flight_.front().ticket <= t) {
        in_flight_.front().work->wait();
        retire_front();
      }
      break;
    }
    case Progress::Inline: return;  // done when posted
  }
  std::lock_guard<std::mutex> lock(times_mutex_);
  times_.waited_s += now() - t0;
}

CommStream::Ticket CommStream::all_reduce(void* data, size_t count, DType dtype, std::string label, Then then) {
  Op op;
  op.run_blocking = [this, data, count, dtype] { comm_.all_reduce(data, count, dtype, comm::ReduceOp::Sum); };
  op.start_nonblocking = [this, data, count, dtype] {
    return comm_.iall_reduce(data, count, dtype, comm::ReduceOp::Sum);
  };
  op.then = std::move(then);
  return post(std::move(op), label);
}

CommStream::Ticket CommStream::reduce_scatter(const float* send, float* recv, size_t recv_count, std::string label,
                                              Then then) {
  Op op;
  op.run_blocking = [this, send, recv, recv_count] {
    comm_.reduce_scatter(send, recv, recv_count, DType::F32, comm::ReduceOp::Sum);
  };
  op.start_nonblocking = [this, send, recv, recv_count] {
    return comm_.ireduce_scatter(send, recv, recv_count, DType::F32, comm::ReduceOp::Sum);
  };
  op.then = std::move(then);
  return post(std::move(op), label);
}

CommStream::Ticket CommStream::all_gather(const float* send, float* recv, size_t send_count, std::string label,
                                          Then then) {
  Op op;
  op.run_blocking = [this, send, recv, send_count] { comm_.all_gather(send, recv, send_count, DType::F32); };
  op.start_nonblocking = [this, send, recv, send_count] {
    return comm_.iall_gather(send, recv, send_count, DType::F32);
  };
  op.then = std::move(then);
  return post(std::move(op), label);
}

CommStream::Ticket CommStream::run(std::string label, std::function<void(comm::Communicator&)> body, Then then) {
  Op op;
  op.run_blocking = [this, body = std::move(body)] { body(comm_); };
  op.then = std::move(then);
  return post(std::move(op), label);
}

CommStream::Times CommStream::times() const {
  std::lock_guard<std::mutex> lock(times_mutex_);
  Times t = times_;
  if (progress_ == Progress::Thread) {
    std::lock_guard<std::mutex> l2(shared_->mutex);
    t.ran_s += shared_->ran_s;
  }
  return t;
}

void CommStream::reset_times() {
  std::lock_guard<std::mutex> lock(times_mutex_);
  times_ = Times{};
  if (progress_ == Progress::Thread) {
    std::lock_guard<std::mutex> l2(shared_->mutex);
    shared_->ran_s = 0;
  }
}

std::vector<std::string> CommStream::take_events() {
  std::vector<std::string> out;
  out.swap(events_);
  return out;
}

void CommStream::note(const std::string& event) {
  if (record_) events_.push_back(event);
}

}  // namespace lattice::comm
