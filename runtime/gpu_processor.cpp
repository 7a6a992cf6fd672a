#include "runtime/gpu_processor.h"

#include "runtime/log.h"

#include <system_error>

#include <fmt/format.h>

#include <chrono>

namespace caravan::detail {

// ------------------------------------------------------------------------------------ GpuFollowTable

void GpuFollowTable::add(Event completion) {
  Shard& shard = shard_of(completion);
  std::lock_guard lock(shard.mutex);
  shard.tasks.try_emplace(completion);
}

GpuFollowTable::Follow GpuFollowTable::follow(Event precondition, TaskRecord* follower) {
  Shard& shard = shard_of(precondition);
  std::lock_guard lock(shard.mutex);
  auto it = shard.tasks.find(precondition);
  if (it == shard.tasks.end()) return Follow::not_followable;
  if (it->second.marker) {
    follower->set_run_after(it->second.marker, precondition);
    return Follow::ready;
  }
  it->second.followers.push_back(follower);
  return Follow::waiting;
}

std::vector<TaskRecord*> GpuFollowTable::launched(Event completion, const std::shared_ptr<void>& marker) {
  Shard& shard = shard_of(completion);
  std::lock_guard lock(shard.mutex);
  auto it = shard.tasks.find(completion);
  if (it == shard.tasks.end()) return {};
  it->second.marker = marker;
  std::vector<TaskRecord*> ready = std::move(it->second.followers);
  it->second.followers.clear();
  for (TaskRecord* f : ready) f->set_run_after(marker, completion);
  return ready;
}

std::vector<TaskRecord*> GpuFollowTable::forget(Event completion) {
  Shard& shard = shard_of(completion);
  std::lock_guard lock(shard.mutex);
  auto it = shard.tasks.find(completion);
  if (it == shard.tasks.end()) return {};
  std::vector<TaskRecord*> waiting = std::move(it->second.followers);
  shard.tasks.erase(it);
  return waiting;
}

// ------------------------------------------------------------------------------------ GpuProcessor

namespace {

// Triggers a task's completion once its precondition's has triggered, with the task's own
// failure or else the precondition's.
class CompleteAfter final : public EventWaiter {
 public:
  CompleteAfter(EventTable& events, Event completion, FailureCause failure)
      : events_(events), completion_(completion), failure_(std::move(failure)) {}
  void event_triggered(const FailureCause& precondition_failure) override {
    events_.trigger(completion_, failure_ ? failure_ : precondition_failure);
    delete this;
  }

