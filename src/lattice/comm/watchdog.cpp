#include "lattice/comm/watchdog.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "lattice/core/error.h"

namespace lattice::comm {

namespace {

constexpr int kQueryTag = 1;
constexpr int kReplyTag = 2;
constexpr auto kPollInterval = std::chrono::milliseconds(20);
constexpr int kMaxSlots = 64;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A question from a rank whose wait timed out, and the answer.
struct Query {
  uint64_t group_key;
};
struct Reply {
  int64_t collectives_started;  // on the asked group; -1 if this rank does not know it
  char doing[480];              // "waiting 1.9 s in recv from rank 0 ..." or "not in a communication call ..."
};

struct Slot {
  bool used = false;
  WaitInfo info;
  double start = 0;
};

struct State {
  std::mutex mu;  // guards everything below except the atomics
  std::array<Slot, kMaxSlots> slots;
  // The last wait that finished. Its group pointer stays valid: a group that
  // is destroyed first copies its name to last_group and clears the pointer.
  bool has_last = false;
  WaitInfo last_info;
  std::string last_group;
  double last_end = 0;
  std::vector<WatchedGroup*> groups;

  std::thread thread;
  std::condition_variable cv;
  bool stop = false;
  bool running = false;
  MPI_Comm side = MPI_COMM_NULL;
  int world_rank = 0;

