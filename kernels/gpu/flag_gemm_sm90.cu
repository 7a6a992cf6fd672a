// The Hopper path of flag_gemm (kernels.h): the same contract as the portable WMMA kernel in
// flag_gemm.cu, built for sm_90a only (this file is its own library, see CMakeLists.txt) because
// it uses the instructions that make Hopper fast and exist nowhere else:
//   - TMA (cp.async.bulk.tensor) brings 128 x 64 tiles of A and 64 x 64 tiles of B into shared
//     memory in the 128-byte swizzled layout the tensor cores read, one thread issuing them;
//   - wgmma (warpgroup MMA, m64nNk16) multiplies straight out of shared memory into fp32
//     registers, asynchronously, so the next tiles' loads overlap the math;
//   - mbarriers with transaction counts tell a consumer when a stage has landed and tell the
//     producer when a stage may be overwritten.
// One block computes a 128 x BN tile of C (BN = 256, or 128 for narrow matrices) with three
// warpgroups: a producer (one thread issues every load; the others give their registers to the
// consumers through setmaxnreg) and two consumers of 64 rows each.
//
// Two epilogues. The plain one (a grid of one block per tile) stages the tile in the stages'
// memory and the consumers store it: the block's SM runs nothing else until the stores are done,
// which is cheap for local C but costs up to two thirds more when C is another GPU's
// (GEMM+ReduceScatter tile-scatter at K = 2048). The persistent one (one block per SM, each
// taking tiles in turn) hands the staged tile to the producer warpgroup's three idle warps, which
// store it and count it done while the consumers go on to the next tile's products, whose loads
// the producer has already issued. Its staging buffer costs a stage (three stages for 256-column
// tiles, five for 128). Sending the rows with bulk copies (cp.async.bulk, shared to global)
// instead was slower than the plain epilogue on 4 x H200 (likely because they share the TMA unit
// with the stages' loads).
//
// Flags: before the producer issues the first load of A for its tile, it waits (acquire, system
// scope) for the flags of the tile's rows, then orders that acquire before its TMA reads with a
// proxy fence (TMA reads through the async proxy; without the fence the hardware need not order
// them after a generic-proxy load). B needs no flag, but a stage's A and B loads complete one
// transaction, so the first B tiles wait with A. Blocks are launched in groups of row tiles
// taken in `tile_order`, so rows are consumed in the order they arrive, a group at a time.
#include "kernels/gpu/flag_gemm_sm90.h"

#include "kernels/gpu/flag_gemm_rows.cuh"
#include "kernels/gpu/sm90.cuh"
#include "kernels/gpu/sm90_host.h"

#include <caravan/error.h>

#include <cuda.h>  // CUtensorMap

#include <algorithm>

