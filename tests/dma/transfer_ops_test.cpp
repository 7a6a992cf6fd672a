// The op generator and tiling, checked against per-element offsets computed directly.
#include "runtime/dma/channel.h"
#include "runtime/dma/interleave.h"
#include "runtime/dma/transfer_ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>

namespace caravan::dma {
namespace {

// Applies the ops of `tile` (all of `space` by default) as a map src offset -> dst offset per
// byte, and checks it against the layouts of `space`. Returns the number of ops.
std::size_t check_ops(const Rect& space, const FieldSpace& fields, const Layout& a, const Layout& b,
                      std::optional<Rect> part = std::nullopt) {
  const Rect tile = part.value_or(space);
  View src = View::of_layout(a, space, fields, 0), dst = View::of_layout(b, space, fields, 0);
  std::vector<TransferOp> ops;
  append_tile_ops(tile, fields, src, dst, ops);
  std::map<std::uint64_t, std::uint64_t> moved;  // dst byte -> src byte
  std::uint64_t bytes = 0;
  for (const auto& rows : ops) {
    for (std::uint64_t r = 0; r < rows.rows; ++r) {
      const TransferOp op = rows.row(r);
      for (std::uint64_t i = 0; i < op.count; ++i)
        for (std::uint64_t k = 0; k < op.elem; ++k) {
          auto s = static_cast<std::uint64_t>(static_cast<std::int64_t>(op.src) + static_cast<std::int64_t>(i) * op.src_stride) + k;
          auto d = static_cast<std::uint64_t>(static_cast<std::int64_t>(op.dst) + static_cast<std::int64_t>(i) * op.dst_stride) + k;
            EXPECT_TRUE(moved.emplace(d, s).second) << "dst byte " << d << " written twice";
          ++bytes;
        }
    }
  }
  EXPECT_EQ(bytes, tile.volume() * fields.total_size()) << a.to_string() << " -> " << b.to_string();
  Linearization la(a, space, fields), lb(b, space, fields);
  Point p = tile.lo();
  for (;;) {
    for (std::size_t f = 0; f < fields.count(); ++f)
      for (std::uint64_t k = 0; k < fields.fields()[f].size; ++k) {
        auto it = moved.find(lb.offset(p, f) + k);
        if (it == moved.end()) {
          ADD_FAILURE() << a.to_string() << " -> " << b.to_string() << ": a byte of the tile not written";
          return ops.size();
        }
        if (it->second != la.offset(p, f) + k) {
          ADD_FAILURE() << a.to_string() << " -> " << b.to_string() << ": a byte from the wrong place";
          return ops.size();
        }
      }
    int d = 0;
    for (; d < tile.dims(); ++d) {
      auto i = static_cast<std::size_t>(d);
      if (p[i] < tile.hi()[i]) {
        ++p[i];
        break;
      }
      p[i] = tile.lo()[i];
    }
    if (d == tile.dims()) break;
  }
  return ops.size();
}

TEST(TransferOps, EveryByteLandsWhereTheLayoutsSay) {
  FieldSpace fields({{"a", 4}, {"b", 8}, {"c", 2}});
  for (auto [a, b] : std::vector<std::pair<const char*, const char*>>{
           {"F,x", "F,x"}, {"F,x", "x,F"}, {"x,F", "x_in=4,F,x_out"}, {"x_in=3,F,x_out", "F,x"}, {"x_in=4,F,x_out", "x_in=3,F,x_out"}})
    check_ops(Rect::from_extents({23}), fields, Layout::parse(a), Layout::parse(b));
  for (auto [a, b] : std::vector<std::pair<const char*, const char*>>{
           {"F,x,y", "F,y,x"}, {"x,y,F", "F,x,y"}, {"x_in=4,y_in=3,x_out,y_out,F", "y,x,F"}, {"F,x_in=2,x_out,y", "x_in=3,F,y,x_out"}})
    check_ops(Rect::from_extents({7, 5}), fields, Layout::parse(a), Layout::parse(b));
}

// Tiles inside a larger instance (rows apart on both sides) and 3-D tiles: every byte lands where
// the layouts say, and where no view is blocked a tile is one op per op of its first row and
// plane, its rows held by the ops (or fewer, where they continue each other).
TEST(TransferOps, SubTilesAndThreeDimensionsWithRowsInTheOps) {
  FieldSpace fields({{"a", 4}, {"b", 8}, {"c", 2}});
  const Rect plane = Rect::from_extents({9, 7});
  const Rect part(2, Point{2, 1}, Point{6, 5});  // 5 x 5 of the 9 x 7
  for (auto [a, b] : std::vector<std::pair<const char*, const char*>>{
           {"F,x,y", "F,x,y"}, {"F,x,y", "x,F,y"}, {"x,y,F", "F,x,y"}, {"y,x,F", "x,y,F"}, {"F,y,x", "x,F,y"}}) {
    const std::size_t ops = check_ops(plane, fields, Layout::parse(a), Layout::parse(b), part);
    EXPECT_LE(ops, fields.count()) << a << " -> " << b << ": one op (of rows) per field at most";
  }
  // A blocked view keeps one op per row (or more): still every byte right.
  check_ops(plane, fields, Layout::parse("x_in=4,F,x_out,y"), Layout::parse("F,x,y"), part);
  const Rect box = Rect::from_extents({6, 5, 4});
  const Rect inner(3, Point{1, 1, 1}, Point{4, 3, 2});  // 4 x 3 x 2
  for (auto [a, b] : std::vector<std::pair<const char*, const char*>>{
           {"F,x,y,z", "x,F,y,z"}, {"x,y,z,F", "F,z,y,x"}, {"F,x,y,z", "F,x,y,z"}, {"z,x,F,y", "F,x,y,z"}}) {
    check_ops(box, fields, Layout::parse(a), Layout::parse(b));
    const std::size_t ops = check_ops(box, fields, Layout::parse(a), Layout::parse(b), inner);
    // The row and the rows take two of the tile's dimensions (4, 3, 2); per field one op of
    // rows for each coordinate of the third, at most 3.
    EXPECT_LE(ops, fields.count() * 3) << a << " -> " << b << ": per field, one op of rows per plane at most";
  }
}

// A 3-D sub-box of a conversion: each plane's fields sit next to each other in the op list,
// where they interleave on one side, so that a plane's fields form one group of ops of rows
// (op_group_at) instead of moving one field at a time (each field's planes came one after
// another before: six groups of one op here). Where no side interleaves, nothing groups and the
// order stays as it was. Every byte is checked against the layouts (check_ops).
TEST(TransferOps, ThreeDimensionalSubBoxesGroupEachPlanesFields) {
  FieldSpace fields({{"a", 4}, {"b", 4}, {"c", 4}});
  const Rect box = Rect::from_extents({6, 5, 4});
  const Rect inner(3, Point{1, 1, 1}, Point{4, 3, 2});  // 4 x 3 x 2: two planes of 3 rows of 4
  struct Case {
    const char *a, *b;
    std::size_t groups, members;  // expected: groups in the tile's op list, fields in each
  };
  for (const Case& c : {Case{"F,x,y,z", "x,F,y,z", 2, 3}, Case{"x,F,y,z", "F,x,y,z", 2, 3},
                        Case{"x,y,z,F", "F,x,y,z", 2, 3}, Case{"F,x,y,z", "F,z,y,x", 3, 1}}) {
    SCOPED_TRACE(std::string(c.a) + " -> " + c.b);
    const std::size_t n = check_ops(box, fields, Layout::parse(c.a), Layout::parse(c.b), inner);
    View src = View::of_layout(Layout::parse(c.a), box, fields, 0), dst = View::of_layout(Layout::parse(c.b), box, fields, 0);
    std::vector<TransferOp> ops;
    append_tile_ops(inner, fields, src, dst, ops);
    ASSERT_EQ(ops.size(), n);
    std::size_t groups = 0;
    for (std::size_t i = 0; i < ops.size(); ++groups) {
      const OpGroup g = op_group_at(ops.data(), ops.size(), i);
      EXPECT_EQ(g.members, c.members) << "group at op " << i;
      i += g.size();
    }
    EXPECT_EQ(groups, c.groups);
  }
  // Where the fields interleave on neither side (fields outermost on both), the order stays field
  // by field: the first two planes' ops are field a's, before field b's array.
  {
    const Layout soa_a = Layout::parse("x,y,z,F"), soa_b = Layout::parse("x,z,y,F");
    check_ops(box, fields, soa_a, soa_b, inner);
    View src = View::of_layout(soa_a, box, fields, 0), dst = View::of_layout(soa_b, box, fields, 0);
    std::vector<TransferOp> ops;
    append_tile_ops(inner, fields, src, dst, ops);
    ASSERT_EQ(ops.size(), 6u);  // three fields by two planes
    const std::uint64_t field_b = src.offset(box.lo(), 1);
    EXPECT_LT(ops[0].src, field_b);
    EXPECT_LT(ops[1].src, field_b) << "a field's planes stay together where no side interleaves";
  }
  // Fields of different sizes never group: the order stays field by field.
  {
    FieldSpace mixed({{"a", 4}, {"b", 8}, {"c", 4}});
    const Layout aos = Layout::parse("F,x,y,z"), other = Layout::parse("x,F,z,y");
    check_ops(box, mixed, aos, other, inner);
    View src = View::of_layout(aos, box, mixed, 0), dst = View::of_layout(other, box, mixed, 0);
    std::vector<TransferOp> ops;
    append_tile_ops(inner, mixed, src, dst, ops);
    ASSERT_EQ(ops.size(), 6u);
    EXPECT_EQ(ops[0].elem, ops[1].elem) << "field a's two planes first";
    EXPECT_EQ(ops[2].elem, 8u);
  }
  // Two tiles appended to one list: each tile's planes are grouped within that tile.
  {
    const Layout a = Layout::parse("F,x,y,z"), b = Layout::parse("x,F,y,z");
    View src = View::of_layout(a, box, fields, 0), dst = View::of_layout(b, box, fields, 0);
    const Rect other(3, Point{0, 1, 2}, Point{3, 3, 3});  // another 4 x 3 x 2 sub-box
    std::vector<TransferOp> ops;
    append_tile_ops(inner, fields, src, dst, ops);
    const std::size_t first_tile = ops.size();
    append_tile_ops(other, fields, src, dst, ops);
    std::size_t groups = 0;
    for (std::size_t i = 0; i < ops.size(); ++groups) {
      const OpGroup g = op_group_at(ops.data(), ops.size(), i);
      EXPECT_EQ(g.members, 3u) << "group at op " << i << " (the second tile starts at " << first_tile << ")";
      i += g.size();
    }
    EXPECT_EQ(groups, 4u);
  }
}

TEST(TransferOps, IdenticalLayoutsBecomeOneRun) {
  FieldSpace fields({{"a", 4}, {"b", 8}});
  Rect space = Rect::from_extents({100, 30});
  for (const char* l : {"F,x,y", "x,y,F"}) {
    std::vector<TransferOp> ops;
    Layout layout = Layout::parse(l);
    View v = View::of_layout(layout, space, fields, 0);
    append_tile_ops(space, fields, v, v, ops);
    // AOS: one run. SOA: one run per field, and the field arrays are adjacent, so one run too.
    ASSERT_EQ(ops.size(), 1u) << l;
    EXPECT_EQ(ops[0].bytes(), space.volume() * fields.total_size());
  }
}

TEST(TransferOps, TilesCoverTheSpaceOnce) {
  for (auto extents : std::vector<std::vector<std::int64_t>>{{1000}, {37, 11}, {5, 6, 7}, {3, 1, 4, 2}}) {
    Rect space = Rect::from_extents(extents);
    for (std::uint64_t target : {1ull, 7ull, 50ull, 100000ull}) {
      TileGrid grid(space, target);
      std::set<Point> seen;
      for (std::uint64_t t = 0; t < grid.count(); ++t) {
        Rect tile = grid.tile(t);
        EXPECT_LE(tile.volume(), std::max<std::uint64_t>(target, 1)) << space.to_string();
        EXPECT_LE(tile.volume(), grid.largest().volume());
        Point p = tile.lo();
        for (;;) {
          ASSERT_TRUE(space.contains(p));
          ASSERT_TRUE(seen.insert(p).second) << "a point is in two tiles of " << space.to_string();
          int d = 0;
          for (; d < tile.dims(); ++d) {
            auto i = static_cast<std::size_t>(d);
            if (p[i] < tile.hi()[i]) {
              ++p[i];
              break;
            }
            p[i] = tile.lo()[i];
          }
          if (d == tile.dims()) break;
        }
      }
      EXPECT_EQ(seen.size(), space.volume()) << space.to_string() << " target " << target;
    }
  }
}

}  // namespace
}  // namespace caravan::dma

