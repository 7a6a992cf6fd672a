#include "runtime/gpu/op_kernel.h"

#include "runtime/gpu/grid_copy.cuh"

#include <caravan/error.h>

namespace caravan::gpu {
namespace {

constexpr int kThreads = 256;

// Each op is cut into units of w bytes, w the widest of 16, 8, 4, 2, 1 that divides its element
// size, strides and both addresses; unit u of op i is piece u % pieces of element u / pieces.
// The units of all ops are numbered one after another (first[i] = the first unit of op i) and the
// grid strides over them, so consecutive threads move consecutive pieces of one element, or the
// same piece of consecutive elements.
struct Plan {
  std::uint64_t first[kMaxKernelOps + 1];
  std::uint32_t width[kMaxKernelOps];
};

__device__ inline void move(const std::byte* src, std::byte* dst, std::uint32_t width) {
  switch (width) {
    case 16: *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src); break;
    case 8: *reinterpret_cast<std::uint64_t*>(dst) = *reinterpret_cast<const std::uint64_t*>(src); break;
    case 4: *reinterpret_cast<std::uint32_t*>(dst) = *reinterpret_cast<const std::uint32_t*>(src); break;
    case 2: *reinterpret_cast<std::uint16_t*>(dst) = *reinterpret_cast<const std::uint16_t*>(src); break;
    default: *dst = *src;
  }
}

__global__ void __launch_bounds__(kThreads) op_batch_kernel(KernelOpBatch batch, Plan plan) {
  const std::uint64_t total = plan.first[batch.count];
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * kThreads;
  int op = 0;
  for (std::uint64_t u = blockIdx.x * static_cast<std::uint64_t>(kThreads) + threadIdx.x; u < total; u += stride) {
    while (u >= plan.first[op + 1]) ++op;  // units only grow along a thread's walk
    const KernelOp& o = batch.ops[op];
    const std::uint32_t w = plan.width[op];
    const std::uint64_t pieces = o.elem / w, local = u - plan.first[op];
    const std::uint64_t element = local / pieces, byte = (local % pieces) * w;
    move(o.src + static_cast<std::int64_t>(element) * o.src_stride + byte,
         o.dst + static_cast<std::int64_t>(element) * o.dst_stride + byte, w);
  }
}

// One contiguous, 16-byte aligned run (what xgmi requests are): the unrolled grid copy.
__global__ void __launch_bounds__(kThreads) contiguous_kernel(const uint4* src, uint4* dst, std::uint64_t vectors) {
  dev::grid_copy16(src, dst, vectors, blockIdx.x * static_cast<std::uint64_t>(kThreads) + threadIdx.x,
                   static_cast<std::uint64_t>(gridDim.x) * kThreads);
}

std::uint32_t widest_unit(const KernelOp& o) {
  const auto bits = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(o.src) | reinterpret_cast<std::uintptr_t>(o.dst)) |
                    o.elem | static_cast<std::uint64_t>(o.src_stride) | static_cast<std::uint64_t>(o.dst_stride);
  for (std::uint32_t w : {16u, 8u, 4u, 2u})
    if (bits % w == 0) return w;
  return 1;
}

}  // namespace

void launch_op_batch(const KernelOpBatch& batch, hipStream_t stream, unsigned max_blocks) {
  if (batch.count < 0 || batch.count > kMaxKernelOps)
    throw Error(Errc::invalid_argument, "launch_op_batch: count must be in [0, " + std::to_string(kMaxKernelOps) + "], is " +
                                            std::to_string(batch.count));
  if (batch.count == 1 && batch.ops[0].count == 1 && widest_unit(batch.ops[0]) == 16) {
    const KernelOp& o = batch.ops[0];
    const std::uint64_t vectors = o.elem / 16;
    if (vectors == 0) return;
    const std::uint64_t per_block = static_cast<std::uint64_t>(kThreads) * dev::kGridCopyUnroll;
    const std::uint64_t blocks = std::min<std::uint64_t>((vectors + per_block - 1) / per_block, max_blocks ? max_blocks : 1024);
    contiguous_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(o.src),
                                                                              reinterpret_cast<uint4*>(o.dst), vectors);
    CARAVAN_HIP_CHECK(hipGetLastError());
    return;
  }
  Plan plan{};
  for (int i = 0; i < batch.count; ++i) {
    const KernelOp& o = batch.ops[i];
    plan.width[i] = widest_unit(o);
    plan.first[i + 1] = plan.first[i] + (o.elem == 0 ? 0 : o.count * (o.elem / plan.width[i]));
  }
  const std::uint64_t units = plan.first[batch.count];
  if (units == 0) return;
  // Enough blocks to fill the GPU a few times over; the grid strides over the rest.
  const std::uint64_t blocks = std::min<std::uint64_t>((units + kThreads - 1) / kThreads, max_blocks ? max_blocks : 2048);
  op_batch_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(batch, plan);
  CARAVAN_HIP_CHECK(hipGetLastError());
}

void preload_op_kernel(int device) {
  int current = 0;
  CARAVAN_HIP_CHECK(hipGetDevice(&current));
  CARAVAN_HIP_CHECK(hipSetDevice(device));
  hipFuncAttributes attributes;
  hipError_t status = hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&op_batch_kernel));
  if (status == hipSuccess) status = hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&contiguous_kernel));
  CARAVAN_HIP_CHECK(hipSetDevice(current));
  CARAVAN_HIP_CHECK(status);
}

}  // namespace caravan::gpu
