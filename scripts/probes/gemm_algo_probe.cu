// Probe (not part of the build): how much faster than cuBLAS's default choice (cublasGemmEx,
// CUBLAS_GEMM_DEFAULT, what the library's Blas::gemm and the bulk baseline call) the fastest of
// cuBLASLt's heuristic candidates runs the transformer layer's GEMMs, on one GPU. For each shape
// (a rank's GEMM at tensor-parallel degree TP, and the row blocks the overlapped variants cut it
// into) it times, alternating within each round so that clocks and power drift hit all alike:
//   default   cublasGemmEx with CUBLAS_GEMM_DEFAULT
//   lt #i     cublasLtMatmul with the heuristic's i-th algorithm (i < 32; #0 is its first pick)
// Prints per shape the default's median (p10..p90), the heuristic's first pick's, the fastest
// candidate's and its ratio to the default. Outputs of every candidate are compared with the
// default's (the same bf16 inputs; an algorithm that differs by more than 1e-2 relative is
// dropped and reported), so a fast wrong kernel cannot win.
// Build (CUDA toolkit only):
//   nvcc -arch=sm_90 -O2 -std=c++20 -o gemm_algo_probe scripts/probes/gemm_algo_probe.cu -lcublasLt -lcublas
// Run: ./gemm_algo_probe [rounds, default 15] [shape name part]
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include "check.h"

namespace {

// Row-major C[m x n] = A[m x k] B[k x n].
struct Shape {
  const char* name;
  long m, k, n;
};
const Shape kShapes[] = {
    // Llama-3 70B at TP 4, 8192 tokens: whole GEMMs, a shard's rows (AllGather+GEMM's chunks), a
    // ring part's rows (GEMM+ReduceScatter x4 parts).
    {"70B qkv TP4", 8192, 8192, 2560},
    {"70B qkv TP4 shard", 2048, 8192, 2560},
    {"70B o-proj TP4", 8192, 2048, 8192},
    {"70B o-proj TP4 x4 part", 512, 2048, 8192},
    {"70B mlp-up TP4", 8192, 8192, 14336},
    {"70B mlp-up TP4 shard", 2048, 8192, 14336},
    {"70B mlp-down TP4", 8192, 7168, 8192},
    {"70B mlp-down TP4 x2 part", 1024, 7168, 8192},
    // Llama-3 8B at TP 4.
    {"8B qkv TP4", 8192, 4096, 1536},
    {"8B o-proj TP4", 8192, 1024, 4096},
    {"8B mlp-up TP4", 8192, 4096, 7168},
    {"8B mlp-up TP4 shard", 2048, 4096, 7168},
    {"8B mlp-down TP4", 8192, 3584, 4096},
    // 70B at TP 2.
    {"70B qkv TP2", 8192, 8192, 5120},
    {"70B mlp-up TP2", 8192, 8192, 28672},
    {"70B mlp-down TP2", 8192, 14336, 8192},
};
constexpr int kMaxAlgos = 32;
constexpr std::size_t kWorkspace = 32u << 20;  // as kernels/gpu/blas.cpp

void check_lt(cublasStatus_t s, const char* what, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::printf("line %d: %s: cublas status %d\n", line, what, s);
    std::exit(1);
  }
}
#define CL(x) check_lt((x), #x, __LINE__)

// Largest |a - b| / (max |b| + tiny) over the two outputs (copied to the host).
double relative_difference(const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b) {
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    if (!std::isfinite(x)) return INFINITY;
    worst = std::max(worst, std::abs(x - y));
    scale = std::max(scale, std::abs(y));
  }
  return worst / (scale + 1e-30);
}

