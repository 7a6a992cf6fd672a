// The GPU processors' scheduling, without a GPU: the runtime's GPU processors run on simulated
// streams (each a thread executing its queue of work in order, markers included), so launch
// order, completion after the stream's work, priority classes, failures and shutdown are tested
// here and under ThreadSanitizer. tests/gpu/gpu_processor_test.cpp runs the same processors on
// real GPUs.
#include "runtime/gpu_processor.h"
#include "runtime/runtime_impl.h"
#include "tests/runtime/test_util.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace caravan {
namespace {

using namespace std::chrono_literals;

// A stream: a thread that runs its work items in order. A failing item leaves the stream
// failed (as a GPU error is sticky): every marker reached afterwards reports it.
class SimulatedStream {
 public:
  SimulatedStream() : thread_([this] { main(); }) {}
  ~SimulatedStream() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  // `work` returns false to fail the stream.
  void enqueue(std::function<bool()> work) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(work));
    }
    cv_.notify_one();
  }
  bool failed() const { return failed_.load(); }

 private:
  void main() {
    std::unique_lock lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      auto work = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      if (!work()) failed_ = true;
      lock.lock();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<bool()>> queue_;
  bool stop_ = false;
  std::atomic<bool> failed_{false};
  std::thread thread_;
};

struct Marker {
  std::mutex mutex;
  std::condition_variable cv;
  bool reached = false;
  bool failed = false;
  int holds = 0;          // streams waiting on it (order_after)
  bool released = false;  // the processor is done with it
};

class SimulatedStreams final : public detail::GpuStreams {
 public:
  SimulatedStreams(int device, int per_class) : device_(device) {
    for (int i = 0; i < 2 * per_class; ++i) streams_.push_back(std::make_unique<SimulatedStream>());
  }
  int device() const override { return device_; }
  int lane_count() const override { return static_cast<int>(streams_.size()); }
  void bind_thread() override { binds_.fetch_add(1); }
  void* stream(int lane) override { return streams_[static_cast<std::size_t>(lane)].get(); }
  void* record(int lane) override {
    records_.fetch_add(1);
    auto* marker = new Marker;
    SimulatedStream* s = streams_[static_cast<std::size_t>(lane)].get();
    s->enqueue([marker, s] {
      std::lock_guard lock(marker->mutex);
      marker->reached = true;
      marker->failed = s->failed();
      marker->cv.notify_all();
      return true;
    });
    return marker;
  }
  FailureCause wait(void* handle) override {
    auto* marker = static_cast<Marker*>(handle);
    std::unique_lock lock(marker->mutex);
    marker->cv.wait(lock, [&] { return marker->reached; });
    return marker->failed ? make_failure(Errc::device, "simulated stream error") : nullptr;
  }
  // The stream blocks until the marker is reached (holding it until then, as the GPU does).
  void order_after(int lane, void* handle) override {
    auto* marker = static_cast<Marker*>(handle);
    {
      std::lock_guard lock(marker->mutex);
      ++marker->holds;
    }
    SimulatedStream* s = streams_[static_cast<std::size_t>(lane)].get();
    s->enqueue([marker] {
      std::unique_lock lock(marker->mutex);
      marker->cv.wait(lock, [&] { return marker->reached; });
      bool ok = !marker->failed;
      const bool last = --marker->holds == 0 && marker->released;
      lock.unlock();
      if (last) delete marker;
      return ok;  // a failed stream's error reaches the waiting one (sticky, as on a GPU)
    });
  }
  void release(void* handle) override {
    auto* marker = static_cast<Marker*>(handle);
    std::unique_lock lock(marker->mutex);
    marker->released = true;
    const bool last = marker->holds == 0;
    lock.unlock();
    if (last) delete marker;
    releases_.fetch_add(1);
  }
  int records() const { return records_.load(); }
  int releases() const { return releases_.load(); }
  int lane_of(const void* stream) const {
    for (std::size_t i = 0; i < streams_.size(); ++i)
      if (streams_[i].get() == stream) return static_cast<int>(i);
    return -1;
  }
  int binds() const { return binds_.load(); }

 private:
  int device_;
  std::vector<std::unique_ptr<SimulatedStream>> streams_;
  std::atomic<int> binds_{0}, records_{0}, releases_{0};
};

constexpr int kPerClass = 2;

