// Eight bf16 values in one 16-byte vector (uint4), accumulated in fp32: the arithmetic shared by
// every reduction of bf16 partials (reduce_sum, the pull ReduceScatter), so that all of them
// round alike (each input added in fp32 in the order given, one rounding to bf16 at the end).
#pragma once

#include "kernels/gpu/bf16.h"

namespace caravan::gpu::dev {

__device__ inline void accumulate_bf16x8(float (&acc)[8], const uint4& raw) {
  const auto* h = reinterpret_cast<const bf16x2*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = bf16x2_to_float2(h[k]);
    acc[2 * k] += f.x;
    acc[2 * k + 1] += f.y;
  }
}

__device__ inline uint4 round_bf16x8(const float (&acc)[8]) {
  uint4 packed;
  auto* h = reinterpret_cast<bf16x2*>(&packed);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = floats_to_bf16x2(acc[2 * k], acc[2 * k + 1]);
  return packed;
}

}  // namespace caravan::gpu::dev
