// Overlapped communication + GEMM on the GPUs of one node: the collective moves tiles into
// symmetric memory (kernels/gpu/gpu_heap.h) and raises a flag per tile; the GEMM consumes each
// tile as its flag flips, so communication hides behind computation.
//
// Chunked variants run the vendor BLAS per chunk after that chunk's flag, waited on in stream
// order (hipStreamWaitValue64) with no host involvement; the copies run on the copy engines of
// a communication stream per rank, so the GEMM keeps every SM. Chunk orders are swizzled to the
// arrival order: each rank starts on its own shard, then takes peers in the order they arrive.
//
// Flags hold epochs: every call of an operation on a rank increases the rank's epoch by one,
// and every rank calls an operation the same number of times, so a flag never needs resetting.
// Arguments are checked before a call takes its epoch: a call that throws leaves every rank's
// sequence intact. Calls of one object on one rank run in order even on different streams.
// Shapes: k and n multiples of 8 (16-byte rows), so every chunk starts 16-byte aligned and
// uses the GEMM kernels warmed up at construction.
// Each operation also signals when a peer may overwrite a buffer it read ("freed"/"done"
// flags), so back-to-back calls are safe without a barrier.
#pragma once

#include "kernels/gpu/blas.h"
#include "kernels/gpu/gpu_heap.h"

#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace caravan::gpu {

class PaceGroup;

// The GPUs of a node, one rank each: the symmetric heap, and per rank this process drives a
// communication stream and BLAS handles. Two forms, like the heap's: in-process (this process
// drives every rank, one host thread per rank) and cross-process (each process of the node
// drives its own rank; GpuSymmetricHeap::join_node). Operations are built and called the same
// way in both; in the cross-process form a process calls run() for its own rank only.
// Every rank calls the team's operations in the same order, as collectives of one communicator
// are called: a copy-engine pull waits on the host for every earlier call on its GPU, whichever
// operation made it (PaceGroup), so ranks that call two operations in different orders wait for
// each other until CARAVAN_OVERLAP_TIMEOUT_S and fail with Error(timeout).
// Thread-compatible per rank.
class GpuTeam {
 public:
  // `sharing`: whether ranks may share a GPU (GpuSymmetricHeap, DeviceSharing: for tests of the
  // copy-engine schedules only).
  GpuTeam(std::vector<int> devices, std::uint64_t heap_bytes_per_rank, DeviceSharing sharing = DeviceSharing::refused);
  explicit GpuTeam(std::unique_ptr<GpuSymmetricHeap> cross_process_heap);
  ~GpuTeam();
  GpuTeam(const GpuTeam&) = delete;
  GpuTeam& operator=(const GpuTeam&) = delete;

  int world() const { return heap_->world(); }
  int device(int rank) const { return heap_->device(rank); }
  GpuSymmetricHeap& heap() { return *heap_; }
  const GpuSymmetricHeap& heap() const { return *heap_; }
  // Whether this process drives `rank` (every rank in-process; its own one cross-process).
  bool drives(int rank) const;
  std::vector<int> driven_ranks() const;
  // Called at the end of an operation's construction: cross-process, a gather of the job, so
  // that no rank's first call finds a peer still allocating or loading kernels (see overlap.md,
  // the rules), which also checks that every rank built the same operation (`signature`: its kind
  // and shape) at the same heap offset: a process that built another shape, or operations in
  // another order, would have its peers write into the wrong buffers and flags.
  // Error(invalid_argument) naming both; in-process nothing.
  void construction_done(const std::string& signature);
  // Cross-process: the collective teardown of the heap (GpuSymmetricHeap::leave); call it on
  // every rank once no operation is in flight. In-process nothing.
  void leave();
  hipStream_t comm_stream(int rank) const;
  // The number of SMs (compute units) of rank's GPU.
  int sm_count(int rank) const;
  // A second compute stream per rank ("lane" 1; lane 0 is the caller's stream) with its own
  // BLAS handle: chunk GEMMs alternate between the two lanes, so one chunk's last, partly
  // filled wave of tiles overlaps the next chunk's first.
  hipStream_t lane_stream(int rank) const;
  Blas& blas(int rank, int lane = 0);
  // The paced operations of `rank` (every operation built on this team joins its ranks').
  PaceGroup& pace_group(int rank);
  // Makes `rank`'s GPU current on the calling thread.
  void use(int rank) const;

