// The DMA engine (Isometry section 3): carries out planned paths.
//
//   CopyOperation   one copy or fill: its plan, tiles, intermediate buffers and XDs
//   Xd              a transfer descriptor: one hop of one copy, on one channel's worker
//   DmaWorker       one thread per channel: picks the highest-priority XD that can issue a
//                   request, keeps the channel's window full, reports completions
//   BufferPool      per memory: bounds the intermediate buffers copies may hold at once
//
// Pipelining: the instance is cut into tiles (TileGrid). Hop i may start tile t when hop i-1
// has finished it (its input slot holds it) and hop i+1 has finished tile t - slots (so its
// output slot is free again). Each intermediate buffer is a ring of `slots` tile slots.
//
// Across ranks (remote_copy.cpp): a copy whose hops run on several ranks exists on each of them
// as a CopyOperation with the same tiles and buffers. Each rank runs the XDs of its hops; the
// XDs of other ranks' hops are mirrors whose tiles_done follows that rank's messages ("tile t
// landed in your buffer", "slot s drained"), so the handshake above works unchanged.
#pragma once

#include "runtime/dma/buffer_cache.h"
#include "runtime/dma/channel.h"
#include "runtime/dma/transfer_ops.h"
#include "runtime/event_table.h"
#include "runtime/runtime_impl.h"

#include <caravan/copy.h>
#include <caravan/planner/planner.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace caravan::net {
class Network;
class RemoteMemory;
struct AmMessage;
}  // namespace caravan::net

namespace caravan {
class InstanceImpl;
}

namespace caravan::dma {

class DmaWorker;
class Engine;
struct CopyOperation;

// The engine's clock (steady), in nanoseconds: copies' timestamps and reports.
std::int64_t now_ns();

// The largest request a hop on `channel` sends (and a one-hop copy's tile), in bytes: at least
// 4 MiB, at most 256 MiB, whole MiB. GPU channels (sdma, xgmi, gpu_convert): `gpu_request_us`
// (CARAVAN_GPU_REQUEST_US) of work at their calibrated peak. Others: the smallest request that
// reaches 99% of their calibrated peak.
std::uint64_t full_speed_request_bytes(const planner::Channel& channel, std::int64_t gpu_request_us);

// Cuts a tile's ops into the requests of its hop, each at most `limit` bytes (its request size),
// and returns where each request ends in `ops` (empty: one request of all of them, which most
// tiles are). Requests take consecutive ops; a group (interleave.h: the fields of a layout
// conversion, rows at one distance) stays in one request, or is cut by row range or, when one of
// its rows is longer than `limit`, by element range, all its members side by side: each request
// then moves every field of its elements. Ops are rewritten only where a group is cut.
std::vector<std::size_t> cut_requests(std::vector<TransferOp>& ops, std::uint64_t limit);

struct Xd {
  CopyOperation* op = nullptr;
  std::size_t hop = 0;
  DmaWorker* worker = nullptr;  // null: another rank runs this hop, and this XD mirrors its progress
  std::uint64_t request_bytes = 0;
  Layout src_layout, dst_layout;

  // Guarded by worker->mutex_.
  struct ActiveTile {
    std::uint64_t index = 0;
    std::vector<TransferOp> ops;
    std::vector<std::size_t> request_ends;  // cut_requests: where each request ends (empty: one)
    std::size_t next_request = 0;
    std::size_t next_op = 0;
    std::uint64_t outstanding = 0;  // requests issued and not completed
  };
  std::uint64_t next_tile = 0;
  // The worker is cutting next_tile into ops outside its lock, or the copy's caller is cutting
  // and submitting its first requests (DmaWorker::add): no one else issues or retires it.
  bool generating = false;
  // In order; few at a time (at most the slots). A vector, not a deque: libstdc++'s deque
  // allocates two blocks as it is made, on every copy's setup path.
  std::vector<ActiveTile> active;
  // A request in flight holds a span into its tile's ops after the worker unlocks: moving tiles
  // (push_back, erase) must keep those buffers, which a noexcept move does.
  static_assert(std::is_nothrow_move_constructible_v<ActiveTile> && std::is_nothrow_move_assignable_v<ActiveTile>);
  int in_flight = 0;
  bool retired = false;
  std::uint64_t requests = 0, first_seq = 0, last_seq = 0;
  std::int64_t last_issue_ns = 0;  // when its latest request was handed to the channel

