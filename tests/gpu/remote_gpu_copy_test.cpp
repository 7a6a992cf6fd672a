// Multi-process, with GPUs: copies between GPU memory of ranks in different logical nodes, the
// path a copy between two GPU hosts takes (fbm -[sdma]-> reg -[nic]-> reg* -[sdma]-> fbm*,
// pipelined tile by tile; REG is pinned for the GPUs, so its sdma hops run on the copy engines).
// Run by `caravan run -n 2 --nodes 2` (ctest labels gpu and multiproc); every rank skips with
// the reason where it is not a rank of a job or its host has fewer GPUs than the job has ranks.
//
// Data: each source holds a pattern from a seed rank 0 draws fresh for every run, destinations
// are poisoned first, and every (point, field) is checked after the copy.
#include "runtime/dma/engine.h"
#include "runtime/gpu/devices.h"
#include "tests/dma/dma_test_util.h"
#include "tests/net/net_test_util.h"

#include <caravan/settings.h>

#include <fmt/format.h>

#include <random>
#include <thread>

namespace caravan {
namespace {

using namespace std::chrono_literals;
using test::JobTest;

class GpuJobTest : public JobTest {
 protected:
  void SetUp() override {
    JobTest::SetUp();
    if (IsSkipped()) return;
    const auto& devices = gpu::topology().devices;
    if (devices.size() < static_cast<std::size_t>(world()))
      GTEST_SKIP() << "needs a GPU per rank on this host (" << world() << " ranks, "
                   << (devices.empty() ? gpu::topology().reason : std::to_string(devices.size()) + " GPUs") << ")";
  }
  // This rank's memory of `kind`; GPU memory is the rank's own GPU (rank r uses GPU r), so the
  // two ends of a copy use different GPUs and PCIe links, as on two hosts.
  MemoryId memory(int r, MemoryKind kind) {
    return MemoryId{static_cast<std::uint32_t>(rt().rank_info(r).node), static_cast<std::uint32_t>(r), kind,
                    kind == MemoryKind::fbm ? static_cast<std::uint32_t>(r) : 0u};
  }
  std::vector<Instance> share(const Instance& mine) {
    auto parts = test::network(rt()).allgather(mine.descriptor(), 30s, "test descriptors");
    std::vector<Instance> out;
    for (auto& part : parts) out.push_back(Instance::from_descriptor(part));
    return out;
  }
  std::uint64_t fresh_seed() {
    std::uint64_t seed = std::random_device{}() | (static_cast<std::uint64_t>(std::random_device{}()) << 32);
    return test::all_gather(rt(), seed)[0];
  }
  bool engine_drains(std::chrono::seconds limit) {
    auto until = std::chrono::steady_clock::now() + limit;
    while (dma::Engine::current().stats().active_copies != 0 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(5ms);
    return dma::Engine::current().stats().active_copies == 0;
  }
};

std::uint64_t seed_of(std::uint64_t seed, int rank) { return seed ^ (0x51ull * static_cast<std::uint64_t>(rank + 1)); }

TEST_F(GpuJobTest, GpuToGpuAcrossNodesIsPipelinedThroughRegisteredHostMemory) {
  // Buffers far smaller than the instance, so the copy streams through REG on both hosts.
  settings::ScopedOverride threshold("CARAVAN_PLANNER_BUFFER_THRESHOLD", "1M");
  const int me = rank(), n = world();
  const std::uint64_t seed = fresh_seed();
  FieldSpace fields({{"a", 8}, {"b", 4}, {"c", 4}});
  auto space = Rect::from_extents({1 << 19});  // 8 MiB
  auto src = Instance::create(memory(me, MemoryKind::fbm), space, fields, Layout::parse("F,x"));
  auto dst = Instance::create(memory(me, MemoryKind::fbm), space, fields, Layout::parse("F,x"));
  test::write_pattern(src, seed_of(seed, me));
  test::poison(dst);
  auto dsts = share(dst);
  const int target = (me + n / 2) % n;  // with --nodes 2: a rank on the other node
  if (target != me && rt().rank_info(target).node != rt().node()) {
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
  } else {
    GTEST_LOG_(INFO) << "rank " << me << " has no rank on another node to copy to (run with --nodes 2)";
  }
  rt().barrier(30s);
  const int writer = (me + n - n / 2) % n;
  if (writer != me && rt().rank_info(writer).node != rt().node()) {
    EXPECT_EQ(test::count_mismatches(dst, seed_of(seed, writer)), 0u);
  }
  EXPECT_TRUE(engine_drains(10s));
  rt().barrier(30s);
}

TEST_F(GpuJobTest, LayoutChangesAndMixedEndsAcrossNodes) {
  // GPU memory to the other node's pinned host memory and back into GPU memory, each with a
  // layout change that some hop converts (the copy engines' strided copies or a memcpy).
  const int me = rank(), n = world();
  const std::uint64_t seed = fresh_seed();
  FieldSpace fields({{"a", 4}, {"b", 8}, {"c", 2}});
  auto space = Rect::from_extents({160, 96});
  auto gpu_src = Instance::create(memory(me, MemoryKind::fbm), space, fields, Layout::parse("F,x,y"));
  auto host_dst = Instance::create(memory(me, MemoryKind::zcm), space, fields, Layout::parse("y,x,F"));
  auto host_src = Instance::create(memory(me, MemoryKind::sys), space, fields, Layout::parse("x,y,F"));
  auto gpu_dst = Instance::create(memory(me, MemoryKind::fbm), space, fields, Layout::parse("x_in=16,F,x_out,y"));
  test::write_pattern(gpu_src, seed_of(seed, me));
  test::write_pattern(host_src, seed_of(seed, me) + 1);
  test::poison(host_dst);
  test::poison(gpu_dst);
  auto host_dsts = share(host_dst), gpu_dsts = share(gpu_dst);
  const int target = (me + n / 2) % n;
  if (target != me) {
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
  const int writer = (me + n - n / 2) % n;
  if (writer != me) {
    EXPECT_EQ(test::count_mismatches(host_dst, seed_of(seed, writer)), 0u);
    EXPECT_EQ(test::count_mismatches(gpu_dst, seed_of(seed, writer) + 1), 0u);
  }
  EXPECT_TRUE(engine_drains(10s));
  rt().barrier(30s);
}

}  // namespace
}  // namespace caravan
