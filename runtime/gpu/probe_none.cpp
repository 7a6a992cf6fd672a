// Built when the build has no GPU sources: CARAVAN_GPU=OFF, or AUTO and no GPU compiler found at
// configure time. CARAVAN_GPU_REASON (cmake/CaravanGpu.cmake) says which.
#include <caravan/platform.h>

#ifndef CARAVAN_GPU_REASON
#define CARAVAN_GPU_REASON "it was configured without GPU sources (CARAVAN_GPU)"
#endif

namespace caravan {

GpuProbe probe_gpus() {
  GpuProbe probe;
  probe.reason = "this build has no GPU support: " CARAVAN_GPU_REASON;
  return probe;
}

}  // namespace caravan