namespace caravan::dma {
namespace {

// The streaming path for long runs must copy exactly what memcpy copies, at any alignment and
// length: the head before the first aligned line, whole groups of interleaved pages (32 KiB),
// the lines after the last group and the tail.
TEST(HostOps, StreamedRunsMatchMemcpyAtAnyAlignment) {
  std::vector<std::byte> src(1 << 18), dst(1 << 18), expected(1 << 18);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 131 + 7) & 0xff);
  for (std::uint64_t src_off : {0u, 1u, 15u, 64u}) {
    for (std::uint64_t dst_off : {0u, 3u, 16u, 33u}) {
      for (std::uint64_t length : {0u, 1u, 63u, 64u, 200u, 4097u, 30000u, 32768u, 32768u + 4097u, 3u * 32768u + 100u, 200000u}) {
        std::fill(dst.begin(), dst.end(), std::byte{0xEE});
        expected = dst;
        std::memcpy(expected.data() + dst_off, src.data() + src_off, length);
        TransferOp op{src_off, dst_off, length, 1, 0, 0};
        copy_host_ops(std::span<const TransferOp>(&op, 1), src.data(), dst.data(), /*stream_bytes=*/1);
        ASSERT_EQ(dst, expected) << "src+" << src_off << " dst+" << dst_off << " length " << length;
      }
    }
  }
}