  std::atomic<double> timeout{kDefaultWatchdogTimeoutS};
  std::atomic<int> paused{0};
};

// Never destroyed: WaitScopes and groups may outlive static destruction order.
State& state() {
  static State* s = new State;
  return *s;
}

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; i++) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

std::string rank_list(const std::vector<int>& ranks, size_t max_shown = 16) {
  std::ostringstream s;
  for (size_t i = 0; i < ranks.size() && i < max_shown; i++) s << (i ? "," : "") << ranks[i];
  if (ranks.size() > max_shown) s << ",... (" << ranks.size() << " ranks)";
  return s.str();
}

std::string describe(const WaitInfo& info, const std::string& group_name) {
  std::ostringstream s;
  const char* op = info.label ? info.label : comm_op_name(info.op);
  if (info.batch) {
    s << "batch_isend_irecv of " << info.count << " operations with rank" << (info.n_peers + info.more_peers > 1 ? "s " : " ");
    for (int i = 0; i < info.n_peers; i++) s << (i ? ", " : "") << info.peers[i];
    if (info.more_peers) s << " and " << info.more_peers << " more";
  } else if (info.op == CommOp::Send || info.op == CommOp::Recv) {
    s << op << (info.op == CommOp::Send ? " to rank " : " from rank ") << (info.n_peers ? info.peers[0] : -1)
      << " (tag " << info.tag << ", " << info.count << " " << dtype_name(info.dtype) << ")";
  } else if (info.op == CommOp::Barrier) {
    s << op << " #" << info.seq;
  } else {
    s << op << " #" << info.seq << " (" << info.count << " " << dtype_name(info.dtype);
    if (info.has_reduce) s << ", " << reduce_op_name(info.reduce);
    s << ")";
  }
  s << " on group '" << group_name << "'";
  return s.str();
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

// What this process is doing, for another rank's report. Caller holds st.mu.
std::string doing_locked(State& st, double now) {
  std::string out;
  for (const Slot& slot : st.slots) {
    if (!slot.used) continue;
    if (!out.empty()) out += "; ";
    out += "waiting " + seconds(now - slot.start) + " in " + describe(slot.info, slot.info.group->name());
  }
  if (!out.empty()) return out;
  if (!st.has_last) return "not in a communication call; no communication finished yet";
  const std::string& group = st.last_info.group ? st.last_info.group->name() : st.last_group;
  return "not in a communication call; last finished " + describe(st.last_info, group) + " " +
         seconds(now - st.last_end) + " ago";
}

// Answers every pending question from other ranks. Watchdog thread only.
void serve_queries(State& st) {
  if (st.side == MPI_COMM_NULL) return;
  for (;;) {
    int flag = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, st.side, &flag, &status);
    if (!flag) return;
    Query q{};
    MPI_Recv(&q, sizeof q, MPI_BYTE, status.MPI_SOURCE, kQueryTag, st.side, MPI_STATUS_IGNORE);
    Reply r{};
    r.collectives_started = -1;
    {
      std::lock_guard<std::mutex> lock(st.mu);
      for (WatchedGroup* g : st.groups)
        if (g->key() == q.group_key) r.collectives_started = static_cast<int64_t>(g->collectives_started());
      std::string d = doing_locked(st, now_s());
      std::snprintf(r.doing, sizeof r.doing, "%s", d.c_str());
    }
    // Small enough to go eagerly: completes without the asker's progress.
    MPI_Send(&r, sizeof r, MPI_BYTE, status.MPI_SOURCE, kReplyTag, st.side);
  }
}

// Reports the wait in `slot` (a copy) and aborts the job. Watchdog thread only.
[[noreturn]] void fire(State& st, const Slot& slot, const std::string& group_name,
                       const std::vector<int>& group_world_ranks, uint64_t group_key) {
  const WaitInfo& info = slot.info;
  double timeout = st.timeout.load();
  double waited = now_s() - slot.start;
  bool collective = info.seq > 0;

  std::vector<int> peers;
  if (collective) {
    for (int r : group_world_ranks)
      if (r != st.world_rank) peers.push_back(r);
  } else {
    for (int i = 0; i < info.n_peers; i++)
      if (info.peers[i] != st.world_rank) peers.push_back(info.peers[i]);
  }

  // Ask every peer what it is doing; keep answering others while we wait for
  // the answers (they may be timing out at the same moment).
  std::vector<Reply> replies(peers.size());
  std::vector<bool> answered(peers.size(), false);
  if (st.side != MPI_COMM_NULL && !peers.empty()) {
    Query q{group_key};
    std::vector<MPI_Request> recvs(peers.size()), sends(peers.size());
    for (size_t i = 0; i < peers.size(); i++) {
      MPI_Irecv(&replies[i], sizeof(Reply), MPI_BYTE, peers[i], kReplyTag, st.side, &recvs[i]);
      MPI_Isend(&q, sizeof q, MPI_BYTE, peers[i], kQueryTag, st.side, &sends[i]);
    }
    double grace = std::clamp(timeout * 0.25, 0.5, 5.0);
    double give_up = now_s() + grace;
    size_t pending = peers.size();
    while (pending > 0 && now_s() < give_up) {
      for (size_t i = 0; i < peers.size(); i++) {
        if (answered[i]) continue;
        int flag = 0;
        MPI_Test(&recvs[i], &flag, MPI_STATUS_IGNORE);
        if (flag) {
          answered[i] = true;
          pending--;
        }
      }
      serve_queries(st);
      if (pending) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  std::ostringstream head;
  std::string prefix = "rank " + std::to_string(st.world_rank) + ": watchdog: ";
  char timeout_text[32];
  std::snprintf(timeout_text, sizeof timeout_text, "%g s", timeout);
  head << prefix << describe(info, group_name) << " (world ranks " << rank_list(group_world_ranks) << ") has waited "
       << seconds(waited) << ", longer than the timeout of " << timeout_text
       << " (set_watchdog_timeout / LATTICE_COMM_TIMEOUT_S)";
  std::ostringstream details;
  if (collective) {
    std::vector<int> arrived{st.world_rank}, missing, silent;
    for (size_t i = 0; i < peers.size(); i++) {
      if (!answered[i] || replies[i].collectives_started < 0)
        silent.push_back(peers[i]);
      else if (replies[i].collectives_started >= static_cast<int64_t>(info.seq))
        arrived.push_back(peers[i]);
      else
        missing.push_back(peers[i]);
    }
    std::sort(arrived.begin(), arrived.end());
    auto list = [](const std::vector<int>& v) {
      std::string s = v.size() == 1 ? "rank " : "ranks ";
      for (size_t i = 0; i < v.size() && i < 32; i++) s += (i ? ", " : "") + std::to_string(v[i]);
      if (v.size() > 32) s += ", ... (" + std::to_string(v.size()) + ")";
      return s;
    };
    head << "; waiting in it: " << list(arrived);
    if (!missing.empty()) head << "; not arrived: " << list(missing);
    if (!silent.empty()) head << "; no answer from: " << list(silent);
    int shown = 0;
    for (size_t i = 0; i < peers.size() && shown < 32; i++) {
      bool is_missing = std::find(missing.begin(), missing.end(), peers[i]) != missing.end();
      if (answered[i] && !is_missing && replies[i].collectives_started >= 0) continue;
      details << prefix << "  rank " << peers[i] << ": ";
      if (!answered[i])
        details << "no answer (the process is gone, or stuck where its watchdog thread cannot run)\n";
      else if (replies[i].collectives_started < 0)
        details << "does not know group '" << group_name << "'; " << replies[i].doing << "\n";
      else
        details << "has started " << replies[i].collectives_started << " collectives on this group; "
                << replies[i].doing << "\n";
      shown++;
    }
  } else {
    for (size_t i = 0; i < peers.size(); i++) {
      details << prefix << "  rank " << peers[i] << ": "
              << (answered[i] ? std::string(replies[i].doing)
                              : std::string("no answer (the process is gone, or stuck where its watchdog "
                                            "thread cannot run)"))
              << "\n";
    }
    if (peers.empty()) details << prefix << "  the peer is this rank itself: nothing can ever match this wait\n";
  }
  head << "; aborting the job\n";
  std::string report = head.str() + details.str();
  std::fputs(report.c_str(), stderr);
  std::fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);
  std::_Exit(kWatchdogExitCode);
}

void watchdog_loop(State& st) {
  std::unique_lock<std::mutex> lock(st.mu);
  while (!st.stop) {
    st.cv.wait_for(lock, kPollInterval);
    if (st.stop) break;
    if (st.paused.load() > 0) continue;
    lock.unlock();
    serve_queries(st);
    lock.lock();
    double now = now_s();
    double timeout = st.timeout.load();
    for (const Slot& slot : st.slots) {
      if (!slot.used || now - slot.start <= timeout) continue;
      Slot copy = slot;
      std::string name = slot.info.group->name();
      std::vector<int> members = slot.info.group->world_ranks();
      uint64_t key = slot.info.group->key();
      lock.unlock();
      fire(st, copy, name, members, key);
    }
  }
}

}  // namespace

// ---- timeout ----

void set_watchdog_timeout(double seconds) {
  LATTICE_CHECK(std::isfinite(seconds) && seconds > 0,
                "watchdog timeout " << seconds << " s is invalid: it must be a positive number of seconds");
  state().timeout.store(seconds);
}

double watchdog_timeout() { return state().timeout.load(); }

void load_watchdog_timeout_from_env() {
  const char* text = std::getenv("LATTICE_COMM_TIMEOUT_S");
  if (!text) return;
  char* end = nullptr;
  double v = std::strtod(text, &end);
  LATTICE_CHECK(end != text && *end == '\0' && std::isfinite(v) && v > 0,
                "LATTICE_COMM_TIMEOUT_S='" << text
                                           << "' is not a positive number of seconds (e.g. LATTICE_COMM_TIMEOUT_S=60)");
  set_watchdog_timeout(v);
}

// ---- groups ----

WatchedGroup::WatchedGroup(std::string name, std::vector<int> world_ranks)
    : name_(std::move(name)), world_ranks_(std::move(world_ranks)) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  // Groups with the same name and members (duplicates) are told apart by how
  // many such groups already exist here, the same count on every member.
  uint64_t ordinal = 0;
  for (WatchedGroup* g : st.groups)
    if (g->name_ == name_ && g->world_ranks_ == world_ranks_) ordinal++;
  uint64_t h = 14695981039346656037ull;
  h = fnv1a(h, name_.data(), name_.size());
  h = fnv1a(h, world_ranks_.data(), world_ranks_.size() * sizeof(int));
  h = fnv1a(h, &ordinal, sizeof ordinal);
  key_ = h;
  st.groups.push_back(this);
}

