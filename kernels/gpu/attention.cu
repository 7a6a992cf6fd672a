// Fused causal attention for the GPU transformer layer (kernels.h: fused_causal_attention): the
// forward pass of flash attention. Each block owns 16 x warps query rows of one head and walks
// the keys in tiles of 64; per tile it computes the scores on the tensor cores, folds them into
// a running row maximum and sum (online softmax, fp32) and adds probabilities x V into an fp32
// accumulator held in registers, so neither the scores nor the probabilities ever reach memory.
//
// Written with mma.sync (m16n8k16, bf16 in, fp32 out) rather than WMMA because the online
// softmax needs to know which row and column each accumulator register holds, and because a
// score fragment is then, register for register, the probability operand of the next product.
// K and V tiles come in through cp.async, two stages, while the previous tile is computed.
//
// On Hopper (compute capability 9.0) the TMA + wgmma kernel of attention_sm90.cu runs instead,
// where it takes the head width (AttentionKernel).
#include "kernels/gpu/kernels.h"
#include "kernels/gpu/online_softmax.cuh"
#ifdef CARAVAN_HAVE_SM90_KERNELS
#include "kernels/gpu/attention_sm90.h"
#endif

#include <caravan/error.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

namespace caravan::gpu {
namespace {

constexpr int kKeyTile = 64;  // keys per step; also the unit of the causal diagonal
// Query rows per block when the caller does not choose: 128 (8 warps) reads each K/V tile once
// for twice the rows of 64 (4 warps), which is what the long prefill sequences need.
constexpr int kAttentionBlockRows = 128;

__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared without passing through registers; zero-filled when !valid (rows
// past the sequence must read as zeros, not garbage: 0 x NaN would poison a row).
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void commit_async() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending>
__device__ __forceinline__ void wait_async() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}
// Four 8 x 8 bf16 matrices; lane l gives the address of row (l % 8) of matrix (l / 8).
__device__ __forceinline__ void load_matrices(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}
__device__ __forceinline__ void load_matrices_transposed(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}
// c (16 x 8) += a (16 x 16) * b (16 x 8). Lane l = 4g + t holds c[g][2t, 2t+1] in c0, c1 and
// c[g + 8][2t, 2t+1] in c2, c3.
__device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Tiles in shared memory are row-major with D columns, the 16-byte chunks of each row permuted
// (chunk c of row r stored at c ^ (r mod 8)): ldmatrix reads 8 rows at one column, which then
// fall in 8 different bank groups instead of one.
template <int D>
__device__ __forceinline__ int swizzled(int row, int col) {
  constexpr int chunks = D / 8, mask = (chunks < 8 ? chunks : 8) - 1;
  return row * D + ((((col / 8) ^ (row & mask)) * 8) | (col % 8));
}

// Rows [row0, row0 + Rows) of a D-wide slice (leading dimension ld) into a swizzled tile.
template <int D, int Rows, int Threads>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* src, long ld, long row0, long rows) {
  constexpr int chunks = D / 8;
  for (int i = static_cast<int>(threadIdx.x); i < Rows * chunks; i += Threads) {
    const int r = i / chunks, c = i % chunks;
    const long global_row = row0 + r;
    const bool valid = global_row < rows;
    copy16_async(tile + swizzled<D>(r, c * 8), src + (valid ? global_row : 0) * ld + c * 8, valid);
  }
}

// Grid: query blocks x heads, heaviest query block first. Shared memory: two stages of
// {K tile, V tile}; the query tile borrows the second stage before the loop starts.
template <int D, int Warps>
__global__ void __launch_bounds__(Warps * 32)
    attention_kernel(const bf16* q, const bf16* k, const bf16* v, long ld, long tokens, int heads, int group,
                     float scale_log2, bf16* out, long ld_out) {
  constexpr int kBlockRows = 16 * Warps, kThreads = Warps * 32, kDepthSteps = D / 16, kColumnTiles = D / 8;
  constexpr int kStage = 2 * kKeyTile * D;  // elements of one {K, V} stage
  static_assert(kBlockRows <= 2 * kKeyTile, "the query tile must fit in one stage");
  extern __shared__ __align__(128) unsigned char shared_raw[];
  bf16* shared = reinterpret_cast<bf16*>(shared_raw);

  // Causal work grows with the query block: launch the last blocks first, every head of one
  // before the next (a grid of query blocks x heads ran one head's blocks, light ones included,
  // before the next head's heavy ones: 19-38% slower at 4096 tokens on an H100), so that the
  // short ones fill the tail of the grid.
  const long query_blocks = (tokens + kBlockRows - 1) / kBlockRows;
  const long q0 = (query_blocks - 1 - blockIdx.x / heads) * kBlockRows;
  const int head = static_cast<int>(blockIdx.x % heads), kv_head = head / group;
  const bf16* q_head = q + static_cast<long>(head) * D;
  const bf16* k_head = k + static_cast<long>(kv_head) * D;
  const bf16* v_head = v + static_cast<long>(kv_head) * D;
  const long last_row = min(q0 + kBlockRows, tokens) - 1;
  const int key_tiles = static_cast<int>(last_row / kKeyTile) + 1;

  bf16* q_tile = shared + kStage;
  load_tile<D, kBlockRows, kThreads>(q_tile, q_head, ld, q0, tokens);
  load_tile<D, kKeyTile, kThreads>(shared, k_head, ld, 0, tokens);
  load_tile<D, kKeyTile, kThreads>(shared + kKeyTile * D, v_head, ld, 0, tokens);
  commit_async();
  wait_async<0>();
  __syncthreads();

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row0 = warp * 16;
  // This warp's 16 query rows as mma A fragments, for the whole depth D.
  std::uint32_t q_fragments[kDepthSteps][4];
#pragma unroll
  for (int s = 0; s < kDepthSteps; ++s)
    load_matrices(q_fragments[s], q_tile + swizzled<D>(warp_row0 + (lane & 15), s * 16 + (lane >> 4) * 8));
  __syncthreads();  // the query tile's space is stage 1's from here on

  float acc[kColumnTiles][4];
#pragma unroll
  for (int c = 0; c < kColumnTiles; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.0f;
  // Per lane, rows g and g + 8 of the warp: running maximum (scaled by log2 e / sqrt(D)) and
  // this lane's part of the running sum.
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const long warp_first = q0 + warp_row0, warp_last = warp_first + 15;

  for (int j = 0; j < key_tiles; ++j) {
    const bf16* k_tile = shared + (j & 1) * kStage;
    const bf16* v_tile = k_tile + kKeyTile * D;
    if (j + 1 < key_tiles) {
      bf16* next = shared + ((j + 1) & 1) * kStage;
      load_tile<D, kKeyTile, kThreads>(next, k_head, ld, static_cast<long>(j + 1) * kKeyTile, tokens);
      load_tile<D, kKeyTile, kThreads>(next + kKeyTile * D, v_head, ld, static_cast<long>(j + 1) * kKeyTile, tokens);
      commit_async();
      wait_async<1>();
    } else {
      wait_async<0>();
    }
    __syncthreads();

    const long key0 = static_cast<long>(j) * kKeyTile;
    if (key0 <= warp_last) {  // some key of this tile is visible to some row of this warp
      float s[kKeyTile / 8][4];
#pragma unroll
      for (int n = 0; n < kKeyTile / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      // Scores = Q K^T: K's rows (keys) are the B operand's columns, so K loads untransposed.
#pragma unroll
      for (int pair = 0; pair < kKeyTile / 16; ++pair)
#pragma unroll
        for (int d = 0; d < kDepthSteps; ++d) {
          std::uint32_t b[4];
          load_matrices(b, k_tile + swizzled<D>(pair * 16 + (lane >> 4) * 8 + (lane & 7), d * 16 + ((lane >> 3) & 1) * 8));
          mma(s[2 * pair], q_fragments[d], b[0], b[1]);
          mma(s[2 * pair + 1], q_fragments[d], b[2], b[3]);
        }

      const auto at = [&](int n, int e) -> float& { return s[n][e]; };
      if (key0 + kKeyTile - 1 > warp_first)  // a diagonal tile (the warp's rows are within one)
        mask_keys_past_rows<kKeyTile / 8>(at, static_cast<int>(key0 - warp_first), g, t);
      float tile_max[2];
      scaled_tile_maxima<kKeyTile / 8>(at, scale_log2, tile_max);
      float base[2], correction[2];
      fold_tile_maxima(tile_max, row_max, base, correction);
      // The probabilities as bf16 A fragments of P x V (two adjacent score fragments, 16 keys,
      // make one), packed as soon as they are computed so that the fp32 scores die early.
      float tile_sum[2] = {0.0f, 0.0f};
      std::uint32_t p[kKeyTile / 16][4];
#pragma unroll
      for (int n = 0; n < kKeyTile / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = probability(s[n][e], scale_log2, base[e / 2]);
          tile_sum[e / 2] += s[n][e];
        }
        p[n / 2][(n % 2) * 2] = pack_bf16(s[n][0], s[n][1]);
        p[n / 2][(n % 2) * 2 + 1] = pack_bf16(s[n][2], s[n][3]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) row_sum[i] = row_sum[i] * correction[i] + tile_sum[i];
#pragma unroll
      for (int c = 0; c < kColumnTiles; ++c) {
        acc[c][0] *= correction[0];
        acc[c][1] *= correction[0];
        acc[c][2] *= correction[1];
        acc[c][3] *= correction[1];
      }
      // Output += P V. V's rows (keys) are the B operand's depth, so V loads transposed.
#pragma unroll
      for (int kk = 0; kk < kKeyTile / 16; ++kk) {
#pragma unroll
        for (int c = 0; c < kColumnTiles / 2; ++c) {
          std::uint32_t b[4];
          load_matrices_transposed(
              b, v_tile + swizzled<D>(kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), c * 16 + (lane >> 4) * 8));
          mma(acc[2 * c], p[kk], b[0], b[1]);
          mma(acc[2 * c + 1], p[kk], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }

  float inverse[2];
  row_sum_inverses(row_sum, inverse);
  bf16* out_head = out + static_cast<long>(head) * D;
#pragma unroll
  for (int c = 0; c < kColumnTiles; ++c) {
    const int col = c * 8 + 2 * t;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const long row = warp_first + g + i * 8;
      if (row < tokens)
        *reinterpret_cast<std::uint32_t*>(out_head + row * ld_out + col) =
            pack_bf16(acc[c][2 * i] * inverse[i], acc[c][2 * i + 1] * inverse[i]);
    }
  }
}

// The float32 reference: one thread per (query, head), two passes over the visible keys.
template <int D>
__global__ void attention_reference_kernel(const float* q, const float* k, const float* v, long ld, long tokens,
                                           int q_heads, int group, float scale, float* out, long ld_out) {
  const long index = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (index >= tokens * q_heads) return;
  const long row = index / q_heads;
  const int head = static_cast<int>(index % q_heads), kv_head = head / group;
  const float* qr = q + row * ld + static_cast<long>(head) * D;
  float maximum = -INFINITY;
  for (long key = 0; key <= row; ++key) {
    const float* kr = k + key * ld + static_cast<long>(kv_head) * D;
    float dot = 0;
    for (int d = 0; d < D; ++d) dot += qr[d] * kr[d];
    maximum = fmaxf(maximum, dot * scale);
  }
  float acc[D] = {};
  float sum = 0;
  for (long key = 0; key <= row; ++key) {
    const float* kr = k + key * ld + static_cast<long>(kv_head) * D;
    const float* vr = v + key * ld + static_cast<long>(kv_head) * D;
    float dot = 0;
    for (int d = 0; d < D; ++d) dot += qr[d] * kr[d];
    const float p = expf(dot * scale - maximum);
    sum += p;
    for (int d = 0; d < D; ++d) acc[d] += p * vr[d];
  }
  float* o = out + row * ld_out + static_cast<long>(head) * D;
  for (int d = 0; d < D; ++d) o[d] = acc[d] / sum;
}

template <int D>
constexpr int shared_bytes() {
  return 2 * 2 * kKeyTile * D * static_cast<int>(sizeof(bf16));
}

// Kernels above 48 KiB of dynamic shared memory must be allowed it once per device.
template <int D, int Warps>
void allow_shared_memory() {
  static std::atomic<std::uint64_t> devices_done{0};
  int device = 0;
  CARAVAN_HIP_CHECK(hipGetDevice(&device));
  const std::uint64_t bit = device < 64 ? (std::uint64_t{1} << device) : 0;
  if (bit != 0 && (devices_done.load(std::memory_order_acquire) & bit) != 0) return;
  CARAVAN_HIP_CHECK(hipFuncSetAttribute(reinterpret_cast<const void*>(&attention_kernel<D, Warps>),
                                        hipFuncAttributeMaxDynamicSharedMemorySize, shared_bytes<D>()));
  devices_done.fetch_or(bit, std::memory_order_acq_rel);
}

template <int D, int Warps>
void launch(const AttentionArguments& a, hipStream_t stream) {
  allow_shared_memory<D, Warps>();
  constexpr int rows = 16 * Warps;
  const dim3 grid(static_cast<unsigned>((a.tokens + rows - 1) / rows * a.q_heads));
  const float scale_log2 = a.scale * 1.4426950408889634f;
  launch_checked(attention_kernel<D, Warps>, dim3(grid), dim3(Warps * 32), shared_bytes<D>(), stream, a.q, a.k, a.v,
                 a.ld, a.tokens, static_cast<int>(a.q_heads), static_cast<int>(a.q_heads / a.kv_heads), scale_log2,
                 a.out, a.ld_out);
}

template <int Warps>
void launch_depth(const AttentionArguments& a, hipStream_t stream) {
  switch (a.head_dim) {
    case 32: return launch<32, Warps>(a, stream);
    case 64: return launch<64, Warps>(a, stream);
    default: return launch<128, Warps>(a, stream);
  }
}

bool hopper_runs(long head_dim) {
#ifdef CARAVAN_HAVE_SM90_KERNELS
  return sm90::attention_supports(head_dim) && sm90::attention_available();
#else
  (void)head_dim;
  return false;
#endif
}

// TMA coordinates are 32-bit: longer sequences (absurd for a quadratic kernel) stay portable.
constexpr long kHopperMaxTokens = std::numeric_limits<std::int32_t>::max();

bool use_hopper(AttentionKernel kernel, long head_dim, int block_rows) {
  return kernel != AttentionKernel::portable && (block_rows == 0 || block_rows == 128) && hopper_runs(head_dim);
}

void require_arguments(const AttentionArguments& a, int block_rows) {
  const auto fail = [](const std::string& what) { throw Error(Errc::invalid_argument, "fused_causal_attention: " + what); };
  if (!fused_attention_supports(a.head_dim))
    fail("head_dim = " + std::to_string(a.head_dim) + " is not one of 32, 64, 128");
  if (a.tokens < 0 || a.q_heads <= 0 || a.kv_heads <= 0 || a.q_heads % a.kv_heads != 0)
    fail("tokens must be >= 0, q_heads and kv_heads positive and kv_heads must divide q_heads (got tokens = " +
         std::to_string(a.tokens) + ", q_heads = " + std::to_string(a.q_heads) + ", kv_heads = " +
         std::to_string(a.kv_heads) + ")");
  if (a.ld % 8 != 0 || a.ld_out % 2 != 0)
    fail("ld must be a multiple of 8 (16-byte rows) and ld_out even (got ld = " + std::to_string(a.ld) + ", ld_out = " +
         std::to_string(a.ld_out) + ")");
  const auto aligned = [](const void* p, std::uintptr_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; };
  if (!aligned(a.q, 16) || !aligned(a.k, 16) || !aligned(a.v, 16) || !aligned(a.out, 4))
    fail("q, k and v must be 16-byte aligned and out 4-byte aligned");
  if (block_rows != 0 && block_rows != 64 && block_rows != 128)
    fail("block_rows = " + std::to_string(block_rows) + " is not 0 (automatic), 64 or 128");
  // The kernels take each tile's maxima on the raw scores and scale them after
  // (online_softmax.cuh), which holds for a positive scale only.
  if (!(a.scale > 0.0f) || !std::isfinite(a.scale))
    fail("scale = " + std::to_string(a.scale) + " must be finite and positive");
}

}  // namespace

AttentionArguments packed_qkv_attention(const bf16* qkv, long ld, long tokens, long q_heads, long kv_heads, long head_dim,
                                        bf16* out, long ld_out) {
  return AttentionArguments{.q = qkv,
                            .k = qkv + q_heads * head_dim,
                            .v = qkv + (q_heads + kv_heads) * head_dim,
                            .ld = ld,
                            .tokens = tokens,
                            .q_heads = q_heads,
                            .kv_heads = kv_heads,
                            .head_dim = head_dim,
                            .scale = 1.0f / std::sqrt(static_cast<float>(head_dim)),
                            .out = out,
                            .ld_out = ld_out};
}

bool fused_attention_supports(long head_dim) { return head_dim == 32 || head_dim == 64 || head_dim == 128; }

void preload_attention() {
  (void)hopper_runs(128);  // loads the Hopper kernels and grants their shared memory, where they run
  allow_shared_memory<32, 4>();
  allow_shared_memory<64, 4>();
  allow_shared_memory<128, 4>();
  allow_shared_memory<32, 8>();
  allow_shared_memory<64, 8>();
  allow_shared_memory<128, 8>();
  hipFuncAttributes attributes;
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&attention_reference_kernel<32>)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&attention_reference_kernel<64>)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&attention_reference_kernel<128>)));
}

