// The vendor BLAS calls Caravan's overlapped operations make (cuBLAS on NVIDIA, hipBLAS on AMD),
// in row-major terms: C[m x n] = A[m x k] * B[k x n], bf16 in and out, fp32 accumulation.
#pragma once

#include "kernels/gpu/kernels.h"

#include <memory>

namespace caravan::gpu {

// Whether a Blas runs the algorithms Blas::tune chose on its device (use), or always cuBLAS's own
// first choice (off: what PyTorch calls; benchmarks time it beside the tuned one).
enum class GemmTuning { use, off };

// What Blas::tune does for one shape.
struct TuneOptions {
  static constexpr int kFromSetting = -1;
  // cuBLASLt candidates timed beside the untuned choice; kFromSetting: CARAVAN_GPU_GEMM_TUNE
  // (8 by default; 0: tune nothing).
  int candidates = kFromSetting;
  // For tests: record the pick-th candidate that passes the filter, untimed (-1: the fastest), so
  // that the cuBLASLt path of gemm() runs whatever the machine's timings.
  int pick = -1;
};

// What a Blas runs for one (256-byte aligned) shape: cuBLAS's choice because nothing was tuned,
// cuBLAS's choice because tuning found nothing 1% faster, or a tuned cuBLASLt algorithm.
enum class GemmChoice { untuned, vendor_default, algorithm };

class Blas {
 public:
  // A handle on the current device, bound for life to `home` (a stream of its own when null):
  // calls on other streams are ordered into it with events, never by rebinding the handle (see
  // blas.cpp). Throws Error(device) when the library cannot start.
  explicit Blas(hipStream_t home = nullptr, GemmTuning tuning = GemmTuning::use);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // Times the untuned choice (cublasGemmEx's for gemm(), the heuristic's first for gemm_add())
  // against up to options.candidates algorithms cuBLASLt's heuristic offers for this GEMM (gemm()
  // with this beta, or gemm_add() when add_elsewhere, with ldd = ldc), on random data in buffers
  // of its own, and keeps the fastest, if 1% faster than the untuned one, for every Blas of the
  // process on this Blas's device (cuBLAS's default ran some of the layer's shapes up to 11%
  // slower than the best candidate on an H200: bench gemm). Candidates must have one K split and
  // no reduction between blocks (on an H200 cuBLAS offered no others for the layer's shapes:
  // scripts/probes/gemm_algo_probe.cu). The choice serves calls whose four pointers are 256-byte
  // aligned (as hipMalloc's); others take the untuned choice. Every candidate runs here, so a
  // chosen kernel is loaded before any operation calls it. Allocates, launches and waits for the
  // device: call it where nothing waits on a flag (an operation's warm-up), never inside an
  // operation. One tuning at a time per device (another thread's call waits). Does nothing with
  // 0 candidates, for GemmTuning::off, or when the shape was tuned on this device before. Returns
  // the choices timed, the untuned one included (0 when it did nothing).
  int tune(long m, long n, long k, long lda, long ldb, long ldc, float beta = 0.0f, bool add_elsewhere = false,
           TuneOptions options = {});
  // What this Blas's calls of that GEMM (256-byte aligned) run: untuned for GemmTuning::off or a
  // shape no Blas of the process tuned on this device.
  GemmChoice choice(long m, long n, long k, long lda, long ldb, long ldc, float beta = 0.0f,
                    bool add_elsewhere = false) const;

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