// A runtime whose GPU processors run on simulated streams; `streams[d]` is GPU d's.
struct SimulatedGpus {
  explicit SimulatedGpus(int gpus, int cpu_workers = 2) : rt(RuntimeOptions{.cpu_workers = cpu_workers}) {
    streams.resize(static_cast<std::size_t>(gpus), nullptr);
    rt.impl().use_gpu_streams(gpus, [this](int device) {
      auto made = std::make_unique<SimulatedStreams>(device, kPerClass);
      streams[static_cast<std::size_t>(device)] = made.get();
      return made;
    });
  }
  static SimulatedStream& stream_of(TaskContext& ctx) { return *static_cast<SimulatedStream*>(ctx.gpu_stream); }
  Runtime rt;
  std::vector<SimulatedStreams*> streams;
};

using test::settles;
Processor gpu(int index) { return test::gpu_processor(index); }

TEST(TaskOnGpuProcessor, ProcessorsListsEveryGpu) {
  SimulatedGpus gpus(3);
  auto list = gpus.rt.processors();
  ASSERT_EQ(list.size(), 4u);
  EXPECT_EQ(list[0].kind, ProcessorKind::cpu);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(list[static_cast<std::size_t>(i + 1)].kind, ProcessorKind::gpu);
    EXPECT_EQ(list[static_cast<std::size_t>(i + 1)].index, i);
    EXPECT_EQ(list[static_cast<std::size_t>(i + 1)].rank, 0);
  }
}

TEST(TaskOnGpuProcessor, CompletesOnlyWhenItsStreamWorkHasFinished) {
  SimulatedGpus gpus(1);
  static std::atomic<bool> gate_open{false}, work_done{false}, body_returned{false};
  static std::atomic<int> device_seen{-2};
  gate_open = false;
  work_done = false;
  body_returned = false;
  TaskId t = test::task("gpu_processor_test.gated", [](TaskContext& ctx) {
    device_seen = ctx.gpu_device;
    SimulatedGpus::stream_of(ctx).enqueue([] {
      while (!gate_open.load()) std::this_thread::sleep_for(1ms);
      work_done = true;
      return true;
    });
    body_returned = true;
  });
  Event done = gpus.rt.spawn(t, {}, SpawnOptions{.processor = gpu(0)});
  for (int i = 0; i < 2000 && !body_returned.load(); ++i) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(body_returned.load());
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(done.has_triggered()) << "the task completed before the work on its stream ran";
  gate_open = true;
  ASSERT_TRUE(done.wait_for(10s));
  EXPECT_TRUE(work_done.load());
  EXPECT_EQ(device_seen.load(), 0);
  EXPECT_GE(gpus.streams[0]->binds(), 1) << "the body must start with its GPU current";
}

TEST(TaskOnGpuProcessor, CpuTasksSeeNoStream) {
  SimulatedGpus gpus(1);
  static std::atomic<int> device_seen{0};
  static std::atomic<void*> stream_seen{reinterpret_cast<void*>(1)};
  TaskId t = test::task("gpu_processor_test.on_cpu", [](TaskContext& ctx) {
    device_seen = ctx.gpu_device;
    stream_seen = ctx.gpu_stream;
  });
  gpus.rt.spawn(t).wait();
  EXPECT_EQ(device_seen.load(), -1);
  EXPECT_EQ(stream_seen.load(), nullptr);
}

// A chain alternating between the CPU processor and two GPUs: each link's precondition is the
// previous link's completion, so the work runs in chain order whatever the lanes.
TEST(TaskOnGpuProcessor, PreconditionsOrderWorkAcrossProcessors) {
  SimulatedGpus gpus(2);
  static std::mutex mutex;
  static std::vector<int> order;
  order.clear();
  TaskId t = test::task("gpu_processor_test.link", [](TaskContext& ctx) {
    int index = ctx.args_as<int>();
    auto append = [index] {
      std::this_thread::sleep_for(std::chrono::microseconds(200 * (index % 3)));
      std::lock_guard lock(mutex);
      order.push_back(index);
      return true;
    };
    if (ctx.gpu_stream) SimulatedGpus::stream_of(ctx).enqueue(append);
    else append();
  });
  constexpr int kLinks = 60;
  Event previous;
  for (int i = 0; i < kLinks; ++i) {
    Processor where = i % 3 == 0 ? Processor{} : gpu(i % 3 - 1);
    previous = gpus.rt.spawn(t, task_args(i), SpawnOptions{.precondition = previous, .priority = (i % 5) - 2, .processor = where});
  }
  ASSERT_TRUE(previous.wait_for(30s));
  ASSERT_EQ(order.size(), static_cast<std::size_t>(kLinks));
  for (int i = 0; i < kLinks; ++i) EXPECT_EQ(order[static_cast<std::size_t>(i)], i);
}

