// The CPU backend of the overlapped collectives and GEMMs (include/caravan/kernels/overlap.h;
// the protocol is described in docs/overlap.md).
//
// Pieces:
//  - OpState: what every operation has: the heap, rank and world, the resolved settings, a
//    thread team, the launch epoch and the "entered" words (entered[s] = the last epoch rank s
//    entered; a rank writes into s's buffers for epoch e only once entered[s] >= e).
//  - Exchange: W slots of rows x row_elems bf16 in symmetric memory, one flag per (slot, chunk).
//    Rank r always writes into slot r of the receiver: its shard (AllGather), its partial sums
//    for the receiver's rows (ReduceScatter) or its column block (All-Scatter).
//  - Counters: per-chunk "tiles computed" counters on this rank, added to by compute threads and
//    waited on by communication threads; they grow by tiles-per-chunk every launch, so the
//    target of launch e is e * tiles-per-chunk and nothing is reset.
#include "kernels/host/thread_team.h"
#include "runtime/cpu_relax.h"
#include "runtime/deadline.h"

#include <caravan/error.h>
#include <caravan/kernels/overlap.h>
#include <caravan/runtime.h>
#include <caravan/settings.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <thread>

namespace caravan::kernels {

std::string_view to_string(OverlapVariant variant) {
  switch (variant) {
    case OverlapVariant::bulk_synchronous: return "bulk_synchronous";
    case OverlapVariant::producer_consumer: return "producer_consumer";
    case OverlapVariant::fused_sequential: return "fused_sequential";
    case OverlapVariant::workgroup_specialized: return "workgroup_specialized";
  }
  return "?";
}

void check_overlap_settings() {
  // Each setting's own range is the table's (settings::get_* checks it, and `caravan` checks
  // every setting before any command); what is left is the rule the table cannot state.
  const std::int64_t tile_n = settings::get_int("CARAVAN_OVERLAP_TILE_N");
  if (tile_n % PackedB::kPanelWidth != 0)
    throw Error(Errc::invalid_argument, fmt::format("CARAVAN_OVERLAP_TILE_N='{}': must be a multiple of {} (the GEMM's "
                                                    "panel width)",
                                                    tile_n, PackedB::kPanelWidth));
}

int default_compute_threads() {
  const std::int64_t setting = settings::get_int("CARAVAN_OVERLAP_THREADS");
  if (setting > 0) return static_cast<int>(setting);
  Runtime& rt = Runtime::current();
  const std::string& host = rt.rank_info(rt.rank()).host;
  int on_host = 0;
  for (int r = 0; r < rt.world_size(); ++r) on_host += rt.rank_info(r).host == host;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, on_host));
}

OverlapVariant parse_variant(std::string_view name) {
  if (name == "bulk") return OverlapVariant::bulk_synchronous;
  for (OverlapVariant v : kAllVariants)
    if (name == to_string(v)) return v;
  throw Error(Errc::invalid_argument,
              fmt::format("overlap variant '{}': expected bulk_synchronous (or bulk), producer_consumer, "
                          "fused_sequential or workgroup_specialized",
                          name));
}

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct Config {
  int threads = 1;
  int comm_threads = 1;
  std::int64_t chunk_rows = 64;
  std::int64_t tile_cols = 64;
  std::chrono::nanoseconds timeout{};
};

Config resolve(const OverlapOptions& options, std::string_view op) {
  Config c;
  const std::int64_t threads = options.threads ? options.threads : default_compute_threads();
  if (threads < 1 || threads > 256)
    throw Error(Errc::invalid_argument, fmt::format("{}: threads = {}: must be in [1, 256]", op, threads));
  c.threads = static_cast<int>(threads);
  std::int64_t comm = options.comm_threads ? options.comm_threads : settings::get_int("CARAVAN_OVERLAP_COMM_THREADS");
  if (comm < 1 || comm > 64)
    throw Error(Errc::invalid_argument, fmt::format("{}: comm_threads = {}: must be in [1, 64]", op, comm));
  c.comm_threads = static_cast<int>(comm);
  c.chunk_rows = options.chunk_rows ? options.chunk_rows : settings::get_int("CARAVAN_OVERLAP_TILE_M");
  if (c.chunk_rows < 1)
    throw Error(Errc::invalid_argument, fmt::format("{}: chunk_rows = {}: must be at least 1", op, c.chunk_rows));
  c.tile_cols = options.tile_cols ? options.tile_cols : settings::get_int("CARAVAN_OVERLAP_TILE_N");
  if (c.tile_cols < PackedB::kPanelWidth || c.tile_cols % PackedB::kPanelWidth != 0)
    throw Error(Errc::invalid_argument,
                fmt::format("{}: tile_cols = {}{}: must be a positive multiple of {}", op, c.tile_cols,
                            options.tile_cols ? "" : " (CARAVAN_OVERLAP_TILE_N)", PackedB::kPanelWidth));
  c.timeout = options.timeout ? *options.timeout
                              : std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::duration<double>(settings::get_double("CARAVAN_OVERLAP_TIMEOUT_S")));
  if (c.timeout <= 0ns) throw Error(Errc::invalid_argument, fmt::format("{}: the timeout must be positive", op));
  return c;
}

void require(bool ok, std::string_view op, const std::string& rule) {
  if (!ok) throw Error(Errc::invalid_argument, fmt::format("{}: {}", op, rule));
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

}  // namespace