 private:
  struct Rank;
  void add_rank(int rank);
  std::unique_ptr<GpuSymmetricHeap> heap_;
  std::vector<std::unique_ptr<Rank>> ranks_;  // null for ranks another process drives
};

// How a call is paced when CARAVAN_OVERLAP_GPU_PACE=pulls (docs/overlap.md, "Run-ahead").
enum class PaceAs {
  run_ahead,         // measured safe queued back to back: waits only for a copy-engine pull before it
  unmeasured,        // not measured unpaced: waits for its own operation's previous call, and
                     // that operation's next call waits for it
  copy_engine_pull,  // pulls peers' data with the copy engines: waits until every operation's
                     // calls on this GPU have finished, and the next call on this GPU waits for it
};

class RankSync;

// The paced operations of one rank (GPU) of a team. Copy-engine pulls hang when other copies of
// their GPU are queued behind flag waits, whichever operation queued them (docs/overlap.md,
// "Run-ahead"), so a pull is paced against the calls of every operation on its GPU, not only
// its own. Operations join at construction and leave at destruction; like calls, these must not
// run beside a call on that rank (the team is thread-compatible per rank), and an operation is
// destroyed once its calls have finished (a pull queued later no longer waits for them).
class PaceGroup {
 public:
  PaceGroup() = default;
  PaceGroup(const PaceGroup&) = delete;
  PaceGroup& operator=(const PaceGroup&) = delete;

 private:
  friend class RankSync;
  std::mutex mutex_;
  std::vector<RankSync*> members_;
  RankSync* last_pull_ = nullptr;  // a member whose last call pulled, until a later call waited for it
};

// Per-rank events and epoch of one operation (internal helper, shared by the operations).
class RankSync {
 public:
  // `pace`: enter() may first wait (polling, bounded by CARAVAN_OVERLAP_TIMEOUT_S) until earlier
  // calls have finished on the GPU; `pulls_only`: only around copy-engine pulls and calls paced
  // as unmeasured (CARAVAN_OVERLAP_GPU_PACE). `group`: the rank's PaceGroup, when paced. The LL
  // AllGather is never paced: its calls may be captured in a graph.
  RankSync(int chunk_events, bool pace, bool pulls_only = false, PaceGroup* group = nullptr);
  ~RankSync();
  RankSync(const RankSync&) = delete;
  RankSync& operator=(const RankSync&) = delete;
  hipEvent_t start = nullptr, comm_done = nullptr, lane_done = nullptr;
  std::vector<hipEvent_t> chunk;
  std::uint64_t epoch = 0;

  // Starts a call on `stream`: the next epoch. A call on another stream than the previous one
  // first waits for the previous call, so the calls of one rank stay in order whatever streams
  // the caller uses (the previous call's stream must still exist then). Paced: waits on the
  // host first, as `how` says (throws Error(timeout) without taking an epoch if that wait runs
  // out). Unpaced operations ignore `how`.
  std::uint64_t enter(hipStream_t stream, PaceAs how = PaceAs::unmeasured);
  // Makes `stream` wait until the last call of this rank has finished.
  void order_after_last_call(hipStream_t stream);
  // Ends a call that entered on `stream`: paced, records where it ends, for the next enter().
  void leave(hipStream_t stream);

 private:
  hipEvent_t call_done_ = nullptr;
  hipEvent_t call_end_ = nullptr;  // paced: recorded at the end of every call
  hipStream_t last_stream_ = nullptr;
  bool pace_ = false;
  bool pulls_only_ = false;
  bool last_paced_ = false;  // the previous call was paced as a pull or as unmeasured
  PaceGroup* group_ = nullptr;
};

// Every rank's flag words of one operation, for a hang report (internal helper, shared by the
// operations): copied on streams of their own into pinned memory allocated at construction (no
// allocation while a GPU may be waiting), each copy given up after 2 s, so that a copy stuck
// behind a blocked queue is reported as such instead of hanging the report. The words are
// `groups` arrays of `per_group` words each, in that order.
class FlagReport {
 public:
  FlagReport(GpuTeam& team, SymmetricRegion flags, std::vector<std::string> groups, long per_group);
  ~FlagReport();
  FlagReport(const FlagReport&) = delete;
  FlagReport& operator=(const FlagReport&) = delete;
  // A line per rank: its calls so far (where this process drives it) and each group's words.
  std::string describe(const std::vector<std::unique_ptr<RankSync>>& sync) const;

