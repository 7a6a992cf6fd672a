// Multi-process, with GPUs: copies between GPU memory of ranks on one node. The ranks are
// separate processes, so the source rank maps the destination's allocation through IPC when the
// copy starts and its own GPU writes it: one xgmi hop between two GPUs, one sdma hop on one GPU,
// and intermediate GPU buffers of another rank written the same way. Run by `caravan run -n 2`
// and `-n 4` (ctest labels gpu and multiproc); every rank skips with the reason where it is not a
// rank of a job, its host has fewer GPUs than the job has ranks, or the ranks are not on one node.
//
// Data: each source holds a pattern from a seed rank 0 draws fresh for every run, destinations
// are poisoned first, and every (point, field) is checked after the copy.
#include "tests/dma/dma_test_util.h"
#include "tests/gpu/gpu_job_util.h"
#include "tests/net/remote_copy_util.h"

#include <caravan/settings.h>

#include <fmt/format.h>

namespace caravan {
namespace {

using namespace std::chrono_literals;

class GpuNodeJobTest : public test::GpuJobTest {
 protected:
  void SetUp() override {
    test::GpuJobTest::SetUp();
    if (IsSkipped()) return;
    for (int r = 0; r < world(); ++r)
      if (rt().rank_info(r).node != rt().node())
        GTEST_SKIP() << "needs every rank on this node (run with caravan run -n 2 or -n 4, without --nodes)";
  }
  // Rank r's memory of `kind`; GPU memory is GPU `device` (by default the rank's own: rank r uses GPU r).
  MemoryId memory(int r, MemoryKind kind, int device = -1) {
    return MemoryId{static_cast<std::uint32_t>(rt().node()), static_cast<std::uint32_t>(r), kind,
                    kind == MemoryKind::fbm ? static_cast<std::uint32_t>(device < 0 ? r : device) : 0u};
  }
  int target() { return (rank() + 1) % world(); }            // the rank this one copies to
  int writer() { return (rank() + world() - 1) % world(); }  // the rank that copies to this one
};

TEST_F(GpuNodeJobTest, GpuToAnotherRanksGpuIsOnePeerCopy) {
  const std::uint64_t seed = test::fresh_seed(rt());
  FieldSpace fields({{"a", 8}, {"b", 4}, {"c", 4}});
  auto space = Rect::from_extents({(1 << 20) + 77});  // 16 MiB and a partial tile
  auto src = Instance::create(memory(rank(), MemoryKind::fbm), space, fields, Layout::parse("F,x"));
  auto dst = Instance::create(memory(rank(), MemoryKind::fbm), space, fields, Layout::parse("F,x"));
  test::write_pattern(src, test::rank_seed(seed, rank()));
  auto dsts = test::share(rt(), dst);
  // Into the same destination again and again, started directly (the descriptor's IPC handle)
  // and through the set-up exchange with the owner (its `ready` names the handle): every copy
  // after the first reuses the first one's mapping.
  std::size_t mappings_after_first = 0;
  for (int round = 0; round < 4; ++round) {
    settings::ScopedOverride direct("CARAVAN_DMA_IPC_DIRECT", round < 2 ? "true" : "false");
    test::poison(dst);
    rt().barrier(30s);
    CopyReport report;
    ASSERT_TRUE(copy(src, dsts[static_cast<std::size_t>(target())], {.report = &report}).wait_for(60s)) << "round " << round;
    EXPECT_EQ(report.route, fmt::format("{} -[xgmi]-> {}", memory(rank(), MemoryKind::fbm).to_string(),
                                        memory(target(), MemoryKind::fbm).to_string()));
    EXPECT_TRUE(report.buffer_bytes.empty());
    const std::size_t mappings = dma::Engine::current().stats().gpu_mappings;
    if (round == 0) mappings_after_first = mappings;
    else EXPECT_EQ(mappings, mappings_after_first) << "the second copy mapped the destination again";
    EXPECT_GE(mappings, 1u);
    rt().barrier(30s);
    EXPECT_EQ(test::count_mismatches(dst, test::rank_seed(seed, writer())), 0u) << "round " << round;
  }
  EXPECT_TRUE(test::engine_drains(10s));
  rt().barrier(30s);
}

TEST_F(GpuNodeJobTest, LayoutChangesBetweenRanksGpus) {
  // The peer copy engine converts the layout (2-D/3-D strided copies into the mapped memory).
  const std::uint64_t seed = test::fresh_seed(rt());
  FieldSpace fields({{"a", 4}, {"b", 8}, {"c", 2}});
  auto space = Rect::from_extents({160, 96});
  auto src = Instance::create(memory(rank(), MemoryKind::fbm), space, fields, Layout::parse("F,x,y"));
  auto dst = Instance::create(memory(rank(), MemoryKind::fbm), space, fields, Layout::parse("y,x,F"));
  test::write_pattern(src, test::rank_seed(seed, rank()));
  test::poison(dst);
  auto dsts = test::share(rt(), dst);
  CopyReport report;
  ASSERT_TRUE(copy(src, dsts[static_cast<std::size_t>(target())], {.report = &report}).wait_for(60s));
  EXPECT_NE(report.route.find("-[xgmi]-> " + memory(target(), MemoryKind::fbm).to_string()), std::string::npos)
      << report.route;
  rt().barrier(30s);
  EXPECT_EQ(test::count_mismatches(dst, test::rank_seed(seed, writer())), 0u) << "route " << report.route;
  EXPECT_TRUE(test::engine_drains(10s));
  rt().barrier(30s);
}

TEST_F(GpuNodeJobTest, SameGpuOfAnotherRankIsOneCopyEngineCopy) {
  // Rank r's GPU r memory into the target rank's allocation on the same GPU r.
  const std::uint64_t seed = test::fresh_seed(rt());
  FieldSpace fields({{"v", 4}});
  auto space = Rect::from_extents({3 << 20});
  const int mine = rank(), from_writer = writer();
  auto src = Instance::create(memory(rank(), MemoryKind::fbm), space, fields, Layout::parse("F,x"));
  // This rank's destination lives on the GPU of the rank that writes it.
  auto dst = Instance::create(memory(rank(), MemoryKind::fbm, from_writer), space, fields, Layout::parse("F,x"));
  test::write_pattern(src, test::rank_seed(seed, mine));
  test::poison(dst);
  auto dsts = test::share(rt(), dst);
  CopyReport report;
  ASSERT_TRUE(copy(src, dsts[static_cast<std::size_t>(target())], {.report = &report}).wait_for(60s));
  EXPECT_EQ(report.route, fmt::format("{} -[sdma]-> {}", memory(rank(), MemoryKind::fbm).to_string(),
                                      memory(target(), MemoryKind::fbm, rank()).to_string()));
  rt().barrier(30s);
  EXPECT_EQ(test::count_mismatches(dst, test::rank_seed(seed, from_writer)), 0u);
  EXPECT_TRUE(test::engine_drains(10s));
  rt().barrier(30s);
}

TEST_F(GpuNodeJobTest, PipelinedThroughAnotherRanksGpuBuffers) {
  // GPU memory into the target rank's pinned host memory through small buffers: whatever path the
  // planner takes, a hop of this rank that writes a buffer of the target rank writes it mapped,
  // and the target's next hop starts on each tile once told it landed.
  settings::ScopedOverride threshold("CARAVAN_PLANNER_BUFFER_THRESHOLD", "1M");
  const std::uint64_t seed = test::fresh_seed(rt());
  FieldSpace fields({{"a", 8}, {"b", 8}});
  auto space = Rect::from_extents({1 << 19});  // 8 MiB
  auto src = Instance::create(memory(rank(), MemoryKind::fbm), space, fields, Layout::parse("F,x"));
  auto dst = Instance::create(memory(rank(), MemoryKind::zcm), space, fields, Layout::parse("F,x"));
  test::write_pattern(src, test::rank_seed(seed, rank()));
  test::poison(dst);
  auto dsts = test::share(rt(), dst);
  CopyReport report;
  ASSERT_TRUE(copy(src, dsts[static_cast<std::size_t>(target())], {.report = &report}).wait_for(60s));
  // The first hop writes a GPU buffer of the target rank (over the peer link, or on this GPU's
  // copy engines into the target's allocation on the same GPU), which the target then drains.
  const std::string target_gpus = fmt::format("node{}/rank{}/fbm", rt().node(), target());  // any of its GPUs
  const std::size_t first_hop_end = report.route.find("]-> ");
  ASSERT_NE(first_hop_end, std::string::npos) << report.route;
  EXPECT_EQ(report.route.compare(first_hop_end + 4, target_gpus.size(), target_gpus), 0) << report.route;
  EXPECT_EQ(report.buffer_bytes.size(), 1u) << report.route;
  EXPECT_GE(report.tiles, 8u) << report.route;
  RecordProperty("route", report.route);
  rt().barrier(30s);
  EXPECT_EQ(test::count_mismatches(dst, test::rank_seed(seed, writer())), 0u) << "route " << report.route;
  EXPECT_TRUE(test::engine_drains(10s));
  rt().barrier(30s);
}

TEST_F(GpuNodeJobTest, HostToHostBetweenRanksStillCorrect) {
  // With GPU paths between the ranks the planner may send host memory through them; whatever it
  // picks, the bytes arrive.
  const std::uint64_t seed = test::fresh_seed(rt());
  FieldSpace fields({{"a", 4}, {"b", 4}});
  auto space = Rect::from_extents({1 << 20});  // 8 MiB
  auto src = Instance::create(memory(rank(), MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto dst = Instance::create(memory(rank(), MemoryKind::sys), space, fields, Layout::parse("x,F"));
  test::write_pattern(src, test::rank_seed(seed, rank()));
  test::poison(dst);
  auto dsts = test::share(rt(), dst);
  CopyReport report;
  ASSERT_TRUE(copy(src, dsts[static_cast<std::size_t>(target())], {.report = &report}).wait_for(60s));
  RecordProperty("route", report.route);
  rt().barrier(30s);
  EXPECT_EQ(test::count_mismatches(dst, test::rank_seed(seed, writer())), 0u) << "route " << report.route;
  EXPECT_TRUE(test::engine_drains(10s));
  rt().barrier(30s);
}

}  // namespace
}  // namespace caravan