TEST(TaskOnGpuProcessor, PriorityPicksTheStreamClass) {
  SimulatedGpus gpus(1);
  static std::mutex mutex;
  static std::vector<std::pair<int, const void*>> seen;  // (priority, stream)
  seen.clear();
  TaskId t = test::task("gpu_processor_test.priority", [](TaskContext& ctx) {
    std::lock_guard lock(mutex);
    seen.emplace_back(ctx.args_as<int>(), ctx.gpu_stream);
  });
  std::vector<Event> done;
  for (int p : {-5, 0, 1, 7, 0, 3, -1, 1000, kMinPriority})
    done.push_back(gpus.rt.spawn(t, task_args(p), SpawnOptions{.priority = p, .processor = gpu(0)}));
  ASSERT_TRUE(merge_events(done).wait_for(10s));
  ASSERT_EQ(seen.size(), done.size());
  std::vector<int> low_lanes, high_lanes;
  for (auto [priority, stream] : seen) {
    int lane = gpus.streams[0]->lane_of(stream);
    ASSERT_GE(lane, 0) << "the body's stream is not one of its processor's";
    if (priority > 0) {
      EXPECT_GE(lane, kPerClass) << "priority " << priority << " ran on a low-priority stream";
      high_lanes.push_back(lane);
    } else {
      EXPECT_LT(lane, kPerClass) << "priority " << priority << " ran on a high-priority stream";
      low_lanes.push_back(lane);
    }
  }
  // Within a class, the lanes are used in turn.
  for (std::size_t i = 1; i < low_lanes.size(); ++i) EXPECT_NE(low_lanes[i], low_lanes[i - 1]);
  for (std::size_t i = 1; i < high_lanes.size(); ++i) EXPECT_NE(high_lanes[i], high_lanes[i - 1]);
}

// A queued task of higher priority is launched before lower ones that became ready earlier.
TEST(TaskOnGpuProcessor, ReadyTasksLaunchHighestPriorityFirst) {
  SimulatedGpus gpus(1);
  static std::atomic<bool> release{false};
  static std::mutex mutex;
  static std::vector<int> launched;
  release = false;
  launched.clear();
  TaskId blocker = test::task("gpu_processor_test.blocker", [](TaskContext&) {
    while (!release.load()) std::this_thread::sleep_for(1ms);  // holds the launcher
  });
  TaskId t = test::task("gpu_processor_test.record_launch", [](TaskContext& ctx) {
    std::lock_guard lock(mutex);
    launched.push_back(ctx.args_as<int>());
  });
  Event first = gpus.rt.spawn(blocker, {}, SpawnOptions{.processor = gpu(0)});
  std::this_thread::sleep_for(20ms);  // the launcher is inside the blocker now
  std::vector<Event> done{first};
  for (int p : {0, -3, 5, 2, 5, 900})
    done.push_back(gpus.rt.spawn(t, task_args(p), SpawnOptions{.priority = p, .processor = gpu(0)}));
  release = true;
  ASSERT_TRUE(merge_events(done).wait_for(10s));
  EXPECT_EQ(launched, (std::vector<int>{900, 5, 5, 2, 0, -3}));
}

TEST(TaskOnGpuProcessor, AStreamErrorPoisonsTheCompletionNamingTaskAndGpu) {
  SimulatedGpus gpus(2);
  TaskId bad = test::task("gpu_processor_test.faulting", [](TaskContext& ctx) {
    SimulatedGpus::stream_of(ctx).enqueue([] { return false; });
  });
  TaskId after = test::task("gpu_processor_test.after_fault", [](TaskContext&) {});
  Event failed = gpus.rt.spawn(bad, {}, SpawnOptions{.processor = gpu(1)});
  ASSERT_TRUE(settles(failed, 10s));
  EXPECT_EQ(failed.query(), EventState::poisoned);
  FailureCause cause = failed.failure();
  ASSERT_TRUE(cause);
  EXPECT_EQ(cause->code(), Errc::device);
  std::string what = cause->what();
  EXPECT_NE(what.find("gpu1"), std::string::npos) << what;
  EXPECT_NE(what.find("gpu_processor_test.faulting"), std::string::npos) << what;
  // Work that depends on it never runs, and carries the same cause.
  Event dependent = gpus.rt.spawn(after, {}, SpawnOptions{.precondition = failed, .processor = gpu(0)});
  ASSERT_TRUE(settles(dependent, 10s));
  EXPECT_EQ(dependent.failure(), cause);
}

