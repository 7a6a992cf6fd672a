// Host launchers of Caravan's GPU kernels (kernels/gpu/*.cu). Every launcher checks the launch
// and throws Error(device) on failure; the work itself is asynchronous on `stream`.
#pragma once

#include "kernels/gpu/bf16.h"
#include "kernels/gpu/heap_view.h"
#include "runtime/gpu/platform.h"

#include <cstddef>
#include <cstdint>
#include <string>

namespace caravan::gpu {

// Loads this file's kernels on the current device now (the runtime loads a kernel on its first
// launch otherwise, and loading waits for the device to be idle; see overlap.h).
void preload_kernels();

// Fills rows x cols of a row-major matrix (leading dimension ld) with uniform values in
// [-scale, scale], a pure function of (seed, row0 + row, col0 + col): any rank can regenerate any
// part of a distributed matrix. The float version holds the same values (rounded to bf16 first),
// for float32 references.
void fill_random(bf16* out, long rows, long cols, long ld, std::uint64_t seed, long row0, long col0, float scale,
                 hipStream_t stream);
void fill_random(float* out, long rows, long cols, long ld, std::uint64_t seed, long row0, long col0, float scale,
                 hipStream_t stream);

// Sums for a relative error ||out - ref|| / ||ref|| and the count of non-finite outputs (a
// poisoned element that was never written is NaN). `sums` is device memory, zeroed here.
struct ErrorSums {
  double diff2 = 0;
  double ref2 = 0;
  unsigned long long nonfinite = 0;
};
void compare(const bf16* out, long rows, long cols, long ld, const float* ref, long ref_ld, ErrorSums* sums,
             hipStream_t stream);

// out[i] = sum over j < count of inputs[j][i], accumulated in fp32, for `elements` bf16 values.
// Inputs are summed in the order given (deterministic). All pointers 16-byte aligned.
inline constexpr int kMaxReduceInputs = 8;
struct ReduceInputs {
  const bf16* in[kMaxReduceInputs] = {};
  int count = 0;
};
void reduce_sum(bf16* out, const ReduceInputs& inputs, std::size_t elements, hipStream_t stream);

// The low-latency AllGather: each rank's `bytes` (a multiple of 8, at most kLlMaxBytes) travel
// to every peer as 16-byte lines of two 4-byte data words each followed by a 4-byte flag equal
// to the call's epoch, so a receiver knows a line has landed by reading the line itself, with no
// separate signal. `lines` is this rank's copy of a symmetric region of ll_buffer_bytes(world,
// bytes); `out` receives world x bytes (rank p's data at p * bytes). `state` (device memory of
// this rank, zero at first) holds the epochs, advanced on the device by each call, so calls can
// be captured in a graph and replayed; every call on one state must pass the same `bytes`. The
// line buffer alternates halves by epoch parity, so a rank may run one call ahead of a peer.
// `early_launch`: launched as a programmatic dependent of the kernel before it in the stream
// (Hopper and later), so that its launch overlaps that kernel's end.
inline constexpr std::size_t kLlMaxBytes = std::size_t{1} << 20;
inline constexpr unsigned kLlThreads = 128;  // one thread per 8-byte pair
inline constexpr std::size_t kLlMaxBlocks = kLlMaxBytes / 8 / kLlThreads;
struct LlState {
  std::uint32_t block_epoch[kLlMaxBlocks] = {};  // the epoch of the last call, per block
};
std::size_t ll_buffer_bytes(int world, std::size_t bytes);
// How the AllGather's data travels: `pairs`, the 16-byte lines above (twice the data on the
// links); `lines128`, 128-byte lines of 120 data bytes and an 8-byte flag, stored and loaded by
// 8 threads at once (NVIDIA only: it relies on NVLink delivering a warp's aligned 128-byte store
// whole, as NCCL's LL128 does), with 1/15 more bytes than the data; `automatic`, ll_format(bytes).
// ll_buffer_bytes is enough for either. On 4 x H200, from graphs (scripts/probes/ll_format_probe.cu):
// 128-byte lines 0.94-0.98x the pairs' speed at 8-16 KiB per rank, 1.01-1.02x at 32, 1.10x at 64,
// 1.21-1.24x at 128 and 1.36x at 256 KiB.
enum class LlFormat : std::uint8_t { automatic, pairs, lines128 };
inline constexpr unsigned kLl128Threads = 8;  // threads (16 bytes each) per 128-byte line
inline constexpr unsigned kLl128Words = 15;   // 8-byte data words per line
// The format for `bytes` per rank: lines128 from CARAVAN_LL128_MIN_BYTES up (0: never) on NVIDIA
// GPUs that CUDA reports native peer atomics between (every pair this process sees: NVLink, not
// PCIe), pairs otherwise. Reads the setting (about 0.4 us): the operations resolve it at
// construction.
LlFormat ll_format(std::size_t bytes);
const char* to_string(LlFormat format);
void ll_allgather(const HeapView& heap, const void* in, std::size_t bytes, void* lines, void* out, LlState* state,
                  hipStream_t stream, bool early_launch = false, LlFormat format = LlFormat::automatic);

// The low-latency ReduceScatter, same protocol: `partial` holds world x `bytes` (this rank's
// partial sums of every rank's rows, rank p's at p * bytes); each peer's part travels to it as
// lines, and out (`bytes`) = the sum over ranks of their part for this rank, accumulated in fp32
// in rank order. `lines`: ll_buffer_bytes(world, bytes) of symmetric memory; `state` as above;
// `format` as for ll_allgather.
void ll_reduce_scatter(const HeapView& heap, const bf16* partial, std::size_t bytes, void* lines, bf16* out,
                       LlState* state, hipStream_t stream, bool early_launch = false,
                       LlFormat format = LlFormat::automatic);

}  // namespace caravan::gpu

