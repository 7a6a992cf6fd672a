// The CPU processor of a rank: a pool of worker threads running ready tasks, highest priority
// first, FIFO among equal priorities.
#pragma once

#include "runtime/task_queue.h"

#include <caravan/task.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace caravan::detail {

class CpuProcessor final : public TaskProcessor {
 public:
  CpuProcessor(EventTable& events, Processor id, int workers, int spin_us);
  ~CpuProcessor();

  Processor id() const { return id_; }
  int worker_count() const { return static_cast<int>(workers_.size()); }

  // Makes `task` ready to run (its precondition has triggered).
  void make_ready(TaskRecord* task) override;

  // No task starts from now on: the queued ones and those made ready later fail with
  // `failure` at once (a running task may be waiting on one). Idempotent.
  void request_stop(const FailureCause& failure);
  // After request_stop: waits until every worker has returned, or `timeout` has passed (false).
  bool wait_for_workers(std::chrono::milliseconds timeout);
  // Workers still running a task after request_stop, and those of them blocked in Event::wait.
  int live_workers() const { return live_workers_.load(std::memory_order_acquire); }
  int blocked_workers() const { return blocked_workers_.load(std::memory_order_relaxed); }
  // request_stop, then joins the workers once the tasks they are running return. Idempotent.
  void stop(const FailureCause& failure);

  // Triggers `task`'s completion poisoned with `failure` and frees it.
  void fail(TaskRecord* task, const FailureCause& failure) override;

 private:
  void worker_main();
  void run(TaskRecord* task);

  EventTable& events_;
  Processor id_;
  int spin_us_;
  ReadyQueue queue_;
  std::vector<std::thread> workers_;
  std::atomic<int> live_workers_{0};
  std::atomic<int> blocked_workers_{0};
  std::mutex exit_mutex_;  // with exit_cv_: a worker returned
  std::condition_variable exit_cv_;
  bool stop_requested_ = false;  // stop_mutex_
  bool joined_ = false;          // stop_mutex_
  std::mutex stop_mutex_;
  FailureCause stop_failure_;
};

}  // namespace caravan::detail