TEST(TaskOnGpuProcessor, AThrowingBodyFailsAfterTheWorkItEnqueued) {
  SimulatedGpus gpus(1);
  static std::atomic<bool> gate_open{false}, work_done{false};
  gate_open = false;
  work_done = false;
  TaskId t = test::task("gpu_processor_test.throws", [](TaskContext& ctx) {
    SimulatedGpus::stream_of(ctx).enqueue([] {
      while (!gate_open.load()) std::this_thread::sleep_for(1ms);
      work_done = true;
      return true;
    });
    throw std::runtime_error("bad shape");
  });
  Event e = gpus.rt.spawn(t, {}, SpawnOptions{.processor = gpu(0)});
  std::this_thread::sleep_for(30ms);
  EXPECT_FALSE(e.has_triggered()) << "reported before the work the body had enqueued finished";
  gate_open = true;
  ASSERT_TRUE(settles(e, 10s));
  ASSERT_EQ(e.query(), EventState::poisoned);
  EXPECT_TRUE(work_done.load());
  EXPECT_EQ(e.failure()->code(), Errc::task_failed);
  EXPECT_NE(std::string(e.failure()->what()).find("bad shape"), std::string::npos);
}

TEST(TaskOnGpuProcessor, UnknownProcessorsAreRefusedNamingWhatExists) {
  SimulatedGpus gpus(2);
  TaskId t = test::task("gpu_processor_test.nothing", [](TaskContext&) {});
  CARAVAN_EXPECT_ERROR(gpus.rt.spawn(t, {}, SpawnOptions{.processor = gpu(2)}), Errc::invalid_argument,
                       "gpu0..gpu1");
  CARAVAN_EXPECT_ERROR(gpus.rt.spawn(t, {}, SpawnOptions{.processor = Processor{ProcessorKind::cpu, Processor::kThisRank, 1}}),
                       Errc::invalid_argument, "does not exist on this rank");
  CARAVAN_EXPECT_ERROR(gpus.rt.spawn(t, {}, SpawnOptions{.processor = Processor{ProcessorKind::gpu, 7, 0}}),
                       Errc::invalid_argument, "this job has 1 rank(s)");
}

TEST(TaskOnGpuProcessor, WithoutGpusSpawnSaysWhy) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  rt.impl().use_gpu_streams(0, nullptr);
  TaskId t = test::task("gpu_processor_test.nothing", [](TaskContext&) {});
  EXPECT_EQ(rt.processors().size(), 1u);
  CARAVAN_EXPECT_ERROR(rt.spawn(t, {}, SpawnOptions{.processor = gpu(0)}), Errc::invalid_argument, "no GPU processor");
}

// Shutdown with tasks in every state: launched tasks finish, queued and waiting ones are
// poisoned with shut_down, and nothing hangs.
TEST(TaskOnGpuProcessor, ShutdownFinishesLaunchedWorkAndPoisonsTheRest) {
  SimulatedGpus gpus(1);
  static std::atomic<int> ran{0};
  ran = 0;
  TaskId slow = test::task("gpu_processor_test.slow", [](TaskContext& ctx) {
    SimulatedGpus::stream_of(ctx).enqueue([] {
      std::this_thread::sleep_for(2ms);
      ran.fetch_add(1);
      return true;
    });
    std::this_thread::sleep_for(1ms);
  });
  // Outcomes are collected by callbacks: once the runtime is gone its events cannot be asked.
  std::atomic<int> succeeded{0}, shut_down{0}, other{0};
  auto count = [&](const FailureCause& failure) {
    if (!failure) succeeded.fetch_add(1);
    else if (failure->code() == Errc::shut_down) shut_down.fetch_add(1);
    else other.fetch_add(1);
  };
  UserEvent never = UserEvent::create();
  for (int i = 0; i < 50; ++i) gpus.rt.spawn(slow, {}, SpawnOptions{.processor = gpu(0)}).on_trigger(count);
  for (int i = 0; i < 10; ++i) {
    Event waiting = gpus.rt.spawn(slow, {}, SpawnOptions{.precondition = never, .processor = gpu(0)});
    waiting.on_trigger(count);
    // ... and one ordered on the GPU after each of those, held in the follow table.
    gpus.rt.spawn(slow, {}, SpawnOptions{.precondition = waiting, .processor = gpu(0), .order_on_gpu = true}).on_trigger(count);
  }
  std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(test::shuts_down_within(gpus.rt, 10s)) << "shutdown did not return within 10 s";
  EXPECT_EQ(succeeded + shut_down + other, 70) << "some completion never triggered";
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(succeeded.load(), ran.load()) << "a launched task must finish, and only launched ones run";
  EXPECT_GT(ran.load(), 0);
  EXPECT_GE(shut_down.load(), 20) << "tasks still waiting on preconditions must be poisoned";
}

