#include "runtime/cpu_processor.h"

#include <algorithm>
#include <chrono>

namespace caravan::detail {

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
  Event completion = task->completion();
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
  TaskContext context = context_for(*task, id_);
  FailureCause failure = run_task_body(*task, context);
  Event completion = task->completion();
  delete task;
  events_.trigger(completion, std::move(failure));
}

}  // namespace caravan::detail
