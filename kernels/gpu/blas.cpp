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

// The handle is bound to one stream for its whole life (`home`); a call on another stream is
// ordered into it with two events. Why: cublasSetStream resets the workspace to cuBLAS's pool,
// and (re)binding a handle while the device holds a stream waiting on a peer's flag can wait on
// that device; a mixed-stream test of the overlapped operations hung inside a CUDA call on
// 4 x H200 while the handle was rebound at every call.
struct Blas::Impl {
  cublasHandle_t handle = nullptr;
  void* workspace = nullptr;
  hipStream_t home = nullptr;
  bool owns_home = false;
  hipEvent_t enter = nullptr, leave = nullptr;

  template <class Call>
  void on(hipStream_t stream, Call call) {
    if (stream == home) {
      call();
      return;
    }
    CARAVAN_HIP_CHECK(hipEventRecord(enter, stream));
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(home, enter, 0));
    call();
    CARAVAN_HIP_CHECK(hipEventRecord(leave, home));
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, leave, 0));
  }
  void release() {
    if (handle) (void)cublasDestroy(handle);
    if (workspace) (void)hipFree(workspace);
    if (enter) (void)hipEventDestroy(enter);
    if (leave) (void)hipEventDestroy(leave);
    if (owns_home && home) (void)hipStreamDestroy(home);
  }
};

Blas::Blas(hipStream_t home) : impl_(std::make_unique<Impl>()) {
  Impl& i = *impl_;
  try {
    if (home) {
      i.home = home;
    } else {
      CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&i.home, hipStreamNonBlocking));
      i.owns_home = true;
    }
    CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&i.enter, hipEventDisableTiming));
    CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&i.leave, hipEventDisableTiming));
    check(cublasCreate(&i.handle), "cublasCreate");
    // A workspace of its own (per handle, so two lanes never share one) lets cuBLAS pick its
    // fastest kernels.
    CARAVAN_HIP_CHECK(hipMalloc(&i.workspace, kWorkspace));
    check(cublasSetStream(i.handle, i.home), "cublasSetStream");
    check(cublasSetWorkspace(i.handle, i.workspace, kWorkspace), "cublasSetWorkspace");
  } catch (...) {
    i.release();
    throw;
  }
}

Blas::~Blas() { impl_->release(); }

// Row-major C = A B is column-major C^T = B^T A^T: swap the operands and the m/n roles.
void Blas::gemm(hipStream_t stream, long m, long n, long k, const bf16* a, long lda, const bf16* b, long ldb, bf16* c,
                long ldc, float beta) {
  const float alpha = 1.0f;
  impl_->on(stream, [&] {
    check(cublasGemmEx(impl_->handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                       static_cast<int>(k), &alpha, b, CUDA_R_16BF, static_cast<int>(ldb), a, CUDA_R_16BF,
                       static_cast<int>(lda), &beta, c, CUDA_R_16BF, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx(bf16)");
  });
}

void Blas::gemm_batched(hipStream_t stream, long m, long n, long k, float alpha, const bf16* a, long lda, long stride_a,
                        const bf16* b, long ldb, long stride_b, bool transpose_b, void* c, bool c_float, long ldc,
                        long stride_c, int batch) {
  const float beta = 0.0f;
  impl_->on(stream, [&] {
    check(cublasGemmStridedBatchedEx(impl_->handle, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N,
                                     static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b, CUDA_R_16BF,
                                     static_cast<int>(ldb), stride_b, a, CUDA_R_16BF, static_cast<int>(lda), stride_a, &beta, c,
                                     c_float ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(ldc), stride_c, batch,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmStridedBatchedEx(bf16)");
  });
}

void Blas::gemm_reference(hipStream_t stream, long m, long n, long k, const float* a, long lda, const float* b, long ldb,
                          float* c, long ldc) {
  const float alpha = 1.0f, beta = 0.0f;
  impl_->on(stream, [&] {
    check(cublasSetMathMode(impl_->handle, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode(pedantic)");
    cublasStatus_t status = cublasSgemm(impl_->handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                                        static_cast<int>(k), &alpha, b, static_cast<int>(ldb), a, static_cast<int>(lda),
                                        &beta, c, static_cast<int>(ldc));
    check(cublasSetMathMode(impl_->handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode(default)");
    check(status, "cublasSgemm(reference)");
  });
}

}  // namespace caravan::gpu