// Groups (a conversion's fields, moved element by element or in blocks; rows) copy exactly what
// their ops copy one element at a time: random groups of every element size, 1-D and 2-D, fields
// by rows and rows by fields, gathers and scatters, each into its own part of a poisoned
// destination, next to lone strided ops and runs.
TEST(HostOps, GroupsCopyWhatTheirOpsCopyElementByElement) {
  constexpr std::uint64_t kPart = 64 << 10;
  std::mt19937_64 rng(20261127);
  auto pick = [&](std::uint64_t lo, std::uint64_t hi) { return lo + rng() % (hi - lo + 1); };
  for (int round = 0; round < 40; ++round) {
    std::vector<TransferOp> ops;
    std::uint64_t at = 0;
    std::size_t grouped = 0;
    for (int part = 0; part < 6; ++part, at += kPart) {
      const std::uint64_t elems[] = {1, 2, 4, 8, 12, 16};
      const std::uint64_t e = elems[rng() % 6], fields = pick(1, 10), record = fields * e + pick(0, 1) * e;
      const std::uint64_t rows = pick(1, 6), gap = pick(0, 2) * e;
      std::uint64_t count = pick(1, 700);
      while (count > 1 && rows * (count * record + gap) > kPart) count /= 2;
      const bool gather = rng() % 2 == 0;
      const int arrangement = static_cast<int>(rng() % 3);  // field major, row major, rows in the ops
      std::vector<TransferOp> by_row;
      for (std::uint64_t r = 0; r < rows; ++r)
        for (std::uint64_t f = 0; f < fields; ++f) {
          const std::uint64_t interleaved = r * (count * record + gap) + f * e, array = (f * rows + r) * count * e;
          const auto rs = static_cast<std::int64_t>(record), es = static_cast<std::int64_t>(e);
          if (gather) by_row.push_back({at + interleaved, at + array, e, count, rs, es});
          else by_row.push_back({at + array, at + interleaved, e, count, es, rs});
        }
      const std::size_t first = ops.size();
      if (arrangement == 0) {
        for (std::uint64_t f = 0; f < fields; ++f)
          for (std::uint64_t r = 0; r < rows; ++r) ops.push_back(by_row[r * fields + f]);
      } else if (arrangement == 2) {
        for (std::uint64_t f = 0; f < fields; ++f) {
          TransferOp op = by_row[f];
          op.rows = rows;
          if (rows > 1) {
            op.src_row_stride = static_cast<std::int64_t>(by_row[fields + f].src - op.src);
            op.dst_row_stride = static_cast<std::int64_t>(by_row[fields + f].dst - op.dst);
          }
          ops.push_back(op);
        }
      } else {
        ops.insert(ops.end(), by_row.begin(), by_row.end());
      }
      if (op_group_at(ops.data(), ops.size(), first).members > 1) ++grouped;
    }
    ops.push_back({7, at, 1000, 1, 0, 0});  // a run after the groups
    const std::uint64_t bytes = at + 1000;
    std::vector<std::byte> src(bytes), got(bytes, std::byte{0xAB});
    for (auto& b : src) b = static_cast<std::byte>(rng());
    std::vector<std::byte> expected = got;
    for (const TransferOp& op : ops)
      for (std::uint64_t r = 0; r < op.rows; ++r)
        for (std::uint64_t i = 0; i < op.count; ++i)
          std::memcpy(expected.data() + op.dst + static_cast<std::int64_t>(r) * op.dst_row_stride +
                          static_cast<std::int64_t>(i) * op.dst_stride,
                      src.data() + op.src + static_cast<std::int64_t>(r) * op.src_row_stride +
                          static_cast<std::int64_t>(i) * op.src_stride,
                      op.elem);
    copy_host_ops(ops, src.data(), got.data());
    ASSERT_EQ(got, expected) << "round " << round;
    if (round == 0) {
      EXPECT_GT(grouped, 0u) << "the random parts include groups";
    }
  }
}

