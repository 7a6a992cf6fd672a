// The GPU processors of a rank: one per visible GPU. A task spawned on one runs its body on the
// processor's launcher thread with the GPU current and a stream of it in TaskContext; the body
// enqueues work there and returns, and the task completes when that work has finished on the GPU.
//
// Ready tasks wait in a priority queue (as on the CPU processor). Each task goes to a lane: a
// stream with its own FIFO of launched tasks and a completion thread that waits on the FIFO's
// front marker (an event recorded behind the body's work) and then triggers the task's
// completion, or poisons it with the GPU's error. A stream's work finishes in order, so one
// thread per stream sees its completions as they happen and a long task on one lane never holds
// up another lane's report. Lanes come in two classes: tasks of priority > 0 go to streams of
// the GPU's highest stream priority, the others to streams of its lowest; within a class, lanes
// are used in turn (CARAVAN_GPU_TASK_STREAMS per class).
//
// The device side sits behind GpuStreams, so that the scheduling is tested (and run under
// ThreadSanitizer) without a GPU; runtime/gpu/task_streams.cpp is the HIP implementation.
#pragma once

#include "runtime/task_queue.h"

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

namespace caravan::detail {

// Streams of one GPU and markers behind their work. Lanes [0, lane_count()/2) are the
// low-priority class, the rest the high-priority one. Each method may be called from any thread.
class GpuStreams {
 public:
  virtual ~GpuStreams() = default;
  virtual int device() const = 0;
  virtual int lane_count() const = 0;
  // Makes the GPU current on the calling thread (the launcher, before each body).
  virtual void bind_thread() = 0;
  // The stream of `lane` (a hipStream_t), as TaskContext::gpu_stream.
  virtual void* stream(int lane) = 0;
  // A marker behind the work enqueued on `lane` so far. Throws Error(device).
  virtual void* record(int lane) = 0;
  // Blocks until the marker's work has finished; returns the GPU's error, if it reported one.
  virtual FailureCause wait(void* marker) = 0;
  // Makes later work on `lane` wait for `marker`'s work (a marker of any GPU's streams), on the
  // GPU. Throws Error(device).
  virtual void order_after(int lane, void* marker) = 0;
  // The marker will not be used again (by anyone): back to the pool.
  virtual void release(void* marker) = 0;
};

// GPU tasks of this rank that others may be ordered after on the GPU (SpawnOptions::
// order_on_gpu), from spawn until their completion triggers. A follower spawned before its
// precondition task is launched waits here; once that task's work is enqueued, followers get
// the marker behind it and become ready. Thread-safe.
class GpuFollowTable {
 public:
  // A GPU task was spawned (before it can run).
  void add(Event completion);
  enum class Follow { not_followable, waiting, ready };
  // `follower` asks to be ordered after the task completing `precondition`. ready: it has the
  // marker now (the caller makes it ready); waiting: it is held until that task is launched or
  // fails; not_followable: not a GPU task of this rank still running (the usual path applies).
  Follow follow(Event precondition, TaskRecord* follower);
  // The task completing `completion` enqueued its work behind `marker`: its waiting followers
  // (each given the marker), to be made ready; later followers get the marker at once.
  std::vector<TaskRecord*> launched(Event completion, const std::shared_ptr<void>& marker);
  // The task completing `completion` fails without its work being enqueued, or its completion
  // is about to trigger: forgets it, returning the followers still waiting (to fail with it).
  std::vector<TaskRecord*> forget(Event completion);

 private:
  struct Entry {
    std::shared_ptr<void> marker;  // set once launched
    std::vector<TaskRecord*> followers;
  };
  // Every GPU task passes through here three times, from three threads (spawn, launch, report),
  // so the table is split into shards by event: one lock made the launcher wait on the spawning
  // thread (1.7 us per task measured on H100, more than the launch).
  struct alignas(64) Shard {
    std::mutex mutex;
    std::unordered_map<Event, Entry> tasks;
  };
  static constexpr std::size_t kShards = 16;  // the mix below takes 4 bits
  Shard& shard_of(Event e) {
    // The top bits of a multiplicative mix: consecutive slots land on different shards.
    const std::uint64_t mixed = std::uint64_t{std::hash<Event>{}(e)} * 0x9E3779B97F4A7C15ull;
    return shards_[static_cast<std::size_t>(mixed >> 60)];
  }
  std::array<Shard, kShards> shards_;
};

class GpuProcessor final : public TaskProcessor {
 public:
  // `spin_us`: how long the launcher and the lanes poll for work before they sleep.
  GpuProcessor(EventTable& events, GpuFollowTable& follows, Processor id, std::unique_ptr<GpuStreams> streams,
               int spin_us);
  ~GpuProcessor();