// A block of `rows` rows cut into chunks of `chunk_rows` (the last one may be shorter).
struct Chunks {
  std::int64_t rows = 0, chunk_rows = 1, count = 0;
  Chunks() = default;
  Chunks(std::int64_t rows_, std::int64_t chunk_rows_)
      : rows(rows_), chunk_rows(std::min(chunk_rows_, rows_)), count(ceil_div(rows_, std::min(chunk_rows_, rows_))) {}
  std::int64_t first(std::int64_t c) const { return c * chunk_rows; }
  std::int64_t size(std::int64_t c) const { return std::min(chunk_rows, rows - c * chunk_rows); }
};

struct OpState {
  // `with_team`: the operation runs on a team (the GEMMs); the plain collectives run on the
  // calling thread alone.
  OpState(SymmetricHeap heap_, const OverlapOptions& options, std::string_view name_, bool with_team)
      : heap(heap_), name(name_) {
    Runtime& rt = Runtime::current();
    rank = rt.rank();
    world = rt.world_size();
    config = resolve(options, name);
    // Large enough for every variant: producer_consumer needs threads + 1 members,
    // workgroup_specialized at least comm_threads + 1.
    team = std::make_unique<ThreadTeam>(with_team ? std::max(config.threads, config.comm_threads) + 1 : 1);
    entered = heap.allocate_signals(static_cast<std::size_t>(world));
  }
  virtual ~OpState() = default;

  // A new launch: the next epoch, announced to every peer (release: this rank's reads of the
  // buffers of the previous launch happen before any peer overwrites them).
  void begin() {
    ++epoch;
    for (int p = 0; p < world; ++p)
      if (p != rank) heap.signal(entered, static_cast<std::size_t>(rank), SignalOp::set, epoch, p, MemoryOrder::release);
  }
  void wait_entered(int peer) const {
    if (peer != rank) wait(entered, static_cast<std::size_t>(peer), epoch, "peer's entry into this launch");
  }

  // Waits until this rank's word `index` of `signals` reaches `value` (acquire). Gives up with
  // Error(timeout) after the configured timeout, Error(cancelled) as soon as another member of
  // the team failed (the chunk it was to deliver will not come), Error(transport) when a rank
  // of the job failed.
  void wait(const SymmetricRegion& signals, std::size_t index, std::uint64_t value, std::string_view what) const {
    if (heap.read(signals, index, MemoryOrder::acquire) >= value) return;
    const auto start = Clock::now(), deadline = caravan::detail::deadline_after<Clock>(config.timeout, start);
    for (;;) {
      auto now = Clock::now();
      try {
        heap.wait_until(signals, index, SignalCompare::ge, value, std::min<std::chrono::nanoseconds>(5ms, deadline - now));
        return;
      } catch (const Error& e) {
        if (e.code() != Errc::timeout) throw;
      }
      if (team->failed())
        throw Error(Errc::cancelled, fmt::format("{} (rank {}, launch {}): gave up waiting for {} {}: another thread of "
                                                 "this rank failed",
                                                 name, rank, epoch, what, index));
      if (Clock::now() >= deadline)
        throw Error(Errc::timeout,
                    fmt::format("{} (rank {}, launch {}): waited {:.3f} s for {} {} to reach {} (it is {}); a peer is "
                                "stuck or ran a different sequence of launches (CARAVAN_OVERLAP_TIMEOUT_S)",
                                name, rank, epoch, std::chrono::duration<double>(Clock::now() - start).count(), what,
                                index, value, heap.read(signals, index, MemoryOrder::relaxed)));
    }
  }

  SymmetricHeap heap;
  std::string name;
  int rank = 0, world = 1;
  Config config;
  std::unique_ptr<ThreadTeam> team;
  SymmetricRegion entered;
  std::uint64_t epoch = 0;
};

namespace {

// W slots of `chunks.rows` x `row_elems` bf16 in symmetric memory, one flag per (slot, chunk).
struct Exchange {
  Exchange() = default;
  Exchange(OpState& op, std::int64_t rows, std::int64_t row_elems_, std::int64_t chunk_rows)
      : chunks(rows, chunk_rows), row_elems(row_elems_) {
    slot_bytes = static_cast<std::uint64_t>(rows * row_elems) * sizeof(Bf16);
    data = op.heap.allocate(slot_bytes * static_cast<std::uint64_t>(op.world), 64);
    flags = op.heap.allocate_signals(static_cast<std::size_t>(op.world * chunks.count));
  }
  std::size_t flag(int slot, std::int64_t c) const { return static_cast<std::size_t>(slot * chunks.count + c); }
  std::uint64_t offset(int slot, std::int64_t c) const {
    return static_cast<std::uint64_t>(slot) * slot_bytes + static_cast<std::uint64_t>(chunks.first(c) * row_elems) * sizeof(Bf16);
  }
  std::size_t chunk_bytes(std::int64_t c) const { return static_cast<std::size_t>(chunks.size(c) * row_elems) * sizeof(Bf16); }
  Bf16* slot(const OpState& op, int s) const {
    return reinterpret_cast<Bf16*>(op.heap.local(data) + static_cast<std::uint64_t>(s) * slot_bytes);
  }
  Bf16* chunk(const OpState& op, int s, std::int64_t c) const { return slot(op, s) + chunks.first(c) * row_elems; }

  // Puts chunk c (read from `src`) into slot op.rank of `dest`, then raises its flag there to the
  // epoch (release: the flag's observer sees the rows). `dest` must have entered the epoch.
  void send(OpState& op, int dest, std::int64_t c, const Bf16* src) const {
    op.heap.put_signal(data, offset(op.rank, c), src, chunk_bytes(c), flags, flag(op.rank, c), SignalOp::set, op.epoch, dest);
  }
  // Gets chunk c of `owner`'s slot `owner` into this rank's slot `owner` and raises the local flag.
  void pull(OpState& op, int owner, std::int64_t c) const {
    op.heap.get(chunk(op, owner, c), data, offset(owner, c), chunk_bytes(c), owner);
    op.heap.signal(flags, flag(owner, c), SignalOp::set, op.epoch, op.rank, MemoryOrder::release);
  }
  void wait(const OpState& op, int s, std::int64_t c) const { op.wait(flags, flag(s, c), op.epoch, "chunk flag"); }

