// The vocabulary-parallel embedding and cross-entropy of tensor parallelism.
//
// wte [Vp, C] is split by rows over the t ranks of the TP group: rank r holds
// vocabulary ids [first, first + rows) with rows = Vp/t (Vp from
// tensor::padded_vocab, so every rank's range is equal). Of those, `real`
// are classes (ids < V); the rest are padding rows, zero, never a class.
//
// Lookup: a token outside this rank's range contributes a zero row, so the
// sum over the group (an all-reduce, or the reduce-scatter of sequence
// parallelism) is exactly wte[token]; wpe is added by rank 0 alone (adding a
// zero is exact, so x₀ is bitwise the one-process lookup). Its gradient: each
// rank scatter-adds the whole dx₀ into the rows it holds.
//
// Loss: the tied LM head is column-parallel over the vocabulary, so rank r
// has logits z[:, first : first + rows) and the full [N, Vp] never exists.
// Per row i, with real columns only:
//   m_i = max_r (local max)                                  all-reduce max, N floats
//   s_i = Σ_r Σ_j exp(z_ij - m_i) ; z_i,target (one owner)   all-reduce sum, 2N doubles
//   loss_i = m_i + log s_i - z_i,target
//   dz_ij = dloss · (exp(z_ij - m_i)/s_i - [j = target])     local
// — the one-process formulas term for term, so padded logits never win and
// the loss at V = 50257 on any t is the one-process loss (its sum of
// exponentials reassociated across ranks, nothing more).
#pragma once

#include <cstdint>

#include "lattice/layers/tensor/tensor_parallel.h"

namespace lattice::tensor {

struct VocabRange {
  int64_t first = 0;  // first vocabulary id held here
  int rows = 0;       // rows of wte held here (= columns of the local logits)
  int real = 0;       // of which classes (ids < V)
};
// Rank r's range of a vocabulary of V padded to Vp (Vp % t == 0) on t ranks.
VocabRange vocab_range(int V, int Vp, int t, int r);

// out[i] = tokens[i] - first when this rank holds it, else -1 (a row this
// table does not hold: kernels::embedding_forward gives it a zero row).
void local_tokens(int32_t* out, const int32_t* tokens, int64_t n, const VocabRange& range);

// Per-row losses of logits [N, range.rows] (this rank's columns); with
// `backward`, logits are replaced by dloss·(softmax - onehot) as
// kernels::crossentropy_forward_backward does. tp null: one process.
void vocab_parallel_cross_entropy(TensorParallel* tp, float* logits, float* losses, const int32_t* targets, int64_t N,
                                  const VocabRange& range, bool backward, float dloss);

}  // namespace lattice::tensor
