// Copies on an asynchronous channel that takes requests from any thread (as the GPU channels do):
// the engine's caller then submits a copy's first request itself when the channel is idle
// (DmaWorker::add), and the DMA worker the rest. Run under ThreadSanitizer in CI, where there is
// no GPU: the channels here are the host ones, run on a thread of their own.
#include "runtime/dma/engine.h"
#include "channels/file_channel.h"
#include "channels/memcpy_channel.h"
#include "runtime/progress.h"
#include "tests/dma/dma_test_util.h"

#include <caravan/settings.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

namespace caravan {
namespace {

using namespace std::chrono_literals;
using test::sys_memory;

// Any synchronous channel made asynchronous, as the GPU channels are: submit() (from any thread)
// queues the request, and the wrapper's own thread runs it through the wrapped channel, which
// completes it there. Records which threads submitted; can hold requests back, or refuse them
// inside submit().
class AsyncChannel final : public dma::Channel {
 public:
  explicit AsyncChannel(std::unique_ptr<dma::Channel> inner) : inner_(std::move(inner)), thread_([this] { run(); }) {}
  ~AsyncChannel() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  ChannelKind kind() const noexcept override { return inner_->kind(); }
  bool serves(MemoryId src, MemoryId dst) const noexcept override { return inner_->serves(src, dst); }
  int window() const noexcept override { return 4; }
  bool submits_from_any_thread() const noexcept override { return true; }
  void submit(const dma::Request& request, Completion done) override {
    if (fail_inline_.load()) {  // a channel that refuses at once, inside submit()
      done(make_failure(Errc::device, "the test channel refused the request"));
      return;
    }
    std::lock_guard lock(mutex_);
    queue_.push_back({request, std::move(done)});
    submitters_.insert(std::this_thread::get_id());
    log_.push_back({std::this_thread::get_id(), request.bytes});
    cv_.notify_all();
  }
  void fail_inline(bool on) { fail_inline_.store(on); }
  // The thread that runs the requests and their completions.
  std::thread::id thread_id() const { return thread_.get_id(); }
  std::set<std::thread::id> submitters() {
    std::lock_guard lock(mutex_);
    return submitters_;
  }
  struct Submitted {
    std::thread::id thread;
    std::uint64_t bytes;
  };
  std::vector<Submitted> log() {
    std::lock_guard lock(mutex_);
    return log_;
  }
  // While held, requests queue up and none runs.
  void hold(bool on) {
    {
      std::lock_guard lock(mutex_);
      held_ = on;
    }
    cv_.notify_all();
  }

 private:
  struct Queued {
    dma::Request request;
    Completion done;
  };
  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !held_); });
      if (queue_.empty()) return;
      Queued q = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      inner_->submit(q.request, std::move(q.done));
      lock.lock();
    }
  }

  std::unique_ptr<dma::Channel> inner_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  std::set<std::thread::id> submitters_;
  std::vector<Submitted> log_;
  std::atomic<bool> fail_inline_{false};
  bool held_ = false;
  bool stop_ = false;
  std::thread thread_;
};

const FieldSpace kFields({{"a", 8}, {"b", 8}});
const std::string kChannel = "memcpy node0/rank0/sys->node0/rank0/sys";

// Puts the sys -> sys memcpy channel, made asynchronous, in place of the runtime's own.
AsyncChannel& use_async_memcpy() {
  auto channel = std::make_unique<AsyncChannel>(std::make_unique<channels::MemcpyChannel>(1, 0));
  AsyncChannel& async = *channel;
  dma::Engine::current().replace_channel_for_testing(kChannel, std::move(channel));
  return async;
}

