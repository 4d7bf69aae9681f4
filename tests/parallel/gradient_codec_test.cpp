// The gradient codecs (parallel/compress/gradient_codec.h) against f32: the
// payload sizes of their formulas, each codec's error bound, what topk keeps,
// non-finite values passing through, and error feedback's bookkeeping.
#include "lattice/parallel/compress/gradient_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "../io/test_util.h"

using namespace lattice;
using namespace lattice::parallel;

namespace {

std::vector<float> normal(int64_t n, unsigned seed, float scale = 1e-3f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

CodecSpec spec(GradCodec c, double ratio = 0.01) { return CodecSpec{c, ratio}; }

std::vector<float> round_trip(const CodecSpec& s, const std::vector<float>& x, std::vector<float>* decoded = nullptr) {
  std::vector<uint8_t> payload(payload_bytes(s, static_cast<int64_t>(x.size())));
  std::vector<float> enc_decoded(x.size()), out(x.size());
  encode(s, x.data(), static_cast<int64_t>(x.size()), payload.data(), enc_decoded.data());
  decode(s, payload.data(), static_cast<int64_t>(x.size()), out.data());
  if (decoded) *decoded = enc_decoded;
  return out;
}

TEST(GradientCodec, PayloadSizesAreTheFormulas) {
  const int64_t k = 4096;  // 16 blocks of 256
  EXPECT_EQ(payload_bytes(spec(GradCodec::None), k), 4u * k);
  EXPECT_EQ(payload_bytes(spec(GradCodec::BF16), k), 2u * k);
  EXPECT_EQ(payload_bytes(spec(GradCodec::F16), k), 2u * k);
  EXPECT_EQ(payload_bytes(spec(GradCodec::Int8), k), k + 4u * 16);
  EXPECT_EQ(payload_bytes(spec(GradCodec::OneBit), k), k / 8 + 4u * 16);
  EXPECT_EQ(payload_bytes(spec(GradCodec::TopK, 0.01), k), 8u * 41);  // round(40.96) = 41 pairs
  // Shares of f32, as the byte targets count them.
  EXPECT_LE(payload_bytes(spec(GradCodec::Int8), k) / (4.0 * k), 0.27);
  EXPECT_LE(payload_bytes(spec(GradCodec::OneBit), k) / (4.0 * k), 0.04);
  EXPECT_LE(payload_bytes(spec(GradCodec::TopK, 0.01), k) / (4.0 * k), 0.025);
  // Odd sizes round up to whole words and blocks.
  EXPECT_EQ(payload_bytes(spec(GradCodec::BF16), 3), 8u);
  EXPECT_EQ(payload_bytes(spec(GradCodec::Int8), 257), 4u * 2 + 260);
  EXPECT_EQ(payload_bytes(spec(GradCodec::OneBit), 257), 4u * 2 + 36);
  EXPECT_EQ(topk_count(0.01, 10), 1);  // at least one
  EXPECT_EQ(topk_count(1.0, 10), 10);
  EXPECT_ERROR_CONTAINS(grad_codec_from_name("int4"), "compression.grad=\"int4\" is not a gradient codec");
}

TEST(GradientCodec, SixteenBitFloatsRoundToNearest) {
  const std::vector<float> x = normal(1000, 1, 1.0f);
  for (GradCodec c : {GradCodec::BF16, GradCodec::F16}) {
    const double rel = c == GradCodec::BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    const std::vector<float> y = round_trip(spec(c), x);
    for (size_t i = 0; i < x.size(); i++) {
      if (c == GradCodec::F16 && std::fabs(x[i]) < 6.2e-5f) continue;  // f16 subnormals: absolute steps
      EXPECT_LE(std::fabs(y[i] - x[i]), rel * std::fabs(x[i])) << grad_codec_name(c) << " " << x[i];
    }
  }
}

TEST(GradientCodec, Int8IsWithinHalfAStepOfItsBlockScale) {
  std::vector<float> x = normal(1000, 2);  // 4 blocks, the last partial
  x[300] = 0.5f;                           // one large value: block 1's scale is large, the others' are not
  const std::vector<float> y = round_trip(spec(GradCodec::Int8), x);
  for (int64_t b = 0; b * kCodecBlock < 1000; b++) {
    const int64_t lo = b * kCodecBlock, hi = std::min<int64_t>(1000, lo + kCodecBlock);
    float m = 0;
    for (int64_t i = lo; i < hi; i++) m = std::max(m, std::fabs(x[i]));
    const float step = m / 127.0f;
    for (int64_t i = lo; i < hi; i++) EXPECT_LE(std::fabs(y[i] - x[i]), 0.5f * step * (1 + 1e-5f)) << i;
  }
  EXPECT_FLOAT_EQ(y[300], 0.5f);  // the block maximum is exact
}

TEST(GradientCodec, OneBitKeepsSignsAndTheBlockMeanMagnitude) {
  const std::vector<float> x = normal(600, 3);
  const std::vector<float> y = round_trip(spec(GradCodec::OneBit), x);
  for (int64_t b = 0; b * kCodecBlock < 600; b++) {
    const int64_t lo = b * kCodecBlock, hi = std::min<int64_t>(600, lo + kCodecBlock);
    double mean = 0;
    for (int64_t i = lo; i < hi; i++) mean += std::fabs(x[i]);
    mean /= static_cast<double>(hi - lo);
    for (int64_t i = lo; i < hi; i++) EXPECT_NEAR(y[i], x[i] < 0 ? -mean : mean, 1e-9) << i;
  }
}

TEST(GradientCodec, TopKKeepsTheLargestMagnitudesExactly) {
  const std::vector<float> x = normal(1000, 4);
  const CodecSpec s = spec(GradCodec::TopK, 0.05);
  const std::vector<float> y = round_trip(s, x);
  std::vector<float> mags(x.size());
  for (size_t i = 0; i < x.size(); i++) mags[i] = std::fabs(x[i]);
  std::sort(mags.begin(), mags.end(), std::greater<float>());
  const float threshold = mags[49];  // 50 kept
  int kept = 0;
  for (size_t i = 0; i < x.size(); i++) {
    if (y[i] != 0) {
      kept++;
      EXPECT_EQ(y[i], x[i]);
      EXPECT_GE(std::fabs(x[i]), threshold);
    } else {
      EXPECT_LE(std::fabs(x[i]), threshold);
    }
  }
  EXPECT_EQ(kept, 50);
}

TEST(GradientCodec, EncodeReportsWhatDecodeGivesAndDecodeAddAdds) {
  const std::vector<float> x = normal(777, 5);
  for (GradCodec c :
       {GradCodec::None, GradCodec::BF16, GradCodec::F16, GradCodec::Int8, GradCodec::OneBit, GradCodec::TopK}) {
    std::vector<float> reported;
    const std::vector<float> y = round_trip(spec(c), x, &reported);
    EXPECT_EQ(reported, y) << grad_codec_name(c);
    std::vector<uint8_t> payload(payload_bytes(spec(c), 777));
    encode(spec(c), x.data(), 777, payload.data(), nullptr);
    std::vector<float> acc(777, 1.0f);
    decode_add(spec(c), payload.data(), 777, acc.data());
    for (size_t i = 0; i < acc.size(); i++) EXPECT_FLOAT_EQ(acc[i], 1.0f + y[i]) << grad_codec_name(c) << " " << i;
  }
}

// A non-finite gradient must reach the receiver (the step's check then stops
// training, as it does uncompressed), not be quantised into a finite value.
TEST(GradientCodec, NonFiniteValuesPassThrough) {
  std::vector<float> x = normal(512, 6);
  x[10] = std::numeric_limits<float>::infinity();
  x[300] = std::numeric_limits<float>::quiet_NaN();
  for (GradCodec c : {GradCodec::BF16, GradCodec::F16, GradCodec::Int8, GradCodec::OneBit, GradCodec::TopK}) {
    const std::vector<float> y = round_trip(spec(c, 0.01), x);
    bool any = false;
    for (float v : y) any = any || !std::isfinite(v);
    EXPECT_TRUE(any) << grad_codec_name(c);
  }
}

// Error feedback's invariant: with e <- (x + e) - decode(encode(x + e)),
// what was sent over T steps plus the last error is the sum of the inputs.
TEST(GradientCodec, ErrorFeedbackSendsEverythingEventually) {
  const int64_t n = 1000;
  for (GradCodec c : {GradCodec::Int8, GradCodec::OneBit, GradCodec::TopK}) {
    const CodecSpec s = spec(c, 0.01);
    std::vector<float> e(n, 0.0f), sent(n, 0.0f), truth(n, 0.0f), decoded(n);
    std::vector<uint8_t> payload(payload_bytes(s, n));
    for (int t = 0; t < 50; t++) {
      std::vector<float> x = normal(n, 100 + t);
      for (int64_t i = 0; i < n; i++) truth[i] += x[i], x[i] += e[i];
      encode(s, x.data(), n, payload.data(), decoded.data());
      for (int64_t i = 0; i < n; i++) e[i] = x[i] - decoded[i], sent[i] += decoded[i];
    }
    double worst = 0, scale = 0;
    for (int64_t i = 0; i < n; i++) {
      worst = std::max(worst, std::fabs(double(sent[i]) + e[i] - truth[i]));
      scale = std::max(scale, std::fabs(double(truth[i])));
    }
    EXPECT_LE(worst, 1e-5 * scale) << grad_codec_name(c);
  }
}

}  // namespace