 private:
  void release() noexcept;  // frees what the constructor made, also when it failed part way
  GpuTeam& team_;
  SymmetricRegion flags_;
  std::vector<std::string> groups_;
  long per_group_;
  std::vector<int> devices_;
  std::vector<hipStream_t> streams_;
  std::vector<hipEvent_t> done_;
  std::uint64_t* words_ = nullptr;  // world x groups x per_group, pinned
};

// Diagnostics: device events, made by the caller with timing, that an operation's next calls
// on one rank record while a trace is set (AllGatherGemm::set_trace,
// GemmReduceScatter::set_ring_trace; `caravan bench overlap --stamps` prints them). Each vector
// has world x splits events; the operations say what a chunk is.
struct ChunkTrace {
  hipEvent_t start = nullptr;  // on the caller's stream, as the call begins
  std::vector<hipEvent_t> ready, gemm_done, pushed;
};

enum class AgGemmVariant {
  ce_pull,       // each rank pulls peers' shards with its copy engine; GEMM per shard as it lands
  ce_push,       // each rank pushes its shard to every peer; GEMM per shard as it lands
  ce_bulk,       // copy-engine AllGather (pull), then one GEMM over all rows: Caravan without overlap
  ce_pull_runs,  // as ce_pull, but the peers' shards in at most two GEMMs over contiguous rows
  ce_push_runs,  // as ce_push, likewise
  ll_bulk,       // low-latency AllGather (SM-driven, flags inside the data), then one GEMM: for
                 // small shards (at most kLlMaxBytes), where copy-engine and NCCL latency dominate
  tile_pull,     // as ce_pull, but one tile-level GEMM (flag_gemm) whose blocks each wait for the
  tile_push,     // flags of their own rows (arrival order); as ce_push likewise. `lanes` unused
  sm_push,       // each rank's SMs push its shard to every peer (a kernel of
                 // CARAVAN_OVERLAP_GPU_COMM_BLOCKS blocks, flags raised by the kernel); GEMM per
                 // shard as it lands
  sm_bulk,       // the same push on every SM, then one GEMM over all rows: for mid-size shards,
                 // where copy-engine latency and the low-latency protocol's doubled bytes cost
};
std::string_view to_string(AgGemmVariant v);

// C[m x n] = AllGather_rows(A)[m x k] x B[k x n] on every rank, A row-sharded (m/world rows per
// rank), B and C per rank (the column shard of a weight, as tensor parallelism has it).
class AllGatherGemm {
 public:
  // `splits` cuts each shard into that many chunks (finer pipelining, smaller GEMMs).
  // Throws Error(invalid_argument) when m is not a multiple of world * splits or a size is not
  // positive. n = 0 builds the AllGather alone (see AllGather below): no GEMM is warmed up, and
  // only gather() may be called.
  AllGatherGemm(GpuTeam& team, long m, long k, long n, int splits = 1);
  ~AllGatherGemm();