  // Tiles finished in order; read by the neighbouring XDs' workers.
  std::atomic<std::uint64_t> tiles_done{0};

  // The copy's timeline, recorded when it asked for a report (guarded by worker->mutex_; read
  // once the XD has retired). Microseconds since the copy started.
  bool record = false;
  std::vector<RequestSpan> spans;
  std::vector<double> tile_done_us;
};

class DmaWorker {
 public:
  DmaWorker(Engine& engine, std::unique_ptr<Channel> channel, std::string name);
  ~DmaWorker();
  void add(Xd* xd);
  void wake();
  void stop();
  Channel& channel() { return *channel_; }
  const std::string& name() const { return name_; }
  // What `xd` is doing or waiting for, for the stall report (e.g. "1 request in flight for 12.0 s").
  std::string describe(const Xd& xd);

 private:
  void loop();
  bool can_issue(const Xd& xd) const;
  // mutex_ held: nothing of `xd` is in flight or being cut, and it is done or cancelled.
  bool can_retire(const Xd& xd) const;
  static constexpr std::size_t kNoSpan = ~std::size_t{0};
  // A request taken from an XD, with what its completion needs.
  struct Issue {
    Request request;
    std::uint64_t tile = 0;
    std::size_t span = kNoSpan;
  };
  // Tile t of `xd` as ops of at most its request size (no lock: reads only what the copy fixed
  // before it started).
  Xd::ActiveTile cut_tile(const Xd& xd, std::uint64_t t) const;
  // mutex_ held: the next request of xd's last active tile, counted in flight.
  Issue take_request(Xd* xd);
  // mutex_ held by `lock`, xd just added: runs a small one-hop, one-tile copy on this thread
  // (Channel::inline_bytes) and retires it, returning true with the lock released. False, with
  // the lock still held and nothing done, when the copy does not qualify.
  bool run_inline(Xd* xd, std::unique_lock<std::mutex>& lock);
  // mutex_ not held: hands the request to the channel, completing through complete().
  void submit(Xd* xd, const Issue& issue);
  void complete(Xd* xd, std::uint64_t tile, std::size_t span, const FailureCause& failure);

