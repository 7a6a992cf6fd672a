#include "runtime/event_table.h"
#include "runtime/runtime_impl.h"
#include "tests/runtime/test_util.h"

#include <caravan/settings.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

namespace caravan {
namespace {

using namespace std::chrono_literals;

class EventTest : public ::testing::Test {
 protected:
  Runtime rt_{RuntimeOptions{.cpu_workers = 2}};
};

TEST_F(EventTest, NoEventHasAlwaysTriggered) {
  Event none;
  EXPECT_TRUE(none.is_none());
  EXPECT_EQ(none.query(), EventState::triggered);
  EXPECT_NO_THROW(none.wait());
  EXPECT_TRUE(none.wait_for(0ns));
  EXPECT_EQ(none.failure(), nullptr);
}

TEST_F(EventTest, UserEventTriggersOnce) {
  UserEvent e = UserEvent::create();
  EXPECT_FALSE(e.is_none());
  EXPECT_EQ(e.query(), EventState::pending);
  e.trigger();
  EXPECT_EQ(e.query(), EventState::triggered);
  EXPECT_NO_THROW(e.wait());
  CARAVAN_EXPECT_ERROR(e.trigger(), Errc::already_done, "already triggered");
  CARAVAN_EXPECT_ERROR(e.poison("late"), Errc::already_done, "already triggered");
}

TEST_F(EventTest, HandlesAreComparableValues) {
  UserEvent a = UserEvent::create();
  UserEvent b = UserEvent::create();
  Event copy = a;
  EXPECT_EQ(copy, a);
  EXPECT_NE(a, b);
  EXPECT_NE(std::hash<Event>{}(a), std::hash<Event>{}(b));
  static_assert(std::is_trivially_copyable_v<Event>);
  a.trigger();
  b.trigger();
}

TEST_F(EventTest, WaitBlocksUntilTriggeredFromAnotherThread) {
  UserEvent e = UserEvent::create();
  std::atomic<bool> triggered{false};
  std::thread t([&] {
    std::this_thread::sleep_for(20ms);
    triggered = true;
    e.trigger();
  });
  e.wait();
  EXPECT_TRUE(triggered.load());
  t.join();
}

TEST_F(EventTest, WaitForTimesOutAndLeavesEventPending) {
  UserEvent e = UserEvent::create();
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(e.wait_for(30ms));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 30ms);
  EXPECT_EQ(e.query(), EventState::pending);
  e.trigger();
  EXPECT_TRUE(e.wait_for(0ns));
}

// A timeout past the clock's range means no limit: now + timeout overflowed and the wait gave
// up at once. A negative timeout is one already past.
TEST_F(EventTest, WaitForWithAHugeTimeoutWaitsForTheTrigger) {
  UserEvent e = UserEvent::create();
  std::thread t([&] {
    std::this_thread::sleep_for(20ms);
    e.trigger();
  });
  EXPECT_TRUE(e.wait_for(std::chrono::nanoseconds::max()));
  t.join();
  UserEvent pending = UserEvent::create();
  EXPECT_FALSE(pending.wait_for(-5ms));
  pending.trigger();
}

TEST_F(EventTest, OldHandlesKeepTheirStateAfterSlotReuse) {
  // Slots are recycled; an old handle must still read its own generation's outcome.
  std::vector<Event> ok, bad;
  for (int i = 0; i < 10000; ++i) {
    UserEvent e = UserEvent::create();
    if (i % 3 == 0) {
      e.poison("generation " + std::to_string(i));
      bad.push_back(e);
    } else {
      e.trigger();
      ok.push_back(e);
    }
  }
  for (const Event& e : ok) EXPECT_EQ(e.query(), EventState::triggered);
  for (std::size_t i = 0; i < bad.size(); ++i) {
    ASSERT_EQ(bad[i].query(), EventState::poisoned);
    EXPECT_EQ(std::string(bad[i].failure()->what()), "generation " + std::to_string(i * 3));
  }
}

TEST_F(EventTest, MergeOfNothingIsNoEvent) {
  EXPECT_TRUE(merge_events({}).is_none());
  EXPECT_TRUE(merge_events({Event(), Event()}).is_none());
}

TEST_F(EventTest, MergeOfOneIsThatEvent) {
  UserEvent e = UserEvent::create();
  EXPECT_EQ(merge_events({e}), e);
  e.trigger();
}

TEST_F(EventTest, MergeTriggersAfterTheLastInput) {
  std::vector<UserEvent> inputs;
  std::vector<Event> as_events;
  for (int i = 0; i < 50; ++i) {
    inputs.push_back(UserEvent::create());
    as_events.push_back(inputs.back());
  }
  as_events.push_back(inputs[7]);  // the same event twice is fine
  Event merged = merge_events(as_events);
  for (std::size_t i = 0; i + 1 < inputs.size(); ++i) {
    inputs[i].trigger();
    EXPECT_EQ(merged.query(), EventState::pending) << "after input " << i;
  }
  inputs.back().trigger();
  EXPECT_TRUE(merged.wait_for(1s));
  EXPECT_EQ(merged.query(), EventState::triggered);
}

TEST_F(EventTest, MergeIsPoisonedByAnyInputAtOnce) {
  UserEvent a = UserEvent::create(), b = UserEvent::create();
  Event merged = merge_events({a, b});
  a.poison("a failed");
  // Fail fast: b is still pending, the merge has already failed.
  EXPECT_EQ(merged.query(), EventState::poisoned);
  EXPECT_STREQ(merged.failure()->what(), "a failed");
  b.trigger();
  EXPECT_EQ(merged.query(), EventState::poisoned);
}

TEST_F(EventTest, MergeOfAlreadyPoisonedInputIsPoisoned) {
  UserEvent a = UserEvent::create();
  a.poison("early");
  UserEvent b = UserEvent::create();
  Event merged = merge_events({b, a});
  EXPECT_EQ(merged.query(), EventState::poisoned);
  b.trigger();
}

TEST_F(EventTest, PoisonTravelsThroughChainsAndMergesWithTheOriginalCause) {
  TaskId noop = test::task("event_test.noop", [](TaskContext&) {});
  UserEvent root = UserEvent::create();
  Event chain = root;
  for (int i = 0; i < 5; ++i) chain = rt_.spawn(noop, {}, {.precondition = chain});
  UserEvent other = UserEvent::create();
  Event joined = merge_events({chain, other});
  Event after = rt_.spawn(noop, {}, {.precondition = joined});
  FailureCause cause = make_failure(Errc::transport, "link 3 went down");
  root.poison(cause);
  try {
    after.wait();
    FAIL() << "wait on a poisoned event returned normally";
  } catch (const EventPoisoned& e) {
    EXPECT_EQ(e.cause(), cause);  // the very same cause object
    EXPECT_EQ(e.cause()->code(), Errc::transport);
    EXPECT_NE(std::string(e.what()).find("link 3 went down"), std::string::npos);
  }
  other.trigger();
}

TEST_F(EventTest, LongPoisonedChainDoesNotGrowTheStack) {
  // 100k dependent tasks poisoned at once: notification is iterative, not recursive.
  TaskId noop = test::task("event_test.noop", [](TaskContext&) {});
  UserEvent root = UserEvent::create();
  Event chain = root;
  for (int i = 0; i < 100000; ++i) chain = rt_.spawn(noop, {}, {.precondition = chain});
  root.poison("root failed");
  EXPECT_THROW(chain.wait(), EventPoisoned);
}

TEST_F(EventTest, CallbacksRunExactlyOnce) {
  UserEvent e = UserEvent::create();
  std::atomic<int> before{0}, after{0};
  FailureCause seen = make_failure(Errc::internal, "not called");
  e.on_trigger([&](const FailureCause& f) {
    ++before;
    seen = f;
  });
  EXPECT_EQ(before.load(), 0);
  e.trigger();
  EXPECT_EQ(before.load(), 1);
  EXPECT_EQ(seen, nullptr);
  e.on_trigger([&](const FailureCause&) { ++after; });  // already triggered: runs now
  EXPECT_EQ(after.load(), 1);
  EXPECT_EQ(before.load(), 1);
}

TEST_F(EventTest, CallbackSeesThePoisonCause) {
  UserEvent e = UserEvent::create();
  std::string message;
  e.on_trigger([&](const FailureCause& f) { message = f ? f->what() : "none"; });
  e.poison("disk full");
  EXPECT_EQ(message, "disk full");
}

TEST_F(EventTest, ThrowingCallbackDoesNotBreakOtherWaiters) {
  UserEvent e = UserEvent::create();
  int ran = 0;
  e.on_trigger([](const FailureCause&) { throw std::runtime_error("callback bug"); });
  e.on_trigger([&](const FailureCause&) { ++ran; });
  e.trigger();
  EXPECT_EQ(ran, 1);
}

TEST(EventShutdown, ShutdownPoisonsPendingWork) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  TaskId noop = test::task("event_test.noop", [](TaskContext&) {});
  UserEvent never = UserEvent::create();
  Event task = rt.spawn(noop, {}, {.precondition = never});
  std::atomic<int> code{-1};
  task.on_trigger([&](const FailureCause& f) { code = f ? static_cast<int>(f->code()) : -2; });
  rt.shutdown();
  EXPECT_EQ(code.load(), static_cast<int>(Errc::shut_down));
}

