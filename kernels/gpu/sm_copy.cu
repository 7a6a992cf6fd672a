// SM-driven pushes over the peer links (kernels.h: sm_push): the threads of a few blocks store
// a local buffer straight into every peer's copy of a symmetric allocation, chunk by chunk, and
// raise the peer's landing flag for a chunk once every block's share of it is stored.
//
// Why SMs and not the copy engine: with every GPU sending to every other at once, copy engines
// fall to about 197 GB/s per GPU while SM-driven stores hold 330-370 GB/s (measured reference),
// and a kernel's launch costs less than a copy-engine copy plus a stream write per chunk. The
// price is the SMs it occupies, so the grid is small when a GEMM runs beside it.
#include "kernels/gpu/bf16_vector.cuh"
#include "kernels/gpu/device.cuh"
#include "kernels/gpu/early_launch.cuh"
#include "kernels/gpu/kernels.h"
#include "kernels/gpu/symmetric.cuh"
#include "runtime/gpu/grid_copy.cuh"

#include <caravan/error.h>

#include <algorithm>
#include <string>

namespace caravan::gpu {
namespace {

constexpr int kThreads = 512;

// One thread of a block records that it reached `which` (kernels.h: stamp_word).
__device__ inline void stamp(std::uint64_t* stamps, int which) {
  if (stamps == nullptr) return;
  const std::uint64_t now = dev::global_ns();
  atomicMax(reinterpret_cast<unsigned long long*>(stamps + which), static_cast<unsigned long long>(now));
  if (which == stamp_word::entry_last)
    atomicMax(reinterpret_cast<unsigned long long*>(stamps + stamp_word::entry_first),
              ~static_cast<unsigned long long>(now));
}

__global__ void stamp_time_kernel(std::uint64_t* word) { *word = dev::global_ns(); }

// The block's share of a ReduceScatter's sums: out[v] = the sum over ranks q < world of
// from[q][v], in rank order and fp32 (the order and rounding of reduce_sum), for the vectors
// v in [begin, end) at begin + blockIdx.x * blockDim.x + threadIdx.x, stepping by the grid. Every
// rank's vector is loaded (L2 only: the peers' bytes are new in every call) before the first is
// used.
__device__ inline void sum_ranks(const uint4* const (&from)[kMaxHeapRanks], int world, std::size_t begin,
                                 std::size_t end, uint4* out) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t v = begin + blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; v < end; v += stride) {
    uint4 raw[kMaxHeapRanks];
#pragma unroll
    for (int q = 0; q < kMaxHeapRanks; ++q)
      if (q < world) raw[q] = dev::load_l2(from[q] + v);
    float acc[8] = {};
#pragma unroll
    for (int q = 0; q < kMaxHeapRanks; ++q)
      if (q < world) dev::accumulate_bf16x8(acc, raw[q]);
    out[v] = dev::round_bf16x8(acc);
  }
}

// The block's last stamp (kernels.h: stamp_word::done), once all its threads have written.
__device__ inline void stamp_block_done(std::uint64_t* stamps) {
  if (stamps == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0) stamp(stamps, stamp_word::done);
}

// Sets every peer's copy of `flag` to `value` once this thread's earlier writes, and those that a
// block barrier ordered before them, are visible to the peers: one system-scope fence, then
// relaxed stores (the fence makes them a release). Why not a release store per peer: on
// 4 x H200, an announcement of three or six release stores in a row took 10-14 us (eleventh
// session's %globaltimer stamps), as if each waited for the one before it to land.
__device__ inline void publish_to_peers(const HeapView& heap, std::uint64_t* flag, std::uint64_t value) {
  for (int step = 1; step < heap.world; ++step)
    dev::notify(heap, flag, value, (heap.rank + step) % heap.world, dev::SignalOp::set, dev::Order::relaxed);
}

