#include "kernels/gpu/blas.h"

#include <caravan/error.h>

#include <cublas_v2.h>

#include <string>

namespace caravan::gpu {
namespace {

void check(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(Errc::device, std::string(call) + " failed: " + cublasGetStatusName(status) + " (" +
                                  cublasGetStatusString(status) + ")");
}

constexpr std::size_t kWorkspace = 32u << 20;

}  // namespace

struct Blas::Impl {
  cublasHandle_t handle = nullptr;
  void* workspace = nullptr;
  hipStream_t stream = nullptr;
  bool stream_set = false;

  // cublasSetStream resets the handle's workspace to cuBLAS's default pool: set ours again
  // whenever the stream changes.
  void use(hipStream_t s) {
    if (stream_set && s == stream) return;
    check(cublasSetStream(handle, s), "cublasSetStream");
    check(cublasSetWorkspace(handle, workspace, kWorkspace), "cublasSetWorkspace");
    stream = s;
    stream_set = true;
  }
};

Blas::Blas() : impl_(std::make_unique<Impl>()) {
  check(cublasCreate(&impl_->handle), "cublasCreate");
  // A workspace of its own (per handle, so two lanes never share one) lets cuBLAS pick its
  // fastest kernels whatever stream it runs on.
  CARAVAN_HIP_CHECK(hipMalloc(&impl_->workspace, kWorkspace));
  check(cublasSetWorkspace(impl_->handle, impl_->workspace, kWorkspace), "cublasSetWorkspace");
}

Blas::~Blas() {
  if (impl_->handle) (void)cublasDestroy(impl_->handle);
  if (impl_->workspace) (void)hipFree(impl_->workspace);
}

// Row-major C = A B is column-major C^T = B^T A^T: swap the operands and the m/n roles.
void Blas::gemm(hipStream_t stream, long m, long n, long k, const bf16* a, long lda, const bf16* b, long ldb, bf16* c,
                long ldc, float beta) {
  const float alpha = 1.0f;
  impl_->use(stream);
  check(cublasGemmEx(impl_->handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                     static_cast<int>(k), &alpha, b, CUDA_R_16BF, static_cast<int>(ldb), a, CUDA_R_16BF,
                     static_cast<int>(lda), &beta, c, CUDA_R_16BF, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx(bf16)");
}

void Blas::gemm_batched(hipStream_t stream, long m, long n, long k, float alpha, const bf16* a, long lda, long stride_a,
                        const bf16* b, long ldb, long stride_b, bool transpose_b, void* c, bool c_float, long ldc,
                        long stride_c, int batch) {
  const float beta = 0.0f;
  impl_->use(stream);
  check(cublasGemmStridedBatchedEx(impl_->handle, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N,
                                   static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b, CUDA_R_16BF,
                                   static_cast<int>(ldb), stride_b, a, CUDA_R_16BF, static_cast<int>(lda), stride_a, &beta, c,
                                   c_float ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(ldc), stride_c, batch,
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx(bf16)");
}

void Blas::gemm_reference(hipStream_t stream, long m, long n, long k, const float* a, long lda, const float* b, long ldb,
                          float* c, long ldc) {
  const float alpha = 1.0f, beta = 0.0f;
  impl_->use(stream);
  check(cublasSetMathMode(impl_->handle, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode(pedantic)");
  cublasStatus_t status = cublasSgemm(impl_->handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                                      static_cast<int>(k), &alpha, b, static_cast<int>(ldb), a, static_cast<int>(lda),
                                      &beta, c, static_cast<int>(ldc));
  check(cublasSetMathMode(impl_->handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode(default)");
  check(status, "cublasSgemm(reference)");
}

}  // namespace caravan::gpu
