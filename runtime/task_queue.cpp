#include "runtime/task_queue.h"

#include "runtime/log.h"

#include <fmt/format.h>

#include <chrono>
#include <thread>

namespace caravan::detail {

void TaskRecord::event_triggered(const FailureCause& failure) {
  // The precondition failed: the task never runs, and its completion carries the same cause.
  if (failure) processor_->fail(this, failure);
  else processor_->make_ready(this);
}

ReadyQueue::PushResult ReadyQueue::push(TaskRecord* task) {
  std::lock_guard lock(mutex_);
  if (stopped_) return PushResult::stopped;
  task->next_ready_ = nullptr;
  auto it = buckets_.begin();
  while (it != buckets_.end() && it->priority > task->priority_) ++it;
  if (it != buckets_.end() && it->priority == task->priority_) {
    it->tail->next_ready_ = task;
    it->tail = task;
  } else {
    buckets_.insert(it, Bucket{task->priority_, task, task});
  }
  size_.fetch_add(1, std::memory_order_relaxed);
  return sleepers_ > 0 ? PushResult::queued_wake_worker : PushResult::queued;
}

TaskRecord* ReadyQueue::pop_locked(bool to_run) {
  if (buckets_.empty()) return nullptr;
  Bucket& top = buckets_.front();
  TaskRecord* task = top.head;
  top.head = task->next_ready_;
  if (!top.head) buckets_.erase(buckets_.begin());
  if (pop_counter_ && to_run) {
    pop_counter_->fetch_add(1, std::memory_order_seq_cst);
    size_.fetch_sub(1, std::memory_order_seq_cst);
  } else {
    size_.fetch_sub(1, std::memory_order_relaxed);
  }
  return task;
}

TaskRecord* ReadyQueue::try_pop() {
  std::lock_guard lock(mutex_);
  if (stopped_) return nullptr;  // what is left is the stopper's to poison (take_all)
  return pop_locked();
}

TaskRecord* ReadyQueue::pop_blocking() {
  std::unique_lock lock(mutex_);
  for (;;) {
    if (stopped_) return nullptr;
    if (TaskRecord* task = pop_locked()) return task;
    ++sleepers_;
    cv_.wait(lock);
    --sleepers_;
  }
}

bool ReadyQueue::enqueue(TaskRecord* task) {
  switch (push(task)) {
    case PushResult::queued: return true;
    case PushResult::queued_wake_worker: wake_one(); return true;
    case PushResult::stopped: return false;
  }
  return false;
}

TaskRecord* ReadyQueue::pop_after_polling(int spin_us) {
  using Clock = std::chrono::steady_clock;
  TaskRecord* task = try_pop();
  if (!task && spin_us > 0) {
    const auto until = Clock::now() + std::chrono::microseconds(spin_us);
    while (!task && !stop_requested_.load(std::memory_order_relaxed)) {
      if (maybe_nonempty()) task = try_pop();
      else if (Clock::now() >= until) break;
      else std::this_thread::yield();
    }
  }
  return task ? task : pop_blocking();
}

void ReadyQueue::stop() {
  {
    std::lock_guard lock(mutex_);
    stopped_ = true;
    stop_requested_.store(true, std::memory_order_relaxed);
  }
  cv_.notify_all();
}

std::vector<TaskRecord*> ReadyQueue::take_all() {
  std::lock_guard lock(mutex_);
  std::vector<TaskRecord*> out;
  while (TaskRecord* task = pop_locked(/*to_run=*/false)) out.push_back(task);
  return out;
}

TaskContext context_for(const TaskRecord& task, Processor processor) {
  TaskContext context;
  context.task = task.id();
  context.task_name = task.entry().name;
  context.args = task.args();
  context.processor = processor;
  context.completion = task.completion();
  return context;
}

FailureCause run_task_body(const TaskRecord& task, TaskContext& context) {
  FailureCause failure;
  try {
    task.entry().fn(context);
  } catch (const EventPoisoned& e) {
    failure = e.cause();  // the task waited on failed work: pass the original cause on
  } catch (const std::exception& e) {
    failure = make_failure(Errc::task_failed, fmt::format("task '{}' failed: {}", task.entry().name, e.what()));
  } catch (...) {
    failure = make_failure(Errc::task_failed, fmt::format("task '{}' failed: unknown exception", task.entry().name));
  }
  if (failure) log::get("task")->debug("{}", failure->what());
  return failure;
}

}  // namespace caravan::detail
