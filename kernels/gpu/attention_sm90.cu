// The Hopper path of the fused causal attention (kernels.h: fused_causal_attention), built for
// sm_90a only (the sm90 library, see CMakeLists.txt). The same forward pass of flash attention as
// the portable mma.sync kernel in attention.cu, written the way the Hopper tensor cores want it
// (FlashAttention-3's design, written from its paper). Persistent: a block per SM at most, each
// taking work items (128 query rows of one head) in turn, heaviest first.
//   - a producer warpgroup, one thread of which issues TMA loads: an item's 128 query rows once
//     (as soon as the previous item's last scores are done), then each 128-key tile of K and of V
//     into a ring of stages, each half with its own mbarrier so the scores can start while V is
//     still landing;
//   - two consumer warpgroups of 64 query rows each compute the scores S = Q K^T with wgmma
//     straight from shared memory (both operands K-major), fold them into the online softmax in
//     registers, and add P V with wgmma taking P from registers: the accumulator layout of S is,
//     pair for pair, the register layout of wgmma's A operand, as with mma.sync. The next tile's
//     scores are issued with the current P V, and the softmax runs while P V is computed.
// Each consumer gives a stage back (one arrival per warp) once its products on it are done. A
// consumer whose 64 rows see none of a tile's keys (the second on the last query block when
// tokens % 128 is 1 to 64: all its rows are past the end) skips its products but still gives the
// stage back, once the tile has landed.
// Not here: FlashAttention-3's turn-taking between the two consumers, which changed nothing on an
// H100 (docs/overlap.md). TMA coordinates are 32-bit: the dispatcher sends longer sequences to
// the portable kernel.
#include "kernels/gpu/attention_sm90.h"

#include "kernels/gpu/online_softmax.cuh"
#include "kernels/gpu/sm90.cuh"
#include "kernels/gpu/sm90_host.h"

#include <caravan/error.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace caravan::gpu::sm90 {
namespace {

// 128 keys per K or V tile: with 64 (twice the per-tile waits, fences and row reductions) the
// kernel was 8-15% slower on 70B's shapes at 8192-16384 tokens on an H100, up to 14% on 8B's, and
// the same at 4096 (docs/results/attention-key-tile-h100-s23.txt).
constexpr int kBlockRows = 128, kConsumerRows = 64, kKeyTile = 128;
constexpr int kBoxColumns = 64;                        // bf16 per 128-byte swizzled row of a TMA box
constexpr int kThreads = 3 * 128;                      // producer + two consumer warpgroups
constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
constexpr int kStages = 3;  // with 2, a stage is given back only one tile before its refill is needed

template <int D>
struct AttentionConfig {
  static constexpr int kBoxes = D / kBoxColumns;               // boxes across one head's D columns
  static constexpr int kQBoxBytes = kConsumerRows * 128;       // 64 query rows x 128 bytes
  static constexpr int kKeyBoxBytes = kKeyTile * 128;          // a tile's keys x 128 bytes
  static constexpr int kQTileBytes = kBoxes * kQBoxBytes;      // a consumer's 64 query rows of one head
  static constexpr int kKeyTileBytes = kBoxes * kKeyBoxBytes;  // a K or V tile of one head
  static constexpr int kQBytes = 2 * kQTileBytes;
  // Q, then the stages (K tile, V tile), from a 1024-byte boundary (the swizzle's period); then
  // the barriers: Q landed, Q free, and per stage K landed, V landed and stage free.
  static constexpr int kSharedBytes = 1024 + kQBytes + kStages * 2 * kKeyTileBytes + (2 + 3 * kStages) * 8;
  static_assert(kSharedBytes <= 227 * 1024, "fits in an SM's shared memory");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define CARAVAN_OUT8(c, i) \
  c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3]), c(d[i + 4]), c(d[i + 5]), c(d[i + 6]), c(d[i + 7])
#define CARAVAN_OUT32(c) CARAVAN_OUT8(c, 0), CARAVAN_OUT8(c, 8), CARAVAN_OUT8(c, 16), CARAVAN_OUT8(c, 24)
#define CARAVAN_OUT64(c) \
  CARAVAN_OUT32(c), CARAVAN_OUT8(c, 32), CARAVAN_OUT8(c, 40), CARAVAN_OUT8(c, 48), CARAVAN_OUT8(c, 56)
