#include "lattice/layers/tensor/tensor_parallel.h"

#include "lattice/core/error.h"
#include "lattice/core/timer.h"
#include "lattice/kernels/ops.h"

namespace lattice::tensor {

namespace k = lattice::kernels;

TensorParallel::TensorParallel(comm::Communicator& group, bool sequence_parallel)
    : group_(group), sp_(sequence_parallel && group.size() > 1) {}

// Runs one collective of the group, timed, and names it in any error.
template <typename Fn>
static void collective(double* seconds, const char* what, Fn fn) {
  Timer t;
  try {
    fn();
  } catch (const Error& e) {
    LATTICE_FAIL("tensor parallelism, " << what << ": " << e.what());
  }
  *seconds += t.seconds();
}

void TensorParallel::check_rows(int64_t N) const {
  LATTICE_CHECK(!sp_ || N % size() == 0, "sequence parallelism cuts the " << N << " rows of a micro-batch into "
                                                                          << size()
                                                                          << " equal slices: B*T must "
                                                                             "be a multiple of "
                                                                          << "parallel.tp=" << size());
}

const float* TensorParallel::gather(const float* slice, float* full, int64_t N, int64_t C, const char* what) {
  if (!sp_) return slice;
  check_rows(N);
  collective(&comm_s_, what,
             [&] { group_.all_gather(slice, full, static_cast<size_t>(local_rows(N) * C), DType::F32); });
  return full;
}

void TensorParallel::reduce(float* partial, float* out, int64_t N, int64_t C, const char* what) {
  if (sp_) {
    check_rows(N);
    collective(&comm_s_, what, [&] {
      group_.reduce_scatter(partial, out, static_cast<size_t>(local_rows(N) * C), DType::F32, comm::ReduceOp::Sum);
    });
    return;
  }
  LATTICE_CHECK(out == partial, "TensorParallel::reduce(" << what
                                                          << "): without sequence parallelism the "
                                                             "all-reduce is in place");
  collective(&comm_s_, what,
             [&] { group_.all_reduce(partial, static_cast<size_t>(N * C), DType::F32, comm::ReduceOp::Sum); });
}

void TensorParallel::all_reduce(float* data, int64_t n, comm::ReduceOp op, const char* what) {
  collective(&comm_s_, what, [&] { group_.all_reduce(data, static_cast<size_t>(n), DType::F32, op); });
}

void TensorParallel::all_reduce(double* data, int64_t n, const char* what) {
  collective(&comm_s_, what, [&] { group_.all_reduce(data, static_cast<size_t>(n), DType::F64, comm::ReduceOp::Sum); });
}

// ---- ColumnParallelLinear ----

const float* ColumnParallelLinear::forward(float* y, const float* x, float* gathered, const float* W, const float* b,
                                           int64_t N) {
  const float* in = tp_ ? tp_->gather(x, gathered, N, IC_, "column-parallel input") : x;  // f forward
  k::linear_forward(y, in, W, b, N, IC_, OC_);
  return in;
}

void ColumnParallelLinear::backward_input(float* dx, const float* dy, const float* W, int64_t N) {
  k::linear_backward_input(dx, dy, W, N, IC_, OC_, false);
  if (tp_ && tp_->size() > 1) tp_->reduce(dx, dx, N, IC_, "column-parallel input gradient");  // f backward
}

void ColumnParallelLinear::backward_weight(float* dW, float* db, const float* dy, const float* x_whole, int64_t N,
                                           bool accumulate) {
  k::linear_backward_weight(dW, db, dy, x_whole, N, IC_, OC_, accumulate);
}

// ---- RowParallelLinear ----

void RowParallelLinear::forward(float* y, float* partial, const float* x_local, const float* W, const float* b,
                                int64_t N) {
  if (!tp_ || tp_->size() == 1) {
    k::linear_forward(y, x_local, W, b, N, IC_, OC_);
    return;
  }
  // Σ_r x_r·W_rᵀ first, the bias once after it (adding it on every rank
  // would count it t times).
  k::linear_forward(partial, x_local, W, nullptr, N, IC_, OC_);
  tp_->reduce(partial, y, N, OC_, "row-parallel output");  // g forward
  if (!b) return;
  const int64_t rows = tp_->local_rows(N);
  const int OC = OC_;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; i++) {
    float* row = y + i * OC;
    for (int c = 0; c < OC; c++) row[c] += b[c];
  }
}

const float* RowParallelLinear::backward_input(float* dx_local, const float* dy, float* dy_whole, const float* W,
                                               int64_t N) {
  const float* d = tp_ ? tp_->gather(dy, dy_whole, N, OC_, "row-parallel output gradient") : dy;  // g backward
  k::linear_backward_input(dx_local, d, W, N, IC_, OC_, false);
  return d;
}

void RowParallelLinear::backward_weight(float* dW, float* db, const float* dy_whole, const float* x_local, int64_t N,
                                        bool accumulate) {
  k::linear_backward_weight(dW, db, dy_whole, x_local, N, IC_, OC_, accumulate);
}

int padded_vocab(int vocab_size, int t) {
  const int64_t tile = 128LL * t;
  return static_cast<int>((vocab_size + tile - 1) / tile * tile);
}

}  // namespace lattice::tensor