  Chunks chunks;
  std::int64_t row_elems = 0;
  std::uint64_t slot_bytes = 0;
  SymmetricRegion data, flags;
};

// Per-chunk "tiles computed" counters on this rank (see the file comment).
struct Counters {
  Counters() = default;
  Counters(OpState& op, std::size_t count, std::int64_t per_chunk_) : per_chunk(per_chunk_) {
    words = op.heap.allocate_signals(count);
    local = std::make_unique<std::atomic<std::uint64_t>[]>(count);
  }
  // Returns true for the tile that completes its chunk (the fused variant's sender).
  bool add(OpState& op, std::size_t index) const {
    op.heap.signal(words, index, SignalOp::add, 1, op.rank, MemoryOrder::release);
    return local[index].fetch_add(1, std::memory_order_acq_rel) + 1 == target(op);
  }
  void wait(const OpState& op, std::size_t index) const { op.wait(words, index, target(op), "computed tiles of chunk"); }
  std::uint64_t target(const OpState& op) const { return op.epoch * static_cast<std::uint64_t>(per_chunk); }

  std::int64_t per_chunk = 1;
  SymmetricRegion words;
  std::unique_ptr<std::atomic<std::uint64_t>[]> local;
};

// A shared work counter: members take units in order until none are left.
struct WorkQueue {
  std::atomic<std::int64_t> next{0};
  void reset() { next.store(0, std::memory_order_relaxed); }
  template <class Fn>
  void drain(std::int64_t count, Fn&& fn) {
    for (std::int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < count; u = next.fetch_add(1, std::memory_order_relaxed))
      fn(u);
  }
};

// Sum of this rank's chunk and every peer's slot for it, in fp32, rounded once into `out`.
void reduce_rows(const Bf16* own, const std::vector<const Bf16*>& others, Bf16* out, std::int64_t elems,
                 std::vector<float>& acc) {
  acc.resize(static_cast<std::size_t>(elems));
  for (std::int64_t i = 0; i < elems; ++i) acc[static_cast<std::size_t>(i)] = own[i].to_float();
  for (const Bf16* other : others)
    for (std::int64_t i = 0; i < elems; ++i) acc[static_cast<std::size_t>(i)] += other[i].to_float();
  for (std::int64_t i = 0; i < elems; ++i) out[i] = Bf16::from_float(acc[static_cast<std::size_t>(i)]);
}

// Copies rows x cols (ld src_ld) into out at column col0 (ld out_ld).
void copy_block(const Bf16* src, std::int64_t src_ld, Bf16* out, std::int64_t out_ld, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t i = 0; i < rows; ++i)
    std::memcpy(out + i * out_ld, src + i * src_ld, static_cast<std::size_t>(cols) * sizeof(Bf16));
}

// The comm members of workgroup_specialized and the compute members.
int team_size(const OpState& op, OverlapVariant v) {
  switch (v) {
    case OverlapVariant::producer_consumer: return op.config.threads + 1;
    case OverlapVariant::workgroup_specialized: return std::max(op.config.threads, op.config.comm_threads + 1);
    default: return op.config.threads;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// AllGather

struct GatherState : OpState {
  GatherState(SymmetricHeap heap_, std::int64_t rows_per_rank_, std::int64_t cols_, GatherMode mode_,
              const OverlapOptions& options, std::string_view name_, bool with_team)
      : OpState(heap_, options, name_, with_team), rows_per_rank(rows_per_rank_), cols(cols_), mode(mode_) {
    require(rows_per_rank >= 1 && cols >= 1, name,
            fmt::format("rows per rank ({}) and columns ({}) must be at least 1", rows_per_rank, cols));
    exchange = Exchange(*this, rows_per_rank, cols, config.chunk_rows);
    ready = heap.allocate_signals(static_cast<std::size_t>(world));
    claimed = std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(world * exchange.chunks.count));
  }
  int source_at_step(int step) const { return (rank - step + world) % world; }

  // Pull mode: wait until every peer entered this launch (finished reading this rank's staged
  // shard of the last one), stage the shard in slot `rank`, and tell every peer it is there.
  void stage(const Bf16* mine) {
    for (int p = 0; p < world; ++p) wait_entered(p);
    std::memcpy(exchange.slot(*this, rank), mine, exchange.slot_bytes);
    for (int p = 0; p < world; ++p)
      if (p != rank) heap.signal(ready, static_cast<std::size_t>(rank), SignalOp::set, epoch, p, MemoryOrder::release);
  }
  void wait_staged(int owner) const { wait(ready, static_cast<std::size_t>(owner), epoch, "staged shard of rank"); }

  // Push: chunks of `mine` into every peer's slot `rank`, peers in swizzled order (step j to
  // rank + j), steps first % stride == first taken by this caller (several comm threads).
  void push_all(const Bf16* mine, int first = 0, int stride = 1) {
    for (int step = 1 + first; step < world; step += stride) {
      const int dest = (rank + step) % world;
      wait_entered(dest);
      for (std::int64_t c = 0; c < exchange.chunks.count; ++c)
        exchange.send(*this, dest, c, mine + exchange.chunks.first(c) * cols);
    }
  }
  void pull_all() {
    for (int step = 1; step < world; ++step) {
      const int owner = source_at_step(step);
      wait_staged(owner);
      for (std::int64_t c = 0; c < exchange.chunks.count; ++c) exchange.pull(*this, owner, c);
    }
  }
  // Fused pull: the first thread that needs chunk c of `owner` in this launch gets it; others wait.
  void ensure_chunk(int owner, std::int64_t c) {
    auto& claim = claimed[static_cast<std::size_t>(exchange.flag(owner, c))];
    if (claim.exchange(epoch, std::memory_order_acq_rel) != epoch) {
      wait_staged(owner);
      exchange.pull(*this, owner, c);
    } else {
      exchange.wait(*this, owner, c);
    }
  }

  std::int64_t rows_per_rank, cols;
  GatherMode mode;
  Exchange exchange;
  SymmetricRegion ready;
  std::unique_ptr<std::atomic<std::uint64_t>[]> claimed;
};

}  // namespace detail

