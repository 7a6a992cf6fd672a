// Element-wise kernels behind kernels.h: random fills, the reference comparison, the fp32
// reduction of ReduceScatter, and the low-latency AllGather.
#include "kernels/gpu/bf16_vector.cuh"
#include "kernels/gpu/early_launch.cuh"
#include "kernels/gpu/kernels.h"
#include "kernels/gpu/device.cuh"
#include "kernels/gpu/symmetric.cuh"

#include <caravan/settings.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace caravan::gpu {
namespace {

__device__ inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ inline float random_value(std::uint64_t seed, long row, long col, float scale) {
  const std::uint64_t h = splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(row) * 0x100000001B3ull +
                                                       static_cast<std::uint64_t>(col)));
  const float unit = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
  return bf16_to_float(float_to_bf16((2.0f * unit - 1.0f) * scale));
}

template <class T>
__global__ void fill_random_kernel(T* out, long rows, long cols, long ld, std::uint64_t seed, long row0, long col0,
                                   float scale) {
  const long total = rows * cols;
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const long r = i / cols, c = i % cols;
    const float v = random_value(seed, row0 + r, col0 + c, scale);
    if constexpr (sizeof(T) == 2)
      out[r * ld + c] = float_to_bf16(v);
    else out[r * ld + c] = v;
  }
}

__global__ void compare_kernel(const bf16* out, long rows, long cols, long ld, const float* ref, long ref_ld,
                               ErrorSums* sums) {
  double diff2 = 0, ref2 = 0;
  unsigned long long nonfinite = 0;
  const long total = rows * cols;
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const long r = i / cols, c = i % cols;
    const float o = bf16_to_float(out[r * ld + c]);
    const float f = ref[r * ref_ld + c];
    if (!isfinite(o)) {
      ++nonfinite;
      continue;
    }
    diff2 += static_cast<double>(o - f) * (o - f);
    ref2 += static_cast<double>(f) * f;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    diff2 += dev::shfl_down32(diff2, offset);
    ref2 += dev::shfl_down32(ref2, offset);
    nonfinite += dev::shfl_down32(nonfinite, offset);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&sums->diff2, diff2);
    atomicAdd(&sums->ref2, ref2);
    atomicAdd(&sums->nonfinite, nonfinite);
  }
}

__global__ void reduce_sum_kernel(bf16* out, ReduceInputs inputs, std::size_t vectors) {
  for (std::size_t v = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; v < vectors;
       v += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float acc[8] = {};
    for (int j = 0; j < inputs.count; ++j) dev::accumulate_bf16x8(acc, reinterpret_cast<const uint4*>(inputs.in[j])[v]);
    reinterpret_cast<uint4*>(out)[v] = dev::round_bf16x8(acc);
  }
}

__global__ void reduce_sum_tail_kernel(bf16* out, ReduceInputs inputs, std::size_t begin, std::size_t end) {
  for (std::size_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < inputs.count; ++j) acc += bf16_to_float(inputs.in[j][i]);
    out[i] = float_to_bf16(acc);
  }
}

// One 16-byte line: {data0, flag, data1, flag}. Stored and loaded whole with volatile vector
// accesses; the interconnect delivers each aligned 8-byte half atomically, so a line whose two
// flags both equal the epoch holds that epoch's two data words.
// (AMD: two relaxed system-scope 8-byte atomics, one per half, which is all the rule above
// relies on; they bypass the non-coherent L1 without waiting for each other as volatile would.
// The line buffers are fine-grained memory there: malloc_peer_coherent.)
__device__ inline void store_line(uint4* dst, uint4 line) {
#if defined(CARAVAN_GPU_AMD)
  auto* halves = reinterpret_cast<std::uint64_t*>(dst);
  __hip_atomic_store(halves, (static_cast<std::uint64_t>(line.y) << 32) | line.x, __ATOMIC_RELAXED,
                     __HIP_MEMORY_SCOPE_SYSTEM);
  __hip_atomic_store(halves + 1, (static_cast<std::uint64_t>(line.w) << 32) | line.z, __ATOMIC_RELAXED,
                     __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(line.x), "r"(line.y), "r"(line.z),
               "r"(line.w)
               : "memory");
#endif
}
__device__ inline uint4 load_line(const uint4* src) {
  uint4 v;
#if defined(CARAVAN_GPU_AMD)
  v = dev::load_l2(src);
#else
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(src)
               : "memory");
