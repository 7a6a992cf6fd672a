// The per-row signals and row addressing of flag_gemm (kernels.h), shared by its two kernels
// (flag_gemm.cu, flag_gemm_sm90.cu): a tile covers rows [m0, min(m0 + tile_rows, m)) of A and C,
// each signal word covers a fixed range of rows, so a tile meets one word or several, and C's
// rows may live in several parts at addresses of their own (another GPU's memory, for one).
#pragma once

#include "kernels/gpu/kernels.h"
#include "kernels/gpu/symmetric.cuh"

#include <cstdint>

namespace caravan::gpu::dev {

// C as the kernels see it: rows [p * part_rows, (p + 1) * part_rows) at c[p * copies + i] for
// each copy i, ldc elements apart, their done words at done[p * copies + i] (null: not counted).
// One part of m rows in one copy is a plain C.
struct OutputParts {
  bf16* c[FlagGemmParts::kMaxParts];
  std::uint64_t* done[FlagGemmParts::kMaxParts];
  long part_rows;
  long ldc;
  int copies;
  bool counted;  // some part has done words
};

__device__ inline bf16* row_address(const OutputParts& out, long row, int copy) {
  const long p = row / out.part_rows;
  return out.c[p * out.copies + copy] + (row - p * out.part_rows) * out.ldc;
}

// 16 bytes (8 columns from `col`) of C's row `row`, into every copy.
__device__ inline void store_to_copies(const OutputParts& out, long row, long col, uint4 value) {
  for (int copy = 0; copy < out.copies; ++copy) *reinterpret_cast<uint4*>(row_address(out, row, copy) + col) = value;
}

// One thread: waits (acquire) until every flag word over the tile's rows holds at least `epoch`.
__device__ inline void wait_for_tile_rows(std::uint64_t* flags, long rows_per_flag, std::uint64_t epoch, long m0,
                                          long tile_rows, long m) {
  const long last = (min(m0 + tile_rows, m) - 1) / rows_per_flag;
  for (long f = m0 / rows_per_flag; f <= last; ++f) wait_until(flags + f, Compare::ge, epoch);
}

// One thread, after the whole block's part of C is written (every copy): makes it visible at
// system scope (a part may be another GPU's memory, its waiter that GPU's copy engine), then adds
// `columns` to each copy's done word of every row range the tile overlaps, ranges counted from
// each part's first row.
__device__ inline void count_tile_rows_done(const OutputParts& out, long rows_per_done, long m0, long tile_rows, long m,
                                            long columns) {
  __threadfence_system();
  const long end = min(m0 + tile_rows, m);
  for (long p = m0 / out.part_rows; p * out.part_rows < end; ++p)
    for (int copy = 0; copy < out.copies; ++copy) {
      std::uint64_t* done = out.done[p * out.copies + copy];
      if (done == nullptr) continue;
      const long base = p * out.part_rows;
      const long first = max(m0, base) - base, last = min(end, base + out.part_rows) - 1 - base;
      for (long w = first / rows_per_done; w <= last / rows_per_done; ++w)
        atomicAdd_system(reinterpret_cast<unsigned long long*>(done + w), static_cast<unsigned long long>(columns));
    }
}

}  // namespace caravan::gpu::dev
