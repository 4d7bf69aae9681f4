// What a layer's forward keeps for its backward, per layer and micro-batch,
// in bytes: docs/recompute.md's formula for what lattice stores, and Korthikanti
// et al.'s (2022) for Megatron's (16-bit activations with dropout masks and
// the a·s·s attention scores). The model's tests (recompute_test), tensor
// parallelism's (tp_test) and context parallelism's (cp_test) hold the
// MemoryTracker's measurements to the first and print the second beside it.
#pragma once

#include "lattice/model/gpt.h"
#include "lattice/model/recompute.h"

namespace lattice::model::testing {

// This rank's widths (GPT::Dims): model width C, the qkv projection QKV, the
// attention width A, the MLP's first projection FU and hidden width F, query heads NH.
struct LayerWidths {
  double C, QKV, A, FU, F, NH;
};
inline LayerWidths widths_of(const GPT::Dims& d) {
  return {static_cast<double>(d.C),  static_cast<double>(d.QKV), static_cast<double>(d.A),
          static_cast<double>(d.FU), static_cast<double>(d.F),   static_cast<double>(d.NH)};
}

// e bytes per stored array element (4 at f32, 2 at 16-bit), 4 per statistic;
// N = this rank's tokens (b·s, or b·s/cp under context parallelism), R = rows
// of the residual stream (N, or N/t with sequence parallelism); HO = the
// width of all-to-all context parallelism's head-sharded output (A), else 0:
//   none       e·(4·R·C + N·(QKV + A + FU + F + HO)) + 4·(4·R + N·NH)
//   selective  e·(2·R·C + N·(QKV + A + FU + HO))     + 4·N·NH
//   full       e·R·C
inline double stored_bytes_per_layer(Recompute r, double e, double N, double R, const LayerWidths& w, double HO = 0) {
  switch (r) {
    case Recompute::None: return e * (4 * R * w.C + N * (w.QKV + w.A + w.FU + w.F + HO)) + 4 * (4 * R + N * w.NH);
    case Recompute::Selective: return e * (2 * R * w.C + N * (w.QKV + w.A + w.FU + HO)) + 4 * N * w.NH;
    case Recompute::Full: return e * R * w.C;
  }
  return 0;
}

// Korthikanti et al., per layer, s tokens of b sequences, width h, a heads,
// tensor-parallel degree t, sequence parallelism sp:
//   none       sbh(10 + 24/t + 5as/(ht)), with SP sbh(34/t + 5as/(ht))   (t = 1: sbh(34 + 5as/h))
//   selective  sbh(10 + 24/t),            with SP 34sbh/t                (t = 1: 34sbh)
//   full       2sbh
inline double korthikanti_bytes(Recompute r, double s, double b, double h, double a, double t = 1, bool sp = false) {
  const double sbh = s * b * h;
  switch (r) {
    case Recompute::None:
      return sp ? sbh * (34 / t + 5 * a * s / (h * t)) : sbh * (10 + 24 / t + 5 * a * s / (h * t));
    case Recompute::Selective: return sp ? sbh * 34 / t : sbh * (10 + 24 / t);
    case Recompute::Full: return 2 * sbh;
  }
  return 0;
}

}  // namespace lattice::model::testing
