#include <caravan/caravan.h>

#include <atomic>
#include <cstdio>
#include <cstring>

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
  // caravan::dma: a copy that changes the layout, after the tasks.
  const caravan::FieldSpace fields({{"a", 4}, {"b", 8}});
  const caravan::Rect space = caravan::Rect::from_extents({1000});
  const caravan::MemoryId sys{0, 0, caravan::MemoryKind::sys, 0};
  auto aos = caravan::Instance::create(sys, space, fields, caravan::Layout::parse("F,x"));
  auto soa = caravan::Instance::create(sys, space, fields, caravan::Layout::parse("x,F"));
  auto back = caravan::Instance::create(sys, space, fields, caravan::Layout::parse("F,x"));
  for (std::uint64_t i = 0; i < aos.footprint_bytes(); ++i) aos.data()[i] = static_cast<std::byte>(i * 7 + 3);
  caravan::Event there = caravan::copy(aos, soa, {.precondition = b});
  caravan::copy(soa, back, {.precondition = there}).wait();
  if (std::memcmp(aos.data(), back.data(), aos.footprint_bytes()) != 0) {
    std::printf("downstream: the copies changed the data\n");
    return 1;
  }
  std::printf("downstream: find_package(caravan) works, sum = %d, copies round-trip\n", sum.load());
  return 0;
}