  Engine& engine_;
  std::unique_ptr<Channel> channel_;
  std::string name_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Xd*> pool_;  // by priority (highest first), then submission order
  std::uint64_t executed_ = 0;  // requests started on this channel
  int in_flight_ = 0;
  bool stop_ = false;
  const bool submit_here_;  // the channel's submits_from_any_thread(): add() may issue directly
  // Asynchronous channels: when it has nothing to issue, the worker polls `signals_` (bumped by
  // every add, wake, completion and stop before it notifies) for up to spin_ns_ before it
  // sleeps, because waking a sleeping thread costs tens of microseconds (far more on a virtual
  // machine), and the wake-ups at a copy's first and last request add straight to its time.
  std::int64_t spin_ns_ = 0;
  std::atomic<std::uint64_t> signals_{0};
  // mutex_: the worker is in cv_.wait (not polling): add() then fills the window itself.
  bool worker_asleep_ = false;
  std::thread thread_;
};

// The cross-rank part of a copy (remote_copy.cpp). Guarded by the engine's mutex unless noted.
//
// The rank that called copy() (the initiator) owns the copy's event and coordinates: once the
// precondition has triggered it admits the participants (every rank that runs a hop or owns an
// instance of the copy) one after another in global memory order, so that buffer reservations
// across ranks are taken in one order and cannot deadlock; each admitted participant allocates
// its buffers and answers `ready` with the remote keys of the buffers other ranks put into. Then
// `go` hands every participant those keys and each starts its XDs. A participant reports `done`
// once its XDs have retired and their puts are flushed; the initiator then sends `finished`
// (buffers may be reused: no put can still land in them) and triggers the event. The first
// failure anywhere (an XD's error, a lost peer, cancel) makes the initiator send `abort`.
//
// A part that ends without that guarantee (its initiator was lost or shut down first, or this
// rank shuts down) keeps the REG buffers other ranks put into in quarantine, out of the pool,
// until each of those ranks has answered `quiesce` ("my puts into your buffers are over") or is
// gone. Every step of the protocol (admission, buffer allocation, abort, finish) runs on the
// engine's control thread, so none of them races another.
struct DistributedState {
  std::uint64_t id = 0;  // initiator rank << 48 | its sequence number
  int initiator = 0;
  std::vector<int> hop_rank;      // the rank that runs each hop (the owner of its source memory)
  std::vector<int> participants;  // in global memory order (node, rank)
  // Where `rank` is in participants (and peers); participants.size() when it takes no part.
  std::size_t index_of(int rank) const {
    return static_cast<std::size_t>(std::find(participants.begin(), participants.end(), rank) - participants.begin());
  }
  std::vector<planner::Hop> hops;
  std::uint64_t tile_points = 0;
  // The initiator's view of each participant.
  enum class Peer : std::uint8_t { waiting, setup_sent, ready, done };
  std::vector<Peer> peers;
  std::size_t next = 0;  // the participant being admitted
  bool aborted = false;
  std::vector<std::byte> setup;  // the setup message's body
  // Per hop: the remote key of the hop's output (buffer or destination) where another rank owns it.
  std::vector<std::vector<std::byte>> targets;
  // This rank's part.
  bool started = false;       // `go` seen: XDs added (or none to add)
  bool segment_done = false;  // its XDs retired and their puts flushed
  bool orphaned = false;      // the initiator is lost: finish without `finished`
  // Every rank of the copy was done (their puts flushed) when this rank's part finished: the
  // initiator saw every `done`; a participant got `finished` saying so. Else its buffers that
  // other ranks put into go into quarantine rather than back to the pool.
  bool clean = false;
  std::vector<int> quiesce_waiters;  // ranks to answer `quiesced` once segment_done
  std::atomic<int> flushes{0};
  std::shared_ptr<InstanceImpl> src_impl, dst_impl;  // a participant's own instances, kept alive
};

struct CopyOperation {
  Engine* engine = nullptr;
  Event done;
  int priority = 0;
  std::uint64_t sequence = 0;
  CopyReport* report = nullptr;
  // CopyOptions::signal (checked): the last hop's request that completes tile t writes
  // signal_value to signal_flags[t].
  std::uint64_t* signal_flags = nullptr;
  std::uint64_t signal_value = 0;
  // The path, for reports and messages. Kept as its steps and rendered only when asked for:
  // building the text on every copy was a measurable part of a small copy's setup.
  MemoryId route_src;
  std::vector<std::pair<ChannelKind, MemoryId>> route_steps;  // each hop's channel and destination
  std::string route_text;  // used instead when set (fills)
  std::string route() const;
  void set_route(const std::vector<planner::Hop>& hops);
  double predicted_gbps = 0;

  Instance src_instance, dst_instance;     // kept alive while the copy runs
  std::shared_ptr<Storage> src_storage, dst_storage;
  std::shared_ptr<Storage> pattern;        // fill: the value of one point
  IndexSpace space;
  FieldSpace fields;
  std::optional<View> src_view, dst_view;  // the whole instances (hop 0 input, last hop output)
  TileGrid grid;
  int slots = 2;

  struct BufferSpec {
    MemoryId memory;
    Layout layout;
    std::uint64_t slot_bytes = 0;
    std::shared_ptr<Storage> storage;
  };
  std::vector<BufferSpec> buffers;  // between hop i and i+1
  std::vector<std::unique_ptr<Xd>> xds;

  // Engine state, guarded by the engine's mutex.
  enum class State { waiting_precondition, waiting_buffers, running, finished } state = State::waiting_precondition;
  std::size_t reservations_held = 0;  // entries of reservation_order taken from their pools
  std::vector<std::pair<MemoryId, std::uint64_t>> reservation_order;  // global memory order

