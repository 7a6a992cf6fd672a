// The vendor BLAS calls Caravan's overlapped operations make (cuBLAS on NVIDIA, hipBLAS on AMD),
// in row-major terms: C[m x n] = A[m x k] * B[k x n], bf16 in and out, fp32 accumulation.
#pragma once

#include "kernels/gpu/kernels.h"

#include <memory>

namespace caravan::gpu {

class Blas {
 public:
  // A handle on the current device. Throws Error(device) when the library cannot start.
  Blas();
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // Row-major bf16 GEMM with leading dimensions (elements between rows); beta 0 or 1.
  void gemm(hipStream_t stream, long m, long n, long k, const bf16* a, long lda, const bf16* b, long ldb, bf16* c,
            long ldc, float beta = 0.0f);
  // The float32 reference: true fp32 arithmetic (no TF32), row-major.
  void gemm_reference(hipStream_t stream, long m, long n, long k, const float* a, long lda, const float* b, long ldb,
                      float* c, long ldc);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace caravan::gpu
