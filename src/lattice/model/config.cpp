#include "lattice/model/config.h"

#include "lattice/core/error.h"

namespace lattice::model {

void ModelConfig::validate() const {
  LATTICE_CHECK(n_layer >= 1, "model.n_layer must be >= 1, got " << n_layer);
  LATTICE_CHECK(n_head >= 1, "model.n_head must be >= 1, got " << n_head);
  LATTICE_CHECK(n_embd >= 1, "model.n_embd must be >= 1, got " << n_embd);
  LATTICE_CHECK(vocab_size >= 2, "model.vocab_size must be >= 2, got " << vocab_size);
  LATTICE_CHECK(vocab_size <= 65536,
                "model.vocab_size=" << vocab_size << " exceeds 65536, the most that uint16 token shards can hold");
  LATTICE_CHECK(seq_len >= 1, "model.seq_len must be >= 1, got " << seq_len);
  LATTICE_CHECK(n_embd % n_head == 0,
                "model.n_embd=" << n_embd << " is not divisible by model.n_head=" << n_head);
}

int64_t ModelConfig::num_params() const {
  int64_t C = n_embd, L = n_layer;
  return static_cast<int64_t>(vocab_size) * C + static_cast<int64_t>(seq_len) * C + L * (12 * C * C + 13 * C) + 2 * C;
}

double ModelConfig::flops_per_token(int T) const {
  const double n = static_cast<double>(num_params() - static_cast<int64_t>(seq_len) * n_embd);
  return 6.0 * n + 12.0 * n_layer * static_cast<double>(n_embd) * T;
}

}  // namespace lattice::model