  std::atomic<bool> cancelled{false};
  std::mutex failure_mutex;
  FailureCause failure;  // the first failure
  std::atomic<int> live_xds{0};
  std::atomic<std::int64_t> last_progress_ns{0};
  std::int64_t called_ns = 0;   // when copy() or fill() was called
  std::int64_t started_ns = 0;  // when its XDs were handed to their workers (set before that)
  std::int64_t finished_ns = 0; // when its last XD retired (finish(), before the event triggers)
  std::int64_t last_warned_ns = 0;

  std::unique_ptr<DistributedState> dist;  // null: every hop and instance on this rank
  // A path of a multi-path copy: "path 2 of 4 of copy <event>" (for stall reports); else empty.
  std::string part_of;

  void fail(const FailureCause& cause);
  void touch();
};

// A copy split over several paths at once (PlannerChoice::multipath). Each path moves one slab
// of the index space (PathShare::piece) as a copy of its own, a *part*: a CopyOperation with its
// own internal event, plan, tiles, buffers and XDs, run by the usual machinery (pools, priorities,
// cancellation, stall reports, timelines). The user holds `done`, which triggers once every
// part's event has, poisoned with the first part's failure; that failure stops the other parts
// with the same cause, and cancel(done) stops them all.
struct MultiCopy {
  Engine* engine = nullptr;
  Event done;
  CopyReport* report = nullptr;  // the caller's; filled in from part_reports before done triggers
  std::int64_t called_ns = 0;
  std::string route;             // "N paths: A | B | ..."
  double predicted_gbps = 0;
  std::uint64_t bytes = 0;
  std::vector<planner::PathShare> shares;  // each part's plan, piece, bytes and rate
  std::vector<std::shared_ptr<CopyOperation>> parts;
  std::vector<CopyReport> part_reports;    // sized once, before any part runs
  // The plan's key in the engine's learned rates (copies that learn from their paths' measured
  // rates, CARAVAN_DMA_MULTIPATH_LEARN); empty: this copy does not.
  std::string learn_key;

  std::mutex mutex;                // guards the fields below
  std::vector<Event> part_events;  // of the parts submitted so far
  std::size_t remaining = 0;       // parts whose event has not triggered (or that were never submitted)
  FailureCause failure;            // the first failure (or the cancel / shutdown cause)
};

struct EngineStats {
  std::size_t active_copies = 0;
  std::map<MemoryId, std::uint64_t> pool_in_use;  // bytes reserved for intermediate buffers
  std::map<MemoryId, std::uint64_t> idle_buffers; // bytes of finished copies' buffers kept for reuse
  // Cross-rank copies: bytes of REG buffers that another rank may still put into (a part that
  // did not end cleanly), kept out of the pool until that rank's puts are over.
  std::map<MemoryId, std::uint64_t> quarantined_buffers;
  std::size_t remote_keys = 0;  // imported remote keys cached for nic hops
  std::size_t gpu_mappings = 0; // other ranks' GPU memory mapped for xgmi/sdma hops (IPC), cached
  // Multi-path copies whose event has not triggered; their parts count in active_copies.
  std::size_t multipath_copies = 0;
};

// The per-hop timeline of a finished copy that recorded one (CopyReport::timeline).
std::vector<HopTimeline> hop_timelines(const CopyOperation& op);
// The public description of a copy's tiles (CopyTiling): each tile's rectangle and its range of
// points in the order that runs dimension 0 fastest.
CopyTiling describe_tiling(const TileGrid& grid, const Rect& space);

class Engine final : public RuntimeService {
 public:
  explicit Engine(RuntimeImpl& runtime);
  ~Engine() override;

  // The engine of the running runtime (created on first use).
  static Engine& current();

