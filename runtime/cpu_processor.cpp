#include "runtime/cpu_processor.h"

#include "runtime/log.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

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

TaskRecord* ReadyQueue::pop_locked() {
  if (buckets_.empty()) return nullptr;
  Bucket& top = buckets_.front();
  TaskRecord* task = top.head;
  top.head = task->next_ready_;
  if (!top.head) buckets_.erase(buckets_.begin());
  size_.fetch_sub(1, std::memory_order_relaxed);
  return task;
}

TaskRecord* ReadyQueue::try_pop() {
  std::lock_guard lock(mutex_);
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

void ReadyQueue::stop() {
  {
    std::lock_guard lock(mutex_);
    stopped_ = true;
  }
  cv_.notify_all();
}

std::vector<TaskRecord*> ReadyQueue::take_all() {
  std::lock_guard lock(mutex_);
  std::vector<TaskRecord*> out;
  while (TaskRecord* task = pop_locked()) out.push_back(task);
  return out;
}

CpuProcessor::CpuProcessor(EventTable& events, Processor id, int workers, int spin_us)
    : events_(events), id_(id), spin_us_(spin_us) {
  workers_.reserve(static_cast<std::size_t>(workers));
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { worker_main(); });
}

CpuProcessor::~CpuProcessor() { stop(make_failure(Errc::shut_down, "the runtime shut down before this task ran")); }

void CpuProcessor::make_ready(TaskRecord* task) {
  switch (queue_.push(task)) {
    case ReadyQueue::PushResult::queued: break;
    case ReadyQueue::PushResult::queued_wake_worker: queue_.wake_one(); break;
    case ReadyQueue::PushResult::stopped:
      // stop() set stop_failure_ before it stopped the queue, under the queue's lock.
      fail(task, stop_failure_);
      break;
  }
}

void CpuProcessor::fail(TaskRecord* task, const FailureCause& failure) {
  Event completion = task->completion_;
  delete task;
  events_.trigger(completion, failure);
}

void CpuProcessor::stop(const FailureCause& failure) {
  std::lock_guard lock(stop_mutex_);
  if (stopping_.load()) return;
  stop_failure_ = failure;
  stopping_.store(true, std::memory_order_release);
  queue_.stop();
  for (auto& worker : workers_) worker.join();
  for (TaskRecord* task : queue_.take_all()) fail(task, failure);
}

void CpuProcessor::worker_main() {
  using Clock = std::chrono::steady_clock;
  for (;;) {
    TaskRecord* task = queue_.try_pop();
    if (!task && spin_us_ > 0) {
      // Poll a little before sleeping: a task spawned soon after is then picked up without a
      // futex wake-up. Yielding keeps the spawning thread running on a machine with few cores.
      auto until = Clock::now() + std::chrono::microseconds(spin_us_);
      while (!task && !stopping_.load(std::memory_order_relaxed)) {
        if (queue_.maybe_nonempty()) task = queue_.try_pop();
        else if (Clock::now() >= until) break;
        else std::this_thread::yield();
      }
    }
    if (!task) task = queue_.pop_blocking();
    if (!task) return;
    run(task);
  }
}

void CpuProcessor::run(TaskRecord* task) {
  TaskContext context;
  context.task = task->id_;
  context.task_name = task->entry_->name;
  context.args = task->args_.view();
  context.processor = id_;
  context.completion = task->completion_;
  FailureCause failure;
  try {
    task->entry_->fn(context);
  } catch (const EventPoisoned& e) {
    failure = e.cause();  // the task waited on failed work: pass the original cause on
  } catch (const std::exception& e) {
    failure = make_failure(Errc::task_failed, fmt::format("task '{}' failed: {}", task->entry_->name, e.what()));
  } catch (...) {
    failure = make_failure(Errc::task_failed, fmt::format("task '{}' failed: unknown exception", task->entry_->name));
  }
  if (failure) log::get("task")->debug("{}", failure->what());
  Event completion = task->completion_;
  delete task;
  events_.trigger(completion, std::move(failure));
}

}  // namespace caravan::detail
