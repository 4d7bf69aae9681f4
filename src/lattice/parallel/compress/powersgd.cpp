#include "lattice/parallel/compress/powersgd.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "lattice/core/error.h"
#include "lattice/core/rng.h"
#include "lattice/kernels/ops.h"

namespace lattice::parallel {

int64_t LowRankLayout::p_floats() const {
  int64_t n = 0;
  for (const Matrix& m : matrices) n += rank * m.rows;
  return n;
}

int64_t LowRankLayout::q_floats() const {
  int64_t n = 0;
  for (const Matrix& m : matrices) n += rank * m.cols;
  return n;
}

int64_t LowRankLayout::exact_floats() const {
  int64_t n = 0;
  for (const Span& s : exact) n += s.n;
  return n;
}

bool worth_compressing(int64_t rows, int64_t cols, int64_t rank) {
  return rank >= 1 && rows >= 1 && cols >= 1 && rank * (rows + cols) < rows * cols;
}

namespace {

void add_exact(LowRankLayout& l, int64_t offset, int64_t n) {
  if (n <= 0) return;
  if (!l.exact.empty() && l.exact.back().offset + l.exact.back().n == offset) {
    l.exact.back().n += n;  // adjacent parameters: one span
  } else {
    l.exact.push_back({offset, n});
  }
}

}  // namespace

LowRankLayout lowrank_layout(const model::ParamGroup& group, int64_t rank) {
  LATTICE_CHECK(rank >= 1, "compression.rank=" << rank << " must be >= 1");
  LowRankLayout l;
  l.rank = rank;
  for (const model::ParamInfo& p : group.params()) {
    if (p.shape.size() == 2 && worth_compressing(p.shape[0], p.shape[1], rank)) {
      l.matrices.push_back({p.offset, p.shape[0], p.shape[1]});
    } else {
      add_exact(l, p.offset, p.numel());
    }
    l.extent = std::max(l.extent, p.offset + p.numel());
  }
  return l;
}

LowRankLayout lowrank_rows(const std::vector<std::pair<int64_t, int64_t>>& row_ranges, int64_t cols, int64_t rank) {
  LATTICE_CHECK(rank >= 1, "compression.rank=" << rank << " must be >= 1");
  LowRankLayout l;
  l.rank = rank;
  for (const auto& [first, last] : row_ranges) {
    if (last <= first) continue;
    if (worth_compressing(last - first, cols, rank)) {
      l.matrices.push_back({first * cols, last - first, cols});
    } else {
      add_exact(l, first * cols, (last - first) * cols);
    }
    l.extent = std::max(l.extent, last * cols);
  }
  return l;
}

namespace {

// Scratch of reduce(): one at a time per thread (the communication thread,
// or the posting thread inline), reused across steps.
struct Scratch {
  std::vector<float> send;            // all-reduce 1: every Pᵀ, then the exact values
  std::vector<float> q_sum, q_local;  // all-reduce 2: every Qᵀ; this rank's own
  std::vector<float> row_sum, row_local;
  std::vector<double> gs;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Makes the r rows of A (r×len, row-major: each row one column of P or Q)
// orthonormal by modified Gram-Schmidt in f64. A row that is (numerically)
// in the span of the earlier ones — or zero — becomes zero: it adds nothing
// to P Qᵀ, and is drawn again next step. A non-finite row stays non-finite,
// so an overflowed gradient reaches the result as it would uncompressed.
void orthonormalize(float* A, int64_t r, int64_t len, std::vector<double>& v) {
  v.assign(A, A + r * len);
  for (int64_t c = 0; c < r; c++) {
    double* x = v.data() + c * len;
    double before = 0;
    for (int64_t i = 0; i < len; i++) before += x[i] * x[i];
    for (int64_t k = 0; k < c; k++) {
      const double* u = v.data() + k * len;
      double d = 0;
      for (int64_t i = 0; i < len; i++) d += u[i] * x[i];
      for (int64_t i = 0; i < len; i++) x[i] -= d * u[i];
    }
    double norm = 0;
    for (int64_t i = 0; i < len; i++) norm += x[i] * x[i];
    if (!std::isfinite(norm) || !std::isfinite(before)) continue;
    // Below 1e-10 of what it was, the rest is rounding of a dependent row.
    const double scale = norm > 0 && norm > 1e-20 * before ? 1.0 / std::sqrt(norm) : 0.0;
    for (int64_t i = 0; i < len; i++) x[i] *= scale;
  }
  for (int64_t i = 0; i < r * len; i++) A[i] = static_cast<float>(v[i]);
}

bool row_is_zero(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (x[i] != 0) return false;
  return true;
}

bool all_finite(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (!std::isfinite(x[i])) return false;
  return true;
}

}  // namespace

PowerSgd::State& PowerSgd::state(int64_t key, const LowRankLayout& layout, bool error_feedback) {
  State& s = states_[key];
  s.key = key;
  const size_t q_bytes = static_cast<size_t>(layout.q_floats()) * sizeof(float);
  if (s.matrices != layout.matrices.size() || s.q.bytes() != q_bytes) {
    LATTICE_CHECK(s.matrices == 0, "internal: PowerSGD key " << key << " reused for another layout");
    if (q_bytes > 0) s.q = Buffer(q_bytes, MemCategory::Grads);  // zero: every column drawn on first use
    s.matrices = layout.matrices.size();
  }
  const size_t e_bytes = static_cast<size_t>(layout.extent) * sizeof(float);
  if (error_feedback && e_bytes > 0 && s.error.bytes() < e_bytes) s.error = Buffer(e_bytes, MemCategory::Grads);
  return s;
}

void scale_error_buffer(Buffer& errors, float f) {
  if (errors.empty()) return;
  if (f == 0.0f) {
    std::memset(errors.data(), 0, errors.bytes());  // also where an error was not finite
  } else {
    kernels::scale_inplace(errors.as<float>(), f, static_cast<int64_t>(errors.bytes() / sizeof(float)));
  }
}

void PowerSgd::scale_errors(float f) {
  for (auto& [key, s] : states_) scale_error_buffer(s.error, f);
}

size_t PowerSgd::state_bytes() const {
  size_t b = 0;
  for (const auto& [key, s] : states_) b += s.q.bytes() + s.error.bytes();
  return b;
}

void PowerSgd::reduce(comm::Communicator& comm, State& state, float* data, const LowRankLayout& layout) {
  const int64_t r = layout.rank, key = state.key;
  float* err = state.error.empty() ? nullptr : state.error.as<float>();
  Scratch& s = scratch();
  const int64_t P = layout.p_floats(), Q = layout.q_floats(), X = layout.exact_floats();
  s.send.resize(static_cast<size_t>(P + X));
  s.q_sum.resize(static_cast<size_t>(Q));
  s.q_local.resize(static_cast<size_t>(Q));

  // M = grad + e ; Q ready (warm, zero rows drawn, orthonormal) ; P = M Q.
  bool drew = false;
  for (size_t mi = 0, p_at = 0, q_at = 0; mi < layout.matrices.size(); mi++) {
    const LowRankLayout::Matrix& m = layout.matrices[mi];
    float* M = data + m.offset;
    const int64_t mn = m.rows * m.cols;
    if (err) {
      const float* e = err + m.offset;
      for (int64_t i = 0; i < mn; i++) M[i] += e[i];
    }
    float* Qt = state.q.as<float>() + q_at;  // r×cols
    for (int64_t c = 0; c < r; c++) {
      float* q = Qt + c * m.cols;
      if (!row_is_zero(q, m.cols)) continue;
      const uint64_t stream = hash_name("powersgd") ^ (static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) ^ mi;
      for (int64_t j = 0; j < m.cols; j++)
        q[j] = init_normal_hashed(state.draws, stream, static_cast<uint64_t>(c * m.cols + j));
      drew = true;
    }
    orthonormalize(Qt, r, m.cols, s.gs);
    // Pᵀ[c][i] = Σ_j M[i][j] Q[j][c]
    float* Pt = s.send.data() + p_at;
    for (int64_t i = 0; i < m.rows; i++) {
      const float* row = M + i * m.cols;
      for (int64_t c = 0; c < r; c++) {
        const float* q = Qt + c * m.cols;
        float acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < m.cols; j++) acc += row[j] * q[j];
        Pt[c * m.rows + i] = acc;
      }
    }
    p_at += static_cast<size_t>(r * m.rows);
    q_at += static_cast<size_t>(r * m.cols);
  }
  if (drew) state.draws++;  // the same on every rank: Q is
  {
    float* x = s.send.data() + P;
    for (const LowRankLayout::Span& sp : layout.exact) {
      std::memcpy(x, data + sp.offset, static_cast<size_t>(sp.n) * sizeof(float));
      x += sp.n;
    }
  }

