// What the probes share: the error checks (print where a CUDA runtime call failed and stop; a
// probe is a throwaway program, not library code), and a random bf16 fill.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e = (x);                                                                        \
    if (e != cudaSuccess) {                                                                     \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));                     \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

// The same for a cuBLAS call (the probes that time cuBLAS include cublas_v2.h first).
#define CB(x)                                                               \
  do {                                                                      \
    cublasStatus_t status_ = (x);                                           \
    if (status_ != CUBLAS_STATUS_SUCCESS) {                                 \
      std::printf("%s:%d cublas status %d\n", __FILE__, __LINE__, status_); \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

// p[i] = a hash of (i, seed) spread uniformly over [-scale / 2, scale / 2), as bf16 (grid-stride).
__global__ void probe_fill(__nv_bfloat16* p, std::size_t count, std::uint32_t seed, float scale = 0.1f) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13, x *= 0x5bd1e995u, x ^= x >> 15;
    p[i] = __float2bfloat16((static_cast<float>(x & 0xffff) / 65536.0f - 0.5f) * scale);
  }
}