  Event copy(const Instance& src, const Instance& dst, const CopyOptions& options);
  Event fill(const Instance& dst, std::span<const std::byte> value, const CopyOptions& options);
  bool cancel(Event copy_event);
  // Stops a copy with `cause` (cancel() uses Errc::cancelled, shutdown Errc::shut_down).
  bool stop_copy(Event copy_event, const FailureCause& cause);
  // `region`: the points copied (CopyOptions::region); none, the whole space.
  std::shared_ptr<const planner::Plan> plan(const Instance& src, const Instance& dst, PlannerChoice choice,
                                            const std::optional<Rect>& region = std::nullopt);
  // The multi-path plan of copying src to dst (plan_copy_multipath).
  std::shared_ptr<const planner::MultiPlan> plan_multipath(const Instance& src, const Instance& dst,
                                                           const std::optional<Rect>& region = std::nullopt);
  // The checks and planning copy(src, dst, options) makes before it starts anything (for
  // add_copy, which must refuse at add time what every launch would refuse).
  void check_copy(const Instance& src, const Instance& dst, const CopyOptions& options);
  // The tiles copy(src, dst) with `choice` is cut into (copy_tiling).
  CopyTiling tiling(const Instance& src, const Instance& dst, PlannerChoice choice,
                    const std::optional<Rect>& region = std::nullopt);
  void shutdown() override;

  // Sets CARAVAN_DMA_MULTIPATH_LEARN for this engine from now on (`caravan bench gpu` compares
  // the planner's cut with the learned one in one run); 0 also stops cutting by learned rates.
  void set_multipath_learn(double weight);
  // Test seam: runs the transfer-graph channel named `worker_name` (as in stall reports, e.g.
  // "memcpy node0/rank0/sys->node0/rank0/sys") on `channel` from now on, with a new worker.
  // Tests use it to make a channel hang. Only while no copy is active: Error(invalid_argument)
  // otherwise, and Error(not_found) for an unknown name.
  void replace_channel_for_testing(const std::string& worker_name, std::unique_ptr<Channel> channel);
  // Test seam: plans and runs copies on `machine` from now on instead of the live machine (a new
  // transfer graph, planner, buffer pools, and a worker per channel the engine can implement
  // here: memcpy and file channels between this rank's host memories and dsk, GPU channels as
  // on the live machine). Tests use it to get several paths on a CPU host, e.g. relays through
  // extra host memories (sys1, reg...). Only while no copy is active (Error(invalid_argument)).
  void replace_machine_for_testing(const planner::MachineDescription& machine);

  EngineStats stats();
  // Instances of other ranks (remote_copy.cpp): what Instance::descriptor and from_descriptor do.
  std::vector<std::byte> export_instance(const std::shared_ptr<InstanceImpl>& impl);
  std::shared_ptr<InstanceImpl> import_instance(std::span<const std::byte> descriptor);
  // Storage for a buffer in `memory`: REG memory in a job is registered with UCX (from a cache of
  // registrations: registering costs far more than copying a tile), the rest as allocate_storage().
  std::shared_ptr<Storage> allocate_buffer(MemoryId memory, std::uint64_t bytes);
  // Storage for an instance (`attach`: the caller's bytes); REG memory in a job is registered.
  std::shared_ptr<Storage> allocate_instance_storage(MemoryId memory, std::uint64_t bytes, void* attach = nullptr);
  void release_buffer(std::shared_ptr<Storage> storage);
  const planner::TransferGraph& graph() const { return *graph_; }
  detail::EventTable& events() { return runtime_.events(); }
  std::uint16_t rank() const { return static_cast<std::uint16_t>(runtime_.rank()); }

  // Called when a copy's precondition triggers, and by workers.
  void on_precondition(const std::shared_ptr<CopyOperation>& op, const FailureCause& failure);
  // A part of a multi-path copy has triggered its event (with its failure, or null).
  void multipath_part_done(const std::shared_ptr<MultiCopy>& multi, const FailureCause& failure);
  void xd_retired(CopyOperation* op);
  void tile_finished(Xd* xd);
  int my_rank() const { return runtime_.rank(); }

 private:
  friend class DmaWorker;
  struct BufferPool {
    std::uint64_t capacity = 0;
    std::uint64_t used = 0;
    std::deque<std::shared_ptr<CopyOperation>> waiters;
  };

