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
#pragma once

#include "runtime/dma/channel.h"
#include "runtime/dma/transfer_ops.h"
#include "runtime/event_table.h"
#include "runtime/runtime_impl.h"

#include <caravan/copy.h>
#include <caravan/planner/planner.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace caravan::dma {

class DmaWorker;
class Engine;
struct CopyOperation;

struct Xd {
  CopyOperation* op = nullptr;
  std::size_t hop = 0;
  DmaWorker* worker = nullptr;
  std::uint64_t request_bytes = 0;
  Layout src_layout, dst_layout;

  // Guarded by worker->mutex_.
  struct ActiveTile {
    std::uint64_t index = 0;
    std::vector<TransferOp> ops;  // each at most request_bytes
    std::size_t next_op = 0;
    std::uint64_t outstanding = 0;  // requests issued and not completed
  };
  std::uint64_t next_tile = 0;
  bool generating = false;  // the worker is cutting next_tile into ops, outside its lock
  std::deque<ActiveTile> active;
  int in_flight = 0;
  bool retired = false;
  std::uint64_t requests = 0, first_seq = 0, last_seq = 0;

  // Tiles finished in order; read by the neighbouring XDs' workers.
  std::atomic<std::uint64_t> tiles_done{0};
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

 private:
  void loop();
  bool can_issue(const Xd& xd) const;
  void complete(Xd* xd, std::uint64_t tile, const FailureCause& failure);

  Engine& engine_;
  std::unique_ptr<Channel> channel_;
  std::string name_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Xd*> pool_;  // by priority (highest first), then submission order
  std::uint64_t executed_ = 0;  // requests started on this channel
  int in_flight_ = 0;
  bool stop_ = false;
  // Asynchronous channels: when it has nothing to issue, the worker polls `signals_` (bumped by
  // every add, wake, completion and stop before it notifies) for up to spin_ns_ before it
  // sleeps, because waking a sleeping thread costs tens of microseconds (far more on a virtual
  // machine), and the wake-ups at a copy's first and last request add straight to its time.
  std::int64_t spin_ns_ = 0;
  std::atomic<std::uint64_t> signals_{0};
  std::thread thread_;
};

struct CopyOperation {
  Engine* engine = nullptr;
  Event done;
  int priority = 0;
  std::uint64_t sequence = 0;
  CopyReport* report = nullptr;
  std::string route;
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
  std::int64_t last_warned_ns = 0;

  void fail(const FailureCause& cause);
  void touch();
};

struct EngineStats {
  std::size_t active_copies = 0;
  std::map<MemoryId, std::uint64_t> pool_in_use;  // bytes reserved for intermediate buffers
};

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
  std::shared_ptr<const planner::Plan> plan(const Instance& src, const Instance& dst, PlannerChoice choice);
  void shutdown() override;

  EngineStats stats();
  const planner::TransferGraph& graph() const { return *graph_; }
  detail::EventTable& events() { return runtime_.events(); }
  std::uint16_t rank() const { return static_cast<std::uint16_t>(runtime_.rank()); }

  // Called when a copy's precondition triggers, and by workers.
  void on_precondition(const std::shared_ptr<CopyOperation>& op, const FailureCause& failure);
  void xd_retired(CopyOperation* op);
  void tile_finished(Xd* xd);

 private:
  friend class DmaWorker;
  struct BufferPool {
    std::uint64_t capacity = 0;
    std::uint64_t used = 0;
    std::deque<std::shared_ptr<CopyOperation>> waiters;
  };

  planner::TransferRequest make_request(const Instance& src, const Instance& dst) const;
  void check_common(const Instance& inst, const char* what) const;
  Event submit(std::shared_ptr<CopyOperation> op, Event precondition);
  void prepare_pipeline(CopyOperation& op, const std::vector<planner::Hop>& hops);
  void admit(const std::shared_ptr<CopyOperation>& op);  // engine mutex held
  void start(const std::shared_ptr<CopyOperation>& op);
  void release_reservations(CopyOperation& op, std::vector<std::shared_ptr<CopyOperation>>& retry);  // mutex held
  void finish(const std::shared_ptr<CopyOperation>& op);
  void watchdog_main();
  DmaWorker& worker_for(std::uint32_t graph_channel);

  RuntimeImpl& runtime_;
  std::shared_ptr<const planner::TransferGraph> graph_;
  std::unique_ptr<planner::Planner> planner_;
  std::vector<std::unique_ptr<DmaWorker>> workers_;  // by graph channel index (null: no implementation)
  std::mutex mutex_;
  std::condition_variable idle_cv_;
  std::map<MemoryId, BufferPool> pools_;
  std::unordered_map<Event, std::shared_ptr<CopyOperation>> active_;
  std::uint64_t next_sequence_ = 0;
  bool stopping_ = false;
  std::thread watchdog_;
  std::condition_variable watchdog_cv_;
  std::uint64_t request_floor_bytes_, tile_bytes_, pool_bytes_;
  std::int64_t stall_ns_;
  int slots_;
};

}  // namespace caravan::dma