// Shutdown while the launcher is inside a body: the tasks queued behind it never run; they are
// poisoned with shut_down.
TEST(TaskOnGpuProcessor, ShutdownPoisonsTasksQueuedBehindARunningBody) {
  SimulatedGpus gpus(1);
  static std::atomic<bool> release{false};
  static std::atomic<int> queued_ran{0};
  release = false;
  queued_ran = 0;
  TaskId blocker = test::task("gpu_processor_test.holds_launcher", [](TaskContext&) {
    while (!release.load()) std::this_thread::sleep_for(1ms);
  });
  TaskId queued = test::task("gpu_processor_test.queued", [](TaskContext&) { queued_ran.fetch_add(1); });
  std::atomic<int> blocker_ok{0}, shut_down{0}, other{0};
  gpus.rt.spawn(blocker, {}, SpawnOptions{.processor = gpu(0)}).on_trigger([&](const FailureCause& f) {
    if (!f) blocker_ok.fetch_add(1);
  });
  std::this_thread::sleep_for(20ms);  // the launcher is in the blocker now
  for (int i = 0; i < 20; ++i)
    gpus.rt.spawn(queued, {}, SpawnOptions{.processor = gpu(0)}).on_trigger([&](const FailureCause& f) {
      if (f && f->code() == Errc::shut_down) shut_down.fetch_add(1);
      else other.fetch_add(1);
    });
  std::thread stopper([&] { gpus.rt.shutdown(); });
  std::this_thread::sleep_for(200ms);  // shutdown has stopped the queue and waits for the launcher
  release = true;
  stopper.join();
  EXPECT_EQ(blocker_ok.load(), 1) << "the body running at shutdown finishes";
  EXPECT_EQ(queued_ran.load(), 0) << "a task queued behind it ran after shutdown began";
  EXPECT_EQ(shut_down.load(), 20);
  EXPECT_EQ(other.load(), 0);
}

// A long chain ordered on the GPU, all waiting behind its first link, fails as a whole when that
// link's precondition fails, without one stack frame per link.
TEST(TaskOnGpuProcessor, ALongChainOrderedOnTheGpuFailsWithoutRecursion) {
  SimulatedGpus gpus(1);
  static std::atomic<int> ran{0};
  ran = 0;
  TaskId t = test::task("gpu_processor_test.long_chain", [](TaskContext&) { ran.fetch_add(1); });
  UserEvent head = UserEvent::create();
  constexpr int kLinks = 50000;
  Event previous = head;
  for (int i = 0; i < kLinks; ++i)
    previous = gpus.rt.spawn(t, {}, SpawnOptions{.precondition = previous, .processor = gpu(0), .order_on_gpu = true});
  head.poison("the chain's input failed");
  ASSERT_TRUE(settles(previous, 60s));
  ASSERT_TRUE(previous.failure());
  EXPECT_NE(std::string(previous.failure()->what()).find("the chain's input failed"), std::string::npos);
  EXPECT_EQ(ran.load(), 0);
}

TEST(TaskOnGpuProcessor, UseGpuStreamsChecksItsArguments) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  CARAVAN_EXPECT_ERROR(rt.impl().use_gpu_streams(-1, nullptr), Errc::invalid_argument, "count = -1");
  CARAVAN_EXPECT_ERROR(rt.impl().use_gpu_streams(2, nullptr), Errc::invalid_argument, "factory is empty");
}

// Many threads spawn chains of tasks over two GPUs and the CPU with random priorities; every
// task's work runs exactly once, after its precondition's work, and every completion triggers.
TEST(TaskOnGpuProcessor, StressRandomGraphsOverTwoGpus) {
  SimulatedGpus gpus(2);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 600;
  constexpr int kTotal = kThreads * kPerThread;
  static std::vector<std::atomic<int>> runs(kTotal);
  static std::atomic<int> order_violations{0};
  for (auto& r : runs) r = 0;
  struct Args {
    int index;
    int depends_on;  // -1: none
  };
  TaskId t = test::task("gpu_processor_test.stress", [](TaskContext& ctx) {
    Args a = ctx.args_as<Args>();
    auto work = [a] {
      if (a.depends_on >= 0 && runs[static_cast<std::size_t>(a.depends_on)].load() != 1) order_violations.fetch_add(1);
      runs[static_cast<std::size_t>(a.index)].fetch_add(1);
      return true;
    };
    if (ctx.gpu_stream) SimulatedGpus::stream_of(ctx).enqueue(work);
    else work();
  });
  std::vector<std::vector<Event>> events(kThreads);
  std::vector<std::thread> spawners;
  for (int th = 0; th < kThreads; ++th) {
    spawners.emplace_back([&, th] {
      std::mt19937 rng(1234u + static_cast<unsigned>(th));
      auto& mine = events[static_cast<std::size_t>(th)];
      for (int i = 0; i < kPerThread; ++i) {
        int index = th * kPerThread + i;
        int dep_local = i > 0 && rng() % 3 != 0 ? static_cast<int>(rng() % static_cast<unsigned>(i)) : -1;
        Args a{index, dep_local >= 0 ? th * kPerThread + dep_local : -1};
        Processor where = rng() % 5 == 0 ? Processor{} : gpu(static_cast<int>(rng() % 2));
        int priority = static_cast<int>(rng() % 7) - 3;
        Event pre = dep_local >= 0 ? mine[static_cast<std::size_t>(dep_local)] : Event{};
        const bool on_gpu = rng() % 2 == 0;
        mine.push_back(gpus.rt.spawn(t, task_args(a), SpawnOptions{.precondition = pre, .priority = priority, .processor = where,
                                                                    .order_on_gpu = on_gpu}));
      }
    });
  }
  for (auto& s : spawners) s.join();
  std::vector<Event> all;
  for (auto& v : events) all.insert(all.end(), v.begin(), v.end());
  ASSERT_TRUE(merge_events(all).wait_for(60s)) << "tasks did not finish within 60 s";
  for (int i = 0; i < kTotal; ++i) ASSERT_EQ(runs[static_cast<std::size_t>(i)].load(), 1) << "task " << i;
  EXPECT_EQ(order_violations.load(), 0);
  for (SimulatedStreams* s : gpus.streams) EXPECT_EQ(s->records(), s->releases()) << "a marker was never released";
}