  // Checks a copy's instances (and its region: inside both spaces; without one the spaces must
  // be equal) and describes it to the planner; the request's space is the points copied.
  planner::TransferRequest make_request(const Instance& src, const Instance& dst,
                                        const std::optional<Rect>& region = std::nullopt) const;
  // One DmaWorker per channel of `graph` that has an implementation on this rank (null otherwise).
  std::vector<std::unique_ptr<DmaWorker>> make_workers(const planner::TransferGraph& graph);
  // A copy of `piece` (the whole space, or a slab of a multi-path copy) along `plan`, prepared
  // (tiles, buffers, XDs) and checked, not yet submitted.
  std::shared_ptr<CopyOperation> prepare_copy(const Instance& src, const Instance& dst, const planner::Plan& plan,
                                              const Rect& piece, const CopyOptions& options, std::int64_t called_ns);
  // Whether copy(src, dst, options) runs as a multi-path copy: asked for, or automatic from
  // CARAVAN_DMA_MULTIPATH_MIN_BYTES. Throws for an explicit request it cannot honour (across ranks).
  bool wants_multipath(const Instance& src, const Instance& dst, const CopyOptions& options) const;
  // The points a copy moves: its region, or the whole space.
  static const Rect& copied_space(const Instance& src, const CopyOptions& options) {
    return options.region ? *options.region : src.space();
  }
  // The multi-path plan copy() runs (plan_multipath, less any slab that rounded to no row), so
  // that copy() and copy_tiling() cut the copy into the same parts. `key`, if given: set to the
  // plan's key (multipath_key).
  planner::MultiPlan runnable_multipath_plan(const Instance& src, const Instance& dst, std::string* key = nullptr,
                                             const std::optional<Rect>& region = std::nullopt);
  // plan_multipath, also setting `key` to the plan's key among the cached plans.
  std::shared_ptr<const planner::MultiPlan> plan_multipath(const Instance& src, const Instance& dst, std::string& key,
                                                           const std::optional<Rect>& region = std::nullopt);
  // The key of src -> dst among the cached multi-path plans and the learned rates.
  static std::string multipath_key(const planner::TransferRequest& request);
  // Cuts `plan` (the runnable plan of `key`) again by the rates its paths were measured at in
  // earlier copies, where there are any.
  void spread_by_learned_rates(planner::MultiPlan& plan, const std::string& key, const Rect& space);
  // A multi-path copy finished without failure: blends each path's measured rate (its bytes over
  // the time from the copy's first start to the path's end) into the learned rates of its plan.
  void learn_path_rates(const MultiCopy& multi);
  Event copy_multipath(const Instance& src, const Instance& dst, const planner::MultiPlan& plan, const CopyOptions& options,
                       std::int64_t called_ns, std::string learn_key = {});
  bool stop_multipath(const std::shared_ptr<MultiCopy>& multi, const FailureCause& cause);
  void finish_multipath(const std::shared_ptr<MultiCopy>& multi);
  void check_common(const Instance& inst, const char* what) const;
  Event submit(std::shared_ptr<CopyOperation> op, Event precondition);
  void prepare_pipeline(CopyOperation& op, const std::vector<planner::Hop>& hops);
  // Points per tile for a copy of `space` along `hops`, and each intermediate buffer's slot size.
  std::uint64_t choose_tile_points(const Rect& space, const FieldSpace& fields, const std::vector<planner::Hop>& hops,
                                   std::vector<std::uint64_t>& slot_bytes) const;
  // CopyOptions::signal against the prepared copy (its tiles, its last hop's channel, where the
  // flags live); sets op.signal_*. Throws Error(invalid_argument) naming the rule.
  void check_signal(CopyOperation& op, const TileSignal& signal) const;
  // Tiles, buffers and XDs from sizes already chosen (by this rank, or by the initiator of a
  // cross-rank copy): XDs of hops that `runs_here` get this rank's workers.
  void build_pipeline(CopyOperation& op, const std::vector<planner::Hop>& hops, std::uint64_t tile_points,
                      const std::vector<std::uint64_t>& slot_bytes, const std::vector<std::uint64_t>& request_bytes,
                      const std::function<bool(std::size_t hop)>& runs_here);
  std::uint32_t channel_between(MemoryId src, MemoryId dst, ChannelKind kind) const;
  void admit(const std::shared_ptr<CopyOperation>& op);  // engine mutex held
  void start(const std::shared_ptr<CopyOperation>& op);
  void release_reservations(CopyOperation& op, std::vector<std::shared_ptr<CopyOperation>>& retry);  // mutex held
  void finish(const std::shared_ptr<CopyOperation>& op);
  void watchdog_main();
  DmaWorker& worker_for(std::uint32_t graph_channel);

