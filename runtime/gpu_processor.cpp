#include "runtime/gpu_processor.h"

#include "runtime/log.h"

#include <fmt/format.h>

namespace caravan::detail {

GpuProcessor::GpuProcessor(EventTable& events, Processor id, std::unique_ptr<GpuStreams> streams)
    : events_(events), id_(id), streams_(std::move(streams)) {
  const int lanes = streams_->lane_count();
  if (lanes < 2 || lanes % 2 != 0)
    throw Error(Errc::internal, fmt::format("{}: {} streams (needs an even number, at least 2)", id_.to_string(), lanes));
  for (int i = 0; i < lanes; ++i) lanes_.push_back(std::make_unique<Lane>());
  for (int i = 0; i < lanes; ++i) lanes_[static_cast<std::size_t>(i)]->thread = std::thread([this, i] { lane_main(i); });
  launcher_ = std::thread([this] { launcher_main(); });
}

GpuProcessor::~GpuProcessor() { stop(make_failure(Errc::shut_down, "the runtime shut down before this task ran")); }

void GpuProcessor::make_ready(TaskRecord* task) {
  switch (queue_.push(task)) {
    case ReadyQueue::PushResult::queued: break;
    case ReadyQueue::PushResult::queued_wake_worker: queue_.wake_one(); break;
    case ReadyQueue::PushResult::stopped:
      // stop() set stop_failure_ before it stopped the queue, under the queue's lock.
      fail(task, stop_failure_);
      break;
  }
}

void GpuProcessor::fail(TaskRecord* task, const FailureCause& failure) {
  Event completion = task->completion();
  delete task;
  events_.trigger(completion, failure);
}

void GpuProcessor::stop(const FailureCause& failure) {
  std::lock_guard lock(stop_mutex_);
  if (stopped_) return;
  stopped_ = true;
  stop_failure_ = failure;
  queue_.stop();
  if (launcher_.joinable()) launcher_.join();
  for (TaskRecord* task : queue_.take_all()) fail(task, failure);
  // The launcher is gone, so nothing more is launched: each lane reports what it holds and ends.
  for (auto& lane : lanes_) {
    {
      std::lock_guard lane_lock(lane->mutex);
      lane->stopping = true;
    }
    lane->cv.notify_one();
  }
  for (auto& lane : lanes_)
    if (lane->thread.joinable()) lane->thread.join();
}

void GpuProcessor::launcher_main() {
  while (TaskRecord* task = queue_.pop_blocking()) launch(task);
}

void GpuProcessor::launch(TaskRecord* task) {
  const int per_class = static_cast<int>(lanes_.size() / 2);
  const bool high = task->priority() > 0;
  unsigned& next = high ? next_high_ : next_low_;
  const int lane = (high ? per_class : 0) + static_cast<int>(next++ % static_cast<unsigned>(per_class));

  // Every body starts with its GPU current (the one before may have switched).
  try {
    streams_->bind_thread();
  } catch (const Error& e) {
    fail(task, make_failure(e.code(), fmt::format("{}: task '{}' could not start: {}", id_.to_string(),
                                                  task->entry().name, e.what())));
    return;
  }
  TaskContext context = context_for(*task, id_);
  context.gpu_device = streams_->device();
  context.gpu_stream = streams_->stream(lane);
  Launched launched;
  launched.completion = task->completion();
  launched.task_name = task->entry().name;
  launched.failure = run_task_body(*task, context);
  delete task;
  // Recorded after a failed body too: its completion must not be reported before the work it
  // did enqueue has finished (the caller may free buffers that work still uses).
  try {
    launched.marker = streams_->record(lane);
  } catch (const Error& e) {
    if (!launched.failure)
      launched.failure = make_failure(e.code(), fmt::format("{}: task '{}': {}", id_.to_string(), launched.task_name,
                                                            e.what()));
  }
  Lane& target = *lanes_[static_cast<std::size_t>(lane)];
  {
    std::lock_guard lock(target.mutex);
    target.launched.push_back(std::move(launched));
  }
  target.cv.notify_one();
}

void GpuProcessor::lane_main(int index) {
  // Waiting on a marker needs no current device, so lanes do not bind one.
  Lane& lane = *lanes_[static_cast<std::size_t>(index)];
  std::unique_lock lock(lane.mutex);
  for (;;) {
    lane.cv.wait(lock, [&] { return lane.stopping || !lane.launched.empty(); });
    if (lane.launched.empty()) return;  // stopping, and everything reported
    Launched launched = std::move(lane.launched.front());
    lane.launched.pop_front();
    lock.unlock();
    FailureCause failure = std::move(launched.failure);
    if (launched.marker) {
      if (FailureCause device_failure = streams_->wait(launched.marker); device_failure && !failure) {
        failure = make_failure(device_failure->code(), fmt::format("{}: task '{}' failed on the GPU: {}", id_.to_string(),
                                                                   launched.task_name, device_failure->what()));
        log::get("task")->debug("{}", failure->what());
      }
    }
    events_.trigger(launched.completion, std::move(failure));
    lock.lock();
  }
}

}  // namespace caravan::detail