  Processor id() const { return id_; }
  int device() const { return streams_->device(); }

  void make_ready(TaskRecord* task) override;
  void fail(TaskRecord* task, const FailureCause& failure) override;

  // Whether it has work that will finish by itself: tasks queued, being launched, or launched and
  // not yet reported (shutdown waits rather than poison what such work will trigger). A body
  // blocked in Event::wait on the launcher does not count (it waits on others' work), nor do the
  // tasks queued behind it. The loads are ordered against the writers' (see count_pops_into).
  bool busy() const {
    const int blocked = blocked_bodies_.load(std::memory_order_seq_cst);
    const bool queued = queue_.size_ordered() > 0;
    const int taken = taken_.load(std::memory_order_seq_cst);
    return in_lanes_.load(std::memory_order_seq_cst) > 0 || taken > blocked || (blocked == 0 && queued);
  }
  // Whether the body running on the launcher is blocked in Event::wait.
  bool body_blocked() const { return blocked_bodies_.load(std::memory_order_acquire) > 0; }
  // Whether the launcher holds a task it took off the queue (launching it, or in its body).
  bool launching() const { return taken_.load(std::memory_order_seq_cst) > 0; }

  // No task is launched from now on: the queued ones, and those made ready later, fail with
  // `failure` at once. Idempotent.
  void request_stop(const FailureCause& failure);

  // Stops launching once the body running now returns and poisons every task still queued with
  // `failure`; tasks already launched complete (or fail) as their GPU work finishes, and this
  // waits for them. Idempotent.
  void stop(const FailureCause& failure);

 private:
  struct Launched {
    std::shared_ptr<void> marker;  // null: nothing to wait for (recording failed)
    Event completion;
    Event after;  // the task it was ordered after on the GPU: complete after that one
    std::string_view task_name;  // the registry's, which outlives every task
    FailureCause failure;  // the body's, or recording's
  };
  struct Lane {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Launched> launched;
    std::atomic<std::size_t> size{0};  // launched.size(), for polling without the lock
    std::atomic<bool> sleeping{false};  // its thread waits on cv (set under mutex)
    bool wake_early = false;  // a task for this lane is being launched
    bool stopping = false;
    std::thread thread;
  };
  void launcher_main();
  void launch(TaskRecord* task);
  void lane_main(int lane);

  void fail_followers(Event completion, const FailureCause& failure);
  // A task that could not be launched: as fail(), but one ordered after another task still
  // completes after it.
  void fail_at_launch(TaskRecord* task, const FailureCause& failure);

  EventTable& events_;
  GpuFollowTable& follows_;
  Processor id_;
  std::unique_ptr<GpuStreams> streams_;
  int spin_us_;
  ReadyQueue queue_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> taken_{0};           // tasks off the queue until launch() returns (0 or 1)
  std::atomic<int> in_lanes_{0};        // launched tasks until their lane has reported them
  std::atomic<int> blocked_bodies_{0};  // 1 while the launcher's body is in Event::wait
  std::vector<std::unique_ptr<Lane>> lanes_;
  unsigned next_low_ = 0, next_high_ = 0;  // launcher thread only
  std::thread launcher_;
  std::mutex stop_mutex_;
  bool stop_requested_ = false;  // stop_mutex_
  bool stopped_ = false;         // stop_mutex_
  FailureCause stop_failure_;
};

// The HIP implementation of GpuStreams for `device`: `per_class` non-blocking streams of the
// lowest and as many of the highest stream priority. GPU builds only; throws Error(device).
std::unique_ptr<GpuStreams> make_device_streams(int device, int per_class);

}  // namespace caravan::detail