namespace caravan::gpu {

// ---- The transformer layer's element-wise kernels (layer_kernels.cu; kernels/gpu/tp_layer.h) ----
// All row-major bf16 with fp32 arithmetic; widths multiples of 8 (16-byte vectors).

// Loads layer_kernels.cu's kernels on the current device now (see preload_kernels).
void preload_layer_kernels();
// out[i, :] = x[i, :] / sqrt(mean(x[i, :]^2) + 1e-6) * weight (fp32 weight of `cols`).
void rmsnorm(const bf16* x, long rows, long cols, const float* weight, bf16* out, hipStream_t stream);
// out = a + b, `count` elements (a multiple of 8).
void add(const bf16* a, const bf16* b, bf16* out, std::size_t count, hipStream_t stream);
// out[i, j] = silu(gate[i, j]) * up[i, j], where row i of `up_gate` is [up (f) | gate (f)].
void swiglu(const bf16* up_gate, long rows, long f, bf16* out, hipStream_t stream);
// The causal softmax of attention scores: `rows` rows of `cols` fp32 scores each (consecutive,
// leading dimension `cols`), row r being query (first_query + r % rows_per_head); keys past the
// query get probability 0. Writes bf16 probabilities with the same layout to `out`.
void causal_softmax(const float* scores, long rows, long cols, long rows_per_head, long first_query, bf16* out,
                    hipStream_t stream);

}  // namespace caravan::gpu

