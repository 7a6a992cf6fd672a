// Built when a GPU toolchain was found: asks the GPU runtime what it sees.
#include "runtime/gpu/platform.h"

#include <caravan/platform.h>

#include <dlfcn.h>

#include <string>

namespace caravan {
namespace gpu {

void throw_hip_error(hipError_t error, const char* call, const char* file, int line) {
  (void)hipGetLastError();
  throw Error(Errc::device, std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                                hipGetErrorName(error) + " (" + hipGetErrorString(error) + ")");
}

}  // namespace gpu

GpuProbe probe_gpus() {
  GpuProbe probe;
  probe.built = true;
  int runtime_version = 0;
  (void)hipRuntimeGetVersion(&runtime_version);
#if defined(CARAVAN_GPU_AMD)
  probe.toolchain = "HIP " + std::to_string(runtime_version);
#else
  probe.toolchain = "CUDA " + std::to_string(runtime_version / 1000) + "." + std::to_string(runtime_version % 1000 / 10) +
                    " (nvcc)";
#endif
  int count = 0;
  hipError_t status = hipGetDeviceCount(&count);
  if (status != hipSuccess) {
    (void)hipGetLastError();
    probe.device_count = 0;
    probe.reason = std::string("the GPU runtime sees no device: ") + hipGetErrorName(status) + " (" +
                   hipGetErrorString(status) + ")";
#if !defined(CARAVAN_GPU_AMD)
    // Without any NVIDIA driver CUDA says "driver version is insufficient", which sends a user
    // of a machine with no GPU looking for a driver update: say what is missing.
    if (status == hipErrorInsufficientDriver && !dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD) &&
        !dlopen("libcuda.so.1", RTLD_LAZY))
      probe.reason =
          "no NVIDIA driver on this machine (libcuda.so.1 cannot be loaded; CUDA says "
          "cudaErrorInsufficientDriver)";
#endif
    return probe;
  }
  probe.device_count = count;
  if (count == 0) probe.reason = "the GPU runtime reports 0 devices";
  return probe;
}

}  // namespace caravan