#endif
  return v;
}

// Progress: block i of one rank waits only for block i of each peer, so with blocks dispatched
// in index order (what the hardware does, not a documented promise) the rank with the fewest
// resident blocks always completes them; the grid is capped at kLlMaxBytes to stay small. At
// that cap (1024 blocks) a whole grid is resident at once on 132 SMs (H100 SXM, H200): the
// AllGather takes 56 registers a thread (9 blocks an SM), the ReduceScatter is bounded to 64
// (8 blocks; it took 72 unbounded). A grid-stride loop over a smaller grid, which would lift
// this, made an 8 KiB AllGather 0.4 us slower from graphs (twelfth session), as did bounding
// the AllGather too (0.1-0.2 us).
// Calls of one rank must run in order (LowLatencyAllGather::run keeps them so): they share
// the device-side epochs.
// The epoch of a low-latency call lives on the device, so that a captured graph replays with
// fresh epochs. Each block has its own word (LlState::block_epoch): thread 0 advances it and
// hands the value to the block. Every call on one state has the same grid, so the words stay
// equal, and block b of the next call reads its word only after this grid has completed
// (stream order, or wait_for_prior_grid when launched early), so no fence or atomic is needed.
// One shared word advanced by the last block to finish cost every block a GPU-scope fence,
// which waits for its stores to the peers, and an atomic: about 0.5 us of a 4.4 us call on
// 4 x H200 (twelfth session).
__device__ inline std::uint32_t ll_epoch_begin(LlState* state) {
  __shared__ std::uint32_t shared_epoch;
  if (threadIdx.x == 0) {
    const std::uint32_t epoch = state->block_epoch[blockIdx.x] + 1;
    state->block_epoch[blockIdx.x] = epoch;
    shared_epoch = epoch;
  }
  __syncthreads();
  // The next call, if launched early, is scheduled only once every block of this grid has got
  // here (or exited), so it never takes the place of a block of this grid not yet resident;
  // its blocks then wait in wait_for_prior_grid until this grid is done.
  allow_dependent_launch();
  return shared_epoch;
}

// Waits until every peer's line (rank q != me, at lines + q * pairs + i) carries `epoch` and
// leaves them in got[q]. Each round loads every line still missing before looking at any, so
// the loads are in flight together; waiting for the peers one after another cost a load's
// latency per peer.
__device__ inline void wait_lines(const uint4* lines, std::size_t pairs, std::size_t i, int world, int me,
                                  std::uint32_t epoch, uint4 (&got)[kMaxHeapRanks]) {
  unsigned pending = ((1u << world) - 1u) & ~(1u << me);
  while (pending != 0) {
#pragma unroll
    for (int q = 0; q < kMaxHeapRanks; ++q)
      if (pending & (1u << q)) got[q] = load_line(lines + static_cast<std::size_t>(q) * pairs + i);
#pragma unroll
    for (int q = 0; q < kMaxHeapRanks; ++q)
      if ((pending & (1u << q)) != 0 && got[q].y == epoch && got[q].w == epoch) pending &= ~(1u << q);
  }
}

