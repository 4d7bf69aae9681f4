// A Linear's parameters inside a ParamGroup, as the block's parts use them.
//
// A Linear may be *packed*: n weights declared back to back with no gap
// (ParamInfo::packed), so that in memory they are one matrix of Σ OC_i rows
// and one GEMM computes all of them — Llama's q_proj | k_proj | v_proj into
// one [N, Q + 2·KV] row, gate_proj | up_proj into one [N, 2F]. GPT-2's fused
// c_attn is one weight of 3C rows (n = 1). Their biases, when there are any,
// are packed the same way, starting at index b.
#pragma once

#include <cstddef>

#include "lattice/model/param_group.h"

namespace lattice::model::parts {

struct LinearParams {
  ParamGroup* group = nullptr;
  size_t w = 0;   // the first weight
  size_t n = 1;   // weights packed from w
  int b = -1;     // the first bias (-1: no bias)

  // The compute copies (model/param_group.h: rounded to the compute dtype).
  const float* weight() const { return group->compute_param(w); }
  const float* bias() const { return b < 0 ? nullptr : group->compute_param(static_cast<size_t>(b)); }
  // The gradients of the n weights (and biases) for writing, as one matrix
  // (and one vector); returns whether to accumulate (see
  // ParamGroup::write_grad): the n weights and biases are always written
  // together, so they are all stale or all written (checked). db is null without biases.
  bool write_grads(float** dw, float** db) const;
};

}  // namespace lattice::model::parts
