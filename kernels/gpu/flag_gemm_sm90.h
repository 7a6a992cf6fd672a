// The Hopper (sm_90a) path of flag_gemm (kernels.h), in a library of its own because it is built
// for that one architecture: flag_gemm.cu calls it when the current device can run it.
#pragma once

#include "kernels/gpu/flag_gemm_rows.cuh"
#include "kernels/gpu/kernels.h"

namespace caravan::gpu::sm90 {

// Whether the current device runs the Hopper kernel (compute capability 9.0); the first call on
// a device also grants the kernel its shared memory there and finds the driver's tensor-map
// encoder (call it before peers spin: it loads the kernel).
bool available();

// The tile width (256 or 128 columns of C) that takes the fewest waves of blocks for m x n.
int choose_tile_n(long m, long n);

// flag_gemm_parts's contract, with 128 x tile_n tiles; the caller has checked the arguments and
// that available() holds. out.ldc a multiple of 8 and every part 16-byte aligned (C is written 16
// bytes at a time). `persistent`: one block per multiprocessor, the epilogue's stores overlapping
// the next tile (FlagGemmKernel::persistent).
void flag_gemm(const bf16* a, long lda, const bf16* b, long ldb, const dev::OutputParts& out, long m, long n, long k,
               std::uint64_t* flags, long rows_per_flag, std::uint64_t epoch, const int* tile_order, long rows_per_done,
               int tile_n, bool persistent, hipStream_t stream);

}  // namespace caravan::gpu::sm90
