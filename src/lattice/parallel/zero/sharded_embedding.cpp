#include "lattice/parallel/zero/sharded_embedding.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "lattice/core/error.h"
#include "lattice/layers/context/context_parallel.h"
#include "lattice/kernels/ops.h"

namespace lattice::parallel {

namespace k = lattice::kernels;

namespace {
constexpr size_t kWte = 0, kWpe = 1;  // parameter order of the embedding group
}

ShardedEmbedding::ShardedEmbedding(model::ParamGroup& group, const model::ModelConfig& config,
                                   const GroupShard& shard, comm::CommStream& stream, GradientReducer& reducer,
                                   int64_t key_group, const float* params, Gradients gradients, float* grad_shard)
    : group_(group),
      C_(config.n_embd),
      Vp_(static_cast<int>(group.params()[kWte].shape[0])),  // this rank's rows (tensor parallelism: a range)
      shard_(shard),
      stream_(stream),
      reducer_(reducer),
      key_group_(key_group),
      params_(params),
      gradients_(gradients),
      grad_shard_(grad_shard) {
  // Without learned positions (rotary) the group is the token table alone:
  // wpe_row_ is then -1 and every wpe term below is skipped.
  has_wpe_ = group.params().size() > kWpe;
  const int64_t wpe_offset = has_wpe_ ? group.params()[kWpe].offset : 0;
  LATTICE_CHECK(group.params()[kWte].offset == 0 && wpe_offset % C_ == 0 && shard.chunk_numel() % C_ == 0,
                "internal: the embedding group is not laid out in rows of n_embd=" << C_);
  wpe_row_ = has_wpe_ ? wpe_offset / C_ : -1;
  const size_t chunk_bytes = static_cast<size_t>(shard.chunk_numel()) * sizeof(float);
  // Two pieces (one in use, the next chunk's collective in flight), or one
  // when the group is a single chunk.
  const size_t pieces = shard.chunks > 1 ? 2 : 1;
  if (params_) pieces_ = Buffer(pieces * chunk_bytes, MemCategory::Params);
  if (gradients_ == Gradients::Sharded) grad_pieces_ = Buffer(pieces * chunk_bytes, MemCategory::Grads);
  // PowerSGD: chunk c's wte rows one matrix, its wpe rows another (wpe is
  // whole on every tensor-parallel rank and must stay identical there: its
  // approximation may not depend on this rank's wte slice); padding rows
  // are neither sent nor written.
  if (reducer.options().spec.codec == GradCodec::PowerSgd) {
    const int64_t rows = shard.chunk_numel() / C_;
    const int64_t wpe_begin = has_wpe_ ? wpe_row_ : 0, wpe_end = has_wpe_ ? wpe_row_ + group.params()[kWpe].shape[0] : 0;
    for (int64_t c = 0; c < shard.chunks; c++) {
      const int64_t lo = c * rows, hi = lo + rows;
      const std::pair<int64_t, int64_t> wte_rows{std::min<int64_t>(lo, Vp_), std::min<int64_t>(hi, Vp_)};
      const std::pair<int64_t, int64_t> wpe_rows{std::clamp(lo, wpe_begin, wpe_end), std::clamp(hi, wpe_begin, wpe_end)};
      lowrank_.push_back(
          lowrank_rows({{wte_rows.first - lo, wte_rows.second - lo}, {wpe_rows.first - lo, wpe_rows.second - lo}}, C_,
                       reducer.options().spec.powersgd_rank));
    }
  }
}

size_t ShardedEmbedding::param_buffer_bytes() const { return pieces_.bytes(); }
size_t ShardedEmbedding::grad_buffer_bytes() const { return grad_pieces_.bytes(); }

void ShardedEmbedding::wte_rows(int64_t c, int64_t* first, int64_t* last) const {
  const int64_t rows = shard_.chunk_numel() / C_;
  *first = std::min<int64_t>(c * rows, Vp_);
  *last = std::min<int64_t>((c + 1) * rows, Vp_);
}

comm::CommStream::Ticket ShardedEmbedding::gather_chunk(int64_t c) {
  float* piece = pieces_.as<float>() + (c % 2) * shard_.chunk_numel();
  return stream_.all_gather(params_ + c * shard_.slice, piece, shard_.slice,
                            "gather embedding " + std::to_string(c) + "/" + std::to_string(shard_.chunks));
}

// Chunks that hold wte rows come first; only they take part in the head.
static int64_t head_chunks(const GroupShard& s, int64_t C, int64_t Vp) {
  const int64_t rows = s.chunk_numel() / C;
  return std::min(s.chunks, (Vp + rows - 1) / rows);
}

void ShardedEmbedding::for_each_gathered_chunk(
    const std::function<void(const float* piece, int64_t first, int64_t last, int64_t c)>& fn) {
  const int64_t chunks = head_chunks(shard_, C_, Vp_);
  comm::CommStream::Ticket next = gather_chunk(0);
  for (int64_t c = 0; c < chunks; c++) {
    stream_.wait(next);
    // The buffer of chunk c+1 held chunk c-1, whose product is done.
    if (c + 1 < chunks) next = gather_chunk(c + 1);
    int64_t first, last;
    wte_rows(c, &first, &last);
    float* piece = pieces_.as<float>() + (c % 2) * shard_.chunk_numel();
    k::round_to(group_.compute_dtype(), piece, shard_.chunk_numel());  // mixed precision: the compute copy
    fn(piece, first, last, c);
  }
}

void ShardedEmbedding::head_forward(float* logits, const float* lnf, int64_t rows, int64_t ld) {
  if (!params_) {  // stage 2: the table is whole here
    k::gemm(false, true, rows, Vp_, C_, 1.0f, lnf, ld, group_.compute_param(kWte), C_, 0.0f, logits, Vp_);
    return;
  }
  for_each_gathered_chunk([&](const float* piece, int64_t first, int64_t last, int64_t) {
    // logits[:, first:last] = lnf · wte[first:last]ᵀ
    k::gemm(false, true, rows, last - first, C_, 1.0f, lnf, ld, piece, C_, 0.0f, logits + first, Vp_);
  });
}

void ShardedEmbedding::head_backward_input(float* dlnf, const float* dlogits, int64_t N) {
  if (!params_) {
    k::linear_backward_input(dlnf, dlogits, group_.compute_param(kWte), N, C_, Vp_, false);
    return;
  }
  for_each_gathered_chunk([&](const float* piece, int64_t first, int64_t last, int64_t c) {
    // dlnf (+)= dlogits[:, first:last] · wte[first:last]
    k::gemm(false, false, N, C_, last - first, 1.0f, dlogits + first, Vp_, piece, C_, c == 0 ? 0.0f : 1.0f, dlnf,
            C_);
  });
}

void ShardedEmbedding::head_weight_into_group(const float* dlogits, const float* lnf, int64_t N) {
  bool acc = false;
  float* dwte = group_.write_grad(kWte, &acc);
  k::linear_backward_weight(dwte, nullptr, dlogits, lnf, N, C_, Vp_, acc);
  if (!last_) return;
  // The last micro-batch: every gradient in the group's buffer but the
  // lookup's last share is there (wpe's, if nothing wrote it yet this step,
  // is zero), so its chunks are reduced now, during the rest of the backward.
  if (has_wpe_) {
    bool wpe_acc = false;
    float* dwpe = group_.write_grad(kWpe, &wpe_acc);
    if (!wpe_acc) std::memset(dwpe, 0, sizeof(float) * group_.params()[kWpe].numel());
  }
  group_.zero_grad_padding();
  float* grad = group_.grad_storage();
  const int64_t chunk = shard_.chunk_numel(), slice = shard_.slice;
  for (int64_t c = 0; c < shard_.chunks; c++) {
    float* data = grad + c * chunk;
    const std::string label = "grad embedding " + std::to_string(c) + "/" + std::to_string(shard_.chunks);
    const int64_t key = GradientReducer::key(key_group_, c);
    if (reducer_.lowrank() && gradients_ == Gradients::AllReduce) {
      last_ticket_ = reducer_.all_reduce_lowrank(key, data, lowrank_[c], 1, slice, label);
    } else if (reducer_.lowrank()) {
      last_ticket_ = reducer_.reduce_scatter_lowrank(key, data, lowrank_[c], 1, slice, grad + shard_.slice_begin(c), 0,
                                                     false, label);
    } else if (gradients_ == Gradients::AllReduce) {
      last_ticket_ = reducer_.all_reduce(key, data, slice, label);
    } else {
      last_ticket_ = reducer_.reduce_scatter(key, data, slice, grad + shard_.slice_begin(c), false, label);
    }
  }
}

void ShardedEmbedding::head_backward_weight(const float* dlogits, const float* lnf, int64_t N) {
  if (gradients_ != Gradients::Sharded) return head_weight_into_group(dlogits, lnf, N);
  // Every chunk of the group is reduce-scattered once per micro-batch (the
  // ones past the vocabulary carry zeros from the head; the lookup adds its
  // share to the shard afterwards), so the first micro-batch of a step
  // overwrites the whole shard.
  const int64_t chunk = shard_.chunk_numel(), k = shard_.slice;
  for (int64_t c = 0; c < shard_.chunks; c++) {
    const int b = static_cast<int>(c % 2);
    stream_.wait(grad_ticket_[b]);  // its previous reduction is done
    float* piece = grad_pieces_.as<float>() + b * chunk;
    int64_t first, last;
    wte_rows(c, &first, &last);
    const int64_t head_rows = last - first;
    // d wte[first:last] = dlogits[:, first:last]ᵀ · lnf
    if (head_rows > 0)
      k::gemm(true, false, head_rows, C_, N, 1.0f, dlogits + first, Vp_, lnf, C_, 0.0f, piece, C_);
    std::memset(piece + head_rows * C_, 0, static_cast<size_t>(chunk - head_rows * C_) * sizeof(float));
    const int64_t key = GradientReducer::key(key_group_, c);
    std::string label = "grad embedding " + std::to_string(c) + "/" + std::to_string(shard_.chunks);
    grad_ticket_[b] = reducer_.lowrank()
                          ? reducer_.reduce_scatter_lowrank(key, piece, lowrank_[c], 1, k, grad_shard_ + c * k, 0,
                                                            written_, std::move(label))
                          : reducer_.reduce_scatter(key, piece, k, grad_shard_ + c * k, written_, std::move(label));
    last_ticket_ = grad_ticket_[b];
  }
  written_ = true;
}

void ShardedEmbedding::add_owned_row(float* out, int64_t row, const float* src) const {
  const int64_t begin = row * C_, end = begin + C_, k = shard_.slice;
  for (int64_t f = begin; f < end;) {
    const int64_t seg_end = std::min(end, f + (k - f % k));  // slices are k-aligned within chunks
    if (shard_.owner(f) == shard_.rank) {
      const float* s = src + shard_.shard_offset(f);
      const DType t = group_.compute_dtype();  // mixed precision: the master rounded, as the compute copy
      for (int64_t i = 0; i < seg_end - f; i++) out[f - begin + i] += round_to_dtype(s[i], t);
    }
    f = seg_end;
  }
}

void ShardedEmbedding::add_to_owned(float* dst, int64_t row, const float* values, bool home) const {
  const int64_t begin = row * C_, end = begin + C_, k = shard_.slice;
  for (int64_t f = begin; f < end;) {
    const int64_t seg_end = std::min(end, f + (k - f % k));
    if (shard_.owner(f) == shard_.rank) {
      float* d = dst + (home ? f : shard_.shard_offset(f));
      for (int64_t i = 0; i < seg_end - f; i++) d[i] += values[f - begin + i];
    }
    f = seg_end;
  }
}

void ShardedEmbedding::exchange_tokens(const int32_t* tokens, int64_t count) {
  const int n = shard_.ranks;
  tokens_all_.ensure(static_cast<size_t>(n * count) * sizeof(float), MemCategory::Comm);
  // Gathered in place: this rank's ids go to its own slot (ids < 2^24 are exact floats).
  float* mine = tokens_all_.as<float>() + static_cast<int64_t>(shard_.rank) * count;
  for (int64_t i = 0; i < count; i++) mine[i] = static_cast<float>(tokens[i]);
  stream_.wait(stream_.all_gather(mine, tokens_all_.as<float>(), static_cast<size_t>(count), "tokens"));
}

int64_t ShardedEmbedding::wpe_row_of(int64_t j, int64_t BT, int T) const {
  const int t = static_cast<int>((j % BT) % T);
  if (cp_ == 1) return wpe_row_ + t;
  return wpe_row_ + context::position_of(cp_, static_cast<int>((j / BT) % cp_), t, T);
}

void ShardedEmbedding::lookup(float* x, const int32_t* tokens, int B, int T, const int32_t* positions) {
  if (!params_) {
    // Every row here is whole: a one-process table under the same call.
    model::embedding_forward_at(x, tokens, group_.compute_param(kWte),
                                positions && has_wpe_ ? group_.compute_param(kWpe) : nullptr, positions, B, T, C_);
    return;
  }
  const int n = shard_.ranks;
  const int64_t BT = static_cast<int64_t>(B) * T;
  exchange_tokens(tokens, BT);
  // Row (q, i): the parts of wte[token] and wpe[position] this rank owns.
  // Each element has its two terms from one or two ranks and zeros from the
  // rest, so the reduce-scatter's sum is exactly wte + wpe, as a lookup.
  rows_.ensure(static_cast<size_t>(n * BT * C_) * sizeof(float), MemCategory::Comm);
  float* rows = rows_.as<float>();
  std::memset(rows, 0, static_cast<size_t>(n * BT * C_) * sizeof(float));
  const float* all = tokens_all_.as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n * BT; j++) {
    float* out = rows + j * C_;
    if (all[j] >= 0) add_owned_row(out, static_cast<int64_t>(all[j]), params_);  // negative: another TP rank's
    if (positions && has_wpe_) add_owned_row(out, wpe_row_of(j, BT, T), params_);
  }
  stream_.wait(stream_.reduce_scatter(rows, x, static_cast<size_t>(BT * C_), "lookup"));
}