// order_on_gpu: the follower's body runs while its precondition's work is still running, its
// own work waits for that work on the stream, and it completes after it.
TEST(TaskOnGpuProcessor, OrderedOnTheGpuLaunchesBeforeThePreconditionsWorkFinishes) {
  SimulatedGpus gpus(2);
  static std::atomic<bool> gate_open{false}, follower_body_ran{false};
  static std::mutex mutex;
  static std::vector<int> order;
  gate_open = false;
  follower_body_ran = false;
  order.clear();
  TaskId first = test::task("gpu_processor_test.gated_first", [](TaskContext& ctx) {
    SimulatedGpus::stream_of(ctx).enqueue([] {
      while (!gate_open.load()) std::this_thread::sleep_for(1ms);
      std::lock_guard lock(mutex);
      order.push_back(1);
      return true;
    });
  });
  TaskId second = test::task("gpu_processor_test.follower", [](TaskContext& ctx) {
    follower_body_ran = true;
    SimulatedGpus::stream_of(ctx).enqueue([] {
      std::lock_guard lock(mutex);
      order.push_back(2);
      return true;
    });
  });
  Event a = gpus.rt.spawn(first, {}, SpawnOptions{.processor = gpu(0)});
  // On the other GPU, so that only the wait on the marker orders the two.
  Event b = gpus.rt.spawn(second, {}, SpawnOptions{.precondition = a, .processor = gpu(1), .order_on_gpu = true});
  for (int i = 0; i < 2000 && !follower_body_ran.load(); ++i) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(follower_body_ran.load()) << "the follower waited for its precondition's work on the host";
  std::this_thread::sleep_for(10ms);
  EXPECT_FALSE(a.has_triggered());
  EXPECT_FALSE(b.has_triggered());
  {
    std::lock_guard lock(mutex);
    EXPECT_TRUE(order.empty()) << "the follower's work ran before its precondition's";
  }
  gate_open = true;
  ASSERT_TRUE(b.wait_for(10s));
  EXPECT_TRUE(a.has_triggered());
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

// A follower spawned before its precondition task is launched waits for it; if that task's body
// throws, or its own precondition fails, the follower never runs and carries the same cause.
TEST(TaskOnGpuProcessor, OrderedOnTheGpuNeverRunsAfterAFailedPrecondition) {
  SimulatedGpus gpus(1);
  static std::atomic<int> follower_runs{0};
  follower_runs = 0;
  TaskId throws = test::task("gpu_processor_test.throws_early", [](TaskContext&) { throw std::runtime_error("no luck"); });
  TaskId follower = test::task("gpu_processor_test.must_not_run", [](TaskContext&) { follower_runs.fetch_add(1); });
  TaskId fine = test::task("gpu_processor_test.fine", [](TaskContext&) {});

  UserEvent go = UserEvent::create();
  Event a = gpus.rt.spawn(throws, {}, SpawnOptions{.precondition = go, .processor = gpu(0)});
  Event b = gpus.rt.spawn(follower, {}, SpawnOptions{.precondition = a, .processor = gpu(0), .order_on_gpu = true});
  Event c = gpus.rt.spawn(follower, {}, SpawnOptions{.precondition = b, .processor = gpu(0), .order_on_gpu = true});
  go.trigger();
  // The followers fail as soon as the body has thrown; a's own completion waits for the work
  // the body had enqueued (none here), so it may come a little later.
  ASSERT_TRUE(settles(c, 10s));
  ASSERT_TRUE(settles(a, 10s));
  EXPECT_EQ(a.query(), EventState::poisoned);
  EXPECT_EQ(b.failure(), a.failure());
  EXPECT_EQ(c.failure(), a.failure());

  UserEvent doomed = UserEvent::create();
  Event d = gpus.rt.spawn(fine, {}, SpawnOptions{.precondition = doomed, .processor = gpu(0)});
  Event e = gpus.rt.spawn(follower, {}, SpawnOptions{.precondition = d, .processor = gpu(0), .order_on_gpu = true});
  doomed.poison("upstream failed");
  ASSERT_TRUE(settles(e, 10s));
  ASSERT_TRUE(e.failure());
  EXPECT_EQ(e.failure(), d.failure());
  EXPECT_EQ(follower_runs.load(), 0);
}

// A chain of 300 links over two GPUs and the CPU, every GPU link ordered on the GPU: the work
// runs in chain order (CPU links take the usual path: their precondition is not a GPU task,
// and a GPU task after a CPU task waits for it on the host).
TEST(TaskOnGpuProcessor, ChainsOrderedOnTheGpuKeepTheirOrder) {
  SimulatedGpus gpus(2);
  static std::mutex mutex;
  static std::vector<int> order;
  order.clear();
  TaskId t = test::task("gpu_processor_test.gpu_link", [](TaskContext& ctx) {
    int index = ctx.args_as<int>();
    auto append = [index] {
      std::lock_guard lock(mutex);
      order.push_back(index);
      return true;
    };
    if (ctx.gpu_stream) SimulatedGpus::stream_of(ctx).enqueue(append);
    else append();
  });
  constexpr int kLinks = 300;
  Event previous;
  for (int i = 0; i < kLinks; ++i) {
    Processor where = i % 10 == 9 ? Processor{} : gpu(i % 2);
    previous = gpus.rt.spawn(t, task_args(i), SpawnOptions{.precondition = previous, .processor = where, .order_on_gpu = true});
  }
  ASSERT_TRUE(previous.wait_for(30s));
  ASSERT_EQ(order.size(), static_cast<std::size_t>(kLinks));
  for (int i = 0; i < kLinks; ++i) EXPECT_EQ(order[static_cast<std::size_t>(i)], i);
}

// test::shuts_down_within (10 s) for simulated GPUs this test owns: on a hang they are leaked with
// `keep` (what their tasks write to), so that nothing is destroyed under the hung shutdown.
bool shuts_down_within_10s(std::unique_ptr<SimulatedGpus>& gpus, std::shared_ptr<void> keep) {
  if (test::shuts_down_within(gpus->rt, 10s)) return true;
  (void)gpus.release();
  new std::shared_ptr<void>(std::move(keep));  // leaked on purpose
  return false;
}

// What the shutdown tests' tasks write: whether they started, and how their wait ended (1 ok,
// 2 poisoned with shut_down, 3 otherwise).
struct WaitState {
  std::atomic<int> started{0};
  std::atomic<int> outcome{0};
  std::atomic<int> behind_code{-1};
};

struct WaitArgs {
  Event event;
  WaitState* state;
};

void wait_and_record(TaskContext& ctx) {
  const auto a = ctx.args_as<WaitArgs>();
  a.state->started.store(1);
  try {
    a.event.wait();
    a.state->outcome.store(1);
  } catch (const EventPoisoned& e) {
    a.state->outcome.store(e.cause() && e.cause()->code() == Errc::shut_down ? 2 : 3);
  }
}

// Shutdown while a CPU task waits on a chain of GPU tasks that is still running: the CPU worker
// is blocked, but the GPU work progresses, so shutdown lets the chain finish instead of poisoning
// the GPU tasks not yet launched (each waits on the one before on the host).
TEST(TaskOnGpuProcessor, ShutdownLetsACpuTaskWaitOnGpuWorkThatProgresses) {
  auto gpus = std::make_unique<SimulatedGpus>(1, /*cpu_workers=*/1);
  static std::atomic<int> gpu_ran{0};
  gpu_ran = 0;
  TaskId slow = test::task("gpu_processor_test.slow_link", [](TaskContext& ctx) {
    SimulatedGpus::stream_of(ctx).enqueue([] {
      std::this_thread::sleep_for(60ms);
      gpu_ran.fetch_add(1);
      return true;
    });
  });
  TaskId wait_on = test::task("gpu_processor_test.wait_and_record", wait_and_record);
  constexpr int kLinks = 4;
  Event link;
  for (int i = 0; i < kLinks; ++i)
    link = gpus->rt.spawn(slow, {}, SpawnOptions{.precondition = link, .processor = gpu(0)});
  auto state = std::make_shared<WaitState>();
  gpus->rt.spawn(wait_on, task_args(WaitArgs{link, state.get()}));
  for (int i = 0; i < 5000 && state->started.load() == 0; ++i) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(state->started.load(), 1);
  ASSERT_TRUE(shuts_down_within_10s(gpus, state)) << "shutdown did not return within 10 s";
  EXPECT_EQ(gpu_ran.load(), kLinks) << "GPU tasks of a progressing chain were cut short";
  EXPECT_EQ(state->outcome.load(), 1) << "the CPU task's wait on the chain should have succeeded";
}

// A GPU task's body blocked in Event::wait on a user event nobody triggers (it runs on the
// launcher thread, which stopping the GPU joins): shutdown poisons the user event so that the body
// returns, instead of hanging; the task queued behind it fails with shut_down.
TEST(TaskOnGpuProcessor, ShutdownFreesABodyBlockedOnAUserEvent) {
  auto gpus = std::make_unique<SimulatedGpus>(1, /*cpu_workers=*/1);
  TaskId blocked = test::task("gpu_processor_test.wait_and_record", wait_and_record);
  TaskId nothing = test::task("gpu_processor_test.nothing_behind", [](TaskContext&) {});
  UserEvent never = UserEvent::create();
  auto state = std::make_shared<WaitState>();
  gpus->rt.spawn(blocked, task_args(WaitArgs{never, state.get()}), SpawnOptions{.processor = gpu(0)});
  gpus->rt.spawn(nothing, {}, SpawnOptions{.processor = gpu(0)}).on_trigger([state](const FailureCause& f) {
    state->behind_code = f ? static_cast<int>(f->code()) : -2;
  });
  // Shut down as soon as the body has started: it may not have reached its wait yet.
  for (int i = 0; i < 5000 && state->started.load() == 0; ++i) std::this_thread::sleep_for(100us);
  ASSERT_EQ(state->started.load(), 1);
  ASSERT_TRUE(shuts_down_within_10s(gpus, state)) << "shutdown did not return within 10 s";
  EXPECT_EQ(state->outcome.load(), 2) << "the body's wait should have ended with Errc::shut_down";
  EXPECT_EQ(state->behind_code.load(), static_cast<int>(Errc::shut_down)) << "the task queued behind the body";
}

// A CPU task W waits on GPU task X, whose body waits on W's completion: nothing can ever move, and
// no user event is pending. Shutdown must fail the pending events without first joining X's
// launcher (which would wait forever).
TEST(TaskOnGpuProcessor, ShutdownBreaksACycleThroughAGpuBody) {
  struct Cycle {
    WaitState body, cpu;
    Event w;  // set before X's body runs (X waits on the gate)
  };
  struct BodyArgs {
    Cycle* cycle;
  };
  auto gpus = std::make_unique<SimulatedGpus>(1, /*cpu_workers=*/1);
  TaskId waits = test::task("gpu_processor_test.wait_and_record", wait_and_record);
  TaskId waits_on_w = test::task("gpu_processor_test.wait_on_w", [](TaskContext& ctx) {
    Cycle* c = ctx.args_as<BodyArgs>().cycle;
    c->body.started.store(1);
    try {
      c->w.wait();
      c->body.outcome.store(1);
    } catch (const EventPoisoned& e) {
      c->body.outcome.store(e.cause() && e.cause()->code() == Errc::shut_down ? 2 : 3);
    }
  });
  auto cycle = std::make_shared<Cycle>();
  UserEvent gate = UserEvent::create();
  Event x = gpus->rt.spawn(waits_on_w, task_args(BodyArgs{cycle.get()}),
                           SpawnOptions{.precondition = gate, .processor = gpu(0)});
  cycle->w = gpus->rt.spawn(waits, task_args(WaitArgs{x, &cycle->cpu}));
  gate.trigger();
  for (int i = 0; i < 5000 && (cycle->body.started.load() == 0 || cycle->cpu.started.load() == 0); ++i)
    std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(shuts_down_within_10s(gpus, cycle)) << "shutdown did not return within 10 s";
  EXPECT_EQ(cycle->cpu.outcome.load(), 2) << "the CPU task's wait on X should have ended with Errc::shut_down";
  // Poisoning X wakes W, which returns: if that happens before the poisoning reaches W's own
  // event, W has simply finished, and the body's wait succeeds. Either way it must have ended.
  EXPECT_TRUE(cycle->body.outcome.load() == 1 || cycle->body.outcome.load() == 2) << cycle->body.outcome.load();
}

}  // namespace
}  // namespace caravan