WatchedGroup::~WatchedGroup() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.groups.erase(std::remove(st.groups.begin(), st.groups.end(), this), st.groups.end());
  if (st.has_last && st.last_info.group == this) {
    st.last_group = name_;
    st.last_info.group = nullptr;
  }
}

// ---- waits ----

WaitScope::WaitScope(const WaitInfo& info) {
  State& st = state();
  double start = now_s();
  std::lock_guard<std::mutex> lock(st.mu);
  for (int i = 0; i < kMaxSlots; i++) {
    if (st.slots[i].used) continue;
    st.slots[i].used = true;
    st.slots[i].info = info;
    st.slots[i].start = start;
    slot_ = i;
    return;
  }
  // More than kMaxSlots threads waiting at once: this wait goes unwatched.
}

WaitScope::~WaitScope() {
  if (slot_ < 0) return;
  State& st = state();
  double end = now_s();
  std::lock_guard<std::mutex> lock(st.mu);
  Slot& slot = st.slots[slot_];
  st.has_last = true;
  st.last_info = slot.info;
  st.last_end = end;
  slot.used = false;
}

std::string describe_wait(const WaitInfo& info) { return describe(info, info.group ? info.group->name() : "?"); }

// ---- thread ----

void start_watchdog() {
  State& st = state();
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.running) return;
  }
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &st.world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1) MPI_Comm_dup(MPI_COMM_WORLD, &st.side);
  std::lock_guard<std::mutex> lock(st.mu);
  st.stop = false;
  st.running = true;
  st.thread = std::thread([&st] { watchdog_loop(st); });
}

void stop_watchdog() {
  State& st = state();
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (!st.running) return;
    st.stop = true;
  }
  st.cv.notify_all();
  st.thread.join();
  std::lock_guard<std::mutex> lock(st.mu);
  st.running = false;
  if (st.side != MPI_COMM_NULL) MPI_Comm_free(&st.side);
}

WatchdogPause::WatchdogPause() { state().paused.fetch_add(1); }
WatchdogPause::~WatchdogPause() { state().paused.fetch_sub(1); }

}  // namespace lattice::comm
