// The model variants the tests of the model's math and mechanics run on
// (model_test, stage_test): value-parametrized over Variant, each test
// builds its own shape and takes it as every variant.
//
//   gpt2            the shape as it is: GPT-2 (LayerNorm, learned positions,
//                   GELU, biases, the head tied to the token embedding)
//   llama_gqa       ModelConfig::defaults(Family::Llama) (RMSNorm, rope,
//                   SwiGLU, no biases, untied lm_head) with n_kv_head =
//                   n_head / 2 and ffn_hidden = 5C/2
//   llama_mqa_tied  the same with one key/value head and the head tied
//   llama_mixed     family llama with GPT-2's parts: LayerNorm, GELU,
//                   learned positions, biases (multi-head, untied,
//                   ffn_hidden = 5C/2)
//
// The Llama variants take at least 4 query heads, so that the grouping of
// query heads over key/value heads is real (GPT-2's tiny shapes have 2).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <vector>

#include "lattice/core/rng.h"
#include "lattice/model/config.h"

namespace lattice::model::testing {

enum class Variant { GPT2, LlamaGqa, LlamaMqaTied, LlamaMixed };

inline const char* variant_name(Variant v) {
  switch (v) {
    case Variant::GPT2: return "gpt2";
    case Variant::LlamaGqa: return "llama_gqa";
    case Variant::LlamaMqaTied: return "llama_mqa_tied";
    case Variant::LlamaMixed: return "llama_mixed";
  }
  return "?";
}

// n token ids below `vocab`, drawn from `seed`.
inline std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng.next_below(vocab));
  return t;
}

// A GPT-2 shape of four layers (H=4, C=32, V=101, T=16): enough layers for a
// pipeline's stages and for recomputation's "first N" and "every k" to choose
// some layers and not others.
inline ModelConfig four_layers() {
  ModelConfig c;
  c.n_layer = 4;
  c.n_head = 4;
  c.n_embd = 32;
  c.vocab_size = 101;
  c.seq_len = 16;
  return c;
}

// `shape` (n_layer, n_head, n_embd, vocab_size, seq_len of a GPT-2 config) as variant v.
inline ModelConfig as_variant(const ModelConfig& shape, Variant v) {
  if (v == Variant::GPT2) return shape;
  ModelConfig c = ModelConfig::defaults(Family::Llama);
  c.n_layer = shape.n_layer;
  c.n_head = std::max(shape.n_head, 4);
  c.n_embd = shape.n_embd;
  c.vocab_size = shape.vocab_size;
  c.seq_len = shape.seq_len;
  c.ffn_hidden = 5 * shape.n_embd / 2;
  switch (v) {
    case Variant::LlamaGqa:
      c.n_kv_head = c.n_head / 2;
      break;
    case Variant::LlamaMqaTied:
      c.n_kv_head = 1;
      c.tie_embeddings = true;
      break;
    case Variant::LlamaMixed:
      c.norm = NormKind::LayerNorm;
      c.mlp = MlpKind::GELU;
      c.position = PositionKind::Learned;
      c.bias = true;
      break;
    case Variant::GPT2:
      break;
  }
  return c;
}

// The instances, in this order: gtest numbers them (GPT.SameSeedIsBitIdentical/0
// is gpt2, /1 llama_gqa, ...) and CTest names them by PrintTo
// (GPT.SameSeedIsBitIdentical/llama_gqa), as parity_test's fixtures. (A gtest
// name generator would name them in gtest, but CMake 3.25's discovery then
// keeps gtest's "# GetParam() = ..." comment in every CTest name.)
inline const auto kAllVariants =
    ::testing::Values(Variant::GPT2, Variant::LlamaGqa, Variant::LlamaMqaTied, Variant::LlamaMixed);

inline void PrintTo(Variant v, std::ostream* os) { *os << variant_name(v); }

}  // namespace lattice::model::testing
