// Collectives over the host symmetric heap with per-chunk flags, and GEMMs fused with them so
// that computation consumes (or produces) data chunk by chunk as it lands: the CPU backend of
// the overlap work (docs/overlap.md). The GPU backend (kernels/gpu) has the same operations.
//
// Every class here is collective: all ranks construct it with the same arguments, in the same
// order (it allocates symmetric memory), and call run() the same number of times. Matrices are
// row-major bf16; W is the world size, r this rank.
//
// Signalling, in short (details in docs/overlap.md):
//  - Data moves in chunks of `chunk_rows` rows; each chunk has a 64-bit flag in the receiver's
//    symmetric memory. The sender puts the chunk and then raises the flag to the launch's epoch
//    (put_signal: release), the consumer waits for flag >= epoch (acquire). Epochs count launches
//    (1, 2, ...), so flags never need a reset: last launch's flags are simply too small.
//  - A launch starts with every rank telling every peer "I entered epoch e" (one release signal
//    each). A rank writes into a peer's buffers for epoch e only after that peer entered e, i.e.
//    finished e-1 and no longer reads them. Results stay valid until the rank's next run().
//  - Tile orders are swizzled to arrival order: in step j = 1..W-1 rank r sends to (r + j) % W
//    (or pulls from (r - j) % W), so it receives shard (r - j) % W in step j; consumers take their
//    own shard first, then r-1, r-2, ...
#pragma once

#include <caravan/kernels/bf16.h>
#include <caravan/kernels/tile_gemm.h>
#include <caravan/symmetric_heap.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

namespace caravan::kernels {

// The GEMM + collective schedules of the Iris taxonomy, as they map onto CPU threads:
//  bulk_synchronous:      the collective, then the GEMM (or the GEMM, then the collective); the
//                         baseline that PyTorch + NCCL corresponds to.
//  producer_consumer:     `threads` compute threads plus one communication thread (the two
//                         "streams"), handing chunks over through flags.
//  fused_sequential:      every compute thread does the communication of its own tile right
//                         before (AllGather: pulls the A chunk) or after (stores the C tile to
//                         its destinations) computing it; no separate communication thread.
//  workgroup_specialized: one team of `threads` threads, the first `comm_threads` dedicated to
//                         communication, the others to computation (at least one of each).
enum class OverlapVariant { bulk_synchronous, producer_consumer, fused_sequential, workgroup_specialized };
inline constexpr OverlapVariant kAllVariants[] = {OverlapVariant::bulk_synchronous, OverlapVariant::producer_consumer,
                                                  OverlapVariant::fused_sequential, OverlapVariant::workgroup_specialized};
std::string_view to_string(OverlapVariant variant);
// "bulk", "bulk_synchronous", "producer_consumer", "fused_sequential", "workgroup_specialized";
// throws Error(invalid_argument) listing them otherwise.
OverlapVariant parse_variant(std::string_view name);

enum class GatherMode { push, pull };

// Compute threads per rank when OverlapOptions::threads is 0: CARAVAN_OVERLAP_THREADS, or when
// that is 0 the host's cores divided by the job's ranks on this host (logical nodes of one host
// share its cores), at least 1. Needs a running Runtime.
int default_compute_threads();

// Checks the CPU operations' settings against the rule the settings table cannot state
// (CARAVAN_OVERLAP_TILE_N a multiple of 32; each setting's range is the table's), throwing
// Error(invalid_argument) that names the variable. A launcher runs it before it starts ranks, so
// that a bad value fails once, as a usage error, not in every rank.
void check_overlap_settings();

struct OverlapOptions {
  int threads = 0;                // compute threads of this rank; 0: CARAVAN_OVERLAP_THREADS
  int comm_threads = 0;           // workgroup_specialized's communication threads; 0: CARAVAN_OVERLAP_COMM_THREADS
  std::int64_t chunk_rows = 0;    // rows per flagged chunk = GEMM tile rows; 0: CARAVAN_OVERLAP_TILE_M
  std::int64_t tile_cols = 0;     // GEMM tile columns (a multiple of 32); 0: CARAVAN_OVERLAP_TILE_N
  std::optional<std::chrono::nanoseconds> timeout;  // any single wait; default CARAVAN_OVERLAP_TIMEOUT_S
};

namespace detail {
struct OpState;
}

// AllGather: rank r contributes `rows_per_rank` x `cols`; every rank receives the [W * rows_per_rank,
// cols] matrix, shard s at rows [s * rows_per_rank, (s + 1) * rows_per_rank).
//  push: each rank puts its chunks into every peer's copy and raises the peer's chunk flags.
//  pull: each rank stages its shard in its own copy, says so, and every peer gets the chunks.
class AllGather {
 public:
  AllGather(SymmetricHeap heap, std::int64_t rows_per_rank, std::int64_t cols, GatherMode mode,
            const OverlapOptions& options = {});
  ~AllGather();
  AllGather(AllGather&&) noexcept;
  // Returns the gathered matrix (symmetric memory, valid until the next run()).
  const Bf16* run(const Bf16* mine);

