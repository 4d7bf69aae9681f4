#include "lattice/optim/state_store.h"

#include <cstring>
#include <vector>

#include "lattice/core/error.h"
#include "lattice/core/memory.h"

namespace lattice::optim {
namespace {

class MemoryStore final : public StateStore {
 public:
  MemoryStore(int64_t numel, int arrays) : numel_(numel) {
    LATTICE_CHECK(arrays == 2 || arrays == 3, "optimizer state store: 2 or 3 arrays, got " << arrays);
    // Moments are optimizer memory; a parameter shard kept here (ZeRO-3) is parameter memory.
    for (int a = 0; a < arrays; a++)
      buffers_.emplace_back(static_cast<size_t>(numel) * sizeof(float),
                            a == kP ? MemCategory::Params : MemCategory::Optimizer);
  }
  int64_t numel() const override { return numel_; }
  int arrays() const override { return static_cast<int>(buffers_.size()); }
  void update_in_windows(const WindowFn& fn) override {
    float* window[3] = {};
    for (size_t a = 0; a < buffers_.size(); a++) window[a] = buffers_[a].as<float>();
    if (numel_ > 0) fn(0, numel_, window);
  }
  void read(int array, int64_t begin, int64_t n, float* dst) override {
    check(array, begin, n);
    std::memcpy(dst, buffers_[array].as<float>() + begin, static_cast<size_t>(n) * sizeof(float));
  }
  void write(int array, int64_t begin, int64_t n, const float* src) override {
    check(array, begin, n);
    std::memcpy(buffers_[array].as<float>() + begin, src, static_cast<size_t>(n) * sizeof(float));
  }
  size_t resident_bytes() const override {
    size_t b = 0;
    for (const Buffer& buf : buffers_) b += buf.bytes();
    return b;
  }
  std::string describe() const override { return "memory"; }
  float* resident(int array) override { return buffers_[array].as<float>(); }

 private:
  void check(int array, int64_t begin, int64_t n) const {
    LATTICE_CHECK(array >= 0 && array < arrays() && begin >= 0 && n >= 0 && begin + n <= numel_,
                  "optimizer state: access to array " << array << " [" << begin << ", " << begin + n
                                                      << ") outside " << numel_ << " elements");
  }
  int64_t numel_;
  std::vector<Buffer> buffers_;
};

}  // namespace

std::unique_ptr<StateStore> make_memory_store(int64_t numel, int arrays) {
  return std::make_unique<MemoryStore>(numel, arrays);
}

}  // namespace lattice::optim
