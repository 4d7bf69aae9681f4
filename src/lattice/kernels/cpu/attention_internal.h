// The blocked attention loops of attention.cpp, shared by the causal entry
// points (attention_forward / attention_backward: the diagonal block of the
// whole sequence) and the ring-attention blocks of attention_block.cpp, so
// both run one implementation. Arguments are checked by the callers.
#pragma once

#include <cstdint>

#include "lattice/kernels/ops.h"

namespace lattice::kernels::cpu {

// attention_block_forward without the argument checks.
void attention_block_forward_unchecked(const AttentionBlock& blk, float* out, int64_t ldo, int64_t out_batch,
                                       float* lse, bool merge);

// The block backward without the argument checks. accumulate == false
// writes dq (=) and zeroes dk, dv before adding the query heads into them
// (attention_backward); accumulate == true adds into all three.
void attention_block_backward_unchecked(const AttentionBlock& blk, const float* dout, int64_t ldo, int64_t out_batch,
                                        const float* lse, const float* delta, float* dq, float* dk, float* dv,
                                        bool accumulate);

// attention_delta without the argument checks.
void attention_delta_unchecked(float* delta, const float* dout, const float* out, int64_t ld, int64_t batch, int B,
                               int T, int NH, int hs);

}  // namespace lattice::kernels::cpu