TEST(EventShutdown, UsingAnEventOfAShutDownRuntimeIsAClearError) {
  Event e;
  {
    Runtime rt(RuntimeOptions{.cpu_workers = 1});
    UserEvent u = UserEvent::create();
    u.trigger();
    e = u;
  }
  CARAVAN_EXPECT_ERROR(e.wait(), Errc::shut_down, "shut down");
  CARAVAN_EXPECT_ERROR(e.query(), Errc::shut_down, "shut down");
  // A new runtime does not adopt old handles.
  Runtime rt2(RuntimeOptions{.cpu_workers = 1});
  CARAVAN_EXPECT_ERROR(e.wait(), Errc::shut_down, "another runtime is running");
  CARAVAN_EXPECT_ERROR(Runtime(RuntimeOptions{.cpu_workers = 1}), Errc::already_done, "already running");
}

// A handle no runtime issued is said to be that, not to belong to a runtime that shut down.
TEST(EventShutdown, AHandleThatWasNeverIssuedIsNamedSo) {
  const Event made_up = Event::from_parts(3, 0, 0xFFF0, 1);   // an instance no runtime of this test had
  const Event instance_zero = Event::from_parts(3, 0, 0, 1);  // instance 0 is never given out
  CARAVAN_EXPECT_ERROR(made_up.wait(), Errc::invalid_argument, "was never issued: no Caravan runtime of this process");
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  CARAVAN_EXPECT_ERROR(made_up.wait(), Errc::invalid_argument, "instance 65520");
  CARAVAN_EXPECT_ERROR(made_up.query(), Errc::invalid_argument, "was never issued");
  CARAVAN_EXPECT_ERROR(instance_zero.wait(), Errc::invalid_argument, "was never issued");
  CARAVAN_EXPECT_ERROR(UserEvent::from_event(made_up).trigger(), Errc::invalid_argument, "was never issued");
  // This runtime's instance, but a slot or a generation it never issued.
  UserEvent real = UserEvent::create();
  const Event no_slot = Event::from_parts(1u << 30, real.owner_rank(), real.runtime_instance(), 1);
  CARAVAN_EXPECT_ERROR(no_slot.wait(), Errc::invalid_argument, "was never issued by this runtime (it has no slot");
  const Event later = Event::from_parts(real.slot(), real.owner_rank(), real.runtime_instance(), real.generation() + 5);
  CARAVAN_EXPECT_ERROR(later.query(), Errc::invalid_argument, "was never issued by this runtime (slot");
  real.trigger();
  EXPECT_NO_THROW(real.wait());
}

