// The GPU platform layer: Caravan's GPU code is written against the HIP API. On AMD this header
// includes HIP itself; on NVIDIA it maps the HIP subset Caravan uses onto CUDA with aliases and
// inline functions (no blanket #define renames), so that vendor differences stay in this file.
#pragma once

// AMD: hipcc defines __HIP_PLATFORM_AMD__ only once hip_runtime.h is in, so the HIP language
// (__HIP__, set by clang for every file hipcc compiles) also selects it.
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)
#define CARAVAN_GPU_AMD 1
#include <hip/hip_runtime.h>
#else
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

using hipError_t = cudaError_t;
using hipStream_t = cudaStream_t;
using hipEvent_t = cudaEvent_t;
using hipDeviceProp_t = cudaDeviceProp;
using hipMemcpyKind = cudaMemcpyKind;
using hipPitchedPtr = cudaPitchedPtr;
using hipExtent = cudaExtent;
using hipPos = cudaPos;
using hipMemcpy3DParms = cudaMemcpy3DParms;
inline constexpr hipError_t hipSuccess = cudaSuccess;
inline constexpr hipError_t hipErrorNoDevice = cudaErrorNoDevice;
inline constexpr hipError_t hipErrorInsufficientDriver = cudaErrorInsufficientDriver;
inline constexpr hipError_t hipErrorNotReady = cudaErrorNotReady;
inline constexpr hipError_t hipErrorPeerAccessAlreadyEnabled = cudaErrorPeerAccessAlreadyEnabled;
inline constexpr hipMemcpyKind hipMemcpyDefault = cudaMemcpyDefault;  // direction inferred (unified addressing)
inline constexpr unsigned hipStreamNonBlocking = cudaStreamNonBlocking;
inline constexpr unsigned hipEventDisableTiming = cudaEventDisableTiming;
// hipHostMalloc flags: pinned, visible to every device, mapped into their address spaces.
inline constexpr unsigned hipHostMallocPortable = cudaHostAllocPortable;
inline constexpr unsigned hipHostMallocMapped = cudaHostAllocMapped;
// hipHostRegister flags: pin memory allocated elsewhere, for every device, mapped.
inline constexpr unsigned hipHostRegisterPortable = cudaHostRegisterPortable;
inline constexpr unsigned hipHostRegisterMapped = cudaHostRegisterMapped;
inline constexpr hipError_t hipErrorHostMemoryAlreadyRegistered = cudaErrorHostMemoryAlreadyRegistered;

inline hipError_t hipGetDeviceCount(int* count) { return cudaGetDeviceCount(count); }
inline hipError_t hipGetDeviceProperties(hipDeviceProp_t* prop, int device) { return cudaGetDeviceProperties(prop, device); }
inline hipError_t hipRuntimeGetVersion(int* version) { return cudaRuntimeGetVersion(version); }
inline hipError_t hipDriverGetVersion(int* version) { return cudaDriverGetVersion(version); }
inline hipError_t hipGetLastError() { return cudaGetLastError(); }
// A kernel launch that returns its own status (a <<<>>> launch leaves it in the thread's last
// error, mixed with whatever the application left there).
inline hipError_t hipLaunchKernel(const void* kernel, dim3 grid, dim3 block, void** args, std::size_t shared_bytes,
                                  hipStream_t stream) {
  return cudaLaunchKernel(kernel, grid, block, args, shared_bytes, stream);
}
inline const char* hipGetErrorName(hipError_t e) { return cudaGetErrorName(e); }
inline const char* hipGetErrorString(hipError_t e) { return cudaGetErrorString(e); }

// Devices and peers.
inline hipError_t hipSetDevice(int device) { return cudaSetDevice(device); }
inline hipError_t hipGetDevice(int* device) { return cudaGetDevice(device); }
inline hipError_t hipDeviceGetPCIBusId(char* id, int length, int device) { return cudaDeviceGetPCIBusId(id, length, device); }
inline hipError_t hipDeviceCanAccessPeer(int* can, int device, int peer) { return cudaDeviceCanAccessPeer(can, device, peer); }
inline hipError_t hipDeviceEnablePeerAccess(int peer, unsigned flags) { return cudaDeviceEnablePeerAccess(peer, flags); }
inline hipError_t hipDeviceSynchronize() { return cudaDeviceSynchronize(); }
inline hipError_t hipMemGetInfo(std::size_t* free, std::size_t* total) { return cudaMemGetInfo(free, total); }

