// Property test: on hundreds of random small machines, instances and layouts, the full planner's
// predicted throughput equals a brute-force search written here, independently of the planner
// (it enumerates every path, every assignment of candidate layouts to buffers and every
// blocking factor, and scores them with the public PREFIX / SUFFIX-bar functions); it is never
// below the simple planner; every plan respects the threshold; and the multi-path planner lies
// between the best single path and the max-flow bound.
//
// The search space both sides share is the documented one (docs/planner.md): acyclic paths of at
// most max_hops hops, a self-loop at most once per memory; buffer layouts among the source, the
// destination and the four tilings T_ab (inner components in the order of a, outer in the order
// of b); blocking factors that divide the extent; a buffer holds at least one field value and at
// most min(TH, capacity); requests are PREFIX capped by the buffers they touch; hops between two
// buffers keep SUFFIX-bar within both; shared resources split their capacity over their uses.
#include <caravan/error.h>
#include <caravan/planner/planner.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

namespace caravan::planner {
namespace {

using Rng = std::mt19937_64;

int uniform(Rng& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
double real(Rng& rng, double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); }

std::vector<std::uint64_t> divisors_of(std::uint64_t n) {
  std::vector<std::uint64_t> d;
  for (std::uint64_t i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

struct Case {
  MachineDescription machine;
  TransferRequest request;
  PlannerOptions options;
};

Layout random_layout(Rng& rng, const IndexSpace& space) {
  std::vector<LayoutComponent> parts{LayoutComponent::fields()};
  for (int d = 0; d < space.dims(); ++d) {
    auto ext = static_cast<std::uint64_t>(space.extent(d));
    int pick = uniform(rng, 0, 9);
    if (pick < 6) {
      parts.push_back(LayoutComponent::whole(d));
    } else {
      std::uint64_t block;
      if (pick < 9) {
        auto ds = divisors_of(ext);
        block = ds[static_cast<std::size_t>(uniform(rng, 0, static_cast<int>(ds.size()) - 1))];
      } else {
        block = static_cast<std::uint64_t>(uniform(rng, 1, static_cast<int>(ext)));  // maybe not dividing: padded
      }
      parts.push_back(LayoutComponent::inner(d, block));
      parts.push_back(LayoutComponent::outer(d));
    }
  }
  std::shuffle(parts.begin(), parts.end(), rng);
  Layout l;
  for (const auto& p : parts) l.push_back(p);
  return l;
}

Case random_case(std::uint64_t seed) {
  Rng rng(seed);
  Case c;
  int memories = uniform(rng, 2, 5);
  const MemoryKind kinds[] = {MemoryKind::sys, MemoryKind::zcm, MemoryKind::reg, MemoryKind::fbm, MemoryKind::dsk};
  std::vector<MemoryId> ids;
  for (int i = 0; i < memories; ++i) {
    MemoryId id{static_cast<std::uint32_t>(uniform(rng, 0, 1)), 0, kinds[uniform(rng, 0, 4)], static_cast<std::uint32_t>(i)};
    id.rank = id.node;
    ids.push_back(id);
    std::uint64_t capacity = uniform(rng, 0, 3) == 0 ? static_cast<std::uint64_t>(uniform(rng, 1, 512)) : 0;
    c.machine.memories.push_back({id, capacity});
  }
  const std::uint64_t sizes[] = {8, 64, 512, 4096, 65536};
  for (int a = 0; a < memories; ++a)
    for (int b = 0; b < memories; ++b) {
      if (uniform(rng, 0, 99) >= (a == b ? 35 : 50)) continue;
      std::vector<ThroughputFunction::Sample> samples;
      double g = real(rng, 0.2, 3.0);
      int first = uniform(rng, 0, 3), count = uniform(rng, 1, 3);
      for (int k = first; k < first + count && k < 5; ++k) {
        samples.push_back({sizes[k], g});
        g += real(rng, 0.0, 4.0);
      }
      ChannelKind kind = uniform(rng, 0, 2) == 0 ? ChannelKind::memcpy : ChannelKind::sdma;
      c.machine.channels.push_back({kind, ids[static_cast<std::size_t>(a)], ids[static_cast<std::size_t>(b)], ThroughputFunction(samples), {}});
    }
  if (!c.machine.channels.empty() && uniform(rng, 0, 2) == 0) {
    c.machine.resources.push_back({"shared", real(rng, 0.5, 6.0)});
    for (int k = 0; k < 3; ++k)
      c.machine.channels[static_cast<std::size_t>(uniform(rng, 0, static_cast<int>(c.machine.channels.size()) - 1))].shares = {"shared"};
  }
  c.machine.name = "random-" + std::to_string(seed);
  const std::int64_t extents[] = {4, 6, 8, 12, 16};
  std::vector<std::int64_t> shape;
  int dims = uniform(rng, 0, 4) < 2 ? 1 : 2;
  for (int d = 0; d < dims; ++d) shape.push_back(extents[uniform(rng, 0, dims == 1 ? 4 : 2)]);
  std::vector<Field> fields;
  const std::uint32_t field_sizes[] = {1, 2, 4, 8};
  for (int f = uniform(rng, 1, 3); f > 0; --f) fields.push_back({"f" + std::to_string(f), field_sizes[uniform(rng, 0, 3)]});
  c.request.space = Rect::from_extents(shape);
  c.request.fields = FieldSpace(fields);
  c.request.src = ids[static_cast<std::size_t>(uniform(rng, 0, memories - 1))];
  c.request.dst = ids[static_cast<std::size_t>(uniform(rng, 0, memories - 1))];
  c.request.src_layout = random_layout(rng, c.request.space);
  c.request.dst_layout = uniform(rng, 0, 4) == 0 ? c.request.src_layout : random_layout(rng, c.request.space);
  const std::uint64_t thresholds[] = {4, 16, 64, 256, 4096, 1 << 20};
  c.options.buffer_threshold = thresholds[uniform(rng, 0, 5)];
  c.options.max_hops = seed % 3 == 0 ? 4 : 3;
  c.options.transit_nodes = true;
  return c;
}

// ------------------------------------------------------------------ the brute force

// The candidate layouts for one choice of blocking factors, built from the component lists.
std::vector<Layout> candidates(const TransferRequest& r, const std::map<int, std::uint64_t>& blocks) {
  std::vector<Layout> out{r.src_layout, r.dst_layout};
  auto block_in = [](const Layout& l, int d) -> std::uint64_t {
    for (const auto& c : l)
      if (c.kind == LayoutComponent::Kind::dim_in && c.dim == d) return c.block;
    return 0;
  };
  // Per dimension, the block its in/out parts use in the tilings.
  std::map<int, std::uint64_t> split;
  for (int d = 0; d < r.space.dims(); ++d) {
    auto ext = static_cast<std::uint64_t>(r.space.extent(d));
    std::uint64_t a = block_in(r.src_layout, d), b = block_in(r.dst_layout, d);
    if (a == 0 && b == 0) split[d] = blocks.at(d);
    else if (a == b) split[d] = a;
    else if ((a == 0 || b == 0) && ext % (a + b) == 0) split[d] = a + b;
    else return out;  // blocked differently: no tilings
  }
  auto expand = [&](const Layout& l) {
    std::vector<LayoutComponent> seq;
    for (const auto& c : l) {
      if (c.kind == LayoutComponent::Kind::dim) {
        seq.push_back(LayoutComponent::inner(c.dim, split[c.dim]));
        seq.push_back(LayoutComponent::outer(c.dim));
      } else if (c.kind == LayoutComponent::Kind::dim_in) {
        seq.push_back(LayoutComponent::inner(c.dim, split[c.dim]));
      } else {
        seq.push_back(c);
      }
    }
    return seq;
  };
  auto s = expand(r.src_layout), d = expand(r.dst_layout);
  for (const auto* inner : {&s, &d})
    for (const auto* outer : {&s, &d}) {
      Layout t;
      for (const auto& c : *inner)
        if (c.kind != LayoutComponent::Kind::dim_out) t.push_back(c);
      for (const auto& c : *outer)
        if (c.kind == LayoutComponent::Kind::dim_out) t.push_back(c);
      out.push_back(t);
    }
  return out;
}

struct BruteForce {
  const TransferGraph& g;
  const TransferRequest& r;
  const PlannerOptions& o;
  double best = 0;

  double limit(std::uint32_t v) const {
    double th = static_cast<double>(o.buffer_threshold);
    auto cap = g.memory(v).capacity;
    return cap ? std::min(th, static_cast<double>(cap)) : th;
  }

  void run() {
    std::vector<int> vars;
    for (int d = 0; d < r.space.dims(); ++d) vars.push_back(d);
    std::map<int, std::uint64_t> blocks;
    enumerate_blocks(vars, 0, blocks);
  }

  void enumerate_blocks(const std::vector<int>& dims, std::size_t i, std::map<int, std::uint64_t>& blocks) {
    if (i == dims.size()) {
      score_all(candidates(r, blocks));
      return;
    }
    for (auto b : divisors_of(static_cast<std::uint64_t>(r.space.extent(dims[i])))) {
      blocks[dims[i]] = b;
      enumerate_blocks(dims, i + 1, blocks);
    }
  }

  void score_all(const std::vector<Layout>& layouts) {
    std::size_t k = layouts.size();
    prefix.assign(k * k, 0);
    shuffle.assign(k * k, 0);
    for (std::size_t a = 0; a < k; ++a)
      for (std::size_t b = 0; b < k; ++b) {
        prefix[a * k + b] = static_cast<double>(prefix_bytes(layouts[a], layouts[b], r.space, r.fields));
        shuffle[a * k + b] = static_cast<double>(shuffle_bytes(layouts[a], layouts[b], r.space, r.fields));
      }
    count = k;
    auto src = *g.find(r.src);
    std::vector<std::uint32_t> path;
    walk(src, path);
  }

  // Every path from src, as channel lists.
  void walk(std::uint32_t at, std::vector<std::uint32_t>& path) {
    auto src = *g.find(r.src), dst = *g.find(r.dst);
    if (static_cast<int>(path.size()) == o.max_hops) return;
    for (std::uint32_t e = 0; e < g.channel_count(); ++e) {
      const Channel& c = g.channel(e);
      if (c.src != at) continue;
      std::vector<std::uint32_t> vertices{src};
      for (auto p : path) vertices.push_back(g.channel(p).dst);
      auto w = c.dst;
      // Acyclic: w may repeat only the vertex just before it (a self-loop, once), or, when
      // src == dst, close the path at dst.
      bool repeat = false;
      for (std::size_t i = 0; i < vertices.size(); ++i)
        if (vertices[i] == w) {
          bool self = i + 1 == vertices.size();
          bool twice = self && vertices.size() >= 2 && vertices[vertices.size() - 2] == w;
          bool closing = i == 0 && w == dst && src == dst;
          if (!(self && !twice) && !closing) repeat = true;
        }
      if (repeat) continue;
      path.push_back(e);
      if (w == dst) score_path(path);
      walk(w, path);
      path.pop_back();
    }
  }

  void score_path(const std::vector<std::uint32_t>& path) {
    std::size_t n = path.size();
    for (std::size_t i = 0; i + 1 < n; ++i)
      if (limit(g.channel(path[i]).dst) < r.fields.max_size()) return;  // a buffer holds a field value
    std::vector<std::size_t> assign(n + 1, 0);
    assign[n] = 1;
    assign_layouts(path, assign, 1);
  }

  void assign_layouts(const std::vector<std::uint32_t>& path, std::vector<std::size_t>& assign, std::size_t i) {
    std::size_t n = path.size();
    if (i == n) {
      best = std::max(best, evaluate(path, assign));
      return;
    }
    for (std::size_t l = 0; l < count; ++l) {
      assign[i] = l;
      assign_layouts(path, assign, i + 1);
    }
  }

  double evaluate(const std::vector<std::uint32_t>& path, const std::vector<std::size_t>& assign) {
    std::size_t n = path.size();
    double tp = 1e300;
    std::map<std::uint32_t, int> uses;
    for (std::size_t i = 0; i < n; ++i) {
      const Channel& c = g.channel(path[i]);
      bool from_buffer = i > 0, to_buffer = i + 1 < n;
      double cap = 1e300;
      if (from_buffer) cap = std::min(cap, limit(c.src));
      if (to_buffer) cap = std::min(cap, limit(c.dst));
      std::size_t pair = assign[i] * count + assign[i + 1];
      if (from_buffer && to_buffer && shuffle[pair] > cap) return 0;
      tp = std::min(tp, c.tp(std::min(prefix[pair], cap)));
      for (auto res : c.resources) ++uses[res];
    }
    for (auto [res, k] : uses) tp = std::min(tp, g.resource(res).gbps / k);
    return tp;
  }

  std::vector<double> prefix, shuffle;
  std::size_t count = 0;
};

void expect_plan_respects_limits(const TransferGraph& g, const Plan& p, const PlannerOptions& o, const std::string& what) {
  for (const auto& b : p.buffers) {
    auto v = *g.find(b.memory);
    double limit = static_cast<double>(o.buffer_threshold);
    if (g.memory(v).capacity) limit = std::min(limit, static_cast<double>(g.memory(v).capacity));
    EXPECT_LE(static_cast<double>(b.bytes), limit) << what;
    EXPECT_LE(b.bytes, o.buffer_threshold) << what;
  }
  for (const auto& h : p.hops) {
    if (h.src_is_buffer && h.dst_is_buffer) {
      EXPECT_LE(h.shuffle_bytes, o.buffer_threshold) << what;
    }
    if (h.src_is_buffer || h.dst_is_buffer) {
      EXPECT_LE(h.request_bytes, o.buffer_threshold) << what;
    }
  }
}

TEST(PlannerProperty, FullEqualsBruteForceAndBoundsHold) {
  constexpr int kCases = 600;
  int planned = 0, infeasible = 0, simple_failed = 0, multipath_checked = 0;
  for (std::uint64_t seed = 1; seed <= kCases; ++seed) {
    Case c = random_case(seed);
    std::string what = "seed " + std::to_string(seed) + ": " + c.request.src.to_string() + " -> " + c.request.dst.to_string() +
                       " " + c.request.src_layout.to_string() + " => " + c.request.dst_layout.to_string() + " over " +
                       c.request.space.to_string() + ", TH " + std::to_string(c.options.buffer_threshold);
    SCOPED_TRACE(what);
    TransferGraph g(c.machine);
    BruteForce brute{g, c.request, c.options};
    brute.run();
    double full_gbps = 0;
    try {
      Plan full = plan_full(g, c.request, c.options);
      full_gbps = full.predicted_gbps;
      ++planned;
      EXPECT_TRUE(full.exhaustive);
      EXPECT_NEAR(full_gbps, brute.best, 1e-6 * brute.best) << to_text(full);
      EXPECT_LE(static_cast<int>(full.hops.size()), c.options.max_hops);
      EXPECT_LE(full_gbps, full.upper_bound_gbps * (1 + 1e-9));
      expect_plan_respects_limits(g, full, c.options, what);
    } catch (const Error& e) {
      ++infeasible;
      EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
      EXPECT_EQ(brute.best, 0.0) << "the planner found no plan but brute force did: " << e.what();
      continue;
    }
    try {
      Plan simple = plan_simple(g, c.request, c.options);
      EXPECT_LE(simple.predicted_gbps, full_gbps * (1 + 1e-9)) << to_text(simple);
      expect_plan_respects_limits(g, simple, c.options, what);
    } catch (const Error& e) {
      ++simple_failed;  // the simple planner may miss a plan the full one finds (e.g. TH)
      EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
    }
    if (seed % 4 == 0) {
      ++multipath_checked;
      MultiPlan multi = plan_multipath(g, c.request, c.options);
      double bound = max_flow_bound(g, c.request.src, c.request.dst, c.options);
      EXPECT_GE(multi.predicted_gbps, full_gbps * (1 - 1e-9)) << to_text(multi);
      if (c.request.src != c.request.dst) {
        EXPECT_LE(multi.predicted_gbps, bound * (1 + 1e-6)) << to_text(multi);
      }
      std::uint64_t bytes = 0;
      for (const auto& s : multi.shares) {
        bytes += s.bytes;
        expect_plan_respects_limits(g, s.plan, c.options, what);
      }
      EXPECT_EQ(bytes, c.request.bytes());
    }
  }
  // The generator must exercise both outcomes, or the test proves little.
  EXPECT_GT(planned, kCases / 4);
  EXPECT_GT(infeasible, 10);
  std::printf("property: %d planned, %d without a plan, simple planner failed on %d, %d multi-path checks\n", planned, infeasible,
              simple_failed, multipath_checked);
}

}  // namespace
}  // namespace caravan::planner
