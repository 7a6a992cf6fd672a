#include "runtime/cpu_processor.h"


namespace caravan::detail {

CpuProcessor::CpuProcessor(EventTable& events, Processor id, int workers, int spin_us)
    : events_(events), id_(id), spin_us_(spin_us) {
  workers_.reserve(static_cast<std::size_t>(workers));
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { worker_main(); });
}

CpuProcessor::~CpuProcessor() { stop(make_failure(Errc::shut_down, "the runtime shut down before this task ran")); }

void CpuProcessor::make_ready(TaskRecord* task) {
  // stop() set stop_failure_ before it stopped the queue, under the queue's lock.
  if (!queue_.enqueue(task)) fail(task, stop_failure_);
}

void CpuProcessor::fail(TaskRecord* task, const FailureCause& failure) {
  Event completion = task->completion();
  delete task;
  events_.trigger(completion, failure);
}

void CpuProcessor::stop(const FailureCause& failure) {
  std::lock_guard lock(stop_mutex_);
  if (stopped_) return;
  stop_failure_ = failure;
  stopped_ = true;
  queue_.stop();
  for (auto& worker : workers_) worker.join();
  for (TaskRecord* task : queue_.take_all()) fail(task, failure);
}

void CpuProcessor::worker_main() {
  while (TaskRecord* task = queue_.pop_after_polling(spin_us_)) run(task);
}

void CpuProcessor::run(TaskRecord* task) {
  TaskContext context = context_for(*task, id_);
  FailureCause failure = run_task_body(*task, context);
  Event completion = task->completion();
  delete task;
  events_.trigger(completion, std::move(failure));
}

}  // namespace caravan::detail