// Memory.
inline hipError_t hipMalloc(void** ptr, std::size_t bytes) { return cudaMalloc(ptr, bytes); }
inline hipError_t hipFree(void* ptr) { return cudaFree(ptr); }
inline hipError_t hipHostMalloc(void** ptr, std::size_t bytes, unsigned flags) { return cudaHostAlloc(ptr, bytes, flags); }
inline hipError_t hipHostFree(void* ptr) { return cudaFreeHost(ptr); }
inline hipError_t hipHostRegister(void* ptr, std::size_t bytes, unsigned flags) { return cudaHostRegister(ptr, bytes, flags); }
inline hipError_t hipHostUnregister(void* ptr) { return cudaHostUnregister(ptr); }
inline hipError_t hipMemset(void* ptr, int value, std::size_t bytes) { return cudaMemset(ptr, value, bytes); }
// What an address points into (device, pinned host, managed, or memory the runtime does not know).
using hipPointerAttribute_t = cudaPointerAttributes;
using hipMemoryType = cudaMemoryType;
inline constexpr hipMemoryType hipMemoryTypeUnregistered = cudaMemoryTypeUnregistered;
inline constexpr hipMemoryType hipMemoryTypeHost = cudaMemoryTypeHost;
inline constexpr hipMemoryType hipMemoryTypeDevice = cudaMemoryTypeDevice;
inline constexpr hipMemoryType hipMemoryTypeManaged = cudaMemoryTypeManaged;
inline hipError_t hipPointerGetAttributes(hipPointerAttribute_t* attributes, const void* ptr) {
  return cudaPointerGetAttributes(attributes, ptr);
}

// Copies (every pointer is a unified address: hipMemcpyDefault infers the direction).
inline hipError_t hipMemcpy(void* dst, const void* src, std::size_t bytes, hipMemcpyKind kind) {
  return cudaMemcpy(dst, src, bytes, kind);
}
inline hipError_t hipMemcpyAsync(void* dst, const void* src, std::size_t bytes, hipMemcpyKind kind, hipStream_t stream) {
  return cudaMemcpyAsync(dst, src, bytes, kind, stream);
}
inline hipError_t hipMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device, std::size_t bytes,
                                     hipStream_t stream) {
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, stream);
}
inline hipError_t hipMemcpy2DAsync(void* dst, std::size_t dpitch, const void* src, std::size_t spitch, std::size_t width,
                                   std::size_t height, hipMemcpyKind kind, hipStream_t stream) {
  return cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream);
}
inline hipError_t hipMemcpy3DAsync(const hipMemcpy3DParms* p, hipStream_t stream) { return cudaMemcpy3DAsync(p, stream); }
inline hipPitchedPtr make_hipPitchedPtr(void* ptr, std::size_t pitch, std::size_t xsize, std::size_t ysize) {
  return make_cudaPitchedPtr(ptr, pitch, xsize, ysize);
}
inline hipExtent make_hipExtent(std::size_t w, std::size_t h, std::size_t d) { return make_cudaExtent(w, h, d); }

// Streams and events.
inline hipError_t hipStreamCreateWithFlags(hipStream_t* stream, unsigned flags) { return cudaStreamCreateWithFlags(stream, flags); }
inline hipError_t hipStreamDestroy(hipStream_t stream) { return cudaStreamDestroy(stream); }
inline hipError_t hipStreamSynchronize(hipStream_t stream) { return cudaStreamSynchronize(stream); }
inline hipError_t hipEventCreateWithFlags(hipEvent_t* event, unsigned flags) { return cudaEventCreateWithFlags(event, flags); }
inline hipError_t hipEventDestroy(hipEvent_t event) { return cudaEventDestroy(event); }
inline hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream) { return cudaEventRecord(event, stream); }
inline hipError_t hipEventSynchronize(hipEvent_t event) { return cudaEventSynchronize(event); }
inline hipError_t hipEventQuery(hipEvent_t event) { return cudaEventQuery(event); }

