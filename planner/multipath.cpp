// Multi-path planning (beyond the paper): one large transfer split over several paths at once.
//
// 1. Bound: the max-flow from src to dst over the transfer graph (Boost's push-relabel), each
//    channel at its peak and each shared resource a single node pair whose arc has the
//    resource's capacity, so that every channel using it draws from one pool. (For a resource
//    shared by channels with different ends this relaxes the real constraint, so it stays an
//    upper bound.)
// 2. Candidates: the flow decomposed into paths, plus the full planner's best single path. Each
//    candidate gets its own layouts and blocking factors, solved as in the full planner.
// 3. Rates: a small linear program gives each path x_p <= its own throughput with, for every
//    channel, sum over paths of x_p / tp(request on that path) <= 1 (time-sharing) and, for
//    every shared resource, sum of x_p * uses <= capacity. It keeps at most max_paths paths.
// 4. Split: the instance is cut along the outermost dimension of the source layout into pieces
//    proportional to the rates; the plan's throughput is that of its slowest piece. When that is
//    not better than the single best path, the single path is returned.
#include "planner/context.h"

#include <caravan/error.h>

#include <boost/graph/adjacency_list.hpp>
#include <boost/graph/push_relabel_max_flow.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <span>

namespace caravan::planner {
namespace {

using detail::Context;
using detail::kInf;

// ------------------------------------------------------------ max-flow network

using FlowTraits = boost::adjacency_list_traits<boost::vecS, boost::vecS, boost::directedS>;
using FlowGraph = boost::adjacency_list<
    boost::vecS, boost::vecS, boost::directedS, boost::no_property,
    boost::property<boost::edge_capacity_t, std::int64_t,
                    boost::property<boost::edge_residual_capacity_t, std::int64_t,
                                    boost::property<boost::edge_reverse_t, FlowTraits::edge_descriptor>>>>;

constexpr double kUnitsPerGbps = 1e6;  // integer capacities in KB/s, rounded up

struct Arc {
  FlowTraits::edge_descriptor edge;
  int channel;     // the chain this arc belongs to
  bool entry;      // leaves the channel's source memory
  bool exit;       // enters the channel's destination memory
};

struct FlowNetwork {
  FlowGraph g;
  std::vector<Arc> arcs;
  std::size_t memories = 0;
  std::int64_t value = 0;
};

void add_arc(FlowNetwork& net, std::size_t from, std::size_t to, std::int64_t cap, int channel, bool entry, bool exit) {
  auto e = boost::add_edge(from, to, net.g).first;
  auto r = boost::add_edge(to, from, net.g).first;
  boost::put(boost::edge_capacity, net.g, e, cap);
  boost::put(boost::edge_capacity, net.g, r, 0);
  boost::put(boost::edge_reverse, net.g, e, r);
  boost::put(boost::edge_reverse, net.g, r, e);
  net.arcs.push_back({e, channel, entry, exit});
}

std::int64_t units(double gbps) { return static_cast<std::int64_t>(std::ceil(gbps * kUnitsPerGbps)); }

FlowNetwork build_network(const Context& ctx) {
  const auto& g = ctx.graph;
  FlowNetwork net;
  net.memories = g.memory_count();
  std::size_t next = net.memories;
  std::vector<std::size_t> resource_in(g.resource_count(), 0);
  for (std::size_t v = 0; v < net.memories; ++v) boost::add_vertex(net.g);
  for (std::uint32_t r = 0; r < g.resource_count(); ++r) {
    resource_in[r] = next;
    boost::add_vertex(net.g);
    boost::add_vertex(net.g);
    next += 2;
  }
  std::vector<char> resource_used(g.resource_count(), 0);
  auto usable = [&](std::uint32_t v) { return v == ctx.src || v == ctx.dst || ctx.buffer_ok(v); };
  for (std::uint32_t e = 0; e < g.channel_count(); ++e) {
    const Channel& c = g.channel(e);
    if (c.self_loop() || !ctx.allowed[c.src] || !ctx.allowed[c.dst] || !usable(c.src) || !usable(c.dst)) continue;
    if (c.dst == ctx.src || c.src == ctx.dst) continue;
    std::int64_t cap = units(c.peak_gbps);
    std::size_t at = c.src;
    bool first = true;
    for (auto r : c.resources) {
      add_arc(net, at, resource_in[r], cap, static_cast<int>(e), first, false);
      if (!resource_used[r]) {
        add_arc(net, resource_in[r], resource_in[r] + 1, units(g.resource(r).gbps), -1, false, false);
        resource_used[r] = 1;
      }
      at = resource_in[r] + 1;
      first = false;
    }
    add_arc(net, at, c.dst, cap, static_cast<int>(e), first, true);
  }
  if (ctx.src != ctx.dst) net.value = boost::push_relabel_max_flow(net.g, ctx.src, ctx.dst);
  return net;
}

// Paths (channel sequences) that carry the flow, largest first.
std::vector<std::vector<std::uint32_t>> decompose(const Context& ctx, FlowNetwork& net) {
  const auto& g = ctx.graph;
  std::size_t n = boost::num_vertices(net.g);
  // Remaining flow per arc, and outgoing arcs per node.
  std::vector<std::int64_t> flow(net.arcs.size());
  std::vector<std::vector<std::size_t>> out(n);
  for (std::size_t i = 0; i < net.arcs.size(); ++i) {
    auto e = net.arcs[i].edge;
    flow[i] = boost::get(boost::edge_capacity, net.g, e) - boost::get(boost::edge_residual_capacity, net.g, e);
    if (flow[i] > 0) out[boost::source(e, net.g)].push_back(i);
  }
  std::vector<std::vector<std::uint32_t>> paths;
  for (int round = 0; round < 64; ++round) {
    std::vector<std::size_t> arcs;
    std::vector<char> seen(n, 0);
    std::size_t at = ctx.src;
    seen[at] = 1;
    while (at != ctx.dst) {
      std::size_t pick = SIZE_MAX;
      for (auto i : out[at])
        if (flow[i] > 0 && !seen[boost::target(net.arcs[i].edge, net.g)] && (pick == SIZE_MAX || flow[i] > flow[pick])) pick = i;
      if (pick == SIZE_MAX) break;
      arcs.push_back(pick);
      at = boost::target(net.arcs[pick].edge, net.g);
      seen[at] = 1;
    }
    if (at != ctx.dst || arcs.empty()) break;
    std::int64_t bottleneck = flow[arcs[0]];
    for (auto i : arcs) bottleneck = std::min(bottleneck, flow[i]);
    for (auto i : arcs) flow[i] -= bottleneck;
    // Back to memories and channels. Inside a shared resource the flow may switch from one
    // channel's chain to another's; keep the hop only if a real channel joins its two memories.
    std::vector<std::uint32_t> channels;
    bool real = true;
    std::uint32_t from = ctx.src;
    int entered = -1;
    for (auto i : arcs) {
      const Arc& a = net.arcs[i];
      if (a.entry) entered = a.channel;
      if (!a.exit) continue;
      auto to = static_cast<std::uint32_t>(boost::target(a.edge, net.g));
      std::optional<std::uint32_t> channel;
      if (entered >= 0 && g.channel(static_cast<std::uint32_t>(entered)).dst == to) channel = static_cast<std::uint32_t>(entered);
      else if (g.channel(static_cast<std::uint32_t>(a.channel)).src == from) channel = static_cast<std::uint32_t>(a.channel);
      else
        for (auto e : g.out_channels(from))
          if (g.channel(e).dst == to) channel = e;
      if (!channel) {
        real = false;
        break;
      }
      channels.push_back(*channel);
      from = to;
    }
    if (real && static_cast<int>(channels.size()) <= ctx.options.max_hops &&
        std::find(paths.begin(), paths.end(), channels) == paths.end())
      paths.push_back(std::move(channels));
  }
  return paths;
}

// ------------------------------------------------------------ one path, layouts chosen

// The best layouts and blocking factors for a fixed channel sequence (the full planner's solve,
// with the path given): a depth-first search over buffer layouts, pruned by the same bounds.
std::optional<Plan> plan_on_path(const Context& ctx, const detail::Model& m, const std::vector<std::uint32_t>& channels) {
  const auto& g = ctx.graph;
  std::size_t n = channels.size();
  std::vector<std::uint32_t> at(n + 1);
  at[0] = ctx.src;
  for (std::size_t i = 0; i < n; ++i) at[i + 1] = g.channel(channels[i]).dst;
  for (std::size_t i = 1; i < n; ++i)
    if (!ctx.buffer_ok(at[i])) return std::nullopt;
  double resource_cap = kInf;
  {
    std::map<std::uint32_t, int> uses;
    for (auto e : channels)
      for (auto r : g.channel(e).resources) ++uses[r];
    for (auto [r, k] : uses) resource_cap = std::min(resource_cap, g.resource(r).gbps / k);
  }
  std::vector<int> layouts(n + 1, m.src);
  layouts[n] = m.dst;
  double best = 0;
  std::vector<int> best_layouts;
  std::array<int, kMaxDims> best_index{};
  std::vector<detail::HopConstraint> hops(n);
  auto cap_of = [&](std::size_t i) {
    double cap = kInf;
    if (i > 0) cap = std::min(cap, ctx.limit[at[i]]);
    if (i + 1 < n) cap = std::min(cap, ctx.limit[at[i + 1]]);
    return std::min(cap, ctx.run_cap(i > 0, i + 1 < n));  // a region's runs in its instances
  };
  auto set_hop = [&](std::size_t i) {
    const auto& p = m.pair(layouts[i], layouts[i + 1]);
    auto& h = hops[i];
    h.tp = &g.channel(channels[i]).tp;
    h.request = &p.request;
    h.cap = cap_of(i);
    h.shuffle = i > 0 && i + 1 < n ? &p.shuffle : nullptr;
    h.shuffle_limit = h.cap;
  };
  auto hop_bound = [&](std::size_t i) {
    const auto& p = m.pair(layouts[i], layouts[i + 1]);
    if (i > 0 && i + 1 < n && p.min_shuffle_log2 > std::log2(cap_of(i)) + 1e-9) return 0.0;
    const Channel& c = g.channel(channels[i]);
    return std::min(c.peak_gbps, c.tp(std::min(std::exp2(p.max_request_log2), cap_of(i))));
  };
  // Assign layouts to buffers 1..n-1 in order; hop i-1 is fixed once layout i is.
  auto search = [&](auto&& self, std::size_t i, double bound) -> void {
    if (i == n) {
      double b = std::min(bound, hop_bound(n - 1));
      if (!(b > best * (1 + 1e-9))) return;
      for (std::size_t k = 0; k < n; ++k) set_hop(k);
      auto s = detail::solve_blocks(m, hops, std::min(b, resource_cap));
      if (s.feasible && s.gbps > best * (1 + 1e-9)) {
        best = s.gbps;
        best_layouts = layouts;
        best_index = s.index;
      }
      return;
    }
    for (int b = 0; b < m.count; ++b) {
      layouts[i] = b;
      double hb = std::min(bound, hop_bound(i - 1));
      if (hb > best * (1 + 1e-9)) self(self, i + 1, hb);
    }
  };
  search(search, 1, resource_cap);
  if (best_layouts.empty()) return std::nullopt;
  std::vector<detail::Step> steps;
  for (std::size_t i = 0; i < n; ++i) steps.push_back({channels[i], m.layout(best_layouts[i + 1], best_index)});
  bool valid = true;
  Plan plan = detail::make_plan(ctx, PlannerKind::multipath, steps, &valid);
  if (!valid) return std::nullopt;
  return plan;
}

// ------------------------------------------------------------ a small LP

// Maximises sum(x) subject to A x <= b (b >= 0), x >= 0, by the simplex method on a dense
// tableau with Bland's rule (no cycling). Sizes here are tens of rows and a few columns.
std::vector<double> maximise_sum(const std::vector<std::vector<double>>& a, const std::vector<double>& b, std::size_t vars) {
  std::size_t rows = a.size(), cols = vars + rows;
  std::vector<std::vector<double>> t(rows + 1, std::vector<double>(cols + 1, 0.0));
  std::vector<std::size_t> basis(rows);
  for (std::size_t i = 0; i < rows; ++i) {
    for (std::size_t j = 0; j < vars; ++j) t[i][j] = a[i][j];
    t[i][vars + i] = 1;
    t[i][cols] = b[i];
    basis[i] = vars + i;
  }
  for (std::size_t j = 0; j < vars; ++j) t[rows][j] = -1;  // objective row: -sum(x)
  for (int iter = 0; iter < 1000; ++iter) {
    std::size_t enter = cols;
    for (std::size_t j = 0; j < cols; ++j)
      if (t[rows][j] < -1e-12) {
        enter = j;
        break;
      }
    if (enter == cols) break;
    std::size_t leave = rows;
    double ratio = kInf;
    for (std::size_t i = 0; i < rows; ++i) {
      if (t[i][enter] <= 1e-12) continue;
      double r = t[i][cols] / t[i][enter];
      if (r < ratio - 1e-15 || (std::abs(r - ratio) <= 1e-15 && leave < rows && basis[i] < basis[leave])) {
        ratio = r;
        leave = i;
      }
    }
    if (leave == rows) break;  // unbounded; cannot happen with x_p <= tp_p rows
    double pivot = t[leave][enter];
    for (auto& v : t[leave]) v /= pivot;
    for (std::size_t i = 0; i <= rows; ++i) {
      if (i == leave || t[i][enter] == 0) continue;
      double f = t[i][enter];
      for (std::size_t j = 0; j <= cols; ++j) t[i][j] -= f * t[leave][j];
    }
    basis[leave] = enter;
  }
  std::vector<double> x(vars, 0.0);
  for (std::size_t i = 0; i < rows; ++i)
    if (basis[i] < vars) x[basis[i]] = std::max(0.0, t[i][cols]);
  return x;
}

// Rates for the given paths (see the file comment, step 3).
std::vector<double> allocate(const TransferGraph& g, const std::vector<Plan>& plans) {
  std::vector<std::vector<double>> a;
  std::vector<double> b;
  std::size_t vars = plans.size();
  for (std::size_t p = 0; p < vars; ++p) {
    std::vector<double> row(vars, 0.0);
    row[p] = 1;
    a.push_back(row);
    b.push_back(plans[p].predicted_gbps);
  }
  std::map<std::uint32_t, std::vector<double>> per_channel, per_resource;
  for (std::size_t p = 0; p < vars; ++p)
    for (const auto& h : plans[p].hops) {
      auto& row = per_channel[h.channel];
      row.resize(vars, 0.0);
      row[p] += 1.0 / h.gbps;
      for (auto r : g.channel(h.channel).resources) {
        auto& rrow = per_resource[r];
        rrow.resize(vars, 0.0);
        rrow[p] += 1.0;
      }
    }
  for (auto& [c, row] : per_channel) {
    a.push_back(row);
    b.push_back(1.0);
  }
  for (auto& [r, row] : per_resource) {
    a.push_back(row);
    b.push_back(g.resource(r).gbps);
  }
  return maximise_sum(a, b, vars);
}

}  // namespace

double max_flow_bound(const TransferGraph& graph, MemoryId src, MemoryId dst, const PlannerOptions& options) {
  TransferRequest probe{src, dst, Rect::from_extents({1}), FieldSpace::uniform(1, 1), Layout::aos(1), Layout::aos(1)};
  Context ctx(graph, probe, options);
  if (ctx.src == ctx.dst) return ctx.upper_bound;
  return static_cast<double>(build_network(ctx).value) / kUnitsPerGbps;
}

void spread_shares(MultiPlan& plan, const Rect& space, std::span<const double> rates) {
  if (rates.size() != plan.shares.size())
    throw Error(Errc::invalid_argument, fmt::format("spread_shares: {} rates for {} shares", rates.size(),
                                                    plan.shares.size()));
  for (std::size_t p = 0; p < rates.size(); ++p)
    if (!(rates[p] > 0) || !std::isfinite(rates[p]))
      throw Error(Errc::invalid_argument,
                  fmt::format("spread_shares: rate {} of share {} is not a positive number of GB/s", rates[p], p));
  if (plan.split_dim < 0 || plan.split_dim >= space.dims())
    throw Error(Errc::invalid_argument, fmt::format("spread_shares: split dimension {} is not one of {}'s",
                                                    plan.split_dim, space.to_string()));
  const auto split = static_cast<std::size_t>(plan.split_dim);
  const auto extent = static_cast<std::uint64_t>(space.extent(plan.split_dim));
  const std::size_t paths = plan.shares.size();
  double total_rate = 0;
  for (double r : rates) total_rate += r;
  std::vector<std::uint64_t> rows(paths, 0);
  std::uint64_t given = 0;
  for (std::size_t p = 0; p < paths; ++p) {
    rows[p] = static_cast<std::uint64_t>(std::floor(static_cast<double>(extent) * rates[p] / total_rate));
    given += rows[p];
  }
  while (given < extent) {  // the remainder to the paths that would finish a row soonest
    std::size_t pick = 0;
    double soonest = kInf;
    for (std::size_t p = 0; p < paths; ++p) {
      const double time = static_cast<double>(rows[p] + 1) / rates[p];
      if (time < soonest) {
        soonest = time;
        pick = p;
      }
    }
    ++rows[pick];
    ++given;
  }
  const std::uint64_t slice = space.volume() == 0 ? 0 : plan.bytes / extent;
  std::vector<PathShare> shares;
  double slowest = 0;  // seconds per byte, up to a constant
  Point lo = space.lo();
  for (std::size_t p = 0; p < paths; ++p) {
    if (rows[p] == 0) continue;  // a sliver that rounded to nothing: the path is not used
    Point plo = lo, phi = space.hi();
    phi[split] = lo[split] + static_cast<std::int64_t>(rows[p]) - 1;
    lo[split] += static_cast<std::int64_t>(rows[p]);
    PathShare share{std::move(plan.shares[p].plan), Rect(space.dims(), plo, phi), rows[p] * slice, rates[p]};
    slowest = std::max(slowest, static_cast<double>(share.bytes) / rates[p]);
    shares.push_back(std::move(share));
  }
  plan.shares = std::move(shares);
  plan.predicted_gbps = slowest > 0 ? static_cast<double>(plan.bytes) / slowest : 0;
}

MultiPlan plan_multipath(const TransferGraph& graph, const TransferRequest& request, const PlannerOptions& options) {
  Context ctx(graph, request, options);
  detail::Model model = detail::build_model(request);
  Plan single = plan_full(graph, request, options);
  MultiPlan result;
  result.bytes = request.bytes();
  result.best_single_gbps = single.predicted_gbps;
  FlowNetwork net = build_network(ctx);
  result.max_flow_gbps = ctx.src == ctx.dst ? ctx.upper_bound : static_cast<double>(net.value) / kUnitsPerGbps;

  auto single_only = [&] {
    result.shares.clear();
    result.split_dim = -1;
    result.predicted_gbps = single.predicted_gbps;
    single.planner = PlannerKind::multipath;
    result.shares.push_back({single, request.space, request.bytes(), single.predicted_gbps});
    return result;
  };
  if (ctx.src == ctx.dst) return single_only();

  // Candidate paths.
  std::vector<Plan> plans{single};
  std::vector<std::vector<std::uint32_t>> routes;
  {
    std::vector<std::uint32_t> r;
    for (const auto& h : single.hops) r.push_back(h.channel);
    routes.push_back(r);
  }
  // Candidates: the flow's own paths, and every two-hop detour through one buffer (a max-flow
  // picks one optimum; when a shared resource caps the total, another mix of detours may fit
  // the per-path limits better, and the LP below chooses among them).
  auto candidates = decompose(ctx, net);
  if (ctx.options.max_hops >= 2)
    for (auto first : graph.out_channels(ctx.src)) {
      const Channel& a = graph.channel(first);
      if (a.self_loop() || a.dst == ctx.dst || !ctx.buffer_ok(a.dst)) continue;
      for (auto second : graph.out_channels(a.dst))
        if (graph.channel(second).dst == ctx.dst && !graph.channel(second).self_loop()) candidates.push_back({first, second});
    }
  for (auto& channels : candidates) {
    if (std::find(routes.begin(), routes.end(), channels) != routes.end()) continue;
    if (auto plan = plan_on_path(ctx, model, channels)) {
      plans.push_back(std::move(*plan));
      routes.push_back(channels);
    }
  }
  auto rates = allocate(graph, plans);
  // At most max_paths paths: keep the largest rates and solve again.
  std::vector<std::size_t> order(plans.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](auto a, auto b) { return rates[a] > rates[b]; });
  // A path whose share is a sliver (below kMinShare of the total) is dropped: it gains almost
  // nothing and costs a setup of its own (buffers, streams, a part to track). On the live
  // 4 x H200 machine the LP gave fbm0 -> sys -> zcm 1-2 GB/s beside fbm0 -> zcm, the two sharing
  // GPU 0's PCIe link, the calibrated link peak being a little above the direct path's rate.
  constexpr double kMinShare = 0.05;
  double total_before = 0;
  for (auto r : rates) total_before += r;
  std::vector<Plan> kept;
  for (auto i : order)
    if (rates[i] > std::max(1e-9, kMinShare * total_before) && static_cast<int>(kept.size()) < std::max(1, options.max_paths))
      kept.push_back(plans[i]);
  if (kept.size() <= 1) return single_only();
  if (kept.size() < plans.size()) rates = allocate(graph, kept);
  else {
    std::vector<double> sorted;
    for (auto i : order) sorted.push_back(rates[i]);
    rates = sorted;
  }

  // Split along the outermost dimension of the source layout.
  int split = -1;
  for (const auto& c : request.src_layout)
    if (c.kind != LayoutComponent::Kind::fields) split = c.dim;
  result.split_dim = split;
  std::vector<double> given;
  for (std::size_t p = 0; p < kept.size(); ++p) {
    if (!(rates[p] > 0)) continue;  // the LP left it nothing
    kept[p].planner = PlannerKind::multipath;
    result.shares.push_back({std::move(kept[p]), request.space, 0, rates[p]});
    given.push_back(rates[p]);
  }
  if (result.shares.size() <= 1) return single_only();
  spread_shares(result, request.space, given);
  if (result.shares.size() <= 1 || result.predicted_gbps <= single.predicted_gbps) return single_only();
  return result;
}

}  // namespace caravan::planner
