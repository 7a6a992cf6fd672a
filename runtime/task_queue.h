// What every processor kind shares: a spawned task's record, the priority ready queue, and
// running a task body with its errors turned into a failure cause.
#pragma once

#include "runtime/event_table.h"
#include "runtime/task_registry.h"

#include <caravan/task.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

namespace caravan::detail {

class TaskRecord;

// A processor as a task record sees it: where the record goes once its precondition triggers.
class TaskProcessor {
 public:
  virtual ~TaskProcessor() = default;
  // The precondition triggered: queue `task` to run.
  virtual void make_ready(TaskRecord* task) = 0;
  // Triggers `task`'s completion poisoned with `failure` and frees the record.
  virtual void fail(TaskRecord* task, const FailureCause& failure) = 0;
};

// Argument bytes, stored inline when small (the common case: a few ids and sizes).
class ArgBuffer {
 public:
  explicit ArgBuffer(std::span<const std::byte> bytes) : size_(bytes.size()) {
    if (size_ > sizeof(inline_)) {
      heap_ = std::make_unique<std::byte[]>(size_);
      std::memcpy(heap_.get(), bytes.data(), size_);
    } else if (size_) {
      std::memcpy(inline_, bytes.data(), size_);
    }
  }
  std::span<const std::byte> view() const { return {heap_ ? heap_.get() : inline_, size_}; }

 private:
  std::size_t size_;
  std::byte inline_[48];
  std::unique_ptr<std::byte[]> heap_;
};

// One spawned task, from spawn until it has run (or been poisoned). It is the waiter on its
// precondition, and then a node in its processor's ready queue.
class TaskRecord final : public EventWaiter {
 public:
  TaskRecord(const TaskEntry* entry, TaskId id, Event completion, int priority, TaskProcessor* processor,
             std::span<const std::byte> args)
      : entry_(entry), id_(id), completion_(completion), priority_(priority), processor_(processor), args_(args) {}
  void event_triggered(const FailureCause& failure) override;

  const TaskEntry& entry() const { return *entry_; }
  TaskId id() const { return id_; }
  Event completion() const { return completion_; }
  int priority() const { return priority_; }
  std::span<const std::byte> args() const { return args_.view(); }
  // GPU tasks ordered on the GPU after another one (SpawnOptions::order_on_gpu): the marker
  // behind that task's work, which this task's stream waits on before its own work, and that
  // task's completion, which this task's completion follows.
  const std::shared_ptr<void>& run_after() const { return run_after_; }
  Event completes_after() const { return completes_after_; }
  void set_run_after(std::shared_ptr<void> marker, Event precondition) {
    run_after_ = std::move(marker);
    completes_after_ = precondition;
  }

 private:
  friend class ReadyQueue;
  const TaskEntry* entry_;
  TaskId id_;
  Event completion_;
  int priority_;
  TaskProcessor* processor_;
  ArgBuffer args_;
  std::shared_ptr<void> run_after_;
  Event completes_after_;
  TaskRecord* next_ready_ = nullptr;
};

// Ready tasks by priority. One lock; buckets per distinct priority, highest first, each an
// intrusive FIFO. The handful of priorities real programs use keeps the bucket scan short.
class ReadyQueue {
 public:
  enum class PushResult { queued, queued_wake_worker, stopped };
  PushResult push(TaskRecord* task);
  TaskRecord* try_pop();
  // Blocks until a task is ready or stop() was called (then returns nullptr).
  TaskRecord* pop_blocking();
  // Queues `task` and wakes a sleeping consumer; false, queueing nothing, once stop() was called.
  bool enqueue(TaskRecord* task);
  // The next task, or nullptr once stop() was called. Polls for `spin_us` before it sleeps: a
  // task made ready soon after is then picked up without a futex wake-up. Yielding keeps the
  // thread that makes it ready running on a machine with few cores.
  TaskRecord* pop_after_polling(int spin_us);
  void stop();
  bool maybe_nonempty() const { return size_.load(std::memory_order_relaxed) > 0; }
  // Queued tasks, read in the order that makes "queued or counted" exact with count_pops_into.
  std::size_t size_ordered() const { return size_.load(std::memory_order_seq_cst); }
  // Every task popped to run is counted into `*counter` under the lock, before it leaves the
  // queue's size: a reader of size_ordered() and then the counter never misses it (a task
  // taken by take_all is not counted).
  void count_pops_into(std::atomic<int>* counter) { pop_counter_ = counter; }
  std::vector<TaskRecord*> take_all();
  void wake_one() { cv_.notify_one(); }

 private:
  struct Bucket {
    int priority;
    TaskRecord* head;
    TaskRecord* tail;
  };
  TaskRecord* pop_locked(bool to_run = true);

  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Bucket> buckets_;  // sorted by priority, highest first; never empty buckets
  std::atomic<std::size_t> size_{0};
  std::atomic<bool> stop_requested_{false};  // stopped_, for polling without the lock
  int sleepers_ = 0;
  bool stopped_ = false;
  std::atomic<int>* pop_counter_ = nullptr;  // set before any task is queued
};

// The context a body of `task` sees on `processor` (the caller adds processor-specific fields).
TaskContext context_for(const TaskRecord& task, Processor processor);
// Runs the body. Returns null, or the failure its completion carries: the original cause when
// it threw EventPoisoned (it waited on failed work), else Errc::task_failed with its message.
FailureCause run_task_body(const TaskRecord& task, TaskContext& context);

}  // namespace caravan::detail