 private:
  std::unique_ptr<detail::OpState> state_;
};

// ReduceScatter: every rank contributes [rows, cols] (rows a multiple of W); rank r receives
// rows [r * rows / W, (r + 1) * rows / W) of the sum over ranks, accumulated in fp32.
class ReduceScatter {
 public:
  ReduceScatter(SymmetricHeap heap, std::int64_t rows, std::int64_t cols, const OverlapOptions& options = {});
  ~ReduceScatter();
  ReduceScatter(ReduceScatter&&) noexcept;
  // `out`: rows / W x cols.
  void run(const Bf16* mine, Bf16* out);

 private:
  std::unique_ptr<detail::OpState> state_;
};

// All-Scatter (all-gather along columns): rank r contributes [rows, cols_per_rank]; every rank
// receives [rows, W * cols_per_rank] with rank s's block at columns [s * cols_per_rank, ...).
class AllScatter {
 public:
  AllScatter(SymmetricHeap heap, std::int64_t rows, std::int64_t cols_per_rank, const OverlapOptions& options = {});
  ~AllScatter();
  AllScatter(AllScatter&&) noexcept;
  // `out`: rows x (W * cols_per_rank).
  void run(const Bf16* mine, Bf16* out);

 private:
  std::unique_ptr<detail::OpState> state_;
};

// Low-latency AllGather for small messages: each 8-byte word carries 4 bytes of data and the
// launch's epoch as a 4-byte flag, written together, so a receiver that sees the flag has the
// data (no separate signal, no handshake; twice the bytes on the wire). Two buffers alternate
// between launches: a rank that finished launch e-1 has received every peer's words of e-1, so
// every peer is done reading the buffer that launch e overwrites.
class LowLatencyAllGather {
 public:
  LowLatencyAllGather(SymmetricHeap heap, std::size_t bytes_per_rank, const OverlapOptions& options = {});
  ~LowLatencyAllGather();
  LowLatencyAllGather(LowLatencyAllGather&&) noexcept;
  // `out`: W * bytes_per_rank bytes, rank s's at [s * bytes_per_rank, ...).
  void run(const void* mine, void* out);

 private:
  std::unique_ptr<detail::OpState> state_;
};

// AllGather + GEMM (tensor parallel, sequence-parallel input): rank r holds A_r [M / W, K] and
// the weight column block B_r [K, N / W]; out_r [M, N / W] = AllGather(A) x B_r.
class AllGatherGemm {
 public:
  AllGatherGemm(SymmetricHeap heap, std::int64_t m, std::int64_t n, std::int64_t k, OverlapVariant variant,
                const OverlapOptions& options = {});
  ~AllGatherGemm();
  AllGatherGemm(AllGatherGemm&&) noexcept;
  // B_r [K, N / W] (row-major, ld N / W), packed once; weights change rarely.
  void set_weights(const Bf16* b);
  // `a`: A_r [M / W, K]; `out`: [M, N / W].
  void run(const Bf16* a, Bf16* out);

 private:
  std::unique_ptr<detail::OpState> state_;
};

// GEMM + ReduceScatter (row-parallel layer): rank r holds A_r [M, K / W] and B_r [K / W, N];
// out_r [M / W, N] = rows [r M / W, (r + 1) M / W) of sum_s A_s B_s, reduced in fp32.
class GemmReduceScatter {
 public:
  GemmReduceScatter(SymmetricHeap heap, std::int64_t m, std::int64_t n, std::int64_t k, OverlapVariant variant,
                    const OverlapOptions& options = {});
  ~GemmReduceScatter();
  GemmReduceScatter(GemmReduceScatter&&) noexcept;
  void set_weights(const Bf16* b);  // B_r [K / W, N]
  void run(const Bf16* a, Bf16* out);  // A_r [M, K / W] -> out [M / W, N]

 private:
  std::unique_ptr<detail::OpState> state_;
};

// GEMM + All-Scatter (Iris's example): every rank holds the same A [M, K] and B_r [K, N / W];
// every rank receives C [M, N] = A x [B_0 .. B_{W-1}].
class GemmAllScatter {
 public:
  GemmAllScatter(SymmetricHeap heap, std::int64_t m, std::int64_t n, std::int64_t k, OverlapVariant variant,
                 const OverlapOptions& options = {});
  ~GemmAllScatter();
  GemmAllScatter(GemmAllScatter&&) noexcept;
  void set_weights(const Bf16* b);  // B_r [K, N / W]
  void run(const Bf16* a, Bf16* out);  // A [M, K] -> out [M, N]

 private:
  std::unique_ptr<detail::OpState> state_;
};

}  // namespace caravan::kernels
