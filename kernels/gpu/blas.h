// The vendor BLAS calls Caravan's overlapped operations make (cuBLAS on NVIDIA, hipBLAS on AMD),
// in row-major terms: C[m x n] = A[m x k] * B[k x n], bf16 in and out, fp32 accumulation.
#pragma once

#include "kernels/gpu/kernels.h"

#include <memory>

namespace caravan::gpu {

class Blas {
 public:
  // A handle on the current device, bound for life to `home` (a stream of its own when null):
  // calls on other streams are ordered into it with events, never by rebinding the handle (see
  // blas.cpp). Throws Error(device) when the library cannot start.
  explicit Blas(hipStream_t home = nullptr);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // Row-major bf16 GEMM with leading dimensions (elements between rows); beta 0 or 1.
  void gemm(hipStream_t stream, long m, long n, long k, const bf16* a, long lda, const bf16* b, long ldb, bf16* c,
            long ldc, float beta = 0.0f);
  // Row-major D[m x n] = A[m x k] * B[k x n] + C[m x n], with C and D distinct buffers (cuBLASLt:
  // a sum lands in a new place without first being copied there). Each shape is planned once per
  // set of pointer alignments (the algorithm cuBLASLt's heuristic puts first for them) and the
  // plan reused, also for pointers aligned more strictly than it was planned for. Not
  // thread-safe (the plans are this object's): one host thread per Blas, as for every call.
  void gemm_add(hipStream_t stream, long m, long n, long k, const bf16* a, long lda, const bf16* b, long ldb,
                const bf16* c, long ldc, bf16* d, long ldd);
  // Row-major strided-batched GEMM: for i < batch, C_i[m x n] = alpha A_i[m x k] op(B_i), where
  // X_i = x + i * stride_x (elements; a stride of 0 shares one matrix across the batch) and
  // op(B) = B[k x n], or with transpose_b, the transpose of B stored as [n x k]. bf16 inputs,
  // fp32 accumulation; C is fp32 (c_float) or bf16.
  void gemm_batched(hipStream_t stream, long m, long n, long k, float alpha, const bf16* a, long lda, long stride_a,
                    const bf16* b, long ldb, long stride_b, bool transpose_b, void* c, bool c_float, long ldc,
                    long stride_c, int batch);
  // The float32 reference: true fp32 arithmetic (no TF32), row-major.
  void gemm_reference(hipStream_t stream, long m, long n, long k, const float* a, long lda, const float* b, long ldb,
                      float* c, long ldc);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace caravan::gpu
