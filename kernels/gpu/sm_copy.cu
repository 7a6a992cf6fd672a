// SM-driven pushes over the peer links (kernels.h: sm_push): the threads of a few blocks store
// a local buffer straight into every peer's copy of a symmetric allocation, chunk by chunk, and
// raise the peer's landing flag for a chunk once every block's share of it is stored.
//
// Why SMs and not the copy engine: with every GPU sending to every other at once, copy engines
// fall to about 197 GB/s per GPU while SM-driven stores hold 330-370 GB/s (measured reference),
// and a kernel's launch costs less than a copy-engine copy plus a stream write per chunk. The
// price is the SMs it occupies, so the grid is small when a GEMM runs beside it.
#include "kernels/gpu/kernels.h"
#include "kernels/gpu/symmetric.cuh"
#include "runtime/gpu/grid_copy.cuh"

#include <caravan/error.h>

#include <string>

namespace caravan::gpu {
namespace {

constexpr int kThreads = 512;

// Block b stores the vectors b * threads + t, stepping by the grid, of each chunk; the last block
// to finish a chunk (a counter per peer and chunk, in this GPU's memory) raises the flag. Each
// block fences its stores at system scope before it counts itself, and the last one fences again
// before its release store: whoever acquires the flag sees every block's stores (the pattern of
// a last-block reduction, at system scope).
__global__ void __launch_bounds__(kThreads)
    sm_push_kernel(HeapView heap, const uint4* src, uint4* dst, std::size_t chunk_vectors, int chunks, SmPushFlags flags,
                   std::uint32_t* counters, std::uint64_t epoch) {
  const int world = heap.world, me = heap.rank;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kThreads;
  std::uint64_t* const landed = flags.landed;
  // Every block announces the entry (the same value, so whichever block runs first does it):
  // a peer's blocks may wait on it, and this GPU's other blocks need not be resident yet.
  if (threadIdx.x == 0)
    for (std::uint64_t* entry : flags.entry)
      if (entry != nullptr)
        for (int step = 1; step < world; ++step) dev::notify(heap, entry, epoch, (me + step) % world);
  for (int step = 1; step < world; ++step) {
    const int peer = (me + step) % world;
    if (flags.freed != nullptr) {
      if (threadIdx.x == 0) dev::wait_until(flags.freed + peer, dev::Compare::ge, epoch);
      __syncthreads();  // the peer entered this epoch: its copy may be overwritten
    }
    uint4* remote = dev::translate(heap, dst, peer);
    for (int c = 0; c < chunks; ++c) {
      const std::size_t base = static_cast<std::size_t>(c) * chunk_vectors;
      dev::grid_copy16(src + base, remote + base, chunk_vectors, blockIdx.x * static_cast<std::size_t>(kThreads) + threadIdx.x,
                       stride);
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence_system();
        cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> count(counters[peer * chunks + c]);
        if (count.fetch_add(1, cuda::memory_order_acq_rel) == gridDim.x - 1) {
          count.store(0, cuda::memory_order_relaxed);  // for the next call (stream-ordered after this one)
          __threadfence_system();
          dev::notify(heap, landed + me * chunks + c, epoch, peer);
        }
      }
    }
  }
  // Ends only once every peer's chunks have landed here (one block waits; the kernel's end then
  // orders them before whatever the stream runs next).
  if (flags.wait_landed && blockIdx.x == 0 && threadIdx.x == 0)
    for (int step = 1; step < world; ++step)
      for (int c = 0; c < chunks; ++c)
        dev::wait_until(landed + ((me - step + world) % world) * chunks + c, dev::Compare::ge, epoch);
}

}  // namespace

void preload_sm_copy() {
  hipFuncAttributes attributes;
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&sm_push_kernel)));
}

std::size_t sm_push_counter_bytes(int world, int chunks) {
  return static_cast<std::size_t>(world) * static_cast<std::size_t>(chunks) * sizeof(std::uint32_t);
}

void sm_push(const HeapView& heap, const void* src, void* dst, std::size_t chunk_bytes, int chunks, const SmPushFlags& flags,
             std::uint32_t* counters, std::uint64_t epoch, int blocks, hipStream_t stream) {
  const auto misaligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 != 0; };
  if (chunk_bytes == 0 || chunk_bytes % 16 != 0 || chunks < 1 || blocks < 1 || misaligned(src) || misaligned(dst) ||
      flags.landed == nullptr || counters == nullptr)
    throw Error(Errc::invalid_argument,
                "sm_push: chunk_bytes (" + std::to_string(chunk_bytes) + ") must be a positive multiple of 16, chunks (" +
                    std::to_string(chunks) + ") and blocks (" + std::to_string(blocks) +
                    ") positive, src and dst 16-byte aligned, landed and counters given");
  sm_push_kernel<<<blocks, kThreads, 0, stream>>>(heap, static_cast<const uint4*>(src), static_cast<uint4*>(dst),
                                                  chunk_bytes / 16, chunks, flags, counters, epoch);
  CARAVAN_HIP_CHECK(hipGetLastError());
}

}  // namespace caravan::gpu
