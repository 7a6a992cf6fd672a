#include "runtime/gpu/op_kernel.h"

#include "runtime/dma/interleave.h"
#include "runtime/gpu/grid_copy.cuh"

#include <caravan/error.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

namespace caravan::gpu {
namespace {

constexpr int kThreads = 256;
std::atomic<bool> g_force_wide_index{false};  // force_wide_index_for_testing
// Members of a group one thread moves per unit, and units per thread and pass: up to kChunk *
// kUnroll loads in flight per thread before its stores (one 4-byte load in flight per thread
// leaves HBM waiting on latency).
constexpr int kChunk = 4;
constexpr int kUnroll = 2;

// Each op is cut into units of w bytes, w the widest of 16, 8, 4, 2, 1 that divides its element
// size, strides and both addresses. Ops are taken in groups: consecutive ops with the same
// element size, count and strides whose sources (or destinations) interleave, element by element,
// as the fields of a layout conversion do (AOS -> SOA: field f of point i at base + 12 i + 4 f;
// runtime/dma/interleave.h). A unit is one piece of one element for up to kChunk members of its
// group: the thread loads the piece of each of those members, then stores each. Consecutive
// threads take consecutive elements, so each store instruction of a warp writes one contiguous
// run per member, and its loads of the interleaved side hit the sectors its other loads just
// brought in. (scripts/probes/conversion_probe.cu timed the shapes as kernels written for one
// 48 MiB AOS -> SOA case on an H100, against a plain copy of the same bytes: a thread per
// element 0.95-0.99; one pass per member, which reads the interleaved side once per member,
// 0.54-0.85; units numbered member by member within an element, whose stores scatter over every
// member's array, 0.66-0.72; a block staging whole records in shared memory 0.97-1.02, which
// needs each record contiguous and whole, so it is not what a generic batch can do.)
// Units of group g: count x pieces per chunk of kChunk members, chunk by chunk, element by element
// within a chunk; the units of all groups are numbered one after another (first[g] = the first
// unit of group g) and the grid strides over them.
struct Plan {
  std::uint64_t first[kMaxKernelOps + 1];
  std::uint32_t width[kMaxKernelOps];
  std::uint32_t pieces[kMaxKernelOps];  // units per element of one member: elem / width
  std::uint8_t lead[kMaxKernelOps];     // the group's first op
  std::uint8_t members[kMaxKernelOps];
  int groups = 0;
};
// Both travel by value as kernel arguments: within 4 KiB (CUDA before 12.1, and HIP), with room
// for the 256 bytes of hidden arguments an AMD code object adds.
static_assert(sizeof(KernelOpBatch) + sizeof(Plan) + 256 <= 4096,
              "the conversion kernel's arguments must fit in 4 KiB");

__device__ inline uint4 load_unit(const std::byte* src, std::uint32_t width) {
  uint4 v{};
  switch (width) {
    case 16: v = *reinterpret_cast<const uint4*>(src); break;
    case 8: {
      const auto x = *reinterpret_cast<const std::uint64_t*>(src);
      v.x = static_cast<unsigned>(x);
      v.y = static_cast<unsigned>(x >> 32);
      break;
    }
    case 4: v.x = *reinterpret_cast<const std::uint32_t*>(src); break;
    case 2: v.x = *reinterpret_cast<const std::uint16_t*>(src); break;
    default: v.x = static_cast<unsigned>(*reinterpret_cast<const unsigned char*>(src));
  }
  return v;
}

__device__ inline void store_unit(std::byte* dst, uint4 v, std::uint32_t width) {
  switch (width) {
    case 16: *reinterpret_cast<uint4*>(dst) = v; break;
    case 8:
      *reinterpret_cast<std::uint64_t*>(dst) = static_cast<std::uint64_t>(v.x) | static_cast<std::uint64_t>(v.y) << 32;
      break;
    case 4: *reinterpret_cast<std::uint32_t*>(dst) = v.x; break;
    case 2: *reinterpret_cast<std::uint16_t*>(dst) = static_cast<std::uint16_t>(v.x); break;
    default: *reinterpret_cast<unsigned char*>(dst) = static_cast<unsigned char>(v.x);
  }
}

// Index is std::uint32_t where every unit number (and a pass past the last) fits: 32-bit division
// is several times cheaper than 64-bit.
template <typename Index>
__global__ void __launch_bounds__(kThreads) op_batch_kernel(KernelOpBatch batch, Plan plan) {
  const auto total = static_cast<Index>(plan.first[plan.groups]);
  const Index pass = static_cast<Index>(gridDim.x) * (kThreads * kUnroll);
  int g = 0;
  for (Index base = static_cast<Index>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x; base < total; base += pass) {
    uint4 value[kUnroll][kChunk];
    std::byte* dst[kUnroll][kChunk];
    std::uint32_t width[kUnroll];
    int moved[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const Index u = base + static_cast<Index>(k * kThreads);
      moved[k] = 0;
      width[k] = 0;
      if (u >= total) continue;
      while (u >= static_cast<Index>(plan.first[g + 1])) ++g;  // units only grow along a thread's walk
      Index local = u - static_cast<Index>(plan.first[g]);
      int chunk = 0;
      if (plan.members[g] > kChunk) {
        const auto per_chunk = static_cast<Index>(batch.ops[plan.lead[g]].count * plan.pieces[g]);
        chunk = static_cast<int>(local / per_chunk);
        local -= static_cast<Index>(chunk) * per_chunk;
      }
      const Index pieces = plan.pieces[g];
      const Index element = pieces == 1 ? local : local / pieces;
      const std::uint32_t w = plan.width[g];
      const std::uint64_t byte = static_cast<std::uint64_t>(local - element * pieces) * w;
      const int first = plan.lead[g] + chunk * kChunk;
      moved[k] = min(kChunk, plan.members[g] - chunk * kChunk);
      width[k] = w;
#pragma unroll
      for (int m = 0; m < kChunk; ++m) {
        if (m < moved[k]) {
          const KernelOp& o = batch.ops[first + m];
          value[k][m] = load_unit(o.src + static_cast<std::int64_t>(element) * o.src_stride + byte, w);
          dst[k][m] = o.dst + static_cast<std::int64_t>(element) * o.dst_stride + byte;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k)
#pragma unroll
      for (int m = 0; m < kChunk; ++m)
        if (m < moved[k]) store_unit(dst[k][m], value[k][m], width[k]);
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
  // A contiguous run becomes a strided op of single units (the widest its addresses and length
  // allow), so that an element never holds more units than 32 bits count.
  KernelOpBatch shaped = batch;
  for (int i = 0; i < shaped.count; ++i) {
    KernelOp& o = shaped.ops[i];
    if (o.count != 1 || o.elem == 0) continue;
    const std::uint32_t w = widest_unit(o);
    o.count = o.elem / w;
    o.elem = o.src_stride = o.dst_stride = w;
  }
  Plan plan{};
  for (int i = 0; i < shaped.count;) {
    const KernelOp& o = shaped.ops[i];
    const auto j = static_cast<int>(
        dma::interleaved_group_end(shaped.ops, static_cast<std::size_t>(shaped.count), static_cast<std::size_t>(i)));
    std::uint64_t bits = 0;
    for (int m = i; m < j; ++m) bits |= widest_unit(shaped.ops[m]);
    std::uint32_t width = 16;
    while (bits % width != 0) width /= 2;
    const std::uint64_t pieces = o.elem / width;
    if (pieces > UINT32_MAX)
      throw Error(Errc::invalid_argument,
                  "launch_op_batch: op " + std::to_string(i) + " has elements of " + std::to_string(o.elem) +
                      " bytes; an element may hold at most 2^32 units of " + std::to_string(width) + " bytes");
    const auto members = static_cast<std::uint64_t>(j - i);
    const int g = plan.groups++;
    plan.lead[g] = static_cast<std::uint8_t>(i);
    plan.members[g] = static_cast<std::uint8_t>(members);
    plan.width[g] = width;
    plan.pieces[g] = static_cast<std::uint32_t>(pieces);
    plan.first[g + 1] = plan.first[g] + o.count * pieces * ((members + kChunk - 1) / kChunk);
    i = j;
  }
  const std::uint64_t units = plan.first[plan.groups];
  if (units == 0) return;
  // Enough blocks to fill the GPU a few times over; the grid strides over the rest.
  const std::uint64_t per_block = static_cast<std::uint64_t>(kThreads) * kUnroll;
  const std::uint64_t blocks =
      std::min<std::uint64_t>((units + per_block - 1) / per_block, max_blocks ? max_blocks : 2048);
  if (units + blocks * per_block < (std::uint64_t{1} << 32) && !g_force_wide_index.load(std::memory_order_relaxed))
    op_batch_kernel<std::uint32_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(shaped, plan);
  else
    op_batch_kernel<std::uint64_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(shaped, plan);
  CARAVAN_HIP_CHECK(hipGetLastError());
}

void force_wide_index_for_testing(bool on) { g_force_wide_index.store(on, std::memory_order_relaxed); }

void preload_op_kernel(int device) {
  int current = 0;
  CARAVAN_HIP_CHECK(hipGetDevice(&current));
  CARAVAN_HIP_CHECK(hipSetDevice(device));
  hipFuncAttributes attributes;
  hipError_t status = hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&op_batch_kernel<std::uint32_t>));
  if (status == hipSuccess)
    status = hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&op_batch_kernel<std::uint64_t>));
  if (status == hipSuccess) status = hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&contiguous_kernel));
  CARAVAN_HIP_CHECK(hipSetDevice(current));
  CARAVAN_HIP_CHECK(status);
}

}  // namespace caravan::gpu