using detail::Exchange;
using detail::OpState;

AllGather::AllGather(SymmetricHeap heap, std::int64_t rows_per_rank, std::int64_t cols, GatherMode mode,
                     const OverlapOptions& options)
    : state_(std::make_unique<detail::GatherState>(heap, rows_per_rank, cols, mode, options, "AllGather", false)) {}
AllGather::~AllGather() = default;
AllGather::AllGather(AllGather&&) noexcept = default;

namespace {
// The buffers a call names must exist: a null one (data() of an empty vector, say) would crash
// inside the operation, after the ranks began it.
void require_buffers(const char* call, std::initializer_list<std::pair<const char*, const void*>> buffers) {
  for (const auto& [name, pointer] : buffers)
    if (!pointer) throw Error(Errc::invalid_argument, fmt::format("{}: {} is null", call, name));
}
}  // namespace

const Bf16* AllGather::run(const Bf16* mine) {
  require_buffers("AllGather::run", {{"mine", mine}});
  auto& s = static_cast<detail::GatherState&>(*state_);
  s.begin();
  if (s.mode == GatherMode::pull) {
    s.stage(mine);
    s.pull_all();
  } else {
    std::memcpy(s.exchange.slot(s, s.rank), mine, s.exchange.slot_bytes);
    s.push_all(mine);
    for (int step = 1; step < s.world; ++step)
      for (std::int64_t c = 0; c < s.exchange.chunks.count; ++c) s.exchange.wait(s, s.source_at_step(step), c);
  }
  return s.exchange.slot(s, 0);
}

// ---------------------------------------------------------------------------------------------
// AllGather + GEMM

namespace detail {

struct AgGemmState : GatherState {
  AgGemmState(SymmetricHeap heap_, std::int64_t m_, std::int64_t n_, std::int64_t k_, OverlapVariant variant_,
              const OverlapOptions& options)
      : GatherState(heap_, check(m_, n_, k_, Runtime::current().world_size()) / Runtime::current().world_size(), k_,
                    variant_ == OverlapVariant::fused_sequential ? GatherMode::pull : GatherMode::push, options,
                    "AllGatherGemm", true),
        m(m_), n(n_), k(k_), n_local(n_ / world), variant(variant_) {
    tiles_n = ceil_div(n_local, config.tile_cols);
  }
  static std::int64_t check(std::int64_t m, std::int64_t n, std::int64_t k, int world) {
    require(m >= 1 && n >= 1 && k >= 1, "AllGatherGemm", fmt::format("M = {}, N = {}, K = {} must be at least 1", m, n, k));
    require(m % world == 0, "AllGatherGemm", fmt::format("M = {} must be divisible by the world size {}", m, world));
    require(n % world == 0, "AllGatherGemm", fmt::format("N = {} must be divisible by the world size {}", n, world));
    return m;
  }
  std::int64_t units() const { return world * exchange.chunks.count * tiles_n; }

  // Unit u, in arrival order: shard (rank - step), its chunks in order, each chunk's column tiles.
  void compute(std::int64_t u, const Bf16* a, Bf16* out, bool wait_for_data) {
    const std::int64_t chunk_index = u / tiles_n, tile = u % tiles_n;
    const int step = static_cast<int>(chunk_index / exchange.chunks.count);
    const std::int64_t c = chunk_index % exchange.chunks.count;
    const int shard = source_at_step(step);
    const Bf16* rows = nullptr;
    if (shard == rank && mode == GatherMode::push) {
      rows = a + exchange.chunks.first(c) * k;  // own rows straight from the input
    } else {
      if (shard != rank && wait_for_data) {
        if (variant == OverlapVariant::fused_sequential) ensure_chunk(shard, c);
        else exchange.wait(*this, shard, c);
      }
      rows = exchange.chunk(*this, shard, c);
    }
    const std::int64_t col0 = tile * config.tile_cols;
    gemm_tile(rows, k, weights, exchange.chunks.size(c), col0, std::min(config.tile_cols, n_local - col0),
              out + (shard * rows_per_rank + exchange.chunks.first(c)) * n_local + col0, n_local);
  }

  void run(const Bf16* a, Bf16* out) {
    if (weights.k() == 0) throw Error(Errc::invalid_argument, "AllGatherGemm::run: set_weights() first");
    begin();
    work.reset();
    const std::int64_t count = units();
    switch (variant) {
      case OverlapVariant::bulk_synchronous:
        push_all(a);
        for (int step = 1; step < world; ++step)
          for (std::int64_t c = 0; c < exchange.chunks.count; ++c) exchange.wait(*this, source_at_step(step), c);
        team->run(config.threads, [&](int) { work.drain(count, [&](std::int64_t u) { compute(u, a, out, false); }); });
        break;
      case OverlapVariant::producer_consumer:
        team->run(config.threads + 1, [&](int member) {
          if (member == config.threads) push_all(a);  // the communication "stream"
          else work.drain(count, [&](std::int64_t u) { compute(u, a, out, true); });
        });
        break;
      case OverlapVariant::fused_sequential:
        stage(a);
        team->run(config.threads, [&](int) { work.drain(count, [&](std::int64_t u) { compute(u, a, out, true); }); });
        break;
      case OverlapVariant::workgroup_specialized: {
        const int size = team_size(*this, variant), comm = config.comm_threads;
        team->run(size, [&](int member) {
          if (member < comm) push_all(a, member, comm);
          else work.drain(count, [&](std::int64_t u) { compute(u, a, out, true); });
        });
        break;
      }
    }
  }

