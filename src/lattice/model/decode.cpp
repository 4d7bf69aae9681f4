// Generation: the logits of the last position (last_logits), and decoding
// with a key/value cache (decode, next_logits). One process, f32.
//
// The cache keeps, per layer and position, the keys after their rotation
// (rotary positions are applied once, at the position a token was decoded
// at) and the values: kv_heads()·hs floats each, so grouped-query attention
// caches n_head/n_kv_head times less than multi-head attention.
#include <algorithm>
#include <cstring>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/model/activations.h"
#include "lattice/model/gpt.h"

namespace lattice::model {

namespace k = lattice::kernels;
using Pass = GroupHooks::Pass;

void GPT::check_one_process(const char* what) const {
  LATTICE_CHECK(whole_model(), what << " runs the whole model, not pipeline stage [" << first_layer_ << ", "
                                    << last_layer_ << "); `lattice generate` loads a checkpoint of any layout whole");
  LATTICE_CHECK(!tp_, what << " runs on one process (tensor parallelism splits the vocabulary and the heads "
                              "over parallel.tp="
                           << tp_size() << " ranks); `lattice generate` loads a checkpoint of any layout whole");
  LATTICE_CHECK(!cp_, what << " runs on one process (context parallelism splits each sequence over parallel.cp "
                              "ranks); `lattice generate` loads a checkpoint of any layout whole");
}

void GPT::check_f32(const char* what) const {
  LATTICE_CHECK(compute_ == DType::F32, what << " runs at f32 compute, not " << dtype_name(compute_)
                                             << " (`lattice generate` loads a checkpoint's f32 master weights)");
}

const float* GPT::last_logits(const int32_t* inputs, int B, int T) {
  check_one_process("last_logits (generation)");
  check_f32("last_logits (generation)");
  Slot& s = inference_slot(B, T);
  forward_body(s, inputs, nullptr);
  const int C = config_.n_embd;
  // Only the last position of each row: lnf rows (b, T-1), stride T·C.
  head().head_forward(s.logits, s.lnf + static_cast<int64_t>(T - 1) * C, B, static_cast<int64_t>(T) * C);
  params_out(head_index(), Pass::Forward);
  return s.logits;
}


// The chunk buffers of decode(), for up to seq_len rows (sizes only when d is null).
static int64_t carve_decode(DecodeState* d, void* base, const ModelConfig& c, const GPT::Dims& z) {
  const int64_t rows = c.seq_len, C = c.n_embd;
  Carver cv(base);
  float* x = cv.take(rows * C);
  LayerActs a;
  a.ln1 = a.ln2 = cv.take(rows * C);
  a.ln1_mean = a.ln2_mean = cv.take(rows);
  a.ln1_rstd = a.ln2_rstd = cv.take(rows);
  a.qkv = cv.take(rows * z.QKV);
  a.atty = cv.take(rows * z.A);
  a.lse = nullptr;  // not needed without a backward
  a.heads_out = nullptr;
  a.res1 = cv.take(rows * C);
  a.fch = cv.take(rows * z.FU);
  a.hid = cv.take(rows * z.F);
  float* logits = cv.take(z.V);
  if (d) d->x = x, d->logits = logits, d->block = a;
  return cv.used();
}

void GPT::decode_reset() {
  if (decode_) decode_->tokens.clear();
}

int GPT::decode_position() const { return decode_ ? static_cast<int>(decode_->tokens.size()) : 0; }

const float* GPT::next_logits(const int32_t* context, int64_t n) {
  LATTICE_CHECK(n >= 1, "next_logits needs a context of at least one token");
  const int64_t start = n - std::min<int64_t>(n, config_.seq_len);
  // Reuse the cache only if it holds a prefix of context[start, n) and there
  // is at least one new token (the last logits are not kept).
  const int64_t cached = decode_position();
  const bool reuse = decode_ && decode_->window_start == start && cached < n - start &&
                     std::equal(decode_->tokens.begin(), decode_->tokens.end(), context + start);
  if (!reuse) decode_reset();
  const int64_t from = start + (reuse ? cached : 0);
  const float* logits = decode(context + from, static_cast<int>(n - from));
  decode_->window_start = start;
  return logits;
}

const float* GPT::decode(const int32_t* tokens, int n) {
  check_one_process("decode (generation)");
  check_f32("decode (generation)");
  const int C = config_.n_embd, L = config_.n_layer, T = config_.seq_len;
  const int64_t KV = static_cast<int64_t>(dims_.NKV) * dims_.hs;
  if (!decode_) {
    decode_ = std::make_unique<DecodeState>();
    decode_->cache = Buffer(sizeof(float) * 2 * static_cast<size_t>(L) * T * KV, MemCategory::Activations);
    decode_->work = Buffer(carve_decode(nullptr, nullptr, config_, dims_), MemCategory::Activations);
    carve_decode(decode_.get(), decode_->work.data(), config_, dims_);
  }
  DecodeState& d = *decode_;
  const int pos = decode_position();
  LATTICE_CHECK(n >= 1, "decode needs at least one token, got " << n);
  LATTICE_CHECK(pos + n <= T, "decode: positions " << pos << ".." << pos + n - 1
                                                   << " do not fit the model's seq_len " << T
                                                   << " (decode_reset() starts over)");
  for (int i = 0; i < n; i++)
    LATTICE_CHECK(tokens[i] >= 0 && tokens[i] < config_.vocab_size,
                  "token id " << tokens[i] << " at position " << i << " is outside the vocabulary [0, "
                              << config_.vocab_size << ")");
  params_in(embedding_index(), Pass::Forward);
  // x = embed[tokens] (+ wpe[pos .. pos + n))
  std::vector<int32_t> positions(static_cast<size_t>(n));
  for (int i = 0; i < n; i++) positions[i] = pos + i;
  tied().lookup(d.x, tokens, 1, n, positions.data());
  if (!tied_head()) params_out(embedding_index(), Pass::Forward);
  const LayerActs& a = d.block;
  const int64_t Q = dims_.A, QKV = dims_.QKV;
  for (int l = 0; l < L; l++) {
    float* keys = d.cache.as<float>() + static_cast<int64_t>(l) * 2 * T * KV;
    float* values = keys + static_cast<int64_t>(T) * KV;
    // The new positions' keys and values join the cache, then attend to all of it.
    params_in(block_index(l), Pass::Forward);
    if (moe_layer(l)) params_in(expert_index(l), Pass::Forward);
    block_forward(l, a, d.x, d.x, 1, n, pos, nullptr, DType::F32, [&] {
      for (int i = 0; i < n; i++) {
        const float* row = a.qkv + static_cast<int64_t>(i) * QKV;
        std::memcpy(keys + static_cast<int64_t>(pos + i) * KV, row + Q, sizeof(float) * KV);
        std::memcpy(values + static_cast<int64_t>(pos + i) * KV, row + Q + KV, sizeof(float) * KV);
      }
      k::attention_decode(a.atty, a.qkv, QKV, keys, values, KV, n, pos, dims_.NH, dims_.NKV, dims_.hs);
    }, moe_layer(l) ? &d.moe : nullptr);
    if (moe_layer(l)) params_out(expert_index(l), Pass::Forward);
    params_out(block_index(l), Pass::Forward);
  }
  // Logits of the last new position only.
  params_in(final_index(), Pass::Forward);
  ParamGroup& f = final_group();
  const float* norm_b = norm_.has_bias() ? f.compute_param(layout_.norm_f + 1) : nullptr;
  norm_.forward(a.ln1, a.ln1_mean, a.ln1_rstd, d.x + static_cast<int64_t>(n - 1) * C, f.compute_param(layout_.norm_f),
                norm_b, 1);
  if (tied_head()) params_out(final_index(), Pass::Forward);
  head().head_forward(d.logits, a.ln1, 1, C);
  params_out(head_index(), Pass::Forward);
  d.tokens.insert(d.tokens.end(), tokens, tokens + n);
  return d.logits;
}

}  // namespace lattice::model
