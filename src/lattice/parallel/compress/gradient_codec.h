// Gradient codecs: how data parallelism puts a block of f32 gradient values
// on the wire in fewer bytes (compression.grad). Each one encodes n floats
// into a payload of a size fixed by n alone — so every rank knows every
// other's without asking — and decodes it back approximately:
//
//   bf16, f16  2 bytes a value, rounded to nearest even (core/dtype.h)
//   int8       a scale per block of 256 values (max |x| / 127) and one signed
//              byte each: n + 4⌈n/256⌉ bytes (about 0.266 of f32)
//   onebit     the sign of each value and a scale per block of 256 (the
//              block's mean |x|, as 1-bit SGD/Adam scale it): ⌈n/8⌉ rounded
//              up to 4 bytes, + 4⌈n/256⌉ (about 0.035 of f32)
//   topk       the K = max(1, round(ratio·n)) values largest in magnitude
//              (ties to the lower index), as (u32 index, f32 value) pairs:
//              8K bytes (0.02 of f32 at ratio 0.01)
//
// PowerSGD (compression.grad = "powersgd") is named here with the others but
// is no block codec: it approximates each gradient matrix by a rank-r
// product and needs the matrices' shapes, so it reduces whole buffers of
// known layout (powersgd.h); payload_bytes, encode and decode refuse it.
//
// Payloads are whole 4-byte words (they travel as opaque words: all_to_all
// and all_gather move them without arithmetic). Decoding is deterministic:
// every rank that decodes the same payloads in the same order gets the same
// floats. What a codec drops is the caller's to carry (error feedback,
// gradient_reducer.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace lattice::parallel {

enum class GradCodec { None, BF16, F16, Int8, OneBit, TopK, PowerSgd };

// "none", "bf16", "f16", "int8", "onebit", "topk", "powersgd" (compression.grad); throws naming the valid ones.
GradCodec grad_codec_from_name(const std::string& name);
const char* grad_codec_name(GradCodec c);

struct CodecSpec {
  GradCodec codec = GradCodec::None;
  double topk_ratio = 0.01;   // topk: the fraction of values kept
  int64_t powersgd_rank = 4;  // powersgd: the rank r of each matrix's approximation
};

constexpr int64_t kCodecBlock = 256;  // values per scale (int8, onebit)

// Payload bytes for n values (a multiple of 4); 4n for None.
size_t payload_bytes(const CodecSpec& spec, int64_t n);
// Values topk keeps of n.
int64_t topk_count(double ratio, int64_t n);
// Encodes x[0, n) into `payload` (payload_bytes); `decoded`, if not null,
// receives exactly what decode() will give back (for error feedback).
void encode(const CodecSpec& spec, const float* x, int64_t n, void* payload, float* decoded);
// out[0, n) = the decoded values; decode_add adds them into out instead.
void decode(const CodecSpec& spec, const void* payload, int64_t n, float* out);
void decode_add(const CodecSpec& spec, const void* payload, int64_t n, float* out);

}  // namespace lattice::parallel
