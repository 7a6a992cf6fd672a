// The probes' one error check: print where a CUDA runtime call failed and stop (a probe is a
// throwaway program, not library code).
#pragma once

#include <cuda_runtime.h>

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
