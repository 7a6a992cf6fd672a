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

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>
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
  // The marker may be reused afterwards.
  virtual FailureCause wait(void* marker) = 0;
};

class GpuProcessor final : public TaskProcessor {
 public:
  GpuProcessor(EventTable& events, Processor id, std::unique_ptr<GpuStreams> streams);
  ~GpuProcessor();

  Processor id() const { return id_; }
  int device() const { return streams_->device(); }

  void make_ready(TaskRecord* task) override;
  void fail(TaskRecord* task, const FailureCause& failure) override;

  // Stops launching once the body running now returns and poisons every task still queued with
  // `failure`; tasks already launched complete (or fail) as their GPU work finishes, and this
  // waits for them. Idempotent.
  void stop(const FailureCause& failure);

 private:
  struct Launched {
    void* marker = nullptr;  // null: nothing to wait for (recording failed)
    Event completion;
    std::string_view task_name;  // the registry's, which outlives every task
    FailureCause failure;  // the body's, or recording's
  };
  struct Lane {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Launched> launched;
    bool stopping = false;
    std::thread thread;
  };
  void launcher_main();
  void launch(TaskRecord* task);
  void lane_main(int lane);

  EventTable& events_;
  Processor id_;
  std::unique_ptr<GpuStreams> streams_;
  ReadyQueue queue_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  unsigned next_low_ = 0, next_high_ = 0;  // launcher thread only
  std::thread launcher_;
  std::mutex stop_mutex_;
  bool stopped_ = false;  // stop_mutex_
  FailureCause stop_failure_;
};

// The HIP implementation of GpuStreams for `device`: `per_class` non-blocking streams of the
// lowest and as many of the highest stream priority. GPU builds only; throws Error(device).
std::unique_ptr<GpuStreams> make_device_streams(int device, int per_class);

}  // namespace caravan::detail