// Every store width this CPU has, in both orders, copies the same bytes (the run-time choice
// takes the fastest of them and memcpy).
TEST(HostOps, EveryStreamingStoreWidthAndOrderMatchesMemcpy) {
  std::vector<std::byte> src(300000), dst(src.size()), expected(src.size());
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 37 + 11) & 0xff);
  int ran = 0;
  for (const char* isa : {"sse2", "avx2", "avx512"}) {
    for (bool interleave : {true, false}) {
      for (std::uint64_t offset : {0u, 5u, 64u}) {
        for (std::uint64_t length : {100u, 32768u + 130u, 250000u}) {
          std::fill(dst.begin(), dst.end(), std::byte{0x11});
          expected = dst;
          std::memcpy(expected.data() + offset, src.data() + 3, length);
          if (!stream_copy_using(isa, interleave, dst.data() + offset, src.data() + 3, length)) continue;
          ++ran;
          ASSERT_EQ(dst, expected) << isa << (interleave ? " interleaved" : " front to back") << " dst+" << offset
                                   << " length " << length;
        }
      }
    }
  }
  EXPECT_GE(ran, 18) << "SSE2 is always there on x86-64";
  EXPECT_NE(std::string_view(stream_copy_method()).find("measured"), std::string_view::npos) << stream_copy_method();
}

}  // namespace
}  // namespace caravan::dma