#define CARAVAN_REGS32                                                                                             \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31"
#define CARAVAN_REGS64                                                                                               \
  CARAVAN_REGS32                                                                                                     \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, " \
  "%54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CARAVAN_ACCUMULATE(x) "+f"(x)
#define CARAVAN_OVERWRITE(x) "=f"(x)

// The scores S (64 x 128, fp32) += A (64 x 16, K-major, shared) x B (16 x 128, K-major, shared), or,
// in the _overwrite forms, S = A x B (S only written, not an input of the product). The
// immediates after the predicate: A's and B's scales (1) and transposes (none).
__device__ __forceinline__ void wgmma_m64n128_ss(float (&d)[64], std::uint64_t a, std::uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" CARAVAN_REGS64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : CARAVAN_OUT64(CARAVAN_ACCUMULATE)
      : "l"(a), "l"(b));
}
__device__ __forceinline__ void wgmma_m64n128_ss_overwrite(float (&d)[64], std::uint64_t a, std::uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" CARAVAN_REGS64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : CARAVAN_OUT64(CARAVAN_OVERWRITE)
      : "l"(a), "l"(b));
}
// O (64 x N, fp32) += A (64 x 16, registers: the m16n8k16 A fragment of each warp's 16 rows) x
// B (16 x N, N-major, shared): B transposed, as flag_gemm's B.
__device__ __forceinline__ void wgmma_m64n64_rs(float (&d)[32], const std::uint32_t (&a)[4], std::uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" CARAVAN_REGS32
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : CARAVAN_OUT32(CARAVAN_ACCUMULATE)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
__device__ __forceinline__ void wgmma_m64n128_rs(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" CARAVAN_REGS64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : CARAVAN_OUT64(CARAVAN_ACCUMULATE)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
#undef CARAVAN_OUT8
#undef CARAVAN_OUT32
#undef CARAVAN_OUT64
#undef CARAVAN_REGS32
#undef CARAVAN_REGS64
#undef CARAVAN_ACCUMULATE
#undef CARAVAN_OVERWRITE

// wgmma reads and writes registers after its asm statement has issued, which the compiler does
// not know: it may move a use of an accumulator above the wait, or give registers it thinks dead
// (an A operand still being read) to other values. An empty asm that reads and writes each
// register, placed after the wait, pins both: the values pass through it, so nothing reads them
// before it and nothing reuses their registers until it.
template <int N>
__device__ __forceinline__ void pin_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin_registers(std::uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

template <int D>
__device__ __forceinline__ void wgmma_output(float (&d)[D / 2], const std::uint32_t (&a)[4], std::uint64_t b) {
  if constexpr (D == 128)
    wgmma_m64n128_rs(d, a, b);
  else
    wgmma_m64n64_rs(d, a, b);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Persistent: at most one block per SM, each taking work items (128 query rows of one head) in
// turn, the heaviest first, so that its producer loads the next item's rows and first tiles while
// the consumers finish the last product and store the item before.
template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    attention_sm90_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                          const __grid_constant__ CUtensorMap map_v, long tokens, int heads, int group,
                          float scale_log2, bf16* out, long ld_out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = AttentionConfig<D>;
  extern __shared__ unsigned char shared_raw[];
  unsigned char* q_tile =
      reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(shared_raw) + 1023) & ~std::uintptr_t{1023});
  unsigned char* stages = q_tile + C::kQBytes;
  std::uint64_t* q_full = reinterpret_cast<std::uint64_t*>(stages + kStages * 2 * C::kKeyTileBytes);
  std::uint64_t* q_empty = q_full + 1;
  std::uint64_t* k_full = q_empty + 1;
  std::uint64_t* v_full = k_full + kStages;
  std::uint64_t* empty = v_full + kStages;
  const auto k_stage = [&](int s) { return stages + s * 2 * C::kKeyTileBytes; };
  const auto v_stage = [&](int s) { return stages + s * 2 * C::kKeyTileBytes + C::kKeyTileBytes; };

  // Causal work grows with the query block: the last query blocks go first (every head of one,
  // then the next), so short items fill the tail.
  const long query_blocks = (tokens + kBlockRows - 1) / kBlockRows, items = query_blocks * heads;
  struct Item {
    long q0;
    int head, key_tiles;
  };
  const auto item_at = [&](long i) {
    const long q0 = (query_blocks - 1 - i / heads) * kBlockRows;
    return Item{q0, static_cast<int>(i % heads), static_cast<int>((min(q0 + kBlockRows, tokens) - 1) / kKeyTile) + 1};
  };
  const auto parity = [](int n) { return static_cast<std::uint32_t>((n / kStages) & 1); };
  // The item a block takes n-th: rounds of one item per block, every other round in reverse
  // block order, so that the heavy and the light items even out over a block's rounds (taken
  // round-robin, the first block got the heaviest of every round: up to 10% slower at 16k tokens).
  const auto item_index = [&](int n) {
    const long round = static_cast<long>(n) * gridDim.x;
    return round + (n % 2 == 0 ? blockIdx.x : gridDim.x - 1 - blockIdx.x);
  };
  const int warpgroup = static_cast<int>(threadIdx.x) / 128;

  if (threadIdx.x == 0) {
    barrier_init(q_full, 1);
    barrier_init(q_empty, 2 * 4);  // one arrival per consumer warp
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&k_full[s], 1);
      barrier_init(&v_full[s], 1);
      barrier_init(&empty[s], 2 * 4);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    if (threadIdx.x == 0) {
      int loaded = 0;  // K and V tiles this block has loaded: the stage ring's position
      int taken = 0;   // items this block has taken
      for (long i = item_index(0); i < items; i = item_index(++taken)) {
        const Item item = item_at(i);
        const int kv_head = item.head / group;
        if (taken > 0) barrier_wait(q_empty, (taken - 1) & 1);  // the last item's scores are done
        barrier_expect_bytes(q_full, C::kQBytes);
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int b = 0; b < C::kBoxes; ++b)
            tma_load(q_tile + (c * C::kBoxes + b) * C::kQBoxBytes, &map_q, q_full, item.head * D + b * kBoxColumns,
                     static_cast<int>(item.q0) + c * kConsumerRows);
        for (int j = 0; j < item.key_tiles; ++j, ++loaded) {
          const int s = loaded % kStages;
          if (loaded >= kStages) barrier_wait(&empty[s], parity(loaded) ^ 1);
          barrier_expect_bytes(&k_full[s], C::kKeyTileBytes);
#pragma unroll
          for (int b = 0; b < C::kBoxes; ++b)
            tma_load(k_stage(s) + b * C::kKeyBoxBytes, &map_k, &k_full[s], kv_head * D + b * kBoxColumns, j * kKeyTile);
          barrier_expect_bytes(&v_full[s], C::kKeyTileBytes);
#pragma unroll
          for (int b = 0; b < C::kBoxes; ++b)
            tma_load(v_stage(s) + b * C::kKeyBoxBytes, &map_v, &v_full[s], kv_head * D + b * kBoxColumns, j * kKeyTile);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
  const int consumer = warpgroup - 1;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = (static_cast<int>(threadIdx.x) % 128) / 32;
  const int g = lane / 4, t = lane % 4;
  const bool warp_leader = lane == 0;
  const unsigned char* my_q = q_tile + consumer * C::kQTileBytes;

  // Per item: the first query row of this warp; the output accumulator and, per lane, rows g and
  // g + 8 of its warp: running maximum (scaled by log2 e / sqrt(D)) and this lane's part of the
  // running sum. Accumulator layout of m64nNk16: warp w holds rows 16w + g and + 8; in each group
  // of 8 columns, columns 2t and 2t + 1.
  long warp_first = 0;
  float o[D / 2];
  float row_max[2], row_sum[2];
  // The scores of key tile j (stage s) into sc, issued, not waited for.
  const auto issue_scores = [&](float(&sc)[kKeyTile / 2], int s) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // 16 columns of depth: a box of 64 columns, 32 bytes along its swizzled rows.
      const std::uint64_t a = descriptor(my_q + (kk / 4) * C::kQBoxBytes + (kk % 4) * 32, 16, 1024);
      const std::uint64_t b = descriptor(k_stage(s) + (kk / 4) * C::kKeyBoxBytes + (kk % 4) * 32, 16, 1024);
      if (kk == 0)
        wgmma_m64n128_ss_overwrite(sc, a, b);
      else
        wgmma_m64n128_ss(sc, a, b);
    }
    wgmma_commit();
  };
  // o += P V for the probabilities p of the tile in stage s, issued, not waited for.
  const auto issue_output = [&](const std::uint32_t(&p)[kKeyTile / 16][4], int s) {
#pragma unroll
    for (int kk = 0; kk < kKeyTile / 16; ++kk)
      // 16 keys = two 8-row groups of 1024 bytes; boxes of 64 columns of V kKeyBoxBytes apart.
      wgmma_output<D>(o, p[kk], descriptor(v_stage(s) + kk * 2048, C::kKeyBoxBytes, 1024));
    wgmma_commit();
  };
  // Folds key tile j's scores into the running maximum and sum, leaving the probabilities in sc
  // (fp32) and the factor by which o must be scaled before they are added.
  const auto softmax = [&](float(&sc)[kKeyTile / 2], int j, float(&correction)[2]) {
    const long key0 = static_cast<long>(j) * kKeyTile;
    const bool diagonal = key0 + kKeyTile - 1 > warp_first;
    const auto at = [&](int n, int e) -> float& { return sc[4 * n + e]; };
    if (diagonal) mask_keys_past_rows<kKeyTile / 8>(at, static_cast<int>(key0 - warp_first), g, t);
    float tile_max[2];
    scaled_tile_maxima<kKeyTile / 8>(at, scale_log2, tile_max);
    float base[2];
    fold_tile_maxima(tile_max, row_max, base, correction);
    float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < kKeyTile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[4 * n + e] = probability(sc[4 * n + e], scale_log2, base[e / 2]);
        tile_sum[e / 2] += sc[4 * n + e];
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) row_sum[i] = row_sum[i] * correction[i] + tile_sum[i];
  };
  // The probabilities as bf16 A fragments of P V: 16 keys (two groups of 8 columns) make one.
  const auto pack_probabilities = [&](const float(&sc)[kKeyTile / 2], std::uint32_t(&p)[kKeyTile / 16][4]) {
#pragma unroll
    for (int n = 0; n < kKeyTile / 8; ++n) {
      p[n / 2][(n % 2) * 2] = pack_bf16(sc[4 * n], sc[4 * n + 1]);
      p[n / 2][(n % 2) * 2 + 1] = pack_bf16(sc[4 * n + 2], sc[4 * n + 3]);
    }
  };
  const auto rescale_output = [&](const float(&correction)[2]) {
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
      o[4 * c] *= correction[0];
      o[4 * c + 1] *= correction[0];
      o[4 * c + 2] *= correction[1];
      o[4 * c + 3] *= correction[1];
    }
  };

  int consumed = 0;  // K and V tiles this block's producer has handed out before this item
  int taken = 0;
  for (long i = item_index(0); i < items; i = item_index(++taken)) {
    const Item item = item_at(i);
    const long row0 = item.q0 + consumer * kConsumerRows;
    // Key tiles holding a key some row of this consumer sees (none if all its rows are past the end).
    const int my_tiles = row0 < tokens ? static_cast<int>((min(row0 + kConsumerRows, tokens) - 1) / kKeyTile) + 1 : 0;
    warp_first = row0 + warp * 16;
#pragma unroll
    for (int c = 0; c < D / 2; ++c) o[c] = 0.0f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.0f;
    // Stage and phase of this item's key tile j.
    const auto stage = [&](int j) { return (consumed + j) % kStages; };
    const auto phase = [&](int j) { return parity(consumed + j); };
    barrier_wait(q_full, taken & 1);

    // Software pipelining within the warpgroup (FlashAttention-3's): while the tensor cores add
    // tile j - 1's P V, and compute tile j's scores, the warps wait only for the scores, then run
    // tile j's softmax, so the exponentials overlap the P V product. The probabilities are packed
    // into P V's A registers only once that product is done: ptxas serializes every wgmma (C7513)
    // if an A register of one is written while any is in flight.
    if (my_tiles > 0) {
      float sc[kKeyTile / 2];
      std::uint32_t p[kKeyTile / 16][4];
      float correction[2];
      barrier_wait(&k_full[stage(0)], phase(0));
      wgmma_fence();
      issue_scores(sc, stage(0));
      wgmma_wait<0>();
      pin_registers(sc);
      softmax(sc, 0, correction);  // o is still zero: nothing to rescale
      pack_probabilities(sc, p);
      for (int j = 1; j < my_tiles; ++j) {
        barrier_wait(&k_full[stage(j)], phase(j));
        barrier_wait(&v_full[stage(j - 1)], phase(j - 1));
        wgmma_fence();
        issue_scores(sc, stage(j));
        issue_output(p, stage(j - 1));
        wgmma_wait<1>();  // the scores; P V may still run, reading p and adding into o
        pin_registers(sc);
        softmax(sc, j, correction);
        wgmma_wait<0>();
        pin_registers(p);
        pin_registers(o);
        if (warp_leader) barrier_arrive(&empty[stage(j - 1)]);
        rescale_output(correction);
        pack_probabilities(sc, p);
      }
      // The query rows are read for the last time: the producer may load the next item's.
      if (warp_leader) barrier_arrive(q_empty);
      const int last = stage(my_tiles - 1);
      barrier_wait(&v_full[last], phase(my_tiles - 1));
      wgmma_fence();
      issue_output(p, last);
      wgmma_wait<0>();
      pin_registers(p);
      pin_registers(o);
      if (warp_leader) barrier_arrive(&empty[last]);
    } else if (warp_leader) {
      barrier_arrive(q_empty);
    }
    // Tiles none of this consumer's rows see: wait until they have landed (so that this
    // consumer's arrivals fall in the same phase of each stage as the other's), then give them back.
    for (int j = my_tiles; j < item.key_tiles; ++j) {
      barrier_wait(&k_full[stage(j)], phase(j));
      barrier_wait(&v_full[stage(j)], phase(j));
      if (warp_leader) barrier_arrive(&empty[stage(j)]);
    }
    consumed += item.key_tiles;

    float inverse[2];
    row_sum_inverses(row_sum, inverse);
    bf16* out_head = out + static_cast<long>(item.head) * D;
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
      const int col = c * 8 + 2 * t;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const long row = warp_first + g + r * 8;
        if (row < tokens)
          *reinterpret_cast<std::uint32_t*>(out_head + row * ld_out + col) =
              pack_bf16(o[4 * c + 2 * r] * inverse[r], o[4 * c + 2 * r + 1] * inverse[r]);
      }
    }
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