// Thread 0 of a block that has stored its share of chunk c for `peer`: fences those stores at
// system scope and counts the block; the last block of the grid resets the counter (for the next
// call, stream-ordered after this one), fences again and raises the peer's landed flag.
__device__ inline void block_stored_chunk(const HeapView& heap, std::uint32_t* counters, std::uint64_t* landed,
                                          int peer, int c, int chunks, std::uint64_t epoch) {
  __threadfence_system();
  std::uint32_t* count = &counters[peer * chunks + c];
  if (dev::atomic_add<dev::Scope::gpu>(heap, count, 1u, heap.rank, dev::Order::acq_rel) == gridDim.x - 1) {
    dev::atomic_store<dev::Scope::gpu>(heap, count, 0u, heap.rank, dev::Order::relaxed);
    __threadfence_system();  // with the relaxed store below, a release
    dev::notify(heap, landed + heap.rank * chunks + c, epoch, peer, dev::SignalOp::set, dev::Order::relaxed);
  }
}

// The same for chunk c stored to every peer at once (SmPushFlags::all_peers_at_once): one fence
// and one count per block, in this rank's own counter slot (otherwise unused: a rank never
// pushes to itself), and the last block raises every peer's landed flag after one more fence.
// A fence and a count per peer cost three system-scope fences in a row per block and chunk.
__device__ inline void block_stored_chunk_everywhere(const HeapView& heap, std::uint32_t* counters,
                                                     std::uint64_t* landed, int c, int chunks, std::uint64_t epoch) {
  __threadfence_system();
  std::uint32_t* count = &counters[heap.rank * chunks + c];
  if (dev::atomic_add<dev::Scope::gpu>(heap, count, 1u, heap.rank, dev::Order::acq_rel) == gridDim.x - 1) {
    dev::atomic_store<dev::Scope::gpu>(heap, count, 0u, heap.rank, dev::Order::relaxed);
    __threadfence_system();  // with the relaxed stores of publish_to_peers, a release
    publish_to_peers(heap, landed + heap.rank * chunks + c, epoch);
  }
}

