// Multi-path planning on the measured 4 x H200 node: host -> GPU 0 over GPU 0's own PCIe link
// and through each peer GPU's PCIe link then NVLink (measured: 174 GB/s against 55 GB/s direct).
#include <caravan/planner/machine_file.h>
#include <caravan/planner/planner.h>

#include <gtest/gtest.h>

#include <set>

namespace caravan::planner {
namespace {

TEST(Multipath, H200HostToGpuUsesEveryPcieLink) {
  TransferGraph g(builtin_machine("h200x4"));
  TransferRequest r{MemoryId::parse("node0/rank0/zcm"), MemoryId::parse("node0/rank0/fbm"), Rect::from_extents({1 << 30}),
                    FieldSpace::uniform(1, 1), Layout::aos(1), Layout::aos(1)};
  Plan single = plan_full(g, r);
  EXPECT_EQ(single.hops.size(), 1u) << to_text(single);
  EXPECT_NEAR(single.predicted_gbps, 55.4, 0.5);
  MultiPlan m = plan_multipath(g, r);
  SCOPED_TRACE(to_text(m));
  ASSERT_EQ(m.shares.size(), 4u);
  std::set<MemoryId> relays;
  std::uint64_t bytes = 0;
  for (const auto& s : m.shares) {
    bytes += s.bytes;
    if (s.plan.hops.size() == 2) {
      EXPECT_EQ(s.plan.hops[0].kind, ChannelKind::sdma);
      EXPECT_EQ(s.plan.hops[1].kind, ChannelKind::xgmi);
      relays.insert(s.plan.hops[0].dst);
      EXPECT_LE(s.plan.buffers[0].bytes, s.plan.buffer_threshold);
    } else {
      EXPECT_EQ(s.plan.hops.size(), 1u);
    }
  }
  EXPECT_EQ(relays.size(), 3u);  // through GPUs 1, 2 and 3
  EXPECT_EQ(bytes, r.bytes());
  // Four PCIe links, bounded by the host's measured 179.6 GB/s aggregate.
  EXPECT_GE(m.predicted_gbps, 3.0 * single.predicted_gbps);
  EXPECT_LE(m.predicted_gbps, 179.6 * (1 + 1e-6));
  EXPECT_NEAR(m.max_flow_gbps, 179.6, 0.01);
  EXPECT_NEAR(max_flow_bound(g, r.src, r.dst), 179.6, 0.01);
}

TEST(Multipath, SharedLinksAreCountedOnce) {
  // GPU 0 -> GPU 1 over NVLink: relaying through GPU 2 also leaves through GPU 0's NVLink
  // egress, so relays add nothing; only the way round through host memory (GPU 0's PCIe out,
  // GPU 1's PCIe in) adds its 55 GB/s.
  TransferGraph g(builtin_machine("h200x4"));
  TransferRequest r{MemoryId::parse("node0/rank0/fbm"), MemoryId::parse("node0/rank1/fbm"), Rect::from_extents({1 << 30}),
                    FieldSpace::uniform(1, 1), Layout::aos(1), Layout::aos(1)};
  MultiPlan m = plan_multipath(g, r);
  EXPECT_GE(m.predicted_gbps, 394.0 * (1 - 1e-6)) << to_text(m);
  EXPECT_LE(m.predicted_gbps, 394.0 + 55.4 + 1e-3) << to_text(m);
  EXPECT_NEAR(m.max_flow_gbps, 394.0 + 55.4, 1e-3);
  for (const auto& s : m.shares)
    for (const auto& h : s.plan.hops)
      if (h.kind == ChannelKind::xgmi) {
        EXPECT_EQ(h.src, r.src) << "a relay through a third GPU gains nothing";
      }
}

TEST(Multipath, GeneratedClusterAcrossNodes) {
  TransferGraph g(generate_cluster({4, 8}));
  TransferRequest r{MemoryId::parse("node0/rank0/fbm"), MemoryId::parse("node3/rank24/fbm"), Rect::from_extents({1 << 28}),
                    FieldSpace::uniform(1, 4), Layout::aos(1), Layout::aos(1)};
  MultiPlan m = plan_multipath(g, r);
  EXPECT_GE(m.predicted_gbps, m.best_single_gbps * (1 - 1e-9)) << to_text(m);
  EXPECT_LE(m.predicted_gbps, 48.0 * (1 + 1e-6)) << to_text(m);  // one NIC per node
}

}  // namespace
}  // namespace caravan::planner
