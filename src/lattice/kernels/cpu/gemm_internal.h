// The two oneDNN paths behind kernels::gemm, exposed for the benchmark and the
// tests that compare them. Model code calls kernels::gemm / linear_* only.
#pragma once

#include <cstdint>

#include "lattice/core/dtype.h"

namespace lattice::kernels::cpu {

// dnnl_sgemm: oneDNN's BLAS-like f32 entry point (row-major). No setup, no cache.
void gemm_dnnl_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                     int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// A dnnl::matmul primitive built once per (shape, transposes, leading
// dimensions, alpha, beta, dtype, bias, thread count) and cached per calling
// thread. `bias` (length N, f32, added to every row) may be null; with a bias,
// alpha must be 1. A and B are f32 or bf16 (the same), C is f32.
void gemm_dnnl_matmul(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
                      int64_t lda, const void* B, int64_t ldb, float beta, float* C, int64_t ldc, DType ab_type,
                      const float* bias);

// bf16 A and B widened to f32 block by block (exact: bf16 is the top half of
// an f32) into a per-thread workspace, then dnnl_sgemm on the blocks. Products
// of bf16 values are exact in f32 and the sums are f32, as in a bf16 GEMM
// with f32 accumulation.
void gemm_bf16_via_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                         const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
                         int64_t ldc);

// True when oneDNN has a non-reference bf16 matmul kernel for this CPU (and
// LATTICE_DNNL_BF16 is not 0). Asked once, through the C API's status codes.
bool dnnl_bf16_matmul_available();

// Number of primitives in the calling thread's matmul cache (for tests).
int64_t matmul_cache_size();

}  // namespace lattice::kernels::cpu
