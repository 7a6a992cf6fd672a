#include <caravan/caravan.h>

#include <atomic>
#include <cstdio>

int main() {
  static std::atomic<int> sum{0};
  caravan::TaskId add = caravan::register_task("downstream.add", [](caravan::TaskContext& ctx) {
    sum += ctx.args_as<int>();
  });
  caravan::Runtime rt(caravan::RuntimeOptions{.cpu_workers = 2});
  caravan::Event a = rt.spawn(add, caravan::task_args(40));
  caravan::Event b = rt.spawn(add, caravan::task_args(2), {.precondition = a});
  b.wait();
  if (sum.load() != 42) {
    std::printf("downstream: wrong sum %d\n", sum.load());
    return 1;
  }
  std::printf("downstream: find_package(caravan) works, sum = %d\n", sum.load());
  return 0;
}
