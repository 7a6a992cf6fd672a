// The stall watchdog (CARAVAN_DMA_STALL_S): a copy whose channel hangs is reported in the log,
// naming each hop's channel, tiles done and what it waits for; cancel() then frees it.
//
// The hang comes from a test channel put in place of a real one through
// Engine::replace_channel_for_testing: it holds every request until the copy is cancelled.
#include "runtime/dma/engine.h"
#include "runtime/log.h"
#include "tests/dma/dma_test_util.h"

#include <caravan/settings.h>

#include <spdlog/sinks/ringbuffer_sink.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace caravan {
namespace {

using namespace std::chrono_literals;
using test::dsk_memory;
using test::sys_memory;

// Accepts requests and never completes them, until their copy is cancelled (Request::cancelled):
// what a wedged device looks like to the engine. Completions run on its own thread, as those of
// asynchronous channels do.
class HangingChannel final : public dma::Channel {
 public:
  explicit HangingChannel(ChannelKind kind) : kind_(kind), thread_([this] { run(); }) {}
  ~HangingChannel() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  ChannelKind kind() const noexcept override { return kind_; }
  bool serves(MemoryId, MemoryId) const noexcept override { return true; }
  void submit(const dma::Request& request, Completion done) override {
    std::lock_guard lock(mutex_);
    held_.push_back({request.cancelled, std::move(done)});
    ++accepted_;
    cv_.notify_all();
  }
  std::size_t accepted() {
    std::lock_guard lock(mutex_);
    return accepted_;
  }

 private:
  struct Held {
    const std::atomic<bool>* cancelled;
    Completion done;
  };
  void run() {
    std::unique_lock lock(mutex_);
    while (!stop_) {
      cv_.wait_for(lock, 1ms);
      for (auto it = held_.begin(); it != held_.end();) {
        if (it->cancelled && it->cancelled->load(std::memory_order_acquire)) {
          Completion done = std::move(it->done);
          it = held_.erase(it);
          lock.unlock();
          done(make_failure(Errc::cancelled, "the hanging test channel gave the request up"));
          lock.lock();
        } else {
          ++it;
        }
      }
    }
  }

  ChannelKind kind_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Held> held_;
  std::size_t accepted_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

// Captures the "caravan.dma" logger's lines while it lives.
class DmaLogCapture {
 public:
  DmaLogCapture() : sink_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(256)) {
    log::get("dma")->sinks().push_back(sink_);
  }
  ~DmaLogCapture() {
    auto& sinks = log::get("dma")->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  // The first captured line containing `text`, waiting up to `timeout` for it.
  std::string wait_for_line(const std::string& text, std::chrono::milliseconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      for (const std::string& line : sink_->last_formatted())
        if (line.find(text) != std::string::npos) return line;
      if (std::chrono::steady_clock::now() > deadline) return {};
      std::this_thread::sleep_for(10ms);
    }
  }