namespace caravan::gpu::sm90 {
namespace {

constexpr int kTileM = 128, kTileK = 64;
constexpr int kBlockN = 64;                       // columns of B per TMA box: 64 bf16 = one 128-byte row
constexpr int kABytes = kTileM * kTileK * 2;      // 16 KiB per stage
constexpr int kBBoxBytes = kTileK * kBlockN * 2;  // 8 KiB per box of B
constexpr int kThreads = 3 * 128;                 // producer + two consumer warpgroups
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
constexpr int kStoreThreads = 96;  // the persistent epilogue's store warps: the producer warpgroup's warps 1-3
constexpr int kGroupRows = 16;  // row tiles per group of the block order (4, 8, 16, 32 measured within 5%)

template <int TileN, bool Persistent>
struct Config {
  static constexpr int kStages = (TileN == 256 ? 4 : 6) - (Persistent ? 1 : 0);
  static constexpr int kBBytes = TileN / kBlockN * kBBoxBytes;
  static constexpr int kStageBytes = kABytes + kBBytes;
  // A staged row of C: padded by 16 bytes, so that the 8 rows one warp's store touches fall in
  // distinct banks.
  static constexpr int kPitch = TileN * 2 + 16;
  static constexpr int kEpilogueBytes = Persistent ? 2 * 64 * kPitch : 0;
  // Stages start at a 1024-byte boundary (the swizzle pattern's period); the persistent
  // epilogue's buffer, then the barriers (full and empty per stage, staged and drained) follow.
  static constexpr int kSharedBytes = 1024 + kStages * kStageBytes + kEpilogueBytes + (2 * kStages + 2) * 8;
  static_assert(kSharedBytes <= 227 * 1024, "fits in an SM's shared memory");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define CARAVAN_ACC8(i)                                                                                       \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])

// D (64 x N, fp32, in registers) += A (64 x 16, K-major) x B (16 x N, N-major); `accumulate` 0
// overwrites D. The last two immediates: A not transposed (K-major), B transposed (N-major).
__device__ __forceinline__ void wgmma_m64n256(float (&d)[128], std::uint64_t a, std::uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
      : CARAVAN_ACC8(0), CARAVAN_ACC8(8), CARAVAN_ACC8(16), CARAVAN_ACC8(24), CARAVAN_ACC8(32), CARAVAN_ACC8(40),
        CARAVAN_ACC8(48), CARAVAN_ACC8(56), CARAVAN_ACC8(64), CARAVAN_ACC8(72), CARAVAN_ACC8(80), CARAVAN_ACC8(88),
        CARAVAN_ACC8(96), CARAVAN_ACC8(104), CARAVAN_ACC8(112), CARAVAN_ACC8(120)
      : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_m64n128(float (&d)[64], std::uint64_t a, std::uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 1;\n}\n"
      : CARAVAN_ACC8(0), CARAVAN_ACC8(8), CARAVAN_ACC8(16), CARAVAN_ACC8(24), CARAVAN_ACC8(32), CARAVAN_ACC8(40),
        CARAVAN_ACC8(48), CARAVAN_ACC8(56)
      : "l"(a), "l"(b), "r"(accumulate));
}
#undef CARAVAN_ACC8