  std::int64_t m, n, k, n_local, tiles_n = 1;
  OverlapVariant variant;
  PackedB weights;
  WorkQueue work;
};

}  // namespace detail

AllGatherGemm::AllGatherGemm(SymmetricHeap heap, std::int64_t m, std::int64_t n, std::int64_t k, OverlapVariant variant,
                             const OverlapOptions& options)
    : state_(std::make_unique<detail::AgGemmState>(heap, m, n, k, variant, options)) {}
AllGatherGemm::~AllGatherGemm() = default;
AllGatherGemm::AllGatherGemm(AllGatherGemm&&) noexcept = default;
void AllGatherGemm::set_weights(const Bf16* b) {
  require_buffers("AllGatherGemm::set_weights", {{"b", b}});
  auto& s = static_cast<detail::AgGemmState&>(*state_);
  if (s.weights.k() == 0) s.weights = PackedB(b, s.k, s.n_local, s.n_local);
  else s.weights.repack(b, s.n_local);
}
void AllGatherGemm::run(const Bf16* a, Bf16* out) {
  require_buffers("AllGatherGemm::run", {{"a", a}, {"out", out}});
  static_cast<detail::AgGemmState&>(*state_).run(a, out);
}

// ---------------------------------------------------------------------------------------------
// ReduceScatter and GEMM + ReduceScatter

namespace detail {

// Rank r's rows are block r of the M rows; every rank sends block b of its partial result to
// rank b (slot r there), and rank r sums its own block with the W-1 slots it received.
struct ScatterReduceState : OpState {
  ScatterReduceState(SymmetricHeap heap_, std::int64_t m_, std::int64_t n_, std::int64_t k_per_rank_,
                     OverlapVariant variant_, const OverlapOptions& options, std::string_view name_, bool with_team)
      : OpState(heap_, options, name_, with_team), m(m_), n(n_), k_local(k_per_rank_), variant(variant_) {
    require(m >= 1 && n >= 1, name, fmt::format("rows ({}) and columns ({}) must be at least 1", m, n));
    require(m % world == 0, name, fmt::format("M = {} must be divisible by the world size {}", m, world));
    block_rows = m / world;
    exchange = Exchange(*this, block_rows, n, config.chunk_rows);
    tiles_n = ceil_div(n, config.tile_cols);
    computed = Counters(*this, static_cast<std::size_t>(world * exchange.chunks.count), tiles_n);
  }
  // Blocks in the order they are computed and sent: rank + 1, rank + 2, ..., own block last (it
  // needs no communication, so computing it last hides the tail of the sends).
  int block_at(std::int64_t position) const { return static_cast<int>((rank + 1 + position) % world); }
  std::size_t chunk_id(int block, std::int64_t c) const { return static_cast<std::size_t>(block * exchange.chunks.count + c); }
  const Bf16* partial_chunk(const Bf16* partial, int block, std::int64_t c) const {
    return partial + (block * block_rows + exchange.chunks.first(c)) * n;
  }
  void send_chunk(const Bf16* partial, int block, std::int64_t c) {
    wait_entered(block);
    exchange.send(*this, block, c, partial_chunk(partial, block, c));
  }
  // Sends position p of the peers' chunks (p over (W - 1) x chunks, in computing order).
  void send_all(const Bf16* partial, bool wait_computed, int first = 0, int stride = 1) {
    const std::int64_t count = (world - 1) * exchange.chunks.count;
    for (std::int64_t p = first; p < count; p += stride) {
      const int block = block_at(p / exchange.chunks.count);
      const std::int64_t c = p % exchange.chunks.count;
      if (wait_computed) computed.wait(*this, chunk_id(block, c));
      send_chunk(partial, block, c);
    }
  }
  void reduce_chunk(const Bf16* partial, std::int64_t c, Bf16* out, bool wait_computed, std::vector<float>& acc) {
    if (wait_computed) computed.wait(*this, chunk_id(rank, c));
    std::vector<const Bf16*> others;
    for (int step = 1; step < world; ++step) {
      const int from = (rank - step + world) % world;  // arrival order: rank - 1 sends to us first
      exchange.wait(*this, from, c);
      others.push_back(exchange.chunk(*this, from, c));
    }
    reduce_rows(partial_chunk(partial, rank, c), others, out + exchange.chunks.first(c) * n,
                exchange.chunks.size(c) * n, acc);
  }
  void reduce_all(const Bf16* partial, Bf16* out, bool wait_computed) {
    thread_local std::vector<float> acc;
    reduce_work.drain(exchange.chunks.count, [&](std::int64_t c) { reduce_chunk(partial, c, out, wait_computed, acc); });
  }

