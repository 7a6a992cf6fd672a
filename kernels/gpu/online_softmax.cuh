// The online softmax steps both fused attention kernels share (attention.cu, attention_sm90.cu):
// their score fragments have the same layout (a lane holds rows g and g + 8 of its warp's 16, the
// four lanes of a quad the same rows), so folding a tile's row maxima into the running ones, and
// packing probabilities into A fragments, are the same arithmetic on the same registers. NVIDIA
// only, like the kernels (warp shuffles by mask, __nv_bfloat162).
#pragma once

#include "kernels/gpu/bf16.h"

#include <cmath>
#include <cstdint>

namespace caravan::gpu {

// tile_max: this lane's maxima over its scores of the tile (scaled, masked), for rows g and g + 8.
// Reduces them over the quad, raises row_max to include them, and gives the base the tile's
// exponentials subtract (0 for a row that has seen no visible key yet: -inf - -inf would be NaN)
// and the factor by which the earlier sum and output must be scaled.
__device__ __forceinline__ void fold_tile_maxima(float (&tile_max)[2], float (&row_max)[2], float (&base)[2],
                                                 float (&correction)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
    tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
    const float new_max = fmaxf(row_max[i], tile_max[i]);
    base[i] = new_max == -INFINITY ? 0.0f : new_max;
    correction[i] = exp2f(row_max[i] - base[i]);
    row_max[i] = new_max;
  }
}

// Two floats rounded to bf16 in one 32-bit register, low half first: a pair of an A fragment.
__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&v);
}

}  // namespace caravan::gpu