template <int TileN>
__device__ __forceinline__ void wgmma_tile(float (&d)[TileN / 2], std::uint64_t a, std::uint64_t b, int accumulate) {
  if constexpr (TileN == 256)
    wgmma_m64n256(d, a, b, accumulate);
  else
    wgmma_m64n128(d, a, b, accumulate);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The tile with linear index `tile` in launch order: blocks in groups of `group_rows` row tiles
// (consecutive in `tile_order`), each group swept column by column, so the tiles computed at
// once share a few columns of B and a few rows of A in L2. Sweeping whole rows instead streams
// all of B from memory for every few rows (a 8192 x 14336 B is 235 MB; that order ran at half
// of cuBLAS's speed on an H100).
struct TileAt {
  long m0, n0;
};
__device__ __forceinline__ TileAt tile_at(long tile, long m, long col_tiles, long group_rows, const int* tile_order,
                                          int tile_n) {
  const long row_tiles = (m + kTileM - 1) / kTileM;
  const long group = tile / (group_rows * col_tiles), first_row = group * group_rows;
  const long rows_in_group = min(group_rows, row_tiles - first_row);
  const long in_group = tile - group * group_rows * col_tiles;
  const long row_index = first_row + in_group % rows_in_group;
  const int m_tile = tile_order ? tile_order[row_index] : static_cast<int>(row_index);
  return {static_cast<long>(m_tile) * kTileM, (in_group / rows_in_group) * tile_n};
}

template <int TileN, bool Persistent>
__global__ void __launch_bounds__(kThreads, 1)
    flag_gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                          const __grid_constant__ dev::OutputParts out, long m, long n, long k, long col_tiles,
                          long group_rows, std::uint64_t* flags, long rows_per_flag, std::uint64_t epoch,
                          const int* tile_order, long rows_per_done) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Config<TileN, Persistent>;
  extern __shared__ unsigned char shared_raw[];
  unsigned char* stages =
      reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(shared_raw) + 1023) & ~std::uintptr_t{1023});
  unsigned char* epilogue_buffer = stages + C::kStages * C::kStageBytes;
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(epilogue_buffer + C::kEpilogueBytes);
  std::uint64_t* empty = full + C::kStages;
  // The persistent epilogue's hand-over: the consumers have staged a tile (staged), the store
  // warps have read it out (drained).
  std::uint64_t* staged_full = empty + C::kStages;
  std::uint64_t* staged_drained = staged_full + 1;
  const auto stage_a = [&](int s) { return stages + s * C::kStageBytes; };
  const auto stage_b = [&](int s) { return stages + s * C::kStageBytes + kABytes; };

  const int warpgroup = threadIdx.x / 128;
  const long tiles = col_tiles * ((m + kTileM - 1) / kTileM);
  const int k_tiles = static_cast<int>((k + kTileK - 1) / kTileK);
  // Without Persistent the grid has a block per tile and the loops below run once.

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], 2 * 4);  // one arrival per consumer warp
    }
    barrier_init(staged_full, 256);  // every consumer thread
    barrier_init(staged_drained, kStoreThreads);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    if (threadIdx.x == 0) {
      int step = 0;  // k-steps loaded by this block over all its tiles: the stage ring's position
      for (long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const TileAt at = tile_at(tile, m, col_tiles, group_rows, tile_order, TileN);
        if (flags != nullptr) {
          dev::wait_for_tile_rows(flags, rows_per_flag, epoch, at.m0, kTileM, m);
          asm volatile("fence.proxy.async;\n" ::: "memory");  // the acquire above before the TMA reads below
        }
        for (int kt = 0; kt < k_tiles; ++kt, ++step) {
          const int s = step % C::kStages;
          if (step >= C::kStages) barrier_wait(&empty[s], ((step / C::kStages) - 1) & 1);
          barrier_expect_bytes(&full[s], C::kStageBytes);
          const int k0 = kt * kTileK;
          tma_load(stage_a(s), &map_a, &full[s], k0, static_cast<int>(at.m0));
#pragma unroll
          for (int j = 0; j < TileN / kBlockN; ++j)
            tma_load(stage_b(s) + j * kBBoxBytes, &map_b, &full[s], static_cast<int>(at.n0) + j * kBlockN, k0);
        }
      }
    }
    if constexpr (Persistent) {
      if (threadIdx.x >= 32) {  // the store warps: each tile of this block, as the consumers stage it
        const int t = threadIdx.x - 32;
        constexpr int kChunksPerRow = TileN * 2 / 16;
        static_assert(kStoreThreads % kChunksPerRow == 0, "each store thread keeps one chunk of a row");
        const int chunk = t % kChunksPerRow;
        const unsigned char* staged = epilogue_buffer;
        int handed = 0;
        for (long tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++handed) {
          const TileAt at = tile_at(tile, m, col_tiles, group_rows, tile_order, TileN);
          barrier_wait(staged_full, handed & 1);
          // Each row goes to its part of C, which may be this GPU's memory or a peer's.
          // A thread keeps one 16-byte chunk of a row (kStoreThreads is a multiple of the chunks).
          const long col = at.n0 + chunk * 8;
          if (col < n) {  // n is a multiple of 8: a chunk is wholly in or out
            const long rows = min(static_cast<long>(kTileM), m - at.m0);
            for (int r = t / kChunksPerRow; r < rows; r += kStoreThreads / kChunksPerRow)
              dev::store_to_copies(out, at.m0 + r, col,
                                   *reinterpret_cast<const uint4*>(staged + r * C::kPitch + chunk * 16));
          }
          barrier_arrive(staged_drained);  // this thread's reads of the buffer are done
          if (out.counted) {
            named_barrier_sync(4, kStoreThreads);  // every store warp's rows are written
            if (t == 0) dev::count_tile_rows_done(out, rows_per_done, at.m0, kTileM, m, min(at.n0 + TileN, n) - at.n0);
          }
        }
      }
    }
    return;
  }
  // Consumers: warpgroup 1 owns rows 0..63 of the tile, warpgroup 2 rows 64..127.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
  const int consumer = warpgroup - 1;
  const bool warp_leader = threadIdx.x % 32 == 0;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, thread = threadIdx.x % 128;
  // Accumulator layout of m64nNk16: warp w of the warpgroup holds rows 16w + lane/4 and +8; in
  // each group of 8 columns, columns 2 * (lane % 4) and +1.
  const int local_row = warp * 16 + lane / 4;
  constexpr int kPitch = C::kPitch;
  float d[TileN / 2];
  // This consumer's 64 rows of the tile, rounded to bf16, into `staged` (rows kPitch apart).
  const auto stage_accumulators = [&](unsigned char* staged) {
#pragma unroll
    for (int j = 0; j < TileN / 8; ++j) {
      const int col = j * 8 + (lane % 4) * 2;
      *reinterpret_cast<__nv_bfloat162*>(staged + local_row * kPitch + col * 2) =
          __floats2bfloat162_rn(d[4 * j], d[4 * j + 1]);
      *reinterpret_cast<__nv_bfloat162*>(staged + (local_row + 8) * kPitch + col * 2) =
          __floats2bfloat162_rn(d[4 * j + 2], d[4 * j + 3]);
    }
  };
  int handed = 0;  // tiles staged for the persistent epilogue's store warps
  int step = 0;
