// The device-side operations whose spelling differs between NVIDIA and AMD, for Caravan's
// kernels: shuffles within 32 lanes, the global timer, a pause while polling, and loads that skip
// the SM's L1 cache.
#pragma once

#include "runtime/gpu/platform.h"

#include <cstdint>

namespace caravan::gpu::dev {

// Shuffles within groups of 32 lanes, the warp the kernels are written for: a whole warp on
// NVIDIA, half of a 64-lane wavefront on AMD (width 32). A reduction over the "warps" of
// threadIdx.x / 32 therefore means the same on both.
template <class T>
__device__ inline T shfl_xor32(T v, int lane_mask) {
#if defined(CARAVAN_GPU_AMD)
  return __shfl_xor(v, lane_mask, 32);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}
template <class T>
__device__ inline T shfl_down32(T v, unsigned delta) {
#if defined(CARAVAN_GPU_AMD)
  return __shfl_down(v, delta, 32);
#else
  return __shfl_down_sync(0xffffffffu, v, delta);
#endif
}

// The GPU's global timer in ns. AMD: the constant-rate wall clock, taken to tick at 100 MHz
// (what gfx90a and gfx94x run it at; hipDeviceAttributeWallClockRate says so per device).
__device__ inline std::uint64_t global_ns() {
#if defined(CARAVAN_GPU_AMD)
#if defined(__HIP_DEVICE_COMPILE__)
  return static_cast<std::uint64_t>(wall_clock64()) * 10;
#else
  return 0;  // the host pass of a device function, never called
#endif
#else
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

// Gives the SM (compute unit) to other warps for about `ns` while polling.
__device__ inline void pause_ns(unsigned ns) {
#if defined(CARAVAN_GPU_AMD)
  (void)ns;
  __builtin_amdgcn_s_sleep(1);  // about 64 clocks: the shortest sleep
#else
  __nanosleep(ns);
#endif
}

// A load that never hits this SM's L1 (data another GPU, a copy engine or another block may
// have written since). AMD: relaxed system-scope 8-byte atomic loads, which bypass the L1 and,
// on fine-grained memory (malloc_peer_coherent), see other GPUs' writes.
__device__ inline std::uint64_t load_l2(const std::uint64_t* p) {
#if defined(CARAVAN_GPU_AMD)
  return __hip_atomic_load(const_cast<std::uint64_t*>(p), __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  return __ldcg(reinterpret_cast<const unsigned long long*>(p));
#endif
}
__device__ inline uint4 load_l2(const uint4* p) {
#if defined(CARAVAN_GPU_AMD)
  const auto* halves = reinterpret_cast<const std::uint64_t*>(p);
  const std::uint64_t lo = load_l2(halves), hi = load_l2(halves + 1);
  return uint4{static_cast<std::uint32_t>(lo), static_cast<std::uint32_t>(lo >> 32), static_cast<std::uint32_t>(hi),
               static_cast<std::uint32_t>(hi >> 32)};
#else
  return __ldcg(p);
#endif
}

}  // namespace caravan::gpu::dev
