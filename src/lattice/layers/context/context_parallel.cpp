#include "lattice/layers/context/context_parallel.h"

#include <cstring>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"

namespace lattice::context {

namespace k = lattice::kernels;

Mode parse_mode(const std::string& name) {
  if (name == "ring") return Mode::Ring;
  if (name == "all_to_all") return Mode::AllToAll;
  LATTICE_FAIL("parallel.cp_mode=\"" << name << "\" is not a context-parallel mode (\"ring\" or \"all_to_all\")");
}

const char* name_of(Mode mode) { return mode == Mode::Ring ? "ring" : "all_to_all"; }

// The global chunk (of 2·cp) that half h of rank r's rows is.
static int chunk_of(int cp, int rank, int half, Split split) {
  if (split == Split::Contiguous) return 2 * rank + half;
  return half == 0 ? rank : 2 * cp - 1 - rank;
}

std::vector<BlockPair> ring_step_pairs(int cp, int rank, int step, Split split) {
  const int holder = ((rank - step) % cp + cp) % cp;  // whose keys and values arrive at this step
  std::vector<BlockPair> pairs;
  for (int q = 0; q < 2; q++) {
    const int qi = chunk_of(cp, rank, q, split);
    for (int kv = 0; kv < 2; kv++) {
      const int ki = chunk_of(cp, holder, kv, split);
      if (ki < qi) pairs.push_back({q, kv, false});  // every key of an earlier chunk is visible
      if (ki == qi) pairs.push_back({q, kv, true});  // the diagonal
    }
  }
  return pairs;
}

int64_t pair_scores(const BlockPair& p, int64_t c) { return p.causal ? c * (c + 1) / 2 : c * c; }

ContextParallel::ContextParallel(comm::Communicator& group, Mode mode) : group_(group), mode_(mode) {}

void ContextParallel::check_local_length(int T_local) const {
  LATTICE_CHECK(T_local > 0 && T_local % 2 == 0,
                "context parallelism cuts each sequence into 2*cp chunks: a micro-batch of "
                    << T_local << " tokens per sequence on each of the cp=" << size()
                    << " ranks is not two whole chunks (model.seq_len must be divisible by 2*parallel.cp="
                    << 2 * size() << ")");
}

int position_of(int cp, int rank, int t, int T_local) {
  const int c = T_local / 2;
  return chunk_of(cp, rank, t / c, Split::Balanced) * c + t % c;
}

int ContextParallel::position(int t, int T_local) const { return position_of(size(), rank(), t, T_local); }

void ContextParallel::positions(int32_t* out, int T_local) const {
  check_local_length(T_local);
  for (int t = 0; t < T_local; t++) out[t] = position(t, T_local);
}

void ContextParallel::local_tokens(int32_t* out, const int32_t* in, int B, int T) const {
  LATTICE_CHECK(T % (2 * size()) == 0, "context parallelism: a sequence of " << T << " tokens does not cut into 2*cp="
                                                                             << 2 * size() << " chunks");
  const int Tl = T / size(), c = Tl / 2;
  for (int b = 0; b < B; b++)
    for (int h = 0; h < 2; h++)
      std::memcpy(out + static_cast<int64_t>(b) * Tl + h * c,
                  in + static_cast<int64_t>(b) * T + static_cast<int64_t>(chunk_of(size(), rank(), h, Split::Balanced)) * c,
                  sizeof(int32_t) * c);
}

void ContextParallel::check_heads(const HeadShape& s) const {
  if (mode_ != Mode::AllToAll) return;
  LATTICE_CHECK(s.NH % size() == 0 && s.NKV % size() == 0,
                "parallel.cp_mode=\"all_to_all\" gives each of the parallel.cp="
                    << size() << " ranks whole heads, but this rank has " << s.NH << " query and " << s.NKV
                    << " key/value heads (model.n_head and model.n_kv_head, divided by parallel.tp); use "
                       "parallel.cp_mode=\"ring\" or a cp dividing both");
}

float* ContextParallel::scratch(size_t i, size_t floats, MemCategory category) {
  if (scratch_.size() <= i) scratch_.resize(i + 1);
  if (scratch_[i].bytes() < floats * sizeof(float)) scratch_[i] = Buffer(floats * sizeof(float), category);
  return scratch_[i].as<float>();
}

comm::WorkPtr ContextParallel::ring_exchange(const float* send, float* recv, size_t count, int tag) {
  const int n = size(), next = (rank() + 1) % n, prev = (rank() + n - 1) % n;
  const comm::P2POp ops[2] = {comm::P2POp::send(send, count, DType::F32, next, tag),
                              comm::P2POp::recv(recv, count, DType::F32, prev, tag)};
  return group_.batch_isend_irecv(ops);
}

void ContextParallel::forward(float* out, float* lse, float* qkv, float* heads_out, int B, int T_local,
                              const HeadShape& s) {
  check_local_length(T_local);
  check_heads(s);
  if (mode_ == Mode::Ring) return ring_forward(out, lse, qkv, B, T_local, s);
  a2a_forward(out, lse, qkv, heads_out, B, T_local, s);
}

void ContextParallel::backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                               const float* heads_out, int B, int T_local, const HeadShape& s) {
  check_local_length(T_local);
  if (mode_ == Mode::Ring) return ring_backward(dqkv, dout, qkv, out, lse, B, T_local, s);
  a2a_backward(dqkv, dout, qkv, heads_out, lse, B, T_local, s);
}

