// The data model: layout text, validation, linearization (checked point by point against the
// definitions), PREFIX / SUFFIX-bar / TOTAL.
#include <caravan/error.h>
#include <caravan/layout.h>

#include <gtest/gtest.h>

#include <set>
#include <stdexcept>

namespace caravan {
namespace {

Layout L(const char* text) { return Layout::parse(text); }

// Expects `fn` to throw Error(invalid_argument) with `fragment` in its message.
template <typename Fn>
void expect_invalid(Fn fn, const std::string& fragment) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one saying: " << fragment;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << "message was: " << e.what();
  }
}

TEST(Layout, ParsesAndPrintsTheFigure2Layouts) {
  for (const char* text : {"F,x", "x,F", "x_in=4,F,x_out", "F,x,y", "F,y,x", "x_in=3,y_in=3,x_out,y_out,F", "F,x_in=4,x_out"})
    EXPECT_EQ(L(text).to_string(), text);
  EXPECT_EQ(L(" < F , x_in = 4 , x_out > ").to_string(), "F,x_in=4,x_out");
  EXPECT_EQ(Layout::aos(2).to_string(), "F,x,y");
  EXPECT_EQ(Layout::soa(1).to_string(), "x,F");
  EXPECT_EQ(Layout::hybrid(4).to_string(), "x_in=4,F,x_out");
}