// The kernels load their inputs before the epoch, so the two loads' latencies overlap.
__global__ void ll_allgather_kernel(const CARAVAN_GRID_CONSTANT HeapView heap, const uint2* in, std::size_t pairs,
                                    uint4* lines, uint2* out, LlState* state) {
  wait_for_prior_grid();
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const uint2 mine = i < pairs ? in[i] : uint2{};
  const std::uint32_t epoch = ll_epoch_begin(state);
  const int world = heap.world, me = heap.rank;
  uint4* half = lines + static_cast<std::size_t>(epoch & 1u) * world * pairs;
  if (i < pairs) {
    const uint4 line{mine.x, epoch, mine.y, epoch};
    for (int step = 1; step < world; ++step) {
      const int peer = (me + step) % world;
      store_line(dev::translate(heap, half + static_cast<std::size_t>(me) * pairs + i, peer), line);
    }
    out[static_cast<std::size_t>(me) * pairs + i] = mine;
    uint4 got[kMaxHeapRanks];
    wait_lines(half, pairs, i, world, me, epoch, got);
#pragma unroll
    for (int q = 0; q < kMaxHeapRanks; ++q)
      if (q < world && q != me) out[static_cast<std::size_t>(q) * pairs + i] = uint2{got[q].x, got[q].z};
  }
}

#if !defined(CARAVAN_GPU_AMD)
// The 128-byte lines' counterpart of wait_lines: every thread of the warp calls it (the flag
// travels by shuffle from the line's last thread); a thread of a line past the end (`active`
// false) only stands by. Leaves each peer's 16 bytes of this thread's slot in got[q].
__device__ inline void wait_lines128(const uint4* half, std::size_t line_count, std::size_t slot, bool active,
                                     int world, int me, std::uint32_t epoch, uint4 (&got)[kMaxHeapRanks]) {
  const unsigned flag_source = (threadIdx.x % 32u) | (kLl128Threads - 1);  // lane 7 of this line, within the warp
  unsigned pending = active ? ((1u << world) - 1u) & ~(1u << me) : 0u;
  while (__any_sync(0xffffffffu, pending != 0)) {
#pragma unroll
    for (int q = 0; q < kMaxHeapRanks; ++q)
      if (pending & (1u << q)) got[q] = load_line(half + static_cast<std::size_t>(q) * line_count * kLl128Threads + slot);
#pragma unroll
    for (int q = 0; q < kMaxHeapRanks; ++q) {
      if (q >= world) break;
      const std::uint32_t z = __shfl_sync(0xffffffffu, got[q].z, static_cast<int>(flag_source));
      const std::uint32_t w = __shfl_sync(0xffffffffu, got[q].w, static_cast<int>(flag_source));
      if ((pending & (1u << q)) != 0 && z == epoch && w == epoch) pending &= ~(1u << q);
    }
  }
}
#endif

#if !defined(CARAVAN_GPU_AMD)
// The AllGather in 128-byte lines (LlFormat::lines128): the 8 threads of a line (one eighth of a
// warp) store 16 bytes each with one warp-wide instruction, 15 data words and, in the last
// thread's second half, the flag (the epoch twice). A receiver loads the line the same way and
// takes it once the flag, read by the same instruction, is the epoch. That relies on NVLink
// delivering a warp's aligned 128-byte store to a line as one write, which NCCL's LL128 protocol
// relies on too on NVLink GPUs; the 16-byte lines need only 8-byte halves to arrive whole, but
// put twice the data on the links. Every thread of a warp runs the loop (the flag travels by
// shuffle), lines past the end standing by. Data word w of rank q is word w % 15 of line w / 15.
__global__ void ll128_allgather_kernel(const CARAVAN_GRID_CONSTANT HeapView heap, const std::uint64_t* in,
                                       std::size_t pairs, std::size_t line_count, uint4* lines, std::uint64_t* out,
                                       LlState* state) {
  wait_for_prior_grid();
  const std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const std::size_t line = t / kLl128Threads;
  const unsigned lane = threadIdx.x % kLl128Threads;
  const bool flag_lane = lane == kLl128Threads - 1;
  const bool active = line < line_count;
  const std::size_t first = line * kLl128Words + 2 * lane;  // this thread's first data word
  const bool has_first = active && first < pairs, has_second = active && !flag_lane && first + 1 < pairs;
  const std::uint64_t a = has_first ? in[first] : 0, b = has_second ? in[first + 1] : 0;
  const std::uint32_t epoch = ll_epoch_begin(state);
  const int world = heap.world, me = heap.rank;
  uint4* half = lines + static_cast<std::size_t>(epoch & 1u) * world * line_count * kLl128Threads;
  const std::size_t slot = line * kLl128Threads + lane;
  if (active) {
    const uint4 v{static_cast<std::uint32_t>(a), static_cast<std::uint32_t>(a >> 32),
                  flag_lane ? epoch : static_cast<std::uint32_t>(b), flag_lane ? epoch : static_cast<std::uint32_t>(b >> 32)};
    for (int step = 1; step < world; ++step) {
      const int peer = (me + step) % world;
      store_line(dev::translate(heap, half + static_cast<std::size_t>(me) * line_count * kLl128Threads + slot, peer), v);
    }
    if (has_first) out[static_cast<std::size_t>(me) * pairs + first] = a;
    if (has_second) out[static_cast<std::size_t>(me) * pairs + first + 1] = b;
  }
  uint4 got[kMaxHeapRanks] = {};
  wait_lines128(half, line_count, slot, active, world, me, epoch, got);
  if (active) {
#pragma unroll
    for (int q = 0; q < kMaxHeapRanks; ++q) {
      if (q >= world || q == me) continue;
      if (has_first) out[static_cast<std::size_t>(q) * pairs + first] = (static_cast<std::uint64_t>(got[q].y) << 32) | got[q].x;
      if (has_second)
        out[static_cast<std::size_t>(q) * pairs + first + 1] = (static_cast<std::uint64_t>(got[q].w) << 32) | got[q].z;
    }
  }
}
#endif