 private:
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink_;
};

void expect_cancelled(Event e) {
  bool triggered = false;
  try {
    triggered = e.wait_for(10s);
    ADD_FAILURE() << "the stalled copy " << (triggered ? "completed normally" : "was not freed by cancel() within 10 s");
  } catch (const EventPoisoned& err) {
    EXPECT_EQ(err.cause()->code(), Errc::cancelled) << err.what();
  }
}

void expect_engine_idle() {
  dma::EngineStats stats = dma::Engine::current().stats();
  EXPECT_EQ(stats.active_copies, 0u);
  for (const auto& [memory, used] : stats.pool_in_use) EXPECT_EQ(used, 0u) << memory.to_string();
}

const FieldSpace kFields({{"a", 8}, {"b", 8}});

TEST(CopyStall, OneHopCopyOnAHungChannelIsReportedAndCancelFreesIt) {
  settings::ScopedOverride stall("CARAVAN_DMA_STALL_S", "0.2");
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  dma::Engine& engine = dma::Engine::current();  // started (and its start logged) before capturing
  DmaLogCapture capture;
  const std::string channel = "memcpy node0/rank0/sys->node0/rank0/sys";
  auto hanging = std::make_unique<HangingChannel>(ChannelKind::memcpy);
  HangingChannel* hung = hanging.get();
  engine.replace_channel_for_testing(channel, std::move(hanging));

  Instance a = Instance::create(sys_memory(), Rect::from_extents({4096}), kFields, Layout::parse("F,x"));
  Instance b = Instance::create(sys_memory(), Rect::from_extents({4096}), kFields, Layout::parse("F,x"));
  Event e = copy(a, b);
  std::string report = capture.wait_for_line("made no progress", 10s);
  ASSERT_FALSE(report.empty()) << "no stall report within 10 s (CARAVAN_DMA_STALL_S=0.2)";
  EXPECT_NE(report.find(e.to_string()), std::string::npos) << report;
  EXPECT_NE(report.find("hop 0 on '" + channel + "': 0/1 tiles done, 1 request(s) in flight"), std::string::npos) << report;
  EXPECT_EQ(hung->accepted(), 1u);
  EXPECT_EQ(e.query(), EventState::pending);

  EXPECT_TRUE(cancel(e));
  expect_cancelled(e);
  expect_engine_idle();
}

// Two hops through a bounded buffer, the second hung: the report shows the first hop blocked on
// the buffer (its slots full) and the second stuck in its channel.
TEST(CopyStall, MultiHopReportNamesTheStuckHopAndWhatTheOthersWaitFor) {
  settings::ScopedOverride stall("CARAVAN_DMA_STALL_S", "0.2");
  settings::ScopedOverride tiles("CARAVAN_DMA_TILE_BYTES", "64K");
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  dma::Engine& engine = dma::Engine::current();
  DmaLogCapture capture;
  const std::string channel = "file node0/rank0/sys->node0/rank0/dsk";
  engine.replace_channel_for_testing(channel, std::make_unique<HangingChannel>(ChannelKind::file));

  const Rect space = Rect::from_extents({1 << 16});  // 1 MiB: 16 tiles of 64 KiB
  Instance a = Instance::create(dsk_memory(), space, kFields, Layout::parse("F,x"));
  Instance b = Instance::create(dsk_memory(), space, kFields, Layout::parse("F,x"));
  CopyReport copy_report;
  Event e = copy(a, b, {.report = &copy_report});
  std::string report = capture.wait_for_line("made no progress", 10s);
  ASSERT_FALSE(report.empty()) << "no stall report within 10 s (CARAVAN_DMA_STALL_S=0.2)";
  EXPECT_NE(report.find(e.to_string()), std::string::npos) << report;
  EXPECT_NE(report.find("hop 1 on '" + channel + "': 0/16 tiles done, 1 request(s) in flight"), std::string::npos) << report;
  EXPECT_NE(report.find("hop 0 on 'file node0/rank0/dsk->node0/rank0/sys': 3/16 tiles done, waiting for hop 1 to drain "
                        "the slot of tile 3"),
            std::string::npos)
      << report;

  EXPECT_TRUE(cancel(e));
  expect_cancelled(e);
  expect_engine_idle();
  ASSERT_EQ(copy_report.timeline.size(), 2u) << "a cancelled copy still reports where its time went";
  EXPECT_EQ(copy_report.timeline[0].requests.size(), 3u);
  EXPECT_EQ(copy_report.timeline[1].requests.size(), 1u);
}

TEST(CopyStall, ChannelsAreReplacedOnlyByNameAndWhileIdle) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  dma::Engine& engine = dma::Engine::current();
  CARAVAN_EXPECT_ERROR(engine.replace_channel_for_testing("no such channel", std::make_unique<HangingChannel>(ChannelKind::memcpy)),
                       Errc::not_found, "no channel worker named 'no such channel'");
  const std::string channel = "memcpy node0/rank0/sys->node0/rank0/sys";
  Instance a = Instance::create(sys_memory(), Rect::from_extents({16}), kFields, Layout::parse("F,x"));
  Instance b = Instance::create(sys_memory(), Rect::from_extents({16}), kFields, Layout::parse("F,x"));
  UserEvent gate = UserEvent::create();
  Event e = copy(a, b, {.precondition = gate});
  CARAVAN_EXPECT_ERROR(engine.replace_channel_for_testing(channel, std::make_unique<HangingChannel>(ChannelKind::memcpy)),
                       Errc::invalid_argument, "1 copies are active");
  gate.trigger();
  ASSERT_TRUE(e.wait_for(10s));
}

}  // namespace
}  // namespace caravan