// ---------------------------------------------------------------- ring

namespace {

enum Tag { kKeysValues = 1, kKeyValueGrads = 2 };

// The rows of a [B, T_local, width] array that are half h of each sequence.
struct Rows {
  float* p;
  int64_t ld, batch;
};
Rows half_rows(float* base, int h, int c, int64_t width, int T_local) {
  return {base + static_cast<int64_t>(h) * c * width, width, static_cast<int64_t>(T_local) * width};
}

// The kernel's view of pair p: this rank's query chunk p.q_half of qkv
// [B, T_local, QKV] against key/value chunk p.kv_half of the block `kv`
// [B, T_local, 2·KV] it holds.
kernels::AttentionBlock block_of(const BlockPair& p, const float* qkv, const float* kv, int B, int c, int T_local,
                                 const HeadShape& s) {
  const Rows q = half_rows(const_cast<float*>(qkv), p.q_half, c, s.QKV(), T_local);
  const Rows k = half_rows(const_cast<float*>(kv), p.kv_half, c, 2 * s.KV(), T_local);
  return {q.p, q.ld, q.batch, k.p, k.p + s.KV(), k.ld, k.batch, B, c, c, s.NH, s.NKV, s.hs, p.causal};
}

// [B, T_local, QKV] → the key|value columns [B, T_local, 2·KV].
void pack_keys_values(float* kv, const float* qkv, int64_t rows, const HeadShape& s) {
  const int64_t QKV = s.QKV(), A = s.A(), KV2 = 2 * s.KV();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; i++) std::memcpy(kv + i * KV2, qkv + i * QKV + A, sizeof(float) * KV2);
}

// lse_half [B, NH, c] ↔ the half's columns of lse [B, NH, T_local].
void lse_to_rows(float* lse, const float* half, int h, int B, int NH, int c, int T_local) {
  for (int64_t bn = 0; bn < static_cast<int64_t>(B) * NH; bn++)
    std::memcpy(lse + bn * T_local + static_cast<int64_t>(h) * c, half + bn * c, sizeof(float) * c);
}
void lse_of_rows(float* half, const float* lse, int h, int B, int NH, int c, int T_local) {
  for (int64_t bn = 0; bn < static_cast<int64_t>(B) * NH; bn++)
    std::memcpy(half + bn * c, lse + bn * T_local + static_cast<int64_t>(h) * c, sizeof(float) * c);
}

}  // namespace

