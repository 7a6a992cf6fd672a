#include "planner/context.h"

#include <caravan/error.h>
#include <caravan/settings.h>

#include <fmt/format.h>

#include <algorithm>
#include <queue>

namespace caravan::planner {

PlannerOptions PlannerOptions::from_settings() {
  PlannerOptions o;
  o.buffer_threshold = settings::get_bytes("CARAVAN_PLANNER_BUFFER_THRESHOLD");
  o.full_min_bytes = settings::get_bytes("CARAVAN_PLANNER_FULL_MIN_BYTES");
  o.max_hops = static_cast<int>(settings::get_int("CARAVAN_PLANNER_MAX_HOPS"));
  o.transit_nodes = settings::get_bool("CARAVAN_PLANNER_TRANSIT_NODES");
  o.max_paths = static_cast<int>(settings::get_int("CARAVAN_PLANNER_MAX_PATHS"));
  o.cache_entries = static_cast<std::size_t>(settings::get_int("CARAVAN_PLANNER_CACHE_ENTRIES"));
  return o;
}

std::string_view to_string(PlannerKind kind) noexcept {
  switch (kind) {
    case PlannerKind::simple: return "simple";
    case PlannerKind::full: return "full";
    case PlannerKind::multipath: return "multipath";
  }
  return "?";
}

void TransferRequest::validate() const {
  if (space.dims() < 1) throw Error(Errc::invalid_argument, "transfer: the index space is empty");
  if (fields.count() == 0) throw Error(Errc::invalid_argument, "transfer: the field space is empty");
  src_layout.validate(space.dims(), "src layout");
  dst_layout.validate(space.dims(), "dst layout");
  for (const auto& [instance, side] : {std::pair{&src_instance_space, "src"}, std::pair{&dst_instance_space, "dst"}}) {
    if (!*instance) continue;
    const IndexSpace& whole = **instance;
    if (!whole.contains(space))
      throw Error(Errc::invalid_argument,
                  fmt::format("transfer: the index space {} must lie inside the {} instance's index space {}",
                              space.to_string(), side, whole.to_string()));
  }
}

std::string Plan::route() const {
  if (hops.empty()) return "(empty)";
  std::string out = hops.front().src.to_string();
  for (const auto& h : hops) out += fmt::format(" -[{}]-> {}", to_string(h.kind), h.dst.to_string());
  return out;
}

namespace detail {

Context::Context(const TransferGraph& g, const TransferRequest& r, const PlannerOptions& o)
    : graph(g), request(r), options(o) {
  r.validate();
  src = g.require(r.src, "src memory");
  dst = g.require(r.dst, "dst memory");
  if (o.buffer_threshold == 0) throw Error(Errc::invalid_argument, "buffer threshold (TH) is 0 bytes; it must be positive");
  if (o.max_hops < 1) throw Error(Errc::invalid_argument, fmt::format("max hops is {}; it must be at least 1", o.max_hops));
  if (r.src_instance_space)
    src_run = static_cast<double>(region_run_bytes(r.src_layout, *r.src_instance_space, r.space, r.fields));
  if (r.dst_instance_space)
    dst_run = static_cast<double>(region_run_bytes(r.dst_layout, *r.dst_instance_space, r.space, r.fields));
  auto n = static_cast<std::uint32_t>(g.memory_count());
  allowed.assign(n, 0);
  limit.assign(n, 0);
  for (std::uint32_t v = 0; v < n; ++v) {
    const auto& m = g.memory(v);
    allowed[v] = o.transit_nodes || m.id.node == r.src.node || m.id.node == r.dst.node;
    double th = static_cast<double>(o.buffer_threshold);
    limit[v] = m.capacity ? std::min(th, static_cast<double>(m.capacity)) : th;
  }
  // Widest path (by peak) from every vertex to dst, backwards from dst: a max-min Dijkstra.
  reach.assign(n, 0);
  distance.assign(n, -1);
  reach[dst] = kInf;
  distance[dst] = 0;
  using Item = std::pair<double, std::uint32_t>;
  std::priority_queue<Item> heap;
  heap.push({kInf, dst});
  std::vector<char> done(n, 0);
  while (!heap.empty()) {
    auto [width, v] = heap.top();
    heap.pop();
    if (done[v]) continue;
    done[v] = 1;
    for (auto e : g.in_channels(v)) {
      const Channel& c = g.channel(e);
      if (c.self_loop() || !allowed[c.src]) continue;
      // Only vertices that can hold a buffer can be passed through.
      if (c.src != src && !buffer_ok(c.src)) continue;
      double w = std::min(width, c.peak_gbps);
      if (w > reach[c.src]) {
        reach[c.src] = w;
        heap.push({w, c.src});
      }
    }
  }
  // Hop distances, for the search's tie-break (shorter paths first).
  std::queue<std::uint32_t> queue;
  queue.push(dst);
  while (!queue.empty()) {
    auto v = queue.front();
    queue.pop();
    for (auto e : g.in_channels(v)) {
      const Channel& c = g.channel(e);
      if (c.self_loop() || !allowed[c.src] || distance[c.src] >= 0) continue;
      if (c.src != src && !buffer_ok(c.src)) continue;
      distance[c.src] = distance[v] + 1;
      queue.push(c.src);
    }
  }
  for (auto e : g.out_channels(dst))
    if (g.channel(e).self_loop()) dst_self_loop_peak = std::max(dst_self_loop_peak, g.channel(e).peak_gbps);
  // U: the best first step from src, then the widest way on.
  for (auto e : g.out_channels(src)) {
    const Channel& c = g.channel(e);
    if (c.dst == dst) upper_bound = std::max(upper_bound, c.peak_gbps);
    else if (c.self_loop()) upper_bound = std::max(upper_bound, std::min(c.peak_gbps, reach[src] > 0 && src != dst ? reach[src] : 0.0));
    else if (allowed[c.dst] && buffer_ok(c.dst)) upper_bound = std::max(upper_bound, std::min(c.peak_gbps, reach[c.dst]));
  }
}

void Context::no_plan(std::string_view planner) const {
  std::string src_name = request.src.to_string(), dst_name = request.dst.to_string();
  // Is dst reachable at all, ignoring the threshold?
  std::vector<char> seen(graph.memory_count(), 0);
  std::vector<std::uint32_t> stack{src};
  seen[src] = 1;
  bool reachable = false;
  while (!stack.empty()) {
    auto v = stack.back();
    stack.pop_back();
    for (auto e : graph.out_channels(v)) {
      auto w = graph.channel(e).dst;
      if (w == dst) reachable = true;
      if (!seen[w] && allowed[w]) {
        seen[w] = 1;
        stack.push_back(w);
      }
    }
  }
  if (!reachable)
    throw Error(Errc::invalid_argument,
                fmt::format("{} planner: no path from {} to {} in machine '{}'{}", planner, src_name, dst_name, graph.name(),
                            options.transit_nodes ? "" : " through memories of their own nodes (CARAVAN_PLANNER_TRANSIT_NODES=0)"));
  throw Error(Errc::invalid_argument,
              fmt::format("{} planner: buffer threshold TH = {} bytes is too small for any path from {} to {} within {} hops: "
                          "every path needs an intermediate buffer of at least one {}-byte field value (and, where two "
                          "buffers meet, the layout conversion's shuffle size)",
                          planner, options.buffer_threshold, src_name, dst_name, options.max_hops, request.fields.max_size()));
}

Plan make_plan(const Context& ctx, PlannerKind planner, std::span<const Step> steps, bool* valid) {
  const auto& g = ctx.graph;
  const auto& r = ctx.request;
  Plan plan;
  plan.planner = planner;
  plan.src = r.src;
  plan.dst = r.dst;
  plan.bytes = r.bytes();
  plan.buffer_threshold = ctx.options.buffer_threshold;
  plan.upper_bound_gbps = ctx.upper_bound;
  bool ok = true;
  std::size_t n = steps.size();
  plan.hops.reserve(n);
  Layout previous = r.src_layout;
  for (std::size_t i = 0; i < n; ++i) {
    const Channel& c = g.channel(steps[i].channel);
    Hop h;
    h.channel = steps[i].channel;
    h.kind = c.kind;
    h.src = g.memory(c.src).id;
    h.dst = g.memory(c.dst).id;
    h.src_layout = previous;
    h.dst_layout = i + 1 == n ? r.dst_layout : steps[i].layout;
    h.src_is_buffer = i > 0;
    h.dst_is_buffer = i + 1 < n;
    h.prefix_bytes = prefix_bytes(h.src_layout, h.dst_layout, r.space, r.fields);
    const double run_cap = ctx.run_cap(h.src_is_buffer, h.dst_is_buffer);
    if (run_cap < static_cast<double>(h.prefix_bytes)) h.prefix_bytes = static_cast<std::uint64_t>(run_cap);
    h.shuffle_bytes = shuffle_bytes(h.src_layout, h.dst_layout, r.space, r.fields);
    double cap = kInf;
    if (h.src_is_buffer) cap = std::min(cap, ctx.limit[c.src]);
    if (h.dst_is_buffer) cap = std::min(cap, ctx.limit[c.dst]);
    h.request_bytes = cap < static_cast<double>(h.prefix_bytes) ? static_cast<std::uint64_t>(cap) : h.prefix_bytes;
    h.gbps = c.tp(static_cast<double>(h.request_bytes));
    if (h.src_is_buffer && h.dst_is_buffer && static_cast<double>(h.shuffle_bytes) > cap) ok = false;
    previous = h.dst_layout;
    plan.hops.push_back(std::move(h));
  }
  for (std::size_t i = 1; i < n; ++i) {
    const Hop& in = plan.hops[i - 1];
    const Hop& out = plan.hops[i];
    std::uint64_t bytes = std::max<std::uint64_t>({r.fields.max_size(), in.request_bytes, out.request_bytes});
    if (in.src_is_buffer) bytes = std::max(bytes, in.shuffle_bytes);
    if (out.dst_is_buffer) bytes = std::max(bytes, out.shuffle_bytes);
    if (static_cast<double>(bytes) > ctx.limit[g.channel(steps[i - 1].channel).dst]) ok = false;
    plan.buffers.push_back({in.dst, in.dst_layout, bytes});
  }
  // Throughput: every hop runs at once (pipelined), so the slowest hop bounds the path, and a
  // resource used by k hops gives each at most capacity / k.
  plan.predicted_gbps = kInf;
  for (std::size_t i = 0; i < n; ++i) {
    if (plan.hops[i].gbps < plan.predicted_gbps) {
      plan.predicted_gbps = plan.hops[i].gbps;
      plan.bottleneck = fmt::format("hop {} ({} {} -> {}, {} B requests)", i, to_string(plan.hops[i].kind),
                                    plan.hops[i].src.to_string(), plan.hops[i].dst.to_string(), plan.hops[i].request_bytes);
    }
  }
  std::vector<std::pair<std::uint32_t, int>> uses;
  for (const auto& s : steps)
    for (auto res : g.channel(s.channel).resources) {
      auto it = std::find_if(uses.begin(), uses.end(), [&](const auto& u) { return u.first == res; });
      if (it == uses.end()) uses.push_back({res, 1});
      else ++it->second;
    }
  for (const auto& [res, count] : uses) {
    double share = g.resource(res).gbps / count;
    if (share < plan.predicted_gbps) {
      plan.predicted_gbps = share;
      plan.bottleneck = fmt::format("resource {} ({} GB/s shared by {} hops)", g.resource(res).name, g.resource(res).gbps, count);
    }
  }
  if (valid) *valid = ok;
  return plan;
}

}  // namespace detail
}  // namespace caravan::planner
