// Device side of the flag hand-off test: two GPUs pass a token back and forth through the
// symmetric heap with kernels/gpu/symmetric.cuh (put, release notify, acquire wait).
#include "tests/gpu/flag_handoff.h"

#include "kernels/gpu/symmetric.cuh"

namespace caravan::gpu::test {
namespace {

// Slot layout in the heap region (per rank): [0] data word, [1] flag. Rank `first` starts.
// Round i: the sender puts payload(i) into the peer's data word, then raises the peer's flag to
// i with release; the receiver waits for flag >= i with acquire and must read exactly payload(i)
// (a lost hand-off deadlocks and is caught by the host's timeout; a duplicated or reordered one
// reads a wrong payload or sees the flag skip).
__device__ std::uint64_t payload(std::uint64_t i) { return i * 0x9E3779B97F4A7C15ull + 1; }

__global__ void handoff_kernel(HeapView heap, std::uint64_t* slots, int peer, bool first, std::uint64_t rounds,
                               HandoffResult* result) {
  std::uint64_t* data = slots;
  std::uint64_t* flag = slots + 1;
  std::uint64_t errors = 0, skips = 0;
  for (std::uint64_t i = 1; i <= rounds; ++i) {
    const bool my_turn = ((i & 1) == 1) == first;
    if (my_turn) {
      dev::atomic_store(heap, data, payload(i), peer, dev::Order::relaxed);
      dev::notify(heap, flag, i, peer);
    } else {
      const std::uint64_t seen = dev::wait_until(flag, dev::Compare::ge, i);
      if (seen != i) ++skips;
      if (dev::atomic_load(heap, data, heap.rank, dev::Order::relaxed) != payload(i)) ++errors;
    }
  }
  result->wrong_payload = errors;
  result->flag_skips = skips;
}

__global__ void remote_adds_kernel(HeapView heap, std::uint64_t* counter, int target, int threads, int per_thread) {
  if (static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x) >= threads) return;
  for (int i = 0; i < per_thread; ++i) dev::atomic_add(heap, counter, std::uint64_t{1}, target, dev::Order::relaxed);
}

}  // namespace

void launch_handoff(const HeapView& heap, std::uint64_t* slots, int peer, bool first, std::uint64_t rounds,
                    HandoffResult* result, hipStream_t stream) {
  handoff_kernel<<<1, 1, 0, stream>>>(heap, slots, peer, first, rounds, result);
  CARAVAN_HIP_CHECK(hipGetLastError());
}

void launch_remote_adds(const HeapView& heap, std::uint64_t* counter, int target, int threads, int per_thread,
                        hipStream_t stream) {
  remote_adds_kernel<<<(threads + 127) / 128, 128, 0, stream>>>(heap, counter, target, threads, per_thread);
  CARAVAN_HIP_CHECK(hipGetLastError());
}

}  // namespace caravan::gpu::test