  // Where rank `rank` writes its m/world x k shard before run() (in place in symmetric memory,
  // as a producer kernel would).
  bf16* shard(int rank) const;
  // Enqueues on `stream` a wait until the last call on this rank and the peers' reads of its
  // shard are done: call it before overwriting shard(rank) when calls run back to back.
  void wait_shard_free(int rank, hipStream_t stream);
  // Whether the ll_bulk variant is available (a shard of at most kLlMaxBytes).
  bool low_latency() const { return ll_lines_.bytes > 0; }
  // The gathered A on `rank` after run(), until the next run() on that rank (in stream order).
  const bf16* gathered(int rank) const;
  // Enqueues the operation on `stream` (on rank's device): C = gathered A x b. b and c are
  // row-major with leading dimension n. Call from the thread driving `rank`; every rank calls
  // with the same variant sequence.
  // `lanes` (1 or 2): compute streams the chunk GEMMs alternate on.
  void run(int rank, const bf16* b, bf16* c, AgGemmVariant variant, hipStream_t stream, int lanes = 1);
  // Enqueues the AllGather alone on `stream`: gathered(rank) is complete in stream order after
  // it. Variants ce_push, ce_pull, sm_bulk and ll_bulk (the others are GEMM schedules and are
  // refused). Calls of run() and gather() may be mixed, in the same sequence on every rank.
  void gather(int rank, AgGemmVariant variant, hipStream_t stream);
  // Every rank's call count and flag words, for a hang report: copied on streams of their own
  // into pinned memory allocated at construction, each copy given up after 2 s (a copy stuck
  // behind a blocked queue is reported as such instead of hanging the report).
  std::string describe_flags() const;
  // Diagnostics of the chunked copy-engine variants (ce_push, ce_pull; ChunkTrace): chunk c is
  // the c-th chunk GEMM in the order they are enqueued (this rank's own shard first, then the
  // peers' in arrival order); `ready` once its lane has passed its wait for the chunk's flag,
  // `gemm_done` after its GEMM; with ce_push, `pushed[j]` once this rank's j-th copy to a peer
  // has finished (peer rank+1 first; (world - 1) x splits of them). Null: off.
  void set_trace(int rank, ChunkTrace* trace);

 private:
  GpuTeam& team_;
  long m_, k_, n_;
  int splits_;
  std::vector<ChunkTrace*> traces_;  // per rank
  SymmetricRegion gathered_, flags_;
  SymmetricRegion ll_lines_, ll_state_;  // only when a shard fits the low-latency protocol
  LlFormat ll_format_ = LlFormat::pairs;
  SymmetricRegion sm_counters_;          // sm_push's per-chunk block counters (each rank its own)
  int sm_blocks_ = 0;                    // sm_push's grid (CARAVAN_OVERLAP_GPU_COMM_BLOCKS)
  std::vector<std::unique_ptr<RankSync>> sync_;
  // Per rank this process drives: the tile variants' row-tile orders (device memory), pull then
  // push (each flag_gemm_row_tiles(m) ints).
  std::vector<int*> tile_orders_;
  void build_tile_orders(long tiles, long shard_rows);
  void free_tile_orders() noexcept;
  std::unique_ptr<FlagReport> flag_report_;
  void enqueue(int rank, const bf16* b, bf16* c, AgGemmVariant variant, hipStream_t stream, int lanes, bool with_gemm);
  void enqueue_exchange(int rank, bool push, bool sm, std::uint64_t e);
};

enum class AllGatherVariant {
  ce_push,  // copy engines: each rank pushes its shard into every peer's buffer
  ce_pull,  // copy engines: each rank pulls every peer's shard (rank+1, rank+2, ...)
  sm,       // one kernel on every SM stores the shard into every peer's buffer (mid-size shards)
  ll,       // the low-latency protocol: 8-byte words carrying their own flag (shards of at most
            // kLlMaxBytes)
};
std::string_view to_string(AllGatherVariant v);

// The AllGather alone, on AllGatherGemm's buffers and flags: rank r writes its rows x cols shard
// at shard(r), and after run() every rank's gathered buffer holds the world x rows x cols rows
// in rank order (in symmetric memory, valid until that rank's next run()). As every operation
// here, it is collective: every rank builds it in the same order and calls run() equally often,
// with the same variants in the same order.
class AllGather {
 public:
  // Throws Error(invalid_argument) when a size is not positive, cols is not a multiple of 8, or
  // rows_per_rank is not a multiple of `splits` (the chunks each flag announces).
  AllGather(GpuTeam& team, long rows_per_rank, long cols, int splits = 1);
  bf16* shard(int rank) const { return impl_.shard(rank); }
  // Before overwriting shard(rank) when calls run back to back (see AllGatherGemm).
  void wait_shard_free(int rank, hipStream_t stream) { impl_.wait_shard_free(rank, stream); }
  // Whether the ll variant is available.
  bool low_latency() const { return impl_.low_latency(); }
  // Enqueues the AllGather on `stream` (from the thread driving `rank`) and returns rank's
  // gathered buffer, complete in stream order after this call.
  const bf16* run(int rank, AllGatherVariant variant, hipStream_t stream);
  // The variant to run this shape with, by a rule from the measurements on 2 x H200
  // (docs/overlap.md, "Choosing a variant"): ll where available (shards of at most 1 MiB), sm
  // up to kSmMaxBytes gathered, ce_push above.
  AllGatherVariant automatic() const;
  static constexpr std::uint64_t kSmMaxBytes = std::uint64_t{64} << 20;
  std::string describe_flags() const { return impl_.describe_flags(); }

