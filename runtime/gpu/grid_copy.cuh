// The copy loop of the SM-driven copy kernels (runtime/gpu/op_kernel.cu for the DMA channels,
// kernels/gpu/sm_copy.cu for the overlapped collectives): the threads of a grid move 16-byte
// vectors, each thread keeping kUnroll loads in flight before its stores, which is what keeps a
// peer link busy from the SMs (one load at a time leaves it waiting on latency).
#pragma once

#include <cstdint>

namespace caravan::gpu::dev {

inline constexpr int kGridCopyUnroll = 4;

// Copies vectors [0, count) of src to dst; this thread takes first, first + stride, ... (first:
// its index in the grid, stride: the grid's thread count).
__device__ inline void grid_copy16(const uint4* src, uint4* dst, std::uint64_t count, std::uint64_t first,
                                   std::uint64_t stride) {
  std::uint64_t i = first;
  for (; i + (kGridCopyUnroll - 1) * stride < count; i += kGridCopyUnroll * stride) {
    uint4 v[kGridCopyUnroll];
#pragma unroll
    for (int u = 0; u < kGridCopyUnroll; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kGridCopyUnroll; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < count; i += stride) dst[i] = src[i];
}

}  // namespace caravan::gpu::dev
