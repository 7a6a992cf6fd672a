// `caravan bench overlap`: the overlapped collectives+GEMM against the bulk-synchronous baseline.
// One command, two backends: the CPU backend (host symmetric heap, CPU tile GEMM; ranks started
// by `caravan run`) in bench_overlap.cpp, and the GPU backend (4 GPUs, cuBLAS/NCCL baseline) in
// kernels/gpu, reached through run_bench_overlap_gpu() when the build has a GPU.
#pragma once

#include <string>
#include <vector>

namespace caravan::app {

struct BenchOverlapArgs {
  std::string backend = "auto";        // auto (gpu when a device is present), cpu, gpu
  std::vector<std::string> operations;  // empty = all: ag_gemm, gemm_rs, gemm_as, ll_allgather
  std::vector<long> tokens;             // M values (total tokens); empty = the backend's defaults
  int world = 0;                        // ranks / GPUs; 0 = all there are
  int iterations = 20;
  int warmup = 5;
  bool check = true;                    // verify every variant against a float32 reference
  bool stamps = false;                  // GPU: gemm_rs phases on the GPU clock; ring and ce-push timelines (diagnostic)
  std::vector<std::string> shapes;      // GPU: "NAME:K:N" GEMMs measured instead of Llama's (see OverlapShape)
};

// A GEMM shape of --shape, for the GPU backend's ag_gemm, gemm_rs and gemm_as in place of the Llama
// shapes: K x N of the whole (unsplit) weight. Each operation splits it over the ranks as it does
// Llama's: AllGather+GEMM and GEMM+All-Scatter give each rank N / world columns, GEMM+ReduceScatter
// K / world rows of the inner dimension.
struct OverlapShape {
  std::string name;
  long k = 0, n = 0;
};
// Parses --shape values ("NAME:K:N", K and N positive multiples of 8, at most 2^20). Throws
// Error(invalid_argument) naming the value and the rule.
std::vector<OverlapShape> parse_overlap_shapes(const std::vector<std::string>& values);

// Implemented in bench_overlap_gpu.cpp when CARAVAN_HAVE_OVERLAP_GPU; prints its report (as
// --json asks: emit_report) and returns the process exit code.
int run_bench_overlap_gpu(const BenchOverlapArgs& args);

}  // namespace caravan::app