// Step s: this rank holds the keys and values of rank (r − s) mod cp in `cur`
// and receives the next block into `nxt` while it computes (s < cp − 1).
void ContextParallel::ring_forward(float* out, float* lse, const float* qkv, int B, int T_local, const HeadShape& s) {
  const int n = size(), c = T_local / 2;
  const int64_t rows = static_cast<int64_t>(B) * T_local, KV2 = 2 * s.KV(), block = rows * KV2;
  float* cur = scratch(0, block, MemCategory::Comm);
  float* nxt = scratch(1, block, MemCategory::Comm);
  float* lse_half[2] = {scratch(2, static_cast<size_t>(B) * s.NH * c, MemCategory::Workspace),
                        scratch(3, static_cast<size_t>(B) * s.NH * c, MemCategory::Workspace)};
  pack_keys_values(cur, qkv, rows, s);
  step_scores_.assign(n, 0);
  bool started[2] = {false, false};
  for (int step = 0; step < n; step++) {
    comm::WorkPtr arriving;
    if (step + 1 < n) arriving = ring_exchange(cur, nxt, block, kKeysValues);
    for (const BlockPair& p : ring_step_pairs(n, rank(), step)) {
      const Rows o = half_rows(out, p.q_half, c, s.A(), T_local);
      k::attention_block_forward(block_of(p, qkv, cur, B, c, T_local, s), o.p, o.ld, o.batch, lse_half[p.q_half],
                                 started[p.q_half]);
      started[p.q_half] = true;
      step_scores_[step] += pair_scores(p, c) * B * s.NH;
      if (arriving) arriving->test();  // drives the transfer between blocks (MPI progresses inside its calls)
    }
    if (arriving) arriving->wait();
    std::swap(cur, nxt);
  }
  for (int h = 0; h < 2; h++) lse_to_rows(lse, lse_half[h], h, B, s.NH, c, T_local);
}

// The blocks go around again in the same order; each carries its dK/dV
// accumulator [B, T_local, 2·KV] (f32), which after the last step is one hop
// from home and takes it.
void ContextParallel::ring_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                                    const float* lse, int B, int T_local, const HeadShape& s) {
  const int n = size(), c = T_local / 2;
  const int64_t rows = static_cast<int64_t>(B) * T_local, KV2 = 2 * s.KV(), block = rows * KV2;
  const size_t half_stats = static_cast<size_t>(B) * s.NH * c;
  float* cur = scratch(0, block, MemCategory::Comm);
  float* nxt = scratch(1, block, MemCategory::Comm);
  float* dcur = scratch(4, block, MemCategory::Comm);
  float* dnxt = scratch(5, block, MemCategory::Comm);
  float* lse_half[2] = {scratch(2, half_stats, MemCategory::Workspace), scratch(3, half_stats, MemCategory::Workspace)};
  float* delta_half[2] = {scratch(6, half_stats, MemCategory::Workspace),
                          scratch(7, half_stats, MemCategory::Workspace)};
  for (int h = 0; h < 2; h++) {
    lse_of_rows(lse_half[h], lse, h, B, s.NH, c, T_local);
    const Rows d = half_rows(const_cast<float*>(dout), h, c, s.A(), T_local);
    const Rows o = half_rows(const_cast<float*>(out), h, c, s.A(), T_local);
    LATTICE_CHECK(d.ld == o.ld && d.batch == o.batch, "internal: dout and out differ in layout");
    k::attention_delta(delta_half[h], d.p, o.p, d.ld, d.batch, B, c, s.NH, s.hs);
  }
  std::memset(dqkv, 0, sizeof(float) * rows * s.QKV());
  pack_keys_values(cur, qkv, rows, s);
  std::memset(dcur, 0, sizeof(float) * block);
  for (int step = 0; step < n; step++) {
    comm::WorkPtr arriving;
    if (step + 1 < n) arriving = ring_exchange(cur, nxt, block, kKeysValues);
    for (const BlockPair& p : ring_step_pairs(n, rank(), step)) {
      const Rows dkv = half_rows(dcur, p.kv_half, c, KV2, T_local);
      const Rows d = half_rows(const_cast<float*>(dout), p.q_half, c, s.A(), T_local);
      const Rows dq = half_rows(dqkv, p.q_half, c, s.QKV(), T_local);
      k::attention_block_backward(block_of(p, qkv, cur, B, c, T_local, s), d.p, d.ld, d.batch, lse_half[p.q_half], delta_half[p.q_half], dq.p, dkv.p,
                                  dkv.p + s.KV());
      if (arriving) arriving->test();
    }
    // The accumulator follows its block (the last step: home).
    ring_exchange(dcur, dnxt, block, kKeyValueGrads)->wait();
    if (arriving) arriving->wait();
    std::swap(cur, nxt);
    std::swap(dcur, dnxt);
  }
  // dcur now holds this rank's own keys' and values' gradients.
  const int64_t QKV = s.QKV(), A = s.A();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; i++) std::memcpy(dqkv + i * QKV + A, dcur + i * KV2, sizeof(float) * KV2);
}

