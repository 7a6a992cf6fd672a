// The SM-driven copy of the GPU layout-conversion channel (channels/gpu_convert_channel): a
// kernel that executes a batch of the DMA engine's byte operations (runtime/dma/transfer_ops.h)
// with the GPU's threads instead of its copy engines. Copy engines cost per row of a 2-D copy,
// so narrow strided runs (a layout conversion moving one 4-byte field at a time) crawl there;
// threads move one element each at memory speed. Plain types only: nvcc compiles this kernel
// alone (runtime/CMakeLists.txt), the batching lives in copy_queue.cpp.
#pragma once

#include "runtime/gpu/platform.h"

#include <cstdint>

namespace caravan::gpu {

// A group of strided operations (runtime/dma/interleave.h): `members` x `rows` copies of one op of
// `count` elements of `elem` bytes. Member m of row r moves element i from
// src + m * member_src + r * row_src + i * src_stride to dst + m * member_dst + r * row_dst +
// i * dst_stride (byte addresses the kernel's GPU can reach). A lone op is one member of one row.
struct KernelGroup {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  std::uint64_t elem = 0;
  std::uint64_t count = 0;
  std::int64_t src_stride = 0;
  std::int64_t dst_stride = 0;
  std::uint32_t members = 1;
  std::uint32_t rows = 1;
  std::int64_t member_src = 0, member_dst = 0;
  std::int64_t row_src = 0, row_dst = 0;
};

// Up to kMaxKernelGroups groups per launch (passed by value: no upload, no allocation).
inline constexpr int kMaxKernelGroups = 32;
struct KernelBatch {
  int count = 0;
  KernelGroup groups[kMaxKernelGroups];
};

// Enqueues one kernel on `stream` (of the current device) that performs every group of `batch`.
// Overlapping source and destination bytes give an unspecified result (as a copy engine's).
// `max_blocks` (0: the kernels' own caps, 1024 or 2048 blocks of 256 threads) bounds the grid,
// so that kernels of several requests on one GPU can run side by side instead of one after
// another in launch order.
void launch_op_batch(const KernelBatch& batch, hipStream_t stream, unsigned max_blocks = 0);
// Tests only: with `on`, every batch that the op kernel runs uses its 64-bit index form, which
// otherwise runs only where the units of one launch (plus one pass of the grid) reach 2^32 (4 GiB
// of 1-byte units), so that the random op tests cover it too. A single 16-byte aligned run still
// takes the contiguous kernel. Not for concurrent use with launches that expect the other form.
void force_wide_index_for_testing(bool on);
// Loads the kernels on `device` now (a first launch while peers wait on flags can stall); the
// calling thread's current device is left as it was.
void preload_op_kernel(int device);

}  // namespace caravan::gpu
