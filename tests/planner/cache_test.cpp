// The path cache and the Planner in front of it.
#include <caravan/planner/machine_file.h>
#include <caravan/planner/planner.h>
#include <caravan/settings.h>

#include <gtest/gtest.h>

#include <thread>

namespace caravan::planner {
namespace {

std::shared_ptr<const TransferGraph> two_node() {
  return std::make_shared<const TransferGraph>(builtin_machine("isometry-two-node"));
}

TransferRequest transpose(std::int64_t n) {
  return {MemoryId::parse("node0/rank0/fbm"), MemoryId::parse("node1/rank1/fbm"), Rect::from_extents({n, n}),
          FieldSpace::uniform(4, 4), Layout::parse("F,x,y"), Layout::parse("F,y,x")};
}

TEST(PathCache, HitsReturnTheSamePlan) {
  PlannerOptions o;
  Planner planner(two_node(), o);
  auto a = planner.plan(transpose(4096));
  auto b = planner.plan(transpose(4096));
  EXPECT_EQ(a.get(), b.get());
  EXPECT_EQ(planner.cache().hits(), 1u);
  EXPECT_EQ(planner.cache().size(), 1u);
  EXPECT_EQ(a->planner, PlannerKind::full);  // 256 MiB >= 16 MiB
  auto small = planner.plan(transpose(64));
  EXPECT_EQ(small->planner, PlannerKind::simple);
  EXPECT_EQ(planner.cache().size(), 2u);
}

TEST(PathCache, SameClassOtherExtentsKeepsThePathAndFitsTheBlocks) {
  PlannerOptions o;
  Planner planner(two_node(), o);
  auto a = planner.plan(transpose(4096));  // 256 MiB
  TransferRequest other = transpose(4096);
  other.space = Rect::from_extents({4096, 4100});  // same size class (2^28 <= bytes < 2^29); 4100 = 4 * 1025
  auto b = planner.plan(other);
  EXPECT_NE(a.get(), b.get());
  EXPECT_EQ(b->route(), a->route());
  for (const auto& buf : b->buffers)
    for (const auto& c : buf.layout)
      if (c.kind == LayoutComponent::Kind::dim_in) {
        EXPECT_EQ(4100 % (c.dim == 1 ? c.block : 1), 0u) << buf.layout.to_string();
      }
  for (const auto& buf : b->buffers) EXPECT_LE(buf.bytes, o.buffer_threshold);
  EXPECT_EQ(b->bytes, other.bytes());
}

// A region of a larger instance is not the dense instance of the same space: its rows bound the
// first and last hop, so it gets a plan of its own, rated by those rows.
TEST(PathCache, ARegionOfALargerInstanceIsNotTheDenseCopysPlan) {
  PlannerOptions o;
  Planner planner(two_node(), o);
  TransferRequest dense{MemoryId::parse("node0/rank0/sys"),
                        MemoryId::parse("node1/rank1/sys"),
                        Rect(2, Point{0, 0}, Point{15, 4095}),
                        FieldSpace::uniform(2, 4),
                        Layout::aos(2),
                        Layout::aos(2)};
  TransferRequest band = dense;
  band.src_instance_space = band.dst_instance_space = Rect::from_extents({4096, 4096});
  auto a = planner.plan(dense);
  auto b = planner.plan(band);
  EXPECT_NE(a.get(), b.get());
  EXPECT_GT(a->hops.front().request_bytes, 128u);
  EXPECT_LE(b->hops.front().request_bytes, 128u);
  EXPECT_LT(b->predicted_gbps, a->predicted_gbps);
  // The same band again hits the cache and is rated the same.
  auto c = planner.plan(band);
  EXPECT_EQ(c->route(), b->route());
  EXPECT_DOUBLE_EQ(c->predicted_gbps, b->predicted_gbps);
  EXPECT_EQ(planner.cache().size(), 2u);
}

// Field spaces with the same |F| but other field sizes are other keys, also once a field reaches
// 4 KiB (the packed key made {1, 1, 4096, 4096} and {2, 8192} one key).
TEST(PathCache, FieldSizesOf4KiBAndMoreAreKeptApart) {
  TransferRequest a = transpose(16);
  a.fields = FieldSpace({{"a", 1}, {"b", 1}, {"c", 4096}, {"d", 4096}});
  TransferRequest b = a;
  b.fields = FieldSpace({{"a", 2}, {"b", 8192}});
  ASSERT_EQ(a.bytes(), b.bytes());
  const auto ka = PathCacheKey::of(a, PlannerKind::full), kb = PathCacheKey::of(b, PlannerKind::full);
  EXPECT_FALSE(ka == kb);
  EXPECT_EQ(ka.field_max, 4096u);
  EXPECT_EQ(kb.field_max, 8192u);
  Planner planner(two_node(), PlannerOptions{});
  auto pa = planner.plan(a);
  auto pb = planner.plan(b);
  EXPECT_NE(pa.get(), pb.get());
  EXPECT_EQ(planner.cache().hits(), 0u);
  EXPECT_EQ(planner.cache().size(), 2u);
  EXPECT_EQ(planner.plan(b).get(), pb.get());
}

// A cached path whose blocks cannot be fitted to a new extent (4099 is prime: every block
// becomes 1) is not reused at a fraction of its rate: the new space gets a plan of its own, as
// good as planning it afresh, and later copies of that space hit it.
TEST(PathCache, AFitThatCostsTheRateIsReplanned) {
  PlannerOptions o;
  Planner planner(two_node(), o);
  auto a = planner.plan(transpose(4096));
  TransferRequest prime = transpose(4096);
  prime.space = Rect::from_extents({4096, 4099});  // the same size class
  auto b = planner.plan(prime);
  const Plan fresh = plan_full(*two_node(), prime, o);
  EXPECT_GE(b->predicted_gbps, 0.9 * fresh.predicted_gbps) << to_text(*b) << "\n" << to_text(fresh);
  EXPECT_EQ(b->bytes, prime.bytes());
  for (const auto& buf : b->buffers) EXPECT_LE(buf.bytes, o.buffer_threshold);
  auto c = planner.plan(prime);
  EXPECT_EQ(c.get(), b.get()) << "the plan for this space is cached";
  EXPECT_EQ(planner.cache().size(), 1u);
}

TEST(PathCache, EvictsTheLeastRecentlyUsed) {
  PathCache cache(2);
  auto plan = std::make_shared<const Plan>();
  TransferRequest r = transpose(64);
  auto k1 = PathCacheKey::of(r, PlannerKind::full);
  r.dst = MemoryId::parse("node1/rank1/sys");
  auto k2 = PathCacheKey::of(r, PlannerKind::full);
  r.dst = MemoryId::parse("node1/rank1/zcm");
  auto k3 = PathCacheKey::of(r, PlannerKind::full);
  cache.insert(k1, r.space, plan);
  cache.insert(k2, r.space, plan);
  EXPECT_TRUE(cache.lookup(k1));  // k2 is now the oldest
  cache.insert(k3, r.space, plan);
  EXPECT_TRUE(cache.lookup(k1));
  EXPECT_FALSE(cache.lookup(k2));
  EXPECT_TRUE(cache.lookup(k3));
  EXPECT_EQ(cache.size(), 2u);
}

TEST(PathCache, ConcurrentPlannersAgree) {
  Planner planner(two_node(), PlannerOptions{});
  std::vector<std::thread> threads;
  std::vector<std::string> routes(4);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) routes[static_cast<std::size_t>(t)] = planner.plan(transpose(1024 + 1024 * (i % 3)))->route();
    });
  for (auto& t : threads) t.join();
  for (const auto& r : routes) EXPECT_EQ(r, routes[0]);
}

TEST(PlannerOptions, ComeFromSettings) {
  settings::ScopedOverride th("CARAVAN_PLANNER_BUFFER_THRESHOLD", "8M");
  settings::ScopedOverride hops("CARAVAN_PLANNER_MAX_HOPS", "4");
  PlannerOptions o = PlannerOptions::from_settings();
  EXPECT_EQ(o.buffer_threshold, 8u << 20);
  EXPECT_EQ(o.max_hops, 4);
  EXPECT_EQ(o.full_min_bytes, 16u << 20);
}

}  // namespace
}  // namespace caravan::planner