// Block b stores the vectors b * threads + t, stepping by the grid, of each chunk; the last block
// to finish a chunk (a counter per peer and chunk, in this GPU's memory) raises the flag. Each
// block fences its stores at system scope before it counts itself, and the last one fences again
// before its release store: whoever acquires the flag sees every block's stores (the pattern of
// a last-block reduction, at system scope).
__global__ void __launch_bounds__(kThreads)
    sm_push_kernel(const CARAVAN_GRID_CONSTANT HeapView heap, const uint4* src, uint4* dst, std::size_t chunk_vectors,
                   int chunks, SmPushFlags flags, std::uint32_t* counters, std::uint64_t epoch,
                   std::uint32_t row_vectors, std::size_t pitch_vectors) {
  const int world = heap.world, me = heap.rank;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kThreads;
  std::uint64_t* const landed = flags.landed;
  // The first block to start announces the entry: a peer's blocks may wait on it, and this GPU's
  // other blocks need not be resident yet. This GPU's own copy of an entry word is its election
  // word (the peers store into their copies, never into this one). One announcer, because every
  // block storing the same remote words took 10-16 us in the pull ReduceScatter (eleventh session).
  if (threadIdx.x == 0) {
    bool fenced = false;
    for (std::uint64_t* entry : flags.entry) {
      if (entry == nullptr ||
          atomicMax(reinterpret_cast<unsigned long long*>(entry), static_cast<unsigned long long>(epoch)) >= epoch)
        continue;
      if (!fenced) __threadfence_system();
      fenced = true;
      publish_to_peers(heap, entry, epoch);
    }
  }
  if (flags.all_peers_at_once) {
    // Every peer's slot first (they were announced at about the same time), then each vector
    // loaded once and stored to every peer, one fence per block and chunk for all of them: at
    // small shards the per-peer fences and the peer-by-peer order were most of the time.
    if (flags.freed != nullptr) {
      if (static_cast<int>(threadIdx.x) < world - 1)
        dev::wait_until(flags.freed + (me + 1 + threadIdx.x) % world, dev::Compare::ge, epoch);
      __syncthreads();
    }
    uint4* remote[kMaxHeapRanks] = {};
#pragma unroll  // ranks index the array only through unrolled loops: it stays in registers
    for (int step = 1; step < kMaxHeapRanks; ++step)
      if (step < world) remote[step] = dev::translate(heap, dst, (me + step) % world);
    // Rows of a column block (row_vectors > 0): vector i of a chunk is at row i / row_vectors,
    // column i % row_vectors, rows pitch_vectors apart.
    const std::size_t chunk_span = row_vectors > 0 ? chunk_vectors / row_vectors * pitch_vectors : chunk_vectors;
    for (int c = 0; c < chunks; ++c) {
      const std::size_t base = static_cast<std::size_t>(c) * chunk_span;
      for (std::size_t i = blockIdx.x * static_cast<std::size_t>(kThreads) + threadIdx.x; i < chunk_vectors;
           i += stride) {
        const std::size_t at = base + (row_vectors > 0 ? i / row_vectors * pitch_vectors + i % row_vectors : i);
        const uint4 v = src[at];
#pragma unroll
        for (int step = 1; step < kMaxHeapRanks; ++step)
          if (step < world) remote[step][at] = v;
      }
      __syncthreads();
      if (threadIdx.x == 0) block_stored_chunk_everywhere(heap, counters, landed, c, chunks, epoch);
    }
  } else {
    for (int step = 1; step < world; ++step) {
      const int peer = (me + step) % world;
      if (flags.freed != nullptr) {
        if (threadIdx.x == 0) dev::wait_until(flags.freed + peer, dev::Compare::ge, epoch);
        __syncthreads();  // the peer entered this epoch: its copy may be overwritten
      }
      uint4* remote = dev::translate(heap, dst, peer);
      for (int c = 0; c < chunks; ++c) {
        const std::size_t base = static_cast<std::size_t>(c) * chunk_vectors;
        dev::grid_copy16(src + base, remote + base, chunk_vectors,
                         blockIdx.x * static_cast<std::size_t>(kThreads) + threadIdx.x, stride);
        __syncthreads();
        if (threadIdx.x == 0) block_stored_chunk(heap, counters, landed, peer, c, chunks, epoch);
      }
    }
  }
  // Ends only once every peer's chunks have landed here (one block waits; the kernel's end then
  // orders them before whatever the stream runs next).
  if (flags.wait_landed && blockIdx.x == 0 && threadIdx.x == 0)
    for (int step = 1; step < world; ++step)
      for (int c = 0; c < chunks; ++c)
        dev::wait_until(landed + ((me - step + world) % world) * chunks + c, dev::Compare::ge, epoch);
}

// The one-shot pull ReduceScatter (kernels.h: pull_reduce_scatter). The first block to start
// announces that this rank's partial is complete (the GEMM that wrote it ended before this kernel
// began, in stream order), and every block waits for the same word from every peer, so no block
// depends on another block of this grid being resident. Then each thread sums, in rank order and
// in fp32 (the order and rounding of reduce_sum), one 16-byte vector of this rank's rows from
// every rank's partial, loading the peers' straight over the peer links (L2 only: their bytes are
// new in every call).
// Why one announcer: when every block stored the peers' ready words itself (64-264 blocks, three
// release stores each to the same three words), the announcements took 10-16 us on 4 x H200
// (%globaltimer stamps, eleventh session), most of the exchange.
__global__ void __launch_bounds__(kThreads)
    pull_reduce_scatter_kernel(const CARAVAN_GRID_CONSTANT HeapView heap, const uint4* rows, std::size_t vectors,
                               uint4* out, std::uint64_t* ready, std::uint64_t* freed, std::uint64_t epoch,
                               std::uint64_t* stamps) {
  // Launched early (programmatic dependent launch), the grid may begin while the GEMM before it
  // in the stream is still finishing: wait here until that grid has completed and its writes
  // are visible. A no-op for a grid launched the ordinary way.
  wait_for_prior_grid();
  const int world = heap.world, me = heap.rank;
  if (threadIdx.x == 0) {
    stamp(stamps, stamp_word::entry_last);
    // The election word is this GPU's own ready[me]: the peers store into their copies of it,
    // never into this one.
    if (atomicMax(reinterpret_cast<unsigned long long*>(ready + me), static_cast<unsigned long long>(epoch)) < epoch) {
      __threadfence_system();
      publish_to_peers(heap, ready + me, epoch);
      if (freed != nullptr) publish_to_peers(heap, freed + me, epoch);
    }
    stamp(stamps, stamp_word::signalled);
    for (int q = 0; q < world; ++q)
      if (q != me) dev::wait_until(ready + q, dev::Compare::ge, epoch);
    stamp(stamps, stamp_word::waited);
  }
  __syncthreads();
  const uint4* from[kMaxHeapRanks] = {};
#pragma unroll  // ranks index the array only through unrolled loops: it stays in registers
  for (int q = 0; q < kMaxHeapRanks; ++q)
    if (q < world) from[q] = q == me ? rows : dev::translate(heap, rows, q);
  sum_ranks(from, world, 0, vectors, out);
  stamp_block_done(stamps);
}