// ---------------------------------------------------------------- all-to-all

namespace {

// The four reshuffles of the all-to-all mode. A sequence-sharded row here
// holds every head: [Q: NH·hs | K: NKV·hs | V: NKV·hs] (qkv, dqkv), or Q's
// part only (out, dout: nkv = 0 below). Rank d's share of a row is its heads:
// query heads [d·nh, (d+1)·nh) and key/value heads [d·nkv, (d+1)·nkv), W
// values. Blocks of the all-to-all's buffers are [rows, W], one per rank.
struct HeadSplit {
  int n, nh, nkv, hs;         // ranks; heads per rank; head size
  int64_t NH, NKV;            // heads of a whole row (nkv = 0: no K/V part)
  int64_t W() const { return static_cast<int64_t>(nh + 2 * nkv) * hs; }
  int64_t row() const { return (NH + 2 * NKV) * hs; }
  // fn(offset in the whole row, offset in rank d's share, values) for each part.
  template <typename Fn>
  void parts(int d, Fn fn) const {
    fn(static_cast<int64_t>(d) * nh * hs, 0, static_cast<int64_t>(nh) * hs);
    if (nkv == 0) return;
    const int64_t kv = static_cast<int64_t>(nkv) * hs;
    fn(NH * hs + d * kv, static_cast<int64_t>(nh) * hs, kv);
    fn(NH * hs + NKV * hs + d * kv, static_cast<int64_t>(nh) * hs + kv, kv);
  }
};

// blocks[d] ← rank d's heads of each of `rows` whole rows (to_blocks), or
// the whole rows ← every rank's heads from blocks[d] (the inverse).
void move_heads(float* whole, float* blocks, bool to_blocks, int64_t rows, const HeadSplit& h) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; i++)
    for (int d = 0; d < h.n; d++)
      h.parts(d, [&](int64_t at, int64_t to, int64_t len) {
        float* in_whole = whole + i * h.row() + at;
        float* in_blocks = blocks + (d * rows + i) * h.W() + to;
        std::memcpy(to_blocks ? in_blocks : in_whole, to_blocks ? in_whole : in_blocks, sizeof(float) * len);
      });
}
void split_heads(float* blocks, const float* whole, int64_t rows, const HeadSplit& h) {
  move_heads(const_cast<float*>(whole), blocks, true, rows, h);
}
void join_heads(float* whole, const float* blocks, int64_t rows, const HeadSplit& h) {
  move_heads(whole, const_cast<float*>(blocks), false, rows, h);
}

