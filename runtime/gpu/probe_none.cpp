// Built when no GPU toolchain was found at configure time.
#include <caravan/platform.h>

namespace caravan {

GpuProbe probe_gpus() {
  GpuProbe probe;
  probe.reason = "this build has no GPU support (no CUDA/HIP compiler was found when it was configured)";
  return probe;
}

}  // namespace caravan