// The one-shot push ReduceScatter (kernels.h: push_reduce_scatter). Block b stores its share of
// every peer's rows of this rank's partial (the vectors b * threads + t, stepping by the grid)
// into that peer's inbox slot for this rank, fences at system scope and raises the peer's
// arrived[rank][b]; then waits for arrived[q][b] from every peer q, whose block b stored exactly
// the vectors this block sums (every rank runs the same grid), and sums this rank's rows in rank
// order and fp32 (as reduce_sum), the peers' from the inbox (L2 only: they are new in every
// call) and its own from the partial. So no block waits for another block of its own grid, a
// rank's pushes go as soon as its own GEMM is done whatever its peers are doing, and a block
// sums as soon as its three partners have stored.
// In `rounds` (the rows cut into that many ranges of whole grid passes, each round as above), a block sums round
// r - 1 while its stores of round r are on the links, and only then fences and raises round r:
// the sums, which need only local memory bandwidth, hide behind the link-bound stores. Round r
// of call `epoch` raises the word to (epoch - 1) x rounds + r + 1, so the words keep growing
// from call to call as long as every call has the same rounds.
// Why a word per block: with one count per rank that every block of every peer added to (a
// remote fetch-add each, all on the same word), the signalling took 8-9 us after the stores on
// 4 x H200 (%globaltimer stamps, eleventh session), and each block waited for the slowest block.
__global__ void __launch_bounds__(kThreads)
    push_reduce_scatter_kernel(const CARAVAN_GRID_CONSTANT HeapView heap, const uint4* partial, uint4* inbox,
                               std::size_t vectors, uint4* out, std::uint64_t* arrived, std::uint64_t* freed,
                               std::uint64_t epoch, int rounds, std::uint64_t* stamps) {
  wait_for_prior_grid();
  if (threadIdx.x == 0) stamp(stamps, stamp_word::entry_last);
  const int world = heap.world, me = heap.rank;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  // Each round whole passes of the grid (the last may be short), so every block works in each.
  const std::size_t passes = (vectors + stride - 1) / stride;
  const std::size_t per_round =
      (passes + static_cast<std::size_t>(rounds) - 1) / static_cast<std::size_t>(rounds) * stride;
  const std::uint64_t base = (epoch - 1) * static_cast<std::uint64_t>(rounds);
  uint4* remote[kMaxHeapRanks] = {};
#pragma unroll  // ranks index the array only through unrolled loops: it stays in registers
  for (int step = 1; step < kMaxHeapRanks; ++step)
    if (step < world) remote[step] = dev::translate(heap, inbox + me * vectors, (me + step) % world);
  const uint4* from[kMaxHeapRanks] = {};
#pragma unroll
  for (int q = 0; q < kMaxHeapRanks; ++q)
    if (q < world) from[q] = q == me ? partial + me * vectors : inbox + q * vectors;
  for (int r = 0; r <= rounds; ++r) {
    if (r < rounds) {
      const std::size_t end = (r + 1) * per_round < vectors ? (r + 1) * per_round : vectors;
      for (std::size_t v = r * per_round + first; v < end; v += stride) {
        uint4 rows[kMaxHeapRanks];
#pragma unroll
        for (int step = 1; step < kMaxHeapRanks; ++step)
          if (step < world) rows[step] = partial[((me + step) % world) * vectors + v];  // every load before the first store
#pragma unroll
        for (int step = 1; step < kMaxHeapRanks; ++step)
          if (step < world) remote[step][v] = rows[step];
      }
    }
    if (r > 0) {  // round r - 1: wait for the partners' words, then sum
      if (threadIdx.x == 0) {
        for (int q = 0; q < world; ++q)
          if (q != me) dev::wait_until(arrived + q * gridDim.x + blockIdx.x, dev::Compare::ge, base + r);
        if (r == rounds) stamp(stamps, stamp_word::waited);
      }
      __syncthreads();
      sum_ranks(from, world, (r - 1) * per_round, r * per_round < vectors ? r * per_round : vectors, out);
    }
    if (r < rounds) {
      __syncthreads();
      if (threadIdx.x == 0) {
        if (r == rounds - 1) stamp(stamps, stamp_word::stored);
        // The barrier ordered the block's stores before this thread's fence, and the fence orders
        // them before the relaxed flag stores (a release pattern): one fence for every flag.
        __threadfence_system();
        publish_to_peers(heap, arrived + me * gridDim.x + blockIdx.x, base + r + 1);
        // This rank keeps nothing of the peers' in their copy-engine slots: they may push again.
        if (r == 0 && blockIdx.x == 0 && freed != nullptr) publish_to_peers(heap, freed + me, epoch);
        if (r == rounds - 1) stamp(stamps, stamp_word::signalled);
      }
    }
  }
  stamp_block_done(stamps);
}

}  // namespace