const float* ShardedEmbedding::gather_lookup_rows(const float* dx, const int32_t* tokens, int64_t BT) {
  const int n = shard_.ranks;
  exchange_tokens(tokens, BT);
  rows_.ensure(static_cast<size_t>(n * BT * C_) * sizeof(float), MemCategory::Comm);
  stream_.wait(stream_.all_gather(dx, rows_.as<float>(), static_cast<size_t>(BT * C_), "lookup grad"));
  return rows_.as<float>();
}

void ShardedEmbedding::lookup_into_group(const float* dx, const int32_t* tokens, int B, int T,
                                         const int32_t* positions) {
  const int64_t BT = static_cast<int64_t>(B) * T;
  if (!last_) {  // earlier micro-batches: accumulate here, reduced with the rest on the last one
    float* d[2] = {nullptr, nullptr};
    for (size_t p = kWte; p < (has_wpe_ ? kWpe + 1 : kWpe); p++) {
      bool acc = false;
      d[p] = group_.write_grad(p, &acc);
      if (!acc) std::memset(d[p], 0, sizeof(float) * group_.params()[p].numel());
    }
    model::embedding_backward_at(d[kWte], d[kWpe], dx, tokens, positions, B, T, C_);
    return;
  }
  stream_.wait(last_ticket_);  // the group's chunks are reduced
  const float* rows = gather_lookup_rows(dx, tokens, BT);
  const float* all = tokens_all_.as<float>();
  float* grad = group_.grad_storage();
  const int64_t total = shard_.ranks * BT;
  if (gradients_ == Gradients::AllReduce) {
    // Every rank adds every rank's rows, in the same order: the buffers stay
    // identical. By columns, so threads never share an element.
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < C_; c0 += 64) {
      const int64_t c1 = std::min<int64_t>(C_, c0 + 64);
      for (int64_t j = 0; j < total; j++) {
        const float* v = rows + j * C_;
        if (all[j] >= 0) {  // negative: a token another tensor-parallel rank holds
          float* dw = grad + static_cast<int64_t>(all[j]) * C_;
          for (int64_t c = c0; c < c1; c++) dw[c] += v[c];
        }
        if (!has_wpe_) continue;
        float* dp = grad + wpe_row_of(j, BT, T) * C_;
        for (int64_t c = c0; c < c1; c++) dp[c] += v[c];
      }
    }
  } else {
    for (int64_t j = 0; j < total; j++) {
      if (all[j] >= 0) add_to_owned(grad, static_cast<int64_t>(all[j]), rows + j * C_, /*home=*/true);
      if (has_wpe_) add_to_owned(grad, wpe_row_of(j, BT, T), rows + j * C_, /*home=*/true);
    }
  }
}