namespace caravan::dma {
namespace {

// Cutting an op into pieces keeps every element exactly once, in order; an op of several rows is
// cut at whole rows.
TEST(TransferOps, SplitFrontKeepsEveryElementOnce) {
  for (TransferOp whole : {TransferOp{10, 1000, 5000, 1, 0, 0}, TransferOp{8, 4096, 8, 700, 24, -16},
                           TransferOp{8, 40000, 8, 50, 24, -16, 10, 2000, 1000}, TransferOp{0, 0, 300, 1, 0, 0, 9, 400, 300}}) {
    std::vector<std::pair<std::int64_t, std::int64_t>> expected, got;  // (src, dst) of each byte
    auto bytes_of = [](const TransferOp& op, auto& out) {
      for (std::uint64_t r = 0; r < op.rows; ++r)
        for (std::uint64_t i = 0; i < op.count; ++i)
          for (std::uint64_t k = 0; k < op.elem; ++k) {
            const auto ri = static_cast<std::int64_t>(r), ii = static_cast<std::int64_t>(i), ki = static_cast<std::int64_t>(k);
            out.emplace_back(static_cast<std::int64_t>(op.src) + ri * op.src_row_stride + ii * op.src_stride + ki,
                             static_cast<std::int64_t>(op.dst) + ri * op.dst_row_stride + ii * op.dst_stride + ki);
          }
    };
    bytes_of(whole, expected);
    TransferOp rest = whole;
    while (rest.bytes() > 1000) {
      TransferOp head = split_front(rest, 1000);
      EXPECT_LE(head.bytes(), 1000u);
      if (whole.rows > 1) {
        EXPECT_EQ(head.bytes() % whole.row_bytes(), 0u) << "whole rows";
      }
      EXPECT_GT(head.bytes(), 0u);
      bytes_of(head, got);
    }
    bytes_of(rest, got);
    EXPECT_EQ(got, expected);
  }
}

// Which ops form a group (the fields of a layout conversion, moved together; rows).
TEST(OpGroups, FieldsOfAConversionGroupOnTheirInterleavedSide) {
  const FieldSpace xyz({{"x", 4}, {"y", 4}, {"z", 4}});
  const Rect line = Rect::from_extents({64});
  for (auto [from, to] : {std::pair{"F,x", "x,F"}, std::pair{"x,F", "F,x"}}) {
    std::vector<TransferOp> ops;
    append_tile_ops(line, xyz, View::of_layout(Layout::parse(from), line, xyz, 0),
                    View::of_layout(Layout::parse(to), line, xyz, 0), ops);
    ASSERT_EQ(ops.size(), 3u);
    const OpGroup g = op_group_at(ops.data(), ops.size(), 0);
    EXPECT_EQ(g.members, 3u) << from << " -> " << to;
    EXPECT_EQ(g.rows, 1u) << from << " -> " << to;
    EXPECT_EQ(g.member_index, 1u);
    EXPECT_EQ(op_group_at(ops.data(), ops.size(), 1).members, 2u) << "a group may start at any member";
  }
  // Four 4-byte fields in a 12-byte record cannot all interleave: the group stops at three.
  std::vector<TransferOp> four{
      {0, 0, 4, 10, 12, 4}, {4, 40, 4, 10, 12, 4}, {8, 80, 4, 10, 12, 4}, {12, 120, 4, 10, 12, 4}};
  EXPECT_EQ(op_group_at(four.data(), four.size(), 0).size(), 3u);
  // Neither side steps by one element: rows of one member, as many as keep one distance.
  std::vector<TransferOp> apart{{0, 0, 4, 10, 12, 4}, {8, 40, 4, 10, 12, 4}, {16, 80, 4, 10, 12, 4}, {20, 0, 4, 10, 12, 4}};
  OpGroup rows = op_group_at(apart.data(), apart.size(), 0);
  EXPECT_EQ(rows.members, 1u);
  EXPECT_EQ(rows.rows, 3u);
  EXPECT_EQ(rows.row_src, 8);
  EXPECT_EQ(rows.row_dst, 40);
  // Other shapes: no group.
  std::vector<TransferOp> counts{{0, 0, 4, 10, 12, 4}, {4, 40, 4, 9, 12, 4}};
  EXPECT_EQ(op_group_at(counts.data(), counts.size(), 0).size(), 1u);
  // Contiguous runs (count 1) never interleave: at one distance they are rows.
  std::vector<TransferOp> runs{{0, 0, 64, 1, 0, 0}, {100, 64, 64, 1, 0, 0}};
  EXPECT_EQ(op_group_at(runs.data(), runs.size(), 0).members, 1u);
  EXPECT_EQ(op_group_at(runs.data(), runs.size(), 0).rows, 2u);
}

// Checks that group g at ops[first] names exactly the ops it spans.
void expect_group_names_its_ops(const std::vector<TransferOp>& ops, std::size_t first, const OpGroup& g,
                                const std::string& what) {
  const TransferOp& lead = ops[first];
  for (std::size_t m = 0; m < g.members; ++m)
    for (std::size_t r = 0; r < g.rows; ++r) {
      ASSERT_LT(first + m * g.member_index + r * g.row_index, ops.size()) << what;
      const TransferOp o = group_row(ops.data(), first, g, m, r);
      EXPECT_EQ(o.rows, 1u) << what;
      const auto mi = static_cast<std::int64_t>(m), ri = static_cast<std::int64_t>(r);
      EXPECT_EQ(static_cast<std::int64_t>(o.src - lead.src), mi * g.member_src + ri * g.row_src) << what << " member " << m << " row " << r;
      EXPECT_EQ(static_cast<std::int64_t>(o.dst - lead.dst), mi * g.member_dst + ri * g.row_dst) << what << " member " << m << " row " << r;
      EXPECT_EQ(o.count, lead.count) << what;
    }
}

// A 2-D conversion whose rows are apart: the walker emits one op of all rows per field, and the
// whole tile is one group of the fields (members) by the rows. The same rows as one op each,
// field after field (what the walker emits where a view is blocked), are the same group.
TEST(OpGroups, A2dConversionWithRowsApartIsOneGroupOfFieldsByRows) {
  const FieldSpace xyz({{"x", 4}, {"y", 4}, {"z", 4}});
  const Rect plane = Rect::from_extents({40, 9});
  for (auto [from, to] : {std::pair{"F,x,y", "x,F,y"}, std::pair{"x,F,y", "F,x,y"}}) {
    const std::string what = std::string(from) + " -> " + to;
    std::vector<TransferOp> ops;
    append_tile_ops(plane, xyz, View::of_layout(Layout::parse(from), plane, xyz, 0),
                    View::of_layout(Layout::parse(to), plane, xyz, 0), ops);
    ASSERT_EQ(ops.size(), 3u) << what << ": one op of 9 rows per field";
    const OpGroup g = op_group_at(ops.data(), ops.size(), 0);
    EXPECT_EQ(g.members, 3u) << what;
    EXPECT_EQ(g.size(), ops.size()) << what << ": one group for the tile";
    EXPECT_EQ(g.rows, 9u) << what;
    EXPECT_EQ(g.row_index, 0u) << what << ": the rows are in the ops";
    expect_group_names_its_ops(ops, 0, g, what);
    std::vector<TransferOp> by_row;
    for (const TransferOp& op : ops)
      for (std::uint64_t r = 0; r < op.rows; ++r) by_row.push_back(op.row(r));
    const OpGroup h = op_group_at(by_row.data(), by_row.size(), 0);
    EXPECT_EQ(h.members, 3u) << what;
    EXPECT_EQ(h.size(), by_row.size()) << what;
    EXPECT_EQ(h.rows, 9u) << what;
    EXPECT_EQ(h.member_index, 9u) << what << ": field by field";
    EXPECT_EQ(h.row_src, g.row_src) << what;
    EXPECT_EQ(h.member_dst, g.member_dst) << what;
    expect_group_names_its_ops(by_row, 0, h, what + ", one op per row");
  }
  // The same rows with the fields of each row next to each other: the members are consecutive.
  std::vector<TransferOp> row_major;
  for (std::uint64_t r = 0; r < 5; ++r)
    for (std::uint64_t f = 0; f < 3; ++f) row_major.push_back({r * 1200 + 4 * f, r * 300 + f * 5000, 4, 75, 12, 4});
  const OpGroup g = op_group_at(row_major.data(), row_major.size(), 0);
  EXPECT_EQ(g.members, 3u);
  EXPECT_EQ(g.rows, 5u);
  EXPECT_EQ(g.member_index, 1u);
  EXPECT_EQ(g.row_index, 3u);
  expect_group_names_its_ops(row_major, 0, g, "row by row");
}

// A fill of an AOS instance needs no group: the pattern is one record of the fields in order,
// so the fill is one op of whole records, read again for every point (source stride 0).
TEST(OpGroups, AFillOfRecordsIsOneOpOfWholeRecords) {
  const FieldSpace xyz({{"x", 4}, {"y", 4}, {"z", 4}});
  const Rect line = Rect::from_extents({64});
  std::vector<TransferOp> ops;
  append_tile_ops(line, xyz, View::pattern(xyz), View::of_layout(Layout::parse("F,x"), line, xyz, 0), ops);
  ASSERT_EQ(ops.size(), 1u);
  EXPECT_EQ(ops[0].elem, 12u);
  EXPECT_EQ(ops[0].src_stride, 0);
  EXPECT_EQ(ops[0].count, 64u);
}

}  // namespace
}  // namespace caravan::dma
