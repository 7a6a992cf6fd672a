// The simple planner (Isometry section 4.4): the shortest path, with one layout conversion on a
// memcpy channel.
//
// 1. The shortest path by hop count from src to dst (Boost's breadth-first search), ties broken
//    by the widest bottleneck peak.
// 2. Without a layout conversion, every buffer keeps the source layout.
// 3. With one, buffers before the converting hop hold the source layout and buffers after it the
//    destination layout; the converting hop is the first memcpy hop of the path. If the path has
//    none, a memcpy self-loop is inserted after the first host memory that has one (the paper's
//    rule). Caravan adds one check the paper leaves out: a conversion between two intermediate
//    buffers must fit its shuffle in the threshold; when it does not, the conversion moves to
//    the first or the last hop (whichever is faster at the conversion's request size), where one
//    end holds the whole instance.
#include "planner/context.h"

#include <caravan/error.h>

#include "planner/graph_impl.h"

#include <boost/graph/breadth_first_search.hpp>
#include <boost/graph/filtered_graph.hpp>

#include <fmt/format.h>

#include <algorithm>

namespace caravan::planner {
namespace {

using detail::Context;

struct VertexFilter {
  const Context* ctx = nullptr;
  bool operator()(std::uint32_t v) const { return v == ctx->src || v == ctx->dst || ctx->buffer_ok(v); }
};
struct EdgeFilter {
  const Context* ctx = nullptr;
  const BoostGraph* graph = nullptr;
  bool operator()(const BoostGraph::edge_descriptor& e) const {
    return boost::source(e, *graph) != boost::target(e, *graph) && ctx->allowed[boost::target(e, *graph)];
  }
};

struct DistanceRecorder : boost::default_bfs_visitor {
  std::vector<int>* distance;
  template <class Edge, class Graph>
  void tree_edge(Edge e, const Graph& g) const {
    (*distance)[boost::target(e, g)] = (*distance)[boost::source(e, g)] + 1;
  }
};

// How much faster an SM-driven copy (gpu_convert) must be predicted to be, for a plain copy
// within a GPU memory, before it is chosen over the copy engine.
constexpr double kSmCopyMargin = 1.15;

std::optional<std::uint32_t> self_loop_of(const TransferGraph& g, std::uint32_t v, ChannelKind kind) {
  std::optional<std::uint32_t> best;
  for (auto e : g.out_channels(v)) {
    const Channel& c = g.channel(e);
    if (c.self_loop() && c.kind == kind && (!best || c.peak_gbps > g.channel(*best).peak_gbps)) best = e;
  }
  return best;
}

}  // namespace

Plan plan_simple(const TransferGraph& graph, const TransferRequest& request, const PlannerOptions& options) {
  Context ctx(graph, request, options);
  const auto& bg = graph.impl().graph;
  bool converts = !(request.src_layout == request.dst_layout) &&
                  prefix_bytes(request.src_layout, request.dst_layout, request.space, request.fields) <
                      total_bytes(request.src_layout, request.space, request.fields);

  // 1. Shortest path (channels), widest among the shortest.
  std::vector<std::uint32_t> path;
  if (ctx.src == ctx.dst) {
    auto loop = self_loop_of(graph, ctx.src, ChannelKind::memcpy);
    if (!loop && converts) {
      // A conversion: the self-loop predicted fastest for it, not the one with the highest
      // peak (the copy engine converting an AOS instance sends one value per request).
      double best = -1;
      for (auto e : graph.out_channels(ctx.src)) {
        if (!graph.channel(e).self_loop()) continue;
        bool valid = true;
        const detail::Step step{e, request.dst_layout};
        const double gbps = detail::make_plan(ctx, PlannerKind::simple, std::span(&step, 1), &valid).predicted_gbps;
        if (valid && gbps > best) {
          best = gbps;
          loop = e;
        }
      }
    }
    if (!loop) {
      for (auto e : graph.out_channels(ctx.src))
        if (graph.channel(e).self_loop() && (!loop || graph.channel(e).peak_gbps > graph.channel(*loop).peak_gbps)) loop = e;
      // A plain copy within one GPU memory: the copy engine unless the kernel is clearly faster
      // (by kSmCopyMargin). A kernel takes SMs from the computation that copies are meant to hide
      // behind, and the calibrated peaks of the two are close on an H200 (a near-tie that flipped
      // the route from machine to machine).
      if (!converts && loop && graph.channel(*loop).kind == ChannelKind::gpu_convert)
        if (auto engine = self_loop_of(graph, ctx.src, ChannelKind::sdma);
            engine && graph.channel(*engine).peak_gbps * kSmCopyMargin >= graph.channel(*loop).peak_gbps)
          loop = engine;
    }
    if (!loop) return plan_full(graph, request, options);  // a copy within one memory without a self-loop: search
    path.push_back(*loop);
  } else {
    std::vector<int> distance(graph.memory_count(), -1);
    distance[ctx.src] = 0;
    boost::filtered_graph<BoostGraph, EdgeFilter, VertexFilter> view(bg, EdgeFilter{&ctx, &bg}, VertexFilter{&ctx});
    DistanceRecorder recorder;
    recorder.distance = &distance;
    boost::breadth_first_search(view, ctx.src, boost::visitor(recorder));
    if (distance[ctx.dst] < 0 || distance[ctx.dst] > options.max_hops) ctx.no_plan("simple");
    // Widest bottleneck along the BFS layers.
    std::vector<std::uint32_t> by_distance;
    for (std::uint32_t v = 0; v < graph.memory_count(); ++v)
      if (distance[v] >= 0 && distance[v] <= distance[ctx.dst]) by_distance.push_back(v);
    std::sort(by_distance.begin(), by_distance.end(), [&](auto a, auto b) { return distance[a] < distance[b]; });
    std::vector<double> width(graph.memory_count(), 0);
    std::vector<std::int64_t> via(graph.memory_count(), -1);
    width[ctx.src] = detail::kInf;
    for (auto v : by_distance)
      for (auto e : graph.out_channels(v)) {
        const Channel& c = graph.channel(e);
        if (c.self_loop() || distance[c.dst] != distance[v] + 1) continue;
        if (c.dst != ctx.dst && !ctx.buffer_ok(c.dst)) continue;
        double w = std::min(width[v], c.peak_gbps);
        if (w > width[c.dst]) {
          width[c.dst] = w;
          via[c.dst] = e;
        }
      }
    for (std::uint32_t v = ctx.dst; v != ctx.src;) {
      auto e = static_cast<std::uint32_t>(via[v]);
      path.push_back(e);
      v = graph.channel(e).src;
    }
    std::reverse(path.begin(), path.end());
  }

  // 2./3. Where the layouts change.
  auto build = [&](const std::vector<std::uint32_t>& channels, std::size_t convert_at, bool* valid) {
    std::vector<detail::Step> steps;
    for (std::size_t i = 0; i < channels.size(); ++i)
      steps.push_back({channels[i], converts && i >= convert_at ? request.dst_layout : request.src_layout});
    return detail::make_plan(ctx, PlannerKind::simple, steps, valid);
  };
  bool valid = true;
  if (!converts) {
    Plan plan = build(path, path.size(), &valid);
    if (!valid) ctx.no_plan("simple");
    return plan;
  }
  for (std::size_t i = 0; i < path.size(); ++i) {
    if (graph.channel(path[i]).kind != ChannelKind::memcpy) continue;
    Plan plan = build(path, i, &valid);
    if (valid) return plan;
    break;
  }
  bool has_memcpy = std::any_of(path.begin(), path.end(), [&](auto e) { return graph.channel(e).kind == ChannelKind::memcpy; });
  if (!has_memcpy) {
    // Insert a memcpy self-loop after the first host memory that has one.
    for (std::size_t i = 0; i <= path.size(); ++i) {
      std::uint32_t v = i == 0 ? ctx.src : graph.channel(path[i - 1]).dst;
      if (!is_host(graph.memory(v).id.kind)) continue;
      auto loop = self_loop_of(graph, v, ChannelKind::memcpy);
      if (!loop) continue;
      if (static_cast<int>(path.size()) + 1 > options.max_hops) break;
      if (v == ctx.dst && i != path.size()) continue;
      auto with_loop = path;
      with_loop.insert(with_loop.begin() + static_cast<std::ptrdiff_t>(i), *loop);
      if (v != ctx.src && v != ctx.dst && !ctx.buffer_ok(v)) break;
      Plan plan = build(with_loop, i, &valid);
      if (valid) return plan;
      break;
    }
  }
  // The conversion on the first or the last hop, where one end holds the whole instance, or
  // (between GPUs, with no host memory on the way) on a conversion kernel at either end: a copy
  // engine or peer link converting sends one value per request. The fastest predicted wins.
  std::optional<Plan> best;
  const auto consider = [&](Plan plan, bool plan_valid) {
    if (plan_valid && (!best || plan.predicted_gbps > best->predicted_gbps)) best = std::move(plan);
  };
  Plan first = build(path, 0, &valid);
  consider(std::move(first), valid);
  Plan last = build(path, path.size() - 1, &valid);
  consider(std::move(last), valid);
  if (!has_memcpy && static_cast<int>(path.size()) + 1 <= options.max_hops) {
    for (std::uint32_t end : {ctx.src, ctx.dst}) {
      auto loop = self_loop_of(graph, end, ChannelKind::gpu_convert);
      if (!loop) continue;
      auto with_loop = path;
      const std::size_t at = end == ctx.src ? 0 : path.size();
      with_loop.insert(with_loop.begin() + static_cast<std::ptrdiff_t>(at), *loop);
      Plan plan = build(with_loop, at, &valid);
      consider(std::move(plan), valid);
    }
  }
  if (best) return std::move(*best);
  ctx.no_plan("simple");
}

}  // namespace caravan::planner
