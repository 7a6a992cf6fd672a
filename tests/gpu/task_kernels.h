// Device side of the GPU processor tests (gpu_processor_test.cpp): small kernels a GPU task
// enqueues on its stream. Each launch is checked (throws caravan::Error(device)).
#pragma once

#include "runtime/gpu/platform.h"

#include <cstdint>

namespace caravan::gpu::test {

// Keeps one block of the stream's GPU busy for `ns` nanoseconds (work that is still running
// when the body returns, so that ordering mistakes show).
void launch_spin(std::uint64_t ns, hipStream_t stream);
// y[i] = a * x[i] + b for i < n.
void launch_axpb(float* y, const float* x, float a, float b, std::uint64_t n, hipStream_t stream);
// *counter += 1 (one thread; a read-modify-write that loses updates if two run at once unordered).
void launch_increment(std::uint64_t* counter, hipStream_t stream);

}  // namespace caravan::gpu::test
