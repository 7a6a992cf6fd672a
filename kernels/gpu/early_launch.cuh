// Programmatic dependent launch, shared by the kernels that use it (sm_copy.cu, elementwise.cu).
#pragma once

#include "runtime/gpu/platform.h"

namespace caravan::gpu {

// Launches `kernel` on `grid` blocks of `threads`. `early`: as a programmatic dependent of the
// kernel before it in `stream` (Hopper and later), so that its launch and block scheduling
// overlap that kernel's end. Such a kernel must begin with wait_for_prior_grid(), which holds it
// until the grid before it has completed and its writes are visible.
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), unsigned grid, unsigned threads, hipStream_t stream, bool early,
                   Args... args) {
#if defined(CARAVAN_GPU_AMD)
  (void)early;  // no programmatic dependent launch on AMD: always an ordinary launch
#else
  if (early) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(threads);
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    CARAVAN_HIP_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
    return;
  }
#endif
  launch_checked(kernel, dim3(grid), dim3(threads), 0, stream, args...);
}

// The first instruction of a kernel that may be launched early: a no-op for an ordinary launch.
__device__ inline void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel in the stream, if it was launched early, be scheduled now (it still
// waits in wait_for_prior_grid() for this grid's completion). Once every block has called it
// or exited, the dependent grid's blocks may take SM slots, so call it only where this grid no
// longer needs the SMs for blocks not yet resident.
__device__ inline void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace caravan::gpu