TEST(EventShutdown, NoRuntimeMeansAClearError) {
  CARAVAN_EXPECT_ERROR(UserEvent::create(), Errc::shut_down, "no Caravan runtime is running");
  CARAVAN_EXPECT_ERROR(Runtime::current(), Errc::shut_down, "no Caravan runtime is running");
}

// Many threads trigger, poison, merge, wait (blocking, with timeouts) and add callbacks at once,
// while most events are still pending. Every merge must end in the state its inputs dictate,
// every waiter must wake, and every callback must run exactly once.
TEST(EventStress, ConcurrentTriggerMergeWait) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  constexpr int kEvents = 20000;
  constexpr int kTriggerers = 3;
  constexpr int kMergers = 3;
  constexpr int kWaiters = 3;
  std::vector<UserEvent> events;
  events.reserve(kEvents);
  for (int i = 0; i < kEvents; ++i) events.push_back(UserEvent::create());
  auto poisoned = [](int i) { return i % 97 == 13; };
  std::vector<std::atomic<int>> callback_runs(kEvents);
  for (auto& c : callback_runs) c = 0;
  auto at = [&](int i) -> UserEvent& { return events[static_cast<std::size_t>(i)]; };

  std::atomic<int> failures{0};
  std::atomic<int> merges_made{0};
  std::atomic<bool> start{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kTriggerers; ++t) {
    threads.emplace_back([&, t] {
      while (!start) std::this_thread::yield();
      // Let the mergers register most merges on pending events first.
      while (merges_made.load() < kMergers * 1000) std::this_thread::yield();
      std::vector<int> mine;
      for (int i = t; i < kEvents; i += kTriggerers) mine.push_back(i);
      std::shuffle(mine.begin(), mine.end(), std::mt19937(static_cast<unsigned>(t)));
      int n = 0;
      for (int i : mine) {
        at(i).on_trigger([&, i](const FailureCause&) { ++callback_runs[static_cast<std::size_t>(i)]; });
        if (poisoned(i)) at(i).poison("poisoned " + std::to_string(i));
        else at(i).trigger();
        if (++n % 32 == 0) std::this_thread::yield();  // keep the race going
      }
    });
  }
  for (int m = 0; m < kMergers; ++m) {
    threads.emplace_back([&, m] {
      while (!start) std::this_thread::yield();
      std::mt19937 rng(static_cast<unsigned>(100 + m));
      std::uniform_int_distribution<int> pick(0, kEvents - 1), width(2, 12);
      std::vector<std::pair<Event, bool>> merges;
      for (int round = 0; round < 2000; ++round) {
        std::vector<Event> inputs;
        bool expect_poison = false;
        for (int k = width(rng); k > 0; --k) {
          int i = pick(rng);
          expect_poison |= poisoned(i);
          inputs.push_back(at(i));
        }
        Event merged = merge_events(inputs);
        if (round % 5 == 0) merged = merge_events({merged, inputs.front()});  // nested
        merges.emplace_back(merged, expect_poison);
        ++merges_made;
      }
      for (auto& [merged, expect_poison] : merges) {
        try {
          if (!merged.wait_for(20s)) ++failures;  // would be a hang
          else if (expect_poison) ++failures;
        } catch (const EventPoisoned&) {
          if (!expect_poison) ++failures;
        }
      }
    });
  }
  for (int w = 0; w < kWaiters; ++w) {
    threads.emplace_back([&, w] {
      while (!start) std::this_thread::yield();
      std::mt19937 rng(static_cast<unsigned>(200 + w));
      std::uniform_int_distribution<int> pick(0, kEvents - 1);
      for (int round = 0; round < 300; ++round) {
        int i = pick(rng);
        try {
          // Short timeouts exercise the take-back path; a final long wait must succeed.
          if (!at(i).wait_for(std::chrono::microseconds(50)) && !at(i).wait_for(20s)) ++failures;
          else if (poisoned(i)) ++failures;
        } catch (const EventPoisoned& e) {
          if (!poisoned(i) || std::string(e.cause()->what()) != "poisoned " + std::to_string(i)) ++failures;
        }
      }
    });
  }
  start = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  for (int i = 0; i < kEvents; ++i) ASSERT_EQ(callback_runs[static_cast<std::size_t>(i)].load(), 1) << "event " << i;
}

