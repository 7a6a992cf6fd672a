// The tile-level GEMM fed by flags (kernels.h: flag_gemm): each block computes one 128 x 128 tile
// of C, and before it loads its rows of A it waits until the flags guarding those rows hold the
// call's epoch, so it starts as soon as its own rows have landed, not when a whole chunk has.
// bf16 tensor cores through WMMA (16 x 16 x 16 fragments), fp32 accumulation.
//
// The portable kernel: one shared-memory stage, no asynchronous copies, about 7x slower than
// cuBLAS on an H200. On Hopper flag_gemm runs the TMA + wgmma kernel of flag_gemm_sm90.cu instead.
#include "kernels/gpu/kernels.h"
#ifdef CARAVAN_HAVE_SM90_KERNELS
#include "kernels/gpu/flag_gemm_sm90.h"
#endif
#include "kernels/gpu/flag_gemm_rows.cuh"

#include <mma.h>

#include <algorithm>
#include <string>

namespace caravan::gpu {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTileM = 128, kTileN = 128, kTileK = 32, kThreads = 256;
constexpr int kPadA = kTileK + 8, kPadB = kTileN + 8;  // 16 bytes of padding per row (bank conflicts)

// Warps in a 2 x 4 grid over the tile: each warp owns 64 rows x 32 columns = 4 x 2 fragments.
__global__ void __launch_bounds__(kThreads)
    flag_gemm_kernel(const bf16* a, long lda, const bf16* b, long ldb, const dev::OutputParts out, long m, long n,
                     long k, std::uint64_t* flags, long rows_per_flag, std::uint64_t epoch, const int* tile_order,
                     long rows_per_done) {
  __shared__ __align__(128) bf16 as[kTileM][kPadA];
  __shared__ __align__(128) bf16 bs[kTileK][kPadB];
  __shared__ __align__(128) float cs[kThreads / 32][16][16];
  const int m_tile = tile_order ? tile_order[blockIdx.y] : static_cast<int>(blockIdx.y);
  const long m0 = static_cast<long>(m_tile) * kTileM, n0 = static_cast<long>(blockIdx.x) * kTileN;
  if (flags != nullptr && threadIdx.x == 0) {
    dev::wait_for_tile_rows(flags, rows_per_flag, epoch, m0, kTileM, m);
  }
  __syncthreads();  // the rows this tile needs have landed: every thread may load them now

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wm = warp / 4, wn = warp % 4;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  for (long k0 = 0; k0 < k; k0 += kTileK) {
    for (int v = threadIdx.x; v < kTileM * kTileK / 8; v += kThreads) {
      const int r = v / (kTileK / 8), col = (v % (kTileK / 8)) * 8;
      const long gr = m0 + r, gc = k0 + col;
      uint4 value{0, 0, 0, 0};
      // L2 only: rows written by a copy engine during this kernel must not come from a stale L1 line.
      if (gr < m && gc < k) value = __ldcg(reinterpret_cast<const uint4*>(a + gr * lda + gc));
      *reinterpret_cast<uint4*>(&as[r][col]) = value;
    }
    for (int v = threadIdx.x; v < kTileK * kTileN / 8; v += kThreads) {
      const int r = v / (kTileN / 8), col = (v % (kTileN / 8)) * 8;
      const long gr = k0 + r, gc = n0 + col;
      uint4 value{0, 0, 0, 0};
      if (gr < k && gc < n) value = *reinterpret_cast<const uint4*>(b + gr * ldb + gc);
      *reinterpret_cast<uint4*>(&bs[r][col]) = value;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb[2];
#pragma unroll
      for (int i = 0; i < 4; ++i) wmma::load_matrix_sync(fa[i], &as[wm * 64 + i * 16][kk], kPadA);
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &bs[kk][wn * 32 + j * 16], kPadB);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
  // Each warp stages one fragment at a time in shared memory and writes it as bf16, in bounds.
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(&cs[warp][0][0], acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int r = e / 16, col = e % 16;
        const long gr = m0 + wm * 64 + i * 16 + r, gc = n0 + wn * 32 + j * 16 + col;
        if (gr < m && gc < n)
          for (int copy = 0; copy < out.copies; ++copy)
            dev::row_address(out, gr, copy)[gc] = __float2bfloat16(cs[warp][r][col]);
      }
      __syncwarp();
    }
  if (out.counted) {
    __syncthreads();  // every thread's part of the tile is written
    if (threadIdx.x == 0) dev::count_tile_rows_done(out, rows_per_done, m0, kTileM, m, min(n0 + kTileN, n) - n0);
  }
}

// The Hopper kernel takes these arguments: its epilogue writes C 16 bytes (8 columns) at a time,
// so ldc must be a multiple of 8 and every part of C 16-byte aligned (the portable kernel takes
// any). `parts` null: only ldc is asked about.
bool hopper_kernel_for(long ldc, const FlagGemmParts* parts, FlagGemmKernel kernel) {
#ifdef CARAVAN_HAVE_SM90_KERNELS
  if (kernel == FlagGemmKernel::portable || ldc % 8 != 0) return false;
  for (int p = 0; parts != nullptr && p < parts->count * parts->copies; ++p)
    if (reinterpret_cast<std::uintptr_t>(parts->c[p]) % 16 != 0) return false;
  return sm90::available();
#else
  (void)ldc, (void)parts, (void)kernel;
  return false;
#endif
}

}  // namespace

void preload_flag_gemm() {
  hipFuncAttributes attributes;
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&flag_gemm_kernel)));
#ifdef CARAVAN_HAVE_SM90_KERNELS
  (void)sm90::available();  // loads the Hopper kernel and grants its shared memory, where it runs
