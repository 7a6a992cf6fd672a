// Per-tile landing flags (CopyOptions::signal) through the memcpy channel: a consumer thread that
// starts before the copy waits on each tile's flag with acquire loads and then checks that tile's
// points, the tile ranges copy_tiling() and CopyReport::tiling describe, and the rules a signal
// must follow (each broken one rejected before any byte moves). The GPU channels' flags are
// tested in tests/gpu/gpu_copy_test.cpp.
#include "runtime/dma/engine.h"
#include "tests/dma/dma_test_util.h"

#include <caravan/settings.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace caravan {
namespace {

using namespace std::chrono_literals;
using test::dsk_memory;
using test::linear_index;
using test::sys_memory;

const FieldSpace kFields({{"a", 4}, {"b", 8}});  // 12 bytes a point

// Tiles follow each other in point order (dimension 0 fastest), each a rectangle whose points are
// exactly [first_point, first_point + points), together covering the space once.
void expect_tiling_covers(const CopyTiling& tiling, const Rect& space, bool every_point) {
  ASSERT_FALSE(tiling.tiles.empty());
  EXPECT_EQ(tiling.tile_points, tiling.tiles.front().points);
  std::uint64_t next = 0;
  for (std::size_t i = 0; i < tiling.tiles.size(); ++i) {
    const CopyTile& t = tiling.tiles[i];
    EXPECT_EQ(t.first_point, next) << "tile " << i << " " << t.rect.to_string();
    EXPECT_EQ(t.points, t.rect.volume()) << "tile " << i;
    EXPECT_LE(t.points, tiling.tile_points) << "tile " << i;
    EXPECT_EQ(linear_index(space, t.rect.lo()), t.first_point) << "tile " << i;
    EXPECT_EQ(linear_index(space, t.rect.hi()), t.first_point + t.points - 1) << "tile " << i << " " << t.rect.to_string();
    if (every_point) {
      std::uint64_t outside = 0;
      test::for_each_point(t.rect, [&](const Point& p) {
        const std::uint64_t k = linear_index(space, p);
        if (k < t.first_point || k >= t.first_point + t.points) ++outside;
      });
      EXPECT_EQ(outside, 0u) << "tile " << i << " " << t.rect.to_string();
    }
    next = t.first_point + t.points;
  }
  EXPECT_EQ(next, space.volume());
}

TEST(CopyTileSignalTiling, TilesAreSlabsInPointOrder) {
  struct Case {
    Rect space;
    std::uint64_t target;
  };
  const std::vector<Case> cases = {
      {Rect::from_extents({1000}), 64},
      {Rect::from_extents({1000}), 1000},
      {Rect::from_extents({1000}), 333},
      {Rect::from_extents({13, 41}), 100},        // split along y, 7 rows a tile
      {Rect::from_extents({13, 41}), 5},          // split along x: one row in pieces
      {Rect::from_extents({7, 5, 3}), 20},        // split along y, one z at a time
      {Rect::from_extents({4, 3, 2, 5}), 24},     // a whole x-y-z block per w
      {Rect(2, Point{-3, 10, 0, 0}, Point{8, 20, 0, 0}), 30},  // a space that does not start at 0
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.space.to_string() + " target " + std::to_string(c.target));
    dma::TileGrid grid(c.space, c.target);
    CopyTiling tiling = dma::describe_tiling(grid, c.space);
    EXPECT_EQ(tiling.tiles.size(), grid.count());
    expect_tiling_covers(tiling, c.space, true);
  }
}

class CopyTileSignal : public ::testing::Test {
 protected:
  Runtime rt_{RuntimeOptions{.cpu_workers = 2}};
};

// What a consumer thread saw: tiles whose flag it found not yet set at its first look, and
// (point, field) values of landed tiles that were wrong.
struct Consumed {
  std::uint64_t waited_tiles = 0;
  std::uint64_t wrong_values = 0;
  std::uint64_t timed_out_tile = ~std::uint64_t{0};
};

// Waits for each tile's flag in turn (acquire), then checks that tile's points in `dst`, a sys
// instance filled by the copy with test::write_pattern(seed): the first and last 2048 points of
// the tile (its last bytes land last) and every 61st point between. Sets `ready` once it has
// looked at the first flag. Gives up after 30 s on a tile.
Consumed consume(const CopyTiling& tiling, const std::uint64_t* flags, std::uint64_t value, const Instance& dst,
                 std::uint64_t seed, std::atomic<bool>& ready) {
  Consumed out;
  const std::byte* bytes = dst.data();
  const FieldSpace& fields = dst.fields();
  const Rect& space = dst.space();
  for (std::size_t i = 0; i < tiling.tiles.size(); ++i) {
    std::atomic_ref<const std::uint64_t> flag(flags[i]);
    if (flag.load(std::memory_order_acquire) != value) ++out.waited_tiles;
    if (i == 0) ready.store(true, std::memory_order_release);
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (flag.load(std::memory_order_acquire) != value) {
      if (std::chrono::steady_clock::now() > deadline) {
        out.timed_out_tile = i;
        return out;
      }
      std::this_thread::yield();
    }
    const CopyTile& tile = tiling.tiles[i];
    test::for_each_point(tile.rect, [&](const Point& p) {
      const std::uint64_t at = linear_index(space, p) - tile.first_point;
      if (at >= 2048 && tile.points - at > 2048 && at % 61 != 0) return;
      for (std::size_t f = 0; f < fields.count(); ++f)
        for (std::size_t k = 0; k < fields.fields()[f].size; ++k)
          if (bytes[dst.offset(p, f) + k] != test::value_byte(seed, p, f, k)) {
            ++out.wrong_values;
            break;
          }
    });
  }
  return out;
}