  // Cross-rank copies (remote_copy.cpp).
  void dist_init();
  void dist_shutdown();
  void dist_close();
  void dist_finish_local(const std::shared_ptr<CopyOperation>& op);
  void dist_readmit(std::vector<std::shared_ptr<CopyOperation>>& retry);
  void dist_prepare(CopyOperation& op);
  void dist_begin(const std::shared_ptr<CopyOperation>& op);
  void dist_admitted(const std::shared_ptr<CopyOperation>& op);
  void dist_advance(const std::shared_ptr<CopyOperation>& op);
  void dist_go(const std::shared_ptr<CopyOperation>& op);
  void dist_segment_retired(const std::shared_ptr<CopyOperation>& op);
  void dist_segment_done(const std::shared_ptr<CopyOperation>& op);
  void dist_peer_lost_for(const std::shared_ptr<CopyOperation>& op, int rank, const FailureCause& cause);
  void dist_check_complete(const std::shared_ptr<CopyOperation>& op);
  void dist_fail(const std::shared_ptr<CopyOperation>& op, const FailureCause& cause);
  void dist_abort_here(const std::shared_ptr<CopyOperation>& op, const FailureCause& cause);
  void dist_tile_progress(Xd* xd);
  void dist_peer_lost(int rank, const FailureCause& cause);
  void dist_hold_buffers(CopyOperation& op);
  void dist_release_quarantined(std::uint64_t id, int writer);  // writer -1: any rank no longer alive
  // What `ready` announces for an output of this rank that another rank's hop writes, and how
  // that rank turns it into the storage its channel writes into.
  std::vector<std::byte> export_target(const Storage* storage, const planner::Hop& hop, int writer) const;
  // A copy whose hops all run on this rank and whose destination is another rank's GPU memory
  // on this node, with an IPC target in its descriptor: it runs as a copy of this rank, writing
  // the destination mapped, with no set-up exchange (CARAVAN_DMA_IPC_DIRECT, read at each copy).
  bool writes_peer_gpu_directly(const Instance& src, const Instance& dst, const planner::Plan& plan) const;
  std::shared_ptr<Storage> map_target(MemoryId memory, const planner::Hop& hop, std::span<const std::byte> target,
                                      std::uint64_t buffer_bytes);
  std::shared_ptr<CopyOperation> dist_find(std::uint64_t id);
  void on_setup(int source, const std::vector<std::byte>& body);
  void on_ready(int source, const std::vector<std::byte>& body);
  void on_go(int source, const std::vector<std::byte>& body);
  void on_tiles(int source, std::span<const std::byte> body);
  void on_done(int source, const std::vector<std::byte>& body);
  void on_abort(int source, const std::vector<std::byte>& body);
  void on_finished(int source, const std::vector<std::byte>& body);
  void on_quiesce(int source, const std::vector<std::byte>& body);
  void on_quiesced(int source, const std::vector<std::byte>& body);
  void send(int rank, std::uint16_t id, std::span<const std::byte> body);
  void post_control(std::function<void()> work);
  void control_main();

