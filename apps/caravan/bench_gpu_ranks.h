// What the GPU benchmarks (`bench overlap --backend gpu`, `bench llm --backend gpu`) share: one
// host thread per GPU ("rank"), a barrier any of them can break, bounded waits, device buffers
// and NCCL error checks.
#pragma once

#include <caravan/error.h>

#include "runtime/gpu/platform.h"

#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
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

}  // namespace caravan::app
