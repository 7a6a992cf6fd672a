// Allocations that free themselves, for GPU tests that own a few buffers: device memory on the
// current GPU, and pinned host memory (copies from it run on a copy engine, never on the SMs).
#pragma once

#include "runtime/gpu/platform.h"

#include <algorithm>
#include <cstddef>

namespace caravan::gpu::test {

template <class T>
struct DeviceArray {
  T* data = nullptr;
  explicit DeviceArray(std::size_t count) {
    void* p = nullptr;
    CARAVAN_HIP_CHECK(hipMalloc(&p, std::max<std::size_t>(count, 1) * sizeof(T)));
    data = static_cast<T*>(p);
  }
  ~DeviceArray() { (void)hipFree(data); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

template <class T>
struct PinnedArray {
  T* data = nullptr;
  explicit PinnedArray(std::size_t count) {
    void* p = nullptr;
    CARAVAN_HIP_CHECK(hipHostMalloc(&p, std::max<std::size_t>(count, 1) * sizeof(T), hipHostMallocPortable));
    data = static_cast<T*>(p);
  }
  ~PinnedArray() { (void)hipHostFree(data); }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
};

}  // namespace caravan::gpu::test
