#include "tests/runtime/test_util.h"

#include <atomic>
#include <thread>
#include <vector>

namespace caravan {
namespace {

using namespace std::chrono_literals;

struct NodeArgs {
  int launch_slot;  // which counter array
  int node;
};

std::atomic<int> g_runs[4][8];
std::atomic<int> g_order_errors{0};

// Node n of a launch checks that its dependencies (as encoded in the graph below) already ran
// in the same launch, by comparing run counters.
TEST(TaskGraph, LaunchesManyTimesInOrder) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  for (auto& row : g_runs)
    for (auto& c : row) c = 0;
  g_order_errors = 0;
  // A diamond with a tail: 0 -> {1, 2} -> 3 -> 4; node 5 independent.
  static const std::vector<std::vector<int>> kDeps = {{}, {0}, {0}, {1, 2}, {3}, {}};
  TaskId node = test::task("graph_test.node", [](TaskContext& ctx) {
    auto a = ctx.args_as<NodeArgs>();
    int mine = g_runs[a.launch_slot][a.node].load() + 1;
    for (int d : kDeps[static_cast<std::size_t>(a.node)])
      if (g_runs[a.launch_slot][d].load() < mine) ++g_order_errors;
    g_runs[a.launch_slot][a.node].store(mine);
  });
  TaskGraph graph;
  for (int n = 0; n < 6; ++n) {
    std::vector<TaskGraph::NodeId> deps(kDeps[static_cast<std::size_t>(n)].begin(), kDeps[static_cast<std::size_t>(n)].end());
    graph.add_task(node, task_args(NodeArgs{0, n}), deps);
  }
  EXPECT_EQ(graph.size(), 6u);
  EXPECT_EQ(graph.label(3), "graph_test.node");
  // Each launch waits for the previous one (iterative use).
  Event previous;
  for (int i = 0; i < 200; ++i) previous = graph.launch(previous);
  ASSERT_TRUE(previous.wait_for(30s));
  for (int n = 0; n < 6; ++n) EXPECT_EQ(g_runs[0][n].load(), 200) << "node " << n;
  EXPECT_EQ(g_order_errors.load(), 0);
}

TEST(TaskGraph, LaunchWaitsForItsPrecondition) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  std::atomic<int> started{0};
  TaskGraph graph;
  auto a = graph.add_node("count", [&](Event pre) {
    UserEvent done = UserEvent::create();
    pre.on_trigger([&, done](const FailureCause& f) {
      ++started;
      if (f) done.poison(f);
      else done.trigger();
    });
    return Event(done);
  });
  std::vector<TaskGraph::NodeId> deps{a};
  graph.add_node("after", [](Event pre) { return pre; }, deps);
  UserEvent go = UserEvent::create();
  Event run = graph.launch(go);
  EXPECT_FALSE(run.wait_for(20ms));
  EXPECT_EQ(started.load(), 0);
  go.trigger();
  EXPECT_TRUE(run.wait_for(5s));
  EXPECT_EQ(started.load(), 1);
}

TEST(TaskGraph, FailingNodePoisonsThatLaunchOnly) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  static std::atomic<int> calls{0};
  calls = 0;
  TaskId flaky = test::task("graph_test.flaky", [](TaskContext&) {
    if (calls.fetch_add(1) == 0) throw std::runtime_error("first launch fails");
  });
  TaskId noop = test::task("graph_test.noop", [](TaskContext&) {});
  TaskGraph graph;
  auto f = graph.add_task(flaky);
  std::vector<TaskGraph::NodeId> deps{f};
  graph.add_task(noop, {}, deps);
  Event first = graph.launch();
  EXPECT_THROW(first.wait(), EventPoisoned);
  Event second = graph.launch();
  EXPECT_NO_THROW(second.wait());
}

// The launch's event is not over while a node still runs, even once another node has failed.
TEST(TaskGraph, LaunchSettlesOnlyWhenEveryNodeHas) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  static std::atomic<int> dependent_runs{0};
  dependent_runs = 0;
  TaskId counts = test::task("graph_test.counts", [](TaskContext&) { ++dependent_runs; });
  UserEvent a_done = UserEvent::create();
  UserEvent slow_done = UserEvent::create();
  TaskGraph graph;
  const auto a = graph.add_node("a", [a_done](Event) { return Event(a_done); });
  const std::vector<TaskGraph::NodeId> after_a{a};
  graph.add_task(counts, {}, after_a);  // never runs: a fails
  graph.add_node("slow", [slow_done](Event) { return Event(slow_done); });
  Event run = graph.launch();
  a_done.poison("node a broke");
  EXPECT_EQ(run.query(), EventState::pending) << "the launch reported itself over while the slow node still ran";
  slow_done.trigger();
  try {
    run.wait();
    ADD_FAILURE() << "the launch should be poisoned by node a";
  } catch (const EventPoisoned& e) {
    ASSERT_TRUE(e.cause());
    EXPECT_NE(std::string(e.cause()->what()).find("node a broke"), std::string::npos) << e.cause()->what();
  }
  EXPECT_EQ(dependent_runs.load(), 0) << "a node whose dependency failed ran";
}