namespace caravan::gpu {

// ---- Fused causal attention (attention.cu; flash attention, forward) ----
// out[i, head h] = sum over keys j <= i of softmax_j(scale * q_i . k_j) v_j, for every query row
// i < tokens and query head h; query head h reads key/value head h / (q_heads / kv_heads)
// (grouped-query attention). bf16 in and out, fp32 scores, softmax and accumulation.
struct AttentionArguments {
  const bf16* q = nullptr;  // query head h of row i at q[i * ld + h * head_dim]
  const bf16* k = nullptr;  // key head g of row j at k[j * ld + g * head_dim]
  const bf16* v = nullptr;  // value head g of row j at v[j * ld + g * head_dim]
  long ld = 0;              // leading dimension of q, k and v, in elements (a multiple of 8)
  long tokens = 0;
  long q_heads = 0;
  long kv_heads = 0;
  long head_dim = 0;    // 32, 64 or 128 (fused_attention_supports)
  float scale = 0;      // finite and positive (the fused kernels); usually 1 / sqrt(head_dim)
  bf16* out = nullptr;  // head h of row i at out[i * ld_out + h * head_dim]
  long ld_out = 0;      // even
};
// The arguments for Q, K and V packed per row as a QKV projection writes them: q_heads query
// heads, then kv_heads key heads, then kv_heads value heads, each head_dim wide, in rows of ld;
// the output heads packed the same way in rows of ld_out. Scale 1 / sqrt(head_dim).
AttentionArguments packed_qkv_attention(const bf16* qkv, long ld, long tokens, long q_heads, long kv_heads,
                                        long head_dim, bf16* out, long ld_out);
bool fused_attention_supports(long head_dim);
// Which kernel runs the fused attention. `portable`: mma.sync, any GPU of compute capability 8.0
// or later. `hopper`: TMA + wgmma, compute capability 9.0 and head widths 64 and 128, 128 query
// rows per block. `automatic`: hopper where it can run and block_rows is 0 or 128, else portable.
enum class AttentionKernel { automatic, portable, hopper };
// Whether `kernel` would run `head_dim` on the current device, and the name of the kernel that
// `automatic` (or the kernel asked for) runs there, for reports: "wgmma" or "mma.sync".
bool attention_kernel_runs(AttentionKernel kernel, long head_dim);
std::string attention_kernel_name(AttentionKernel kernel, long head_dim, int block_rows = 0);
// q, k, v 16-byte aligned, out 4-byte aligned.
// Throws Error(invalid_argument) naming the argument and rule (among them a kernel that cannot
// run here). `block_rows`: query rows per block, 64 or 128 (0: the default, 128). Needs no
// workspace; the sequence may be any length.
void fused_causal_attention(const AttentionArguments& a, hipStream_t stream, int block_rows = 0,
                            AttentionKernel kernel = AttentionKernel::automatic);
// The float32 reference of the same attention (one thread per query and head; for tests and
// checks): q, k, v and out are float arrays with a's shape and strides (a's pointers unused).
void attention_reference(const float* q, const float* k, const float* v, const AttentionArguments& a, float* out,
                         hipStream_t stream);
// Loads attention.cu's kernels and grants their shared memory on the current device.
void preload_attention();

// out[i] = in[i] as float, `count` elements (for comparing two bf16 results).
void to_float(const bf16* in, float* out, std::size_t count, hipStream_t stream);
}  // namespace caravan::gpu