#pragma unroll
  for (int i = 0; i < TileN / 2; ++i) d[i] = 0.0f;
  for (long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const TileAt at = tile_at(tile, m, col_tiles, group_rows, tile_order, TileN);
    for (int kt = 0; kt < k_tiles; ++kt, ++step) {
      const int s = step % C::kStages;
      barrier_wait(&full[s], (step / C::kStages) & 1);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kTileK / 16; ++kk) {
        // A: this consumer's 64 rows (8 KiB in), 16 columns of k = 32 bytes along the swizzled row.
        const std::uint64_t a = descriptor(stage_a(s) + consumer * 64 * 128 + kk * 32, 16, 1024);
        // B: 16 rows of k = two 8-row groups of 1024 bytes; boxes of 64 columns 8 KiB apart.
        const std::uint64_t b = descriptor(stage_b(s) + kk * 2048, kBBoxBytes, 1024);
        wgmma_tile<TileN>(d, a, b, kt > 0 || kk > 0 ? 1 : 0);
      }
      wgmma_commit();
      // Keep this stage's products in flight; the previous stage's are done once at most one
      // group is pending, so its buffers go back to the producer.
      wgmma_wait<1>();
      if (kt > 0 && warp_leader) barrier_arrive(&empty[(step - 1) % C::kStages]);
    }
    wgmma_wait<0>();
    if (warp_leader) barrier_arrive(&empty[(step - 1) % C::kStages]);  // the last stage, for the next tile

    if constexpr (!Persistent) {
      // The epilogue goes through shared memory: stored straight from the accumulators, each warp
      // store would touch 16 rows 16 bytes apiece, and that cost 5-12% of the whole GEMM on an
      // H100. Every stage is free once both consumers are done with the last one (the producer
      // issued exactly the k-steps they waited for, for this block's one tile): each consumer
      // stages its 64 rows in its own stage, then copies them out a whole 16-byte-per-lane row
      // per warp.
      named_barrier_sync(1, 256);
      static_assert(64 * kPitch <= C::kStageBytes, "a consumer's rows fit in one stage");
      unsigned char* staged = stages + consumer * C::kStageBytes;
      stage_accumulators(staged);
      named_barrier_sync(2 + consumer, 128);
      constexpr int kChunksPerRow = TileN * 2 / 16;
      // Each row goes to its part of C, which may be this GPU's memory or a peer's.
      for (int i = thread; i < 64 * kChunksPerRow; i += 128) {
        const int r = i / kChunksPerRow, chunk = i % kChunksPerRow;
        const long row = at.m0 + consumer * 64 + r, col = at.n0 + chunk * 8;
        if (row < m && col < n)  // n is a multiple of 8: a chunk is wholly in or out
          dev::store_to_copies(out, row, col, *reinterpret_cast<const uint4*>(staged + r * kPitch + chunk * 16));
      }
      if (out.counted) {
        named_barrier_sync(1, 256);  // both consumers' rows are written
        if (threadIdx.x == 128)
          dev::count_tile_rows_done(out, rows_per_done, at.m0, kTileM, m, min(at.n0 + TileN, n) - at.n0);
      }
    } else {
      // Stage the tile once the store warps have read out the previous one, and hand it over.
      if (handed > 0) barrier_wait(staged_drained, (handed - 1) & 1);
      unsigned char* staged = epilogue_buffer + consumer * 64 * kPitch;
      stage_accumulators(staged);
      barrier_arrive(staged_full);
      ++handed;
    }
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

