// Multi-process: a rank that dies or falls silent. The survivors must notice within a bounded
// time, fail the work that depended on it with an Errc::transport cause naming it, and shut
// down without waiting for it; `caravan run` must exit non-zero and name it. These tests are
// run through expect_rank_failure.sh, which checks the launcher's side.
#include "tests/net/net_test_util.h"

#include <fmt/format.h>

#include <signal.h>

#include <thread>

namespace caravan {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::JobTest;

// What every survivor waits on: an event the victim owns (never triggered) and a task spawned
// on the victim that would run for a long time. Both must fail, naming the victim, soon after
// it is gone.
void expect_failure_reported(Runtime& rt, int victim, Event victims_event, Event victims_task,
                             Clock::time_point gone_at, std::string_view how) {
  std::string name = fmt::format("rank {}", victim);
  for (const Event& e : {victims_event, victims_task}) {
    try {
      e.wait_for(30s);
      ADD_FAILURE() << "a wait on rank " << victim << "'s work ended without an error";
    } catch (const EventPoisoned& p) {
      EXPECT_EQ(p.cause()->code(), Errc::transport) << p.cause()->what();
      EXPECT_NE(std::string(p.cause()->what()).find(name), std::string::npos) << p.cause()->what();
      EXPECT_NE(std::string(p.cause()->what()).find(how), std::string::npos) << p.cause()->what();
    }
  }
  auto noticed = Clock::now() - gone_at;
  EXPECT_LT(noticed, 10s) << "the failure took " << std::chrono::duration<double>(noticed).count() << " s to notice";
  // Collectives cannot complete any more, and say why instead of hanging.
  CARAVAN_EXPECT_ERROR(rt.barrier(30s), Errc::transport, name);
}

struct Shared {
  Event victims_event;
};

TEST_F(JobTest, KilledRankIsReportedWithin10Seconds) {
  int victim = world() - 1;
  test::task("failure.long", [](TaskContext&) { std::this_thread::sleep_for(20s); });
  UserEvent never;
  Shared mine;
  if (rank() == victim) mine.victims_event = never = UserEvent::create();
  Event victims_event = test::all_gather(rt(), mine)[static_cast<std::size_t>(victim)].victims_event;
  Event victims_task;
  if (rank() != victim)
    victims_task = rt().spawn("failure.long", {}, {.processor = Processor{ProcessorKind::cpu, static_cast<std::uint16_t>(victim), 0}});
  rt().barrier(30s);
  if (rank() == victim) {
    std::this_thread::sleep_for(200ms);  // the survivors are waiting by now
    raise(SIGKILL);
  }
  expect_failure_reported(rt(), victim, victims_event, victims_task, Clock::now() + 200ms, "");
}

TEST_F(JobTest, SilentRankIsDeclaredFailedByHeartbeat) {
  // SIGSTOP: the process exists but says nothing (a hung or cut-off node). Only the heartbeat
  // timeout (CARAVAN_PEER_TIMEOUT_S, 2 s for this test) can tell.
  int victim = world() - 1;
  test::task("failure.long", [](TaskContext&) { std::this_thread::sleep_for(20s); });
  UserEvent never;
  Shared mine;
  if (rank() == victim) mine.victims_event = never = UserEvent::create();
  Event victims_event = test::all_gather(rt(), mine)[static_cast<std::size_t>(victim)].victims_event;
  Event victims_task;
  if (rank() != victim)
    victims_task = rt().spawn("failure.long", {}, {.processor = Processor{ProcessorKind::cpu, static_cast<std::uint16_t>(victim), 0}});
  rt().barrier(30s);
  if (rank() == victim) raise(SIGSTOP);
  auto stopped_at = Clock::now();
  expect_failure_reported(rt(), victim, victims_event, victims_task, stopped_at, "sent nothing for");
  // Rank 0 cleans up, so that the launcher sees the victim end (by a signal) and names it.
  if (rank() == 0) kill(rt().rank_info(victim).pid, SIGKILL);
}

}  // namespace
}  // namespace caravan
