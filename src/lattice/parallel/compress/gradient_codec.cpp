#include "lattice/parallel/compress/gradient_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "lattice/core/dtype.h"
#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"

namespace lattice::parallel {

GradCodec grad_codec_from_name(const std::string& name) {
  if (name == "none") return GradCodec::None;
  if (name == "bf16") return GradCodec::BF16;
  if (name == "f16") return GradCodec::F16;
  if (name == "int8") return GradCodec::Int8;
  if (name == "onebit") return GradCodec::OneBit;
  if (name == "topk") return GradCodec::TopK;
  if (name == "powersgd") return GradCodec::PowerSgd;
  LATTICE_FAIL("compression.grad=\"" << name
                                     << "\" is not a gradient codec (none, bf16, f16, int8, onebit, topk, powersgd)");
}

const char* grad_codec_name(GradCodec c) {
  switch (c) {
    case GradCodec::None:
      return "none";
    case GradCodec::BF16:
      return "bf16";
    case GradCodec::F16:
      return "f16";
    case GradCodec::Int8:
      return "int8";
    case GradCodec::OneBit:
      return "onebit";
    case GradCodec::TopK:
      return "topk";
    case GradCodec::PowerSgd:
      return "powersgd";
  }
  return "?";
}

namespace {

size_t words(size_t bytes) { return (bytes + 3) / 4 * 4; }
int64_t blocks_of(int64_t n) { return (n + kCodecBlock - 1) / kCodecBlock; }

[[noreturn]] void not_a_block_codec() {
  LATTICE_FAIL("internal: powersgd is not a block codec: it reduces whole matrices (powersgd.h)");
}

// |x| for ranking, NaN first (it must reach the receiver: the step's
// non-finite check then stops training, as it would uncompressed).
float magnitude(float x) { return std::isnan(x) ? std::numeric_limits<float>::infinity() : std::fabs(x); }

// Calls put(i, value) for every value the payload holds (all n, or topk's K).
template <typename Put>
void visit(const CodecSpec& spec, const void* payload, int64_t n, Put put) {
  const uint8_t* p = static_cast<const uint8_t*>(payload);
  switch (spec.codec) {
    case GradCodec::None: {
      const float* v = reinterpret_cast<const float*>(p);
      for (int64_t i = 0; i < n; i++) put(i, v[i]);
      return;
    }
    case GradCodec::BF16:
    case GradCodec::F16: {
      // Widened a block at a time by the vectorised converters (exact).
      const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
      const DType t = spec.codec == GradCodec::BF16 ? DType::BF16 : DType::F16;
      float block[1024];
      for (int64_t b = 0; b < n; b += 1024) {
        const int64_t m = std::min<int64_t>(1024, n - b);
        kernels::load_16bit(t, h + b, block, m);
        for (int64_t i = 0; i < m; i++) put(b + i, block[i]);
      }
      return;
    }
    case GradCodec::Int8: {
      const float* scale = reinterpret_cast<const float*>(p);
      const int8_t* q = reinterpret_cast<const int8_t*>(p + 4 * blocks_of(n));
      for (int64_t i = 0; i < n; i++) put(i, static_cast<float>(q[i]) * scale[i / kCodecBlock]);
      return;
    }
    case GradCodec::OneBit: {
      const float* scale = reinterpret_cast<const float*>(p);
      const uint8_t* bits = p + 4 * blocks_of(n);
      for (int64_t lo = 0; lo < n; lo += kCodecBlock) {  // blocks start on whole bytes (256 = 32 · 8)
        const int64_t hi = std::min(n, lo + kCodecBlock);
        const float s = scale[lo / kCodecBlock];
        for (int64_t j = lo / 8; j * 8 < hi; j++) {
          const unsigned byte = bits[j];  // in a register: put's stores may alias the payload's bytes
          const int64_t end = std::min<int64_t>(8, hi - j * 8);
          for (int64_t k = 0; k < end; k++) put(j * 8 + k, (byte >> k) & 1u ? s : -s);
        }
      }
      return;
    }
    case GradCodec::TopK: {
      const int64_t K = topk_count(spec.topk_ratio, n);
      const uint32_t* index = reinterpret_cast<const uint32_t*>(p);
      const float* value = reinterpret_cast<const float*>(p + 4 * K);
      for (int64_t j = 0; j < K; j++) put(static_cast<int64_t>(index[j]), value[j]);
      return;
    }
    case GradCodec::PowerSgd:
      not_a_block_codec();
  }
}

}  // namespace

int64_t topk_count(double ratio, int64_t n) {
  return std::min(n, std::max<int64_t>(1, std::llround(ratio * static_cast<double>(n))));
}

size_t payload_bytes(const CodecSpec& spec, int64_t n) {
  const size_t N = static_cast<size_t>(n), scales = 4 * static_cast<size_t>(blocks_of(n));
  switch (spec.codec) {
    case GradCodec::None:
      return 4 * N;
    case GradCodec::BF16:
    case GradCodec::F16:
      return words(2 * N);
    case GradCodec::Int8:
      return scales + words(N);
    case GradCodec::OneBit:
      return scales + words((N + 7) / 8);
    case GradCodec::TopK:
      return 8 * static_cast<size_t>(topk_count(spec.topk_ratio, n));
    case GradCodec::PowerSgd:
      not_a_block_codec();
  }
  return 4 * N;
}

void encode(const CodecSpec& spec, const float* x, int64_t n, void* payload, float* decoded) {
  LATTICE_CHECK(n >= 0 && n <= std::numeric_limits<uint32_t>::max(), "gradient codec: " << n << " values in one block");
  uint8_t* p = static_cast<uint8_t*>(payload);
  std::memset(p, 0, payload_bytes(spec, n));
  switch (spec.codec) {
    case GradCodec::None:
      std::memcpy(p, x, 4 * static_cast<size_t>(n));
      break;
    case GradCodec::BF16:
    case GradCodec::F16:
      kernels::store_16bit(spec.codec == GradCodec::BF16 ? DType::BF16 : DType::F16, x,
                           reinterpret_cast<uint16_t*>(p), n);
      break;
    case GradCodec::Int8: {
      float* scale = reinterpret_cast<float*>(p);
      int8_t* q = reinterpret_cast<int8_t*>(p + 4 * blocks_of(n));
      for (int64_t b = 0; b * kCodecBlock < n; b++) {
        const int64_t lo = b * kCodecBlock, hi = std::min(n, lo + kCodecBlock);
        float m = 0;
        for (int64_t i = lo; i < hi; i++) m = std::max(m, magnitude(x[i]));
        const float s = m / 127.0f;
        scale[b] = std::isfinite(m) ? s : std::numeric_limits<float>::quiet_NaN();  // a non-finite block stays so
        if (!(s > 0 && std::isfinite(s))) continue;  // q stays 0
        // q = lrint(x / s) clamped to ±127, as a loop GCC vectorises: adding
        // and subtracting 1.5·2^23 rounds a float of magnitude < 2^22 to the
        // nearest integer, ties to even — lrint's rounding, bit for bit.
        constexpr float kRound = 12582912.0f;
        for (int64_t i = lo; i < hi; i++) {
          const float v = std::clamp(x[i] / s, -127.0f, 127.0f);
          q[i] = static_cast<int8_t>((v + kRound) - kRound);
        }
      }
      break;
    }
    case GradCodec::OneBit: {
      float* scale = reinterpret_cast<float*>(p);
      uint8_t* bits = p + 4 * blocks_of(n);
      for (int64_t b = 0; b * kCodecBlock < n; b++) {
        const int64_t lo = b * kCodecBlock, hi = std::min(n, lo + kCodecBlock);
        double sum = 0;
        for (int64_t i = lo; i < hi; i++) sum += std::fabs(x[i]);
        scale[b] = static_cast<float>(sum / static_cast<double>(hi - lo));
        for (int64_t j = lo / 8; j * 8 < hi; j++) {  // a byte of signs at a time (lo is a multiple of 8)
          uint8_t byte = 0;
          for (int64_t k = 0; k < 8 && j * 8 + k < hi; k++) byte |= static_cast<uint8_t>(!(x[j * 8 + k] < 0)) << k;
          bits[j] = byte;
        }
      }
      break;
    }
    case GradCodec::TopK: {
      const int64_t K = topk_count(spec.topk_ratio, n);
      std::vector<uint32_t> order(static_cast<size_t>(n));
      std::iota(order.begin(), order.end(), 0u);
      auto larger = [x](uint32_t a, uint32_t b) {
        const float ma = magnitude(x[a]), mb = magnitude(x[b]);
        return ma > mb || (ma == mb && a < b);
      };
      std::nth_element(order.begin(), order.begin() + K - 1, order.end(), larger);
      std::sort(order.begin(), order.begin() + K);  // the kept indices in order
      uint32_t* index = reinterpret_cast<uint32_t*>(p);
      float* value = reinterpret_cast<float*>(p + 4 * K);
      for (int64_t j = 0; j < K; j++) index[j] = order[j], value[j] = x[order[j]];
      break;
    }
    case GradCodec::PowerSgd:
      not_a_block_codec();
  }
  if (decoded) decode(spec, payload, n, decoded);
}

void decode(const CodecSpec& spec, const void* payload, int64_t n, float* out) {
  if (spec.codec == GradCodec::TopK) std::memset(out, 0, 4 * static_cast<size_t>(n));
  visit(spec, payload, n, [out](int64_t i, float v) { out[i] = v; });
}

void decode_add(const CodecSpec& spec, const void* payload, int64_t n, float* out) {
  visit(spec, payload, n, [out](int64_t i, float v) { out[i] += v; });
}

}  // namespace lattice::parallel