void preload_sm_copy() {
  hipFuncAttributes attributes;
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&sm_push_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&pull_reduce_scatter_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&push_reduce_scatter_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&stamp_time_kernel)));
}

unsigned push_reduce_scatter_threads(std::size_t elements, int blocks) {
  const std::size_t vectors = elements / 8,
                    per_block = (vectors + static_cast<std::size_t>(blocks) - 1) / static_cast<std::size_t>(blocks);
  return static_cast<unsigned>(std::clamp<std::size_t>((per_block + 31) / 32 * 32, 128, kThreads));
}

void push_reduce_scatter(const HeapView& heap, const bf16* partial, bf16* inbox, std::size_t elements, bf16* out,
                         std::uint64_t* arrived, int blocks, int rounds, std::uint64_t* freed, std::uint64_t epoch,
                         hipStream_t stream, bool early_launch, std::uint64_t* stamps) {
  const auto misaligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 != 0; };
  if (elements == 0 || elements % 8 != 0 || misaligned(partial) || misaligned(inbox) || misaligned(out) ||
      arrived == nullptr || blocks < 1 || rounds < 1 || epoch < 1)
    throw Error(Errc::invalid_argument,
                "push_reduce_scatter: elements (" + std::to_string(elements) +
                    ") must be a positive multiple of 8, partial, inbox and out 16-byte aligned, "
                    "arrived given, blocks (" +
                    std::to_string(blocks) + "), rounds (" + std::to_string(rounds) + ") and epoch (" +
                    std::to_string(epoch) + ") positive");
  if (heap.world < 1 || heap.world > kMaxHeapRanks)
    throw Error(Errc::invalid_argument, "push_reduce_scatter: heap view has no valid world size");
  const std::size_t vectors = elements / 8;
  const auto* in = reinterpret_cast<const uint4*>(partial);
  auto* box = reinterpret_cast<uint4*>(inbox);
  auto* sum = reinterpret_cast<uint4*>(out);
  launch_kernel(push_reduce_scatter_kernel, static_cast<unsigned>(blocks), push_reduce_scatter_threads(elements, blocks),
                stream, early_launch, heap, in, box, vectors, sum, arrived, freed, epoch, rounds, stamps);
}

