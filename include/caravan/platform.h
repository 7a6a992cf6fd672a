// What this build of Caravan can drive: whether GPU sources were compiled, and which devices
// the GPU runtime sees now.
#pragma once

#include <string>

namespace caravan {

struct GpuProbe {
  bool built = false;     // GPU sources were compiled into this build
  int device_count = 0;   // devices visible now (0 when none, or not built)
  std::string toolchain;  // e.g. "CUDA 13.0 (nvcc, sm_90)"; empty when not built
  std::string reason;     // why device_count is 0, when it is
};

GpuProbe probe_gpus();

}  // namespace caravan