  // GEMM tile u: (position, chunk, column tile) in computing order; A_r rows of that block.
  void compute(std::int64_t u, const Bf16* a, Bf16* partial) {
    const std::int64_t chunk_index = u / tiles_n, tile = u % tiles_n;
    const int block = block_at(chunk_index / exchange.chunks.count);
    const std::int64_t c = chunk_index % exchange.chunks.count;
    const std::int64_t row0 = block * block_rows + exchange.chunks.first(c), col0 = tile * config.tile_cols;
    gemm_tile(a + row0 * k_local, k_local, weights, exchange.chunks.size(c), col0, std::min(config.tile_cols, n - col0),
              partial + row0 * n + col0, n);
    const bool chunk_done = computed.add(*this, chunk_id(block, c));
    if (variant == OverlapVariant::fused_sequential && chunk_done && block != rank) send_chunk(partial, block, c);
  }

  void run_gemm(const Bf16* a, Bf16* out) {
    if (weights.k() == 0) throw Error(Errc::invalid_argument, name + "::run: set_weights() first");
    begin();
    work.reset();
    reduce_work.reset();
    Bf16* p = partial_sums.data();
    const std::int64_t count = world * exchange.chunks.count * tiles_n;
    auto gemm = [&] { work.drain(count, [&](std::int64_t u) { compute(u, a, p); }); };
    switch (variant) {
      case OverlapVariant::bulk_synchronous:
        team->run(config.threads, [&](int) { gemm(); });
        send_all(p, false);
        team->run(config.threads, [&](int) { reduce_all(p, out, false); });
        break;
      case OverlapVariant::producer_consumer:
        team->run(config.threads + 1, [&](int member) {
          if (member == config.threads) send_all(p, true);
          else gemm();
          reduce_all(p, out, true);
        });
        break;
      case OverlapVariant::fused_sequential:
        team->run(config.threads, [&](int) {
          gemm();
          reduce_all(p, out, true);
        });
        break;
      case OverlapVariant::workgroup_specialized: {
        const int comm = config.comm_threads;
        team->run(team_size(*this, variant), [&](int member) {
          if (member < comm) send_all(p, true, member, comm);
          else gemm();
          reduce_all(p, out, true);
        });
        break;
      }
    }
  }

  std::int64_t m, n, k_local, block_rows = 0, tiles_n = 1;
  OverlapVariant variant;
  Exchange exchange;
  Counters computed;
  PackedB weights;
  std::vector<Bf16> partial_sums;  // GemmReduceScatter: this rank's [M, N] partial product
  WorkQueue work, reduce_work;
};

}  // namespace detail

ReduceScatter::ReduceScatter(SymmetricHeap heap, std::int64_t rows, std::int64_t cols, const OverlapOptions& options)
    : state_(std::make_unique<detail::ScatterReduceState>(heap, rows, cols, 0, OverlapVariant::bulk_synchronous, options,
                                                          "ReduceScatter", false)) {}
ReduceScatter::~ReduceScatter() = default;
ReduceScatter::ReduceScatter(ReduceScatter&&) noexcept = default;
void ReduceScatter::run(const Bf16* mine, Bf16* out) {
  require_buffers("ReduceScatter::run", {{"mine", mine}, {"out", out}});
  auto& s = static_cast<detail::ScatterReduceState&>(*state_);
  s.begin();
  s.reduce_work.reset();
  s.send_all(mine, false);
  s.reduce_all(mine, out, false);
}

GemmReduceScatter::GemmReduceScatter(SymmetricHeap heap, std::int64_t m, std::int64_t n, std::int64_t k,
                                     OverlapVariant variant, const OverlapOptions& options) {
  const int world = Runtime::current().world_size();
  detail::require(k >= 1 && k % world == 0, "GemmReduceScatter",
                  fmt::format("K = {} must be a positive multiple of the world size {}", k, world));
  auto s = std::make_unique<detail::ScatterReduceState>(heap, m, n, k / world, variant, options, "GemmReduceScatter", true);
  s->partial_sums.resize(static_cast<std::size_t>(m * n));
  state_ = std::move(s);
}
GemmReduceScatter::~GemmReduceScatter() = default;
GemmReduceScatter::GemmReduceScatter(GemmReduceScatter&&) noexcept = default;
void GemmReduceScatter::set_weights(const Bf16* b) {
  require_buffers("GemmReduceScatter::set_weights", {{"b", b}});
  auto& s = static_cast<detail::ScatterReduceState&>(*state_);
  if (s.weights.k() == 0) s.weights = PackedB(b, s.k_local, s.n, s.n);
  else s.weights.repack(b, s.n);
}
void GemmReduceScatter::run(const Bf16* a, Bf16* out) {
  require_buffers("GemmReduceScatter::run", {{"a", a}, {"out", out}});
  static_cast<detail::ScatterReduceState&>(*state_).run_gemm(a, out);
}

// ---------------------------------------------------------------------------------------------
// All-Scatter and GEMM + All-Scatter