void ShardedEmbedding::lookup_backward(const float* dx, const int32_t* tokens, int B, int T,
                                       const int32_t* positions) {
  if (gradients_ != Gradients::Sharded) return lookup_into_group(dx, tokens, B, T, positions);
  // After the head's reductions have written (or added to) the shard; a
  // part without the head (a pipeline's first stage) starts it at zero.
  stream_.wait(last_ticket_);
  if (!written_) {
    std::memset(grad_shard_, 0, static_cast<size_t>(shard_.shard_numel()) * sizeof(float));
    written_ = true;
  }
  const int n = shard_.ranks;
  const int64_t BT = static_cast<int64_t>(B) * T;
  const float* rows = gather_lookup_rows(dx, tokens, BT);
  // d wte[token] += dx row ; d wpe[t] += dx row, over every rank's rows in
  // order (rows sharing a token add up; one thread, no races).
  const float* all = tokens_all_.as<float>();
  for (int64_t j = 0; j < n * BT; j++) {
    const float* values = rows + j * C_;
    if (all[j] >= 0) add_to_owned(grad_shard_, static_cast<int64_t>(all[j]), values);
    if (has_wpe_) add_to_owned(grad_shard_, wpe_row_of(j, BT, T), values);
  }
}

void ShardedEmbedding::finish() {
  stream_.wait(last_ticket_);
  stream_.wait(grad_ticket_[0]);
  stream_.wait(grad_ticket_[1]);
}

}  // namespace lattice::parallel
