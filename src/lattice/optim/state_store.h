// StateStore: where the optimizer's per-element state lives, so that ZeRO's
// offload can move it without the optimizer knowing.
//
// A store holds `arrays` flat f32 arrays of numel elements each: Adam's first
// and second moments (kM, kV) and, when ZeRO-3 offloads the parameter shard
// too, the parameters (kP). The optimizer never asks for a whole array: it
// asks to visit the state window by window (update_in_windows), which a
// memory store answers with one window over its own buffers and a disk store
// (parallel/zero/disk_store.h) by streaming bounded windows in and out,
// reading ahead and writing behind. A GPU store would do the same between
// device, host and disk.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace lattice::optim {

class StateStore {
 public:
  enum Array { kM = 0, kV = 1, kP = 2 };
  virtual ~StateStore() = default;

  virtual int64_t numel() const = 0;
  virtual int arrays() const = 0;  // 2 (moments) or 3 (moments and parameters)

  // Calls fn(begin, n, window) for consecutive windows covering [0, numel):
  // window[a] points at elements [begin, begin + n) of array a. Whatever fn
  // writes there is kept. Windows are visited in order, one at a time.
  using WindowFn = std::function<void(int64_t begin, int64_t n, float* const* window)>;
  virtual void update_in_windows(const WindowFn& fn) = 0;

  // Random access (checkpoints, ZeRO-3 gathers of an offloaded shard).
  virtual void read(int array, int64_t begin, int64_t n, float* dst) = 0;
  virtual void write(int array, int64_t begin, int64_t n, const float* src) = 0;

  // Memory of the store itself (MemCategory::Optimizer bytes it holds).
  virtual size_t resident_bytes() const = 0;
  // "memory" or "disk: DIR (window 64 MiB, ...)".
  virtual std::string describe() const = 0;

  // Direct pointer to array a when it is resident (memory store), else nullptr.
  virtual float* resident(int array) { (void)array; return nullptr; }
};

// Zero-initialised arrays in memory (moments counted as MemCategory::Optimizer,
// a parameter array as MemCategory::Params).
std::unique_ptr<StateStore> make_memory_store(int64_t numel, int arrays);

}  // namespace lattice::optim