namespace detail {

// Rank r's column block (M x cols_per_rank, row-major) lives in slot r of every rank's exchange;
// results are unpacked into the caller's [M, W * cols_per_rank] output.
struct AllScatterState : OpState {
  AllScatterState(SymmetricHeap heap_, std::int64_t m_, std::int64_t cols_per_rank_, std::int64_t k_,
                  OverlapVariant variant_, const OverlapOptions& options, std::string_view name_, bool with_team)
      : OpState(heap_, options, name_, with_team), m(m_), n_local(cols_per_rank_), k(k_), variant(variant_) {
    require(m >= 1 && n_local >= 1, name, fmt::format("rows ({}) and columns per rank ({}) must be at least 1", m, n_local));
    exchange = Exchange(*this, m, n_local, config.chunk_rows);
    tiles_n = ceil_div(n_local, config.tile_cols);
    computed = Counters(*this, static_cast<std::size_t>(exchange.chunks.count), tiles_n);
  }
  void send_chunk(std::int64_t c, const Bf16* src, int first_step = 1, int stride = 1) {
    for (int step = first_step; step < world; step += stride) {
      const int dest = (rank + step) % world;
      wait_entered(dest);
      exchange.send(*this, dest, c, src);
    }
  }
  void send_all(bool wait_computed, int first = 0, int stride = 1) {
    for (std::int64_t c = first; c < exchange.chunks.count; c += stride) {
      if (wait_computed) computed.wait(*this, static_cast<std::size_t>(c));
      send_chunk(c, exchange.chunk(*this, rank, c));
    }
  }
  // Unit u: slot (rank - step) in arrival order, chunk c: wait for it, copy it into `out`.
  void unpack_all(Bf16* out, bool wait_computed) {
    const std::int64_t ld = n_local * world;
    unpack_work.drain(world * exchange.chunks.count, [&](std::int64_t u) {
      const int from = static_cast<int>((rank - u / exchange.chunks.count + world) % world);
      const std::int64_t c = u % exchange.chunks.count;
      if (from != rank) exchange.wait(*this, from, c);
      else if (wait_computed) computed.wait(*this, static_cast<std::size_t>(c));
      copy_block(exchange.chunk(*this, from, c), n_local, out + exchange.chunks.first(c) * ld + from * n_local, ld,
                 exchange.chunks.size(c), n_local);
    });
  }
  void compute(std::int64_t u, const Bf16* a) {
    const std::int64_t c = u / tiles_n, tile = u % tiles_n;
    const std::int64_t col0 = tile * config.tile_cols;
    Bf16* own = exchange.chunk(*this, rank, c);
    gemm_tile(a + exchange.chunks.first(c) * k, k, weights, exchange.chunks.size(c), col0,
              std::min(config.tile_cols, n_local - col0), own + col0, n_local);
    const bool chunk_done = computed.add(*this, static_cast<std::size_t>(c));
    if (variant == OverlapVariant::fused_sequential && chunk_done) send_chunk(c, own);
  }

  void run_gemm(const Bf16* a, Bf16* out) {
    if (weights.k() == 0) throw Error(Errc::invalid_argument, "GemmAllScatter::run: set_weights() first");
    begin();
    work.reset();
    unpack_work.reset();
    const std::int64_t count = exchange.chunks.count * tiles_n;
    auto gemm = [&] { work.drain(count, [&](std::int64_t u) { compute(u, a); }); };
    switch (variant) {
      case OverlapVariant::bulk_synchronous:
        team->run(config.threads, [&](int) { gemm(); });
        send_all(false);
        team->run(config.threads, [&](int) { unpack_all(out, false); });
        break;
      case OverlapVariant::producer_consumer:
        team->run(config.threads + 1, [&](int member) {
          if (member == config.threads) send_all(true);
          else gemm();
          unpack_all(out, true);
        });
        break;
      case OverlapVariant::fused_sequential:
        team->run(config.threads, [&](int) {
          gemm();
          unpack_all(out, true);
        });
        break;
      case OverlapVariant::workgroup_specialized: {
        const int comm = config.comm_threads;
        team->run(team_size(*this, variant), [&](int member) {
          if (member < comm) send_all(true, member, comm);
          else gemm();
          unpack_all(out, true);
        });
        break;
      }
    }
  }

  std::int64_t m, n_local, k, tiles_n = 1;
  OverlapVariant variant;
  Exchange exchange;
  Counters computed;
  PackedB weights;
  WorkQueue work, unpack_work;
};

}  // namespace detail

AllScatter::AllScatter(SymmetricHeap heap, std::int64_t rows, std::int64_t cols_per_rank, const OverlapOptions& options)
    : state_(std::make_unique<detail::AllScatterState>(heap, rows, cols_per_rank, 0, OverlapVariant::bulk_synchronous,
                                                       options, "AllScatter", false)) {}
AllScatter::~AllScatter() = default;
AllScatter::AllScatter(AllScatter&&) noexcept = default;
void AllScatter::run(const Bf16* mine, Bf16* out) {
  require_buffers("AllScatter::run", {{"mine", mine}, {"out", out}});
  auto& s = static_cast<detail::AllScatterState&>(*state_);
  s.begin();
  s.unpack_work.reset();
  for (std::int64_t c = 0; c < s.exchange.chunks.count; ++c) s.send_chunk(c, mine + s.exchange.chunks.first(c) * s.n_local);
  // The own block goes straight from the input (its slot is not used).
  detail::copy_block(mine, s.n_local, out + s.rank * s.n_local, s.n_local * s.world, s.m, s.n_local);
  const std::int64_t ld = s.n_local * s.world;
  for (int step = 1; step < s.world; ++step) {
    const int from = (s.rank - step + s.world) % s.world;
    for (std::int64_t c = 0; c < s.exchange.chunks.count; ++c) {
      s.exchange.wait(s, from, c);
      detail::copy_block(s.exchange.chunk(s, from, c), s.n_local, out + s.exchange.chunks.first(c) * ld + from * s.n_local,
                         ld, s.exchange.chunks.size(c), s.n_local);
    }
  }
}

GemmAllScatter::GemmAllScatter(SymmetricHeap heap, std::int64_t m, std::int64_t n, std::int64_t k, OverlapVariant variant,
                               const OverlapOptions& options) {
  const int world = Runtime::current().world_size();
  detail::require(n >= 1 && n % world == 0, "GemmAllScatter",
                  fmt::format("N = {} must be a positive multiple of the world size {}", n, world));
  detail::require(k >= 1, "GemmAllScatter", fmt::format("K = {} must be at least 1", k));
  state_ = std::make_unique<detail::AllScatterState>(heap, m, n / world, k, variant, options, "GemmAllScatter", true);
}
GemmAllScatter::~GemmAllScatter() = default;
GemmAllScatter::GemmAllScatter(GemmAllScatter&&) noexcept = default;
void GemmAllScatter::set_weights(const Bf16* b) {
  require_buffers("GemmAllScatter::set_weights", {{"b", b}});
  auto& s = static_cast<detail::AllScatterState&>(*state_);
  if (s.weights.k() == 0) s.weights = PackedB(b, s.k, s.n_local, s.n_local);
  else s.weights.repack(b, s.n_local);
}
void GemmAllScatter::run(const Bf16* a, Bf16* out) {
  require_buffers("GemmAllScatter::run", {{"a", a}, {"out", out}});
  static_cast<detail::AllScatterState&>(*state_).run_gemm(a, out);
}