HopperDevices g_devices;

template <int TileN, bool Persistent>
void grant_shared_memory() {
  CARAVAN_HIP_CHECK(cudaFuncSetAttribute(&flag_gemm_sm90_kernel<TileN, Persistent>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Config<TileN, Persistent>::kSharedBytes));
}

// Grid columns of 128 x tile_n tiles, and the waves they take on `sms` multiprocessors.
long waves(long m, long n, int tile_n, int sms) {
  const long tiles = ((m + kTileM - 1) / kTileM) * ((n + tile_n - 1) / tile_n);
  return (tiles + sms - 1) / sms;
}

}  // namespace

bool available() {
  return g_devices.ready_on_current_device([] {
    grant_shared_memory<256, false>();
    grant_shared_memory<128, false>();
    grant_shared_memory<256, true>();
    grant_shared_memory<128, true>();
    // The encoder is looked up once per process; finding it now keeps the first call's latency
    // and its failure here.
    find_tensor_map_encoder();
  });
}

int choose_tile_n(long m, long n) {
  const int sms = current_multiprocessors();
  // Time ~ waves x the time of one tile. A 128-column tile took 0.68-0.75 of a 256-column
  // one's time on an H100 (it reloads A for half the columns and runs narrower products), so
  // 128 wins only where it saves more than a quarter of the waves.
  const double wide = static_cast<double>(waves(m, n, 256, sms)) * 1.0;
  const double narrow = static_cast<double>(waves(m, n, 128, sms)) * 0.72;
  return narrow < wide ? 128 : 256;
}

namespace {

template <int TileN, bool Persistent>
void launch(const CUtensorMap& map_a, const CUtensorMap& map_b, const dev::OutputParts& out, long m, long n, long k,
            std::uint64_t* flags, long rows_per_flag, std::uint64_t epoch, const int* tile_order, long rows_per_done,
            hipStream_t stream) {
  const long col_tiles = (n + TileN - 1) / TileN, tiles = col_tiles * ((m + kTileM - 1) / kTileM);
  long blocks = tiles;
  if (Persistent) blocks = std::min<long>(tiles, current_multiprocessors());
  launch_checked(flag_gemm_sm90_kernel<TileN, Persistent>, dim3(dim3(static_cast<unsigned>(blocks))), dim3(kThreads),
                 Config<TileN, Persistent>::kSharedBytes, stream, map_a, map_b, out, m, n, k, col_tiles, kGroupRows,
                 flags, rows_per_flag, epoch, tile_order, rows_per_done);
}

}  // namespace

void flag_gemm(const bf16* a, long lda, const bf16* b, long ldb, const dev::OutputParts& out, long m, long n, long k,
               std::uint64_t* flags, long rows_per_flag, std::uint64_t epoch, const int* tile_order, long rows_per_done,
               int tile_n, bool persistent, hipStream_t stream) {
  const CUtensorMap map_a = tensor_map("flag_gemm", a, m, k, lda, kTileK, kTileM);
  const CUtensorMap map_b = tensor_map("flag_gemm", b, k, n, ldb, kBlockN, kTileK);
  const auto run = tile_n == 256 ? (persistent ? &launch<256, true> : &launch<256, false>)
                                 : (persistent ? &launch<128, true> : &launch<128, false>);
  run(map_a, map_b, out, m, n, k, flags, rows_per_flag, epoch, tile_order, rows_per_done, stream);
}

}  // namespace caravan::gpu::sm90
