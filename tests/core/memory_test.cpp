#include <gtest/gtest.h>

#include <cstdint>

#include "lattice/core/memory.h"
#include "lattice/core/tensor.h"

using namespace lattice;

TEST(Memory, BufferIsAlignedZeroedAndCounted) {
  auto& t = MemoryTracker::instance();
  size_t before = t.current(MemCategory::Grads);
  {
    Buffer b(1000, MemCategory::Grads);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
    EXPECT_EQ(b.bytes(), 1024u);
    for (size_t i = 0; i < 1000; i++) ASSERT_EQ(b.as<uint8_t>()[i], 0);
    EXPECT_EQ(t.current(MemCategory::Grads), before + 1024);
    EXPECT_GE(t.peak(MemCategory::Grads), before + 1024);
    Buffer moved = std::move(b);
    EXPECT_TRUE(b.empty());
    EXPECT_EQ(t.current(MemCategory::Grads), before + 1024);
  }
  EXPECT_EQ(t.current(MemCategory::Grads), before);
}

TEST(Memory, PeakTotalIsPeakOfSum) {
  auto& t = MemoryTracker::instance();
  t.reset_peaks();
  size_t base = t.current_total();
  { Buffer a(4096, MemCategory::Params); }
  { Buffer b(4096, MemCategory::Activations); }
  EXPECT_EQ(t.peak_total(), base + 4096);
  {
    Buffer a(4096, MemCategory::Params);
    Buffer b(4096, MemCategory::Activations);
    EXPECT_EQ(t.peak_total(), base + 8192);
  }
  EXPECT_EQ(format_bytes(1536.0), "1.5 KiB");
}

TEST(Tensor, NumelAndShape) {
  float x[6];
  Tensor v = Tensor::f32(x, {2, 3});
  EXPECT_EQ(v.numel(), 6);
  EXPECT_EQ(v.bytes(), 24u);
  EXPECT_EQ(shape_string(v.shape), "[2, 3]");
  Tensor h(x, DType::BF16, {4});
  EXPECT_THROW(h.f32_data(), Error);
}