void pull_reduce_scatter(const HeapView& heap, const bf16* rows, std::size_t elements, bf16* out, std::uint64_t* ready,
                         std::uint64_t* freed, std::uint64_t epoch, hipStream_t stream, bool early_launch,
                         std::uint64_t* stamps) {
  const auto misaligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 != 0; };
  if (elements == 0 || elements % 8 != 0 || misaligned(rows) || misaligned(out) || ready == nullptr)
    throw Error(Errc::invalid_argument,
                "pull_reduce_scatter: elements (" + std::to_string(elements) +
                    ") must be a positive multiple of 8, rows and out 16-byte aligned, ready given");
  if (heap.world < 1 || heap.world > kMaxHeapRanks)
    throw Error(Errc::invalid_argument, "pull_reduce_scatter: heap view has no valid world size");
  const std::size_t vectors = elements / 8;
  // Enough blocks for every SM twice over (more loads in flight), no more than the work needs.
  const std::size_t blocks = std::min<std::size_t>((vectors + kThreads - 1) / kThreads, 264);
  const auto* in = reinterpret_cast<const uint4*>(rows);
  auto* sum = reinterpret_cast<uint4*>(out);
  launch_kernel(pull_reduce_scatter_kernel, static_cast<unsigned>(blocks), kThreads, stream, early_launch, heap, in,
                vectors, sum, ready, freed, epoch, stamps);
}

void stamp_time(std::uint64_t* word, hipStream_t stream) {
  launch_checked(stamp_time_kernel, dim3(1), dim3(1), 0, stream, word);
}

std::size_t sm_push_counter_bytes(int world, int chunks) {
  return static_cast<std::size_t>(world) * static_cast<std::size_t>(chunks) * sizeof(std::uint32_t);
}

void sm_push(const HeapView& heap, const void* src, void* dst, std::size_t chunk_bytes, int chunks,
             const SmPushFlags& flags, std::uint32_t* counters, std::uint64_t epoch, int blocks, hipStream_t stream,
             std::size_t row_bytes, std::size_t pitch_bytes) {
  const auto misaligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 != 0; };
  if (chunk_bytes == 0 || chunk_bytes % 16 != 0 || chunks < 1 || blocks < 1 || misaligned(src) || misaligned(dst) ||
      flags.landed == nullptr || counters == nullptr)
    throw Error(Errc::invalid_argument, "sm_push: chunk_bytes (" + std::to_string(chunk_bytes) +
                                            ") must be a positive multiple of 16, chunks (" + std::to_string(chunks) +
                                            ") and blocks (" + std::to_string(blocks) +
                                            ") positive, src and dst 16-byte aligned, landed and counters given");
  if (row_bytes > 0 && (!flags.all_peers_at_once || row_bytes % 16 != 0 || pitch_bytes % 16 != 0 ||
                        chunk_bytes % row_bytes != 0 || row_bytes > pitch_bytes || row_bytes / 16 > UINT32_MAX))
    throw Error(Errc::invalid_argument,
                "sm_push: rows of row_bytes (" + std::to_string(row_bytes) + ") pitch_bytes (" +
                    std::to_string(pitch_bytes) +
                    ") apart need all_peers_at_once, both multiples of 16, row_bytes dividing chunk_bytes (" +
                    std::to_string(chunk_bytes) + ") and at most pitch_bytes");
  launch_checked(sm_push_kernel, dim3(blocks), dim3(kThreads), 0, stream, heap, static_cast<const uint4*>(src),
                 static_cast<uint4*>(dst), chunk_bytes / 16, chunks, flags, counters, epoch,
                 static_cast<std::uint32_t>(row_bytes / 16), pitch_bytes / 16);
}

}  // namespace caravan::gpu