// A starter that throws, after other nodes have started, fails its node and its dependents; the
// launch does not throw and its event names the node.
TEST(TaskGraph, StarterThatThrowsFailsItsNode) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  static std::atomic<int> runs{0};
  runs = 0;
  TaskId counts = test::task("graph_test.counts2", [](TaskContext&) { ++runs; });
  TaskGraph graph;
  graph.add_task(counts);
  const auto thrower =
      graph.add_node("thrower", [](Event) -> Event { throw Error(Errc::invalid_argument, "bad starter"); });
  const std::vector<TaskGraph::NodeId> after{thrower};
  graph.add_task(counts, {}, after);
  Event run;
  ASSERT_NO_THROW(run = graph.launch());
  try {
    run.wait();
    ADD_FAILURE() << "the launch should be poisoned";
  } catch (const EventPoisoned& e) {
    ASSERT_TRUE(e.cause());
    EXPECT_EQ(e.cause()->code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.cause()->what()).find("node 1 ('thrower') failed to start: bad starter"), std::string::npos)
        << e.cause()->what();
  }
  EXPECT_EQ(runs.load(), 1) << "the first node runs; the one after the thrower does not";
}

TEST(TaskGraph, BadNodesAreRejected) {
  TaskGraph graph;
  TaskId noop = test::task("graph_test.noop", [](TaskContext&) {});
  std::vector<TaskGraph::NodeId> bad{3};
  CARAVAN_EXPECT_ERROR(graph.add_task(noop, {}, bad), Errc::invalid_argument, "depends on node 3, which does not exist");
  CARAVAN_EXPECT_ERROR(graph.add_task("graph_test.missing"), Errc::not_found, "graph_test.missing");
  CARAVAN_EXPECT_ERROR(graph.add_task(noop, {}, {}, 5000), Errc::invalid_argument, "priority 5000");
  CARAVAN_EXPECT_ERROR(graph.add_node("empty", TaskGraph::Starter{}), Errc::invalid_argument, "empty starter");
  CARAVAN_EXPECT_ERROR(graph.label(9), Errc::invalid_argument, "no node 9");
  EXPECT_EQ(graph.size(), 0u);
}

// With a runtime running, a processor it does not have is refused when the node is added (not
// at every launch); a graph built before any runtime is checked at launch, as spawn checks.
TEST(TaskGraph, ProcessorsThatDoNotExistAreRejectedWhenAdded) {
  TaskId noop = test::task("graph_test.noop", [](TaskContext&) {});
  TaskGraph early;
  early.add_task(noop, {}, {}, 0, Processor{ProcessorKind::cpu, Processor::kThisRank, 1});
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  TaskGraph graph;
  CARAVAN_EXPECT_ERROR(graph.add_task(noop, {}, {}, 0, Processor{ProcessorKind::cpu, Processor::kThisRank, 1}),
                       Errc::invalid_argument, "TaskGraph::add_task('graph_test.noop'): processor");
  CARAVAN_EXPECT_ERROR(graph.add_task(noop, {}, {}, 0, Processor{ProcessorKind::gpu, Processor::kThisRank, 64}),
                       Errc::invalid_argument, "does not exist on this rank");
  CARAVAN_EXPECT_ERROR(graph.add_task(noop, {}, {}, 0, Processor{ProcessorKind::cpu, 7, 0}), Errc::invalid_argument,
                       "this job has 1 rank(s)");
  EXPECT_EQ(graph.size(), 0u);
  try {
    early.launch().wait();
    ADD_FAILURE() << "a launch on a processor that does not exist should fail";
  } catch (const EventPoisoned& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
}

TEST(TaskGraph, EmptyGraphLaunchIsItsPrecondition) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  TaskGraph graph;
  EXPECT_TRUE(graph.launch().is_none());
}

}  // namespace
}  // namespace caravan
