#include "runtime/cpu_processor.h"

#include <fmt/format.h>

#include <system_error>

namespace caravan::detail {

CpuProcessor::CpuProcessor(EventTable& events, Processor id, int workers, int spin_us)
    : events_(events), id_(id), spin_us_(spin_us) {
  workers_.reserve(static_cast<std::size_t>(workers));
  live_workers_.store(workers, std::memory_order_relaxed);
  for (int i = 0; i < workers; ++i) {
    try {
      workers_.emplace_back([this] { worker_main(); });
    } catch (const std::system_error& e) {
      // The system refused a thread (a pids limit, say): the started ones are stopped and
      // joined (a joinable std::thread destroyed would end the process), then the error told.
      live_workers_.fetch_sub(workers - i, std::memory_order_relaxed);
      stop(make_failure(Errc::shut_down, "the CPU processor failed to start"));
      throw Error(Errc::invalid_argument,
                  fmt::format("cannot start CPU worker {} of {}: {} (ask for fewer: RuntimeOptions::cpu_workers or "
                              "CARAVAN_CPU_WORKERS)",
                              i + 1, workers, e.what()));
    }
  }
}

CpuProcessor::~CpuProcessor() { stop(make_failure(Errc::shut_down, "the runtime shut down before this task ran")); }

void CpuProcessor::make_ready(TaskRecord* task) {
  // request_stop() set stop_failure_ before it stopped the queue, under the queue's lock.
  if (!queue_.enqueue(task)) fail(task, stop_failure_);
}

void CpuProcessor::fail(TaskRecord* task, const FailureCause& failure) {
  Event completion = task->completion();
  delete task;
  events_.trigger(completion, failure);
}

void CpuProcessor::request_stop(const FailureCause& failure) {
  std::vector<TaskRecord*> queued;
  {
    std::lock_guard lock(stop_mutex_);
    if (stop_requested_) return;
    stop_requested_ = true;
    stop_failure_ = failure;  // before the queue stops: make_ready reads it once enqueue fails
    queue_.stop();
    queued = queue_.take_all();
  }
  // Outside the lock: failing a task runs its dependents' waiters, which may make more tasks
  // ready (they fail in make_ready).
  for (TaskRecord* task : queued) fail(task, failure);
}

bool CpuProcessor::wait_for_workers(std::chrono::milliseconds timeout) {
  std::unique_lock lock(exit_mutex_);
  return exit_cv_.wait_for(lock, timeout, [this] { return live_workers_.load(std::memory_order_acquire) == 0; });
}

void CpuProcessor::stop(const FailureCause& failure) {
  request_stop(failure);
  std::lock_guard lock(stop_mutex_);
  if (joined_) return;
  joined_ = true;
  for (auto& worker : workers_) worker.join();
}

void CpuProcessor::worker_main() {
  t_blocked_wait_count = &blocked_workers_;
  while (TaskRecord* task = queue_.pop_after_polling(spin_us_)) run(task);
  t_blocked_wait_count = nullptr;
  {
    std::lock_guard lock(exit_mutex_);
    live_workers_.fetch_sub(1, std::memory_order_release);
  }
  exit_cv_.notify_all();
}

void CpuProcessor::run(TaskRecord* task) {
  TaskContext context = context_for(*task, id_);
  FailureCause failure = run_task_body(*task, context);
  Event completion = task->completion();
  delete task;
  events_.trigger(completion, std::move(failure));
}

}  // namespace caravan::detail
