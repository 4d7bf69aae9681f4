#include "lattice/layers/tensor/vocab_parallel.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"

namespace lattice::tensor {

namespace k = lattice::kernels;

VocabRange vocab_range(int V, int Vp, int t, int r) {
  LATTICE_CHECK(t >= 1 && Vp % t == 0 && Vp >= V && r >= 0 && r < t,
                "vocab_range: need Vp (" << Vp << ") >= V (" << V << "), divisible by t (" << t << "), 0 <= r < t");
  VocabRange v;
  v.rows = Vp / t;
  v.first = static_cast<int64_t>(r) * v.rows;
  v.real = static_cast<int>(std::clamp<int64_t>(V - v.first, 0, v.rows));
  return v;
}

void local_tokens(int32_t* out, const int32_t* tokens, int64_t n, const VocabRange& range) {
  for (int64_t i = 0; i < n; i++) {
    const int64_t local = tokens[i] - range.first;
    out[i] = local >= 0 && local < range.rows ? static_cast<int32_t>(local) : -1;
  }
}

void vocab_parallel_cross_entropy(TensorParallel* tp, float* logits, float* losses, const int32_t* targets, int64_t N,
                                  const VocabRange& range, bool backward, float dloss) {
  std::vector<float> row_max(static_cast<size_t>(N));
  // [0, N): target logits, [N, 2N): sums of exponentials — one all-reduce.
  std::vector<double> sums(static_cast<size_t>(2 * N));
  k::crossentropy_local_max(row_max.data(), sums.data(), logits, targets, N, range.first, range.real, range.rows);
  if (tp && tp->size() > 1) tp->all_reduce(row_max.data(), N, comm::ReduceOp::Max, "loss row max");
  k::crossentropy_local_exp(logits, sums.data() + N, row_max.data(), N, range.real, range.rows);
  if (tp && tp->size() > 1) tp->all_reduce(sums.data(), 2 * N, "loss sums");
  for (int64_t i = 0; i < N; i++)
    losses[i] = static_cast<float>(static_cast<double>(row_max[i]) + std::log(sums[N + i]) - sums[i]);
  if (backward)
    k::crossentropy_local_grad(logits, sums.data() + N, targets, N, range.first, range.real, range.rows, dloss);
}

}  // namespace lattice::tensor