__device__ inline void add_pair(float (&acc)[4], std::uint32_t x, std::uint32_t y) {
  const float2 a = bf16x2_to_float2(*reinterpret_cast<const bf16x2*>(&x));
  const float2 b = bf16x2_to_float2(*reinterpret_cast<const bf16x2*>(&y));
  acc[0] += a.x, acc[1] += a.y, acc[2] += b.x, acc[3] += b.y;
}

__device__ inline std::uint64_t pack_pair(const float (&acc)[4]) {
  const bf16x2 lo = floats_to_bf16x2(acc[0], acc[1]), hi = floats_to_bf16x2(acc[2], acc[3]);
  return (static_cast<std::uint64_t>(*reinterpret_cast<const std::uint32_t*>(&hi)) << 32) |
         *reinterpret_cast<const std::uint32_t*>(&lo);
}

#if !defined(CARAVAN_GPU_AMD)
// The low-latency ReduceScatter in 128-byte lines (as ll128_allgather_kernel): thread j of a line
// sends words 2j and 2j + 1 of the line (one word and the flag for the last thread) of every
// peer's part to that peer, then sums its words of its own part and of every peer's line for it,
// in rank order, in fp32.
__global__ void CARAVAN_LAUNCH_BOUNDS(kLlThreads, 8)
    ll128_reduce_scatter_kernel(const CARAVAN_GRID_CONSTANT HeapView heap, const std::uint64_t* partial,
                                std::size_t pairs, std::size_t line_count, uint4* lines, std::uint64_t* out,
                                LlState* state) {
  wait_for_prior_grid();
  const int world = heap.world, me = heap.rank;
  const std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const std::size_t line = t / kLl128Threads;
  const unsigned lane = threadIdx.x % kLl128Threads;
  const bool flag_lane = lane == kLl128Threads - 1;
  const bool active = line < line_count;
  const std::size_t first = line * kLl128Words + 2 * lane;
  const bool has_first = active && first < pairs, has_second = active && !flag_lane && first + 1 < pairs;
  std::uint64_t a[kMaxHeapRanks], b[kMaxHeapRanks];
#pragma unroll
  for (int q = 0; q < kMaxHeapRanks; ++q) {
    a[q] = q < world && has_first ? partial[static_cast<std::size_t>(q) * pairs + first] : 0;
    b[q] = q < world && has_second ? partial[static_cast<std::size_t>(q) * pairs + first + 1] : 0;
  }
  const std::uint32_t epoch = ll_epoch_begin(state);
  uint4* half = lines + static_cast<std::size_t>(epoch & 1u) * world * line_count * kLl128Threads;
  const std::size_t slot = line * kLl128Threads + lane;
  if (active) {
#pragma unroll
    for (int q = 0; q < kMaxHeapRanks; ++q)
      if (q < world && q != me)
        store_line(dev::translate(heap, half + static_cast<std::size_t>(me) * line_count * kLl128Threads + slot, q),
                   uint4{static_cast<std::uint32_t>(a[q]), static_cast<std::uint32_t>(a[q] >> 32),
                         flag_lane ? epoch : static_cast<std::uint32_t>(b[q]),
                         flag_lane ? epoch : static_cast<std::uint32_t>(b[q] >> 32)});
  }
  uint4 got[kMaxHeapRanks] = {};
  wait_lines128(half, line_count, slot, active, world, me, epoch, got);
  if (!active) return;
  float acc_a[4] = {}, acc_b[4] = {};
#pragma unroll
  for (int q = 0; q < kMaxHeapRanks; ++q) {
    if (q >= world) break;
    if (q == me) {
      add_pair(acc_a, static_cast<std::uint32_t>(a[q]), static_cast<std::uint32_t>(a[q] >> 32));
      add_pair(acc_b, static_cast<std::uint32_t>(b[q]), static_cast<std::uint32_t>(b[q] >> 32));
    } else {
      add_pair(acc_a, got[q].x, got[q].y);
      add_pair(acc_b, got[q].z, got[q].w);
    }
  }
  if (has_first) out[first] = pack_pair(acc_a);
  if (has_second) out[first + 1] = pack_pair(acc_b);
}
#endif

