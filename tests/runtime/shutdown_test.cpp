// Runtime::shutdown() with tasks still running: it returns when a running task waits on work that
// can no longer happen (a user event nobody triggers, a task queued behind it), and it does not cut
// short a task that is still computing. Each shutdown runs on its own thread under a deadline, so a
// hang fails the test instead of stalling the suite.
#include "tests/runtime/test_util.h"

#include "runtime/event_table.h"

#include <atomic>
#include <future>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace caravan {
namespace {

using namespace std::chrono_literals;

// test::shuts_down_within for a runtime this test owns: on a hang the runtime is leaked with
// `keep` (what its tasks write to), so that nothing is destroyed under the hung shutdown.
bool shuts_down_within(std::unique_ptr<Runtime>& rt, std::chrono::seconds timeout, std::shared_ptr<void> keep = {}) {
  if (test::shuts_down_within(*rt, timeout)) return true;
  (void)rt.release();
  new std::shared_ptr<void>(std::move(keep));  // leaked on purpose
  return false;
}

// Waits (at most 10 s) until `count` reaches `target`.
bool reaches(const std::atomic<int>& count, int target) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (count.load() < target) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// What a task body saw when its wait ended.
enum Outcome : int { waiting = 0, ok = 1, shut_down = 2, other = 3 };

// What the tasks of one test write, on the heap (see shuts_down_within).
struct Counters {
  std::atomic<int> started{0};
  std::atomic<int> outcome{waiting};
  std::atomic<int> compute_started{0};
  std::atomic<int> triggered{0};
};

struct WaitArgs {
  Event event;
  std::atomic<int>* started;
  std::atomic<int>* outcome;
};

void wait_and_record(TaskContext& ctx) {
  const auto a = ctx.args_as<WaitArgs>();
  a.started->fetch_add(1);
  try {
    a.event.wait();
    a.outcome->store(ok);
  } catch (const EventPoisoned& e) {
    a.outcome->store(e.cause() && e.cause()->code() == Errc::shut_down ? shut_down : other);
  } catch (...) {
    a.outcome->store(other);
  }
}

TEST(RuntimeShutdown, ReturnsWhileATaskWaitsOnAUserEventNobodyTriggers) {
  const TaskId waiter = test::task("shutdown_test.wait", wait_and_record);
  auto rt = std::make_unique<Runtime>(RuntimeOptions{.cpu_workers = 2});
  UserEvent never = UserEvent::create();
  auto state = std::make_shared<Counters>();
  rt->spawn(waiter, task_args(WaitArgs{never, &state->started, &state->outcome}));
  ASSERT_TRUE(reaches(state->started, 1)) << "the task did not start";
  ASSERT_TRUE(shuts_down_within(rt, 10s, state)) << "shutdown hung on a task waiting on a user event";
  EXPECT_EQ(state->outcome.load(), shut_down) << "the task's wait should end poisoned with Errc::shut_down";
}

TEST(RuntimeShutdown, ReturnsWhileATaskWaitsOnATaskQueuedBehindIt) {
  const TaskId waiter = test::task("shutdown_test.wait", wait_and_record);
  const TaskId noop = test::task("shutdown_test.noop", [](TaskContext&) {});
  auto rt = std::make_unique<Runtime>(RuntimeOptions{.cpu_workers = 1});
  // The one worker runs the waiting task; what it waits on is queued behind it.
  auto state = std::make_shared<Counters>();
  UserEvent hold = UserEvent::create();
  Event blocker = rt->spawn(noop, {}, {.precondition = hold});
  Event queued = rt->spawn(noop, {}, {.precondition = blocker});
  rt->spawn(waiter, task_args(WaitArgs{queued, &state->started, &state->outcome}));
  ASSERT_TRUE(reaches(state->started, 1));
  hold.trigger();  // `blocker` becomes ready, queued behind the waiting task; `queued` waits on it
  EXPECT_EQ(state->outcome.load(), waiting) << "the only worker is busy: the queued task cannot have run";
  ASSERT_TRUE(shuts_down_within(rt, 10s, state)) << "shutdown hung on a task waiting on a queued task";
  EXPECT_EQ(state->outcome.load(), shut_down) << "the queued task fails at shutdown, and so does the wait on it";
}

TEST(RuntimeShutdown, DoesNotCutShortATaskThatStillComputes) {
  // One task waits on a user event that another running task triggers when it has computed for
  // a while: shutdown must let both finish, since neither is stuck.
  struct ComputeArgs {
    UserEvent done;
    std::atomic<int>* started;
    std::atomic<int>* triggered;
  };
  const TaskId waiter = test::task("shutdown_test.wait", wait_and_record);
  const TaskId compute = test::task("shutdown_test.compute", [](TaskContext& ctx) {
    const auto a = ctx.args_as<ComputeArgs>();
    a.started->fetch_add(1);
    std::this_thread::sleep_for(300ms);  // not an Event::wait: "still computing"
    try {
      a.done.trigger();
      a.triggered->store(1);
    } catch (const Error&) {
      a.triggered->store(-1);
    }
  });
  auto rt = std::make_unique<Runtime>(RuntimeOptions{.cpu_workers = 2});
  UserEvent done = UserEvent::create();
  auto state = std::make_shared<Counters>();
  rt->spawn(waiter, task_args(WaitArgs{done, &state->started, &state->outcome}));
  rt->spawn(compute, task_args(ComputeArgs{done, &state->compute_started, &state->triggered}));
  ASSERT_TRUE(reaches(state->started, 1));
  ASSERT_TRUE(reaches(state->compute_started, 1));
  ASSERT_TRUE(shuts_down_within(rt, 10s, state));
  EXPECT_EQ(state->triggered.load(), 1) << "the computing task's trigger should have succeeded";
  EXPECT_EQ(state->outcome.load(), ok) << "the waiting task should have seen the event trigger";
}

TEST(RuntimeShutdown, FromATaskIsAnErrorNotAHang) {
  const TaskId stopper = test::task("shutdown_test.stopper", [](TaskContext&) { Runtime::current().shutdown(); });
  auto rt = std::make_unique<Runtime>(RuntimeOptions{.cpu_workers = 1});
  try {
    if (!rt->spawn(stopper).wait_for(10s)) {
      (void)rt.release();  // the task hangs in shutdown: leak the runtime rather than hang again
      FAIL() << "shutdown from a task hung instead of failing the task";
    }
    ADD_FAILURE() << "shutdown from a task should fail the task";
  } catch (const EventPoisoned& e) {
    ASSERT_TRUE(e.cause());
    EXPECT_NE(std::string(e.cause()->what()).find("Runtime::shutdown called from a task"), std::string::npos)
        << e.cause()->what();
  }
  EXPECT_TRUE(Runtime::is_running());
  ASSERT_TRUE(shuts_down_within(rt, 10s));
}

// An Event::on_trigger callback runs on whichever thread triggers the event: here a CPU worker
// (a task's completion) and a plain thread (a user event). Shutdown from either would join the
// thread it runs on, or wait for it; it fails with an error the callback sees instead.
TEST(RuntimeShutdown, FromAnEventCallbackIsAnErrorNotAHang) {
  const TaskId noop = test::task("shutdown_test.noop", [](TaskContext&) {});
  auto rt = std::make_unique<Runtime>(RuntimeOptions{.cpu_workers = 1});
  struct Seen {
    std::atomic<int> calls{0};
    std::mutex mutex;
    std::vector<std::string> errors;
  };
  auto seen = std::make_shared<Seen>();
  auto stop_in_callback = [seen](const FailureCause&) {
    try {
      Runtime::current().shutdown();
    } catch (const Error& e) {
      std::lock_guard lock(seen->mutex);
      seen->errors.emplace_back(e.what());
    }
    seen->calls.fetch_add(1);
  };
  UserEvent gate = UserEvent::create();
  rt->spawn(noop, {}, {.precondition = gate}).on_trigger(stop_in_callback);  // runs on the worker
  gate.on_trigger(stop_in_callback);                                         // runs on `trigger_thread`
  std::thread trigger_thread([gate] { gate.trigger(); });
  trigger_thread.join();
  ASSERT_TRUE(reaches(seen->calls, 2)) << "a callback that called shutdown did not return";
  {
    std::lock_guard lock(seen->mutex);
    ASSERT_EQ(seen->errors.size(), 2u) << "shutdown from a callback should throw";
    for (const std::string& e : seen->errors)
      EXPECT_NE(e.find("called from an Event::on_trigger callback"), std::string::npos) << e;
  }
  EXPECT_TRUE(Runtime::is_running());
  ASSERT_TRUE(shuts_down_within(rt, 10s, seen));
}

// Two application threads shut down at once: the second waits until the first has finished
// (it returned at once before, and could then destroy the runtime under the first).
TEST(RuntimeShutdown, ConcurrentCallsReturnOnlyOnceItIsDone) {
  const TaskId waiter = test::task("shutdown_test.wait", wait_and_record);
  auto rt = std::make_unique<Runtime>(RuntimeOptions{.cpu_workers = 1});
  UserEvent never = UserEvent::create();
  auto state = std::make_shared<Counters>();
  rt->spawn(waiter, task_args(WaitArgs{never, &state->started, &state->outcome}));
  ASSERT_TRUE(reaches(state->started, 1)) << "the task did not start";
  // The first shutdown takes at least the 20 ms quiet spell before it fails the user event.
  std::atomic<bool> first_done{false};
  std::thread first([&] {
    rt->shutdown();
    first_done = true;
  });
  std::this_thread::sleep_for(2ms);
  auto second = std::async(std::launch::async, [&] {
    rt->shutdown();
    return first_done.load() || !Runtime::is_running();
  });
  ASSERT_EQ(second.wait_for(20s), std::future_status::ready) << "the second shutdown hung";
  EXPECT_TRUE(second.get()) << "the second shutdown returned while the first was still stopping the runtime";
  first.join();
  EXPECT_EQ(state->outcome.load(), shut_down);
}

// A task waiting on a heap signal nobody raises (a wait outside Event::wait, which shutdown waits
// for) ends with Error(shut_down) once shutdown begins.
TEST(RuntimeShutdown, ReturnsWhileATaskWaitsOnAHeapSignal) {
  settings::ScopedOverride heap_bytes("CARAVAN_SYMMETRIC_HEAP_BYTES", "1M");
  struct HeapWait {
    SymmetricRegion flags;
    std::atomic<int>* started;
    std::atomic<int>* outcome;
  };
  const TaskId waiter = test::task("shutdown_test.heap_wait", [](TaskContext& ctx) {
    const auto a = ctx.args_as<HeapWait>();
    a.started->fetch_add(1);
    try {
      SymmetricHeap::current().wait_until(a.flags, 0, SignalCompare::ge, 1);
      a.outcome->store(ok);
    } catch (const Error& e) {
      a.outcome->store(e.code() == Errc::shut_down ? shut_down : other);
    }
  });
  auto rt = std::make_unique<Runtime>(RuntimeOptions{.cpu_workers = 1});
  auto state = std::make_shared<Counters>();
  const SymmetricRegion flags = SymmetricHeap::current().allocate_signals(1);
  rt->spawn(waiter, task_args(HeapWait{flags, &state->started, &state->outcome}));
  ASSERT_TRUE(reaches(state->started, 1)) << "the task did not start";
  ASSERT_TRUE(shuts_down_within(rt, 10s, state)) << "shutdown hung on a task waiting on a heap signal";
  EXPECT_EQ(state->outcome.load(), shut_down);
}

// The runtime's other threads (DMA workers, GPU lanes, the network's progress thread) name
// themselves; shutdown on one is refused with that name.
TEST(RuntimeShutdown, OnARuntimeThreadIsAnErrorNamingTheThread) {
  auto rt = std::make_unique<Runtime>(RuntimeOptions{.cpu_workers = 1});
  std::string error;
  std::thread([&] {
    const detail::RuntimeThreadRole role("a DMA worker");
    try {
      rt->shutdown();
    } catch (const Error& e) {
      error = e.what();
    }
  }).join();
  EXPECT_NE(error.find("on one of the runtime's own threads (a DMA worker)"), std::string::npos) << error;
  EXPECT_TRUE(Runtime::is_running());
  ASSERT_TRUE(shuts_down_within(rt, 10s));
}

// Many runtimes, each shut down while its workers wait on random mixes of user events, queued
// tasks and each other; every shutdown must return and every wait must end.
TEST(RuntimeShutdown, StressNeverHangs) {
  const TaskId waiter = test::task("shutdown_test.wait", wait_and_record);
  const TaskId noop = test::task("shutdown_test.noop", [](TaskContext&) {});
  std::mt19937 rng(20261129);
  for (int round = 0; round < 12; ++round) {
    const int workers = 1 + static_cast<int>(rng() % 4);
    auto rt = std::make_unique<Runtime>(RuntimeOptions{.cpu_workers = workers});
    std::vector<UserEvent> users;
    for (int i = 0; i < 4; ++i) users.push_back(UserEvent::create());
    std::vector<Event> targets(users.begin(), users.end());
    const int waiters = 2 + static_cast<int>(rng() % 8);
    struct Round {
      std::atomic<int> started{0};
      std::vector<std::atomic<int>> outcomes;
      explicit Round(int n) : outcomes(static_cast<std::size_t>(n)) {}
    };
    auto state = std::make_shared<Round>(waiters);
    std::atomic<int>& started = state->started;
    std::vector<std::atomic<int>>& outcomes = state->outcomes;
    for (int i = 0; i < waiters; ++i) {
      const Event target = targets[rng() % targets.size()];
      targets.push_back(rt->spawn(noop, {}, {.precondition = target}));
      outcomes[static_cast<std::size_t>(i)] = waiting;
      targets.push_back(
          rt->spawn(waiter, task_args(WaitArgs{target, &started, &outcomes[static_cast<std::size_t>(i)]})));
    }
    // Some user events trigger, some never do.
    for (std::size_t i = 0; i < users.size(); ++i)
      if (rng() % 2) users[i].trigger();
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 20));
    ASSERT_TRUE(shuts_down_within(rt, 20s, state))
        << "round " << round << ": shutdown hung (" << workers << " workers, " << waiters << " waiting tasks)";
    // A waiting task that never started was poisoned in the queue; every one that started has
    // ended, with success or Errc::shut_down.
    int ended = 0;
    for (int i = 0; i < waiters; ++i) {
      const int o = outcomes[static_cast<std::size_t>(i)].load();
      EXPECT_NE(o, other) << "round " << round << ", task " << i;
      if (o != waiting) ++ended;
    }
    EXPECT_EQ(ended, started.load()) << "round " << round << ": a task that started had not ended";
    rt.reset();
  }
}

}  // namespace
}  // namespace caravan
