// A first program: tasks, their events, priorities and a merged precondition.
// Run: build/release/apps/examples/example_tasks
#include <caravan/caravan.h>

#include <atomic>
#include <cstdio>
#include <exception>

struct Range {
  int begin, end;
};

namespace {

int run() {
  static std::atomic<long> total{0};
  // Tasks are registered by name, once per process (before or after the runtime starts).
  caravan::TaskId sum = caravan::register_task("example.sum", [](caravan::TaskContext& ctx) {
    auto r = ctx.args_as<Range>();
    long s = 0;
    for (int i = r.begin; i < r.end; ++i) s += i;
    total += s;
    std::printf("sum [%d, %d) = %ld\n", r.begin, r.end, s);
  });

  caravan::Runtime rt;  // CPU workers: CARAVAN_CPU_WORKERS, default one per core

  // Two independent tasks, then one that waits for both (a merged precondition).
  caravan::Event a = rt.spawn(sum, caravan::task_args(Range{0, 100}));
  caravan::Event b = rt.spawn(sum, caravan::task_args(Range{100, 200}), {.priority = 5});
  caravan::Event c = rt.spawn(sum, caravan::task_args(Range{0, 200}), {.precondition = caravan::merge_events({a, b})});
  c.wait();  // throws caravan::EventPoisoned if anything it depends on failed

  // 0 + ... + 199, twice: once in two halves, once whole.
  const long expected = 2 * (199L * 200 / 2);
  if (total != expected) {
    std::printf("wrong total %ld (expected %ld)\n", total.load(), expected);
    return 1;
  }
  std::printf("total %ld, as expected\n", total.load());
  return 0;
}

}  // namespace

// Caravan reports errors as exceptions: caravan::Error (a code and a message naming what was
// refused, e.g. a bad CARAVAN_DSK_DIR), and EventPoisoned from a wait on an event whose work failed.
int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_tasks: %s\n", e.what());
    return 1;
  }
}
