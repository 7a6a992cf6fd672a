// The planners on the paper's own examples (Isometry sections 4.3, 4.4, 6.3) and bad input.
#include <caravan/error.h>
#include <caravan/planner/machine_file.h>
#include <caravan/planner/planner.h>

#include <gtest/gtest.h>

namespace caravan::planner {
namespace {

constexpr std::uint64_t MiB = 1u << 20;

// The two-node cluster of Figure 4 with the 3 GB/s network of section 4.3.
TransferGraph two_node(double network_gbps = 0) {
  MachineDescription m = builtin_machine("isometry-two-node");
  if (network_gbps > 0) {
    for (auto& c : m.channels)
      if (c.kind == ChannelKind::nic) {
        std::vector<ThroughputFunction::Sample> s = c.tp.samples();
        double peak = c.tp.peak();
        for (auto& p : s) p.gbps *= network_gbps / peak;
        c.tp = ThroughputFunction(s);
      }
    for (auto& r : m.resources)
      if (r.name.find("nic") != std::string::npos) r.gbps = network_gbps;
  }
  return TransferGraph(m);
}

MemoryId M(const char* name) { return MemoryId::parse(name); }

void expect_respects_threshold(const Plan& p) {
  for (const auto& b : p.buffers) EXPECT_LE(b.bytes, p.buffer_threshold) << to_text(p);
  for (const auto& h : p.hops)
    if (h.src_is_buffer && h.dst_is_buffer) {
      EXPECT_LE(h.shuffle_bytes, p.buffer_threshold) << to_text(p);
    }
}

// Section 4.3: transposing a row-major matrix between the GPUs of two nodes, |F| = 16,
// TH = 32 MB, a 3 GB/s network. The full planner reaches the network bound through a Table 3
// shaped path: GPU -> host, a layout conversion on memcpy (small requests are fine there),
// the network without conversion, host -> GPU.
TEST(PaperExample, Section43TranspositionReachesTheNetworkBound) {
  TransferGraph g = two_node(3.0);
  TransferRequest r{M("node0/rank0/fbm"), M("node1/rank1/fbm"), Rect::from_extents({8192, 8192}), FieldSpace::uniform(4, 4),
                    Layout::parse("F,x,y"), Layout::parse("F,y,x")};
  PlannerOptions o;
  o.buffer_threshold = 32 * MiB;
  Plan p = plan_full(g, r, o);
  SCOPED_TRACE(to_text(p));
  EXPECT_NEAR(p.upper_bound_gbps, 3.0, 1e-9);
  EXPECT_GE(p.predicted_gbps, 3.0 * (1 - 1e-6));
  expect_respects_threshold(p);
  ASSERT_GE(p.hops.size(), 4u);
  int nic_hops = 0;
  const Hop* smallest = &p.hops.front();
  for (const auto& h : p.hops) {
    EXPECT_GE(h.gbps, 3.0 * (1 - 1e-6));
    if (h.kind == ChannelKind::nic) {
      ++nic_hops;
      EXPECT_FALSE(h.converts()) << "the network hop must move whole buffers";
    }
    if (h.request_bytes < smallest->request_bytes) smallest = &h;
  }
  EXPECT_EQ(nic_hops, 1);
  // The in-tile transposition (requests of one point, |F| bytes) runs on memcpy.
  EXPECT_EQ(smallest->kind, ChannelKind::memcpy);
  EXPECT_EQ(smallest->request_bytes, 16u);
  EXPECT_EQ(p.hops.front().kind, ChannelKind::sdma);
  EXPECT_EQ(p.hops.back().kind, ChannelKind::sdma);
  EXPECT_TRUE(p.hops.front().converts());  // blocking on the GPU side, with long requests
  EXPECT_GT(p.hops.front().request_bytes, 4096u);
  EXPECT_GT(p.hops.back().request_bytes, 4096u);

  // The simple planner converts with the whole matrix as its shuffle; within TH it cannot use
  // the middle of the path and ends far below the network.
  Plan s = plan_simple(g, r, o);
  SCOPED_TRACE(to_text(s));
  expect_respects_threshold(s);
  EXPECT_LT(s.predicted_gbps, p.predicted_gbps);
}

// Figure 10: between the system memories of two nodes the full planner detours through the
// source node's REG (NIC-registered, 3.18 GB/s) instead of the direct 2.70 GB/s edge; the
// simple planner takes the direct edge.
TEST(PaperExample, Figure10RegDetour) {
  TransferGraph g = two_node();
  TransferRequest r{M("node0/rank0/sys"), M("node1/rank1/sys"), Rect::from_extents({4 << 20}), FieldSpace::uniform(8, 4),
                    Layout::aos(1), Layout::aos(1)};
  Plan full = plan_full(g, r);
  SCOPED_TRACE(to_text(full));
  ASSERT_EQ(full.hops.size(), 2u);
  EXPECT_EQ(full.hops[0].dst, M("node0/rank0/reg"));
  EXPECT_EQ(full.hops[1].kind, ChannelKind::nic);
  EXPECT_NEAR(full.predicted_gbps, 3.18, 1e-9);
  Plan simple = plan_simple(g, r);
  SCOPED_TRACE(to_text(simple));
  ASSERT_EQ(simple.hops.size(), 1u);
  EXPECT_EQ(simple.hops[0].kind, ChannelKind::nic);
  EXPECT_NEAR(simple.predicted_gbps, 2.701, 1e-9);
}

// Section 6.3: AOS -> SOA into the disk. The conversion lands on memcpy, never on the disk
// channel, which is slow for small requests; the disk sees whole buffers.
TEST(PaperExample, AosToSoaConvertsOnMemcpyNotOnTheSlowChannel) {
  TransferGraph g = two_node();
  TransferRequest r{M("node0/rank0/sys"), M("node0/rank0/dsk"), Rect::from_extents({4 << 20}), FieldSpace::uniform(8, 4),
                    Layout::aos(1), Layout::soa(1)};
  for (PlannerKind kind : {PlannerKind::full, PlannerKind::simple}) {
    Plan p = kind == PlannerKind::full ? plan_full(g, r) : plan_simple(g, r);
    SCOPED_TRACE(to_text(p));
    expect_respects_threshold(p);
    bool converted = false;
    for (const auto& h : p.hops) {
      if (h.kind == ChannelKind::file) {
        EXPECT_GE(h.request_bytes, 1u * MiB);
        if (kind == PlannerKind::simple) {
          EXPECT_FALSE(h.converts());
        }
      }
      if (h.converts() && h.request_bytes < 4096) {
        EXPECT_EQ(h.kind, ChannelKind::memcpy);
        converted = true;
      }
    }
    EXPECT_TRUE(converted || kind == PlannerKind::full);
    EXPECT_GT(p.predicted_gbps, 0.2);  // near the disk's 0.27 GB/s, not its small-request rate
  }
}

// A plain copy within one GPU memory takes the copy engine unless the SM-driven copy is clearly
// faster: a kernel takes SMs from the computation copies hide behind, and the two calibrated
// peaks are close on an H200 (the route flipped from machine to machine).
TEST(PlannerPolicy, CopiesWithinAGpuPreferTheCopyEngineUnlessTheKernelIsClearlyFaster) {
  const auto plan_with_kernel_peak = [](double convert_peak, const Layout& to) {
    MachineDescription m = generate_cluster({1, 1});
    for (auto& c : m.channels)
      if (c.kind == ChannelKind::gpu_convert)
        c.tp = ThroughputFunction::scaled({{4096, 1.0}}, convert_peak);
      else if (c.kind == ChannelKind::sdma && c.src == c.dst)
        c.tp = ThroughputFunction::scaled({{4096, 1.0}}, 2000.0);
    TransferGraph g(m);
    TransferRequest r{M("node0/rank0/fbm"),      M("node0/rank0/fbm"), Rect::from_extents({1 << 18}),
                      FieldSpace::uniform(4, 4), Layout::aos(1),       to};
    return plan_simple(g, r);
  };
  EXPECT_EQ(plan_with_kernel_peak(2100.0, Layout::aos(1)).hops.at(0).kind, ChannelKind::sdma) << "a near-tie";
  EXPECT_EQ(plan_with_kernel_peak(3000.0, Layout::aos(1)).hops.at(0).kind, ChannelKind::gpu_convert)
      << "the kernel is clearly faster";
  EXPECT_EQ(plan_with_kernel_peak(1900.0, Layout::aos(1)).hops.at(0).kind, ChannelKind::sdma);
}

// A region of a larger instance (CopyOptions::region) is read in its rows, not as one run: a
// narrow band between the nodes' system memories is rated by its 128-byte rows. The full planner
// gathers it into whole buffers before the network (which is slow for small requests); the
// simple planner's direct path is rated at the rows' rate.
// Layout conversions among GPU memories below the full planner's size: the simple planner puts
// the conversion on the conversion kernel, not on the copy engine or the peer link (which would
// send one value per request), both within one GPU and between two.
TEST(PlannerPolicy, ConversionsBetweenGpuMemoriesRunOnTheConversionKernel) {
  TransferGraph g(builtin_machine("h200x4"));
  const Rect space = Rect::from_extents({1 << 19});  // 8 MiB of 4 x 4-byte fields
  for (const char* dst : {"node0/rank0/fbm", "node0/rank1/fbm"}) {
    TransferRequest r{M("node0/rank0/fbm"), M(dst), space, FieldSpace::uniform(4, 4), Layout::aos(1), Layout::soa(1)};
    Plan p = plan_simple(g, r);
    SCOPED_TRACE(to_text(p));
    bool on_kernel = false;
    for (const auto& h : p.hops) {
      if (h.converts()) {
        EXPECT_EQ(h.kind, ChannelKind::gpu_convert);
        on_kernel = true;
      }
    }
    EXPECT_TRUE(on_kernel);
    EXPECT_GT(p.predicted_gbps, 10.0) << "the copy engine converting sends one value per request (0.01 GB/s)";
    EXPECT_GE(p.predicted_gbps, 0.5 * plan_full(g, r).predicted_gbps);
  }
}

TEST(PlannerRegions, ANarrowBandIsRatedByItsRowsAndGatheredBeforeTheNetwork) {
  TransferGraph g = two_node();
  const Rect band(2, Point{0, 0}, Point{15, 4095});  // 16 points of 8 bytes: 128-byte rows
  TransferRequest dense{M("node0/rank0/sys"),      M("node1/rank1/sys"), band,
                        FieldSpace::uniform(2, 4), Layout::aos(2),       Layout::aos(2)};
  TransferRequest region = dense;
  region.src_instance_space = Rect::from_extents({4096, 4096});
  region.dst_instance_space = Rect::from_extents({4096, 4096});
  for (PlannerKind kind : {PlannerKind::full, PlannerKind::simple}) {
    Plan d = kind == PlannerKind::full ? plan_full(g, dense) : plan_simple(g, dense);
    Plan p = kind == PlannerKind::full ? plan_full(g, region) : plan_simple(g, region);
    SCOPED_TRACE(to_text(d) + "\n" + to_text(p));
    EXPECT_LE(p.hops.front().prefix_bytes, 128u);
    EXPECT_LE(p.hops.back().prefix_bytes, 128u);
    EXPECT_LE(p.hops.front().request_bytes, 128u);
    if (kind == PlannerKind::full) {
      // memcpy gathers the rows fast enough that the network stays the bottleneck.
      EXPECT_NEAR(p.predicted_gbps, d.predicted_gbps, 1e-9);
      int nic_hops = 0;
      for (const auto& h : p.hops)
        if (h.kind == ChannelKind::nic) {
          ++nic_hops;
          EXPECT_TRUE(h.src_is_buffer && h.dst_is_buffer) << "the network moves gathered buffers";
          EXPECT_GT(h.request_bytes, 4096u);
        }
      EXPECT_EQ(nic_hops, 1);
    } else {
      EXPECT_LT(p.predicted_gbps, d.predicted_gbps / 2) << "the network sent the rows one by one";
    }
  }
  // A region that spans whole rows keeps long runs: the band's rate is the dense rate.
  TransferRequest rows = dense;
  rows.space = Rect(2, Point{0, 0}, Point{4095, 15});
  TransferRequest rows_region = rows;
  rows_region.src_instance_space = Rect::from_extents({4096, 4096});
  rows_region.dst_instance_space = Rect::from_extents({4096, 4096});
  EXPECT_NEAR(plan_full(g, rows_region).predicted_gbps, plan_full(g, rows).predicted_gbps, 1e-9);
  // An instance space that does not hold the region is refused by name.
  TransferRequest outside = region;
  outside.dst_instance_space = Rect::from_extents({8, 4096});
  try {
    plan_full(g, outside);
    ADD_FAILURE() << "planned a region outside its instance";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("must lie inside the dst instance's index space"), std::string::npos)
        << e.what();
  }
}

TEST(PlannerErrors, BadInputIsRejectedWithTheRule) {
  TransferGraph g = two_node();
  auto message = [&](const TransferRequest& r, PlannerOptions o = {}) {
    try {
      plan_full(g, r, o);
    } catch (const Error& e) {
      return std::pair<Errc, std::string>(e.code(), e.what());
    }
    return std::pair<Errc, std::string>(Errc::internal, "(no error)");
  };
  TransferRequest base{M("node0/rank0/fbm"), M("node1/rank1/fbm"), Rect::from_extents({1024}), FieldSpace::uniform(2, 4),
                       Layout::aos(1), Layout::aos(1)};
  // Layouts that do not describe the same instance.
  auto r = base;
  r.dst_layout = Layout::parse("F,y,x");
  auto [code, text] = message(r);
  EXPECT_EQ(code, Errc::invalid_argument);
  EXPECT_NE(text.find("dst layout 'F,y,x': dimension y is not in the index space (x)"), std::string::npos) << text;
  // Unknown memory.
  r = base;
  r.dst = M("node7/rank7/fbm");
  std::tie(code, text) = message(r);
  EXPECT_EQ(code, Errc::not_found);
  EXPECT_NE(text.find("dst memory node7/rank7/fbm is not a memory"), std::string::npos) << text;
  // No path: a machine of two islands.
  MachineDescription islands;
  islands.name = "islands";
  islands.memories = {{M("node0/rank0/sys"), 0}, {M("node1/rank1/sys"), 0}};
  islands.channels = {{ChannelKind::memcpy, M("node0/rank0/sys"), M("node0/rank0/sys"), ThroughputFunction::flat(1), {}}};
  TransferGraph gi(islands);
  r = base;
  r.src = M("node0/rank0/sys");
  r.dst = M("node1/rank1/sys");
  try {
    plan_full(gi, r);
    ADD_FAILURE() << "planned across islands";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("no path from node0/rank0/sys to node1/rank1/sys"), std::string::npos) << e.what();
  }
  EXPECT_THROW(plan_simple(gi, r), Error);
  // TH too small for any path: GPU to remote GPU has no direct channel, and every buffer
  // must hold at least one field value (4 bytes).
  PlannerOptions tiny;
  tiny.buffer_threshold = 2;
  std::tie(code, text) = message(base, tiny);
  EXPECT_EQ(code, Errc::invalid_argument);
  EXPECT_NE(text.find("buffer threshold TH = 2 bytes is too small"), std::string::npos) << text;
  EXPECT_THROW(plan_simple(g, base, tiny), Error);
  EXPECT_THROW(plan_multipath(g, base, tiny), Error);
}

}  // namespace
}  // namespace caravan::planner
