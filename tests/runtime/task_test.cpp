#include "tests/runtime/test_util.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace caravan {
namespace {

using namespace std::chrono_literals;

TEST(Tasks, ArgumentsArriveIntact) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  struct Small {
    int a;
    double b;
  };
  struct Large {
    std::uint64_t values[32];  // past the inline buffer
  };
  static std::atomic<long> small_sum{0}, large_sum{0};
  small_sum = 0;
  large_sum = 0;
  TaskId small = test::task("task_test.small", [](TaskContext& ctx) {
    auto s = ctx.args_as<Small>();
    small_sum += s.a + static_cast<long>(s.b);
  });
  TaskId large = test::task("task_test.large", [](TaskContext& ctx) {
    auto l = ctx.args_as<Large>();
    for (auto v : l.values) large_sum += static_cast<long>(v);
  });
  Large l{};
  for (int i = 0; i < 32; ++i) l.values[i] = static_cast<std::uint64_t>(i);
  Event a = rt.spawn(small, task_args(Small{40, 2.0}));
  Event b = rt.spawn(large, task_args(l));
  merge_events({a, b}).wait();
  EXPECT_EQ(small_sum.load(), 42);
  EXPECT_EQ(large_sum.load(), 31 * 32 / 2);
}

TEST(Tasks, SpawnByNameAndContext) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  static std::string seen_name;
  static Event seen_completion;
  test::task("task_test.named", [](TaskContext& ctx) {
    seen_name = std::string(ctx.task_name);
    seen_completion = ctx.completion;
  });
  Event e = rt.spawn("task_test.named");
  e.wait();
  EXPECT_EQ(seen_name, "task_test.named");
  EXPECT_EQ(seen_completion, e);
}

TEST(Tasks, Diamond) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  static std::mutex mutex;
  static std::vector<int> order;
  order.clear();
  TaskId record = test::task("task_test.record", [](TaskContext& ctx) {
    std::this_thread::sleep_for(1ms);
    std::lock_guard lock(mutex);
    order.push_back(ctx.args_as<int>());
  });
  Event a = rt.spawn(record, task_args(0));
  Event b = rt.spawn(record, task_args(1), {.precondition = a});
  Event c = rt.spawn(record, task_args(2), {.precondition = a});
  Event d = rt.spawn(record, task_args(3), {.precondition = merge_events({b, c})});
  d.wait();
  ASSERT_EQ(order.size(), 4u);
  EXPECT_EQ(order.front(), 0);
  EXPECT_EQ(order.back(), 3);
  EXPECT_TRUE((order[1] == 1 && order[2] == 2) || (order[1] == 2 && order[2] == 1));
}

// A random DAG of 10,000 tasks: every task checks, when it runs, that all its dependencies have
// finished, and records its position; the positions must form a topological order.
TEST(Tasks, RandomDagRunsInTopologicalOrder) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  constexpr int kTasks = 10000;
  static std::vector<std::vector<int>> deps;
  static std::vector<std::atomic<int>> finished_at(kTasks);
  static std::atomic<int> clock{0};
  static std::atomic<int> violations{0};
  deps.assign(kTasks, {});
  for (auto& f : finished_at) f = -1;
  clock = 0;
  violations = 0;
  std::mt19937 rng(2026);
  for (int i = 1; i < kTasks; ++i) {
    int n = std::uniform_int_distribution<int>(0, std::min(i, 4))(rng);
    for (int k = 0; k < n; ++k) {
      // Mostly recent tasks (long chains), sometimes anything earlier.
      int lo = rng() % 4 == 0 ? 0 : std::max(0, i - 50);
      deps[static_cast<std::size_t>(i)].push_back(std::uniform_int_distribution<int>(lo, i - 1)(rng));
    }
  }
  TaskId node = test::task("task_test.dag_node", [](TaskContext& ctx) {
    int i = ctx.args_as<int>();
    for (int d : deps[static_cast<std::size_t>(i)])
      if (finished_at[static_cast<std::size_t>(d)].load(std::memory_order_acquire) < 0) ++violations;
    finished_at[static_cast<std::size_t>(i)].store(clock.fetch_add(1), std::memory_order_release);
  });
  // Spawn in a shuffled order that still names each task's dependencies first.
  std::vector<Event> events(kTasks);
  std::vector<Event> inputs;
  for (int i = 0; i < kTasks; ++i) {
    inputs.clear();
    for (int d : deps[static_cast<std::size_t>(i)]) inputs.push_back(events[static_cast<std::size_t>(d)]);
    int priority = std::uniform_int_distribution<int>(-3, 3)(rng);
    events[static_cast<std::size_t>(i)] =
        rt.spawn(node, task_args(i), {.precondition = merge_events(inputs), .priority = priority});
  }
  ASSERT_TRUE(merge_events(events).wait_for(60s));
  EXPECT_EQ(violations.load(), 0);
  for (int i = 0; i < kTasks; ++i) {
    int at = finished_at[static_cast<std::size_t>(i)].load();
    ASSERT_GE(at, 0) << "task " << i << " never ran";
    for (int d : deps[static_cast<std::size_t>(i)])
      ASSERT_LT(finished_at[static_cast<std::size_t>(d)].load(), at) << "task " << i << " ran before dependency " << d;
  }
}

