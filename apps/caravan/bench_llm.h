// `caravan bench llm`: the CPU backend lives in bench_llm.cpp, the GPU backend (one process
// driving the GPUs of this machine, NCCL + cuBLAS baseline) in bench_llm_gpu.cpp, built only
// with a GPU toolchain and NCCL.
#pragma once

#include <caravan/kernels/tp_layer.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace caravan::app {

struct LlmGpuRequest {
  kernels::TpLayerShape shape;
  int world = 4;
  int iterations = 10;
  int warmup = 3;
  std::vector<std::string> variants;  // empty: all; the NCCL baseline always
  bool check = true;
  std::string attention = "fused";  // or "unfused": GpuTpLayer's AttentionKind, every variant alike
};

// The GPU variant names `bench llm --backend gpu --variant` accepts (the baseline first).
std::vector<std::string> llm_gpu_variant_names();

// Runs the layer on GPUs 0..world-1 and returns, like the CPU backend's ranks: {"backend": "gpu",
// "world", "baseline", "results": [{"variant", "error", "total": [s per iteration], "steps":
// [[s per iteration] per step]}], ...}, where "error" is the relative error against the float32
// reference layer at a small shape with grouped-query attention (-1 with check off), and
// "diff_vs_baseline" the relative difference from the NCCL baseline's output at the measured
// shape. Throws Error(unsupported) when this build has no GPU backend.
nlohmann::json run_llm_gpu(const LlmGpuRequest& request);

}  // namespace caravan::app