 private:
  std::uint64_t gathered_bytes_;
  AllGatherGemm impl_;
};

enum class GemmRsVariant {
  ce_push,    // GEMM row chunks in destination order; each chunk pushed as it is done; fp32 reduce
              // (in parts, each beside the next part's GEMM, with splits > 1 and 2 lanes)
  ce_bulk,    // one GEMM, then push every chunk, then reduce: Caravan without overlap
  ll_bulk,    // one GEMM, then the low-latency ReduceScatter (SM-driven, flags inside the data):
              // for small outputs (at most kLlMaxBytes per rank), where copy-engine latency dominates
  sm_pull,    // one GEMM into symmetric memory, then one kernel on every SM that waits for every
              // peer's GEMM and sums this rank's rows of all partials, read over the peer links:
              // one flag exchange and no second copy of the data (partials of at most pull_max_bytes())
  sm_push,    // one GEMM, then one kernel that stores every peer's rows into the peer's inbox and
              // counts itself there, then sums this rank's rows once every peer's count is in: a
              // rank's data moves as soon as its own GEMM is done (same size limit as sm_pull)
  tile_push,  // one tile-level GEMM (flag_gemm) whose row tiles run in destination order, each
              // block adding its columns to a done word per part; the copy engine pushes each
              // part once its word is complete (one stream wait-value), as ce_push does per
              // chunk GEMM
  // One tile-level GEMM whose epilogue stores each destination's rows straight into that
  // destination's inbox over the peer links (flag_gemm_parts) and counts them into a word there
  // per source and range of rows (splits ranges per destination); each rank sums a range of its
  // rows as soon as every rank's share of it has landed, while the GEMMs go on. No copy engine,
  // no second copy of the data (inboxes of m x n, two by epoch parity, when they fit: scatter()).
  tile_scatter,
  // As tile_scatter, with the vendor GEMM: one GEMM per range of each destination's rows (range
  // 0 of every destination first, own rows last), stored straight into the destination's inbox,
  // then its done word set by a stream write; lanes alternate the GEMMs over two streams.
  blas_scatter,
  // A ring: each destination's rows go around the ranks, each adding its product to the running
  // sum inside its GEMM (the vendor GEMM with beta = 1, in place, on what its left neighbour
  // pushed) and pushing it on by copy engine to its right neighbour; a rank computes its own rows
  // last, onto the sum of every other rank's, into out. No reduction kernel, so nothing follows
  // the last GEMM; splits parts per destination keep a part's push ahead of the neighbour's GEMM.
  // The running sum is rounded to bf16 at each of the world - 1 hops (the others sum in fp32).
  ce_ring,
};
std::string_view to_string(GemmRsVariant v);