// The low-latency ReduceScatter: thread i sends pair i of every peer's rows to that peer as a
// line, then sums pair i of its own rows and of every peer's line for it, in rank order (the
// order of reduce_sum), in fp32. Progress as in ll_allgather_kernel. (Ranks index the register
// arrays through unrolled loops only, so they stay in registers.)
__global__ void CARAVAN_LAUNCH_BOUNDS(kLlThreads, 8)
    ll_reduce_scatter_kernel(const CARAVAN_GRID_CONSTANT HeapView heap, const uint2* partial, std::size_t pairs,
                             uint4* lines, uint2* out, LlState* state) {
  wait_for_prior_grid();
  const int world = heap.world, me = heap.rank;
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  uint2 part[kMaxHeapRanks];
#pragma unroll
  for (int q = 0; q < kMaxHeapRanks; ++q)
    if (q < world && i < pairs) part[q] = partial[static_cast<std::size_t>(q) * pairs + i];
  const std::uint32_t epoch = ll_epoch_begin(state);
  uint4* half = lines + static_cast<std::size_t>(epoch & 1u) * world * pairs;
  if (i < pairs) {
#pragma unroll
    for (int q = 0; q < kMaxHeapRanks; ++q)
      if (q < world && q != me)
        store_line(dev::translate(heap, half + static_cast<std::size_t>(me) * pairs + i, q),
                   uint4{part[q].x, epoch, part[q].y, epoch});
    uint4 got[kMaxHeapRanks];
    wait_lines(half, pairs, i, world, me, epoch, got);
    float acc[4] = {};
#pragma unroll
    for (int q = 0; q < kMaxHeapRanks; ++q) {
      if (q >= world) break;
      if (q == me) add_pair(acc, part[q].x, part[q].y);
      else add_pair(acc, got[q].x, got[q].z);
    }
    const bf16x2 lo = floats_to_bf16x2(acc[0], acc[1]), hi = floats_to_bf16x2(acc[2], acc[3]);
    out[i] = uint2{*reinterpret_cast<const std::uint32_t*>(&lo), *reinterpret_cast<const std::uint32_t*>(&hi)};
  }
}

int blocks_for(long work, int threads, int cap = 4096) {
  const long blocks = (work + threads - 1) / threads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

}  // namespace

