// Intermediate buffers kept for reuse (runtime/dma/buffer_cache.h): best fit, bounded, and used
// by the engine so that back-to-back pipelined copies do not allocate again.
#include "runtime/dma/buffer_cache.h"
#include "runtime/dma/engine.h"
#include "tests/dma/dma_test_util.h"

#include <caravan/settings.h>

#include <chrono>

namespace caravan {
namespace {

using namespace std::chrono_literals;
using test::dsk_memory;
using test::sys_memory;

TEST(BufferCache, TakesTheSmallestIdleBufferThatFitsWithinAQuarterMore) {
  dma::BufferCache cache(1 << 20);
  const MemoryId sys = sys_memory();
  EXPECT_EQ(cache.take(sys, 100), nullptr) << "nothing kept yet";
  auto big = dma::Storage::allocate_host(sys, 4096);
  auto small = dma::Storage::allocate_host(sys, 1024);
  const dma::Storage* big_raw = big.get();
  const dma::Storage* small_raw = small.get();
  cache.give(std::move(big));
  cache.give(std::move(small));
  EXPECT_EQ(cache.idle_bytes(sys), 5120u);
  EXPECT_EQ(cache.take(sys, 5000), nullptr) << "none is large enough";
  EXPECT_EQ(cache.take(sys, 1000).get(), small_raw) << "the smallest that fits";
  EXPECT_EQ(cache.take(sys, 1000), nullptr) << "4096 bytes is far more than 1000: not wasted on it";
  EXPECT_EQ(cache.take(sys, 3000), nullptr) << "4096 is more than a quarter above 3000 (the pool would not count it)";
  EXPECT_EQ(cache.take(sys, 3500).get(), big_raw);
  EXPECT_EQ(cache.idle_bytes(sys), 0u);
}

TEST(BufferCache, CloseFreesWhatIsKeptAndKeepsNothingAfter) {
  dma::BufferCache cache(1 << 20);
  const MemoryId sys = sys_memory();
  auto kept = dma::Storage::allocate_host(sys, 4096);
  std::weak_ptr<dma::Storage> kept_alive = kept;
  cache.give(std::move(kept));
  EXPECT_EQ(cache.idle_bytes(sys), 4096u);
  cache.close();
  EXPECT_EQ(cache.idle_bytes(sys), 0u);
  EXPECT_TRUE(kept_alive.expired()) << "close() frees the idle buffers";
  auto late = dma::Storage::allocate_host(sys, 4096);
  std::weak_ptr<dma::Storage> late_alive = late;
  cache.give(std::move(late));
  EXPECT_TRUE(late_alive.expired()) << "a buffer given after close() is freed at once";
  EXPECT_EQ(cache.take(sys, 4096), nullptr);
}

TEST(BufferCache, KeepsAtMostItsLimitPerMemoryFreeingTheOldestAndOnlyHostMemory) {
  dma::BufferCache cache(8192);
  const MemoryId sys = sys_memory();
  auto first = dma::Storage::allocate_host(sys, 4096);
  auto second = dma::Storage::allocate_host(sys, 4096);
  auto third = dma::Storage::allocate_host(sys, 4096);
  const dma::Storage* second_raw = second.get();
  std::weak_ptr<dma::Storage> first_alive = first;
  cache.give(std::move(first));
  cache.give(std::move(second));
  cache.give(std::move(third));
  EXPECT_EQ(cache.idle_bytes(sys), 8192u);
  EXPECT_TRUE(first_alive.expired()) << "the oldest buffer is freed to make room";
  EXPECT_EQ(cache.take(sys, 4096).get(), second_raw) << "the oldest one kept is the first found";
  cache.give(dma::Storage::allocate_host(sys, 16384));
  EXPECT_EQ(cache.idle_bytes(sys), 4096u) << "a buffer larger than the limit is not kept";
  cache.give(dma::Storage::allocate_file(dsk_memory(), 4096));
  EXPECT_EQ(cache.idle_bytes(dsk_memory()), 0u) << "file buffers are not kept";
  cache.give(nullptr);
}

// Back-to-back pipelined copies reuse one set of buffers; with no idle allowance none is kept.
TEST(BufferCache, TheEngineReusesBuffersOfFinishedCopies) {
  settings::ScopedOverride tiles("CARAVAN_DMA_TILE_BYTES", "64K");
  const FieldSpace fields({{"a", 8}, {"b", 8}});
  const Rect space = Rect::from_extents({1 << 16});  // 1 MiB through a sys buffer of 3 x 64 KiB
  for (const char* allowance : {"64M", "0"}) {
    settings::ScopedOverride keep("CARAVAN_DMA_IDLE_BUFFER_BYTES", allowance);
    Runtime rt(RuntimeOptions{.cpu_workers = 1});
    Instance a = Instance::create(dsk_memory(), space, fields, Layout::parse("F,x"));
    Instance b = Instance::create(dsk_memory(), space, fields, Layout::parse("F,x"));
    test::write_pattern(a, 5);
    std::uint64_t kept = 0;
    for (int round = 0; round < 3; ++round) {
      test::poison(b);
      CopyReport report;
      ASSERT_TRUE(copy(a, b, {.report = &report}).wait_for(60s));
      EXPECT_EQ(test::count_mismatches(b, 5), 0u) << "round " << round << " (stale buffer contents must not leak)";
      ASSERT_EQ(report.buffer_bytes.size(), 1u) << report.route;
      dma::EngineStats stats = dma::Engine::current().stats();
      const std::uint64_t idle = stats.idle_buffers.count(sys_memory()) ? stats.idle_buffers.at(sys_memory()) : 0;
      if (std::string(allowance) == "0") {
        EXPECT_EQ(idle, 0u);
      } else {
        EXPECT_GE(idle, report.buffer_bytes[0]);
        if (round == 0) kept = idle;
        EXPECT_EQ(idle, kept) << "round " << round << ": the same buffer came back, no new one was added";
      }
    }
  }
}

}  // namespace
}  // namespace caravan