// out[m/world x n] on rank r = rows r of the sum over ranks of A_q[m x k] x B_q[k x n] (K sharded
// over ranks, as the down and output projections have it). The reduction accumulates in fp32.
class GemmReduceScatter {
 public:
  // `splits` cuts each destination's rows into that many GEMMs, each pushed when done. k = 0
  // builds the ReduceScatter alone (see ReduceScatter): no GEMM buffers, call reduce_scatter().
  GemmReduceScatter(GpuTeam& team, long m, long k, long n, int splits = 1);
  ~GemmReduceScatter();
  void run(int rank, const bf16* a, const bf16* b, bf16* out, GemmRsVariant variant, hipStream_t stream, int lanes = 1);
  // The exchange alone on rank's partial `in` (m x n, this GPU's memory, read in stream order):
  // ce_bulk, sm_push or ll_bulk without their GEMM. sm_pull is not offered: it reads the peers'
  // partials where their GEMM wrote them, in symmetric memory.
  void reduce_scatter(int rank, const bf16* in, bf16* out, GemmRsVariant variant, hipStream_t stream);
  // Whether the ll_bulk variant is available (an output of at most kLlMaxBytes per rank).
  bool low_latency() const { return ll_lines_.bytes > 0; }
  // Whether the sm_pull variant is available (a partial of at most pull_max_bytes(), and room in
  // the heap for two of them).
  bool pull() const { return pull_partials_.bytes > 0; }
  // Whether the sm_push variant is available (it uses the same two buffers as inboxes).
  bool push() const { return pull(); }
  // The rounds sm_push's exchange runs in (push_reduce_scatter; CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES).
  int push_rounds() const { return push_rounds_; }
  // Whether the tile_scatter and blas_scatter variants are available: room in the heap for their two inboxes of
  // m x n (taken at construction, after everything else), at most FlagGemmParts::kMaxParts ranks.
  bool scatter() const { return scatter_inboxes_.bytes > 0; }
  // The largest partial that gets sm-pull's two buffers (CARAVAN_OVERLAP_GPU_SM_RS_MAX_BYTES).
  static std::uint64_t pull_max_bytes();
  static constexpr std::uint64_t kPushMaxBlocks = 128;  // sm_push's grid at most
  static constexpr std::uint64_t kPushMaxRounds = 8;    // sm_push's rounds at most
  // Diagnostics: with `after_gemm` (device memory of rank's GPU), the sm_pull and sm_push calls
  // of `rank` write the %globaltimer into it between their GEMM and their exchange (a kernel of
  // its own, which also stops the exchange's early launch), and with `stamps` (stamp_word::count
  // words, zeroed by the caller) the exchange records its phases (kernels.h). Null: off.
  void set_probe(int rank, std::uint64_t* after_gemm, std::uint64_t* stamps);
  // Diagnostics of ce_ring (ChunkTrace): chunk c is step t's part p (c = t x splits + p; step 0
  // is the destination rank - 1, the last this rank's own rows); `ready` once its lane has passed
  // its wait for the left neighbour's part (step 0: once the lane gets to it); `pushed[c]` once
  // its copy to the right neighbour has finished (chunks of the last step are not pushed).
  void set_ring_trace(int rank, ChunkTrace* trace);
  // The parts of a step one ce_ring push of `rank` carries: the fewest that divide `splits` and
  // reach its push bytes (CARAVAN_OVERLAP_GPU_RING_PUSH_BYTES as read at construction, unless
  // set_ring_push_bytes changed them; 1: a push per part).
  int ring_push_group(int rank = 0) const;
  // This rank's push bytes for its later ce_ring calls (0: a push per part). Ranks may differ:
  // the neighbour's word counts parts, whatever group carried them. Not while a call of this
  // rank is being enqueued.
  void set_ring_push_bytes(int rank, std::uint64_t bytes);
  // Every rank's call count and copy-engine flag words (arrived: parts landed per source;
  // freed; ready; ring: ce_ring parts landed from the left neighbour), for a hang report, as
  // AllGatherGemm::describe_flags.
  std::string describe_flags() const;

 private:
  GpuTeam& team_;
  void free_partials();  // and every other per-rank device buffer
  void build_tile_orders();
  struct Probe {
    std::uint64_t* after_gemm = nullptr;
    std::uint64_t* stamps = nullptr;
  };
  std::vector<Probe> probes_;  // per rank
  std::vector<ChunkTrace*> ring_traces_;  // per rank

