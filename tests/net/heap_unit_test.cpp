// Unit: the symmetric heap of a runtime alone (one rank, one node): the same calls as in a
// job, on an anonymous shared mapping.
#include "tests/runtime/test_util.h"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <thread>
#include <vector>

namespace caravan {
namespace {

using namespace std::chrono_literals;

class HeapAlone : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::getenv("WORLD_SIZE")) GTEST_SKIP() << "runs as a runtime alone; WORLD_SIZE is set";
    rt_.emplace(RuntimeOptions{.cpu_workers = 2});
  }
  std::optional<Runtime> rt_;
};

TEST_F(HeapAlone, AllocatePutGetSignalWait) {
  settings::ScopedOverride heap_bytes("CARAVAN_SYMMETRIC_HEAP_BYTES", "1M");
  SymmetricHeap heap = SymmetricHeap::current();
  EXPECT_EQ(heap.capacity(), 1u << 20);
  SymmetricRegion data = heap.allocate(1000);
  SymmetricRegion flags = heap.allocate_signals(2);
  EXPECT_EQ(flags.offset % 64, 0u);
  EXPECT_EQ(heap.peer(data, 0), heap.local(data));
  std::vector<std::byte> in(1000, std::byte{9}), out(1000);
  heap.put(data, 0, in.data(), in.size(), 0);
  heap.get(out.data(), data, 0, out.size(), 0);
  EXPECT_EQ(in, out);
  // A thread waits on a flag that another sets after writing data (release/acquire).
  std::thread producer([&] {
    std::this_thread::sleep_for(10ms);
    std::byte value{42};
    heap.put_signal(data, 500, &value, 1, flags, 1, SignalOp::set, 7, 0);
  });
  EXPECT_EQ(heap.wait_until(flags, 1, SignalCompare::ge, 7, 10s), 7u);
  EXPECT_EQ(heap.local(data)[500], std::byte{42});
  producer.join();
  heap.signal(flags, 1, SignalOp::add, 3, 0);
  EXPECT_EQ(heap.read(flags, 1), 10u);
  CARAVAN_EXPECT_ERROR(heap.wait_until(flags, 0, SignalCompare::ne, 0, 20ms), Errc::timeout, "signal 0 is 0, still not != 0");
  CARAVAN_EXPECT_ERROR(heap.allocate(2u << 20), Errc::invalid_argument, "do not fit");
  CARAVAN_EXPECT_ERROR(heap.allocate(8, 3), Errc::invalid_argument, "not a power of two");
  CARAVAN_EXPECT_ERROR(heap.put(data, 999, in.data(), 2, 0), Errc::invalid_argument, "outside the region");
  CARAVAN_EXPECT_ERROR(heap.put(data, 0, in.data(), 1, 1), Errc::invalid_argument, "rank 1 is outside [0, 1)");
  CARAVAN_EXPECT_ERROR(heap.signal(flags, 2, SignalOp::set, 1, 0), Errc::invalid_argument, "outside the region");
  CARAVAN_EXPECT_ERROR(heap.signal(flags, 0, SignalOp::set, 1, 0, MemoryOrder::acquire), Errc::invalid_argument, "acquire");
  CARAVAN_EXPECT_ERROR(heap.wait_until(flags, 0, SignalCompare::eq, 0, 1s, MemoryOrder::release), Errc::invalid_argument,
                       "relaxed or acquire");
  heap.barrier();
}

TEST(HeapWithoutRuntime, SaysSo) {
  CARAVAN_EXPECT_ERROR(SymmetricHeap::current(), Errc::shut_down, "no Caravan runtime is running");
}

// Threads of one rank allocating at once get disjoint regions (two read the same next offset
// before); and what the heap refuses: null buffers, a signal index past any region, a signal
// count whose byte size wraps.
TEST_F(HeapAlone, ConcurrentAllocationsAreDisjointAndBadCallsAreRefused) {
  settings::ScopedOverride heap_bytes("CARAVAN_SYMMETRIC_HEAP_BYTES", "4M");
  SymmetricHeap heap = SymmetricHeap::current();
  constexpr int kThreads = 4, kEach = 200;
  std::vector<std::vector<SymmetricRegion>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) got[static_cast<std::size_t>(t)].push_back(heap.allocate(1 + (i % 7) * 100, 8));
    });
  for (auto& t : threads) t.join();
  std::vector<SymmetricRegion> all;
  for (const auto& g : got) all.insert(all.end(), g.begin(), g.end());
  std::sort(all.begin(), all.end(),
            [](const SymmetricRegion& a, const SymmetricRegion& b) { return a.offset < b.offset; });
  for (std::size_t i = 1; i < all.size(); ++i)
    EXPECT_GE(all[i].offset, all[i - 1].offset + all[i - 1].bytes) << "regions " << i - 1 << " and " << i << " overlap";
  SymmetricRegion data = heap.allocate(64);
  std::vector<std::byte> buffer(64);
  CARAVAN_EXPECT_ERROR(heap.put(data, 0, nullptr, 8, 0), Errc::invalid_argument, "SymmetricHeap::put: src is null");
  CARAVAN_EXPECT_ERROR(heap.get(nullptr, data, 0, 8, 0), Errc::invalid_argument, "SymmetricHeap::get: dst is null");
  SymmetricRegion flags = heap.allocate_signals(2);
  CARAVAN_EXPECT_ERROR(heap.signal(flags, std::size_t{1} << 62, SignalOp::set, 1, 0), Errc::invalid_argument,
                       "is past any region");
  CARAVAN_EXPECT_ERROR(heap.allocate_signals(std::size_t{1} << 62), Errc::invalid_argument, "do not fit");
}

// A handle kept past its runtime's end is refused, not a dangling pointer into a freed heap, also
// once another runtime runs.
TEST(HeapAfterItsRuntime, IsRefusedWithShutDown) {
  if (std::getenv("WORLD_SIZE")) GTEST_SKIP() << "runs as a runtime alone; WORLD_SIZE is set";
  settings::ScopedOverride heap_bytes("CARAVAN_SYMMETRIC_HEAP_BYTES", "1M");
  std::optional<SymmetricHeap> kept;
  SymmetricRegion region;
  {
    Runtime rt(RuntimeOptions{.cpu_workers = 1});
    kept = SymmetricHeap::current();
    region = kept->allocate(64);
  }
  std::byte value{1};
  CARAVAN_EXPECT_ERROR(kept->put(region, 0, &value, 1, 0), Errc::shut_down, "SymmetricHeap::put: the runtime");
  Runtime next(RuntimeOptions{.cpu_workers = 1});
  CARAVAN_EXPECT_ERROR(kept->local(region), Errc::shut_down, "SymmetricHeap::local: the runtime");
  EXPECT_NE(SymmetricHeap::current().local(SymmetricHeap::current().allocate(64)), nullptr);
}

}  // namespace
}  // namespace caravan