  RuntimeImpl& runtime_;
  std::shared_ptr<const planner::TransferGraph> graph_;
  std::unique_ptr<planner::Planner> planner_;
  std::vector<std::unique_ptr<DmaWorker>> workers_;  // by graph channel index (null: no implementation)
  std::mutex mutex_;
  std::condition_variable idle_cv_;
  std::map<MemoryId, BufferPool> pools_;
  std::unordered_map<Event, std::shared_ptr<CopyOperation>> active_;
  std::unordered_map<Event, std::shared_ptr<MultiCopy>> multi_;  // multi-path copies, by the user's event
  // Multi-path plans by request (planning one solves several paths: tens of microseconds on a
  // 4-GPU machine, repeated for every copy of the same instances otherwise). At most
  // CARAVAN_PLANNER_CACHE_ENTRIES, emptied when full.
  std::mutex multiplan_mutex_;
  std::map<std::string, std::shared_ptr<const planner::MultiPlan>> multiplans_;
  // Per multi-path plan (its key), the rate of each of its runnable paths as measured in the copies
  // that ran it, blended with weight multipath_learn_ per copy (CARAVAN_DMA_MULTIPATH_LEARN); the
  // next copies without landing flags are cut by them. Guarded by multiplan_mutex_.
  std::map<std::string, std::vector<double>> learned_rates_;
  std::atomic<double> multipath_learn_{0};
  std::uint64_t next_sequence_ = 0;
  bool stopping_ = false;
  // finish() calls between taking a copy out of active_ and their last use of the engine (mutex_).
  // They run on the DMA workers, the control thread, the GPU queues' completion threads and
  // threads waiting for events (runtime/progress.h); shutdown waits for them, since it joins only
  // the first two.
  int finishing_ = 0;
  std::thread watchdog_;
  std::condition_variable watchdog_cv_;
  std::uint64_t request_floor_bytes_, tile_bytes_, pool_bytes_, multipath_min_bytes_;
  std::int64_t stall_ns_;
  std::int64_t gpu_request_us_;  // read once: a settings lookup costs about 0.4 us on the GPU hosts
  int slots_;

  // Cross-rank copies (remote_copy.cpp).
  net::Network* network_ = nullptr;
  struct Hook;                // how UCX handlers and listeners reach the engine while it lives
  std::shared_ptr<Hook> hook_;
  std::uint64_t nonce_ = 0;   // tells this engine's instance descriptors from an earlier runtime's
  std::mutex exports_mutex_;
  std::uint64_t next_export_ = 0;
  std::unordered_map<std::uint64_t, std::weak_ptr<InstanceImpl>> exports_;
  std::mutex dist_mutex_;     // guards dist_ops_ (looked up on the progress thread)
  std::unordered_map<std::uint64_t, std::shared_ptr<CopyOperation>> dist_ops_;
  std::multimap<std::uint64_t, std::shared_ptr<Storage>> idle_registered_;  // guarded by mutex_
  std::uint64_t idle_registered_bytes_ = 0;
  // REG buffers of parts that did not end cleanly, by copy id, with the ranks that may still put
  // into them (guarded by mutex_). Released to the pool when those have answered `quiesce` or
  // are gone; at shutdown they are left to the network, which unregisters them after its peers
  // have said bye (the Storage objects go with the engine).
  struct Quarantined {
    std::vector<std::shared_ptr<Storage>> storages;
    std::set<int> writers;
  };
  std::map<std::uint64_t, Quarantined> quarantine_;
  // Remote keys imported for nic hops, by (rank, descriptor), guarded by mutex_. Unpacking one
  // maps the far side's memory (shared-memory transports) and every page of it faults in again
  // after a new import, so copies into the same buffers and instances reuse them. A descriptor
  // names one registration (it carries the registration's serial, net::RegisteredMemory), so a
  // key is never reused for memory registered again at the same address.
  std::map<std::pair<int, std::vector<std::byte>>, std::shared_ptr<net::RemoteMemory>> remote_keys_;
  // Other ranks' GPU memory mapped into this process (IPC) for hops that write it, by (rank,
  // the owner's allocation serial: Storage::serial), guarded by mutex_. Mapping one costs a
  // driver call and a page-table set-up, so copies into the same buffers reuse it; a serial names
  // one allocation, so a mapping is never taken for a later allocation at the same address.
  std::map<std::pair<int, std::uint64_t>, std::shared_ptr<std::byte>> gpu_mappings_;
  // Coordination messages and peer losses are handled on this thread, off the progress thread:
  // they allocate and register memory and trigger events, which may run user callbacks.
  std::mutex control_mutex_;
  std::condition_variable control_cv_;
  std::deque<std::function<void()>> control_queue_;
  bool control_stop_ = false;
  std::thread control_;
  BufferCache buffer_cache_;  // host buffers of finished copies, for reuse
};

}  // namespace caravan::dma
