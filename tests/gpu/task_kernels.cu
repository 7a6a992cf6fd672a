// The GPU processor tests' kernels (task_kernels.h).
#include "tests/gpu/task_kernels.h"

#include "kernels/gpu/device.cuh"

namespace caravan::gpu::test {
namespace {

__global__ void spin(std::uint64_t ns) {
  const std::uint64_t until = dev::global_ns() + ns;
  while (dev::global_ns() < until) dev::pause_ns(1000);
}

__global__ void axpb(float* y, const float* x, float a, float b, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n; i += std::uint64_t{gridDim.x} * blockDim.x)
    y[i] = a * x[i] + b;
}

// A plain load and store, not an atomic: two of these running unordered can lose an update.
__global__ void increment(std::uint64_t* counter) {
  volatile std::uint64_t* c = counter;
  *c = *c + 1;
}

}  // namespace

void launch_spin(std::uint64_t ns, hipStream_t stream) {
  spin<<<1, 1, 0, stream>>>(ns);
  CARAVAN_HIP_CHECK(hipGetLastError());
}

void launch_axpb(float* y, const float* x, float a, float b, std::uint64_t n, hipStream_t stream) {
  axpb<<<264, 256, 0, stream>>>(y, x, a, b, n);
  CARAVAN_HIP_CHECK(hipGetLastError());
}

void launch_increment(std::uint64_t* counter, hipStream_t stream) {
  increment<<<1, 1, 0, stream>>>(counter);
  CARAVAN_HIP_CHECK(hipGetLastError());
}

}  // namespace caravan::gpu::test