// With one worker held busy, queued tasks must then run highest priority first, FIFO among
// equals.
TEST(Tasks, HigherPriorityRunsFirstAmongReadyTasks) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  static std::atomic<bool> release{false};
  static std::atomic<bool> gate_running{false};
  static std::mutex mutex;
  static std::vector<int> order;
  release = false;
  gate_running = false;
  order.clear();
  TaskId gate = test::task("task_test.gate", [](TaskContext&) {
    gate_running = true;
    while (!release) std::this_thread::sleep_for(100us);
  });
  TaskId record = test::task("task_test.record_id", [](TaskContext& ctx) {
    std::lock_guard lock(mutex);
    order.push_back(ctx.args_as<int>());
  });
  Event g = rt.spawn(gate);
  while (!gate_running) std::this_thread::yield();
  // (id, priority): ids encode the expected order.
  std::vector<std::pair<int, int>> spawns = {{5, 0}, {1, 10}, {8, -5}, {6, 0}, {2, 10}, {0, 1000}, {9, -1000},
                                             {3, 7},  {7, 0}, {4, 1}};
  std::vector<Event> events;
  for (auto [id, priority] : spawns) events.push_back(rt.spawn(record, task_args(id), {.priority = priority}));
  release = true;
  g.wait();
  merge_events(events).wait();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

TEST(Tasks, ExceptionPoisonsTheTaskAndItsDependents) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  static std::atomic<int> dependents_ran{0};
  dependents_ran = 0;
  TaskId thrower = test::task("task_test.thrower", [](TaskContext&) { throw std::runtime_error("boom at step 7"); });
  TaskId counted = test::task("task_test.counted", [](TaskContext&) { ++dependents_ran; });
  Event bad = rt.spawn(thrower);
  Event child = rt.spawn(counted, {}, {.precondition = bad});
  Event grandchild = rt.spawn(counted, {}, {.precondition = merge_events({child, Event()})});
  try {
    grandchild.wait();
    FAIL() << "expected EventPoisoned";
  } catch (const EventPoisoned& e) {
    EXPECT_EQ(e.cause()->code(), Errc::task_failed);
    EXPECT_NE(std::string(e.what()).find("task 'task_test.thrower' failed: boom at step 7"), std::string::npos) << e.what();
  }
  EXPECT_EQ(bad.query(), EventState::poisoned);
  EXPECT_EQ(child.failure(), bad.failure());
  EXPECT_EQ(dependents_ran.load(), 0);
}

TEST(Tasks, TaskThatWaitsOnPoisonedEventPassesTheOriginalCauseOn) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  static UserEvent failing;
  failing = UserEvent::create();
  TaskId waiter = test::task("task_test.waiter", [](TaskContext&) { failing.wait(); });
  Event e = rt.spawn(waiter);
  FailureCause cause = make_failure(Errc::device, "GPU 2 fell off the bus");
  failing.poison(cause);
  EXPECT_THROW(e.wait(), EventPoisoned);
  EXPECT_EQ(e.failure(), cause);
}

