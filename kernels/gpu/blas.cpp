#include "kernels/gpu/blas.h"

#include <caravan/error.h>

#include <cublasLt.h>
#include <cublas_v2.h>

#include <cstdint>
#include <string>
#include <vector>

namespace caravan::gpu {
namespace {

void check(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(Errc::device, std::string(call) + " failed: " + cublasGetStatusName(status) + " (" +
                                  cublasGetStatusString(status) + ")");
}

constexpr std::size_t kWorkspace = 32u << 20;

// The alignment cuBLASLt may assume of a pointer: its lowest set address bit, at most 256 bytes.
std::uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t align = 256;
  while (align > 1 && address % align != 0) align /= 2;
  return align;
}

// One planned cuBLASLt GEMM (D = A B + C, column-major terms): its shape, the alignments it was
// planned for, its descriptors and the algorithm the heuristic put first.
struct LtPlan {
  long m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0, ldd = 0;
  std::uint32_t align[4] = {};
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t layout[4] = {};
  cublasLtMatmulAlgo_t algo{};

  bool same_gemm(long m_, long n_, long k_, long lda_, long ldb_, long ldc_, long ldd_) const {
    return m == m_ && n == n_ && k == k_ && lda == lda_ && ldb == ldb_ && ldc == ldc_ && ldd == ldd_;
  }
  // Planned for no stricter alignments than these (so its algorithm takes pointers aligned so).
  bool serves(const std::uint32_t (&al)[4]) const {
    return align[0] <= al[0] && align[1] <= al[1] && align[2] <= al[2] && align[3] <= al[3];
  }
  bool exactly(const std::uint32_t (&al)[4]) const {
    return align[0] == al[0] && align[1] == al[1] && align[2] == al[2] && align[3] == al[3];
  }
  void release() {
    for (auto& l : layout)
      if (l) (void)cublasLtMatrixLayoutDestroy(l), l = nullptr;
    if (op) (void)cublasLtMatmulDescDestroy(op), op = nullptr;
  }
};

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
  cublasLtHandle_t lt = nullptr;  // gemm_add's
  std::vector<LtPlan> plans;

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
  // The plan for this column-major D[m x n] = A[m x k] B[k x n] + C (made at first use).
  const LtPlan& plan(long m, long n, long k, const void* a, long lda, const void* b, long ldb, const void* c, long ldc,
                     const void* d, long ldd);
  void release() {
    for (auto& p : plans) p.release();
    plans.clear();
    if (lt) (void)cublasLtDestroy(lt);
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
    check(cublasLtCreate(&i.lt), "cublasLtCreate");  // gemm_add's, on this device like the other
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

const LtPlan& Blas::Impl::plan(long m, long n, long k, const void* a, long lda, const void* b, long ldb, const void* c,
                               long ldc, const void* d, long ldd) {
  const std::uint32_t align[4] = {alignment_of(a), alignment_of(b), alignment_of(c), alignment_of(d)};
  // The plan made for exactly these alignments, else one made for looser ones (valid here too):
  // no new plan, and no kernel's first launch, inside an operation whose warm-up planned the
  // shape at the loosest alignment its pointers can have (see overlap.cpp's warm_up).
  const LtPlan* looser = nullptr;
  for (const auto& p : plans) {
    if (!p.same_gemm(m, n, k, lda, ldb, ldc, ldd) || !p.serves(align)) continue;
    if (p.exactly(align)) return p;
    if (!looser) looser = &p;
  }
  if (looser) return *looser;
  LtPlan p;
  p.m = m, p.n = n, p.k = k, p.lda = lda, p.ldb = ldb, p.ldc = ldc, p.ldd = ldd;
  for (int i = 0; i < 4; ++i) p.align[i] = align[i];
  cublasLtMatmulPreference_t preference = nullptr;
  try {
    check(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const std::uint64_t rows[4] = {static_cast<std::uint64_t>(m), static_cast<std::uint64_t>(k),
                                   static_cast<std::uint64_t>(m), static_cast<std::uint64_t>(m)},
                        cols[4] = {static_cast<std::uint64_t>(k), static_cast<std::uint64_t>(n),
                                   static_cast<std::uint64_t>(n), static_cast<std::uint64_t>(n)};
    const long lds[4] = {lda, ldb, ldc, ldd};
    for (int i = 0; i < 4; ++i)
      check(cublasLtMatrixLayoutCreate(&p.layout[i], CUDA_R_16BF, rows[i], cols[i], lds[i]), "cublasLtMatrixLayoutCreate");
    check(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
    const std::uint64_t workspace_bytes = kWorkspace;
    check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                               sizeof workspace_bytes),
          "cublasLtMatmulPreferenceSetAttribute(workspace)");
    const cublasLtMatmulPreferenceAttributes_t align_attribute[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i)
      check(cublasLtMatmulPreferenceSetAttribute(preference, align_attribute[i], &align[i], sizeof align[i]),
            "cublasLtMatmulPreferenceSetAttribute(alignment)");
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    check(cublasLtMatmulAlgoGetHeuristic(lt, p.op, p.layout[0], p.layout[1], p.layout[2], p.layout[3], preference, 1,
                                         &result, &found),
          "cublasLtMatmulAlgoGetHeuristic");
    if (found < 1)
      throw Error(Errc::device, "cublasLtMatmulAlgoGetHeuristic found no algorithm for a bf16 GEMM of " +
                                    std::to_string(m) + " x " + std::to_string(n) + " x " + std::to_string(k));
    p.algo = result.algo;
    (void)cublasLtMatmulPreferenceDestroy(preference);
    preference = nullptr;
    plans.push_back(p);
  } catch (...) {
    if (preference) (void)cublasLtMatmulPreferenceDestroy(preference);
    p.release();
    throw;
  }
  return plans.back();
}

// Row-major D = A B + C is column-major D^T = B^T A^T + C^T, as in gemm().
void Blas::gemm_add(hipStream_t stream, long m, long n, long k, const bf16* a, long lda, const bf16* b, long ldb,
                    const bf16* c, long ldc, bf16* d, long ldd) {
  const float alpha = 1.0f, beta = 1.0f;
  impl_->on(stream, [&] {
    const LtPlan& p = impl_->plan(n, m, k, b, ldb, a, lda, c, ldc, d, ldd);
    check(cublasLtMatmul(impl_->lt, p.op, &alpha, b, p.layout[0], a, p.layout[1], &beta, c, p.layout[2], d, p.layout[3],
                         &p.algo, impl_->workspace, kWorkspace, impl_->home),
          "cublasLtMatmul(bf16, C != D)");
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
