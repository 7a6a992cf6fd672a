// The GPU platform layer: Caravan's GPU code is written against the HIP API. On AMD this header
// includes HIP itself; on NVIDIA it maps the HIP subset Caravan uses onto CUDA with aliases and
// inline functions (no blanket #define renames), so that vendor differences stay in this file.
#pragma once

#if defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#else
#include <cuda_runtime.h>

using hipError_t = cudaError_t;
using hipStream_t = cudaStream_t;
using hipEvent_t = cudaEvent_t;
using hipDeviceProp_t = cudaDeviceProp;
inline constexpr hipError_t hipSuccess = cudaSuccess;
inline constexpr hipError_t hipErrorNoDevice = cudaErrorNoDevice;
inline constexpr hipError_t hipErrorInsufficientDriver = cudaErrorInsufficientDriver;

inline hipError_t hipGetDeviceCount(int* count) { return cudaGetDeviceCount(count); }
inline hipError_t hipGetDeviceProperties(hipDeviceProp_t* prop, int device) { return cudaGetDeviceProperties(prop, device); }
inline hipError_t hipRuntimeGetVersion(int* version) { return cudaRuntimeGetVersion(version); }
inline hipError_t hipDriverGetVersion(int* version) { return cudaDriverGetVersion(version); }
inline hipError_t hipGetLastError() { return cudaGetLastError(); }
inline const char* hipGetErrorName(hipError_t e) { return cudaGetErrorName(e); }
inline const char* hipGetErrorString(hipError_t e) { return cudaGetErrorString(e); }
#endif

#include <caravan/error.h>

#include <string>

namespace caravan::gpu {

// Throws Error(device) naming the call, its location, the error's name and text. Clears the
// runtime's last-error state so one failure is reported once.
[[noreturn]] void throw_hip_error(hipError_t error, const char* call, const char* file, int line);

}  // namespace caravan::gpu

#define CARAVAN_HIP_CHECK(call)                                                   \
  do {                                                                            \
    hipError_t caravan_hip_status_ = (call);                                      \
    if (caravan_hip_status_ != hipSuccess)                                        \
      ::caravan::gpu::throw_hip_error(caravan_hip_status_, #call, __FILE__, __LINE__); \
  } while (0)
