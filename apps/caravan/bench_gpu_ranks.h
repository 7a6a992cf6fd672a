// What the GPU benchmarks (`bench overlap --backend gpu`, `bench llm --backend gpu`) share: one
// host thread per GPU ("rank"), a barrier any of them can break, bounded waits, device buffers
// and NCCL error checks.
#pragma once

#include <caravan/error.h>

#include "kernels/gpu/gpu_heap.h"
#include "kernels/gpu/kernels.h"
#include "runtime/gpu/platform.h"

#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>

namespace caravan::app {

inline void nccl_check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess) throw Error(Errc::device, fmt::format("{} failed: {}", call, ncclGetErrorString(r)));
}
#define CARAVAN_NCCL_CHECK(call) nccl_check((call), #call)

// A spinning barrier for the rank threads that any thread can break (its failure then reaches
// every rank instead of leaving them waiting).
class RankBarrier {
 public:
  explicit RankBarrier(int n) : n_(n) {}
  void arrive_and_wait() {
    const int gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_acq_rel);
    } else {
      while (generation_.load(std::memory_order_acquire) == gen) {
        if (broken_.load(std::memory_order_acquire)) throw Error(Errc::cancelled, "another rank failed");
        std::this_thread::yield();
      }
    }
    if (broken_.load(std::memory_order_acquire)) throw Error(Errc::cancelled, "another rank failed");
  }
  void break_all() { broken_.store(true, std::memory_order_release); }

 private:
  const int n_;
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
  std::atomic<bool> broken_{false};
};

// Waits for `event` like hipEventSynchronize, but gives up after `limit`: an operation whose
// flag is never raised must report it, not hang the benchmark.
inline void wait_event(hipEvent_t event, const std::string& what, std::chrono::seconds limit = std::chrono::seconds(60)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    hipError_t status = hipEventQuery(event);
    if (status == hipSuccess) return;
    if (status != hipErrorNotReady) CARAVAN_HIP_CHECK(status);
    if (std::chrono::steady_clock::now() > deadline)
      throw Error(Errc::timeout, fmt::format("{} did not finish within {} s (a flag never raised?)", what, limit.count()));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

template <class T>
inline T* device_alloc(std::size_t count) {
  void* p = nullptr;
  CARAVAN_HIP_CHECK(hipMalloc(&p, std::max<std::size_t>(count, 1) * sizeof(T)));
  return static_cast<T*>(p);
}
struct DeviceFree {
  void operator()(void* p) const { (void)hipFree(p); }
};
template <class T>
using DeviceBuffer = std::unique_ptr<T, DeviceFree>;
template <class T>
inline DeviceBuffer<T> make_buffer(std::size_t count) {
  return DeviceBuffer<T>(device_alloc<T>(count));
}

// ||out - ref|| / ||ref|| through `sums` (device memory) on `stream`, which it waits for;
// infinite when an element is not finite (a poisoned element never written).
inline double relative_error(const gpu::bf16* out, long rows, long cols, long ld, const float* ref, long ref_ld,
                             gpu::ErrorSums* sums, hipStream_t stream) {
  gpu::compare(out, rows, cols, ld, ref, ref_ld, sums, stream);
  gpu::ErrorSums host;
  CARAVAN_HIP_CHECK(hipMemcpyAsync(&host, sums, sizeof(host), hipMemcpyDeviceToHost, stream));
  CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
  if (host.nonfinite > 0) return std::numeric_limits<double>::infinity();
  return host.ref2 > 0 ? std::sqrt(host.diff2 / host.ref2) : std::sqrt(host.diff2);
}

// Releases the symmetric memory allocated after its construction when it goes (between
// benchmark cases); `bench` names the benchmark in the message if that fails.
struct HeapScope {
  HeapScope(gpu::GpuSymmetricHeap& h, const char* bench) : heap(h), mark(h.mark()), name(bench) {}
  ~HeapScope() {
    try {
      heap.release_to(mark);
    } catch (const std::exception& e) {
      fmt::print(stderr, "{}: could not release symmetric memory: {}\n", name, e.what());
    }
  }
  gpu::GpuSymmetricHeap& heap;
  std::uint64_t mark;
  const char* name;
};

}  // namespace caravan::app
