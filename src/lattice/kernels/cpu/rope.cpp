// Rotary position embedding in HF's rotate-half convention (Llama). For head
// size hs, i ∈ [0, hs/2) and position p:
//   inv_freq_i = 1/theta^(2i/hs) ; a_pi = p·inv_freq_i
//   y1_i = x1_i·cos a_pi - x2_i·sin a_pi        (x1 = x[0:hs/2], x2 = x[hs/2:hs])
//   y2_i = x2_i·cos a_pi + x1_i·sin a_pi
// i.e. y = x·cos + rotate_half(x)·sin with rotate_half(x) = [-x2, x1]: each
// pair (x1_i, x2_i) is turned by the angle a_pi. A rotation's transpose is its
// inverse, the turn by -a_pi, so the backward is the same loop with -sin:
//   dx1_i = dy1_i·cos + dy2_i·sin ; dx2_i = dy2_i·cos - dy1_i·sin
//
// The table follows transformers' LlamaRotaryEmbedding step by step in f32
// (as does Meta's reference, precompute_freqs_cis): the exponent 2i/hs, the
// power, the reciprocal and the product p·inv_freq each rounded to f32, then
// cos/sin of that f32 angle (here in double, rounded once). A model trained
// with those angles gets them back; the f32 angle itself is off the exact
// p/theta^(2i/hs) by up to ~p·2⁻²⁴ rad (1.2e-4 at p = 2048), which is what
// every f32 RoPE implementation computes.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "lattice/core/error.h"
#include "lattice/kernels/cpu/simd.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

// Below this many rotated elements an OpenMP region costs more than it saves.
constexpr int64_t kSerialBelow = 1 << 15;
constexpr int64_t kRowBlock = 8;  // rows per OpenMP task

// Rows [row_begin, row_end) of x; row r holds position first_position + r mod T.
// kInverse turns by -a (the backward).
template <bool kInverse>
void rotate_rows(float* x, int64_t ld, const RopeTable& table, int64_t row_begin, int64_t row_end, int T,
                 int n_heads, int first_position) {
  const int hs = table.head_size(), half = hs / 2;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t p = first_position + r % T;
    const float* cos_a = table.cos_row(p);
    const float* sin_a = table.sin_row(p);
    float* row = x + r * ld;
    for (int h = 0; h < n_heads; ++h) {
      float* x1 = row + static_cast<int64_t>(h) * hs;
      float* x2 = x1 + half;
      // x1 and x2 are disjoint halves of the head; each i reads and writes only its own pair.
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i], c = cos_a[i], s = sin_a[i];
        if (kInverse) {
          x1[i] = a * c + b * s;
          x2[i] = b * c - a * s;
        } else {
          x1[i] = a * c - b * s;
          x2[i] = b * c + a * s;
        }
      }
    }
  }
}

template <bool kInverse>
void rope_apply(const char* what, float* x, int64_t ld, const RopeTable& table, int B, int T, int n_heads,
                int first_position) {
  LATTICE_CHECK(table.head_size() > 0, what << ": the RopeTable is empty (default-constructed or moved from)");
  LATTICE_CHECK(B >= 0 && T >= 0 && n_heads > 0,
                what << ": need B >= 0, T >= 0 and n_heads > 0, got B=" << B << " T=" << T << " n_heads=" << n_heads);
  const int hs = table.head_size();
  LATTICE_CHECK(ld >= static_cast<int64_t>(n_heads) * hs,
                what << ": row length ld=" << ld << " is shorter than n_heads=" << n_heads << " heads of head_size="
                     << hs);
  LATTICE_CHECK(first_position >= 0 && static_cast<int64_t>(first_position) + T <= table.max_positions(),
                what << ": positions " << first_position << ".." << static_cast<int64_t>(first_position) + T - 1
                     << " are outside the table's 0.." << table.max_positions() - 1
                     << " (build the RopeTable for the longest sequence)");
  const int64_t rows = static_cast<int64_t>(B) * T;
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(static) if (rows * n_heads * hs >= kSerialBelow && !omp_in_parallel())
  for (int64_t blk = 0; blk < blocks; ++blk)
    cpu::simd([&] {
      return rotate_rows<kInverse>(x, ld, table, blk * kRowBlock, std::min(rows, (blk + 1) * kRowBlock), T, n_heads,
                                   first_position);
    });
}

}  // namespace

RopeTable::RopeTable(int head_size, int max_positions, float theta) {
  LATTICE_CHECK(head_size > 0, "rope: head_size=" << head_size << " must be positive");
  LATTICE_CHECK(head_size % 2 == 0, "rope: head_size=" << head_size
                                        << " is odd; rotary position embedding turns element i with element i + "
                                           "head_size/2 (rotate_half), so the head size must be even");
  // Positions are multiplied as f32, exact only below 2^24.
  LATTICE_CHECK(max_positions > 0 && max_positions <= (1 << 24),
                "rope: max_positions=" << max_positions << " must be in 1.." << (1 << 24));
  LATTICE_CHECK(std::isfinite(theta) && theta > 0.0f, "rope: theta=" << theta << " must be a finite number > 0");
  head_size_ = head_size;
  max_positions_ = max_positions;
  theta_ = theta;
  const int half = head_size / 2;
  inv_freq_ = Buffer(sizeof(float) * half, MemCategory::Workspace);
  table_ = Buffer(sizeof(float) * static_cast<size_t>(max_positions) * head_size, MemCategory::Workspace);
  float* inv_freq = inv_freq_.as<float>();
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_size);
    const float power = static_cast<float>(std::pow(static_cast<double>(theta), static_cast<double>(exponent)));
    inv_freq[i] = 1.0f / power;
  }
  float* table = table_.as<float>();
#pragma omp parallel for schedule(static) if (!omp_in_parallel())
  for (int p = 0; p < max_positions; ++p) {
    float* row = table + static_cast<int64_t>(p) * head_size;
    for (int i = 0; i < half; ++i) {
      const double angle = static_cast<float>(p) * inv_freq[i];  // the f32 product, as HF
      row[i] = static_cast<float>(std::cos(angle));
      row[half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

RopeTable& RopeTable::operator=(RopeTable&& o) noexcept {
  head_size_ = std::exchange(o.head_size_, 0);
  max_positions_ = std::exchange(o.max_positions_, 0);
  theta_ = std::exchange(o.theta_, 0.0f);
  table_ = std::move(o.table_);
  inv_freq_ = std::move(o.inv_freq_);
  return *this;
}

void rope_forward(float* x, int64_t ld, const RopeTable& table, int B, int T, int n_heads, int first_position) {
  rope_apply<false>("rope_forward", x, ld, table, B, T, n_heads, first_position);
}

void rope_backward(float* dx, int64_t ld, const RopeTable& table, int B, int T, int n_heads, int first_position) {
  rope_apply<true>("rope_backward", dx, ld, table, B, T, n_heads, first_position);
}

}  // namespace lattice::kernels
