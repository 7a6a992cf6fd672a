#include "runtime/dma/engine.h"
#include "tests/dma/dma_test_util.h"

#include <caravan/planner/plan.h>
#include <caravan/settings.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <random>
#include <thread>

namespace caravan {
namespace {

using namespace std::chrono_literals;
using test::dsk_memory;
using test::sys_memory;

const FieldSpace kFields({{"a", 4}, {"b", 8}, {"c", 2}});

const std::vector<const char*> k1dLayouts = {"F,x", "x,F", "x_in=4,F,x_out", "x_in=3,F,x_out", "F,x_in=5,x_out"};
const std::vector<const char*> k2dLayouts = {"F,x,y", "F,y,x", "x,y,F", "y,x,F", "x_in=4,y_in=3,x_out,y_out,F",
                                             "F,x_in=4,x_out,y", "y_in=2,F,x,y_out"};

class CopyTest : public ::testing::Test {
 protected:
  Runtime rt_{RuntimeOptions{.cpu_workers = 2}};
};

void copy_and_verify(const Rect& space, const FieldSpace& fields, const char* a, const char* b, MemoryId src_mem,
                     MemoryId dst_mem, std::uint64_t seed) {
  Instance src = Instance::create(src_mem, space, fields, Layout::parse(a));
  Instance dst = Instance::create(dst_mem, space, fields, Layout::parse(b));
  test::write_pattern(src, seed);
  test::poison(dst);
  Event e = copy(src, dst);
  ASSERT_TRUE(e.wait_for(60s)) << a << " -> " << b;
  EXPECT_EQ(test::count_mismatches(dst, seed), 0u) << a << " -> " << b << " over " << space.to_string();
  EXPECT_EQ(test::count_mismatches(src, seed), 0u) << "the source changed";
}

TEST_F(CopyTest, EveryPairOfLayoutsThroughMemcpy) {
  std::uint64_t seed = 1;
  for (const char* a : k1dLayouts)
    for (const char* b : k1dLayouts) copy_and_verify(Rect::from_extents({37}), kFields, a, b, sys_memory(), sys_memory(), seed++);
  for (const char* a : k2dLayouts)
    for (const char* b : k2dLayouts)
      copy_and_verify(Rect::from_extents({13, 7}), kFields, a, b, sys_memory(), sys_memory(), seed++);
}

// Requests split over three memcpy threads (each share cut as the engine cuts requests: a
// conversion's fields by row or element range, side by side), for every pair of layouts and a
// 2-D conversion whose rows are apart; every value checked.
TEST(CopySplit, ConversionsSplitOverThreadsMoveEveryValue) {
  settings::ScopedOverride threads("CARAVAN_MEMCPY_THREADS", "3");
  settings::ScopedOverride split("CARAVAN_MEMCPY_SPLIT_BYTES", "1K");
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  std::uint64_t seed = 300;
  for (const char* a : k2dLayouts)
    for (const char* b : k2dLayouts)
      copy_and_verify(Rect::from_extents({31, 13}), kFields, a, b, sys_memory(), sys_memory(), seed++);
  const FieldSpace xyz({{"x", 4}, {"y", 4}, {"z", 4}});
  copy_and_verify(Rect::from_extents({400, 300}), xyz, "F,x,y", "x,F,y", sys_memory(), sys_memory(), seed++);
  copy_and_verify(Rect::from_extents({400, 300}), xyz, "x,F,y", "F,x,y", sys_memory(), sys_memory(), seed++);
  copy_and_verify(Rect::from_extents({200001}), xyz, "F,x", "x,F", sys_memory(), sys_memory(), seed++);
  // 3-D with the dimensions permuted: tiles whose planes lie apart on one side, each plane's
  // fields one group of ops of rows (interleave_planes in transfer_ops.cpp).
  for (auto [a, b] : {std::pair{"F,x,y,z", "x,F,z,y"}, std::pair{"x,y,z,F", "F,z,x,y"}, std::pair{"z,x,F,y", "F,x,y,z"}})
    copy_and_verify(Rect::from_extents({67, 41, 29}), xyz, a, b, sys_memory(), sys_memory(), seed++);
}

TEST_F(CopyTest, LargeInstancesSpanManyTilesAndRequests) {
  // 600k points x 14 bytes: several tiles, many requests, blocked extents that do not divide.
  copy_and_verify(Rect::from_extents({600001}), kFields, "F,x", "x_in=3,F,x_out", sys_memory(), sys_memory(), 11);
  copy_and_verify(Rect::from_extents({997, 601}), kFields, "x,y,F", "F,y,x", sys_memory(), sys_memory(), 12);
}

TEST_F(CopyTest, FileBackedInstancesBothWays) {
  copy_and_verify(Rect::from_extents({50000}), kFields, "F,x", "x,F", sys_memory(), dsk_memory(), 21);
  copy_and_verify(Rect::from_extents({311, 97}), kFields, "F,x,y", "y,x,F", dsk_memory(), sys_memory(), 22);
}

// A report's timeline accounts for every request and tile, keeps the pipeline's order (a hop
// starts a tile only after the previous hop finished it), and splits each hop's time exactly
// into busy, waiting and scheduling.
void expect_consistent_timeline(const CopyReport& report) {
  ASSERT_EQ(report.timeline.size(), report.hop_requests.size());
  for (std::size_t h = 0; h < report.timeline.size(); ++h) {
    const HopTimeline& hop = report.timeline[h];
    EXPECT_FALSE(hop.channel.empty());
    EXPECT_EQ(hop.requests.size(), report.hop_requests[h]) << hop.channel;
    ASSERT_EQ(hop.tile_done_us.size(), report.tiles) << hop.channel;
    EXPECT_TRUE(std::is_sorted(hop.tile_done_us.begin(), hop.tile_done_us.end())) << hop.channel;
    for (const RequestSpan& r : hop.requests) {
      EXPECT_GE(r.start_us, 0.0);
      EXPECT_GE(r.end_us, r.start_us) << hop.channel;
      EXPECT_LE(r.end_us, hop.end_us + 1e-6) << hop.channel;
      EXPECT_LE(r.end_us, hop.tile_done_us[r.tile] + 1e-6) << "a tile finishes after its requests";
      if (h > 0) {
        EXPECT_GE(r.start_us, report.timeline[h - 1].tile_done_us[r.tile]) << "tile " << r.tile << " started early";
      }
    }
    const double accounted = hop.busy_us + hop.waiting_input_us + hop.waiting_output_us + hop.scheduling_us;
    EXPECT_NEAR(accounted, hop.end_us, 1e-3 * hop.end_us + 1) << hop.channel;
    EXPECT_GT(hop.busy_us, 0.0) << hop.channel;
    if (h == 0) {
      EXPECT_EQ(hop.waiting_input_us, 0.0) << "the first hop reads the source: no input to wait for";
    }
    if (h + 1 == report.timeline.size()) {
      EXPECT_EQ(hop.waiting_output_us, 0.0) << "the last hop writes the destination";
    }
    EXPECT_LE(hop.end_us, report.elapsed_us + 1e-6);
  }
  EXPECT_EQ(report.slots, std::min<std::uint64_t>(report.tiles, settings::get_int("CARAVAN_DMA_SLOTS")));
  EXPECT_GE(report.setup_us, 0.0);
  EXPECT_GE(report.teardown_us, 0.0);
}

TEST(CopyMultiHop, FileToFileThroughBoundedBuffersWithALayoutChange) {
  // dsk -> dsk has no direct channel: the planner must go through host memory, and with
  // TH = 1/16 of the instance the DMA engine must pipeline it through small buffers.
  const Rect space = Rect::from_extents({1 << 18});
  const std::uint64_t instance_bytes = space.volume() * kFields.total_size();
  settings::ScopedOverride th("CARAVAN_PLANNER_BUFFER_THRESHOLD", std::to_string(instance_bytes / 16));
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  Instance src = Instance::create(dsk_memory(), space, kFields, Layout::parse("F,x"));
  Instance dst = Instance::create(dsk_memory(), space, kFields, Layout::parse("x,F"));
  test::write_pattern(src, 31);
  test::poison(dst);
  CopyReport report;
  Event e = copy(src, dst, {.report = &report});
  ASSERT_TRUE(e.wait_for(120s));
  EXPECT_EQ(test::count_mismatches(dst, 31), 0u) << report.route;
  EXPECT_GE(report.hop_requests.size(), 2u) << report.route;
  ASSERT_FALSE(report.buffer_bytes.empty()) << report.route;
  for (std::uint64_t b : report.buffer_bytes) EXPECT_LE(b, instance_bytes / 16) << report.route;
  EXPECT_GE(report.tiles, 16u) << "the copy must be pipelined in pieces";
  // The engine keeps the path as its steps and renders the text only for the report: the same
  // text as the plan's.
  EXPECT_EQ(report.route, plan_copy(src, dst)->route());
  EXPECT_EQ(report.hop_requests.size(), plan_copy(src, dst)->hops.size());
  expect_consistent_timeline(report);
}

TEST(CopyDisk, AnUnusableDiskDirectoryFailsOnlyDiskInstances) {
  // Calibration makes a file in CARAVAN_DSK_DIR; a directory that cannot hold one used to fail
  // every program's first copy, disk or not.
  settings::ScopedOverride dir("CARAVAN_DSK_DIR", "/nonexistent/caravan-disk");
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  const Rect space = Rect::from_extents({1000});
  Instance src = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x"));
  Instance dst = Instance::create(sys_memory(), space, kFields, Layout::parse("x,F"));
  test::write_pattern(src, 51);
  test::poison(dst);
  ASSERT_TRUE(copy(src, dst).wait_for(60s));
  EXPECT_EQ(test::count_mismatches(dst, 51), 0u);
  CARAVAN_EXPECT_ERROR(Instance::create(dsk_memory(), space, kFields, Layout::parse("F,x")), Errc::invalid_argument,
                       "CARAVAN_DSK_DIR=/nonexistent/caravan-disk");
}

TEST(CopyMultiHop, AOneTileCopyReservesOneSlot) {
  // dsk -> dsk through host memory in one tile: a ring of CARAVAN_DMA_SLOTS slots would reserve
  // (and count against the pool) three times the data.
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  const Rect space = Rect::from_extents({64, 64});
  Instance src = Instance::create(dsk_memory(), space, kFields, Layout::parse("F,x,y"));
  Instance dst = Instance::create(dsk_memory(), space, kFields, Layout::parse("F,y,x"));
  test::write_pattern(src, 41);
  test::poison(dst);
  CopyReport report;
  ASSERT_TRUE(copy(src, dst, {.report = &report}).wait_for(60s));
  EXPECT_EQ(test::count_mismatches(dst, 41), 0u) << report.route;
  ASSERT_EQ(report.tiles, 1u) << report.route;
  EXPECT_EQ(report.slots, 1u);
  ASSERT_FALSE(report.buffer_bytes.empty()) << report.route;
  for (std::uint64_t b : report.buffer_bytes) EXPECT_LT(b, 2 * space.volume() * kFields.total_size()) << report.route;
}

TEST_F(CopyTest, ThousandConcurrentCopiesWithRandomShapesAndPriorities) {
  std::mt19937 rng(7);
  struct Job {
    Instance dst;
    Event done;
    std::uint64_t seed;
  };
  std::vector<Job> jobs;
  std::vector<Instance> sources;
  for (int i = 0; i < 1000; ++i) {
    bool two_d = rng() % 3 == 0;
    Rect space = two_d ? Rect::from_extents({1 + static_cast<std::int64_t>(rng() % 90), 1 + static_cast<std::int64_t>(rng() % 40)})
                       : Rect::from_extents({1 + static_cast<std::int64_t>(rng() % 20000)});
    const auto& layouts = two_d ? k2dLayouts : k1dLayouts;
    MemoryId src_mem = rng() % 20 == 0 ? dsk_memory() : sys_memory();
    MemoryId dst_mem = rng() % 20 == 0 ? dsk_memory() : sys_memory();
    Instance src = Instance::create(src_mem, space, kFields, Layout::parse(layouts[rng() % layouts.size()]));
    Instance dst = Instance::create(dst_mem, space, kFields, Layout::parse(layouts[rng() % layouts.size()]));
    std::uint64_t seed = 1000 + static_cast<std::uint64_t>(i);
    test::write_pattern(src, seed);
    test::poison(dst);
    int priority = static_cast<int>(rng() % 21) - 10;
    jobs.push_back({dst, copy(src, dst, {.priority = priority}), seed});
    sources.push_back(src);
  }
  std::vector<Event> all;
  for (const auto& j : jobs) all.push_back(j.done);
  ASSERT_TRUE(merge_events(all).wait_for(240s)) << "copies did not finish: deadlock?";
  std::uint64_t bad = 0;
  for (const auto& j : jobs) bad += test::count_mismatches(j.dst, j.seed);
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(dma::Engine::current().stats().active_copies, 0u);
}

// A high-priority copy behind 64 large low-priority copies on one channel takes the channel at
// the next request boundary and keeps it: no low-priority request runs while it copies.
TEST_F(CopyTest, HighPriorityCopyOvertakesSixtyFourLowPriorityCopies) {
  const Rect big = Rect::from_extents({1 << 19});  // 7 MiB each
  const Rect urgent_space = Rect::from_extents({1 << 19});
  std::vector<Instance> keep;
  auto make = [&](const Rect& space) {
    Instance i = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x"));
    keep.push_back(i);
    return i;
  };
  Instance hs = make(urgent_space), hd = make(urgent_space);
  test::write_pattern(hs, 5);
  auto timed = [&](int priority, CopyReport* report) {
    auto start = std::chrono::steady_clock::now();
    copy(hs, hd, {.priority = priority, .report = report}).wait();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  std::vector<double> alone;
  for (int i = 0; i < 3; ++i) alone.push_back(timed(10, nullptr));
  std::sort(alone.begin(), alone.end());

  std::vector<Event> low;
  std::vector<Instance> low_src, low_dst;
  for (int i = 0; i < 64; ++i) {
    low_src.push_back(make(big));
    low_dst.push_back(make(big));
  }
  test::poison(hd);
  // Queue the load, then the urgent copy right behind it.
  for (int i = 0; i < 64; ++i) low.push_back(copy(low_src[static_cast<std::size_t>(i)], low_dst[static_cast<std::size_t>(i)], {.priority = -10}));
  CopyReport report;
  double loaded = timed(10, &report);
  bool low_still_running = merge_events(low).query() == EventState::pending;
  ASSERT_TRUE(merge_events(low).wait_for(120s));
  EXPECT_EQ(test::count_mismatches(hd, 5), 0u);
  ASSERT_EQ(report.hop_interleaved.size(), 1u);
  EXPECT_EQ(report.hop_interleaved[0], 0u) << "low-priority requests ran in the middle of the urgent copy";
  EXPECT_TRUE(low_still_running) << "the load finished before the urgent copy: the test measured nothing";
  // Timing is the benchmark's job (caravan bench priority); here only a loose sanity bound.
  EXPECT_LT(loaded, 4 * alone[1] + 0.05) << "alone " << alone[1] << " s, under load " << loaded << " s";
}

TEST_F(CopyTest, PoisonedPreconditionMovesNoByteAndPoisonsDependents) {
  TaskId noop = test::task("copy_test.noop", [](TaskContext&) {});
  Instance src = Instance::create(sys_memory(), Rect::from_extents({1000}), kFields, Layout::parse("F,x"));
  Instance dst = Instance::create(sys_memory(), Rect::from_extents({1000}), kFields, Layout::parse("x,F"));
  test::write_pattern(src, 3);
  test::poison(dst);
  std::vector<std::byte> before = test::footprint(dst);
  UserEvent gate = UserEvent::create();
  Event copied = copy(src, dst, {.precondition = gate});
  Event after = rt_.spawn(noop, {}, {.precondition = copied});
  FailureCause cause = make_failure(Errc::transport, "upstream producer died");
  gate.poison(cause);
  EXPECT_THROW(copied.wait(), EventPoisoned);
  EXPECT_EQ(copied.failure(), cause);
  EXPECT_EQ(after.failure(), cause);
  EXPECT_EQ(test::footprint(dst), before);
}

TEST_F(CopyTest, LocalMemoryNamesThisRanksMemories) {
  EXPECT_EQ(local_memory(MemoryKind::sys), sys_memory());
  EXPECT_EQ(local_memory(MemoryKind::dsk), dsk_memory());
  CARAVAN_EXPECT_ERROR(local_memory(MemoryKind::fbm, 99), Errc::not_found, "local_memory");
}

TEST(CopyWithoutRuntime, LocalMemoryNeedsARuntime) {
  CARAVAN_EXPECT_ERROR(local_memory(MemoryKind::sys), Errc::shut_down, "");
}

TEST_F(CopyTest, BadInputIsRejectedBeforeAnyByteMoves) {
  Instance src = Instance::create(sys_memory(), Rect::from_extents({100}), kFields, Layout::parse("F,x"));
  Instance other_space = Instance::create(sys_memory(), Rect::from_extents({101}), kFields, Layout::parse("F,x"));
  Instance other_fields = Instance::create(sys_memory(), Rect::from_extents({100}), FieldSpace::uniform(3, 4), Layout::parse("F,x"));
  test::poison(other_space);
  std::vector<std::byte> before = test::footprint(other_space);
  CARAVAN_EXPECT_ERROR(copy(src, other_space), Errc::invalid_argument, "index space");
  CARAVAN_EXPECT_ERROR(copy(src, other_fields), Errc::invalid_argument, "field spaces differ");
  Instance renamed = Instance::create(sys_memory(), Rect::from_extents({100}),
                                      FieldSpace({{"a", 4}, {"x", 8}, {"c", 2}}), Layout::parse("F,x"));
  Instance one_field =
      Instance::create(sys_memory(), Rect::from_extents({100}), FieldSpace({{"a", 4}}), Layout::parse("F,x"));
  CARAVAN_EXPECT_ERROR(copy(src, renamed), Errc::invalid_argument,
                       "field 1 is 'b' (8 bytes) in src and 'x' (8 bytes) in dst");
  CARAVAN_EXPECT_ERROR(copy(src, one_field), Errc::invalid_argument,
                       "src has 3 fields and dst 1; the first one only src has is 'b' (8 bytes)");
  CARAVAN_EXPECT_ERROR(Instance::create(sys_memory(), Rect::from_extents({4}), FieldSpace(), Layout::parse("F,x")),
                       Errc::invalid_argument, "Instance::create: fields is the empty field space");
  // A footprint past 2^64 - 1 bytes is refused, not wrapped to a small allocation.
  CARAVAN_EXPECT_ERROR(
      Instance::create(sys_memory(), Rect::from_extents({std::int64_t{1} << 31, std::int64_t{1} << 31}),
                       FieldSpace::uniform(1, 8), Layout::parse("F,x,y")),
      Errc::invalid_argument, "footprint exceeds 2^64 - 1 bytes");
  CARAVAN_EXPECT_ERROR(copy(src, src, {.priority = 5000}), Errc::invalid_argument, "priority 5000");
  CARAVAN_EXPECT_ERROR(copy(src, Instance()), Errc::invalid_argument, "empty");
  CARAVAN_EXPECT_ERROR(Instance::create(MemoryId{3, 0, MemoryKind::sys, 0}, Rect::from_extents({4}), kFields, Layout::parse("F,x")),
                       Errc::not_found, "node3/rank0/sys");
  CARAVAN_EXPECT_ERROR(Instance::create(sys_memory(), Rect::from_extents({4}), kFields, Layout::parse("F,x,y")),
                       Errc::invalid_argument, "layout");
  // More than the host has: refused at the call, not killed by the kernel when the pages are touched.
  CARAVAN_EXPECT_ERROR(
      Instance::create(sys_memory(), Rect::from_extents({std::int64_t{1} << 42}), kFields, Layout::parse("F,x")),
      Errc::invalid_argument, "available (MemAvailable");
  EXPECT_THROW(Rect::from_extents({-5}), Error);
  std::vector<std::byte> value(3);
  CARAVAN_EXPECT_ERROR(fill(src, value), Errc::invalid_argument, "the value is 3 bytes");
  // Host and file memory has no address a GPU kernel may use.
  CARAVAN_EXPECT_ERROR(src.gpu_data(), Errc::invalid_argument, "node0/rank0/sys is not memory a GPU addresses");
  Instance file = Instance::create(dsk_memory(), Rect::from_extents({4}), kFields, Layout::parse("F,x"));
  CARAVAN_EXPECT_ERROR(file.gpu_data(), Errc::invalid_argument, "node0/rank0/dsk is not memory a GPU addresses");
  CARAVAN_EXPECT_ERROR(Instance().gpu_data(), Errc::invalid_argument, "empty");
  // A file instance larger than CARAVAN_DSK_DIR's free space: refused now, not a failed write
  // part-way through a copy (the file would be sparse).
  CARAVAN_EXPECT_ERROR(
      Instance::create(dsk_memory(), Rect::from_extents({std::int64_t{1} << 50}), kFields, Layout::parse("F,x")),
      Errc::invalid_argument, "does not fit: CARAVAN_DSK_DIR=");
  // Byte access past the end, also with an offset near 2^64 that would wrap a sum.
  std::vector<std::byte> bytes(16);
  CARAVAN_EXPECT_ERROR(src.read_bytes(~std::uint64_t{0} - 7, bytes), Errc::invalid_argument, "is outside");
  CARAVAN_EXPECT_ERROR(src.write_bytes(~std::uint64_t{0} - 7, bytes), Errc::invalid_argument, "is outside");
  CARAVAN_EXPECT_ERROR(file.read_bytes(~std::uint64_t{0} - 7, bytes), Errc::invalid_argument, "is outside");
  EXPECT_EQ(test::footprint(other_space), before);
  EXPECT_EQ(dma::Engine::current().stats().active_copies, 0u);
}

TEST_F(CopyTest, CancelPoisonsTheCopyAndReturnsItsBuffers) {
  const Rect space = Rect::from_extents({1 << 21});  // 28 MiB
  Instance src = Instance::create(dsk_memory(), space, kFields, Layout::parse("F,x"));
  Instance dst = Instance::create(dsk_memory(), space, kFields, Layout::parse("x,F"));
  Event e = copy(src, dst);
  EXPECT_TRUE(cancel(e));
  try {
    e.wait();
    FAIL() << "a cancelled copy completed normally";
  } catch (const EventPoisoned& err) {
    EXPECT_EQ(err.cause()->code(), Errc::cancelled);
  }
  EXPECT_FALSE(cancel(e)) << "cancelling a finished copy";
  dma::EngineStats stats = dma::Engine::current().stats();
  EXPECT_EQ(stats.active_copies, 0u);
  for (const auto& [memory, used] : stats.pool_in_use) EXPECT_EQ(used, 0u) << memory.to_string();
  // A copy waiting on its precondition cancels at once.
  UserEvent never = UserEvent::create();
  Event waiting = copy(src, dst, {.precondition = never});
  EXPECT_TRUE(cancel(waiting));
  EXPECT_EQ(waiting.query(), EventState::poisoned);
  never.trigger();
}

TEST_F(CopyTest, FillWritesEveryPoint) {
  std::vector<std::byte> value(kFields.total_size());
  for (std::size_t i = 0; i < value.size(); ++i) value[i] = static_cast<std::byte>(0x10 + i);
  for (MemoryId memory : {sys_memory(), dsk_memory()}) {
    Instance inst = Instance::create(memory, Rect::from_extents({333, 7}), kFields, Layout::parse("x_in=4,F,y,x_out"));
    test::poison(inst);
    ASSERT_TRUE(fill(inst, value).wait_for(30s));
    std::vector<std::byte> bytes = test::footprint(inst);
    std::uint64_t bad = 0;
    test::for_each_point(inst.space(), [&](const Point& p) {
      for (std::size_t f = 0; f < kFields.count(); ++f)
        if (std::memcmp(&bytes[inst.offset(p, f)], &value[kFields.offset(f)], kFields.fields()[f].size) != 0) ++bad;
    });
    EXPECT_EQ(bad, 0u) << memory.to_string();
  }
}

TEST_F(CopyTest, CopiesAreTaskGraphNodes) {
  Instance a = Instance::create(sys_memory(), Rect::from_extents({5000}), kFields, Layout::parse("F,x"));
  Instance b = Instance::create(sys_memory(), Rect::from_extents({5000}), kFields, Layout::parse("x,F"));
  Instance c = Instance::create(dsk_memory(), Rect::from_extents({5000}), kFields, Layout::parse("x_in=3,F,x_out"));
  TaskGraph graph;
  auto first = add_copy(graph, a, b);
  std::vector<TaskGraph::NodeId> deps{first};
  add_copy(graph, b, c, deps);  // dependencies first, as add_task takes them
  for (std::uint64_t seed : {41u, 42u}) {
    test::write_pattern(a, seed);
    test::poison(c);
    ASSERT_TRUE(graph.launch().wait_for(30s));
    EXPECT_EQ(test::count_mismatches(c, seed), 0u);
  }
  // A copy that cannot run is refused when it is added, not at a launch that has started the
  // nodes before it.
  Instance other_space = Instance::create(sys_memory(), Rect::from_extents({4999}), kFields, Layout::parse("F,x"));
  CARAVAN_EXPECT_ERROR(add_copy(graph, a, other_space), Errc::invalid_argument, "add_copy: copy: src index space");
  EXPECT_EQ(graph.size(), 2u);
}

// CopyOptions::region: a block of a large instance into a small one holding the same points,
// and back into another large one, for pairs of layouts; only the region's points move, the
// rest stay as they were.
TEST_F(CopyTest, RegionsMoveOnlyTheirPoints) {
  const Rect whole = Rect::from_extents({64, 48});
  const Rect block(2, Point{10, 7}, Point{41, 30});
  std::uint64_t seed = 500;
  for (const char* a : k2dLayouts)
    for (const char* b : {"F,x,y", "y,x,F", "x_in=4,F,x_out,y"}) {
      Instance big = Instance::create(sys_memory(), whole, kFields, Layout::parse(a));
      Instance small = Instance::create(sys_memory(), block, kFields, Layout::parse(b));
      Instance back = Instance::create(sys_memory(), whole, kFields, Layout::parse(b));
      test::write_pattern(big, ++seed);
      test::poison(small);
      test::poison(back);
      CopyReport report;
      ASSERT_TRUE(copy(big, small, {.report = &report, .region = block}).wait_for(30s)) << a << " -> " << b;
      EXPECT_EQ(test::count_mismatches(small, seed), 0u) << a << " -> " << b;
      EXPECT_EQ(report.bytes, block.volume() * kFields.total_size());
      ASSERT_TRUE(copy(small, back, {.region = block}).wait_for(30s));
      const test::RegionCheck check = test::check_region(back, seed, block);
      EXPECT_EQ(check.wrong_inside, 0u) << b << " -> " << b << " inside the region";
      EXPECT_EQ(check.changed_outside, 0u) << b << " -> " << b << " outside the region";
    }
}

// A band of rows between two files of the same space, through host buffers in small tiles.
TEST(CopyRegion, ThroughBuffersInSmallTiles) {
  settings::ScopedOverride threshold("CARAVAN_PLANNER_BUFFER_THRESHOLD", "64K");
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  const Rect space = Rect::from_extents({400, 300});
  const Rect rows(2, Point{0, 50}, Point{399, 249});
  Instance src = Instance::create(dsk_memory(), space, kFields, Layout::parse("F,x,y"));
  Instance file = Instance::create(dsk_memory(), space, kFields, Layout::parse("y,x,F"));
  test::write_pattern(src, 900);
  test::poison(file);
  CopyReport report;
  ASSERT_TRUE(copy(src, file, {.report = &report, .region = rows}).wait_for(60s));
  EXPECT_GT(report.tiles, 4u) << "the region was not cut into tiles: " << report.route;
  std::uint64_t covered = 0;
  for (const CopyTile& t : report.tiling.tiles) {
    EXPECT_TRUE(rows.contains(t.rect.lo()) && rows.contains(t.rect.hi())) << t.rect.to_string();
    EXPECT_EQ(t.first_point, covered) << "tiles count points from the region's lo()";
    covered += t.points;
  }
  EXPECT_EQ(covered, rows.volume());
  const test::RegionCheck check = test::check_region(file, 900, rows);
  EXPECT_EQ(check.wrong_inside, 0u);
  EXPECT_EQ(check.changed_outside, 0u);
}

// fill() of a region, landing flags of a region copy (sized by copy_tiling with the region), a
// region as a task-graph node, and what a region may not be.
TEST_F(CopyTest, RegionsForFillFlagsGraphsAndBadInput) {
  const Rect space = Rect::from_extents({300, 20});
  const Rect block(2, Point{100, 2}, Point{219, 17});
  Instance a = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x,y"));
  std::vector<std::byte> value(kFields.total_size(), std::byte{0x5C});
  test::poison(a);
  ASSERT_TRUE(fill(a, value, {.region = block}).wait_for(30s));
  std::vector<std::byte> bytes = test::footprint(a);
  std::uint64_t wrong = 0;
  test::for_each_point(space, [&](const Point& p) {
    const std::byte want = block.contains(p) ? std::byte{0x5C} : std::byte{0xAB};
    for (std::size_t f = 0; f < kFields.count(); ++f)
      if (bytes[a.offset(p, f)] != want) ++wrong;
  });
  EXPECT_EQ(wrong, 0u);

  Instance b = Instance::create(sys_memory(), block, kFields, Layout::parse("y,x,F"));
  test::write_pattern(a, 77);
  test::poison(b);
  const CopyTiling tiling = copy_tiling(a, b, PlannerChoice::automatic, block);
  std::uint64_t points = 0;
  for (const CopyTile& t : tiling.tiles) points += t.points;
  EXPECT_EQ(points, block.volume());
  std::vector<std::uint64_t> flags(tiling.tiles.size(), 0);
  ASSERT_TRUE(copy(a, b, {.signal = {.flags = flags.data(), .value = 3, .tiles = flags.size()}, .region = block})
                  .wait_for(30s));
  EXPECT_EQ(std::count(flags.begin(), flags.end(), 3u), static_cast<std::ptrdiff_t>(flags.size()));
  EXPECT_EQ(test::count_mismatches(b, 77), 0u);

  TaskGraph graph;
  Instance c = Instance::create(sys_memory(), space, kFields, Layout::parse("x,y,F"));
  add_copy(graph, b, c, CopyOptions{.priority = 2, .region = block});
  test::poison(c);
  ASSERT_TRUE(graph.launch().wait_for(30s));
  const test::RegionCheck check = test::check_region(c, 77, block);
  EXPECT_EQ(check.wrong_inside, 0u);
  EXPECT_EQ(check.changed_outside, 0u);
  CopyReport report;
  CARAVAN_EXPECT_ERROR(add_copy(graph, b, c, CopyOptions{.report = &report, .region = block}), Errc::invalid_argument,
                       "add_copy: CopyOptions::report is not for a graph node");
  CARAVAN_EXPECT_ERROR(add_copy(graph, b, c, CopyOptions{.signal = {.value = 1}, .region = block}),
                       Errc::invalid_argument, "add_copy: CopyOptions::signal is not for a graph node");
  EXPECT_EQ(graph.size(), 1u);
  // The plan of a region copy, as copy() makes it.
  EXPECT_EQ(plan_copy(b, c, PlannerChoice::automatic, block)->route(), "node0/rank0/sys -[memcpy]-> node0/rank0/sys");
  // It is rated by the runs the region keeps in its instances: rows of 120 of their 300 points.
  Instance d = Instance::create(sys_memory(), space, kFields, Layout::parse("F,x,y"));
  EXPECT_EQ(plan_copy(a, d, PlannerChoice::automatic, block)->hops.front().prefix_bytes, 120u * kFields.total_size());
  EXPECT_EQ(plan_copy(a, d)->hops.front().prefix_bytes, space.volume() * kFields.total_size());
  CARAVAN_EXPECT_ERROR(plan_copy(b, c), Errc::invalid_argument, "name them in CopyOptions::region");

  CARAVAN_EXPECT_ERROR(copy(a, c, {.region = Rect(2, Point{290, 0}, Point{310, 3})}), Errc::invalid_argument,
                       "must lie inside both index spaces; it is not inside the src index space");
  CARAVAN_EXPECT_ERROR(copy(a, b, {.region = Rect(2, Point{99, 2}, Point{100, 3})}), Errc::invalid_argument,
                       "it is not inside the dst index space");
  CARAVAN_EXPECT_ERROR(copy(a, c, {.region = Rect::from_extents({5})}), Errc::invalid_argument,
                       "has 1 dimension(s); the src index space");
  CARAVAN_EXPECT_ERROR(copy(a, c, {.region = Rect()}), Errc::invalid_argument, "CopyOptions::region is an empty Rect");
  CARAVAN_EXPECT_ERROR(copy(a, b), Errc::invalid_argument, "name them in CopyOptions::region");
  CARAVAN_EXPECT_ERROR(fill(b, value, {.region = space}), Errc::invalid_argument,
                       "fill: CopyOptions::region [0,299]x[0,19] must lie inside");
  EXPECT_EQ(dma::Engine::current().stats().active_copies, 0u);
}

// Small one-hop copies between host memories run on the thread that starts them
// (CARAVAN_DMA_INLINE_BYTES): done when copy() returns, with landing flags and a report, on the
// thread that triggers a precondition, and not for copies above the limit.
TEST(CopyInline, SmallHostCopiesFinishBeforeCopyReturns) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  const Rect small = Rect::from_extents({1000});  // 14 KB
  Instance a = Instance::create(sys_memory(), small, kFields, Layout::parse("F,x"));
  Instance b = Instance::create(sys_memory(), small, kFields, Layout::parse("x,F"));
  test::write_pattern(a, 61);
  test::poison(b);
  CopyReport report;
  std::uint64_t flag = 0;
  Event e = copy(a, b, {.report = &report, .signal = {.flags = &flag, .value = 9, .tiles = 1}});
  EXPECT_EQ(e.query(), EventState::triggered) << "a 14 KB copy should have run inside copy()";
  EXPECT_EQ(flag, 9u);
  EXPECT_EQ(report.tiles, 1u);
  EXPECT_EQ(report.route, "node0/rank0/sys -[memcpy]-> node0/rank0/sys");
  EXPECT_EQ(test::count_mismatches(b, 61), 0u);
  // With a precondition: it runs on the thread that triggers it.
  test::poison(b);
  UserEvent gate = UserEvent::create();
  Event after = copy(a, b, {.precondition = gate});
  EXPECT_EQ(after.query(), EventState::pending);
  std::thread([gate] { gate.trigger(); }).join();
  EXPECT_EQ(after.query(), EventState::triggered);
  EXPECT_EQ(test::count_mismatches(b, 61), 0u);
  // A poisoned precondition still moves nothing.
  test::poison(b);
  UserEvent failing = UserEvent::create();
  Event never = copy(a, b, {.precondition = failing});
  failing.poison("upstream failed");
  EXPECT_THROW(never.wait(), EventPoisoned);
  EXPECT_EQ(test::count_mismatches(b, 61), small.volume() * kFields.count()) << "nothing should have moved";
}

// Many threads issue small copies (inline) while large copies keep the channel's worker busy and
// some copies are cancelled: every copy that succeeds moved every value, none hangs.
TEST(CopyInline, ConcurrentSmallAndLargeCopiesStress) {
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  const Rect large = Rect::from_extents({1 << 20});  // 14 MiB
  Instance big_src = Instance::create(sys_memory(), large, kFields, Layout::parse("F,x"));
  Instance big_dst = Instance::create(sys_memory(), large, kFields, Layout::parse("x,F"));
  test::write_pattern(big_src, 70);
  std::atomic<bool> stop{false};
  std::atomic<int> large_done{0};
  std::thread background([&] {
    while (!stop.load()) {
      Event e = copy(big_src, big_dst, {.priority = -1});
      if (!e.wait_for(60s)) return;
      large_done.fetch_add(1);
    }
  });
  constexpr int kThreads = 3, kCopies = 300;
  std::atomic<int> wrong{0}, hung{0}, cancelled{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 100);
      for (int i = 0; i < kCopies; ++i) {
        const Rect space = Rect::from_extents({static_cast<std::int64_t>(1 + rng() % 5000)});
        Instance src = Instance::create(sys_memory(), space, kFields, Layout::parse(rng() % 2 ? "F,x" : "x,F"));
        Instance dst = Instance::create(sys_memory(), space, kFields, Layout::parse(rng() % 2 ? "F,x" : "x,F"));
        const std::uint64_t seed = rng();
        test::write_pattern(src, seed);
        test::poison(dst);
        UserEvent gate = UserEvent::create();
        const bool gated = rng() % 3 == 0;
        Event e =
            copy(src, dst, {.precondition = gated ? Event(gate) : Event(), .priority = static_cast<int>(rng() % 3)});
        if (gated && rng() % 2) {
          if (cancel(e)) cancelled.fetch_add(1);
        }
        if (gated) gate.trigger();
        try {
          if (!e.wait_for(30s)) {
            hung.fetch_add(1);
            continue;
          }
          if (test::count_mismatches(dst, seed) != 0) wrong.fetch_add(1);
        } catch (const EventPoisoned& p) {
          if (!p.cause() || p.cause()->code() != Errc::cancelled) wrong.fetch_add(1);
        }
      }
    });
  for (auto& t : threads) t.join();
  stop = true;
  background.join();
  EXPECT_EQ(hung.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(large_done.load(), 0);
  EXPECT_EQ(test::count_mismatches(big_dst, 70), 0u);
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (dma::Engine::current().stats().active_copies != 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(1ms);
  EXPECT_EQ(dma::Engine::current().stats().active_copies, 0u) << "copies still active";
}

TEST(CopyShutdown, PendingCopiesArePoisonedAtShutdown) {
  std::atomic<int> code{-1};
  {
    Runtime rt(RuntimeOptions{.cpu_workers = 1});
    Instance a = Instance::create(sys_memory(), Rect::from_extents({10}), kFields, Layout::parse("F,x"));
    Instance b = Instance::create(sys_memory(), Rect::from_extents({10}), kFields, Layout::parse("F,x"));
    UserEvent never = UserEvent::create();
    Event e = copy(a, b, {.precondition = never});
    e.on_trigger([&](const FailureCause& f) { code = f ? static_cast<int>(f->code()) : -2; });
  }
  EXPECT_EQ(code.load(), static_cast<int>(Errc::shut_down));
}

}  // namespace
}  // namespace caravan
