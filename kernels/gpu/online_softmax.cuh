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

// Score fragments are read and written through `at(n, e)`: element e (0-3) of the n-th group of 8
// key columns, as the m16n8 accumulator holds them (e / 2: row g or g + 8; e % 2: column 2t or
// 2t + 1 of the group).

// On a tile that crosses the causal diagonal, the keys past each row become -inf. key_offset:
// the tile's first key minus the warp's first row (they differ by less than two tiles).
template <int Groups, class Scores>
__device__ __forceinline__ void mask_keys_past_rows(Scores&& at, int key_offset, int g, int t) {
#pragma unroll
  for (int n = 0; n < Groups; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (key_offset + n * 8 + 2 * t + (e & 1) > g + (e / 2) * 8) at(n, e) = -INFINITY;
}

// This lane's maxima of rows g and g + 8 over the tile's raw scores, times scale_log2 (log2 e /
// sqrt(D), positive): the raw scores stay, and each exponential takes one fused multiply-add
// (probability below). This, with the mask applied on diagonal tiles only (it was a select per
// score on every tile), made the Hopper kernel 1.13-1.27x faster and the portable one 4-7% (an
// H100).
template <int Groups, class Scores>
__device__ __forceinline__ void scaled_tile_maxima(Scores&& at, float scale_log2, float (&tile_max)[2]) {
  tile_max[0] = tile_max[1] = -INFINITY;
#pragma unroll
  for (int n = 0; n < Groups; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) tile_max[e / 2] = fmaxf(tile_max[e / 2], at(n, e));
  tile_max[0] *= scale_log2;
  tile_max[1] *= scale_log2;
}

// exp2(score x scale_log2 - base): a raw score's unnormalized probability (0 for a masked one).
__device__ __forceinline__ float probability(float score, float scale_log2, float base) {
  return exp2f(fmaf(score, scale_log2, -base));
}

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

// The reciprocals of rows g and g + 8's softmax sums, for the output's normalization: each lane
// holds its part of the sums, the quad together the whole (0 for a row that saw no key).
__device__ __forceinline__ void row_sum_inverses(float (&row_sum)[2], float (&inverse)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
    inverse[i] = row_sum[i] > 0.0f ? 1.0f / row_sum[i] : 0.0f;
  }
}

// Two floats rounded to bf16 in one 32-bit register, low half first: a pair of an A fragment.
__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&v);
}

}  // namespace caravan::gpu