// CARAVAN_WAIT_SPIN_US: -1 (the default) polls 20 us, and kGpuWaitSpinUs once the runtime uses a
// GPU; a value of 0 or more is used as it is.
TEST(EventWaitSpin, TheAutomaticSettingPollsLongerOnceTheRuntimeUsesAGpu) {
  EXPECT_EQ(detail::wait_spin_us_for(-1, false), 20);
  EXPECT_EQ(detail::wait_spin_us_for(-1, true), detail::kGpuWaitSpinUs);
  EXPECT_EQ(detail::wait_spin_us_for(300, true), 300);
  EXPECT_EQ(detail::wait_spin_us_for(0, true), 0);
  EXPECT_EQ(detail::wait_spin_us_for(0, false), 0);
  {
    settings::ScopedOverride automatic{"CARAVAN_WAIT_SPIN_US", "-1"};
    Runtime rt{RuntimeOptions{.cpu_workers = 1}};
    EXPECT_EQ(rt.impl().events().wait_spin_us(), 20);
    rt.impl().note_uses_gpu();
    EXPECT_EQ(rt.impl().events().wait_spin_us(), detail::kGpuWaitSpinUs);
    // Waits still end when their event triggers, polled or not.
    UserEvent e = UserEvent::create();
    std::thread trigger([&] {
      std::this_thread::sleep_for(10ms);
      e.trigger();
    });
    e.wait();
    trigger.join();
    EXPECT_EQ(e.query(), EventState::triggered);
  }
  settings::ScopedOverride fixed{"CARAVAN_WAIT_SPIN_US", "7"};
  Runtime rt{RuntimeOptions{.cpu_workers = 1}};
  rt.impl().note_uses_gpu();
  EXPECT_EQ(rt.impl().events().wait_spin_us(), 7);
}

}  // namespace
}  // namespace caravan
