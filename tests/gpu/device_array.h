// A device allocation that frees itself, for GPU tests that own a few buffers on the current GPU.
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

}  // namespace caravan::gpu::test
