// Private: the transfer graph's storage. The Boost.Graph adjacency list is the graph of record
// (Boost's BFS and push-relabel run on it); flat per-vertex channel lists beside it serve the
// planners' inner loops, where Boost's iterator layers would cost more than the work they do.
#pragma once

#include <caravan/planner/transfer_graph.h>

#include <boost/graph/adjacency_list.hpp>

#include <unordered_map>

namespace caravan::planner {

struct VertexProps {
  std::uint32_t index = 0;
};
struct EdgeProps {
  std::uint32_t channel = 0;  // index into TransferGraph::channel()
};
using BoostGraph = boost::adjacency_list<boost::vecS, boost::vecS, boost::bidirectionalS, VertexProps, EdgeProps>;

struct TransferGraph::Impl {
  MachineDescription description;
  std::vector<Memory> memories;
  std::vector<Channel> channels;
  std::vector<Resource> resources;
  std::unordered_map<std::uint64_t, std::uint32_t> by_id;  // MemoryId::key() -> vertex
  BoostGraph graph;
  std::vector<std::uint32_t> out_offsets, out_list;  // CSR: channels leaving each vertex
  std::vector<std::uint32_t> in_offsets, in_list;
};

}  // namespace caravan::planner