TEST(Layout, RejectsBadTextWithTheComponent) {
  auto expect_error = [](const char* text, const char* fragment) {
    try {
      Layout::parse(text);
      ADD_FAILURE() << "parsed '" << text << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_error("F,q", "unknown component 'q'");
  expect_error("F,x_in", "needs a block size");
  expect_error("F,x_in=0,x_out", "positive integer");
  expect_error("F,x,x", "appears twice");
  expect_error("", "empty");
  expect_error("F,,x", "empty component");
}

TEST(Layout, ValidatesAgainstTheIndexSpace) {
  EXPECT_NO_THROW(L("F,x,y").validate(2));
  EXPECT_NO_THROW(L("x_in=3,y_in=3,x_out,y_out,F").validate(2));
  auto message = [](const char* text, int dims) {
    try {
      Layout::parse(text).validate(dims, "dst layout");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message("F,y,x", 1).find("dimension y is not in the index space (x)"), std::string::npos);
  EXPECT_NE(message("x,y", 2).find("F must appear exactly once"), std::string::npos);
  EXPECT_NE(message("F,x", 2).find("dimension y is missing"), std::string::npos);
  EXPECT_NE(message("F,x_in=2,y", 2).find("either whole"), std::string::npos);
  EXPECT_NE(message("F,x,x_out,y", 2).find("either whole"), std::string::npos);
  EXPECT_NE(message("F,y,x", 1).find("dst layout 'F,y,x'"), std::string::npos);
}

TEST(MemoryModel, RectAndFieldSpace) {
  Rect r = Rect::from_extents({10, 5});
  EXPECT_EQ(r.volume(), 50u);
  EXPECT_EQ(r.to_string(), "[0,9]x[0,4]");
  EXPECT_THROW(Rect::from_extents({}), Error);
  EXPECT_THROW(Rect::from_extents({1, 2, 3, 4, 5}), Error);
  EXPECT_THROW(Rect::from_extents({0}), Error);
  FieldSpace f({{"re", 8}, {"im", 8}, {"tag", 4}});
  EXPECT_EQ(f.total_size(), 20u);
  EXPECT_EQ(f.offset(2), 16u);
  EXPECT_EQ(f.min_size(), 4u);
  EXPECT_EQ(f.index_of("im"), 1u);
  EXPECT_THROW(FieldSpace({{"a", 4}, {"a", 4}}), Error);
  EXPECT_THROW(FieldSpace({{"a", 0}}), Error);
}

// Field spaces are immutable and copies share their field list: a copy, and one made apart
// from the same fields, are equal; the empty one has no fields and no offsets.
TEST(MemoryModel, FieldSpaceCopiesAndEquality) {
  FieldSpace f({{"re", 8}, {"im", 8}});
  FieldSpace copy = f;
  EXPECT_EQ(copy, f);
  EXPECT_EQ(copy.fields().size(), 2u);
  EXPECT_EQ(copy.fields()[1].name, "im");
  EXPECT_EQ(copy.offset(1), 8u);
  EXPECT_EQ(FieldSpace({{"re", 8}, {"im", 8}}), f);
  EXPECT_FALSE(FieldSpace({{"re", 8}, {"im", 4}}) == f);
  EXPECT_FALSE(FieldSpace({{"re", 8}, {"IM", 8}}) == f);
  FieldSpace none;
  EXPECT_EQ(none.count(), 0u);
  EXPECT_EQ(none.total_size(), 0u);
  EXPECT_THROW(none.offset(0), Error);
  expect_invalid([&] { (void)f.offset(2); }, "field index 2 past its 2 fields");
  EXPECT_FALSE(none == f);
  copy = none;
  EXPECT_EQ(copy.count(), 0u);
  EXPECT_EQ(f.count(), 2u) << "assigning to a copy leaves the original";
}

// Offsets straight from the definition: the layout is a mixed-radix number, densest first, in
// which F contributes the byte offset inside a point's record when it comes first, and
// otherwise selects the block of one field's values.
TEST(Linearization, AosSoaHybridAsInFigure2) {
  IndexSpace s = Rect::from_extents({8});
  FieldSpace f({{"a", 4}, {"b", 8}});  // |F| = 12
  Linearization aos(L("F,x"), s, f), soa(L("x,F"), s, f), hyb(L("x_in=4,F,x_out"), s, f);
  for (std::int64_t x = 0; x < 8; ++x) {
    auto ux = static_cast<std::uint64_t>(x);
    EXPECT_EQ(aos.offset({x}, 0), ux * 12);
    EXPECT_EQ(aos.offset({x}, 1), ux * 12 + 4);
    EXPECT_EQ(soa.offset({x}, 0), ux * 4);
    EXPECT_EQ(soa.offset({x}, 1), 8 * 4 + ux * 8);
    EXPECT_EQ(hyb.offset({x}, 0), (ux / 4) * 48 + (ux % 4) * 4);
    EXPECT_EQ(hyb.offset({x}, 1), (ux / 4) * 48 + 16 + (ux % 4) * 8);
  }
  EXPECT_EQ(aos.total_bytes(), 96u);
  EXPECT_EQ(hyb.total_bytes(), 96u);
}

TEST(Linearization, RowColumnAndBlocked2D) {
  IndexSpace s = Rect::from_extents({6, 6});
  FieldSpace f = FieldSpace::uniform(1, 4);
  Linearization row(L("F,x,y"), s, f), col(L("F,y,x"), s, f), blk(L("x_in=3,y_in=3,x_out,y_out,F"), s, f);
  for (std::int64_t y = 0; y < 6; ++y)
    for (std::int64_t x = 0; x < 6; ++x) {
      auto ux = static_cast<std::uint64_t>(x), uy = static_cast<std::uint64_t>(y);
      EXPECT_EQ(row.offset({x, y}, 0), (uy * 6 + ux) * 4);
      EXPECT_EQ(col.offset({x, y}, 0), (ux * 6 + uy) * 4);
      std::uint64_t block = (uy / 3) * 2 + ux / 3;
      EXPECT_EQ(blk.offset({x, y}, 0), (block * 9 + (uy % 3) * 3 + ux % 3) * 4);
    }
}

TEST(Linearization, EveryLayoutIsABijectionIntoItsFootprint) {
  // Including extents the block does not divide: the last block is padded.
  IndexSpace s = Rect::from_extents({7, 5});
  FieldSpace f({{"a", 2}, {"b", 4}, {"c", 2}});
  for (const char* text : {"F,x,y", "y,F,x", "x_in=3,F,x_out,y", "x_in=2,y_in=2,F,y_out,x_out", "y_out,x,F,y_in=4", "x_out,y,x_in=4,F"}) {
    Layout l = L(text);
    Linearization lin(l, s, f);
    std::set<std::uint64_t> bytes;
    for (std::int64_t y = 0; y < 5; ++y)
      for (std::int64_t x = 0; x < 7; ++x)
        for (std::size_t field = 0; field < 3; ++field) {
          std::uint64_t off = lin.offset({x, y}, field);
          for (std::uint32_t b = 0; b < f.fields()[field].size; ++b) {
            EXPECT_TRUE(bytes.insert(off + b).second) << text << " overlaps at " << off + b;
            EXPECT_LT(off + b, lin.total_bytes()) << text;
          }
        }
    EXPECT_EQ(lin.total_bytes(), total_bytes(l, s, f)) << text;
  }
  // 7 = 3 + 3 + 1: ceil(7/3) = 3 blocks, 2 padding columns per row.
  EXPECT_EQ(total_bytes(L("x_in=3,F,x_out,y"), s, f), 3u * 3 * 8 * 5);
}

TEST(PrefixSuffix, Table3Values) {
  // Section 4.3 with x_in = 4, y_in = 2 on an 8 x 8 instance, |F| = 16.
  IndexSpace s = Rect::from_extents({8, 8});
  FieldSpace f = FieldSpace::uniform(4, 4);
  Layout l0 = L("F,x,y"), l1 = L("F,x_in=4,y_in=2,x_out,y_out"), l2 = L("F,y_in=2,x_in=4,x_out,y_out"), l4 = L("F,y,x");
  EXPECT_EQ(prefix_bytes(l0, l1, s, f), 16u * 4);            // |F| |x_in|
  EXPECT_EQ(shuffle_bytes(l0, l1, s, f), 16u * 64 / 4);      // TOTAL / |y_out|
  EXPECT_EQ(prefix_bytes(l1, l2, s, f), 16u);                // |F|
  EXPECT_EQ(shuffle_bytes(l1, l2, s, f), 16u * 4 * 2);       // |F| |x_in| |y_in|
  EXPECT_EQ(prefix_bytes(l2, l2, s, f), 16u * 64);           // TOTAL
  EXPECT_EQ(prefix_bytes(l2, l4, s, f), 16u * 2);            // |F| |y_in|
  EXPECT_EQ(total_bytes(l0, s, f), 16u * 64);
}

TEST(PrefixSuffix, FieldUnitsWhenFIsNotShared) {
  IndexSpace s = Rect::from_extents({100});
  FieldSpace f({{"a", 4}, {"b", 8}});
  // AOS -> SOA: nothing in common at the front; a request is one value of the smallest field.
  EXPECT_EQ(prefix_bytes(L("F,x"), L("x,F"), s, f), 4u);
  // SOA -> SOA: the whole instance; shuffle of identical layouts is one value of the largest.
  EXPECT_EQ(prefix_bytes(L("x,F"), L("x,F"), s, f), 1200u);
  EXPECT_EQ(shuffle_bytes(L("x,F"), L("x,F"), s, f), 8u);
  // x and x_in=4,x_out are the same linearization when 4 divides 100.
  EXPECT_EQ(prefix_bytes(L("F,x"), L("F,x_in=4,x_out"), s, f), 1200u);
  // 3 does not divide 100: padded, never the same as x.
  EXPECT_EQ(prefix_bytes(L("F,x"), L("F,x_in=3,x_out"), s, f), 12u);
}

// A region's points in a larger instance: contiguous while the region spans each component,
// fastest first; the first component it does not span ends the run.
TEST(PrefixSuffix, RegionRunsEndWhereTheRegionIsNarrowerThanItsInstance) {
  IndexSpace whole = Rect::from_extents({8, 8});
  FieldSpace f = FieldSpace::uniform(4, 4);  // 16 bytes a point
  const auto rect = [](std::int64_t x0, std::int64_t y0, std::int64_t x1, std::int64_t y1) {
    return Rect(2, Point{x0, y0}, Point{x1, y1});
  };
  Layout aos = L("F,x,y");
  EXPECT_EQ(region_run_bytes(aos, whole, whole, f), prefix_bytes(aos, aos, whole, f));
  EXPECT_EQ(region_run_bytes(aos, whole, rect(0, 0, 3, 7), f), 16u * 4);      // half rows
  EXPECT_EQ(region_run_bytes(aos, whole, rect(0, 2, 7, 5), f), 16u * 8 * 4);  // whole rows: one run
  EXPECT_EQ(region_run_bytes(aos, whole, rect(5, 5, 5, 5), f), 16u);          // one point
  // SOA: runs of one field's values.
  EXPECT_EQ(region_run_bytes(L("x,y,F"), whole, rect(0, 0, 3, 7), f), 4u * 4);
  EXPECT_EQ(region_run_bytes(L("x,y,F"), whole, whole, f), 16u * 64);
  // Column-major: a band of whole columns is one run, a band of whole rows is not.
  EXPECT_EQ(region_run_bytes(L("F,y,x"), whole, rect(2, 0, 3, 7), f), 16u * 8 * 2);
  EXPECT_EQ(region_run_bytes(L("F,y,x"), whole, rect(0, 2, 7, 3), f), 16u * 2);
  // Blocked: a whole block of a dimension the region does not span keeps the run going until
  // that dimension's outer part, which takes the region's whole blocks.
  Layout blocked = L("F,x_in=4,y_in=2,x_out,y_out");
  EXPECT_EQ(region_run_bytes(blocked, whole, rect(0, 0, 3, 7), f), 16u * 4 * 2);          // one 4 x 2 tile
  EXPECT_EQ(region_run_bytes(blocked, whole, rect(0, 0, 7, 1), f), 16u * 4 * 2 * 2);      // a row of tiles
  EXPECT_EQ(region_run_bytes(blocked, whole, rect(0, 0, 7, 3), f), 16u * 4 * 2 * 2 * 2);  // y_out: 2 blocks
  // Straddling two blocks without holding one: the longest piece within a block.
  EXPECT_EQ(region_run_bytes(blocked, whole, rect(2, 0, 5, 7), f), 16u * 2);
  EXPECT_EQ(region_run_bytes(blocked, whole, rect(1, 0, 2, 7), f), 16u * 2);
  EXPECT_EQ(region_run_bytes(L("F,x_in=4,x_out,y"), whole, rect(2, 0, 7, 7), f), 16u * 6);  // ordered as x
  expect_invalid([&] { region_run_bytes(aos, whole, rect(0, 0, 8, 7), f); }, "is not inside the index space");
}

// Against the bytes themselves: for every rectangle of an 8 x 8 instance, the longest run of
// region bytes in the footprint. Exact for unblocked layouts; for blocked ones never more than
// the real run, and at least half of it here (a run through whole blocks may also take partial
// blocks at its ends, which region_run_bytes leaves out).
TEST(PrefixSuffix, RegionRunsMatchTheFootprintsBytes) {
  IndexSpace whole = Rect::from_extents({8, 8});
  FieldSpace f = FieldSpace::uniform(4, 4);
  for (const char* text : {"F,x,y", "F,y,x", "x,F,y", "x,y,F", "y,x,F", "F,x_in=4,y_in=2,x_out,y_out",
                           "x_in=2,F,x_out,y", "F,x_in=4,x_out,y", "y_in=4,x,F,y_out"}) {
    const Layout l = L(text);
    const bool blocked = std::string_view(text).find("_in") != std::string_view::npos;
    const Linearization lin(l, whole, f);
    std::uint64_t exact = 0, below = 0;
    double worst = 1;
    for (std::int64_t x0 = 0; x0 < 8; ++x0)
      for (std::int64_t x1 = x0; x1 < 8; ++x1)
        for (std::int64_t y0 = 0; y0 < 8; ++y0)
          for (std::int64_t y1 = y0; y1 < 8; ++y1) {
            const Rect region(2, Point{x0, y0}, Point{x1, y1});
            std::vector<char> in(lin.total_bytes(), 0);
            for (std::int64_t y = y0; y <= y1; ++y)
              for (std::int64_t x = x0; x <= x1; ++x)
                for (std::size_t field = 0; field < f.count(); ++field)
                  for (std::uint64_t b = 0; b < 4; ++b) in[lin.offset({x, y}, field) + b] = 1;
            std::uint64_t longest = 0, current = 0;
            for (char c : in) {
              current = c ? current + 1 : 0;
              longest = std::max(longest, current);
            }
            const std::uint64_t run = region_run_bytes(l, whole, region, f);
            if (blocked) {
              ASSERT_LE(run, longest) << text << " " << region.to_string();
            } else {
              ASSERT_EQ(run, longest) << text << " " << region.to_string();
            }
            ++(run == longest ? exact : below);
            worst = std::max(worst, static_cast<double>(longest) / static_cast<double>(run));
          }
    if (blocked) {
      EXPECT_LE(worst, 2.0) << text;  // 8 x 8 has partial ends of at most one block each
    }
    EXPECT_GT(exact, 0u) << text;
  }
}

// Sizes that do not fit 64 bits are errors, not wrapped numbers (a wrapped footprint would
// allocate too little and every copy into it would write past the end).
TEST(Layout, SizesThatOverflowAreErrors) {
  const std::int64_t big = std::int64_t{1} << 62;
  expect_invalid([&] { (void)Rect::from_extents({big + 1, 4}); }, "more than 2^63 - 1 points");
  expect_invalid(
      [&] {
        (void)Rect::from_extents({std::int64_t{1} << 40, std::int64_t{1} << 30});
      },
      "more than 2^63 - 1 points");
  expect_invalid([&] { (void)Rect(1, Point{INT64_MIN}, Point{INT64_MAX}); }, "dimension x from");
  // The largest volume allowed is exact.
  const Rect widest = Rect::from_extents({INT64_MAX});
  EXPECT_EQ(widest.volume(), static_cast<std::uint64_t>(INT64_MAX));
  EXPECT_EQ(Rect::from_extents({big - 1, 2}).volume(), static_cast<std::uint64_t>(big - 1) * 2);
  expect_invalid([&] { (void)Rect::from_extents({big, 2}); }, "more than 2^63 - 1 points");

  // 2^62 points of 8 bytes: a footprint of 2^65 bytes.
  const Rect square = Rect::from_extents({std::int64_t{1} << 31, std::int64_t{1} << 31});
  const FieldSpace eight = FieldSpace::uniform(1, 8);
  expect_invalid([&] { Linearization lin(L("F,x,y"), square, eight); }, "the footprint exceeds 2^64 - 1 bytes");
  expect_invalid([&] { (void)total_bytes(L("x,y,F"), square, eight); },
                 "layout x,y,F over [0,2147483647]x[0,2147483647]");
  // Padding counts: five points in one block of 2^62, 8 bytes each.
  const Rect five = Rect::from_extents({5});
  expect_invalid([&] { Linearization lin(L("x_in=4611686018427387904,F,x_out"), five, eight); }, "footprint exceeds");
  // A block of 2^64 - 1 holds the five points with the rest padding: 2^64 - 1 values of one byte fit.
  EXPECT_EQ(total_bytes(L("x_in=18446744073709551615,F,x_out"), five, FieldSpace::uniform(1, 1)), UINT64_MAX);
  // Sizes just below the limit still work.
  EXPECT_EQ(total_bytes(L("F,x,y"), Rect::from_extents({std::int64_t{1} << 30, std::int64_t{1} << 30}), eight),
            std::uint64_t{1} << 63);
}

}  // namespace
}  // namespace caravan