// ---------------------------------------------------------------------------------------------
// Low-latency AllGather

namespace detail {

// Words are (epoch & 0xffffffff) << 32 | 4 data bytes. Buffer: 2 launches x W ranks x `words`.
struct LowLatencyState : OpState {
  LowLatencyState(SymmetricHeap heap_, std::size_t bytes_, const OverlapOptions& options)
      : OpState(heap_, options, "LowLatencyAllGather", false), bytes(bytes_), words((bytes_ + 3) / 4) {
    require(bytes >= 1, name, "bytes per rank must be at least 1");
    // Past this the sizes below would wrap (the symmetric heap holds far less anyway).
    require(bytes <= (std::uint64_t{1} << 40), name, fmt::format("{} bytes per rank: at most 2^40", bytes));
    buffer = heap.allocate(2 * static_cast<std::uint64_t>(world) * words * 8, 64);
    packed.resize(words);
  }
  std::uint64_t offset(std::uint64_t launch, int from) const {
    return ((launch % 2) * static_cast<std::uint64_t>(world) + static_cast<std::uint64_t>(from)) * words * 8;
  }

  void run(const void* mine, void* out) {
    ++epoch;  // no entry announcement: see the class comment in overlap.h
    const std::uint64_t flag = (epoch & 0xffffffffu) << 32;
    const auto* in = static_cast<const unsigned char*>(mine);
    const std::size_t full = bytes / 4;  // words with 4 data bytes (the last may carry fewer)
    for (std::size_t w = 0; w < full; ++w) {
      std::uint32_t data;
      std::memcpy(&data, in + 4 * w, 4);
      packed[w] = flag | data;
    }
    if (full < words) {
      std::uint32_t data = 0;
      std::memcpy(&data, in + 4 * full, bytes - 4 * full);
      packed[full] = flag | data;
    }
    for (int step = 1; step < world; ++step) {
      const int dest = (rank + step) % world;
      if (std::byte* peer = heap.peer(buffer, dest)) {
        // Same node: each word is one 8-byte atomic store, so a reader never sees a flag
        // without its data. Relaxed suffices: the data travels inside the flagged word.
        auto* target = reinterpret_cast<std::uint64_t*>(peer + offset(epoch, rank));
        for (std::size_t w = 0; w < words; ++w) std::atomic_ref<std::uint64_t>(target[w]).store(packed[w], std::memory_order_relaxed);
      } else {
        // Other node: one put; the NIC (or UCX's emulation) writes aligned 8-byte words whole.
        heap.put(buffer, offset(epoch, rank), packed.data(), words * 8, dest);
      }
    }
    auto* result = static_cast<unsigned char*>(out);
    std::memcpy(result + static_cast<std::size_t>(rank) * bytes, mine, bytes);
    const auto deadline = caravan::detail::deadline_after<Clock>(config.timeout);
    for (int step = 1; step < world; ++step) {
      const int from = (rank - step + world) % world;
      auto* source = reinterpret_cast<std::uint64_t*>(heap.local(buffer) + offset(epoch, from));
      unsigned char* dst = result + static_cast<std::size_t>(from) * bytes;
      for (std::size_t w = 0; w < words; ++w) {
        std::uint64_t word = std::atomic_ref<std::uint64_t>(source[w]).load(std::memory_order_relaxed);
        for (unsigned spin = 0; (word & 0xffffffff00000000ull) != flag; ++spin) {
          cpu_relax();
          if (spin % 4096 == 4095) {
            if (Clock::now() > deadline)
              throw Error(Errc::timeout, fmt::format("LowLatencyAllGather (rank {}, launch {}): word {} from rank {} still "
                                                     "carries flag {} (CARAVAN_OVERLAP_TIMEOUT_S)",
                                                     rank, epoch, w, from, word >> 32));
            std::this_thread::yield();
          }
          word = std::atomic_ref<std::uint64_t>(source[w]).load(std::memory_order_relaxed);
        }
        const auto data = static_cast<std::uint32_t>(word);
        if (w < full) std::memcpy(dst + 4 * w, &data, 4);
        else std::memcpy(dst + 4 * w, &data, bytes - 4 * w);
      }
    }
  }

  std::size_t bytes, words;
  SymmetricRegion buffer;
  std::vector<std::uint64_t> packed;
};

}  // namespace detail

LowLatencyAllGather::LowLatencyAllGather(SymmetricHeap heap, std::size_t bytes_per_rank, const OverlapOptions& options)
    : state_(std::make_unique<detail::LowLatencyState>(heap, bytes_per_rank, options)) {}
LowLatencyAllGather::~LowLatencyAllGather() = default;
LowLatencyAllGather::LowLatencyAllGather(LowLatencyAllGather&&) noexcept = default;
void LowLatencyAllGather::run(const void* mine, void* out) {
  require_buffers("LowLatencyAllGather::run", {{"mine", mine}, {"out", out}});
  static_cast<detail::LowLatencyState&>(*state_).run(mine, out);
}

}  // namespace caravan::kernels