HopperDevices g_devices;

template <int D>
void grant_shared_memory() {
  CARAVAN_HIP_CHECK(cudaFuncSetAttribute(&attention_sm90_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         AttentionConfig<D>::kSharedBytes));
}

template <int D>
void launch(const AttentionArguments& a, hipStream_t stream) {
  const CUtensorMap map_q =
      tensor_map("fused_causal_attention (q)", a.q, a.tokens, a.q_heads * D, a.ld, kBoxColumns, kConsumerRows);
  const CUtensorMap map_k =
      tensor_map("fused_causal_attention (k)", a.k, a.tokens, a.kv_heads * D, a.ld, kBoxColumns, kKeyTile);
  const CUtensorMap map_v =
      tensor_map("fused_causal_attention (v)", a.v, a.tokens, a.kv_heads * D, a.ld, kBoxColumns, kKeyTile);
  const long items = (a.tokens + kBlockRows - 1) / kBlockRows * a.q_heads;
  const dim3 grid(static_cast<unsigned>(std::min<long>(items, current_multiprocessors())));
  const float scale_log2 = a.scale * 1.4426950408889634f;
  launch_checked(attention_sm90_kernel<D>, dim3(grid), dim3(kThreads), AttentionConfig<D>::kSharedBytes, stream, map_q,
                 map_k, map_v, a.tokens, static_cast<int>(a.q_heads), static_cast<int>(a.q_heads / a.kv_heads),
                 scale_log2, a.out, a.ld_out);
}

}  // namespace

bool attention_available() {
  return g_devices.ready_on_current_device([] {
    grant_shared_memory<64>();
    grant_shared_memory<128>();
    find_tensor_map_encoder();
  });
}

bool attention_supports(long head_dim) { return head_dim == 64 || head_dim == 128; }

void fused_causal_attention(const AttentionArguments& a, hipStream_t stream) {
  if (a.head_dim == 64)
    launch<64>(a, stream);
  else
    launch<128>(a, stream);
}

}  // namespace caravan::gpu::sm90
