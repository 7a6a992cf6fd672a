// Multi-process: events used across ranks (remote waits, preconditions, triggers, poison, merges)
// and tasks spawned on other ranks by name.
#include "runtime/net/remote_events.h"
#include "tests/net/net_test_util.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <mutex>
#include <random>
#include <thread>

namespace caravan {
namespace {

using namespace std::chrono_literals;
using test::JobTest;

// Rank 0 makes a user event; every rank gets its handle.
Event event_of_rank0(Runtime& rt, UserEvent* made) {
  Event mine;
  if (rt.rank() == 0) mine = *made = UserEvent::create();
  return test::all_gather(rt, mine)[0];
}

TEST_F(JobTest, RemoteWaitSeesTheOwnersTrigger) {
  UserEvent made;
  Event e = event_of_rank0(rt(), &made);
  ASSERT_EQ(e.owner_rank(), 0);
  if (rank() != 0) {
    EXPECT_EQ(e.query(), EventState::pending);
    EXPECT_FALSE(e.wait_for(50ms));  // nobody has triggered it yet
  }
  rt().barrier(30s);
  if (rank() == 0) made.trigger();
  EXPECT_TRUE(e.wait_for(20s));
  EXPECT_EQ(e.query(), EventState::triggered);
  EXPECT_EQ(e.failure(), nullptr);
  rt().barrier(30s);
}

TEST_F(JobTest, RemoteEventAsPreconditionAndInMerges) {
  UserEvent made;
  Event e = event_of_rank0(rt(), &made);
  static std::atomic<int> ran{0};
  ran = 0;
  TaskId count = test::task("net.count", [](TaskContext&) { ran.fetch_add(1); });
  Event local_task = rt().spawn(count, {}, {.precondition = e});
  UserEvent mine = UserEvent::create();
  Event merged = merge_events({e, mine});
  EXPECT_FALSE(local_task.wait_for(100ms));
  EXPECT_EQ(ran.load(), 0);
  rt().barrier(30s);
  if (rank() == 0) made.trigger();
  local_task.wait();
  EXPECT_EQ(ran.load(), 1);
  EXPECT_FALSE(merged.wait_for(10ms));
  mine.trigger();
  EXPECT_TRUE(merged.wait_for(20s));
  rt().barrier(30s);
}

TEST_F(JobTest, AnyRankMayTriggerARemoteUserEvent) {
  UserEvent made;
  Event e = event_of_rank0(rt(), &made);
  rt().barrier(30s);
  if (rank() == world() - 1) UserEvent::from_event(e).trigger();  // travels to rank 0
  EXPECT_TRUE(e.wait_for(20s));
  EXPECT_EQ(e.query(), EventState::triggered);
  rt().barrier(30s);
}

TEST_F(JobTest, PoisonCrossesRanksWithItsCause) {
  UserEvent made;
  Event e = event_of_rank0(rt(), &made);
  TaskId never = test::task("net.never", [](TaskContext&) { ADD_FAILURE() << "a task ran after a poisoned precondition"; });
  Event task = rt().spawn(never, {}, {.precondition = e});
  rt().barrier(30s);
  if (rank() == 0) made.poison(make_failure(Errc::device, "tile 7 is corrupt"));
  try {
    task.wait();
    ADD_FAILURE() << "expected the task's completion to be poisoned";
  } catch (const EventPoisoned& p) {
    ASSERT_NE(p.cause(), nullptr);
    EXPECT_EQ(p.cause()->code(), Errc::device);
    EXPECT_STREQ(p.cause()->what(), "tile 7 is corrupt");
  }
  EXPECT_EQ(e.query(), EventState::poisoned);
  rt().barrier(30s);
}

struct SpawnArgs {
  int expected_rank;
  int value;
};

TEST_F(JobTest, TasksSpawnOnOtherRanksByName) {
  // Each rank spawns one task on every rank, with arguments; the body checks where it runs.
  TaskId check = test::task("net.check_where", [](TaskContext& ctx) {
    auto args = ctx.args_as<SpawnArgs>();
    if (Runtime::current().rank() != args.expected_rank || ctx.processor.rank != args.expected_rank)
      throw Error(Errc::internal, fmt::format("ran on rank {}, expected {}", Runtime::current().rank(), args.expected_rank));
    if (args.value != 1000 + args.expected_rank) throw Error(Errc::internal, "arguments were garbled");
  });
  rt().barrier(30s);  // every rank has registered the task
  std::vector<Event> done;
  for (int r = 0; r < world(); ++r) {
    SpawnArgs args{r, 1000 + r};
    done.push_back(rt().spawn("net.check_where", task_args(args),
                              {.processor = Processor{ProcessorKind::cpu, static_cast<std::uint16_t>(r), 0}}));
  }
  (void)check;
  for (const Event& e : done) EXPECT_TRUE(e.wait_for(20s));
  for (const Event& e : done) EXPECT_EQ(e.owner_rank(), rank());  // completions live with the spawner
  // Every spawn_done arrived and cleared its record.
  EXPECT_EQ(test::network(rt()).events().pending_spawn_count(), 0u);
  rt().barrier(30s);
}

TEST_F(JobTest, RemoteTaskFailuresAndUnknownNamesPoisonTheCompletion) {
  test::task("net.throws", [](TaskContext&) { throw std::runtime_error("remote body failed"); });
  // Registered on rank 0 only: other ranks do not know it.
  if (rank() == 0) test::task("net.only_on_rank0", [](TaskContext&) {});
  rt().barrier(30s);
  int target = (rank() + 1) % world();
  Processor there{ProcessorKind::cpu, static_cast<std::uint16_t>(target), 0};
  Event failed = rt().spawn("net.throws", {}, {.processor = there});
  try {
    failed.wait();
    ADD_FAILURE() << "expected a poisoned completion";
  } catch (const EventPoisoned& p) {
    EXPECT_EQ(p.cause()->code(), Errc::task_failed);
    EXPECT_NE(std::string(p.cause()->what()).find("remote body failed"), std::string::npos) << p.cause()->what();
  }
  if (rank() == 0 && target != 0) {
    Event unknown = rt().spawn("net.only_on_rank0", {}, {.processor = there});
    try {
      unknown.wait();
      ADD_FAILURE() << "expected not_found";
    } catch (const EventPoisoned& p) {
      EXPECT_EQ(p.cause()->code(), Errc::not_found);
      EXPECT_NE(std::string(p.cause()->what()).find("net.only_on_rank0"), std::string::npos) << p.cause()->what();
    }
  }
  CARAVAN_EXPECT_ERROR(rt().spawn("net.throws", {}, {.processor = Processor{ProcessorKind::cpu, static_cast<std::uint16_t>(world()), 0}}),
                       Errc::invalid_argument, "does not exist");
  CARAVAN_EXPECT_ERROR(rt().spawn("net.throws", {}, {.processor = Processor{ProcessorKind::cpu, static_cast<std::uint16_t>(target), 3}}),
                       Errc::invalid_argument, "does not exist");
  if (target != rank()) {
    // How many GPUs a rank has is its own business: the target checks, and a GPU it does not
    // have poisons the completion, naming the processor.
    Event missing_gpu =
        rt().spawn("net.throws", {}, {.processor = Processor{ProcessorKind::gpu, static_cast<std::uint16_t>(target), 999}});
    try {
      missing_gpu.wait();
      ADD_FAILURE() << "expected a poisoned completion";
    } catch (const EventPoisoned& p) {
      EXPECT_EQ(p.cause()->code(), Errc::invalid_argument);
      EXPECT_NE(std::string(p.cause()->what()).find("gpu999 does not exist"), std::string::npos) << p.cause()->what();
    }
  }
  rt().barrier(30s);
}

TEST_F(JobTest, ChainsOfTasksHopAcrossRanks) {
  // Rank 0 builds a chain of 40 tasks, each on the next rank, each after the previous one; the
  // tasks append their rank to a log kept on rank 0 through remote spawns of "net.log" there.
  static std::mutex log_mutex;
  static std::vector<int> log;
  log.clear();
  test::task("net.log", [](TaskContext& ctx) {
    std::lock_guard lock(log_mutex);
    log.push_back(ctx.args_as<int>());
  });
  test::task("net.hop", [](TaskContext& ctx) {
    int step = ctx.args_as<int>();
    // Log on rank 0, and wait for it, so that the log's order is the chain's order.
    Runtime::current().spawn("net.log", task_args(step), {.processor = Processor{ProcessorKind::cpu, 0, 0}}).wait();
  });
  rt().barrier(30s);
  if (rank() == 0) {
    Event previous;
    for (int step = 0; step < 40; ++step) {
      auto target = static_cast<std::uint16_t>(step % world());
      previous = rt().spawn("net.hop", task_args(step), {.precondition = previous, .processor = Processor{ProcessorKind::cpu, target, 0}});
    }
    EXPECT_TRUE(previous.wait_for(60s));
    std::lock_guard lock(log_mutex);
    ASSERT_EQ(log.size(), 40u);
    for (int step = 0; step < 40; ++step) EXPECT_EQ(log[static_cast<std::size_t>(step)], step);
  }
  rt().barrier(60s);
}

TEST_F(JobTest, ManyThreadsWaitOnManyRemoteEvents) {
  // Stress the proxy table: every rank makes 200 user events; every rank's 4 threads wait on
  // and merge random subsets of everyone's events while the owners trigger them in random order.
  constexpr int kPerRank = 200;
  std::vector<UserEvent> mine;
  for (int i = 0; i < kPerRank; ++i) mine.push_back(UserEvent::create());
  std::vector<Event> all;
  for (int i = 0; i < kPerRank; ++i) {
    auto column = test::all_gather(rt(), static_cast<Event>(mine[static_cast<std::size_t>(i)]));
    all.insert(all.end(), column.begin(), column.end());
  }
  std::atomic<int> waited{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 random(static_cast<unsigned>(rank() * 97 + t));
      for (int i = 0; i < 100; ++i) {
        Event a = all[random() % all.size()], b = all[random() % all.size()];
        if (merge_events({a, b}).wait_for(60s)) waited.fetch_add(1);
      }
    });
  }
  std::mt19937 random(static_cast<unsigned>(rank()));
  std::shuffle(mine.begin(), mine.end(), random);
  for (auto& e : mine) {
    e.trigger();
    if (random() % 8 == 0) std::this_thread::sleep_for(1ms);
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(waited.load(), 400);
  for (const Event& e : all) EXPECT_TRUE(e.wait_for(30s));
  // One proxy per remote event at most (the waits above shared them), all of them kept.
  EXPECT_LE(test::network(rt()).events().proxy_count(), static_cast<std::size_t>(kPerRank * (world() - 1)));
  EXPECT_GT(test::network(rt()).events().proxy_count(), 0u);
  rt().barrier(60s);
}

TEST_F(JobTest, EventsOfARankThatShutDownArePoisonedNotHung) {
  // The last rank makes an event it never triggers, and shuts down; the others' waits end with
  // Errc::shut_down instead of hanging.
  UserEvent never;
  Event mine;
  if (rank() == world() - 1) mine = never = UserEvent::create();
  Event e = test::all_gather(rt(), mine)[static_cast<std::size_t>(world() - 1)];
  if (rank() == world() - 1) {
    rt().shutdown();
    return;
  }
  try {
    e.wait_for(30s);
    ADD_FAILURE() << "expected a poisoned event";
  } catch (const EventPoisoned& p) {
    EXPECT_EQ(p.cause()->code(), Errc::shut_down) << p.cause()->what();
  }
}

// A thread waiting in a collective that other ranks never join (here a barrier without a
// timeout) ends with Errc::shut_down when its rank shuts down, instead of holding the shutdown
// up for ever (and outliving the Network). The other ranks stay alive meanwhile.
TEST_F(JobTest, ACollectiveWaitingAtShutdownEndsWithShutDown) {
  using Clock = std::chrono::steady_clock;
  rt().barrier(30s);
  if (rank() != 0) {
    std::this_thread::sleep_for(3s);  // alive, and not in the barrier rank 0 waits in
    return;
  }
  Errc code = Errc::internal;
  std::string what = "(the barrier returned)";
  double seconds = 0;
  std::thread waiter([&] {
    const auto start = Clock::now();
    try {
      rt().barrier();
    } catch (const Error& e) {
      code = e.code();
      what = e.what();
    }
    seconds = std::chrono::duration<double>(Clock::now() - start).count();
  });
  std::this_thread::sleep_for(200ms);
  rt().shutdown();
  waiter.join();
  EXPECT_EQ(code, Errc::shut_down) << what;
  EXPECT_NE(what.find("rank 0 is shutting down"), std::string::npos) << what;
  EXPECT_LT(seconds, 2.5) << "the barrier waited for the other ranks' byes: " << what;
}

// On_trigger callbacks of events other ranks trigger run on the network's progress thread: a
// wait there would stop the thread that must deliver what it waits for. It is refused by name.
TEST_F(JobTest, CallbacksOfRemoteTriggersMayNotBlock) {
  UserEvent go;
  Event mine;
  if (rank() == 1) mine = go = UserEvent::create();
  const Event remote = test::all_gather(rt(), mine)[1];
  UserEvent never;
  std::promise<std::pair<Errc, std::string>> seen;
  if (rank() == 0) {
    never = UserEvent::create();
    remote.on_trigger([&](const FailureCause&) {
      try {
        never.wait();
        seen.set_value({Errc::internal, "(the wait returned)"});
      } catch (const Error& e) {
        seen.set_value({e.code(), e.what()});
      }
    });
  }
  rt().barrier(30s);
  if (rank() == 1) go.trigger();
  if (rank() == 0) {
    auto result = seen.get_future();
    ASSERT_EQ(result.wait_for(30s), std::future_status::ready) << "the callback never ran, or blocked";
    const auto [code, what] = result.get();
    EXPECT_EQ(code, Errc::invalid_argument) << what;
    EXPECT_NE(what.find("progress thread"), std::string::npos) << what;
    never.trigger();
  }
  rt().barrier(30s);
}

}  // namespace
}  // namespace caravan
