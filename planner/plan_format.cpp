// How plans print: `caravan plan` shows these.
#include <caravan/planner/plan.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>

namespace caravan::planner {
namespace {

std::string bytes_text(std::uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  if (u == 0) return fmt::format("{} B", b);
  return fmt::format("{:.4g} {}", v, units[u]);
}

nlohmann::json hop_json(const Hop& h) {
  return {{"channel", h.channel},
          {"kind", std::string(to_string(h.kind))},
          {"src", h.src.to_string()},
          {"dst", h.dst.to_string()},
          {"src_layout", h.src_layout.to_string()},
          {"dst_layout", h.dst_layout.to_string()},
          {"src_is_buffer", h.src_is_buffer},
          {"dst_is_buffer", h.dst_is_buffer},
          {"prefix_bytes", h.prefix_bytes},
          {"shuffle_bytes", h.shuffle_bytes},
          {"request_bytes", h.request_bytes},
          {"gbps", h.gbps}};
}

nlohmann::json plan_json(const Plan& p) {
  nlohmann::json hops = nlohmann::json::array(), buffers = nlohmann::json::array();
  for (const auto& h : p.hops) hops.push_back(hop_json(h));
  for (const auto& b : p.buffers)
    buffers.push_back({{"memory", b.memory.to_string()}, {"layout", b.layout.to_string()}, {"bytes", b.bytes}});
  return {{"planner", std::string(to_string(p.planner))},
          {"src", p.src.to_string()},
          {"dst", p.dst.to_string()},
          {"route", p.route()},
          {"bytes", p.bytes},
          {"buffer_threshold", p.buffer_threshold},
          {"predicted_gbps", p.predicted_gbps},
          {"upper_bound_gbps", p.upper_bound_gbps},
          {"bottleneck", p.bottleneck},
          {"exhaustive", p.exhaustive},
          {"paths_evaluated", p.paths_evaluated},
          {"hops", hops},
          {"buffers", buffers}};
}

}  // namespace

std::string to_text(const Plan& p) {
  std::string out = fmt::format("{} plan: {} -> {}, {}\n", to_string(p.planner), p.src.to_string(), p.dst.to_string(), bytes_text(p.bytes));
  out += fmt::format("route: {}\n", p.route());
  // Columns as wide as their widest entry, so long blocked layouts stay aligned.
  std::size_t wm = 4, wl = 10;
  for (const auto& h : p.hops) {
    wm = std::max({wm, h.src.to_string().size() + 1, h.dst.to_string().size() + 1});
    wl = std::max({wl, h.src_layout.to_string().size(), h.dst_layout.to_string().size()});
  }
  out += fmt::format("{:<4} {:<11} {:<{}} {:<{}} {:<{}} {:<{}} {:>10} {:>10} {:>10} {:>8}\n", "hop", "channel", "from", wm, "to", wm,
                     "src layout", wl, "dst layout", wl, "PREFIX", "shuffle", "request", "GB/s");
  for (std::size_t i = 0; i < p.hops.size(); ++i) {
    const Hop& h = p.hops[i];
    out += fmt::format("{:<4} {:<11} {:<{}} {:<{}} {:<{}} {:<{}} {:>10} {:>10} {:>10} {:>8.3f}\n", i, to_string(h.kind),
                       h.src.to_string() + (h.src_is_buffer ? "*" : ""), wm, h.dst.to_string() + (h.dst_is_buffer ? "*" : ""), wm,
                       h.src_layout.to_string(), wl, h.dst_layout.to_string(), wl, bytes_text(h.prefix_bytes),
                       bytes_text(h.shuffle_bytes), bytes_text(h.request_bytes), h.gbps);
  }
  out += "(* = intermediate buffer; shuffle = SUFFIX-bar, bounded by the threshold where both ends are buffers)\n";
  for (const auto& b : p.buffers)
    out += fmt::format("buffer {} layout {} : {} (threshold {})\n", b.memory.to_string(), b.layout.to_string(), bytes_text(b.bytes),
                       bytes_text(p.buffer_threshold));
  out += fmt::format("predicted {:.3f} GB/s (upper bound U {:.3f} GB/s); bottleneck: {}\n", p.predicted_gbps, p.upper_bound_gbps,
                     p.bottleneck);
  if (p.planner == PlannerKind::full)
    out += fmt::format("full search: {} candidate path{} solved{}\n", p.paths_evaluated,
                       p.paths_evaluated == 1 ? "" : "s", p.exhaustive ? "" : " (search budget reached)");
  return out;
}

std::string to_json(const Plan& p) { return plan_json(p).dump(2); }

std::string to_text(const MultiPlan& m) {
  std::string out = fmt::format("multipath plan: {} path(s), {}, split along dimension {}\n", m.shares.size(), bytes_text(m.bytes),
                                m.split_dim >= 0 ? std::string(1, dim_name(m.split_dim)) : std::string("-"));
  for (std::size_t i = 0; i < m.shares.size(); ++i) {
    const auto& s = m.shares[i];
    out += fmt::format("\n-- path {}: {} of the data ({}), {:.3f} GB/s, piece {}\n", i, bytes_text(s.bytes),
                       fmt::format("{:.1f}%", 100.0 * static_cast<double>(s.bytes) / static_cast<double>(std::max<std::uint64_t>(m.bytes, 1))),
                       s.gbps, s.piece.to_string());
    // The route's plan text without its own header, which names the whole copy: its hops,
    // buffers and prediction are as the planner solved the route for all of it.
    const std::string route_text = to_text(s.plan);
    const std::size_t first_line = route_text.find('\n');
    out += fmt::format(
        "(the route's plan, solved for the whole {} copy: its PREFIX and request sizes are the "
        "whole copy's; this path moves {})\n",
        bytes_text(m.bytes), bytes_text(s.bytes));
    out += first_line == std::string::npos ? route_text : route_text.substr(first_line + 1);
  }
  out += fmt::format("\npredicted {:.3f} GB/s over all paths; best single path {:.3f} GB/s; max-flow bound {:.3f} GB/s\n",
                     m.predicted_gbps, m.best_single_gbps, m.max_flow_gbps);
  return out;
}

std::string to_json(const MultiPlan& m) {
  nlohmann::json shares = nlohmann::json::array();
  for (const auto& s : m.shares)
    shares.push_back({{"piece", s.piece.to_string()}, {"bytes", s.bytes}, {"gbps", s.gbps}, {"plan", plan_json(s.plan)}});
  nlohmann::json out{{"planner", "multipath"},
                     {"bytes", m.bytes},
                     {"split_dim", m.split_dim},
                     {"predicted_gbps", m.predicted_gbps},
                     {"best_single_gbps", m.best_single_gbps},
                     {"max_flow_gbps", m.max_flow_gbps},
                     {"shares", shares}};
  return out.dump(2);
}

}  // namespace caravan::planner
