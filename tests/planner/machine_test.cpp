// Memory names, throughput functions, machine files and the transfer graph built from them.
#include <caravan/error.h>
#include <caravan/planner/machine_file.h>
#include <caravan/planner/transfer_graph.h>
#include <caravan/settings.h>

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

namespace caravan::planner {
namespace {

TEST(MemoryId, ParsesAndPrints) {
  MemoryId a = MemoryId::parse("node1/rank4/fbm");
  EXPECT_EQ(a.node, 1u);
  EXPECT_EQ(a.rank, 4u);
  EXPECT_EQ(a.kind, MemoryKind::fbm);
  EXPECT_EQ(a.index, 0u);
  EXPECT_EQ(a.to_string(), "node1/rank4/fbm");
  MemoryId b = MemoryId::parse("node0/rank0/fbm1");
  EXPECT_EQ(b.index, 1u);
  EXPECT_EQ(b.to_string(), "node0/rank0/fbm1");
  EXPECT_EQ(MemoryId::parse("node0/rank0/fbm0"), MemoryId::parse("node0/rank0/fbm"));
  for (const char* bad : {"node1/fbm", "nodeX/rank0/sys", "node0/rank0/gpu", "node0/rank/sys", "node0/rank0/sys/x"})
    EXPECT_THROW(MemoryId::parse(bad), Error) << bad;
  EXPECT_EQ(parse_channel_kind("xgmi"), ChannelKind::xgmi);
  EXPECT_THROW(parse_channel_kind("pcie"), Error);
}

TEST(Throughput, InterpolatesInLogSizeAndInverts) {
  ThroughputFunction tp({{1024, 1.0}, {4096, 3.0}, {1 << 20, 5.0}});
  EXPECT_DOUBLE_EQ(tp(1024), 1.0);
  EXPECT_DOUBLE_EQ(tp(2048), 2.0);  // halfway in log2 between 1K and 4K
  EXPECT_DOUBLE_EQ(tp(512), 0.5);   // below the table: proportional to size
  EXPECT_DOUBLE_EQ(tp(1e12), 5.0);  // above: the peak
  EXPECT_DOUBLE_EQ(tp.peak(), 5.0);
  for (double g : {0.1, 1.0, 2.0, 2.9, 3.5, 4.99, 5.0}) EXPECT_NEAR(tp(tp.inverse(g)), g, 1e-9) << g;
  EXPECT_TRUE(std::isinf(tp.inverse(5.01)));
  EXPECT_EQ(tp.inverse(0), 0.0);
  // Monotone everywhere, also between samples.
  double last = 0;
  for (double r = 1; r < 1e8; r *= 1.37) {
    EXPECT_GE(tp(r), last);
    last = tp(r);
  }
}

TEST(Throughput, FlattensADipAndRejectsBadTables) {
  ThroughputFunction dip({{1024, 2.0}, {4096, 1.0}, {8192, 3.0}});
  EXPECT_TRUE(dip.flattened());
  EXPECT_DOUBLE_EQ(dip(4096), 2.0);
  EXPECT_THROW(ThroughputFunction(std::vector<ThroughputFunction::Sample>{}), Error);
  EXPECT_THROW(ThroughputFunction({{0, 1.0}}), Error);
  EXPECT_THROW(ThroughputFunction({{4, -1.0}}), Error);
  EXPECT_THROW(ThroughputFunction({{4, 1.0}, {4, 2.0}}), Error);
}

TEST(MachineFile, BuiltinsLoadAndMatchTheirSources) {
  for (const auto& name : builtin_machine_names()) {
    MachineDescription m = builtin_machine(name);
    MachineDescription from_file = load_machine_file(std::string(CARAVAN_MACHINES_DIR) + "/" + name + ".json");
    EXPECT_EQ(m.channels.size(), from_file.channels.size()) << name;
    TransferGraph g(m);
    EXPECT_GT(g.channel_count(), 0u);
  }
  TransferGraph two(builtin_machine("isometry-two-node"));
  EXPECT_EQ(two.memory_count(), 10u);
  // Figure 4: self-loops on sys, zcm, reg and fbm of each node.
  int loops = 0;
  for (std::uint32_t e = 0; e < two.channel_count(); ++e) loops += two.channel(e).self_loop();
  EXPECT_EQ(loops, 8);
  auto reg0 = *two.find(MemoryId::parse("node0/rank0/reg"));
  auto sys1 = *two.find(MemoryId::parse("node1/rank1/sys"));
  bool found = false;
  for (auto e : two.out_channels(reg0))
    if (two.channel(e).dst == sys1) {
      found = true;
      EXPECT_EQ(two.channel(e).kind, ChannelKind::nic);
      EXPECT_NEAR(two.channel(e).peak_gbps, 3.18, 1e-9);
    }
  EXPECT_TRUE(found);
}

TEST(MachineFile, RoundTripsThroughJson) {
  MachineDescription m = generate_cluster({2, 4});
  MachineDescription back = parse_machine_json(to_machine_json(m), "round-trip");
  ASSERT_EQ(back.channels.size(), m.channels.size());
  ASSERT_EQ(back.memories.size(), m.memories.size());
  for (std::size_t i = 0; i < m.channels.size(); ++i) {
    EXPECT_EQ(back.channels[i].src, m.channels[i].src);
    EXPECT_EQ(back.channels[i].dst, m.channels[i].dst);
    EXPECT_TRUE(back.channels[i].tp == m.channels[i].tp);
    EXPECT_EQ(back.channels[i].shares, m.channels[i].shares);
  }
}

TEST(MachineFile, GeneratorScales) {
  MachineDescription m = generate_cluster({64, 8});
  TransferGraph g(m);
  EXPECT_EQ(g.memory_count(), 64u * 11);
  EXPECT_TRUE(g.find(MemoryId::parse("node63/rank511/fbm")).has_value());
  EXPECT_TRUE(g.find(MemoryId::parse("node5/rank40/reg")).has_value());
  EXPECT_THROW(generate_cluster({0, 8}), Error);
  // Its size grows with the square of the nodes: bounded before it takes gigabytes.
  for (const ClusterSpec too_big : {ClusterSpec{4096, 64}, ClusterSpec{1024, 64}, ClusterSpec{1025, 1}}) {
    try {
      generate_cluster(too_big);
      ADD_FAILURE() << too_big.nodes << " x " << too_big.gpus_per_node << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_NE(
          std::string(e.what()).find("nodes must be 1..1024, GPUs per node 1..64, and nodes x GPUs at most 16384"),
          std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(resolve_machine("generate:2x3").memories.size(), 2u * 6);
  EXPECT_THROW(resolve_machine("generate:2y3"), Error);
  settings::ScopedOverride machine("CARAVAN_PLANNER_MACHINE", "h200x4");
  EXPECT_EQ(machine_from_settings().name, "h200x4");
}

TEST(MachineFile, ErrorsNameTheEntry) {
  auto message = [](const std::string& text) {
    try {
      parse_machine_json(text, "test.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const std::string nodes = R"("nodes": [{"node": 0, "ranks": [{"rank": 0, "memories": [{"kind": "sys"}]}]}])";
  EXPECT_NE(message("{").find("test.json"), std::string::npos);
  EXPECT_NE(message("{" + nodes + R"(, "channels": [{"kind": "warp", "src": "node0/rank0/sys", "dst": "node0/rank0/sys", "throughput": 1}]})")
                .find("channels[0].kind"),
            std::string::npos);
  EXPECT_NE(message("{" + nodes + R"(, "channels": [{"kind": "memcpy", "src": "node0/rank0/sys", "dst": "node0/rank0/zcm", "throughput": 1}]})")
                .find("node0/rank0/zcm is not declared"),
            std::string::npos);
  EXPECT_NE(message("{" + nodes + R"(, "channels": [{"kind": "memcpy", "src": "node0/rank0/sys", "dst": "node0/rank0/sys", "throughput": 1, "shares": ["bus"]}]})")
                .find("resource 'bus'"),
            std::string::npos);
  EXPECT_NE(message("{" + nodes + R"(, "channels": [{"kind": "memcpy", "src": "node0/rank0/sys", "dst": "node0/rank0/sys", "throughput": {"shape": "none", "gbps": 1}}]})")
                .find("no shape named 'none'"),
            std::string::npos);
  // Wrong types and numbers that do not fit are named, not wrapped or truncated.
  const std::string channel =
      R"(, "channels": [{"kind": "memcpy", "src": "node0/rank0/sys", "dst": "node0/rank0/sys", "throughput": 1}]})";
  EXPECT_NE(message(R"({"name": 5, )" + nodes + channel).find("test.json: top level.name: expected a string, got 5"),
            std::string::npos);
  const auto with_memory = [&](const std::string& node, const std::string& memory) {
    return message(R"({"nodes": [{"node": )" + node + R"(, "ranks": [{"rank": 0, "memories": [)" + memory + "]}]}]" +
                   channel);
  };
  EXPECT_NE(with_memory("0", R"({"kind": "sys", "index": -1})")
                .find("nodes[0].ranks[0].memories[0].index: expected a whole number"),
            std::string::npos);
  EXPECT_NE(with_memory("0", R"({"kind": "sys", "index": 1.7})").find("got 1.7"), std::string::npos);
  EXPECT_NE(with_memory("0", R"({"kind": "sys", "index": "abc"})").find("memories[0].index"), std::string::npos);
  EXPECT_NE(
      with_memory("4294967296", R"({"kind": "sys"})").find("nodes[0].node: expected a whole number from 0 to 1048575"),
      std::string::npos);
  EXPECT_NE(
      message(
          "{" + nodes +
          R"(, "channels": [{"kind": "memcpy", "src": "node0/rank0/sys", "dst": "node0/rank0/sys", "throughput": 1, "pairs": 5}]})")
          .find("channels[0].pairs: expected a string"),
      std::string::npos);
  EXPECT_THROW(load_machine_file("/nonexistent/machine.json"), Error);
  EXPECT_THROW(builtin_machine("nope"), Error);
}

// Parsing `text` as "test.json" throws Error(invalid_argument) with the origin and `fragment`.
void expect_invalid(const std::string& text, const std::string& fragment) {
  try {
    parse_machine_json(text, "test.json");
    ADD_FAILURE() << "no error; expected one saying: " << fragment << "\nfor: " << text;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("machine file test.json: ", 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << "message was: " << e.what();
  }
}

// One node of rank 0 with sys and zcm (`memory` replaces zcm's entry), `resources` (a JSON array)
// and `channels` (the text of a JSON array's entries).
std::string machine(const std::string& channels, const std::string& memory = R"({"kind": "zcm"})",
                    const std::string& resources = R"([{"name": "bus", "gbps": 5}])", const std::string& extra = "") {
  return R"({"nodes": [{"node": 0, "ranks": [{"rank": 0, "memories": [{"kind": "sys"}, )" + memory +
         "]}]}], \"resources\": " + resources + extra + ", \"channels\": [" + channels + "]}";
}

const std::string kSysToZcm =
    R"({"kind": "memcpy", "src": "node0/rank0/sys", "dst": "node0/rank0/zcm", "throughput": 1})";

TEST(MachineFile, RejectsUnknownKeys) {
  ASSERT_NO_THROW(parse_machine_json(machine(kSysToZcm), "test.json"));
  // A misspelt "shares" used to drop the shared resource without a word.
  expect_invalid(
      machine(
          R"({"kind": "memcpy", "src": "node0/rank0/sys", "dst": "node0/rank0/zcm", "throughput": 1, "share": ["bus"]})"),
      R"(channels[0]: unknown key "share" (expected kind, src, dst, pairs, throughput, shares))");
  // A misspelt "capacity" used to leave the memory unbounded.
  expect_invalid(machine(kSysToZcm, R"({"kind": "zcm", "capacty": "4G"})"),
                 R"(nodes[0].ranks[0].memories[1]: unknown key "capacty" (expected kind, index, capacity))");
  expect_invalid(machine(kSysToZcm, R"({"kind": "zcm"})", R"([{"name": "bus", "gpbs": 5}])"),
                 R"(resources[0]: unknown key "gpbs")");
  expect_invalid(machine(R"({"kind": "memcpy", "src": "node0/rank0/sys", "dst": "node0/rank0/zcm",
                             "throughput": {"shape": "s", "gbps": 2, "peak": 3}})",
                         R"({"kind": "zcm"})", R"([])", R"(, "shapes": {"s": [[64, 1.0]]})"),
                 R"(channels[0].throughput: unknown key "peak" (expected shape, gbps))");
  expect_invalid(machine(kSysToZcm, R"({"kind": "zcm"})", R"([])", R"(, "table": {})"),
                 R"(top level: unknown key "table")");
  expect_invalid(R"({"nodes": [{"node": 0, "host": "a", "ranks": []}], "channels": []})",
                 R"(nodes[0]: unknown key "host")");
  expect_invalid(R"({"nodes": [{"node": 0, "ranks": [{"rank": 0, "gpu": 0, "memories": []}]}], "channels": []})",
                 R"(nodes[0].ranks[0]: unknown key "gpu")");
  expect_invalid(machine("[1]"), "channels[0]: expected a JSON object, got array");
}

TEST(MachineFile, RejectsARepeatedChannel) {
  // sys -> zcm from a list entry and again from an explicit one: two edges, bandwidth counted twice.
  const std::string list =
      R"({"kind": "memcpy", "src": ["node0/rank0/sys", "node0/rank0/zcm"], "dst": ["node0/rank0/sys", "node0/rank0/zcm"], "throughput": 1})";
  expect_invalid(machine(list + ", " + kSysToZcm),
                 "channels[1]: channel memcpy node0/rank0/sys -> node0/rank0/zcm is also made by channels[0]");
  expect_invalid(
      machine(
          R"({"kind": "memcpy", "src": ["node0/rank0/sys", "node0/rank0/sys"], "dst": "node0/rank0/zcm", "throughput": 1})"),
      "channels[0].src[1]: memory node0/rank0/sys is listed twice (also channels[0].src[0])");
  // Another kind between the same memories is another channel.
  MachineDescription m = parse_machine_json(
      machine(list + R"(, {"kind": "file", "src": "node0/rank0/sys", "dst": "node0/rank0/zcm", "throughput": 1})"),
      "test.json");
  EXPECT_EQ(m.channels.size(), 5u);
}

TEST(MachineFile, RejectsSizesThatDoNotConvert) {
  const auto capacity = [](const std::string& value) {
    return machine(kSysToZcm, R"({"kind": "zcm", "capacity": )" + value + "}");
  };
  const std::string at = "nodes[0].ranks[0].memories[1].capacity: ";
  expect_invalid(capacity(R"("inf")"), at + "'inf' is not a byte count (a size must be finite)");
  expect_invalid(capacity(R"("nan")"), at + "'nan' is not a byte count");
  expect_invalid(capacity(R"("1e30")"), at + "'1e30' is too large");
  expect_invalid(capacity(R"("16777216T")"), at + "'16777216T' is too large");
  expect_invalid(capacity("18446744073709551616"), at + "1.8446744073709552e+19 is too large");  // 2^64: a double
  expect_invalid(capacity("1e30"), "is too large");
  expect_invalid(capacity("0.5"), at + "0.5 is a fraction of a byte");
  expect_invalid(capacity(R"("0.1")"), at + "'0.1' is a fraction of a byte");
  expect_invalid(capacity("-1"), at + "-1: a size cannot be negative");
  // A number past a double's range is nlohmann's error, made a caravan one with the origin.
  expect_invalid(capacity("1e400"), "JSON: ");
  // Request sizes: the table holding the point is named, not the channel that uses it.
  expect_invalid(machine(kSysToZcm, R"({"kind": "zcm"})", "[]", R"(, "tables": {"t": [[0.5, 1.0], [64, 2.0]]})"),
                 "tables.t[0][0]: 0.5 is a fraction of a byte");
  expect_invalid(machine(kSysToZcm, R"({"kind": "zcm"})", "[]", R"(, "tables": {"t": [[0, 1.0]]})"),
                 "tables.t[0][0]: a request size must be at least 1 byte");
  expect_invalid(machine(kSysToZcm, R"({"kind": "zcm"})", "[]", R"(, "shapes": {"s": [[64, 1.0], ["64", 0.5]]})"),
                 "shapes.s: throughput table: request size 64 appears twice");
  // Whole sizes still read as before, 0 (unbounded) included.
  MachineDescription m = parse_machine_json(capacity(R"("1.5K")"), "test.json");
  EXPECT_EQ(m.memories[1].capacity, 1536u);
  EXPECT_EQ(parse_machine_json(capacity("0"), "test.json").memories[1].capacity, 0u);
  EXPECT_EQ(parse_machine_json(capacity("18446744073709551615"), "test.json").memories[1].capacity,
            18446744073709551615ull);
}

TEST(MachineFile, MemoryIdsKeepToWhatAMemoryNameHolds) {
  // MemoryId::key() keeps 16 bits of index: index 65536 was taken for index 0.
  expect_invalid(machine(kSysToZcm, R"({"kind": "zcm"}, {"kind": "zcm", "index": 65536})"),
                 "nodes[0].ranks[0].memories[2].index: expected a whole number from 0 to 65535");
  expect_invalid(R"({"nodes": [{"node": 1048576, "ranks": []}], "channels": []})",
                 "nodes[0].node: expected a whole number from 0 to 1048575");
  expect_invalid(R"({"nodes": [{"node": 0, "ranks": [{"rank": 16777216, "memories": []}]}], "channels": []})",
                 "nodes[0].ranks[0].rank: expected a whole number from 0 to 16777215");
  MachineDescription m = parse_machine_json(
      R"({"nodes": [{"node": 1048575, "ranks": [{"rank": 16777215, "memories": [{"kind": "fbm", "index": 65535}]}]}],
          "channels": [{"kind": "sdma", "src": "node1048575/rank16777215/fbm65535", "dst": "node1048575/rank16777215/fbm65535", "throughput": 1}]})",
      "test.json");
  EXPECT_EQ(m.memories[0].id, MemoryId::parse("node1048575/rank16777215/fbm65535"));
  expect_invalid(
      machine(kSysToZcm, R"({"kind": "zcm"}, {"kind": "zcm", "index": 0})"),
      "nodes[0].ranks[0].memories[2]: memory node0/rank0/zcm is declared twice (also nodes[0].ranks[0].memories[1])");
}

TEST(MachineFile, ChannelErrorsNameTheJsonEntry) {
  // channels[0] makes four channels; the error is in channels[1], not "channel 4".
  const std::string list =
      R"({"kind": "memcpy", "src": ["node0/rank0/sys", "node0/rank0/zcm"], "dst": ["node0/rank0/sys", "node0/rank0/zcm"], "throughput": 1})";
  expect_invalid(
      machine(
          list +
          R"(, {"kind": "file", "src": "node0/rank0/sys", "dst": ["node0/rank0/zcm", "node0/rank0/dsk"], "throughput": 1})"),
      "channels[1].dst[1]: memory node0/rank0/dsk is not declared");
  expect_invalid(
      machine(
          list +
          R"(, {"kind": "file", "src": "node0/rank0/sys", "dst": "node0/rank0/zcm", "throughput": 1, "shares": ["bus", "nic"]})"),
      "channels[1].shares[1]: resource 'nic' is not declared");
  expect_invalid(machine(kSysToZcm, R"({"kind": "zcm"})", R"([{"name": "bus", "gbps": 0}])"),
                 "resources[0].gbps: expected a positive number (GB/s), got 0");
  expect_invalid(
      machine(kSysToZcm, R"({"kind": "zcm"})", R"([{"name": "bus", "gbps": 1}, {"name": "bus", "gbps": 2}])"),
      "resources[1].name: resource 'bus' is declared twice (also resources[0])");
}

TEST(MachineFile, LocalMachineIsMeasured) {
  MachineDescription m = describe_local_machine();
  TransferGraph g(m);
  ASSERT_EQ(g.channel_count(), 1u);
  EXPECT_TRUE(g.channel(0).self_loop());
  EXPECT_GT(g.channel(0).peak_gbps, 0.01);
}

}  // namespace
}  // namespace caravan::planner