struct Stats {
  double p10, median, p90;
};
Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5)]; };
  return {at(0.1), at(0.5), at(0.9)};
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 15;
  const std::string only = argc > 2 ? argv[2] : "";
  if (rounds < 3) {
    std::printf("rounds must be at least 3 (got %d)\n", rounds);
    return 1;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s; %d rounds; candidates alternate within each round; times in us (median, p10..p90)\n",
              prop.name, rounds);

  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t blas;
  CB(cublasCreate(&blas));
  cublasLtHandle_t lt;
  CL(cublasLtCreate(&lt));
  void* workspace;
  CK(cudaMalloc(&workspace, kWorkspace));
  CB(cublasSetStream(blas, stream));
  CB(cublasSetWorkspace(blas, workspace, kWorkspace));
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));

  for (const Shape& s : kShapes) {
    if (!only.empty() && std::string(s.name).find(only) == std::string::npos) continue;
    __nv_bfloat16 *a, *b, *c, *ref;
    CK(cudaMalloc(&a, sizeof(__nv_bfloat16) * s.m * s.k));
    CK(cudaMalloc(&b, sizeof(__nv_bfloat16) * s.k * s.n));
    CK(cudaMalloc(&c, sizeof(__nv_bfloat16) * s.m * s.n));
    CK(cudaMalloc(&ref, sizeof(__nv_bfloat16) * s.m * s.n));
    probe_fill<<<1024, 256, 0, stream>>>(a, s.m * s.k, 0x1234u);
    probe_fill<<<1024, 256, 0, stream>>>(b, s.k * s.n, 0x5678u);
    CK(cudaGetLastError());
    const float one = 1.0f, zero = 0.0f;

    // Column-major D^T[n x m] = B^T[n x k] A^T[k x m] (row-major operands, swapped).
    cublasLtMatmulDesc_t op;
    CL(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasLtMatrixLayout_t la, lb, lc;
    CL(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.n, s.k, s.n));
    CL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.k, s.m, s.k));
    CL(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, s.n, s.m, s.n));
    cublasLtMatmulPreference_t preference;
    CL(cublasLtMatmulPreferenceCreate(&preference));
    const std::uint64_t workspace_bytes = kWorkspace;
    CL(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                            sizeof workspace_bytes));
    cublasLtMatmulHeuristicResult_t found[kMaxAlgos];
    int count = 0;
    CL(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, preference, kMaxAlgos, found, &count));

    // Candidate -1 is the default; i >= 0 the heuristic's i-th.
    auto run = [&](int candidate, __nv_bfloat16* out) {
      if (candidate < 0)
        CB(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(s.n), static_cast<int>(s.m),
                        static_cast<int>(s.k), &one, b, CUDA_R_16BF, static_cast<int>(s.n), a, CUDA_R_16BF,
                        static_cast<int>(s.k), &zero, out, CUDA_R_16BF, static_cast<int>(s.n), CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT));
      else
        CL(cublasLtMatmul(lt, op, &one, b, la, a, lb, &zero, out, lc, out, lc, &found[candidate].algo, workspace,
                          kWorkspace, stream));
    };

    // The default's output is the check for every other candidate.
    std::vector<__nv_bfloat16> expected(s.m * s.n), got(s.m * s.n);
    run(-1, ref);
    CK(cudaStreamSynchronize(stream));
    CK(cudaMemcpy(expected.data(), ref, sizeof(__nv_bfloat16) * expected.size(), cudaMemcpyDeviceToHost));
    std::vector<int> candidates{-1};
    int rejected = 0;
    for (int i = 0; i < count; ++i) {
      CK(cudaMemsetAsync(c, 0xff, sizeof(__nv_bfloat16) * s.m * s.n, stream));  // poison: NaN
      run(i, c);
      CK(cudaStreamSynchronize(stream));
      CK(cudaMemcpy(got.data(), c, sizeof(__nv_bfloat16) * got.size(), cudaMemcpyDeviceToHost));
      if (relative_difference(got, expected) < 1e-2)
        candidates.push_back(i);
      else
        ++rejected;
    }

    std::vector<std::vector<double>> times(candidates.size());
    for (int warm = 0; warm < 2; ++warm)
      for (int cand : candidates) run(cand, c);
    for (int r = 0; r < rounds; ++r)
      for (std::size_t j = 0; j < candidates.size(); ++j) {
        CK(cudaEventRecord(start, stream));
        run(candidates[j], c);
        CK(cudaEventRecord(stop, stream));
        CK(cudaEventSynchronize(stop));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, start, stop));
        times[j].push_back(ms * 1e3);
      }

    const Stats base = stats(times[0]);
    std::size_t best = 0;
    for (std::size_t j = 1; j < candidates.size(); ++j)
      if (stats(times[j]).median < stats(times[best]).median) best = j;
    const double tflops = 2.0 * s.m * s.n * s.k / (base.median * 1e-6) / 1e12;
    std::printf("%-26s %5ld x %5ld x %5ld  default %8.1f (%.1f..%.1f, %4.0f TFLOP/s)", s.name, s.m, s.k, s.n,
                base.median, base.p10, base.p90, tflops);
    if (candidates.size() > 1 && candidates[1] == 0) {
      const Stats first = stats(times[1]);
      std::printf("  lt #0 %8.1f (%.3fx)", first.median, base.median / first.median);
    }
    // Each candidate's configuration: a K split above 1 or a reduction scheme means blocks that
    // combine partial sums (in-place schemes make blocks wait for each other).
    for (std::size_t j = 1; j < candidates.size(); ++j) {
      const cublasLtMatmulAlgo_t& algo = found[candidates[j]].algo;
      int32_t id = 0, split_k = 1;
      uint32_t tile = 0, reduction = 0, swizzle = 0, custom = 0, stages = 0;
      uint16_t cluster = 0;
      size_t written = 0;
      CL(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &written));
      CL(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &written));
      CL(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k, sizeof split_k,
                                              &written));
      CL(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                              sizeof reduction, &written));
      CL(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof swizzle,
                                              &written));
      CL(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof custom,
                                              &written));
      CL(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &written));
      CL(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster,
                                              &written));
      std::printf(
          "    lt #%d: %8.1f us  id %d tile %u split-k %d reduction %u swizzle %u custom %u stages %u cluster %u"
          " workspace %zu\n",
          candidates[j], stats(times[j]).median, id, tile, split_k, reduction, swizzle, custom, stages, cluster,
          found[candidates[j]].workspaceSize);
    }
    const Stats top = stats(times[best]);
    std::printf("  best %s#%d %8.1f (%.1f..%.1f) %.3fx  [%d candidates, %d rejected]\n",
                candidates[best] < 0 ? "default" : "lt ", candidates[best], top.median, top.p10, top.p90,
                base.median / top.median, count, rejected);
    // The fastest of 30-odd medians is biased low (the luckiest draw wins): time the winner
    // against the default again, alternating, in fresh rounds.
    if (best != 0) {
      std::vector<double> again[2];
      for (int r = 0; r < rounds; ++r)
        for (int j = 0; j < 2; ++j) {
          CK(cudaEventRecord(start, stream));
          run(j == 0 ? -1 : candidates[best], c);
          CK(cudaEventRecord(stop, stream));
          CK(cudaEventSynchronize(stop));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, start, stop));
          again[j].push_back(ms * 1e3);
        }
      const Stats d = stats(again[0]), w = stats(again[1]);
      std::printf("%-26s confirm: default %8.1f (%.1f..%.1f)  lt #%d %8.1f (%.1f..%.1f)  %.3fx\n", "", d.median, d.p10,
                  d.p90, candidates[best], w.median, w.p10, w.p90, d.median / w.median);
    }

    CL(cublasLtMatmulPreferenceDestroy(preference));
    CL(cublasLtMatrixLayoutDestroy(la));
    CL(cublasLtMatrixLayoutDestroy(lb));
    CL(cublasLtMatrixLayoutDestroy(lc));
    CL(cublasLtMatmulDescDestroy(op));
    CK(cudaFree(a));
    CK(cudaFree(b));
    CK(cudaFree(c));
    CK(cudaFree(ref));
  }
  return 0;
}
