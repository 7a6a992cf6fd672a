#include "runtime/gpu/op_kernel.h"

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

// Each group (op_kernel.h, runtime/dma/interleave.h: a layout conversion's fields as its members,
// and rows) is cut into units of w bytes, w the widest of 16, 8, 4, 2, 1 that divides its element
// size, strides, steps and both addresses. A unit is one piece of one element of one row for up
// to kChunk members: the thread loads the piece of each of those members, then stores each.
// Consecutive threads take consecutive elements, so each store instruction of a warp writes one
// contiguous run per member, and its loads of the interleaved side hit the sectors its other
// loads just brought in. (scripts/probes/conversion_probe.cu timed the shapes as kernels written
// for one 48 MiB AOS -> SOA case on an H100, against a plain copy of the same bytes: a thread per
// element 0.95-0.99; one pass per member, which reads the interleaved side once per member,
// 0.54-0.85; units numbered member by member within an element, whose stores scatter over every
// member's array, 0.66-0.72; a block staging whole records in shared memory 0.97-1.02, which
// needs each record contiguous and whole, so it is not what a generic batch can do.) Rows are
// taken in the same launch: a 2-D conversion (its rows apart) was one op per field and row, 56
// ops a launch, at about 4 us of host time per launch.
// Units of group g: row by row; within a row, count x pieces per chunk of kChunk members, chunk
// by chunk, element by element within a chunk. The units of all groups are numbered one after
// another (first[g] = the first unit of group g) and the grid strides over them.
struct Plan {
  std::uint64_t first[kMaxKernelGroups + 1];
  std::uint64_t units_per_row[kMaxKernelGroups];
  std::uint32_t width[kMaxKernelGroups];
  std::uint32_t pieces[kMaxKernelGroups];  // units per element of one member: elem / width
  int groups = 0;
};
// Both travel by value as kernel arguments: within 4 KiB (CUDA before 12.1, and HIP), with room
// for the 256 bytes of hidden arguments an AMD code object adds.
static_assert(sizeof(KernelBatch) + sizeof(Plan) + 256 <= 4096,
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
__global__ void __launch_bounds__(kThreads) op_batch_kernel(KernelBatch batch, Plan plan) {
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
      const KernelGroup& o = batch.groups[g];
      Index local = u - static_cast<Index>(plan.first[g]);
      const Index pieces = plan.pieces[g];
      // Rows and chunks of members cost a division each, and only groups that have them pay it
      // (a plain run or a 1-D conversion has neither: the branches are uniform per group).
      std::int64_t row_src = 0, row_dst = 0;
      if (o.rows > 1) {
        const auto per_row = static_cast<Index>(plan.units_per_row[g]);
        const Index row = local / per_row;
        local -= row * per_row;
        row_src = static_cast<std::int64_t>(row) * o.row_src;
        row_dst = static_cast<std::int64_t>(row) * o.row_dst;
      }
      int members = static_cast<int>(o.members);
      std::int64_t chunk_src = 0, chunk_dst = 0;
      if (members > kChunk) {
        const auto per_chunk = static_cast<Index>(o.count * pieces);
        const int chunk = static_cast<int>(local / per_chunk);
        local -= static_cast<Index>(chunk) * per_chunk;
        chunk_src = static_cast<std::int64_t>(chunk) * kChunk * o.member_src;
        chunk_dst = static_cast<std::int64_t>(chunk) * kChunk * o.member_dst;
        members = min(kChunk, members - chunk * kChunk);
      }
      const Index element = pieces == 1 ? local : local / pieces;
      const std::uint32_t w = plan.width[g];
      const auto byte = static_cast<std::int64_t>((local - element * pieces) * w);
      const auto e = static_cast<std::int64_t>(element);
      const std::byte* src0 = o.src + (e * o.src_stride + byte + row_src + chunk_src);
      std::byte* dst0 = o.dst + (e * o.dst_stride + byte + row_dst + chunk_dst);
      moved[k] = members;
      width[k] = w;
#pragma unroll
      for (int m = 0; m < kChunk; ++m) {
        if (m < moved[k]) {
          value[k][m] = load_unit(src0 + m * o.member_src, w);
          dst[k][m] = dst0 + m * o.member_dst;
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

std::uint32_t widest_unit(const KernelGroup& o) {
  auto bits = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(o.src) | reinterpret_cast<std::uintptr_t>(o.dst)) |
              o.elem | static_cast<std::uint64_t>(o.src_stride) | static_cast<std::uint64_t>(o.dst_stride);
  if (o.members > 1) bits |= static_cast<std::uint64_t>(o.member_src) | static_cast<std::uint64_t>(o.member_dst);
  if (o.rows > 1) bits |= static_cast<std::uint64_t>(o.row_src) | static_cast<std::uint64_t>(o.row_dst);
  for (std::uint32_t w : {16u, 8u, 4u, 2u})
    if (bits % w == 0) return w;
  return 1;
}

}  // namespace

void launch_op_batch(const KernelBatch& batch, hipStream_t stream, unsigned max_blocks) {
  if (batch.count < 0 || batch.count > kMaxKernelGroups)
    throw Error(Errc::invalid_argument, "launch_op_batch: count must be in [0, " + std::to_string(kMaxKernelGroups) +
                                            "], is " + std::to_string(batch.count));
  const KernelGroup& lone = batch.groups[0];
  if (batch.count == 1 && lone.count == 1 && lone.members == 1 && lone.rows == 1 && widest_unit(lone) == 16) {
    const std::uint64_t vectors = lone.elem / 16;
    if (vectors == 0) return;
    const std::uint64_t per_block = static_cast<std::uint64_t>(kThreads) * dev::kGridCopyUnroll;
    const std::uint64_t blocks = std::min<std::uint64_t>((vectors + per_block - 1) / per_block, max_blocks ? max_blocks : 1024);
    launch_checked(contiguous_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
                   reinterpret_cast<const uint4*>(lone.src), reinterpret_cast<uint4*>(lone.dst), vectors);
    return;
  }
  // A contiguous run becomes a strided op of single units (the widest its addresses, length and
  // steps allow), so that an element never holds more units than 32 bits count.
  KernelBatch shaped = batch;
  Plan plan{};
  for (int g = 0; g < shaped.count; ++g) {
    KernelGroup& o = shaped.groups[g];
    const std::uint32_t width = widest_unit(o);
    if (o.count == 1 && o.elem != 0) {
      o.count = o.elem / width;
      o.elem = o.src_stride = o.dst_stride = width;
    }
    const std::uint64_t pieces = o.elem / width;
    if (pieces > UINT32_MAX)
      throw Error(Errc::invalid_argument,
                  "launch_op_batch: group " + std::to_string(g) + " has elements of " + std::to_string(o.elem) +
                      " bytes; an element may hold at most 2^32 units of " + std::to_string(width) + " bytes");
    plan.width[g] = width;
    plan.pieces[g] = static_cast<std::uint32_t>(pieces);
    const std::uint64_t chunks = (std::uint64_t{o.members} + kChunk - 1) / kChunk;
    plan.units_per_row[g] = chunks * o.count * pieces;
    plan.first[g + 1] = plan.first[g] + std::uint64_t{o.rows} * plan.units_per_row[g];
  }
  plan.groups = shaped.count;
  const std::uint64_t units = plan.first[plan.groups];
  if (units == 0) return;
  // Enough blocks to fill the GPU a few times over; the grid strides over the rest.
  const std::uint64_t per_block = static_cast<std::uint64_t>(kThreads) * kUnroll;
  const std::uint64_t blocks =
      std::min<std::uint64_t>((units + per_block - 1) / per_block, max_blocks ? max_blocks : 2048);
  const bool narrow =
      units + blocks * per_block < (std::uint64_t{1} << 32) && !g_force_wide_index.load(std::memory_order_relaxed);
  if (narrow)
    launch_checked(op_batch_kernel<std::uint32_t>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
                   shaped, plan);
  else
    launch_checked(op_batch_kernel<std::uint64_t>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
                   shaped, plan);
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