void fill_random(bf16* out, long rows, long cols, long ld, std::uint64_t seed, long row0, long col0, float scale,
                 hipStream_t stream) {
  launch_checked(fill_random_kernel<bf16>, dim3(blocks_for(rows * cols, 256)), dim3(256), 0, stream, out, rows, cols,
                 ld, seed, row0, col0, scale);
}
void fill_random(float* out, long rows, long cols, long ld, std::uint64_t seed, long row0, long col0, float scale,
                 hipStream_t stream) {
  launch_checked(fill_random_kernel<float>, dim3(blocks_for(rows * cols, 256)), dim3(256), 0, stream, out, rows, cols,
                 ld, seed, row0, col0, scale);
}

void compare(const bf16* out, long rows, long cols, long ld, const float* ref, long ref_ld, ErrorSums* sums,
             hipStream_t stream) {
  CARAVAN_HIP_CHECK(hipMemsetAsync(sums, 0, sizeof(ErrorSums), stream));
  launch_checked(compare_kernel, dim3(blocks_for(rows * cols, 256, 1024)), dim3(256), 0, stream, out, rows, cols, ld,
                 ref, ref_ld, sums);
}

void reduce_sum(bf16* out, const ReduceInputs& inputs, std::size_t elements, hipStream_t stream) {
  const std::size_t vectors = elements / 8;
  if (vectors > 0) {
    launch_checked(reduce_sum_kernel, dim3(blocks_for(static_cast<long>(vectors), 512, 132 * 8)), dim3(512), 0, stream,
                   out, inputs, vectors);
  }
  if (vectors * 8 < elements) {
    launch_checked(reduce_sum_tail_kernel, dim3(1), dim3(32), 0, stream, out, inputs, vectors * 8, elements);
  }
}

void preload_kernels() {
  // Loading a module waits for the device to go idle; spinning kernels must never be the first
  // launch of their module while a peer spins (see warm_up in overlap.cpp).
  hipFuncAttributes attributes{};
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&ll_allgather_kernel)));
#if !defined(CARAVAN_GPU_AMD)
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&ll128_allgather_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&ll128_reduce_scatter_kernel)));
#endif
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&ll_reduce_scatter_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&reduce_sum_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&reduce_sum_tail_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&compare_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&fill_random_kernel<bf16>)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&fill_random_kernel<float>)));
}

namespace {
// One thread per pair, kLlThreads a block: at most kLlMaxBlocks blocks (LlState has a word each).
unsigned ll_blocks(std::size_t pairs) { return static_cast<unsigned>((pairs + kLlThreads - 1) / kLlThreads); }
// 128-byte lines: 15 words a line, 8 threads a line, kLlThreads a block (64 and 32 threads a
// block measured the same as 128, 27th session: the links bound it).
std::size_t ll128_lines(std::size_t pairs) { return (pairs + kLl128Words - 1) / kLl128Words; }
#if !defined(CARAVAN_GPU_AMD)
unsigned ll128_blocks(std::size_t line_count) {
  return static_cast<unsigned>((line_count * kLl128Threads + kLlThreads - 1) / kLlThreads);
}
#endif

// The checks both low-latency launchers make; `fallback` names what to use above the limit.
void require_ll(const char* op, const HeapView& heap, std::size_t bytes, const char* fallback) {
  if (bytes == 0 || bytes % 8 != 0 || bytes > kLlMaxBytes)
    throw Error(Errc::invalid_argument, std::string(op) + ": bytes per rank must be a positive multiple of 8 up to " +
                                            std::to_string(kLlMaxBytes) + " (twice the bytes travel as lines; use the " +
                                            fallback + " above that), got " + std::to_string(bytes));
  if (heap.world < 1 || heap.world > kMaxHeapRanks)
    throw Error(Errc::invalid_argument, std::string(op) + ": heap view has no valid world size");
}
}  // namespace

std::size_t ll_buffer_bytes(int world, std::size_t bytes) {
  const std::size_t pairs = bytes / 8, line_count = ll128_lines(pairs);
  return 2 * static_cast<std::size_t>(world) * std::max(pairs * 16, line_count * kLl128Threads * 16);
}

