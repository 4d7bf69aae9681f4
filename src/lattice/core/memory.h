// Buffer: owned, 64-byte aligned memory, counted by the MemoryTracker under a
// category. Every long-lived allocation in lattice is a Buffer, so the trainer
// can print current and peak bytes per category and the ZeRO and pipeline
// tests can assert on them.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace lattice {

enum class MemCategory : uint8_t { Params, Grads, Optimizer, Activations, Comm, Workspace, kCount };
const char* mem_category_name(MemCategory c);

// Process-wide byte counters, one per category, plus the total. Thread-safe.
class MemoryTracker {
 public:
  static MemoryTracker& instance();

  void on_alloc(MemCategory c, size_t bytes);
  void on_free(MemCategory c, size_t bytes);

  size_t current(MemCategory c) const;
  size_t peak(MemCategory c) const;
  size_t current_total() const;
  size_t peak_total() const;  // peak of the sum, not the sum of peaks
  // Restarts peak counting from the current values (e.g. after set-up).
  void reset_peaks();
  // "params 474.7 MiB, grads ..., peak total 2.1 GiB"
  std::string summary() const;

 private:
  static constexpr size_t kN = static_cast<size_t>(MemCategory::kCount);
  std::array<std::atomic<size_t>, kN> current_{};
  std::array<std::atomic<size_t>, kN> peak_{};
  std::atomic<size_t> total_{0};
  std::atomic<size_t> total_peak_{0};
};

// "1.5 GiB", "12.0 KiB", "17 B".
std::string format_bytes(double bytes);

class Buffer {
 public:
  Buffer() = default;
  // Allocates `bytes` zero-filled bytes, rounded up to and aligned at
  // `alignment` (a power of two >= 64; 4096 for O_DIRECT I/O).
  Buffer(size_t bytes, MemCategory category, size_t alignment = 64);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() { return data_; }
  const void* data() const { return data_; }
  template <typename T>
  T* as() { return static_cast<T*>(data_); }
  template <typename T>
  const T* as() const { return static_cast<const T*>(data_); }
  size_t bytes() const { return bytes_; }
  bool empty() const { return data_ == nullptr; }
  MemCategory category() const { return category_; }
  // Frees the memory now (the Buffer becomes empty).
  void reset();
  // Makes this buffer at least `bytes` long; contents are not preserved when it grows.
  void ensure(size_t bytes, MemCategory category);

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemCategory category_ = MemCategory::Workspace;
};

}  // namespace lattice
