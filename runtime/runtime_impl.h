// RuntimeImpl: what one running runtime owns, and the process-wide pointer that event handles
// use to find it.
#pragma once

#include "runtime/cpu_processor.h"
#include "runtime/event_table.h"
#include "runtime/gpu_processor.h"

#include <caravan/runtime.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace caravan::net {
class Network;
}

namespace caravan {

// A subsystem that lives as long as one runtime (the DMA engine, ...). Services are created on
// first use and shut down before the runtime poisons its pending events, newest first.
class RuntimeService {
 public:
  virtual ~RuntimeService() = default;
  virtual void shutdown() = 0;
};

class RuntimeImpl {
 public:
  RuntimeImpl(Runtime* owner, const RuntimeOptions& options);
  ~RuntimeImpl();

  detail::EventTable& events() { return *events_; }
  detail::CpuProcessor& cpu() { return *cpu_; }
  // GPUs this rank sees (probed on first use), and the reason when it sees none.
  int gpu_count();
  std::string no_gpu_reason();
  // The processor of GPU `index` (< gpu_count()), started on first use. Throws Error(device)
  // when its streams cannot be made, Error(shut_down) once the runtime is shutting down.
  detail::GpuProcessor& gpu(int index);
  // This rank moves data through a GPU (its DMA engine found one) or runs GPU tasks: with the
  // automatic CARAVAN_WAIT_SPIN_US, Event::wait polls longer from now on (wait_spin_us_for).
  void note_uses_gpu();
  // For tests of the GPU processors' scheduling without a GPU: `count` GPUs whose streams
  // `make` provides. Before any GPU processor has started.
  using GpuStreamsFactory = std::function<std::unique_ptr<detail::GpuStreams>(int device)>;
  void use_gpu_streams(int count, GpuStreamsFactory make);
  Runtime* owner() const { return owner_.load(std::memory_order_acquire); }  // null once forget_owner() ran
  // The runtime is visible to its own threads (a task another rank spawned may run) before the
  // Runtime that owns it has its handle: Runtime::current() waits for the owner's constructor to
  // finish (mark_owned), and throws Error(shut_down) if it failed (mark_failed).
  void mark_owned() { owned_.store(1, std::memory_order_release); }
  void mark_failed() { owned_.store(2, std::memory_order_release); }
  bool wait_until_owned() const {
    int state;
    while ((state = owned_.load(std::memory_order_acquire)) == 0) std::this_thread::yield();
    return state == 1;
  }
  // ~Runtime on one of the runtime's own threads leaks the runtime: its Runtime is gone.
  // Atomic: ~Runtime on a task's thread clears it while other tasks read it (Runtime::current()).
  void forget_owner() { owner_.store(nullptr, std::memory_order_release); }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::vector<RankInfo>& ranks() const { return ranks_; }
  int node_count() const { return node_count_; }
  // The distributed part (nullptr when this runtime is one rank on its own).
  net::Network* network() const { return net_.get(); }
  bool accepting_work() const { return !stopping_.load(std::memory_order_acquire); }

  Event spawn(TaskId task, std::span<const std::byte> args, const SpawnOptions& options);
  // `processor` with kThisRank resolved, if it exists: any rank's cpu0, a GPU processor of
  // another rank (that rank checks it), or one of this rank's GPUs. Else Error(invalid_argument)
  // starting with "call('task')".
  Processor check_processor(std::string_view call, std::string_view task, Processor processor);
  void shutdown();

  // The service registered as `name`, created by `make` on first use. Throws Error(shut_down)
  // once the runtime is shutting down.
  RuntimeService& service(const std::string& name, const std::function<std::unique_ptr<RuntimeService>()>& make);

  // The running runtime, or nullptr.
  static RuntimeImpl* current() { return g_current.load(std::memory_order_acquire); }
  // The event table that `e` lives in; throws Error(shut_down) if its runtime is gone and
  // Error(invalid_argument) if another rank owns it.
  static detail::EventTable& table_for(const Event& e);
  // `e` as this rank can wait on it: in its own table, or, when another rank of the job owns
  // it, the local proxy that mirrors it (net/remote_events.h). Throws as table_for.
  struct LocalEvent {
    detail::EventTable* table;
    Event event;
  };
  static LocalEvent local_view(const Event& e);

 private:
  // shutdown()'s CPU step: stops the workers without hanging on a task blocked on an event that
  // can no longer trigger (see the definition).
  void stop_cpu(const FailureCause& failure);
  // Every GPU processor's request_stop (no join).
  void request_stop_gpus(const FailureCause& failure);
  // Before the GPUs stop: frees a GPU task body blocked in Event::wait the same way.
  void unblock_gpu_bodies(const FailureCause& failure);
  // Polls finished() until it says so; whenever all_blocked() has held, and no event has
  // triggered, for the quiet spell (20 ms; CARAVAN_SHUTDOWN_TIMEOUT_S with several ranks), runs
  // step(0), step(1)... (each should unblock more).
  void unblock_when_quiet(const std::function<bool()>& finished, const std::function<bool()>& all_blocked,
                          const std::function<void(int step)>& step);
  // Whether a GPU processor has work that progresses by itself (GpuProcessor::busy).
  bool gpus_busy();
  // The GPU processors started so far (they live as long as the runtime).
  std::vector<detail::GpuProcessor*> started_gpus();

  static std::atomic<RuntimeImpl*> g_current;

  std::atomic<Runtime*> owner_;
  std::atomic<int> owned_{0};  // 0: the owner's constructor runs; 1: it finished; 2: it failed
  int rank_ = 0;
  int world_size_ = 1;
  int node_count_ = 1;
  std::vector<RankInfo> ranks_;
  std::unique_ptr<detail::EventTable> events_;
  std::int64_t wait_spin_setting_ = -1;  // CARAVAN_WAIT_SPIN_US as read at start
  std::unique_ptr<detail::CpuProcessor> cpu_;
  std::mutex gpus_mutex_;
  int gpu_count_ = -1;  // gpus_mutex_; -1 until probed
  std::string no_gpu_reason_;
  GpuStreamsFactory make_gpu_streams_;
  detail::GpuFollowTable gpu_follows_;  // before gpus_: the processors use it until they are destroyed
  std::vector<std::unique_ptr<detail::GpuProcessor>> gpus_;  // gpus_mutex_; index = device
  std::mutex services_mutex_;
  std::map<std::string, RuntimeService*> services_by_name_;
  std::vector<std::unique_ptr<RuntimeService>> services_;  // in creation order
  std::unique_ptr<net::Network> net_;  // after cpu_: destroyed first (its progress thread uses both)
  std::atomic<bool> stopping_{false};
  std::atomic<bool> stopped_{false};  // set once shutdown() has finished
  std::mutex shutdown_mutex_;         // held for the whole of shutdown()
};

}  // namespace caravan