bool attention_kernel_runs(AttentionKernel kernel, long head_dim) {
  if (!fused_attention_supports(head_dim)) return false;
  return kernel != AttentionKernel::hopper || hopper_runs(head_dim);
}

std::string attention_kernel_name(AttentionKernel kernel, long head_dim, int block_rows) {
  return use_hopper(kernel, head_dim, block_rows) ? "wgmma" : "mma.sync";
}

void fused_causal_attention(const AttentionArguments& a, hipStream_t stream, int block_rows, AttentionKernel kernel) {
  require_arguments(a, block_rows);
  if (kernel == AttentionKernel::hopper) {
    if (block_rows != 0 && block_rows != 128)
      throw Error(Errc::invalid_argument,
                  "fused_causal_attention: kernel = hopper takes 128 query rows per block (got "
                  "block_rows = " +
                      std::to_string(block_rows) + ")");
    if (!hopper_runs(a.head_dim))
      throw Error(Errc::invalid_argument,
                  "fused_causal_attention: kernel = hopper needs a build with the sm_90a kernels, a device of compute "
                  "capability 9.0 and head_dim 64 or 128 (head_dim = " +
                      std::to_string(a.head_dim) + ")");
    if (a.tokens > kHopperMaxTokens)
      throw Error(Errc::invalid_argument,
                  "fused_causal_attention: kernel = hopper takes at most 2^31 - 1 tokens (TMA "
                  "coordinates are 32-bit; got tokens = " +
                      std::to_string(a.tokens) + ")");
  }
  if (a.tokens == 0) return;
#ifdef CARAVAN_HAVE_SM90_KERNELS
  if (use_hopper(kernel, a.head_dim, block_rows) && a.tokens <= kHopperMaxTokens)
    return sm90::fused_causal_attention(a, stream);
#endif
  if (block_rows == 0) block_rows = kAttentionBlockRows;
  if (block_rows == 64)
    launch_depth<4>(a, stream);
  else
    launch_depth<8>(a, stream);
}

