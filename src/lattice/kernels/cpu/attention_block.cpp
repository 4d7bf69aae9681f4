// Ring (context-parallel) attention blocks: the argument checks of the public
// entry points of ops.h. The loops are attention.cpp's (attention_internal.h),
// the same ones the causal attention_forward / attention_backward run on the
// diagonal block of a whole sequence.
#include "lattice/core/error.h"
#include "lattice/kernels/cpu/attention_internal.h"
#include "lattice/kernels/ops.h"

namespace lattice::kernels {
namespace {

void check_block(const char* what, const AttentionBlock& a, int64_t ldo, int64_t out_batch) {
  LATTICE_CHECK(a.B > 0 && a.Tq > 0 && a.Tk > 0 && a.NH > 0 && a.NKV > 0 && a.hs > 0,
                what << ": sizes must be positive, got B=" << a.B << " Tq=" << a.Tq << " Tk=" << a.Tk
                     << " NH=" << a.NH << " NKV=" << a.NKV << " hs=" << a.hs);
  LATTICE_CHECK(a.NH % a.NKV == 0, what << ": NH=" << a.NH << " query heads cannot share NKV=" << a.NKV
                                        << " key/value heads (NH must be a multiple of NKV)");
  LATTICE_CHECK(!a.causal || a.Tq == a.Tk, what << ": a causal (diagonal) block needs Tq == Tk, got Tq=" << a.Tq
                                                << " Tk=" << a.Tk);
  const int64_t q_width = static_cast<int64_t>(a.NH) * a.hs, kv_width = static_cast<int64_t>(a.NKV) * a.hs;
  LATTICE_CHECK(a.ldq >= q_width && a.ldkv >= kv_width && ldo >= q_width,
                what << ": leading dimensions ldq=" << a.ldq << " ldkv=" << a.ldkv << " ldo=" << ldo
                     << " must be at least NH·hs=" << q_width << ", NKV·hs=" << kv_width << " and NH·hs="
                     << q_width);
  LATTICE_CHECK(a.B == 1 || (a.q_batch >= a.Tq * a.ldq && a.kv_batch >= a.Tk * a.ldkv && out_batch >= a.Tq * ldo),
                what << ": batch strides q_batch=" << a.q_batch << " kv_batch=" << a.kv_batch << " out_batch="
                     << out_batch << " must be at least Tq·ldq=" << a.Tq * a.ldq << ", Tk·ldkv=" << a.Tk * a.ldkv
                     << " and Tq·ldo=" << a.Tq * ldo);
}

}  // namespace

void attention_block_forward(const AttentionBlock& blk, float* out, int64_t ldo, int64_t out_batch, float* lse,
                             bool merge) {
  check_block("attention_block_forward", blk, ldo, out_batch);
  cpu::attention_block_forward_unchecked(blk, out, ldo, out_batch, lse, merge);
}

void attention_delta(float* delta, const float* dout, const float* out, int64_t ld, int64_t batch, int B, int T,
                     int NH, int hs) {
  LATTICE_CHECK(B > 0 && T > 0 && NH > 0 && hs > 0,
                "attention_delta: sizes must be positive, got B=" << B << " T=" << T << " NH=" << NH << " hs=" << hs);
  LATTICE_CHECK(ld >= static_cast<int64_t>(NH) * hs,
                "attention_delta: leading dimension ld=" << ld << " must be at least NH·hs=" << NH * hs);
  LATTICE_CHECK(B == 1 || batch >= T * ld,
                "attention_delta: batch stride " << batch << " must be at least T·ld=" << T * ld);
  cpu::attention_delta_unchecked(delta, dout, out, ld, batch, B, T, NH, hs);
}

void attention_block_backward(const AttentionBlock& blk, const float* dout, int64_t ldo, int64_t out_batch,
                              const float* lse, const float* delta, float* dq, float* dk, float* dv) {
  check_block("attention_block_backward", blk, ldo, out_batch);
  cpu::attention_block_backward_unchecked(blk, dout, ldo, out_batch, lse, delta, dq, dk, dv, true);
}

}  // namespace lattice::kernels