  // All-reduce 1: the Ps and the exact values.
  if (P + X > 0) comm.all_reduce(s.send.data(), static_cast<size_t>(P + X), DType::F32, comm::ReduceOp::Sum);
  {
    const float* x = s.send.data() + P;
    for (const LowRankLayout::Span& sp : layout.exact) {
      std::memcpy(data + sp.offset, x, static_cast<size_t>(sp.n) * sizeof(float));
      x += sp.n;
    }
  }
  if (layout.matrices.empty()) return;

  // P orthonormal ; Q_w = M_wᵀ P.
  for (size_t mi = 0, p_at = 0, q_at = 0; mi < layout.matrices.size(); mi++) {
    const LowRankLayout::Matrix& m = layout.matrices[mi];
    const float* M = data + m.offset;
    float* Pt = s.send.data() + p_at;
    orthonormalize(Pt, r, m.rows, s.gs);
    // Qᵀ[c][j] = Σ_i P[i][c] M[i][j]
    float* Qt = s.q_local.data() + q_at;
    std::fill(Qt, Qt + r * m.cols, 0.0f);
    for (int64_t i = 0; i < m.rows; i++) {
      const float* row = M + i * m.cols;
      for (int64_t c = 0; c < r; c++) {
        const float p = Pt[c * m.rows + i];
        float* q = Qt + c * m.cols;
        for (int64_t j = 0; j < m.cols; j++) q[j] += p * row[j];
      }
    }
    p_at += static_cast<size_t>(r * m.rows);
    q_at += static_cast<size_t>(r * m.cols);
  }

