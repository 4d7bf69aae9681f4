// Activation recomputation (docs/recompute.md): per layer, what its forward
// keeps for the backward and what the backward computes again. The attention
// kernel never keeps its T×T scores (it recomputes them from the
// log-sum-exp), so every mode starts from what lattice stores
// (activations.h's LayerArrays and statistics) rather than Megatron's list.
//
//   none       everything: x_l, norm₁(x_l), qkv, atty, r_l, norm₂(r_l), fch,
//              hid, the norms' statistics and the log-sum-exp.
//   selective  x_l, the GEMM outputs qkv and fch, the attention's output atty
//              with its log-sum-exp, and r_l. Dropped: norm₁(x_l), norm₂(r_l)
//              (and their statistics) and hid = GELU(fch) or SiLU(gate)·up,
//              which the backward computes again from x_l, r_l and fch:
//              elementwise work, no GEMM, no communication (under SP the
//              norms are this rank's rows).
//   full       x_l only: the backward runs the block's forward again (its
//              GEMMs, attention and tensor-parallel collectives included).
//
// Every recomputation calls the forward's own kernels on the forward's own
// inputs, rounded where the forward rounds them (16-bit storage), so the
// backward reads the same bits: training is bit-identical in every mode.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lattice::model {

enum class Recompute : uint8_t { None, Selective, Full };

// "none" | "selective" | "full".
const char* recompute_name(Recompute r);
// The inverse; anything else is refused, naming recompute.mode.
Recompute recompute_from_name(const std::string& name);

// A layer's stored arrays and statistics (activations.h's LayerActs), by name.
// HeadsOut: context parallelism's all-to-all keeps the head-sharded
// attention output for its backward (layers/context; empty otherwise), kept
// or recomputed with the attention's other outputs.
enum class LayerField { Ln1, Ln1Stats, Qkv, Atty, Lse, Res1, Ln2, Ln2Stats, Fch, Hid, HeadsOut };

// Whether a layer under `r` keeps field f from its forward to its backward.
inline bool stores(Recompute r, LayerField f) {
  switch (r) {
    case Recompute::None: return true;
    case Recompute::Selective:
      return f == LayerField::Qkv || f == LayerField::Atty || f == LayerField::Lse || f == LayerField::Res1 ||
             f == LayerField::Fch || f == LayerField::HeadsOut;
    case Recompute::Full: return false;
  }
  return true;
}

// Whether the weight-gradient half of a layer's backward (backward_weight)
// reads field f: the inputs of the four GEMMs' weight gradients and of the
// norms' (their inputs x_l and r_l, outputs and statistics).
inline bool weight_reads(LayerField f) {
  return f == LayerField::Ln1 || f == LayerField::Ln1Stats || f == LayerField::Atty || f == LayerField::Res1 ||
         f == LayerField::Ln2 || f == LayerField::Ln2Stats || f == LayerField::Hid;
}

// Under the split backward, what backward_input recomputes and keeps for
// backward_weight (carved with the split gradients, which live exactly as
// long), so that the weight half computes nothing again.
inline bool kept_for_weight(Recompute r, LayerField f) { return !stores(r, f) && weight_reads(f); }

// Which layers recompute: `mode` on every layer l (global index) with
// l % every == 0 and, when first > 0, a stage-local index below first (the
// first layers of each pipeline stage: Megatron's "block" method).
struct RecomputeSpec {
  Recompute mode = Recompute::None;
  int every = 1;
  int first = 0;
};
// The policy of stage layers [first_layer, last_layer), one entry per layer.
std::vector<Recompute> recompute_policy(const RecomputeSpec& spec, int first_layer, int last_layer);

}  // namespace lattice::model
