#include "lattice/core/memory.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "lattice/core/error.h"

namespace lattice {

const char* mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::Params: return "params";
    case MemCategory::Grads: return "grads";
    case MemCategory::Optimizer: return "optimizer";
    case MemCategory::Activations: return "activations";
    case MemCategory::Comm: return "comm";
    case MemCategory::Workspace: return "workspace";
    case MemCategory::kCount: break;
  }
  return "?";
}

MemoryTracker& MemoryTracker::instance() {
  static MemoryTracker tracker;
  return tracker;
}

static void raise_max(std::atomic<size_t>& peak, size_t value) {
  size_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

void MemoryTracker::on_alloc(MemCategory c, size_t bytes) {
  size_t i = static_cast<size_t>(c);
  raise_max(peak_[i], current_[i].fetch_add(bytes) + bytes);
  raise_max(total_peak_, total_.fetch_add(bytes) + bytes);
}

void MemoryTracker::on_free(MemCategory c, size_t bytes) {
  current_[static_cast<size_t>(c)].fetch_sub(bytes);
  total_.fetch_sub(bytes);
}

size_t MemoryTracker::current(MemCategory c) const { return current_[static_cast<size_t>(c)].load(); }
size_t MemoryTracker::peak(MemCategory c) const { return peak_[static_cast<size_t>(c)].load(); }
size_t MemoryTracker::current_total() const { return total_.load(); }
size_t MemoryTracker::peak_total() const { return total_peak_.load(); }

void MemoryTracker::reset_peaks() {
  for (size_t i = 0; i < kN; i++) peak_[i].store(current_[i].load());
  total_peak_.store(total_.load());
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    u++;
  }
  char buf[32];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%.0f %s", bytes, units[u]);
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", bytes, units[u]);
  return buf;
}

std::string MemoryTracker::summary() const {
  std::string s;
  for (size_t i = 0; i < kN; i++) {
    if (peak_[i].load() == 0) continue;
    if (!s.empty()) s += ", ";
    s += std::string(mem_category_name(static_cast<MemCategory>(i))) + " " +
         format_bytes(static_cast<double>(peak_[i].load()));
  }
  s += (s.empty() ? "" : ", ") + std::string("peak total ") + format_bytes(static_cast<double>(peak_total()));
  return s;
}

Buffer::Buffer(size_t bytes, MemCategory category, size_t alignment) : category_(category) {
  if (bytes == 0) return;
  LATTICE_CHECK(alignment >= 64 && (alignment & (alignment - 1)) == 0,
                "Buffer alignment must be a power of two >= 64, got " << alignment);
  size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  data_ = std::aligned_alloc(alignment, rounded);
  LATTICE_CHECK(data_ != nullptr, "out of memory allocating " << format_bytes(static_cast<double>(rounded))
                                                              << " for " << mem_category_name(category));
  std::memset(data_, 0, rounded);
  bytes_ = rounded;
  MemoryTracker::instance().on_alloc(category_, bytes_);
}

Buffer::~Buffer() { reset(); }

Buffer::Buffer(Buffer&& other) noexcept
    : data_(other.data_), bytes_(other.bytes_), category_(other.category_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = other.data_;
    bytes_ = other.bytes_;
    category_ = other.category_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void Buffer::reset() {
  if (data_ != nullptr) {
    MemoryTracker::instance().on_free(category_, bytes_);
    std::free(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
}

void Buffer::ensure(size_t bytes, MemCategory category) {
  if (bytes <= bytes_ && category == category_) return;
  *this = Buffer(bytes, category);
}

}  // namespace lattice