// More of the subset, for kernels/ (overlap operations and their benchmarks).
inline constexpr hipMemcpyKind hipMemcpyDeviceToHost = cudaMemcpyDeviceToHost;
inline hipError_t hipMemsetAsync(void* ptr, int value, std::size_t bytes, hipStream_t stream) {
  return cudaMemsetAsync(ptr, value, bytes, stream);
}
inline hipError_t hipMemset2DAsync(void* ptr, std::size_t pitch, int value, std::size_t width, std::size_t height,
                                   hipStream_t stream) {
  return cudaMemset2DAsync(ptr, pitch, value, width, height, stream);
}
inline hipError_t hipStreamWaitEvent(hipStream_t stream, hipEvent_t event, unsigned flags) {
  return cudaStreamWaitEvent(stream, event, flags);
}
inline hipError_t hipEventElapsedTime(float* ms, hipEvent_t start, hipEvent_t stop) { return cudaEventElapsedTime(ms, start, stop); }
inline hipError_t hipEventCreate(hipEvent_t* event) { return cudaEventCreate(event); }
inline hipError_t hipStreamCreateWithPriority(hipStream_t* stream, unsigned flags, int priority) {
  return cudaStreamCreateWithPriority(stream, flags, priority);
}
inline hipError_t hipDeviceGetStreamPriorityRange(int* least, int* greatest) {
  return cudaDeviceGetStreamPriorityRange(least, greatest);
}
using hipFuncAttributes = cudaFuncAttributes;
// Also loads the kernel's module if it was not loaded yet (lazy loading).
inline hipError_t hipFuncGetAttributes(hipFuncAttributes* attributes, const void* func) {
  return cudaFuncGetAttributes(attributes, func);
}

// Kernels that need more than 48 KiB of dynamic shared memory must say so before their launch.
using hipFuncAttribute = cudaFuncAttribute;
inline constexpr hipFuncAttribute hipFuncAttributeMaxDynamicSharedMemorySize = cudaFuncAttributeMaxDynamicSharedMemorySize;
inline hipError_t hipFuncSetAttribute(const void* func, hipFuncAttribute attribute, int value) {
  return cudaFuncSetAttribute(func, attribute, value);
}

// Inter-process memory handles: one process exports a device allocation, others on the same
// host map it (the cross-process GPU symmetric heap).
using hipIpcMemHandle_t = cudaIpcMemHandle_t;
inline constexpr unsigned hipIpcMemLazyEnablePeerAccess = cudaIpcMemLazyEnablePeerAccess;
inline hipError_t hipIpcGetMemHandle(hipIpcMemHandle_t* handle, void* ptr) { return cudaIpcGetMemHandle(handle, ptr); }
inline hipError_t hipIpcOpenMemHandle(void** ptr, hipIpcMemHandle_t handle, unsigned flags) {
  return cudaIpcOpenMemHandle(ptr, handle, flags);
}
inline hipError_t hipIpcCloseMemHandle(void* ptr) { return cudaIpcCloseMemHandle(ptr); }

// Graphs: a stream's work captured once and replayed with one launch.
using hipGraph_t = cudaGraph_t;
using hipGraphExec_t = cudaGraphExec_t;
using hipStreamCaptureMode = cudaStreamCaptureMode;
inline constexpr hipStreamCaptureMode hipStreamCaptureModeThreadLocal = cudaStreamCaptureModeThreadLocal;
inline hipError_t hipStreamBeginCapture(hipStream_t stream, hipStreamCaptureMode mode) {
  return cudaStreamBeginCapture(stream, mode);
}
inline hipError_t hipStreamEndCapture(hipStream_t stream, hipGraph_t* graph) { return cudaStreamEndCapture(stream, graph); }
inline hipError_t hipGraphInstantiate(hipGraphExec_t* exec, hipGraph_t graph, void*, void*, std::size_t) {
  return cudaGraphInstantiate(exec, graph, 0);
}
inline hipError_t hipGraphLaunch(hipGraphExec_t exec, hipStream_t stream) { return cudaGraphLaunch(exec, stream); }
inline hipError_t hipGraphExecDestroy(hipGraphExec_t exec) { return cudaGraphExecDestroy(exec); }
inline hipError_t hipGraphDestroy(hipGraph_t graph) { return cudaGraphDestroy(graph); }

// Stream memory operations (HIP: hipStreamWaitValue64 / hipStreamWriteValue64): a stream waits
// until a 64-bit word in device memory (local or a peer's) reaches a value, or writes one, in
// stream order, without a kernel. CUDA has them only in the driver API; they are looked up
// through the runtime (cudaGetDriverEntryPointByVersion) so that no binary links libcuda and
// machines without a driver still start.
inline constexpr unsigned hipStreamWaitValueGte = 0x0;  // CU_STREAM_WAIT_VALUE_GEQ
hipError_t hipStreamWaitValue64(hipStream_t stream, void* ptr, std::uint64_t value, unsigned flags,
                                std::uint64_t mask = ~std::uint64_t{0});
hipError_t hipStreamWriteValue64(hipStream_t stream, void* ptr, std::uint64_t value, unsigned flags);
#endif

// __launch_bounds__(threads, blocks): at most `threads` a block, and registers for at least
// `blocks` resident blocks per SM. HIP reads the second number as waves per execution unit,
// another quantity, so on AMD only the first is given.
#if defined(CARAVAN_GPU_AMD)
#define CARAVAN_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads)
#else
#define CARAVAN_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
#endif