// Four threads each make 60 copies of up to 256 KiB, at random priorities, three at a time in
// flight: every destination holds its source, every copy's event triggers, and the calling
// threads submitted some of the requests themselves.
TEST(CopyOnAnAsynchronousChannel, ManyThreadsManyCopiesEveryByteLands) {
  settings::ScopedOverride tiles("CARAVAN_DMA_TILE_BYTES", "16K");
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  AsyncChannel* async = &use_async_memcpy();

  constexpr int kThreads = 4, kCopies = 60;
  std::atomic<int> failures{0};
  std::vector<std::thread::id> callers(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      callers[static_cast<std::size_t>(t)] = std::this_thread::get_id();
      std::mt19937 rng(static_cast<unsigned>(1000 + t));
      struct InFlight {
        Instance src, dst;
        std::uint64_t seed;
        Event done;
      };
      std::deque<InFlight> flying;
      auto land = [&] {
        InFlight f = std::move(flying.front());
        flying.pop_front();
        if (!f.done.wait_for(20s) || test::count_mismatches(f.dst, f.seed) != 0) failures.fetch_add(1);
      };
      for (int c = 0; c < kCopies; ++c) {
        const std::int64_t points = 1 + static_cast<std::int64_t>(rng() % (16 * 1024));  // 16 B each
        const Rect space = Rect::from_extents({points});
        InFlight f{Instance::create(sys_memory(), space, kFields, Layout::parse("F,x")),
                   Instance::create(sys_memory(), space, kFields, Layout::parse(rng() % 2 ? "F,x" : "x,F")),
                   static_cast<std::uint64_t>(t) * 1000 + static_cast<std::uint64_t>(c), Event()};
        test::write_pattern(f.src, f.seed);
        test::poison(f.dst);
        f.done = copy(f.src, f.dst, {.priority = static_cast<int>(rng() % 3) - 1});
        flying.push_back(std::move(f));
        if (flying.size() == 3) land();
      }
      while (!flying.empty()) land();
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0) << "copies that did not land intact within 20 s";
  const std::set<std::thread::id> submitters = async->submitters();
  int from_callers = 0;
  for (const auto& id : callers) from_callers += submitters.count(id) ? 1 : 0;
  EXPECT_GT(from_callers, 0) << "no calling thread submitted a first request itself";
  EXPECT_GT(submitters.size(), static_cast<std::size_t>(from_callers)) << "the DMA worker submitted no request";
  EXPECT_EQ(dma::Engine::current().stats().active_copies, 0u);
}