#endif
}

std::string flag_gemm_kernel_name(long m, long n, long ldc, FlagGemmKernel kernel) {
#ifdef CARAVAN_HAVE_SM90_KERNELS
  if (hopper_kernel_for(ldc, nullptr, kernel))
    return "wgmma 128x" + std::to_string(sm90::choose_tile_n(m, n)) +
           (kernel == FlagGemmKernel::persistent ? " persistent" : "");
#else
  (void)m, (void)n, (void)ldc, (void)kernel;
#endif
  return "wmma 128x128";
}

long flag_gemm_tiles_over(long m, long first, long rows) {
  if (rows <= 0 || first >= m) return 0;
  return (std::min(first + rows, m) - 1) / kTileM - first / kTileM + 1;
}

long flag_gemm_row_tiles(long m) { return (m + kTileM - 1) / kTileM; }
long flag_gemm_tile_rows() { return kTileM; }

void flag_gemm_parts(const bf16* a, long lda, const bf16* b, long ldb, const FlagGemmParts& parts, long ldc, long m,
                     long n, long k, std::uint64_t* flags, long rows_per_flag, std::uint64_t epoch,
                     const int* tile_order, long rows_per_done, hipStream_t stream, FlagGemmKernel kernel) {
  if (m <= 0 || n <= 0 || k <= 0 || k % 8 != 0 || n % 8 != 0 || lda % 8 != 0 || ldb % 8 != 0 || lda < k || ldb < n || ldc < n)
    throw Error(Errc::invalid_argument,
                "flag_gemm: m, n, k must be positive, k and n multiples of 8, lda >= k and ldb >= n multiples of 8, "
                "ldc >= n; got m " + std::to_string(m) + ", n " + std::to_string(n) + ", k " + std::to_string(k));
  if (reinterpret_cast<std::uintptr_t>(a) % 16 != 0 || reinterpret_cast<std::uintptr_t>(b) % 16 != 0)
    throw Error(Errc::invalid_argument, "flag_gemm: a and b must be 16-byte aligned (rows are loaded 16 bytes at a time)");
  if (parts.count < 1 || parts.copies < 1 || parts.count * parts.copies > FlagGemmParts::kMaxParts || parts.rows <= 0 ||
      (m + parts.rows - 1) / parts.rows != parts.count)
    throw Error(Errc::invalid_argument,
                "flag_gemm: parts.count and parts.copies must be at least 1 with count x copies at most " +
                    std::to_string(FlagGemmParts::kMaxParts) +
                    ", and count equal to the parts of parts.rows rows that m takes; got count " +
                    std::to_string(parts.count) + ", copies " + std::to_string(parts.copies) + ", rows " +
                    std::to_string(parts.rows) + ", m " + std::to_string(m));
  dev::OutputParts out{};
  out.part_rows = parts.rows;
  out.ldc = ldc;
  out.copies = parts.copies;
  out.counted = false;
  for (int p = 0; p < parts.count * parts.copies; ++p) {
    if (parts.c[p] == nullptr)
      throw Error(Errc::invalid_argument, "flag_gemm: parts.c[" + std::to_string(p) + "] is null");
    out.c[p] = parts.c[p];
    out.done[p] = parts.done[p];
    out.counted = out.counted || parts.done[p] != nullptr;
  }
  if (out.counted && rows_per_done <= 0)
    throw Error(Errc::invalid_argument, "flag_gemm: rows_per_done must be positive when done words are given");
  if (flags != nullptr && rows_per_flag <= 0)
    throw Error(Errc::invalid_argument, "flag_gemm: rows_per_flag must be positive when flags are given");
  if (m > (1L << 31) - kTileM || n > (1L << 31) || k > (1L << 31))
    throw Error(Errc::invalid_argument, "flag_gemm: m, n and k must each be below 2^31");
#ifdef CARAVAN_HAVE_SM90_KERNELS
  if (hopper_kernel_for(ldc, &parts, kernel)) {
    sm90::flag_gemm(a, lda, b, ldb, out, m, n, k, flags, rows_per_flag, epoch, tile_order, rows_per_done,
                    sm90::choose_tile_n(m, n), kernel == FlagGemmKernel::persistent, stream);
    return;
  }
#endif
  if (flag_gemm_row_tiles(m) > 65535)  // the grid's y dimension
    throw Error(Errc::invalid_argument, "flag_gemm: the portable kernel takes at most 65535 row tiles (m up to " +
                                            std::to_string(65535L * kTileM) + "); got m " + std::to_string(m));
  const dim3 grid(static_cast<unsigned>((n + kTileN - 1) / kTileN), static_cast<unsigned>(flag_gemm_row_tiles(m)));
  launch_checked(flag_gemm_kernel, dim3(grid), dim3(kThreads), 0, stream, a, lda, b, ldb, out, m, n, k, flags,
                 rows_per_flag, epoch, tile_order, rows_per_done);
}

void flag_gemm(const bf16* a, long lda, const bf16* b, long ldb, bf16* c, long ldc, long m, long n, long k,
               std::uint64_t* flags, long rows_per_flag, std::uint64_t epoch, const int* tile_order,
               std::uint64_t* done, long rows_per_done, hipStream_t stream, FlagGemmKernel kernel) {
  FlagGemmParts whole;
  whole.count = 1;
  whole.copies = 1;
  whole.rows = std::max(m, 1L);
  whole.c[0] = c;
  whole.done[0] = done;
  flag_gemm_parts(a, lda, b, ldb, whole, ldc, m, n, k, flags, rows_per_flag, epoch, tile_order, rows_per_done, stream,
                  kernel);
}

}  // namespace caravan::gpu
