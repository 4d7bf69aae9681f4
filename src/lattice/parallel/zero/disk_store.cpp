#include "lattice/parallel/zero/disk_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "lattice/core/error.h"
#include "lattice/core/memory.h"

namespace lattice::parallel {
namespace {

constexpr int64_t kAlignBytes = 4096;                      // O_DIRECT granularity
constexpr int64_t kAlignFloats = kAlignBytes / sizeof(float);
const char* kArrayName[3] = {"m", "v", "p"};

std::string errno_text() { return std::strerror(errno); }

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One file of floats, read and written at float offsets that are multiples
// of kAlignFloats with lengths that are too (the store pads to ensure it).
class StateFile {
 public:
  StateFile(const std::string& path, int64_t floats) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
    if (fd_ >= 0) {
      direct_ = true;
    } else {
      fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    }
    LATTICE_CHECK(fd_ >= 0, "zero.offload_dir: cannot create '" << path << "': " << errno_text());
    LATTICE_CHECK(::ftruncate(fd_, floats * static_cast<int64_t>(sizeof(float))) == 0,
                  "zero.offload_dir: cannot size '" << path << "' to " << floats * 4 << " bytes: " << errno_text());
  }
  ~StateFile() {
    if (fd_ >= 0) ::close(fd_);
    ::unlink(path_.c_str());
  }
  void pread_all(float* dst, int64_t first, int64_t n) const {
    char* p = reinterpret_cast<char*>(dst);
    int64_t off = first * 4, left = n * 4;
    while (left > 0) {
      const ssize_t got = ::pread(fd_, p, static_cast<size_t>(left), off);
      LATTICE_CHECK(got > 0, "offload: reading '" << path_ << "' at byte " << off << ": "
                                                  << (got == 0 ? "unexpected end of file" : errno_text()));
      p += got, off += got, left -= got;
    }
  }
  void pwrite_all(const float* src, int64_t first, int64_t n) const {
    const char* p = reinterpret_cast<const char*>(src);
    int64_t off = first * 4, left = n * 4;
    while (left > 0) {
      const ssize_t put = ::pwrite(fd_, p, static_cast<size_t>(left), off);
      LATTICE_CHECK(put > 0, "offload: writing '" << path_ << "' at byte " << off << ": " << errno_text());
      p += put, off += put, left -= put;
    }
  }
  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
};

// Runs I/O requests in order on one thread; wait(t) blocks until request t is done.
class IoThread {
 public:
  IoThread() : worker_([this] { run(); }) {}
  ~IoThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  uint64_t post(std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mutex_);
    LATTICE_CHECK(!error_, "offload I/O failed earlier");
    queue_.push_back(std::move(fn));
    cv_.notify_all();
    return ++posted_;
  }
  void wait(uint64_t t) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return done_ >= t || error_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr e;
      try {
        fn();
      } catch (...) {
        e = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (e && !error_) error_ = e;
        done_++;
      }
      cv_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t posted_ = 0, done_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread worker_;
};

class DiskStore final : public optim::StateStore {
 public:
  DiskStore(const std::string& dir, int rank, int64_t numel, int arrays, double window_bytes, const std::string& tag)
      : numel_(numel), arrays_(arrays), dir_(dir) {
    LATTICE_CHECK(arrays == 2 || arrays == 3, "disk store: 2 or 3 arrays, got " << arrays);
    padded_ = round_up(std::max<int64_t>(numel, 1), kAlignFloats);
    // Three rotating buffers per array within the window budget.
    window_ = std::max<int64_t>(kAlignFloats,
                                static_cast<int64_t>(window_bytes / (3.0 * arrays * sizeof(float))) / kAlignFloats *
                                    kAlignFloats);
    window_ = std::min(window_, padded_);
    for (int a = 0; a < arrays; a++) {
      files_.push_back(std::make_unique<StateFile>(
          dir + "/lattice-pid" + std::to_string(::getpid()) + "-rank" + std::to_string(rank) +
              (tag.empty() ? "" : "-" + tag) + "-" + kArrayName[a] + ".bin",
          padded_));
      for (int b = 0; b < 3; b++)
        buffers_[b].emplace_back(static_cast<size_t>(window_) * sizeof(float), MemCategory::Optimizer,
                                 static_cast<size_t>(kAlignBytes));
    }
    // The files start as zeros (ftruncate), which is the state's initial value.
  }

  int64_t numel() const override { return numel_; }
  int arrays() const override { return arrays_; }