namespace caravan::gpu {
// The tile-level GEMM fed by flags (flag_gemm.cu): C[m x n] = A[m x k] B[k x n], row-major bf16,
// fp32 accumulation, one block per tile of 128 rows of C. With `flags`, a block first waits
// (acquire) until every flag word guarding its rows holds at least `epoch`: flag f guards rows
// [f * rows_per_flag, (f + 1) * rows_per_flag) of A. `tile_order` (device memory, or null for
// 0, 1, ...) lists the row tiles in the order their blocks are launched (the arrival order of
// the rows). k and n multiples of 8; pointers 16-byte aligned.
//
// `done` (device memory, or null): word w counts rows [w * rows_per_done, (w + 1) *
// rows_per_done) of C. Once a block's part of C is written and fenced at system scope, it adds
// the number of columns it wrote to the word of every such row range its tile overlaps. The
// rows of word w are complete when it has grown by n x (the row tiles overlapping them,
// flag_gemm_tiles_over), so a stream (or another GPU) can wait for them with one wait-value on
// a running total, call after call, with no reset. Waiting blocks hold their multiprocessors
// (with more tiles than SMs, or a persistent grid, all of them): what raises the flags must not
// need this GPU's SMs (a copy engine, another GPU), or it may never start.
//
// Two kernels: on Hopper (compute capability 9.0) TMA loads and wgmma products in a pipeline of
// shared-memory stages, 128 x 256 or 128 x 128 tiles (flag_gemm_sm90.cu; taken where ldc is a
// multiple of 8 and c 16-byte aligned); the portable one otherwise, WMMA on 128 x 128 tiles, one
// stage, at most 65535 row tiles. `kernel` = portable forces the latter (for comparison).
// `kernel` = persistent runs the Hopper kernel as a persistent grid, one block per
// multiprocessor taking tiles in turn: the producer warpgroup's idle warps store each finished
// tile (and count it done) while the block's consumers compute the next one (one pipeline stage
// fewer pays for the staging buffer). For C on other GPUs, whose stores would otherwise hold the
// SM. Without the Hopper kernel it is `best`.
enum class FlagGemmKernel { best, portable, persistent };
void flag_gemm(const bf16* a, long lda, const bf16* b, long ldb, bf16* c, long ldc, long m, long n, long k,
               std::uint64_t* flags, long rows_per_flag, std::uint64_t epoch, const int* tile_order,
               std::uint64_t* done, long rows_per_done, hipStream_t stream,
               FlagGemmKernel kernel = FlagGemmKernel::best);
// flag_gemm with C's rows in `count` parts of `rows` rows each (the last may be shorter; m must
// need exactly `count` parts), part p at c[p] (any memory the device can write: a peer GPU's
// symmetric heap, for one, so a GEMM+ReduceScatter's epilogue stores each destination's rows
// straight into that destination) with ldc between rows. done[p] (or null) are part p's done
// words, as flag_gemm's `done` with rows counted from the part's first row; they are added to
// with system-scope atomics, so they too may be another GPU's. Pointers 16-byte aligned.
// `copies` > 1 writes each part to that many places (every rank's C, for GEMM+All-Scatter):
// part p's copy i at c[p * copies + i], counted into done[p * copies + i]; count x copies at most
// kMaxParts.
struct FlagGemmParts {
  static constexpr int kMaxParts = 8;
  int count = 1;
  int copies = 1;
  long rows = 0;
  bf16* c[kMaxParts] = {};
  std::uint64_t* done[kMaxParts] = {};
};
void flag_gemm_parts(const bf16* a, long lda, const bf16* b, long ldb, const FlagGemmParts& out, long ldc, long m,
                     long n, long k, std::uint64_t* flags, long rows_per_flag, std::uint64_t epoch,
                     const int* tile_order, long rows_per_done, hipStream_t stream,
                     FlagGemmKernel kernel = FlagGemmKernel::best);
// The row tiles of an m-row C that overlap rows [first, first + rows).
long flag_gemm_tiles_over(long m, long first, long rows);
// What flag_gemm runs for these arguments on the current device: "wgmma 128x256", "wmma 128x128", ...
std::string flag_gemm_kernel_name(long m, long n, long ldc, FlagGemmKernel kernel = FlagGemmKernel::best);
long flag_gemm_row_tiles(long m);
long flag_gemm_tile_rows();
void preload_flag_gemm();
}  // namespace caravan::gpu