// For a kernel parameter the kernel only reads and indexes at run time (a heap view's bases):
// on NVIDIA it stays in the parameter space instead of being copied to a local-memory stack
// frame first.
#if defined(CARAVAN_GPU_AMD)
#define CARAVAN_GRID_CONSTANT
#else
#define CARAVAN_GRID_CONSTANT __grid_constant__
#endif

#include <caravan/error.h>

#include <string>

namespace caravan::gpu {

// What the runtime says a pointer points into. The field differs between CUDA and HIP, and
// between HIP 5 (memoryType, isManaged) and HIP 6 (type, as CUDA).
enum class PointerMemory { device, host, managed, unknown };
inline PointerMemory pointer_memory(const hipPointerAttribute_t& a) {
#if defined(CARAVAN_GPU_AMD) && HIP_VERSION_MAJOR < 6
  if (a.isManaged) return PointerMemory::managed;
  const hipMemoryType type = a.memoryType;
#else
  const hipMemoryType type = a.type;
  if (type == hipMemoryTypeManaged) return PointerMemory::managed;
#endif
  if (type == hipMemoryTypeDevice) return PointerMemory::device;
  if (type == hipMemoryTypeHost) return PointerMemory::host;
  return PointerMemory::unknown;
}

// Device memory that other GPUs write and read while kernels here poll it (the symmetric heap).
// On AMD it must be fine-grained: hipMalloc's coarse-grained memory is coherent across GPUs
// only at synchronisation points, so a kernel polling a flag a peer writes could keep reading
// its own L2's stale copy. On NVIDIA every device allocation is coherent so.
inline hipError_t malloc_peer_coherent(void** ptr, std::size_t bytes) {
#if defined(CARAVAN_GPU_AMD)
  return hipExtMallocWithFlags(ptr, bytes, hipDeviceMallocFinegrained);
#else
  return hipMalloc(ptr, bytes);
#endif
}

// The device's copy engines (CUDA's asyncEngineCount; HIP 5 does not report them: 0).
inline int copy_engine_count(const hipDeviceProp_t& prop) {
#if defined(CARAVAN_GPU_AMD) && HIP_VERSION_MAJOR < 6
  (void)prop;
  return 0;
#else
  return prop.asyncEngineCount;
#endif
}

// Throws Error(device) naming the call, its location, the error's name and text. Clears the
// runtime's last-error state so one failure is reported once.
[[noreturn]] void throw_hip_error(hipError_t error, const char* call, const char* file, int line);

}  // namespace caravan::gpu

#include <tuple>
#include <type_traits>

#define CARAVAN_HIP_CHECK(call)                                                   \
  do {                                                                            \
    hipError_t caravan_hip_status_ = (call);                                      \
    if (caravan_hip_status_ != hipSuccess)                                        \
      ::caravan::gpu::throw_hip_error(caravan_hip_status_, #call, __FILE__, __LINE__); \
  } while (0)

namespace caravan::gpu {

// Launches `kernel` and checks the launch by its own status (hipLaunchKernel), not by the
// thread's last error, which may hold an error the application left there (a check by
// hipGetLastError would take it as this launch's failure, and clear it). Each argument becomes
// the type of its parameter first, as a <<<>>> launch converts them.
template <class... Params, class... Args>
void launch_checked(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes, hipStream_t stream,
                    Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "launch_checked: one argument per kernel parameter");
  std::tuple<std::remove_cv_t<std::remove_reference_t<Params>>...> values(std::forward<Args>(args)...);
  std::apply(
      [&](auto&... value) {
        void* pointers[] = {static_cast<void*>(&value)..., nullptr};
        CARAVAN_HIP_CHECK(
            hipLaunchKernel(reinterpret_cast<const void*>(kernel), grid, block, pointers, shared_bytes, stream));
      },
      values);
}

// Makes `device` current for a scope and puts the caller's device back at its end: the runtime
// builds queues, streams and buffers on the application's threads (the first copy() makes every
// channel), and a thread must not come back on another GPU. A failed restore is cleared, so that
// it does not surface as a later, unrelated call's error.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (hipGetDevice(&previous_) != hipSuccess) {
      (void)hipGetLastError();
      previous_ = -1;
    }
    CARAVAN_HIP_CHECK(hipSetDevice(device));
  }
  ~ScopedDevice() {
    int now = -1;
    if (previous_ < 0 || (hipGetDevice(&now) == hipSuccess && now == previous_)) return;
    if (hipSetDevice(previous_) != hipSuccess) (void)hipGetLastError();
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace caravan::gpu