  void update_in_windows(const WindowFn& fn) override {
    const int64_t windows = (numel_ + window_ - 1) / window_;
    if (windows == 0) return;
    std::vector<uint64_t> read_done(windows, 0);
    auto post_read = [&](int64_t w) {
      const int b = static_cast<int>(w % 3);
      const int64_t first = w * window_, n = io_length(first);
      read_done[w] = io_.post([this, b, first, n] {
        for (int a = 0; a < arrays_; a++) files_[a]->pread_all(buffers_[b][a].as<float>(), first, n);
      });
    };
    post_read(0);
    if (windows > 1) post_read(1);
    uint64_t last_write = 0;
    for (int64_t w = 0; w < windows; w++) {
      io_.wait(read_done[w]);
      const int b = static_cast<int>(w % 3);
      float* window[3] = {};
      for (int a = 0; a < arrays_; a++) window[a] = buffers_[b][a].as<float>();
      const int64_t first = w * window_, n = std::min(window_, numel_ - first);
      fn(first, n, window);
      const int64_t io_n = io_length(first);
      last_write = io_.post([this, b, first, io_n] {
        for (int a = 0; a < arrays_; a++) files_[a]->pwrite_all(buffers_[b][a].as<float>(), first, io_n);
      });
      // Window w+2 reuses buffer (w+2) % 3 = (w-1) % 3, whose write-back was
      // posted before this read: the I/O thread keeps that order.
      if (w + 2 < windows) post_read(w + 2);
    }
    io_.wait(last_write);
  }

  void read(int array, int64_t begin, int64_t n, float* dst) override {
    check(array, begin, n);
    for_aligned(begin, n, [&](int64_t a0, int64_t len, float* bounce, int64_t skip, int64_t take, float* out) {
      files_[array]->pread_all(bounce, a0, len);
      std::memcpy(out, bounce + skip, static_cast<size_t>(take) * sizeof(float));
    }, dst, nullptr);
  }

  void write(int array, int64_t begin, int64_t n, const float* src) override {
    check(array, begin, n);
    for_aligned(begin, n, [&](int64_t a0, int64_t len, float* bounce, int64_t skip, int64_t take, float* in) {
      if (skip != 0 || take != len) files_[array]->pread_all(bounce, a0, len);  // keep the neighbours
      std::memcpy(bounce + skip, in, static_cast<size_t>(take) * sizeof(float));
      files_[array]->pwrite_all(bounce, a0, len);
    }, nullptr, src);
  }

  size_t resident_bytes() const override {
    size_t b = 0;
    for (const auto& set : buffers_)
      for (const Buffer& buf : set) b += buf.bytes();
    return b;
  }

  std::string describe() const override {
    return "disk: " + dir_ + " (" + (files_[0]->direct() ? "O_DIRECT" : "buffered") + ", window " +
           format_bytes(static_cast<double>(window_) * 4) + " x " + std::to_string(arrays_) + " arrays x 3 buffers)";
  }

 private:
  // Length of the I/O for a window starting at `first`: a whole number of
  // alignment blocks (the file is padded to one).
  int64_t io_length(int64_t first) const { return std::min(window_, padded_ - first); }

  void check(int array, int64_t begin, int64_t n) const {
    LATTICE_CHECK(array >= 0 && array < arrays_ && begin >= 0 && n >= 0 && begin + n <= numel_,
                  "offloaded state: access to array " << array << " [" << begin << ", " << begin + n
                                                      << ") outside " << numel_ << " elements");
  }

  // Walks [begin, begin + n) in aligned pieces of at most one window through
  // a bounce buffer (a window buffer: random access never runs during an update).
  template <typename Fn>
  void for_aligned(int64_t begin, int64_t n, Fn fn, float* out, const float* in) {
    float* bounce = buffers_[0][0].as<float>();
    int64_t pos = begin;
    while (pos < begin + n) {
      const int64_t a0 = pos / kAlignFloats * kAlignFloats;
      const int64_t len = std::min(window_, padded_ - a0);
      const int64_t skip = pos - a0;
      const int64_t take = std::min(len - skip, begin + n - pos);
      fn(a0, len, bounce, skip, take, out ? out + (pos - begin) : const_cast<float*>(in + (pos - begin)));
      pos += take;
    }
  }

  int64_t numel_, padded_ = 0, window_ = 0;
  int arrays_;
  std::string dir_;
  std::vector<std::unique_ptr<StateFile>> files_;
  std::vector<Buffer> buffers_[3];  // [buffer][array]
  IoThread io_;
};

}  // namespace

void check_offload_dir(const std::string& dir) {
  struct stat st;
  LATTICE_CHECK(!dir.empty(), "zero.offload=disk needs zero.offload_dir");
  LATTICE_CHECK(::stat(dir.c_str(), &st) == 0,
                "zero.offload_dir='" << dir << "' does not exist (create it; lattice writes one file per array there)");
  LATTICE_CHECK(S_ISDIR(st.st_mode), "zero.offload_dir='" << dir << "' is not a directory");
  const std::string probe = dir + "/.lattice-offload-probe-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  LATTICE_CHECK(fd >= 0, "zero.offload_dir='" << dir << "' is not writable: " << errno_text());
  const bool wrote = ::write(fd, "x", 1) == 1;
  ::close(fd);
  ::unlink(probe.c_str());
  LATTICE_CHECK(wrote, "zero.offload_dir='" << dir << "' is not writable: " << errno_text());
}

std::unique_ptr<optim::StateStore> make_disk_store(const std::string& dir, int rank, int64_t numel, int arrays,
                                                   double window_bytes, const std::string& tag) {
  check_offload_dir(dir);
  return std::make_unique<DiskStore>(dir, rank, numel, arrays, window_bytes, tag);
}

}  // namespace lattice::parallel