// Copies src -> dst with a signal while a consumer thread, started (and having seen every flag
// unset) before the copy may begin, waits for each tile and checks it.
void copy_with_consumer(const Instance& src, const Instance& dst, std::uint64_t seed, std::vector<std::uint64_t>& flags,
                        std::uint64_t epoch) {
  const CopyTiling tiling = copy_tiling(src, dst);
  ASSERT_EQ(tiling.tiles.size(), flags.size());
  UserEvent go = UserEvent::create();
  CopyReport report;
  Event done = copy(src, dst, {.precondition = go, .report = &report,
                               .signal = {.flags = flags.data(), .value = epoch, .tiles = flags.size()}});
  for (std::uint64_t f : flags) ASSERT_NE(f, epoch) << "a flag was set before the copy could start";
  Consumed consumed;
  std::atomic<bool> ready{false};
  std::thread consumer([&] { consumed = consume(tiling, flags.data(), epoch, dst, seed, ready); });
  // The copy starts only once the consumer has found tile 0 not landed: it watches flags rise.
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (!ready.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  go.trigger();
  const bool finished = done.wait_for(60s);
  consumer.join();
  ASSERT_TRUE(finished);
  EXPECT_EQ(consumed.timed_out_tile, ~std::uint64_t{0}) << "the flag of tile " << consumed.timed_out_tile << " never rose";
  EXPECT_EQ(consumed.wrong_values, 0u) << "a tile's flag rose before its bytes landed (" << report.route << ")";
  EXPECT_GE(consumed.waited_tiles, 1u) << "the consumer started before the copy, so it waited at least for tile 0";
  for (std::size_t i = 0; i < flags.size(); ++i) EXPECT_EQ(flags[i], epoch) << "tile " << i;
  EXPECT_EQ(test::count_mismatches(dst, seed), 0u);
  // The report describes the same tiles copy_tiling() promised.
  EXPECT_EQ(report.tiles, tiling.tiles.size());
  ASSERT_EQ(report.tiling.tiles.size(), tiling.tiles.size());
  EXPECT_EQ(report.tiling.tile_points, tiling.tile_points);
  for (std::size_t i = 0; i < tiling.tiles.size(); ++i) {
    EXPECT_EQ(report.tiling.tiles[i].rect, tiling.tiles[i].rect) << i;
    EXPECT_EQ(report.tiling.tiles[i].first_point, tiling.tiles[i].first_point) << i;
    EXPECT_EQ(report.tiling.tiles[i].points, tiling.tiles[i].points) << i;
  }
  std::printf("[ signal ] %s: %zu tiles of up to %llu points; the consumer waited for %llu of them\n", report.route.c_str(),
              tiling.tiles.size(), static_cast<unsigned long long>(tiling.tile_points),
              static_cast<unsigned long long>(consumed.waited_tiles));
}

TEST_F(CopyTileSignal, EveryFlagRisesAfterItsTileLandsThroughMemcpy) {
  // 1000 x 1201 points x 12 bytes (14 MiB): tiles of whole rows, the last one shorter.
  const Rect space = Rect::from_extents({1000, 1201});
  Instance src = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x,y"));
  Instance dst = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x,y"));
  test::write_pattern(src, 7);
  const CopyTiling tiling = copy_tiling(src, dst);
  ASSERT_GE(tiling.tiles.size(), 3u);
  expect_tiling_covers(tiling, space, false);
  for (const CopyTile& t : tiling.tiles) {  // whole rows: a byte range of an "F,x,y" instance
    EXPECT_EQ(t.rect.extent(0), 1000);
    EXPECT_EQ(dst.offset(t.rect.lo(), 0), t.first_point * kFields.total_size());
  }
  EXPECT_LT(tiling.tiles.back().points, tiling.tile_points);
  std::vector<std::uint64_t> flags(tiling.tiles.size(), 0);
  test::poison(dst);
  copy_with_consumer(src, dst, 7, flags, 1);
  // The same flags, the next epoch: every flag moves on to it.
  test::poison(dst);
  copy_with_consumer(src, dst, 7, flags, 2);
}

TEST(CopyTileSignalSplit, ConvertingCopySplitOverThreadsSignalsEachTile) {
  // A layout conversion (strided ops) whose requests are split over two threads: each flag is
  // stored once both shares of the tile's last request are done.
  settings::ScopedOverride threads("CARAVAN_MEMCPY_THREADS", "2");
  settings::ScopedOverride split("CARAVAN_MEMCPY_SPLIT_BYTES", "64K");
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  const Rect space = Rect::from_extents({1001, 801});  // 9.2 MiB
  Instance src = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x,y"));
  Instance dst = Instance::create(sys_memory(), space, kFields, Layout::parse("x,y,F"));
  test::write_pattern(src, 9);
  test::poison(dst);
  ASSERT_EQ(plan_copy(src, dst)->hops.size(), 1u);
  std::vector<std::uint64_t> flags(copy_tiling(src, dst).tiles.size(), 0);
  ASSERT_GE(flags.size(), 2u);
  copy_with_consumer(src, dst, 9, flags, 41);
}

TEST_F(CopyTileSignal, NoFlagRisesWhenThePreconditionIsPoisoned) {
  const Rect space = Rect::from_extents({1000, 1000});
  Instance src = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x,y"));
  Instance dst = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x,y"));
  std::vector<std::uint64_t> flags(copy_tiling(src, dst).tiles.size(), 0);
  UserEvent gate = UserEvent::create();
  Event done = copy(src, dst, {.precondition = gate, .signal = {.flags = flags.data(), .value = 3, .tiles = flags.size()}});
  gate.poison("the producer failed");
  EXPECT_THROW(done.wait(), EventPoisoned);
  for (std::uint64_t f : flags) EXPECT_EQ(f, 0u);
}

TEST_F(CopyTileSignal, BadSignalsAreRejectedBeforeAnyByteMoves) {
  const Rect space = Rect::from_extents({300, 200});
  Instance src = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x,y"));
  Instance dst = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x,y"));
  test::write_pattern(src, 5);
  test::poison(dst);
  const std::vector<std::byte> before = test::footprint(dst);
  const std::uint64_t tiles = copy_tiling(src, dst).tiles.size();
  alignas(8) std::uint64_t storage[64] = {};
  std::uint64_t* flags = storage;
  auto with = [&](TileSignal signal) { return CopyOptions{.signal = signal}; };

  CARAVAN_EXPECT_ERROR(copy(src, dst, with({.flags = nullptr, .value = 1, .tiles = 0})), Errc::invalid_argument,
                       "CopyOptions::signal.flags is null");
  CARAVAN_EXPECT_ERROR(copy(src, dst, with({.flags = nullptr, .value = 0, .tiles = tiles})), Errc::invalid_argument,
                       "CopyOptions::signal.flags is null");
  CARAVAN_EXPECT_ERROR(copy(src, dst, with({.flags = flags, .value = 0, .tiles = tiles})), Errc::invalid_argument,
                       "CopyOptions::signal.value must be nonzero");
  auto* misaligned = reinterpret_cast<std::uint64_t*>(reinterpret_cast<std::byte*>(flags) + 4);
  CARAVAN_EXPECT_ERROR(copy(src, dst, with({.flags = misaligned, .value = 1, .tiles = tiles})), Errc::invalid_argument,
                       "must be 8-byte aligned");
  CARAVAN_EXPECT_ERROR(copy(src, dst, with({.flags = flags, .value = 1, .tiles = 0})), Errc::invalid_argument,
                       "CopyOptions::signal.tiles must give the number of flags");
  CARAVAN_EXPECT_ERROR(copy(src, dst, with({.flags = flags, .value = 1, .tiles = tiles + 1})), Errc::invalid_argument,
                       "is cut into " + std::to_string(tiles) + " tile(s)");
  // fill() writes no flags.
  std::vector<std::byte> value(kFields.total_size(), std::byte{1});
  CARAVAN_EXPECT_ERROR(fill(dst, value, with({.flags = flags, .value = 1, .tiles = tiles})), Errc::invalid_argument,
                       "fill: CopyOptions::signal is for copy() only");
  // A copy whose last hop is the file channel (into dsk memory) cannot signal.
  Instance file = Instance::create(dsk_memory(), space, kFields, Layout::parse("F,x,y"));
  const std::uint64_t file_tiles = copy_tiling(src, file).tiles.size();
  ASSERT_LE(file_tiles, 64u);
  CARAVAN_EXPECT_ERROR(copy(src, file, with({.flags = flags, .value = 1, .tiles = file_tiles})), Errc::invalid_argument,
                       "runs on the file channel");
  EXPECT_EQ(test::footprint(dst), before) << "a rejected copy moved bytes";
  for (std::uint64_t f : storage) EXPECT_EQ(f, 0u) << "a rejected copy wrote a flag";
  EXPECT_EQ(dma::Engine::current().stats().active_copies, 0u);
}

}  // namespace
}  // namespace caravan