 private:
  EventTable& events_;
  Event completion_;
  FailureCause failure_;
};

}  // namespace

GpuProcessor::GpuProcessor(EventTable& events, GpuFollowTable& follows, Processor id, std::unique_ptr<GpuStreams> streams,
                           int spin_us)
    : events_(events), follows_(follows), id_(id), streams_(std::move(streams)), spin_us_(spin_us) {
  const int lanes = streams_->lane_count();
  if (lanes < 2 || lanes % 2 != 0)
    throw Error(Errc::internal, fmt::format("{}: {} streams (needs an even number, at least 2)", id_.to_string(), lanes));
  for (int i = 0; i < lanes; ++i) lanes_.push_back(std::make_unique<Lane>());
  queue_.count_pops_into(&taken_);
  try {
    for (int i = 0; i < lanes; ++i)
      lanes_[static_cast<std::size_t>(i)]->thread = std::thread([this, i] { lane_main(i); });
    launcher_ = std::thread([this] { launcher_main(); });
  } catch (const std::system_error& e) {
    // The system refused a thread (a pids limit, say): the started ones are stopped and joined
    // (a joinable std::thread destroyed would end the process), then the error told.
    stop(make_failure(Errc::shut_down, "the GPU processor failed to start"));
    throw Error(Errc::invalid_argument,
                fmt::format("{}: cannot start its {} stream threads and launcher: {} (fewer streams: "
                            "CARAVAN_GPU_TASK_STREAMS)",
                            id_.to_string(), lanes, e.what()));
  }
}

GpuProcessor::~GpuProcessor() { stop(make_failure(Errc::shut_down, "the runtime shut down before this task ran")); }

void GpuProcessor::make_ready(TaskRecord* task) {
  // request_stop() set stop_failure_ before it stopped the queue, under the queue's lock.
  if (!queue_.enqueue(task)) fail(task, stop_failure_);
}

void GpuProcessor::fail(TaskRecord* task, const FailureCause& failure) {
  Event completion = task->completion();
  delete task;
  fail_followers(completion, failure);
  events_.trigger(completion, failure);
}

void GpuProcessor::fail_followers(Event completion, const FailureCause& failure) {
  // Each follower fails through its own processor, which hands the failure on to its own
  // followers. A chain of them is worked off here in a loop, not by recursion: a long chain
  // spawned ahead of the GPU would otherwise grow the stack by one frame per link.
  thread_local std::vector<std::pair<TaskRecord*, FailureCause>>* pending = nullptr;
  std::vector<TaskRecord*> followers = follows_.forget(completion);
  if (followers.empty()) return;
  if (pending) {
    for (TaskRecord* f : followers) pending->emplace_back(f, failure);
    return;
  }
  std::vector<std::pair<TaskRecord*, FailureCause>> work;
  for (TaskRecord* f : followers) work.emplace_back(f, failure);
  pending = &work;
  while (!work.empty()) {
    auto [follower, cause] = std::move(work.back());
    work.pop_back();
    follower->event_triggered(cause);  // may append its own followers to `work`
  }
  pending = nullptr;
}

void GpuProcessor::fail_at_launch(TaskRecord* task, const FailureCause& failure) {
  const Event after = task->completes_after();
  if (!after) {
    fail(task, failure);
    return;
  }
  // Ordered after another task: its completion still follows that task's.
  Event completion = task->completion();
  delete task;
  fail_followers(completion, failure);
  events_.add_waiter(after, new CompleteAfter(events_, completion, failure));
}

void GpuProcessor::request_stop(const FailureCause& failure) {
  std::vector<TaskRecord*> queued;
  {
    std::lock_guard lock(stop_mutex_);
    if (stop_requested_) return;
    stop_requested_ = true;
    stop_failure_ = failure;  // before the queue stops: make_ready reads it once enqueue fails
    stopping_.store(true, std::memory_order_relaxed);
    queue_.stop();
    queued = queue_.take_all();
  }
  for (TaskRecord* task : queued) fail(task, failure);
}

void GpuProcessor::stop(const FailureCause& failure) {
  request_stop(failure);
  std::lock_guard lock(stop_mutex_);
  if (stopped_) return;
  stopped_ = true;
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
  // Polling first, as the CPU workers do: the next link of a chain, whose precondition a lane
  // is about to trigger, is picked up without a futex wake-up.
  t_blocked_wait_count = &blocked_bodies_;  // for shutdown, as on the CPU workers
  while (TaskRecord* task = queue_.pop_after_polling(spin_us_)) launch(task);
  t_blocked_wait_count = nullptr;
}

void GpuProcessor::launch(TaskRecord* task) {
  // taken_ counted the task when it left the queue; it is handed on to in_lanes_ below (or the
  // task fails here), then released when launch() returns.
  struct Release {
    std::atomic<int>& taken;
    ~Release() { taken.fetch_sub(1, std::memory_order_seq_cst); }
  } release{taken_};
  const int per_class = static_cast<int>(lanes_.size() / 2);
  const bool high = task->priority() > 0;
  unsigned& next = high ? next_high_ : next_low_;
  const int lane = (high ? per_class : 0) + static_cast<int>(next++ % static_cast<unsigned>(per_class));

  // A sleeping lane thread takes tens of microseconds to wake (about 40 measured on an H100
  // host), longer than most bodies: wake it now, so that it is polling when the task arrives.
  Lane& target = *lanes_[static_cast<std::size_t>(lane)];
  if (target.sleeping.load(std::memory_order_relaxed)) {
    {
      std::lock_guard lock(target.mutex);
      target.wake_early = true;
    }
    target.cv.notify_one();
  }
  // Every body starts with its GPU current (the one before may have switched).
  try {
    streams_->bind_thread();
  } catch (const Error& e) {
    fail_at_launch(task, make_failure(e.code(), fmt::format("{}: task '{}' could not start: {}", id_.to_string(),
                                                            task->entry().name, e.what())));
    return;
  }
  // Ordered on the GPU after another task (SpawnOptions::order_on_gpu): wait for its work there.
  if (task->run_after()) {
    try {
      streams_->order_after(lane, task->run_after().get());
    } catch (const Error& e) {
      fail_at_launch(task, make_failure(e.code(), fmt::format("{}: task '{}' could not be ordered after its "
                                                              "precondition: {}",
                                                              id_.to_string(), task->entry().name, e.what())));
      return;
    }
  }
  TaskContext context = context_for(*task, id_);
  context.gpu_device = streams_->device();
  context.gpu_stream = streams_->stream(lane);
  Launched launched;
  launched.completion = task->completion();
  launched.after = task->completes_after();
  task->set_run_after(nullptr, Event{});
  launched.task_name = task->entry().name;
  launched.failure = run_task_body(*task, context);
  delete task;
  // Recorded after a failed body too: its completion must not be reported before the work it
  // did enqueue has finished (the caller may free buffers that work still uses).
  try {
    GpuStreams* streams = streams_.get();
    launched.marker = std::shared_ptr<void>(streams->record(lane), [streams](void* m) { streams->release(m); });
  } catch (const Error& e) {
    if (!launched.failure)
      launched.failure = make_failure(e.code(), fmt::format("{}: task '{}': {}", id_.to_string(), launched.task_name,
                                                            e.what()));
  }
  // Tasks ordered after this one: they run now, behind its work on the GPU, unless it failed.
  if (launched.failure) {
    fail_followers(launched.completion, launched.failure);
  } else {
    for (TaskRecord* follower : follows_.launched(launched.completion, launched.marker)) follower->event_triggered(nullptr);
  }
  {
    std::lock_guard lock(target.mutex);
    target.launched.push_back(std::move(launched));
    target.size.fetch_add(1, std::memory_order_release);
    in_lanes_.fetch_add(1, std::memory_order_seq_cst);  // before taken_ lets go of it
  }
  target.cv.notify_one();
}

void GpuProcessor::lane_main(int index) {
  const RuntimeThreadRole role("a GPU processor's lane");
  // Waiting on a marker needs no current device, so lanes do not bind one.
  using Clock = std::chrono::steady_clock;
  Lane& lane = *lanes_[static_cast<std::size_t>(index)];
  std::unique_lock lock(lane.mutex);
  for (;;) {
    if (lane.launched.empty() && spin_us_ > 0) {
      // Poll a little before sleeping: the launcher often hands over the next task at once.
      lock.unlock();
      const auto until = Clock::now() + std::chrono::microseconds(spin_us_);
      while (lane.size.load(std::memory_order_acquire) == 0 && !stopping_.load(std::memory_order_relaxed) &&
             Clock::now() < until)
        std::this_thread::yield();
      lock.lock();
    }
    lane.sleeping.store(true, std::memory_order_relaxed);
    lane.cv.wait(lock, [&] { return lane.stopping || lane.wake_early || !lane.launched.empty(); });
    lane.sleeping.store(false, std::memory_order_relaxed);
    lane.wake_early = false;
    if (lane.launched.empty()) {
      if (lane.stopping) return;  // everything reported
      continue;  // woken early: poll for the task being launched
    }
    Launched launched = std::move(lane.launched.front());
    lane.launched.pop_front();
    lane.size.fetch_sub(1, std::memory_order_relaxed);
    lock.unlock();
    FailureCause failure = std::move(launched.failure);
    if (launched.marker) {
      if (FailureCause device_failure = streams_->wait(launched.marker.get()); device_failure && !failure) {
        failure = make_failure(device_failure->code(), fmt::format("{}: task '{}' failed on the GPU: {}", id_.to_string(),
                                                                   launched.task_name, device_failure->what()));
        log::get("task")->debug("{}", failure->what());
      }
    }
    launched.marker.reset();  // followers may still hold it until their wait is enqueued
    // Forgotten: a follower spawned from now on takes the usual path (the completion is about to
    // trigger). None is waiting here: they were handed on at launch.
    fail_followers(launched.completion, failure);
    if (launched.after) {
      // Its work ran after its precondition's, but that task's lane may not have reported yet:
      // completions keep the order of their tasks.
      events_.add_waiter(launched.after, new CompleteAfter(events_, launched.completion, std::move(failure)));
    } else {
      events_.trigger(launched.completion, std::move(failure));
    }
    in_lanes_.fetch_sub(1, std::memory_order_seq_cst);
    lock.lock();
  }
}

}  // namespace caravan::detail