  long m_, k_, n_;
  int splits_;
  bool early_launch_;  // CARAVAN_OVERLAP_GPU_EARLY_LAUNCH, read at construction (not per call)
  std::vector<std::uint64_t> ring_push_bytes_;  // per rank: CARAVAN_OVERLAP_GPU_RING_PUSH_BYTES, likewise
  SymmetricRegion received_, flags_;
  SymmetricRegion ll_lines_, ll_state_;  // only when the output fits the low-latency protocol
  LlFormat ll_format_ = LlFormat::pairs;
  SymmetricRegion pull_partials_;        // sm_pull: two m x n partials (by epoch parity), when they fit;
                                         // sm_push: two inboxes of world slots (by epoch parity)
  SymmetricRegion push_arrived_;         // sm_push: per rank, a flag per peer and block
  int push_blocks_ = 0;                  // sm_push's grid, the same on every rank
  int push_rounds_ = 1;                  // sm_push's rounds (push_reduce_scatter), likewise
  std::uint64_t pull_limit_ = 0;         // the partial sm-pull's buffers were offered up to (pull_max_bytes())
  std::vector<bf16*> partial_;
  // tile_push, per rank: the row tiles in destination order, a done word per part (world x
  // splits; flag_gemm's done words), and the calls so far (a word's target is calls x its
  // columns per call).
  std::vector<int*> tile_orders_;
  std::vector<std::uint64_t*> parts_done_;
  std::vector<std::uint64_t> tile_calls_;
  // tile_scatter: per rank, two inboxes of world slots of m/world x n (by epoch parity), a done
  // word per source and range of rows (world x splits; each source's GEMM adds to its own), and,
  // per rank, the row tiles in range order (range 0 of every destination, then range 1, ...) and
  // its calls so far.
  SymmetricRegion scatter_inboxes_, scatter_done_;
  std::vector<int*> scatter_orders_;
  std::vector<std::uint64_t> scatter_calls_;
  // ce_ring: per rank, its ce_ring calls so far (a neighbour's ring word counts parts over them).
  std::vector<std::uint64_t> ring_calls_;
  std::vector<std::unique_ptr<RankSync>> sync_;
  std::unique_ptr<FlagReport> flag_report_;
  // run() and reduce_scatter(): `in` null runs the variant's GEMM into the partial, otherwise
  // the exchange starts from `in`.
  void enqueue(int rank, const bf16* a, const bf16* b, const bf16* in, bf16* out, GemmRsVariant variant,
               hipStream_t stream, int lanes);
};

enum class ReduceScatterVariant {
  ce_push,  // copy engines: each rank pushes every peer's rows into that peer's slot, then sums
  sm,       // one kernel on every SM stores the peers' rows into their inboxes and sums its own
            // rows once every peer's have landed (needs two inputs' room in the heap)
  ll,       // the low-latency protocol (outputs of at most kLlMaxBytes per rank)
};
std::string_view to_string(ReduceScatterVariant v);

// The ReduceScatter alone: every rank gives an input of world x rows_per_rank rows by cols
// (bf16, its own GPU's memory), and rank r receives rows [r x rows_per_rank, (r + 1) x
// rows_per_rank) of the sum over ranks, accumulated in fp32. Collective, as every operation
// here (see AllGather).
class ReduceScatter {
 public:
  // Throws Error(invalid_argument) when a size is not positive or cols is not a multiple of 8
  // (16-byte rows).
  ReduceScatter(GpuTeam& team, long rows_per_rank, long cols);
  bool sm() const { return impl_.push(); }
  // The rounds sm runs in (CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES; docs/overlap.md).
  int sm_rounds() const { return impl_.push_rounds(); }
  bool low_latency() const { return impl_.low_latency(); }
  // `in` is read and `out` (rows_per_rank x cols, 16-byte aligned) written in stream order.
  void run(int rank, const bf16* in, bf16* out, ReduceScatterVariant variant, hipStream_t stream);
  // The variant to run this shape with (docs/overlap.md, "Choosing a variant"): sm where
  // available (the heap had room for two inputs at construction), else ce_push. sm beat ll at
  // every size ll takes, and ce_push at every size measured.
  ReduceScatterVariant automatic() const { return sm() ? ReduceScatterVariant::sm : ReduceScatterVariant::ce_push; }
  std::string describe_flags() const { return impl_.describe_flags(); }

 private:
  std::uint64_t out_bytes_, in_bytes_;  // per rank, for the refusals' messages
  GemmReduceScatter impl_;
};

enum class GemmAsVariant {
  ce_push,  // producer-consumer on two streams: GEMM row chunks, each pushed to every peer when done
  ce_bulk,  // one GEMM, then push: Caravan without overlap
  // Fused sequential: one tile GEMM whose blocks each compute a tile, then store it into every
  // rank's C and count it into a word per source there; a rank's C is complete once every peer's
  // word holds its count (at most FlagGemmParts::kMaxParts ranks). No copy engine.
  tile_fused,
  // Workgroup-specialized: as tile_fused, with the persistent tile GEMM, whose store warps store
  // and count each tile while the block's consumer warps compute the next.
  tile_specialized,
  // One GEMM, then one kernel on every SM that stores this rank's column block into every peer's
  // C at once (rows of a pitch) and ends once every peer's block has landed: no copy engine and
  // no stream memory operation, for small outputs where their latency dominates.
  sm_bulk,
};
std::string_view to_string(GemmAsVariant v);

