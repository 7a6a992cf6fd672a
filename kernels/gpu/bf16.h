// bf16 in Caravan's GPU code: CUDA's __nv_bfloat16 on NVIDIA; on AMD a storage type of our own,
// since the HIP of Debian 12 (5.2) has no bf16 arithmetic header, converted as the CPU backend's
// Bf16 converts. Kernels convert through the functions below, which round to nearest even on
// both (one rounding rule for every reduction).
#pragma once

#include "runtime/gpu/platform.h"

#if defined(CARAVAN_GPU_AMD)
#include <caravan/kernels/bf16.h>

#include <cstdint>
#else
#include <cuda_bf16.h>
#endif

namespace caravan::gpu {

#if defined(CARAVAN_GPU_AMD)
struct bf16 {
  std::uint16_t bits;
};
struct bf16x2 {
  bf16 lo, hi;
};

// The CPU backend's conversions (constexpr, so host and device functions alike for clang's HIP).
__host__ __device__ inline float bf16_to_float(bf16 v) { return kernels::Bf16{v.bits}.to_float(); }
__host__ __device__ inline bf16 float_to_bf16(float f) { return {kernels::Bf16::from_float(f).bits}; }
__device__ inline float2 bf16x2_to_float2(bf16x2 v) { return make_float2(bf16_to_float(v.lo), bf16_to_float(v.hi)); }
__device__ inline bf16x2 floats_to_bf16x2(float lo, float hi) { return {float_to_bf16(lo), float_to_bf16(hi)}; }
#else
using bf16 = __nv_bfloat16;
using bf16x2 = __nv_bfloat162;

__host__ __device__ inline float bf16_to_float(bf16 v) { return __bfloat162float(v); }
__host__ __device__ inline bf16 float_to_bf16(float f) { return __float2bfloat16(f); }
__device__ inline float2 bf16x2_to_float2(bf16x2 v) { return __bfloat1622float2(v); }
__device__ inline bf16x2 floats_to_bf16x2(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
#endif

}  // namespace caravan::gpu