  // All-reduce 2: the Qs.
  std::copy(s.q_local.begin(), s.q_local.end(), s.q_sum.begin());
  comm.all_reduce(s.q_sum.data(), static_cast<size_t>(Q), DType::F32, comm::ReduceOp::Sum);

  // M̂ = P Qᵀ into the buffer ; e_w = M_w − P Q_wᵀ ; Q kept for the next step.
  for (size_t mi = 0, p_at = 0, q_at = 0; mi < layout.matrices.size(); mi++) {
    const LowRankLayout::Matrix& m = layout.matrices[mi];
    float* M = data + m.offset;
    const float* Pt = s.send.data() + p_at;
    const float* Qs = s.q_sum.data() + q_at;
    const float* Ql = s.q_local.data() + q_at;
    s.row_sum.resize(static_cast<size_t>(m.cols));
    s.row_local.resize(static_cast<size_t>(m.cols));
    float* sum = s.row_sum.data();
    float* local = s.row_local.data();
    for (int64_t i = 0; i < m.rows; i++) {
      float* row = M + i * m.cols;
      std::fill(sum, sum + m.cols, 0.0f);
      for (int64_t c = 0; c < r; c++) {  // in c order: the same floats on every rank
        const float p = Pt[c * m.rows + i];
        const float* q = Qs + c * m.cols;
        for (int64_t j = 0; j < m.cols; j++) sum[j] += p * q[j];
      }
      if (err) {
        std::fill(local, local + m.cols, 0.0f);
        for (int64_t c = 0; c < r; c++) {
          const float p = Pt[c * m.rows + i];
          const float* q = Ql + c * m.cols;
          for (int64_t j = 0; j < m.cols; j++) local[j] += p * q[j];
        }
        // A non-finite error (an overflowed step, skipped by the loss scaler) is not carried.
        float* e = err + m.offset + i * m.cols;
        for (int64_t j = 0; j < m.cols; j++) {
          const float d = row[j] - local[j];
          e[j] = std::isfinite(d) ? d : 0.0f;
        }
      }
      std::memcpy(row, sum, static_cast<size_t>(m.cols) * sizeof(float));
    }
    // Warm start: this step's Q (orthonormalized before use). A non-finite
    // one is dropped and drawn again.
    float* keep = state.q.as<float>() + q_at;
    if (all_finite(Qs, r * m.cols)) {
      std::memcpy(keep, Qs, static_cast<size_t>(r * m.cols) * sizeof(float));
    } else {
      std::fill(keep, keep + r * m.cols, 0.0f);
    }
    p_at += static_cast<size_t>(r * m.rows);
    q_at += static_cast<size_t>(r * m.cols);
  }
}

}  // namespace lattice::parallel