void attention_reference(const float* q, const float* k, const float* v, const AttentionArguments& a, float* out,
                         hipStream_t stream) {
  AttentionArguments shape = a;  // only a's shape and strides apply to the float arrays
  shape.q = shape.k = shape.v = nullptr;
  shape.out = nullptr;
  require_arguments(shape, 0);
  if (a.tokens == 0) return;
  const long threads = a.tokens * a.q_heads;
  const unsigned blocks = static_cast<unsigned>((threads + 127) / 128);
  const int group = static_cast<int>(a.q_heads / a.kv_heads);
  const int heads = static_cast<int>(a.q_heads);
  switch (a.head_dim) {
    case 32:
      launch_checked(attention_reference_kernel<32>, dim3(blocks), dim3(128), 0, stream, q, k, v, a.ld, a.tokens, heads,
                     group, a.scale, out, a.ld_out);
      break;
    case 64:
      launch_checked(attention_reference_kernel<64>, dim3(blocks), dim3(128), 0, stream, q, k, v, a.ld, a.tokens, heads,
                     group, a.scale, out, a.ld_out);
      break;
    default:
      launch_checked(attention_reference_kernel<128>, dim3(blocks), dim3(128), 0, stream, q, k, v, a.ld, a.tokens,
                     heads, group, a.scale, out, a.ld_out);
  }
}

}  // namespace caravan::gpu
