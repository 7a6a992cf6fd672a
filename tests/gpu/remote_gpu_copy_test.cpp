// Multi-process, with GPUs: copies between GPU memory of ranks in different logical nodes, the
// path a copy between two GPU hosts takes (fbm -[sdma]-> reg -[nic]-> reg* -[sdma]-> fbm*,
// pipelined tile by tile; REG is pinned for the GPUs, so its sdma hops run on the copy engines).
// Run by `caravan run -n 2 --nodes 2` (ctest labels gpu and multiproc); every rank skips with
// the reason where it is not a rank of a job or its host has fewer GPUs than the job has ranks.
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

class GpuCrossNodeTest : public test::GpuJobTest {
 protected:
  void SetUp() override {
    test::GpuJobTest::SetUp();
    if (IsSkipped()) return;
    // Every rank copies to the rank half the job away, which must sit on another node.
    const int target = (rank() + world() / 2) % world(), writer = (rank() + world() - world() / 2) % world();
    if (target == rank() || rt().rank_info(target).node == rt().node() || rt().rank_info(writer).node == rt().node())
      GTEST_SKIP() << "needs the rank half the job away on another node (run with caravan run -n 2 --nodes 2)";
  }
  // This rank's memory of `kind`; GPU memory is the rank's own GPU (rank r uses GPU r), so the
  // two ends of a copy use different GPUs and PCIe links, as on two hosts.
  MemoryId memory(int r, MemoryKind kind) {
    return MemoryId{static_cast<std::uint32_t>(rt().rank_info(r).node), static_cast<std::uint32_t>(r), kind,
                    kind == MemoryKind::fbm ? static_cast<std::uint32_t>(r) : 0u};
  }
};

TEST_F(GpuCrossNodeTest, GpuToGpuAcrossNodesIsPipelinedThroughRegisteredHostMemory) {
  // Buffers far smaller than the instance, so the copy streams through REG on both hosts.
  settings::ScopedOverride threshold("CARAVAN_PLANNER_BUFFER_THRESHOLD", "1M");
  const int me = rank(), n = world();
  const std::uint64_t seed = test::fresh_seed(rt());
  FieldSpace fields({{"a", 8}, {"b", 4}, {"c", 4}});
  auto space = Rect::from_extents({1 << 19});  // 8 MiB
  auto src = Instance::create(memory(me, MemoryKind::fbm), space, fields, Layout::parse("F,x"));
  auto dst = Instance::create(memory(me, MemoryKind::fbm), space, fields, Layout::parse("F,x"));
  test::write_pattern(src, test::rank_seed(seed, me));
  test::poison(dst);
  auto dsts = test::share(rt(), dst);
  const int target = (me + n / 2) % n, writer = (me + n - n / 2) % n;  // ranks on the other node (SetUp)
  {
    CopyReport report;
    copy(src, dsts[static_cast<std::size_t>(target)], {.report = &report}).wait_for(60s);
    EXPECT_EQ(report.route, fmt::format("{} -[sdma]-> {} -[nic]-> {} -[sdma]-> {}", memory(me, MemoryKind::fbm).to_string(),
                                        memory(me, MemoryKind::reg).to_string(), memory(target, MemoryKind::reg).to_string(),
                                        memory(target, MemoryKind::fbm).to_string()));
    ASSERT_EQ(report.buffer_bytes.size(), 2u);
    for (std::uint64_t bytes : report.buffer_bytes) EXPECT_LE(bytes, 1u << 20);
    EXPECT_GE(report.tiles, 8u) << "the copy was not cut into tiles";
    ASSERT_EQ(report.hop_requests.size(), 3u);
    EXPECT_GT(report.hop_requests[0], 0u);
    EXPECT_GT(report.hop_requests[1], 0u);
  }
  rt().barrier(30s);
  EXPECT_EQ(test::count_mismatches(dst, test::rank_seed(seed, writer)), 0u);
  EXPECT_TRUE(test::engine_drains(10s));
  rt().barrier(30s);
}

TEST_F(GpuCrossNodeTest, LayoutChangesAndMixedEndsAcrossNodes) {
  // GPU memory to the other node's pinned host memory and back into GPU memory, each with a
  // layout change that some hop converts (the copy engines' strided copies or a memcpy).
  const int me = rank(), n = world();
  const std::uint64_t seed = test::fresh_seed(rt());
  FieldSpace fields({{"a", 4}, {"b", 8}, {"c", 2}});
  auto space = Rect::from_extents({160, 96});
  auto gpu_src = Instance::create(memory(me, MemoryKind::fbm), space, fields, Layout::parse("F,x,y"));
  auto host_dst = Instance::create(memory(me, MemoryKind::zcm), space, fields, Layout::parse("y,x,F"));
  auto host_src = Instance::create(memory(me, MemoryKind::sys), space, fields, Layout::parse("x,y,F"));
  auto gpu_dst = Instance::create(memory(me, MemoryKind::fbm), space, fields, Layout::parse("x_in=16,F,x_out,y"));
  test::write_pattern(gpu_src, test::rank_seed(seed, me));
  test::write_pattern(host_src, test::rank_seed(seed, me) + 1);
  test::poison(host_dst);
  test::poison(gpu_dst);
  auto host_dsts = test::share(rt(), host_dst), gpu_dsts = test::share(rt(), gpu_dst);
  const int target = (me + n / 2) % n, writer = (me + n - n / 2) % n;  // ranks on the other node (SetUp)
  {
    CopyReport to_host, to_gpu;
    Event a = copy(gpu_src, host_dsts[static_cast<std::size_t>(target)], {.report = &to_host});
    Event b = copy(host_src, gpu_dsts[static_cast<std::size_t>(target)], {.report = &to_gpu});
    a.wait_for(60s);
    b.wait_for(60s);
    EXPECT_NE(to_host.route.find("-[nic]->"), std::string::npos) << to_host.route;
    EXPECT_EQ(to_host.route.rfind(memory(me, MemoryKind::fbm).to_string(), 0), 0u) << to_host.route;
    EXPECT_NE(to_gpu.route.find("-[sdma]-> " + memory(target, MemoryKind::fbm).to_string()), std::string::npos) << to_gpu.route;
  }
  rt().barrier(30s);
  EXPECT_EQ(test::count_mismatches(host_dst, test::rank_seed(seed, writer)), 0u);
  EXPECT_EQ(test::count_mismatches(gpu_dst, test::rank_seed(seed, writer) + 1), 0u);
  EXPECT_TRUE(test::engine_drains(10s));
  rt().barrier(30s);
}

}  // namespace
}  // namespace caravan