#if !defined(CARAVAN_GPU_AMD)
namespace {
// 128-byte lines need NVLink between the GPUs: over PCIe a line may land in pieces. The sign of
// NVLink taken here is what CUDA reports for it and not for PCIe peers: native atomics between
// every pair of the GPUs this process sees. With fewer than two in sight (each rank's process
// shown its own GPU only) nothing can be checked, and the lines stay 16 bytes.
bool every_gpu_pair_has_nvlink() {
  static const bool linked = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) return false;
    for (int i = 0; i < count; ++i)
      for (int j = 0; j < count; ++j) {
        int atomics = 0;
        if (i != j && (cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, i, j) != cudaSuccess ||
                       atomics == 0))
          return false;
      }
    return true;
  }();
  return linked;
}
}  // namespace
#endif

LlFormat ll_format(std::size_t bytes) {
#if defined(CARAVAN_GPU_AMD)
  (void)bytes;
  return LlFormat::pairs;  // 128-byte lines rely on NVLink delivering a warp's store whole
#else
  const std::uint64_t from = settings::get_bytes("CARAVAN_LL128_MIN_BYTES");
  return from > 0 && bytes >= from && every_gpu_pair_has_nvlink() ? LlFormat::lines128 : LlFormat::pairs;
#endif
}

const char* to_string(LlFormat format) {
  switch (format) {
    case LlFormat::automatic: return "automatic";
    case LlFormat::pairs: return "16-byte lines";
    case LlFormat::lines128: return "128-byte lines";
  }
  return "?";
}

void ll_allgather(const HeapView& heap, const void* in, std::size_t bytes, void* lines, void* out, LlState* state,
                  hipStream_t stream, bool early_launch, LlFormat format) {
  require_ll("ll_allgather", heap, bytes, "copy-engine AllGather");
  const std::size_t pairs = bytes / 8;
  if (format == LlFormat::automatic) format = ll_format(bytes);
  if (format == LlFormat::lines128) {
#if defined(CARAVAN_GPU_AMD)
    throw Error(Errc::invalid_argument, "ll_allgather: LlFormat::lines128 is for NVIDIA GPUs (NVLink); use pairs");
#else
    const std::size_t line_count = ll128_lines(pairs);
    launch_kernel(ll128_allgather_kernel, ll128_blocks(line_count), kLlThreads, stream, early_launch, heap,
                  static_cast<const std::uint64_t*>(in), pairs, line_count, static_cast<uint4*>(lines),
                  static_cast<std::uint64_t*>(out), state);
    return;
#endif
  }
  launch_kernel(ll_allgather_kernel, ll_blocks(pairs), kLlThreads, stream, early_launch, heap,
                static_cast<const uint2*>(in), pairs, static_cast<uint4*>(lines), static_cast<uint2*>(out), state);
}

void ll_reduce_scatter(const HeapView& heap, const bf16* partial, std::size_t bytes, void* lines, bf16* out, LlState* state,
                       hipStream_t stream, bool early_launch, LlFormat format) {
  require_ll("ll_reduce_scatter", heap, bytes, "copy-engine ReduceScatter");
  const std::size_t pairs = bytes / 8;
  if (format == LlFormat::automatic) format = ll_format(bytes);
  if (format == LlFormat::lines128) {
#if defined(CARAVAN_GPU_AMD)
    throw Error(Errc::invalid_argument, "ll_reduce_scatter: LlFormat::lines128 is for NVIDIA GPUs (NVLink); use pairs");
#else
    const std::size_t line_count = ll128_lines(pairs);
    launch_kernel(ll128_reduce_scatter_kernel, ll128_blocks(line_count), kLlThreads, stream, early_launch, heap,
                  reinterpret_cast<const std::uint64_t*>(partial), pairs, line_count, static_cast<uint4*>(lines),
                  reinterpret_cast<std::uint64_t*>(out), state);
    return;
#endif
  }
  launch_kernel(ll_reduce_scatter_kernel, ll_blocks(pairs), kLlThreads, stream, early_launch, heap,
                reinterpret_cast<const uint2*>(partial), pairs, static_cast<uint4*>(lines), reinterpret_cast<uint2*>(out),
                state);
}

}  // namespace caravan::gpu
