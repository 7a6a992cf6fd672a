// Device primitives of the Hopper (sm_90a) kernels: mbarriers with transaction counts, TMA tile
// loads, shared-memory matrix descriptors for the 128-byte swizzle, named barriers and the wgmma
// fences. Include it only from files built for sm_90a (the sm90 library, kernels/gpu/CMakeLists.txt);
// everything but shared_address exists only where __CUDA_ARCH_FEAT_SM90_ALL is defined.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

namespace caravan::gpu::sm90 {

__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void barrier_init(std::uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count));
}
__device__ __forceinline__ void barrier_expect_bytes(std::uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void barrier_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(bar)) : "memory");
}
__device__ __forceinline__ void barrier_wait(std::uint64_t* bar, std::uint32_t parity) {
  const std::uint32_t address = shared_address(bar);
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (done == 0);
}

__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, std::uint64_t* bar, int inner, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
      "[%2];\n" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(shared_address(bar)), "r"(inner), "r"(outer)
      : "memory");
}

// A shared-memory matrix descriptor for the 128-byte swizzle (PTX ISA, "matrix descriptor").
// `leading` and `stride` are the byte offsets between core-matrix groups: for A (K-major) only
// `stride` (8 rows to the next 8 rows, 1024 bytes) is used; for B (N-major, since B is row-major
// k x n) `leading` steps 64 columns (one TMA box) and `stride` 8 rows of k.
__device__ __forceinline__ std::uint64_t descriptor(const void* p, std::uint32_t leading, std::uint32_t stride) {
  return static_cast<std::uint64_t>((shared_address(p) & 0x3FFFF) >> 4) |
         static_cast<std::uint64_t>((leading & 0x3FFFF) >> 4) << 16 |
         static_cast<std::uint64_t>((stride & 0x3FFFF) >> 4) << 32 | std::uint64_t{1} << 62;
}

// Synchronizes `threads` threads (whole warps) on hardware barrier `id` (0 is __syncthreads').
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace caravan::gpu::sm90
