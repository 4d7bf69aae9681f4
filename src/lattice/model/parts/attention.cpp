#include "lattice/model/parts/attention.h"

#include <cstring>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "lattice/layers/context/context_parallel.h"
#include "lattice/layers/tensor/tensor_parallel.h"

namespace lattice::model::parts {

namespace k = lattice::kernels;

const float* Attention::project(float* qkv, const float* ln, float* work, int B, int T, int first_position,
                                DType q) const {
  const int64_t N = static_cast<int64_t>(B) * T;
  const float* whole =
      tensor::ColumnParallelLinear(tp_, s_.C, static_cast<int>(s_.QKV())).forward(qkv, ln, work, qkv_.weight(),
                                                                                  qkv_.bias(), N);
  if (rope_) rotate(qkv, B, T, first_position, false);
  k::round_to(q, qkv, N * s_.QKV());
  return whole;
}

void Attention::rotate(float* x, int B, int T, int first_position, bool backward) const {
  const auto apply = backward ? k::rope_backward : k::rope_forward;
  if (!cp_) return apply(x, s_.QKV(), *rope_, B, T, s_.NH + s_.NKV, first_position);
  // This rank's rows are two chunks of each sequence, each at its own place.
  const int c = T / 2;
  for (int b = 0; b < B; b++)
    for (int h = 0; h < 2; h++)
      apply(x + (static_cast<int64_t>(b) * T + h * c) * s_.QKV(), s_.QKV(), *rope_, 1, c, s_.NH + s_.NKV,
            first_position + cp_->position(h * c, T));
}

void Attention::attend(float* atty, float* lse, float* qkv, float* heads_out, int B, int T, DType q) const {
  if (cp_) {
    cp_->forward(atty, lse, qkv, heads_out, B, T, {s_.NH, s_.NKV, s_.hs});
  } else {
    k::attention_forward(atty, lse, qkv, B, T, s_.NH, s_.NKV, s_.hs);
  }
  k::round_to(q, atty, static_cast<int64_t>(B) * T * s_.A());
}

void Attention::output(float* y, float* partial, const float* atty, int64_t N) const {
  tensor::RowParallelLinear(tp_, static_cast<int>(s_.A()), s_.C).forward(y, partial, atty, out_.weight(),
                                                                         out_.bias(), N);
}

void Attention::backward_input(float* dln, float* dqkv, float* datty, const float* dy_slice, float* dy_whole,
                               const float* qkv, const float* atty, const float* lse, const float* heads_out,
                               int B, int T) const {
  const int64_t N = static_cast<int64_t>(B) * T;
  tensor::RowParallelLinear(tp_, static_cast<int>(s_.A()), s_.C).backward_input(datty, dy_slice, dy_whole,
                                                                                 out_.weight(), N);
  if (cp_) {
    cp_->backward(dqkv, datty, qkv, atty, lse, heads_out, B, T, {s_.NH, s_.NKV, s_.hs});
  } else {
    k::attention_backward(dqkv, datty, qkv, atty, lse, B, T, s_.NH, s_.NKV, s_.hs);
  }
  if (rope_) rotate(dqkv, B, T, 0, true);
  tensor::ColumnParallelLinear(tp_, s_.C, static_cast<int>(s_.QKV())).backward_input(dln, dqkv, qkv_.weight(), N);
}

void Attention::backward_weight(const float* dy_whole, const float* atty, const float* dqkv, const float* ln_whole,
                                int64_t N) const {
  const int C = s_.C;
  const int QKV = static_cast<int>(s_.QKV());
  float *dw, *db;
  bool acc = out_.write_grads(&dw, &db);
  k::linear_backward_weight(dw, db, dy_whole, atty, N, static_cast<int>(s_.A()), C, acc);
  acc = qkv_.write_grads(&dw, &db);
  if (s_.kv_replicas == 1) return k::linear_backward_weight(dw, db, dqkv, ln_whole, N, C, QKV, acc);
  // Each key/value head here is also on kv_replicas - 1 other ranks, each of
  // which backpropagated its own query heads only: this micro-batch's W_k
  // and W_v gradients (and biases) are the sums of those shares. Each rank
  // puts its share in its head's place of a buffer with room for every
  // head; one all-reduce over the group sums the shares of each head.
  const int64_t A = s_.A(), KV = static_cast<int64_t>(s_.NKV) * s_.hs;
  const int64_t rows = QKV, with_bias = db ? 1 : 0;
  const int t = tp_->size(), heads_places = t / s_.kv_replicas, place = tp_->rank() / s_.kv_replicas;
  const int64_t piece = 2 * KV * (C + with_bias);  // one place: W_k, W_v rows (and their biases)
  LATTICE_CHECK(scratch_, "attention with replicated key/value heads needs a scratch buffer");
  std::vector<float>& mine = *scratch_;
  const int64_t local = rows * C + with_bias * rows;
  mine.assign(static_cast<size_t>(local + piece * heads_places), 0.0f);
  float* dw_local = mine.data();
  float* db_local = with_bias ? dw_local + rows * C : nullptr;
  k::linear_backward_weight(dw_local, db_local, dqkv, ln_whole, N, C, QKV, false);
  float* all = mine.data() + local;
  float* at = all + piece * place;
  std::memcpy(at, dw_local + A * C, sizeof(float) * 2 * KV * C);
  if (with_bias) std::memcpy(at + 2 * KV * C, db_local + A, sizeof(float) * 2 * KV);
  tp_->all_reduce(all, piece * heads_places, comm::ReduceOp::Sum, "replicated key/value weight gradients");
  std::memcpy(dw_local + A * C, at, sizeof(float) * 2 * KV * C);
  if (with_bias) std::memcpy(db_local + A, at + 2 * KV * C, sizeof(float) * 2 * KV);
  if (acc) {
    k::add_inplace(dw, dw_local, rows * C);
    if (with_bias) k::add_inplace(db, db_local, rows);
  } else {
    std::memcpy(dw, dw_local, sizeof(float) * rows * C);
    if (with_bias) std::memcpy(db, db_local, sizeof(float) * rows);
  }
}

}  // namespace lattice::model::parts