// GEMM + All-Scatter (the Iris taxonomy's case): rank r computes the column block r of
// C[m x n] = A[m x k] x B[k x n] from its B_r[k x n/world] and scatters it, so every rank ends
// with all of C (row-major, in symmetric memory).
class GemmAllScatter {
 public:
  // k = 0 builds the All-Scatter alone (see AllScatter): call scatter().
  GemmAllScatter(GpuTeam& team, long m, long k, long n, int chunks);
  ~GemmAllScatter();
  // rank's copy of C (m x n) after run().
  bf16* output(int rank) const;
  void run(int rank, const bf16* a, const bf16* b_shard, GemmAsVariant variant, hipStream_t stream, int lanes = 1);
  // ce_bulk or sm_bulk without its GEMM: rank's column block, already in output(rank), goes to
  // every peer.
  void scatter(int rank, GemmAsVariant variant, hipStream_t stream);

 private:
  GpuTeam& team_;
  long m_, k_, n_;
  int chunks_;
  SymmetricRegion c_, flags_;
  // tile_fused: per rank, a done word per source (a running count of the columns that source's
  // tiles stored here), and per rank its tile_fused calls so far (a word's target is calls x the
  // columns of one call).
  SymmetricRegion fused_done_;
  std::vector<std::uint64_t> fused_calls_;
  SymmetricRegion sm_counters_;  // sm_bulk: sm_push's per-chunk block counters (each rank its own)
  std::vector<std::unique_ptr<RankSync>> sync_;
  void enqueue(int rank, const bf16* a, const bf16* b_shard, GemmAsVariant variant, hipStream_t stream, int lanes,
               bool with_gemm);
};

enum class AllScatterVariant {
  ce_push,  // copy engines: a 2-D copy per peer and chunk, each announced by a stream write
  sm,       // one kernel on every SM stores the block into every peer's output at once
};
std::string_view to_string(AllScatterVariant v);

// The All-Scatter alone (GEMM + All-Scatter's exchange): rank r writes its rows x cols_per_rank
// column block into block(r) (columns [r x cols_per_rank, (r + 1) x cols_per_rank) of its
// output, row stride world x cols_per_rank), and after run() every rank's output holds every
// rank's block: rows x (world x cols_per_rank), row-major, in symmetric memory, valid until that
// rank's next run(). Collective (see AllGather).
class AllScatter {
 public:
  // Throws Error(invalid_argument) when a size is not positive, cols_per_rank is not a multiple
  // of 8 (16-byte rows), or `chunks` does not divide rows (the pieces each flag announces).
  AllScatter(GpuTeam& team, long rows, long cols_per_rank, int chunks = 1);
  bf16* block(int rank) const;
  // Enqueues the exchange and returns rank's output, complete in stream order after this call.
  const bf16* run(int rank, AllScatterVariant variant, hipStream_t stream);
  // The variant to run this shape with (docs/overlap.md, "Choosing a variant"): sm up to
  // AllGather::kSmMaxBytes of output, ce_push above.
  AllScatterVariant automatic() const;

 private:
  long cols_per_rank_;
  std::uint64_t output_bytes_;
  GemmAllScatter impl_;
};

// The low-latency AllGather of small messages (kernels.h: ll_allgather) with its symmetric
// line buffer and device-side epochs (graph-capturable). Its kernel is launched early (a
// programmatic dependent of the kernel before it) when CARAVAN_OVERLAP_GPU_EARLY_LAUNCH is on,
// read at construction.
class LowLatencyAllGather {
 public:
  ~LowLatencyAllGather();
  LowLatencyAllGather(GpuTeam& team, std::size_t bytes_per_rank);
  // in: this rank's bytes; out: world x bytes.
  void run(int rank, const void* in, void* out, hipStream_t stream);
  // The line format of its calls (ll_format of the bytes per rank, at construction).
  LlFormat format() const;

 private:
  GpuTeam& team_;
  std::size_t bytes_;
  bool early_launch_;
  LlFormat format_;
  SymmetricRegion lines_, state_;
  std::vector<std::unique_ptr<RankSync>> sync_;
};

}  // namespace caravan::gpu