namespace caravan::gpu {
// SM-driven push (sm_copy.cu): `blocks` blocks store `chunks` chunks of `chunk_bytes` each, from
// local `src`, into every peer's copy of `dst` (a local address in the symmetric heap), peers in
// the order rank+1, rank+2, ... Flag words are local addresses in the symmetric heap (a peer's
// word is the same offset in its heap); the kernel
//   - first sets each non-null `entry` word at every peer to `epoch` (release; this rank's own
//     copy of the word elects the block that does it, so epochs must grow from call to call),
//   - before writing to a peer, waits (acquire) until this rank's freed[peer] >= epoch, unless
//     `freed` is null,
//   - once chunk c has landed at a peer, sets the peer's landed[rank * chunks + c] = epoch
//     (release, system scope),
//   - with `wait_landed`, ends only when this rank's landed[q * chunks + c] >= epoch for every
//     peer q and chunk c (a whole AllGather in one kernel);
//   - with `all_peers_at_once`, waits for every peer's freed word first and then stores each
//     chunk to all peers together (one load per vector, one fence per chunk), instead of peer
//     by peer: the whole exchange sooner, the first peer's rows later.
// `counters` is this GPU's own scratch of sm_push_counter_bytes(world, chunks), zero before the
// first call and left zero by each; calls using the same counters must be stream-ordered.
// chunk_bytes a multiple of 16, pointers 16-byte aligned.
// With `row_bytes` > 0 (and all_peers_at_once), the chunks are blocks of rows: each chunk is
// chunk_bytes / row_bytes rows of row_bytes, the rows pitch_bytes apart in src and dst alike (a
// column block of a row-major matrix, as the All-Scatter moves); row_bytes and pitch_bytes
// multiples of 16, row_bytes dividing chunk_bytes, at most pitch_bytes.
struct SmPushFlags {
  std::uint64_t* landed = nullptr;
  std::uint64_t* freed = nullptr;
  std::uint64_t* entry[2] = {nullptr, nullptr};
  bool wait_landed = false;
  bool all_peers_at_once = false;
};
void sm_push(const HeapView& heap, const void* src, void* dst, std::size_t chunk_bytes, int chunks,
             const SmPushFlags& flags, std::uint32_t* counters, std::uint64_t epoch, int blocks, hipStream_t stream,
             std::size_t row_bytes = 0, std::size_t pitch_bytes = 0);
std::size_t sm_push_counter_bytes(int world, int chunks);
// One-shot pull ReduceScatter (sm_copy.cu), for outputs small enough that latency rules: every
// rank's partial (the whole m x n) is in the symmetric heap, and `rows` is the local address of
// this rank's rows in it (the same offset in every peer's heap). The kernel sets the peers'
// ready[rank] to `epoch` (release) and, if `freed` is given, their freed[rank] too (this rank
// keeps nothing of theirs); waits until ready[q] >= epoch for every peer q (acquire); then
// writes out = the sum over ranks, in rank order and fp32, of their `elements` at `rows`, read
// over the peer links. This rank's own ready[rank] is its blocks' election word (the first to
// start announces): epochs must grow from call to call. The caller must not overwrite a partial
// while a peer may still read it (GemmReduceScatter alternates two by epoch parity). elements
// a multiple of 8, pointers 16-byte aligned. `early_launch`: launch it as a programmatic
// dependent of the kernel before it in the stream (Hopper and later), so that its launch
// overlaps that kernel's end.
void pull_reduce_scatter(const HeapView& heap, const bf16* rows, std::size_t elements, bf16* out, std::uint64_t* ready,
                         std::uint64_t* freed, std::uint64_t epoch, hipStream_t stream, bool early_launch = false,
                         std::uint64_t* stamps = nullptr);
// The one-shot push ReduceScatter: `partial` (this GPU's memory, world x `elements`, row block q
// for rank q) is stored into each peer q's `inbox` (symmetric, world slots of `elements`) at slot
// `rank`, by `blocks` blocks (the same on every rank, and all resident at once);
// block b then sets the peer's arrived[rank * blocks + b] = `epoch` (one round; symmetric, world x blocks
// words, zero at first; epochs grow from call to call), waits until arrived[q * blocks + b] >=
// epoch for every peer q, and writes its share of out = the sum over ranks in rank order and
// fp32 of slot q (its own rows from `partial`). `freed` (if given): the peers' freed[rank] set to
// `epoch`. The caller must not overwrite an inbox slot a peer may still read (GemmReduceScatter
// alternates two by epoch parity). With `rounds` > 1 the rows go in that many ranges, a block
// summing one range while it stores the next; the words then count rounds, (epoch - 1) x rounds
// + r + 1 after round r, so every call on one arrived array must have the same rounds.
void push_reduce_scatter(const HeapView& heap, const bf16* partial, bf16* inbox, std::size_t elements, bf16* out,
                         std::uint64_t* arrived, int blocks, int rounds, std::uint64_t* freed, std::uint64_t epoch,
                         hipStream_t stream, bool early_launch = false, std::uint64_t* stamps = nullptr);
// The threads per block push_reduce_scatter runs `blocks` blocks of: enough for one 16-byte
// vector a thread, a multiple of 32 in [128, 512]; so a small exchange spreads over many SMs.
unsigned push_reduce_scatter_threads(std::size_t elements, int blocks);
void preload_sm_copy();

// Diagnostics of the one-shot exchanges: with `stamps` (stamp_word::count words of this GPU's
// memory, zeroed before the call), pull_reduce_scatter and push_reduce_scatter record when their
// phases ended, in %globaltimer nanoseconds, each word the latest over the grid's blocks:
//   entry_first holds UINT64_MAX minus the earliest block's start (so that zero-filled words
//   and one atomic max serve every word), entry_last the latest block's start, stored when the
//   blocks had stored their rows into the peers (push only), signalled when they had told the
//   peers, waited when the peers' words were seen, and done when the sums were written.
// (push_reduce_scatter in rounds: stored and signalled mark its last round, waited its last wait.)
// stamp_time writes the timer into *word from one thread, in stream order (marks between other
// work; a kernel launch of its own).
namespace stamp_word {
enum : int { entry_first, entry_last, stored, signalled, waited, done, count };
}
void stamp_time(std::uint64_t* word, hipStream_t stream);
}  // namespace caravan::gpu