// A copy made while the channel has a request in flight is issued by the DMA worker, not by the
// calling thread (only a copy alone on an idle channel is issued directly), and both land.
TEST(CopyOnAnAsynchronousChannel, BusyChannelLeavesIssuingToTheWorker) {
  settings::ScopedOverride tiles("CARAVAN_DMA_TILE_BYTES", "16K");
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  AsyncChannel* async = &use_async_memcpy();
  const Rect big = Rect::from_extents({1 << 14}), small = Rect::from_extents({64});  // 256 KiB; 1 KiB
  Instance a = Instance::create(sys_memory(), big, kFields, Layout::parse("F,x"));
  Instance b = Instance::create(sys_memory(), big, kFields, Layout::parse("F,x"));
  Instance c = Instance::create(sys_memory(), small, kFields, Layout::parse("F,x"));
  Instance d = Instance::create(sys_memory(), small, kFields, Layout::parse("x,F"));
  test::write_pattern(a, 1);
  test::write_pattern(c, 2);
  test::poison(b);
  test::poison(d);
  async->hold(true);
  Event low = copy(a, b, {.priority = -1});  // alone on the idle channel: issued here
  Event high = copy(c, d, {.priority = 1});  // the low copy's request is in flight
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  auto small_submitted = [&] {
    for (const auto& s : async->log())
      if (s.bytes == 64 * kFields.total_size()) return true;
    return false;
  };
  while (!small_submitted() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  const bool seen = small_submitted();
  async->hold(false);
  ASSERT_TRUE(seen) << "the worker did not submit the second copy's request within 10 s";
  ASSERT_TRUE(high.wait_for(20s));
  ASSERT_TRUE(low.wait_for(20s));
  EXPECT_EQ(test::count_mismatches(b, 1), 0u);
  EXPECT_EQ(test::count_mismatches(d, 2), 0u);
  const std::vector<AsyncChannel::Submitted> log = async->log();
  ASSERT_FALSE(log.empty());
  EXPECT_EQ(log.front().thread, std::this_thread::get_id()) << "the first copy's first request, on an idle channel";
  for (const auto& s : log) {
    if (s.bytes == 64 * kFields.total_size()) {
      EXPECT_NE(s.thread, std::this_thread::get_id()) << "the second copy was issued by its caller on a busy channel";
    }
  }
}

// How many of the channel's requests so far came from the calling thread.
std::size_t submitted_by_this_thread(AsyncChannel& async) {
  std::size_t n = 0;
  for (const auto& s : async.log()) n += s.thread == std::this_thread::get_id() ? 1 : 0;
  return n;
}

// dsk -> sys -> dsk through a bounded buffer of 3 slots, the first hop on an asynchronous
// channel: that hop may run 3 tiles ahead of the second, a request each. (A copy of one hop
// would be one tile here: its tiles grow to a full-speed request of the channel.)
// Its settings, made before the Runtime (which reads them); the path itself after it, so that its
// instances go before the Runtime does.
constexpr std::int64_t kBoundedPoints = 1 << 16;  // 1 MiB: tiles of a third of 64 KiB, 48 of them
struct BoundedBufferSettings {
  settings::ScopedOverride threshold{
      "CARAVAN_PLANNER_BUFFER_THRESHOLD",
      std::to_string(kBoundedPoints* static_cast<std::int64_t>(kFields.total_size()) / 16)};
  settings::ScopedOverride slots{"CARAVAN_DMA_SLOTS", "3"};
};
struct ThroughABoundedBuffer {
  AsyncChannel* first_hop = nullptr;
  Instance src, dst, dst2;

  void start() {
    auto channel = std::make_unique<AsyncChannel>(std::make_unique<channels::FileChannel>());
    first_hop = channel.get();
    dma::Engine::current().replace_channel_for_testing("file node0/rank0/dsk->node0/rank0/sys", std::move(channel));
    const Rect space = Rect::from_extents({kBoundedPoints});
    src = Instance::create(test::dsk_memory(), space, kFields, Layout::parse("F,x"));
    dst = Instance::create(test::dsk_memory(), space, kFields, Layout::parse("F,x"));
    dst2 = Instance::create(test::dsk_memory(), space, kFields, Layout::parse("F,x"));
    test::write_pattern(src, 7);
  }
  // Copies src into `to` with the first hop's channel held, and returns how many of its requests
  // the calling thread submitted inside copy(); `done` gets the copy's event.
  std::size_t copy_held(const Instance& to, Event& done) {
    const std::size_t before = submitted_by_this_thread(*first_hop);
    first_hop->hold(true);
    done = copy(src, to);
    const std::size_t from_caller = submitted_by_this_thread(*first_hop) - before;
    first_hop->hold(false);
    return from_caller;
  }
  static void expect_landed(Event& done, const Instance& to) {
    EXPECT_TRUE(done.wait_for(60s));
    EXPECT_EQ(test::count_mismatches(to, 7), 0u);
  }
};

// A copy alone on an idle channel whose DMA worker sleeps (it stopped polling for work): the
// calling thread fills the window (4) itself rather than wait for the worker to wake, up to
// what the copy may have in progress (3 tiles ahead of the next hop).
TEST(CopyOnAnAsynchronousChannel, CallerFillsTheWindowWhileTheWorkerSleeps) {
  settings::ScopedOverride spin("CARAVAN_GPU_WORKER_SPIN_US", "0");  // the worker sleeps as soon as it is idle
  BoundedBufferSettings bounded;
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  ThroughABoundedBuffer path;
  path.start();
  // The worker must be in its wait when copy() looks: a fresh worker gets there within
  // microseconds, but a loaded machine (ThreadSanitizer, 2 cores) may delay it, so a copy that
  // found it awake (1 request from the caller) is tried again after a longer pause.
  std::size_t from_caller = 0;
  for (int attempt = 1; attempt <= 10 && from_caller != 3; ++attempt) {
    std::this_thread::sleep_for(attempt * 100ms);
    test::poison(path.dst);
    Event done;
    from_caller = path.copy_held(path.dst, done);
    ThroughABoundedBuffer::expect_landed(done, path.dst);
  }
  EXPECT_EQ(from_caller, 3u);
}

// The same copy while the worker polls for work (right after a copy's end, within
// CARAVAN_GPU_WORKER_SPIN_US): the caller submits the first request only and leaves the rest
// to the worker, which takes them at once.
TEST(CopyOnAnAsynchronousChannel, CallerSubmitsOneRequestWhileTheWorkerPolls) {
  settings::ScopedOverride spin("CARAVAN_GPU_WORKER_SPIN_US", "1000000");  // polls for 1 s after each event
  BoundedBufferSettings bounded;
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  ThroughABoundedBuffer path;
  path.start();
  test::poison(path.dst);
  test::poison(path.dst2);
  Event first, second;
  path.copy_held(path.dst, first);
  ASSERT_TRUE(first.wait_for(60s));
  const std::size_t from_caller = path.copy_held(path.dst2, second);  // at once: the worker polls
  ThroughABoundedBuffer::expect_landed(second, path.dst2);
  ThroughABoundedBuffer::expect_landed(first, path.dst);
  EXPECT_EQ(from_caller, 1u);
}

// The completion of a copy's last request, run on the channel's own thread, finishes the copy
// there: the DMA worker (asleep here) is not woken to retire it, which on the GPU machine cost
// 150-200 us between a copy's last byte and its event.
TEST(CopyOnAnAsynchronousChannel, TheLastCompletionFinishesTheCopyOnItsThread) {
  settings::ScopedOverride spin("CARAVAN_GPU_WORKER_SPIN_US", "0");  // the worker sleeps as soon as it is idle
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  AsyncChannel& async = use_async_memcpy();
  const Rect space = Rect::from_extents({4096});
  Instance a = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x"));
  Instance b = Instance::create(sys_memory(), space, kFields, Layout::parse("x,F"));
  test::write_pattern(a, 11);
  for (int c = 0; c < 20; ++c) {
    test::poison(b);
    std::atomic<bool> called{false};
    std::thread::id triggered_on;
    // Held until copy() has returned: a request that completed while the caller was still
    // submitting (the copy's XD counts as being cut then) is retired by the worker.
    async.hold(true);
    Event done = copy(a, b);
    async.hold(false);
    done.on_trigger([&](const FailureCause&) {
      triggered_on = std::this_thread::get_id();
      called.store(true);
    });
    ASSERT_TRUE(done.wait_for(20s));
    const auto give_up = std::chrono::steady_clock::now() + 20s;
    while (!called.load() && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    ASSERT_TRUE(called.load());
    EXPECT_EQ(test::count_mismatches(b, 11), 0u);
    // The callback runs on the thread that triggered the event, or here if it had triggered by
    // the time on_trigger was called.
    if (triggered_on != std::this_thread::get_id()) {
      EXPECT_EQ(triggered_on, async.thread_id()) << "copy " << c << " was finished by another thread than the channel's";
    }
  }
  EXPECT_EQ(dma::Engine::current().stats().active_copies, 0u);
}

// The copy's event triggers on the channel's thread, inside the engine's finish(), which still
// uses the engine afterwards: a runtime shut down the moment the event is seen must wait for that
// (the engine counts finishes in progress, and joins its channels' threads before the rest of it
// goes) rather than tear the engine down under it. A stress test, run under AddressSanitizer and
// ThreadSanitizer in CI: with both fixes taken out it still passed on the build machine (the
// engine's members were destroyed but not yet freed when the late thread used them), so it
// guards against crashes and hangs on this path, not that precise ordering.
TEST(CopyOnAnAsynchronousChannel, ShutdownRightAfterTheLastEventWaitsForTheFinishingThread) {
  settings::ScopedOverride spin("CARAVAN_GPU_WORKER_SPIN_US", "0");
  for (int round = 0; round < 20; ++round) {
    Runtime rt(RuntimeOptions{.cpu_workers = 1});
    AsyncChannel& channel = use_async_memcpy();
    auto async_channel = [&]() -> AsyncChannel& { return channel; };
    const Rect space = Rect::from_extents({1024});
    Instance a = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x"));
    Instance b = Instance::create(sys_memory(), space, kFields, Layout::parse("x,F"));
    test::write_pattern(a, static_cast<std::uint64_t>(round));
    async_channel().hold(true);  // the callback below is in place before the copy can finish
    Event done = copy(a, b);
    // Runs inside the trigger, on the finishing thread, and holds it there a while after the
    // event is seen triggered: the widest window for the shutdown below.
    done.on_trigger([](const FailureCause&) { std::this_thread::sleep_for(5ms); });
    async_channel().hold(false);
    const auto give_up = std::chrono::steady_clock::now() + 20s;
    while (!done.has_triggered() && std::chrono::steady_clock::now() < give_up) {
    }
    ASSERT_TRUE(done.has_triggered()) << "round " << round;
    EXPECT_EQ(test::count_mismatches(b, static_cast<std::uint64_t>(round)), 0u);
  }  // instances, then the runtime, go at once
}

// A channel whose service thread is slow to notice finished requests (2 s here; a sleeping
// thread took 150-200 us on the GPU machine) and which registers a progress hook, as the GPU
// channels' queues do: the bytes move inside submit(), and the completion waits for the service
// thread, unless a thread waiting for an event runs it first through help().
class SleepyChannel final : public dma::Channel, public detail::ProgressHook {
 public:
  SleepyChannel() : inner_(1, 0), thread_([this] { run(); }) {
    if (detail::waiting_threads_help()) hooked_ = detail::add_progress_hook(this);
  }
  ~SleepyChannel() override {
    if (hooked_) detail::remove_progress_hook(this);
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  ChannelKind kind() const noexcept override { return inner_.kind(); }
  bool serves(MemoryId src, MemoryId dst) const noexcept override { return inner_.serves(src, dst); }
  int window() const noexcept override { return 2; }
  bool submits_from_any_thread() const noexcept override { return true; }
  void submit(const dma::Request& request, Completion done) override {
    FailureCause failure;
    inner_.submit(request, [&](const FailureCause& f) { failure = f; });
    std::lock_guard lock(mutex_);
    finished_.push_back({std::move(done), failure, std::chrono::steady_clock::now()});
    cv_.notify_all();
  }
  void help() noexcept override { complete_front(true); }
  int helped() const { return helped_.load(); }

 private:
  struct Finished {
    Completion done;
    FailureCause failure;
    std::chrono::steady_clock::time_point at;
  };
  // One completion at a time, in order, whoever runs it (as gpu::CopyQueue).
  bool complete_front(bool helping) {
    std::unique_lock lock(mutex_);
    if (completing_ || finished_.empty()) return false;
    if (!helping && std::chrono::steady_clock::now() < finished_.front().at + kNoticeDelay) return false;
    Finished f = std::move(finished_.front());
    finished_.pop_front();
    completing_ = true;
    lock.unlock();
    f.done(f.failure);
    if (helping) helped_.fetch_add(1);
    lock.lock();
    completing_ = false;
    return true;
  }
  void run() {
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        if (stop_) return;
        cv_.wait_for(lock, 10ms);
      }
      while (complete_front(false)) {
      }
    }
  }
  static constexpr auto kNoticeDelay = 2s;
  channels::MemcpyChannel inner_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Finished> finished_;
  bool completing_ = false, stop_ = false, hooked_ = false;
  std::atomic<int> helped_{0};
  std::thread thread_;
};

void copies_through_a_sleepy_channel(bool helps) {
  settings::ScopedOverride help("CARAVAN_WAIT_HELPS", helps ? "true" : "false");
  settings::ScopedOverride spin("CARAVAN_WAIT_SPIN_US", "1000000");  // waiters poll (and help) for 1 s
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  auto channel = std::make_unique<SleepyChannel>();
  SleepyChannel& sleepy = *channel;
  dma::Engine::current().replace_channel_for_testing(kChannel, std::move(channel));
  const Rect space = Rect::from_extents({1 << 14});
  Instance a = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x"));
  Instance b = Instance::create(sys_memory(), space, kFields, Layout::parse("x,F"));
  test::write_pattern(a, 5);
  const int copies = helps ? 3 : 1;  // 2 s each with helping off
  for (int c = 0; c < copies; ++c) {
    test::poison(b);
    const auto start = std::chrono::steady_clock::now();
    Event done = copy(a, b);
    ASSERT_TRUE(done.wait_for(30s));
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_EQ(test::count_mismatches(b, 5), 0u);
    if (helps)
      EXPECT_LT(took, 1s) << "copy " << c << ": the waiting thread did not finish it";
    else
      EXPECT_GE(took, 2s) << "copy " << c << ": finished before the service thread noticed it, with helping off";
  }
  if (helps)
    EXPECT_GE(sleepy.helped(), copies);
  else
    EXPECT_EQ(sleepy.helped(), 0);
  EXPECT_EQ(dma::Engine::current().stats().active_copies, 0u);
}

TEST(CopyOnAnAsynchronousChannel, AWaitingThreadFinishesRequestsOfASleepyChannel) {
  copies_through_a_sleepy_channel(true);
}

TEST(CopyOnAnAsynchronousChannel, WithHelpingOffTheSleepyChannelsThreadFinishesThem) {
  copies_through_a_sleepy_channel(false);
}

// A channel that fails the first request inside submit(), on the calling thread: the copy's
// event is poisoned with that failure, nothing hangs, and the engine is left idle.
TEST(CopyOnAnAsynchronousChannel, AFailureInsideTheFirstSubmitPoisonsTheCopy) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  use_async_memcpy().fail_inline(true);
  Instance a = Instance::create(sys_memory(), Rect::from_extents({1024}), kFields, Layout::parse("F,x"));
  Instance b = Instance::create(sys_memory(), Rect::from_extents({1024}), kFields, Layout::parse("F,x"));
  for (int c = 0; c < 3; ++c) {
    Event e = copy(a, b);
    try {
      ASSERT_TRUE(e.wait_for(20s)) << "the copy did not end within 20 s";
      ADD_FAILURE() << "the copy succeeded on a channel that refuses every request";
    } catch (const EventPoisoned& err) {
      EXPECT_NE(std::string(err.what()).find("refused the request"), std::string::npos) << err.what();
    }
  }
  EXPECT_EQ(dma::Engine::current().stats().active_copies, 0u);
}

