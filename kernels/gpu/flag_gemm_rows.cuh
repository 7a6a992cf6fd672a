// The per-row signals of flag_gemm (kernels.h), shared by its two kernels (flag_gemm.cu,
// flag_gemm_sm90.cu): a tile covers rows [m0, min(m0 + tile_rows, m)) of A and C, and each
// signal word covers a fixed range of rows, so a tile meets one word or several.
#pragma once

#include "kernels/gpu/symmetric.cuh"

#include <cstdint>

namespace caravan::gpu::dev {

// One thread: waits (acquire) until every flag word over the tile's rows holds at least `epoch`.
__device__ inline void wait_for_tile_rows(std::uint64_t* flags, long rows_per_flag, std::uint64_t epoch, long m0,
                                          long tile_rows, long m) {
  const long last = (min(m0 + tile_rows, m) - 1) / rows_per_flag;
  for (long f = m0 / rows_per_flag; f <= last; ++f) wait_until(flags + f, Compare::ge, epoch);
}

// One thread, after the whole block's part of C is written: makes it visible at system scope,
// then adds `columns` to the done word of every row range the tile overlaps.
__device__ inline void count_tile_rows_done(std::uint64_t* done, long rows_per_done, long m0, long tile_rows, long m,
                                            long columns) {
  __threadfence_system();
  const long last = (min(m0 + tile_rows, m) - 1) / rows_per_done;
  for (long w = m0 / rows_per_done; w <= last; ++w)
    atomicAdd(reinterpret_cast<unsigned long long*>(done + w), static_cast<unsigned long long>(columns));
}

}  // namespace caravan::gpu::dev