// Head-sharded arrays [B, T, w] are in global positions; block j of an
// all-to-all holds rank j's rows [B, T_local, w] (rank j's local row t is
// global position_of(n, j, t)). Copies blocks → array (to_array), or back.
void reorder_positions(float* array, float* blocks, bool to_array, int n, int B, int T_local, int64_t w) {
  const int64_t rows = static_cast<int64_t>(B) * T_local, T = static_cast<int64_t>(T_local) * n;
#pragma omp parallel for collapse(2) schedule(static)
  for (int j = 0; j < n; j++)
    for (int64_t i = 0; i < rows; i++) {
      const int64_t b = i / T_local, pos = position_of(n, j, static_cast<int>(i % T_local), T_local);
      float* in_array = array + (b * T + pos) * w;
      float* in_blocks = blocks + (j * rows + i) * w;
      std::memcpy(to_array ? in_array : in_blocks, to_array ? in_blocks : in_array, sizeof(float) * w);
    }
}
void to_positions(float* array, const float* blocks, int n, int B, int T_local, int64_t w) {
  reorder_positions(array, const_cast<float*>(blocks), true, n, B, T_local, w);
}
void from_positions(float* blocks, const float* array, int n, int B, int T_local, int64_t w) {
  reorder_positions(const_cast<float*>(array), blocks, false, n, B, T_local, w);
}

}  // namespace

// Forward: Q/K/V to head-sharded (split by heads, all-to-all, to global
// positions), the causal kernel on this rank's heads, and the output back
// (from positions, all-to-all, joined by heads). The backward mirrors it.
void ContextParallel::a2a_forward(float* out, float* lse, float* qkv, float* heads_out, int B, int T_local,
                                  const HeadShape& s) {
  const int n = size(), T = T_local * n;
  const HeadSplit all{n, s.NH / n, s.NKV / n, s.hs, s.NH, s.NKV}, q{n, s.NH / n, 0, s.hs, s.NH, 0};
  const int64_t rows = static_cast<int64_t>(B) * T_local;
  float* send = scratch(0, rows * s.QKV(), MemCategory::Comm);
  float* recv = scratch(1, rows * s.QKV(), MemCategory::Comm);
  split_heads(send, qkv, rows, all);
  group_.all_to_all(send, recv, static_cast<size_t>(rows * all.W()), DType::F32);
  to_positions(qkv, recv, n, B, T_local, all.W());  // qkv now holds [B, T, W]: this rank's heads, every position
  k::attention_forward(heads_out, lse, qkv, B, T, all.nh, all.nkv, s.hs);
  from_positions(send, heads_out, n, B, T_local, q.W());
  group_.all_to_all(send, recv, static_cast<size_t>(rows * q.W()), DType::F32);
  join_heads(out, recv, rows, q);
}

void ContextParallel::a2a_backward(float* dqkv, const float* dout, const float* qkv, const float* heads_out,
                                   const float* lse, int B, int T_local, const HeadShape& s) {
  const int n = size(), T = T_local * n;
  const HeadSplit all{n, s.NH / n, s.NKV / n, s.hs, s.NH, s.NKV}, q{n, s.NH / n, 0, s.hs, s.NH, 0};
  const int64_t rows = static_cast<int64_t>(B) * T_local;
  float* send = scratch(0, rows * s.QKV(), MemCategory::Comm);
  float* recv = scratch(1, rows * s.QKV(), MemCategory::Comm);
  float* dout_heads = scratch(2, rows * s.A(), MemCategory::Workspace);    // [B, T, nh·hs]
  float* dqkv_heads = scratch(3, rows * s.QKV(), MemCategory::Workspace);  // [B, T, W]
  split_heads(send, dout, rows, q);
  group_.all_to_all(send, recv, static_cast<size_t>(rows * q.W()), DType::F32);
  to_positions(dout_heads, recv, n, B, T_local, q.W());
  k::attention_backward(dqkv_heads, dout_heads, qkv, heads_out, lse, B, T, all.nh, all.nkv, s.hs);
  from_positions(send, dqkv_heads, n, B, T_local, all.W());
  group_.all_to_all(send, recv, static_cast<size_t>(rows * all.W()), DType::F32);
  join_heads(dqkv, recv, rows, all);
}

}  // namespace lattice::context
