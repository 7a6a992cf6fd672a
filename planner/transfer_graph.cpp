#include "planner/graph_impl.h"

#include <caravan/error.h>

#include <fmt/format.h>

#include <algorithm>

namespace caravan::planner {

TransferGraph::TransferGraph(const MachineDescription& machine) : impl_(std::make_unique<Impl>()) {
  Impl& g = *impl_;
  g.description = machine;
  auto where = [&] { return fmt::format("machine '{}'", machine.name); };
  for (const auto& m : machine.memories) {
    auto vertex = static_cast<std::uint32_t>(g.memories.size());
    if (!g.by_id.emplace(m.id.key(), vertex).second)
      throw Error(Errc::invalid_argument, fmt::format("{}: memory {} is declared twice", where(), m.id.to_string()));
    g.memories.push_back({m.id, m.capacity});
    boost::add_vertex(VertexProps{vertex}, g.graph);
  }
  std::unordered_map<std::string, std::uint32_t> resource_index;
  for (const auto& r : machine.resources) {
    if (!(r.gbps > 0))
      throw Error(Errc::invalid_argument, fmt::format("{}: resource '{}' has capacity {} GB/s, must be positive", where(), r.name, r.gbps));
    if (!resource_index.emplace(r.name, static_cast<std::uint32_t>(g.resources.size())).second)
      throw Error(Errc::invalid_argument, fmt::format("{}: resource '{}' is declared twice", where(), r.name));
    g.resources.push_back({r.name, r.gbps});
  }
  for (std::size_t i = 0; i < machine.channels.size(); ++i) {
    const auto& c = machine.channels[i];
    auto end = [&](MemoryId id, const char* side) {
      auto it = g.by_id.find(id.key());
      if (it == g.by_id.end())
        throw Error(Errc::invalid_argument, fmt::format("{}: channel {} ({} {} -> {}): {} memory {} is not declared", where(), i,
                                                        to_string(c.kind), c.src.to_string(), c.dst.to_string(), side, id.to_string()));
      return it->second;
    };
    Channel ch;
    ch.kind = c.kind;
    ch.src = end(c.src, "src");
    ch.dst = end(c.dst, "dst");
    ch.tp = c.tp;
    if (ch.tp.samples().empty())
      throw Error(Errc::invalid_argument, fmt::format("{}: channel {} ({} {} -> {}) has no throughput table", where(), i,
                                                      to_string(c.kind), c.src.to_string(), c.dst.to_string()));
    ch.peak_gbps = ch.tp.peak();
    for (const auto& name : c.shares) {
      auto it = resource_index.find(name);
      if (it == resource_index.end())
        throw Error(Errc::invalid_argument, fmt::format("{}: channel {} ({} {} -> {}) shares resource '{}', which is not declared", where(), i,
                                                        to_string(c.kind), c.src.to_string(), c.dst.to_string(), name));
      if (std::find(ch.resources.begin(), ch.resources.end(), it->second) == ch.resources.end()) ch.resources.push_back(it->second);
      ch.peak_gbps = std::min(ch.peak_gbps, g.resources[it->second].gbps);
    }
    auto index = static_cast<std::uint32_t>(g.channels.size());
    g.channels.push_back(std::move(ch));
    boost::add_edge(g.channels.back().src, g.channels.back().dst, EdgeProps{index}, g.graph);
  }
  // Flat adjacency for the planners' inner loops, in Boost's edge order.
  auto n = g.memories.size();
  g.out_offsets.assign(n + 1, 0);
  g.in_offsets.assign(n + 1, 0);
  for (std::uint32_t v = 0; v < n; ++v) {
    g.out_offsets[v + 1] = g.out_offsets[v] + static_cast<std::uint32_t>(boost::out_degree(v, g.graph));
    g.in_offsets[v + 1] = g.in_offsets[v] + static_cast<std::uint32_t>(boost::in_degree(v, g.graph));
    for (auto [it, last] = boost::out_edges(v, g.graph); it != last; ++it) g.out_list.push_back(g.graph[*it].channel);
    for (auto [it, last] = boost::in_edges(v, g.graph); it != last; ++it) g.in_list.push_back(g.graph[*it].channel);
  }
}

TransferGraph::~TransferGraph() = default;
TransferGraph::TransferGraph(TransferGraph&&) noexcept = default;
TransferGraph& TransferGraph::operator=(TransferGraph&&) noexcept = default;

const std::string& TransferGraph::name() const noexcept { return impl_->description.name; }
const MachineDescription& TransferGraph::description() const noexcept { return impl_->description; }
std::size_t TransferGraph::memory_count() const noexcept { return impl_->memories.size(); }
const Memory& TransferGraph::memory(std::uint32_t vertex) const { return impl_->memories.at(vertex); }

std::optional<std::uint32_t> TransferGraph::find(MemoryId id) const noexcept {
  auto it = impl_->by_id.find(id.key());
  if (it == impl_->by_id.end()) return std::nullopt;
  return it->second;
}

std::uint32_t TransferGraph::require(MemoryId id, std::string_view what) const {
  if (auto v = find(id)) return *v;
  std::string known;
  int listed = 0;
  for (const auto& m : impl_->memories) {
    if (m.id.node != id.node) continue;
    if (listed++ == 12) {
      known += ", ...";
      break;
    }
    known += (known.empty() ? "" : ", ") + m.id.to_string();
  }
  if (known.empty()) known = fmt::format("none on node{}", id.node);
  throw Error(Errc::not_found, fmt::format("{} {} is not a memory of machine '{}' (memories of node{}: {})", what, id.to_string(),
                                           impl_->description.name, id.node, known));
}

std::size_t TransferGraph::channel_count() const noexcept { return impl_->channels.size(); }
const Channel& TransferGraph::channel(std::uint32_t index) const { return impl_->channels.at(index); }

std::span<const std::uint32_t> TransferGraph::out_channels(std::uint32_t vertex) const {
  const auto& g = *impl_;
  return {g.out_list.data() + g.out_offsets[vertex], g.out_offsets[vertex + 1] - g.out_offsets[vertex]};
}

std::span<const std::uint32_t> TransferGraph::in_channels(std::uint32_t vertex) const {
  const auto& g = *impl_;
  return {g.in_list.data() + g.in_offsets[vertex], g.in_offsets[vertex + 1] - g.in_offsets[vertex]};
}

std::size_t TransferGraph::resource_count() const noexcept { return impl_->resources.size(); }
const Resource& TransferGraph::resource(std::uint32_t index) const { return impl_->resources.at(index); }

}  // namespace caravan::planner
