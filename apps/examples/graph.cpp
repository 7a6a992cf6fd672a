// Events beyond a single wait: a user event as a start gate, a task graph (tasks and a copy as
// nodes) launched several times, a failing task and the cause its dependents report, and a
// cancelled copy.
// Run: build/release/apps/examples/example_graph
#include <caravan/caravan.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

namespace {

constexpr std::int64_t kPoints = 1 << 16;

// What the graph's two tasks receive: the instance to write or read.
struct Pass {
  const caravan::Instance* instance;
};

// Which launch is running: produce counts it up, check reads it (the launches run one after another).
std::atomic<std::int64_t> g_launch{-1};

std::int64_t value_of(std::int64_t point, std::int64_t launch) { return point * 7 + launch; }

int run() {
  caravan::Runtime rt;
  const caravan::FieldSpace fields({{"value", sizeof(std::int64_t)}});
  const caravan::Rect space = caravan::Rect::from_extents({kPoints});
  const caravan::MemoryId host = caravan::local_memory(caravan::MemoryKind::sys);
  const auto src = caravan::Instance::create(host, space, fields, caravan::Layout::parse("F,x"));
  const auto dst = caravan::Instance::create(host, space, fields, caravan::Layout::parse("x,F"));

  // 1. A graph: produce -> copy -> check, built once and launched three times in a row.
  static std::atomic<int> checked{0}, wrong{0};
  const caravan::TaskId produce = caravan::register_task("example.produce", [](caravan::TaskContext& ctx) {
    const auto pass = ctx.args_as<Pass>();
    const std::int64_t launch = ++g_launch;
    for (std::int64_t i = 0; i < kPoints; ++i) {
      const std::int64_t v = value_of(i, launch);
      std::memcpy(pass.instance->data() + pass.instance->offset(caravan::Point{i}, 0), &v, sizeof v);
    }
  });
  const caravan::TaskId check = caravan::register_task("example.check", [](caravan::TaskContext& ctx) {
    const auto pass = ctx.args_as<Pass>();
    for (std::int64_t i = 0; i < kPoints; ++i) {
      std::int64_t v = 0;
      std::memcpy(&v, pass.instance->data() + pass.instance->offset(caravan::Point{i}, 0), sizeof v);
      if (v != value_of(i, g_launch.load())) ++wrong;
    }
    ++checked;
  });
  caravan::TaskGraph graph;
  const auto made = graph.add_task(produce, caravan::task_args(Pass{&src}));
  const caravan::TaskGraph::NodeId after_made[] = {made};
  const auto copied = caravan::add_copy(graph, src, dst, after_made);  // checked and planned here
  const caravan::TaskGraph::NodeId after_copy[] = {copied};
  graph.add_task(check, caravan::task_args(Pass{&dst}), after_copy);

  caravan::UserEvent start = caravan::UserEvent::create();  // nothing runs before it triggers
  caravan::Event previous = start;
  for (int launch = 0; launch < 3; ++launch) previous = graph.launch(previous);  // each after the one before
  if (checked != 0) {
    std::printf("a launch ran before the start gate\n");
    return 1;
  }
  start.trigger();
  previous.wait();  // the last launch's event: every node of it has finished
  std::printf("graph: %d launches checked, %d wrong values\n", checked.load(), wrong.load());
  if (checked != 3 || wrong != 0) return 1;

  // 2. A task that fails: its dependents do not run, and waiting on them reports the first cause.
  static std::atomic<int> ran_after{0};
  const caravan::TaskId read_sensor = caravan::register_task(
      "example.read_sensor", [](caravan::TaskContext&) { throw std::runtime_error("sensor 3 is offline"); });
  const caravan::TaskId average = caravan::register_task("example.average", [](caravan::TaskContext&) { ++ran_after; });
  const caravan::Event reading = rt.spawn(read_sensor);
  const caravan::Event averaged = rt.spawn(average, {}, {.precondition = reading});
  try {
    averaged.wait();
    std::printf("the dependent of a failed task succeeded\n");
    return 1;
  } catch (const caravan::EventPoisoned& e) {
    // cause() is the first failure however far it travelled: here the body's exception.
    std::printf("failure: %s: %s\n", std::string(caravan::to_string(e.cause()->code())).c_str(), e.cause()->what());
    if (e.cause()->code() != caravan::Errc::task_failed || ran_after != 0) return 1;
  }

  // 3. Cancelling a copy (copies and fills can be cancelled; tasks cannot).
  caravan::UserEvent hold = caravan::UserEvent::create();
  const caravan::Event pending_copy = caravan::copy(src, dst, {.precondition = hold});
  const bool cancelled = caravan::cancel(pending_copy);
  hold.trigger();
  try {
    pending_copy.wait();
    std::printf("the cancelled copy ran\n");
    return 1;
  } catch (const caravan::EventPoisoned& e) {
    std::printf("cancel: %s (%s)\n", cancelled ? "accepted" : "refused",
                std::string(caravan::to_string(e.cause()->code())).c_str());
    if (!cancelled || e.cause()->code() != caravan::Errc::cancelled) return 1;
  }
  std::printf("every step behaved as expected\n");
  return 0;
}

}  // namespace

// Caravan reports errors as exceptions: caravan::Error (a code and a message naming what was
// refused), and EventPoisoned from a wait on an event whose work failed.
int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_graph: %s\n", e.what());
    return 1;
  }
}