// A copy through bounded buffers (dsk -> sys -> dsk, 16 tiles) with both file hops asynchronous:
// the first hop's first request goes out from the calling thread, the rest from the workers,
// and every byte lands, copy after copy (with and without a layout change).
TEST(CopyOnAnAsynchronousChannel, MultiHopThroughBoundedBuffers) {
  const Rect space = Rect::from_extents({1 << 16});
  const std::uint64_t instance_bytes = space.volume() * kFields.total_size();
  settings::ScopedOverride th("CARAVAN_PLANNER_BUFFER_THRESHOLD", std::to_string(instance_bytes / 16));
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  dma::Engine& engine = dma::Engine::current();
  for (const char* name : {"file node0/rank0/dsk->node0/rank0/sys", "file node0/rank0/sys->node0/rank0/dsk"})
    engine.replace_channel_for_testing(name, std::make_unique<AsyncChannel>(std::make_unique<channels::FileChannel>()));
  for (int epoch = 0; epoch < 6; ++epoch) {
    Instance src = Instance::create(test::dsk_memory(), space, kFields, Layout::parse("F,x"));
    Instance dst = Instance::create(test::dsk_memory(), space, kFields, Layout::parse(epoch % 2 ? "x,F" : "F,x"));
    const std::uint64_t seed = 31 + static_cast<std::uint64_t>(epoch);
    test::write_pattern(src, seed);
    test::poison(dst);
    CopyReport report;
    Event e = copy(src, dst, {.report = &report});
    ASSERT_TRUE(e.wait_for(60s));
    EXPECT_EQ(test::count_mismatches(dst, seed), 0u) << report.route << ", copy " << epoch;
    EXPECT_GE(report.hop_requests.size(), 2u) << report.route;
  }
}

}  // namespace
}  // namespace caravan
