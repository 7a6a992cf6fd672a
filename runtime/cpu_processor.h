// The CPU processor of a rank: a pool of worker threads running ready tasks, highest priority
// first, FIFO among equal priorities.
#pragma once

#include "runtime/task_queue.h"

#include <caravan/task.h>

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

  // Stops the workers once the tasks they are running return, then poisons every task still
  // queued with `failure`. Idempotent.
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
  bool stopped_ = false;  // stop_mutex_
  std::mutex stop_mutex_;
  FailureCause stop_failure_;
};

}  // namespace caravan::detail
