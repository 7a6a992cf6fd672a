// How large the requests of a hop are (full_speed_request_bytes): GPU channels from
// CARAVAN_GPU_REQUEST_US alone, other channels from where their calibrated table reaches 99% of
// its peak. A high-priority copy on a GPU channel waits behind up to two such requests, so the
// setting must decide their size whatever the table looks like.
#include "runtime/dma/engine.h"
#include "runtime/dma/interleave.h"
#include "runtime/dma/transfer_ops.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <tuple>

namespace caravan {
namespace {

constexpr std::uint64_t kMiB = 1u << 20;

planner::Channel channel_of(ChannelKind kind, std::vector<planner::ThroughputFunction::Sample> samples) {
  planner::Channel c;
  c.kind = kind;
  c.tp = planner::ThroughputFunction(std::move(samples));
  c.peak_gbps = c.tp.peak();
  return c;
}

// A host link as one H200 calibrated it, except that its 16 MiB point is 2.2% below its 64 MiB
// one: the table reaches 99% of its peak only at about 34 MiB.
planner::Channel host_link(ChannelKind kind) {
  return channel_of(kind, {{1u << 20, 48.6}, {4 * kMiB, 53.6}, {16 * kMiB, 53.8}, {64 * kMiB, 55.0}});
}

TEST(RequestSize, GpuChannelsSendTheSettingsWorthOfWorkWhateverTheTable) {
  const planner::Channel sdma = host_link(ChannelKind::sdma);
  ASSERT_GT(sdma.tp.inverse(0.99 * sdma.tp.peak()), 32.0 * kMiB) << "the table must put 99% of its peak past 32 MiB";
  // 250 us at 55 GB/s is 13.75 MB: 14 MiB, whole MiB rounded up.
  EXPECT_EQ(dma::full_speed_request_bytes(sdma, 250), 14 * kMiB);
  // Shorter settings shorten the requests (what a high-priority copy waits for) ...
  EXPECT_EQ(dma::full_speed_request_bytes(sdma, 100), 6 * kMiB);
  // ... down to the 4 MiB every channel sends at least.
  EXPECT_EQ(dma::full_speed_request_bytes(sdma, 20), 4 * kMiB);
  EXPECT_EQ(dma::full_speed_request_bytes(host_link(ChannelKind::xgmi), 250), 14 * kMiB);
  EXPECT_EQ(dma::full_speed_request_bytes(host_link(ChannelKind::gpu_convert), 250), 14 * kMiB);
}

TEST(RequestSize, LongRequestsStopAt256MiB) {
  // A copy within one GPU: 1.9 TB/s for 250 us is 475 MB.
  const planner::Channel local = channel_of(ChannelKind::sdma, {{4 * kMiB, 420.0}, {64 * kMiB, 1900.0}});
  EXPECT_EQ(dma::full_speed_request_bytes(local, 250), 256 * kMiB);
}

TEST(RequestSize, OtherChannelsSendWhereTheirTableReaches99Percent) {
  // The same table on a host channel: its requests grow to the 99% point (about 34 MiB), and the
  // GPU setting plays no part.
  const planner::Channel memcpy = host_link(ChannelKind::memcpy);
  const std::uint64_t bytes = dma::full_speed_request_bytes(memcpy, 250);
  EXPECT_GE(static_cast<double>(bytes), memcpy.tp.inverse(0.99 * memcpy.tp.peak()));
  EXPECT_LT(bytes, 64 * kMiB);
  EXPECT_EQ(dma::full_speed_request_bytes(memcpy, 20), bytes);
  // A host channel that peaks by 4 MiB keeps 4 MiB requests.
  EXPECT_EQ(dma::full_speed_request_bytes(channel_of(ChannelKind::memcpy, {{64u << 10, 6.0}, {1 * kMiB, 8.0}}), 250),
            4 * kMiB);
}

// Runs the ops on host buffers: what each cut must leave unchanged.
std::vector<std::byte> run_ops(const std::vector<dma::TransferOp>& ops, const std::vector<std::byte>& src,
                               std::size_t dst_bytes) {
  std::vector<std::byte> dst(dst_bytes, std::byte{0xAB});
  dma::copy_host_ops(ops, src.data(), dst.data());
  return dst;
}

// A layout conversion longer than a request is cut by element range with its fields side by
// side: a request of consecutive ops up to the limit then reads each source record once, where a
// cut field by field read every record once per field.
TEST(RequestCuts, ConversionFieldsAreCutTogetherByElementRange) {
  const FieldSpace xyz({{"x", 4}, {"y", 4}, {"z", 4}});
  // (points, limit): slices of 100 points; a short last slice of 1 point; a limit below one
  // record (12 bytes), which leaves slices of one point.
  for (auto [points, limit] : {std::pair{1000, 1200}, std::pair{1001, 1200}, std::pair{10, 8}}) {
    const Rect line = Rect::from_extents({points});
    for (auto [from, to] : {std::pair{"F,x", "x,F"}, std::pair{"x,F", "F,x"}}) {
      const std::string what = fmt::format("{} -> {}, {} points, limit {}", from, to, points, limit);
      std::vector<dma::TransferOp> ops;
      dma::append_tile_ops(line, xyz, dma::View::of_layout(Layout::parse(from), line, xyz, 0),
                           dma::View::of_layout(Layout::parse(to), line, xyz, 0), ops);
      ASSERT_EQ(ops.size(), 3u) << what << ": one strided op per field";
      const auto bytes = static_cast<std::size_t>(points) * 12;
      std::vector<std::byte> src(bytes);
      std::mt19937_64 rng(7);
      for (auto& b : src) b = static_cast<std::byte>(rng());
      const std::vector<std::byte> expected = run_ops(ops, src, bytes);
      std::vector<dma::TransferOp> cut = ops;
      const std::vector<std::size_t> ends = dma::cut_requests(cut, static_cast<std::uint64_t>(limit));
      const std::uint64_t per_slice = std::max<std::uint64_t>(static_cast<std::uint64_t>(limit) / 12, 1);
      ASSERT_EQ(cut.size(), 3 * ((static_cast<std::uint64_t>(points) + per_slice - 1) / per_slice)) << what;
      ASSERT_EQ(ends.size(), cut.size() / 3) << what << ": a request per slice";
      for (std::size_t k = 0; k < ends.size(); ++k) EXPECT_EQ(ends[k], 3 * (k + 1)) << what;
      const bool gather = std::string(from) == "F,x";
      for (std::size_t i = 0; i < cut.size(); i += 3) {
        EXPECT_LE(cut[i].count, per_slice) << what << ", slice " << i / 3;
        for (std::size_t f = 1; f < 3; ++f) {
          EXPECT_EQ(cut[i + f].count, cut[i].count) << what << ", slice " << i / 3;
          // The field's part of the same points: one field (4 bytes) or one field array past field 0's.
          const std::uint64_t array = static_cast<std::uint64_t>(points) * 4;
          EXPECT_EQ(cut[i + f].src, cut[i].src + f * (gather ? 4 : array))
              << what << ", slice " << i / 3 << " field " << f;
          EXPECT_EQ(cut[i + f].dst, cut[i].dst + f * (gather ? array : 4))
              << what << ", slice " << i / 3 << " field " << f;
        }
      }
      EXPECT_EQ(run_ops(cut, src, bytes), expected) << what;
    }
  }
}

// A 2-D conversion (rows apart) longer than a request: cut by row range, each request all fields
// of its rows; rows longer than a request are cut by element range, fields side by side. No
// request splits a group otherwise, and every cut moves the same bytes. Both forms of the rows:
// in the ops (one op per field, as the walker emits them) and one op per field and row.
TEST(RequestCuts, A2dConversionIsCutByRowsWithItsFieldsTogether) {
  const FieldSpace xyz({{"x", 4}, {"y", 4}, {"z", 4}});
  const Rect plane = Rect::from_extents({50, 20});  // rows of 50 points: 600 bytes of all fields
  for (auto [from, to, rows_in_ops] : {std::tuple{"F,x,y", "x,F,y", true}, std::tuple{"x,F,y", "F,x,y", true},
                                       std::tuple{"F,x,y", "x,F,y", false}, std::tuple{"x,F,y", "F,x,y", false}}) {
    std::vector<dma::TransferOp> ops;
    dma::append_tile_ops(plane, xyz, dma::View::of_layout(Layout::parse(from), plane, xyz, 0),
                         dma::View::of_layout(Layout::parse(to), plane, xyz, 0), ops);
    ASSERT_EQ(ops.size(), 3u) << from << " -> " << to << ": an op of 20 rows per field";
    if (!rows_in_ops) {
      std::vector<dma::TransferOp> by_row;
      for (const dma::TransferOp& op : ops)
        for (std::uint64_t r = 0; r < op.rows; ++r) by_row.push_back(op.row(r));
      ops = by_row;
    }
    ASSERT_EQ(dma::op_group_at(ops.data(), ops.size(), 0).size(), ops.size()) << from << " -> " << to;
    const std::size_t bytes = 50 * 20 * 12;
    std::vector<std::byte> src(bytes);
    std::mt19937_64 rng(11);
    for (auto& b : src) b = static_cast<std::byte>(rng());
    const std::vector<std::byte> expected = run_ops(ops, src, bytes);
    // (limit, rows per request): whole rows; one row per request; rows cut in three (200 bytes,
    // 16 points of the 50: 4 pieces a row).
    for (auto [limit, rows] : {std::pair{3000u, 5u}, std::pair{700u, 1u}, std::pair{200u, 0u}}) {
      const std::string what = fmt::format("{} -> {}, limit {}, {}", from, to, limit, rows_in_ops ? "rows in the ops" : "an op per row");
      std::vector<dma::TransferOp> cut = ops;
      const std::vector<std::size_t> ends = dma::cut_requests(cut, limit);
      ASSERT_FALSE(ends.empty()) << what;
      EXPECT_EQ(ends.back(), cut.size()) << what;
      std::size_t begin = 0;
      for (std::size_t end : ends) {
        std::uint64_t request_bytes = 0;
        for (std::size_t k = begin; k < end; ++k) request_bytes += cut[k].bytes();
        EXPECT_LE(request_bytes, limit) << what;
        const dma::OpGroup g = dma::op_group_at(cut.data() + begin, end - begin, 0);
        EXPECT_EQ(g.size(), end - begin) << what << ": a request is one group, request ending at " << end;
        EXPECT_EQ(g.members, 3u) << what << ": all fields together, request ending at " << end;
        if (rows > 0) {
          EXPECT_EQ(g.rows, rows) << what;
        } else {
          EXPECT_LE(cut[begin].count * 12, limit) << what;
        }
        begin = end;
      }
      const std::size_t expected_requests = rows > 0 ? 20 / rows : 20 * 4;
      EXPECT_EQ(ends.size(), expected_requests) << what;
      EXPECT_EQ(run_ops(cut, src, bytes), expected) << what;
    }
  }
}

TEST(RequestCuts, OpsWithinTheLimitStayWholeAndLongRunsAreCutToIt) {
  std::vector<dma::TransferOp> small{{0, 0, 100, 1, 0, 0}, {100, 100, 4, 50, 8, 4}};
  const auto before = small;
  EXPECT_TRUE(dma::cut_requests(small, 300).empty()) << "one request";
  ASSERT_EQ(small.size(), before.size());
  for (std::size_t i = 0; i < small.size(); ++i) EXPECT_EQ(small[i].bytes(), before[i].bytes());
  // More than the limit in all, each op (and a three-field group, 3 x 40 bytes) within it: whole.
  std::vector<dma::TransferOp> several{{0, 0, 100, 1, 0, 0},
                                       {100, 100, 4, 50, 8, 4},
                                       {1000, 2000, 4, 10, 12, 4},
                                       {1004, 2040, 4, 10, 12, 4},
                                       {1008, 2080, 4, 10, 12, 4}};
  ASSERT_EQ(dma::op_group_at(several.data(), several.size(), 2).members, 3u);
  const auto several_before = several;
  EXPECT_EQ(dma::cut_requests(several, 250), (std::vector<std::size_t>{1, 2, 5})) << "the group in one request";
  ASSERT_EQ(several.size(), several_before.size());
  for (std::size_t i = 0; i < several.size(); ++i) {
    EXPECT_EQ(several[i].src, several_before[i].src);
    EXPECT_EQ(several[i].count, several_before[i].count);
  }
  // A 10000-byte run and a strided op that starts no group: pieces of at most the limit.
  std::vector<dma::TransferOp> ops{{0, 0, 10000, 1, 0, 0}, {10000, 10000, 8, 500, 16, 8}};
  std::vector<std::byte> src(20000);
  std::iota(reinterpret_cast<unsigned char*>(src.data()), reinterpret_cast<unsigned char*>(src.data()) + src.size(), 0);
  const auto expected = run_ops(ops, src, 20000);
  const std::vector<std::size_t> ends = dma::cut_requests(ops, 1000);
  for (const auto& op : ops) EXPECT_LE(op.bytes(), 1000u);
  EXPECT_EQ(ends.size(), ops.size()) << "pieces of the limit: a request each";
  EXPECT_EQ(std::accumulate(ops.begin(), ops.end(), std::uint64_t{0},
                            [](std::uint64_t a, const auto& o) { return a + o.bytes(); }),
            14000u);
  EXPECT_EQ(run_ops(ops, src, 20000), expected);
}

}  // namespace
}  // namespace caravan