TEST(Tasks, WrongArgumentSizeIsReportedByTheTask) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  TaskId wants_int = test::task("task_test.wants_int", [](TaskContext& ctx) { (void)ctx.args_as<int>(); });
  Event e = rt.spawn(wants_int, task_args(std::uint64_t{1}));
  try {
    e.wait();
    FAIL();
  } catch (const EventPoisoned& err) {
    EXPECT_NE(std::string(err.what()).find("arguments are 8 bytes, but 4 were expected"), std::string::npos) << err.what();
  }
}

TEST(TasksBadInput, UnknownTaskName) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  CARAVAN_EXPECT_ERROR(rt.spawn("task_test.no_such_task"), Errc::not_found, "no task named 'task_test.no_such_task'");
  CARAVAN_EXPECT_ERROR(find_task("task_test.no_such_task"), Errc::not_found, "task_test.no_such_task");
  CARAVAN_EXPECT_ERROR(rt.spawn(TaskId{123456}), Errc::not_found, "no task has id 123456");
}

TEST(TasksBadInput, DuplicateOrEmptyRegistration) {
  test::task("task_test.dup", [](TaskContext&) {});
  CARAVAN_EXPECT_ERROR(register_task("task_test.dup", [](TaskContext&) {}), Errc::already_done, "already registered");
  CARAVAN_EXPECT_ERROR(register_task("", [](TaskContext&) {}), Errc::invalid_argument, "name must not be empty");
  CARAVAN_EXPECT_ERROR(register_task("task_test.empty_fn", TaskFn{}), Errc::invalid_argument, "empty");
}

TEST(TasksBadInput, WorkerCountMustBeInRange) {
  CARAVAN_EXPECT_ERROR(Runtime(RuntimeOptions{.cpu_workers = 0}), Errc::invalid_argument, "cpu_workers = 0");
  CARAVAN_EXPECT_ERROR(Runtime(RuntimeOptions{.cpu_workers = -3}), Errc::invalid_argument, "cpu_workers = -3");
  // Past the setting's bound (a thread count the system would refuse part-way).
  CARAVAN_EXPECT_ERROR(Runtime(RuntimeOptions{.cpu_workers = 100000}), Errc::invalid_argument,
                       "cpu_workers = 100000: must be in [1, 4096]");
  CARAVAN_EXPECT_ERROR(settings::set_override("CARAVAN_CPU_WORKERS", "-1"), Errc::invalid_argument,
                       "CARAVAN_CPU_WORKERS='-1'");
  // The failed constructions left no runtime behind.
  EXPECT_FALSE(Runtime::is_running());
}

TEST(TasksBadInput, WorkerCountFromTheEnvironmentIsValidated) {
  ::setenv("CARAVAN_CPU_WORKERS", "many", 1);
  CARAVAN_EXPECT_ERROR(Runtime(), Errc::invalid_argument, "CARAVAN_CPU_WORKERS='many': expected an integer");
  ::setenv("CARAVAN_CPU_WORKERS", "3", 1);
  {
    Runtime rt;
    EXPECT_EQ(rt.cpu_worker_count(), 3);
  }
  ::unsetenv("CARAVAN_CPU_WORKERS");
}

TEST(TasksBadInput, PriorityAndProcessorAreChecked) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  TaskId noop = test::task("task_test.noop", [](TaskContext&) {});
  CARAVAN_EXPECT_ERROR(rt.spawn(noop, {}, {.priority = kMaxPriority + 1}), Errc::invalid_argument, "priority 1001 is outside");
  CARAVAN_EXPECT_ERROR(rt.spawn(noop, {}, {.priority = kMinPriority - 1}), Errc::invalid_argument, "priority -1001 is outside");
  CARAVAN_EXPECT_ERROR(rt.spawn(noop, {}, {.processor = Processor{ProcessorKind::cpu, 0, 5}}), Errc::invalid_argument,
                       "processor rank0/cpu5 does not exist");
}

TEST(TasksBadInput, SpawnAfterShutdown) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  TaskId noop = test::task("task_test.noop", [](TaskContext&) {});
  rt.shutdown();
  CARAVAN_EXPECT_ERROR(rt.spawn(noop), Errc::shut_down, "shutting down");
}

}  // namespace
}  // namespace caravan
