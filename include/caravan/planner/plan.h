// What a planner is asked (TransferRequest) and what it answers (Plan, MultiPlan).
//
// A plan is the path of Isometry section 4.2: <(m_s, l_s), (m_1, l_1), ..., (m_n, l_n), (m_d, l_d)>.
// Each consecutive pair is one Hop, which the DMA engine turns into one transfer descriptor (XD)
// on the hop's channel; each (m_i, l_i) in between is an intermediate Buffer that the DMA engine
// allocates (at most buffer_threshold bytes) and pipelines through.
#pragma once

#include <caravan/layout.h>
#include <caravan/machine.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace caravan::planner {

class TransferGraph;

// A copy of one instance (space x fields) from (src, src_layout) to (dst, dst_layout).
struct TransferRequest {
  MemoryId src, dst;
  IndexSpace space;
  FieldSpace fields;
  Layout src_layout, dst_layout;
  // When `space` is a region of larger instances (CopyOptions::region): their index spaces, which
  // the layouts describe. A region narrower than its instance along a dimension leaves its rows
  // apart there, and that bounds the runs the first hop can read and the last can write (see
  // region_run_bytes). Unset: that instance is `space` itself.
  std::optional<IndexSpace> src_instance_space, dst_instance_space;

  // Payload bytes: points x |F| (padding excluded).
  std::uint64_t bytes() const noexcept { return space.volume() * fields.total_size(); }
  // Checks that both layouts describe this instance; throws Error(invalid_argument) naming the
  // layout ("src layout" / "dst layout") and the rule.
  void validate() const;
};

enum class PlannerKind : std::uint8_t { simple, full, multipath };
std::string_view to_string(PlannerKind kind) noexcept;

struct Hop {
  std::uint32_t channel = 0;  // TransferGraph::channel(channel)
  ChannelKind kind = ChannelKind::memcpy;
  MemoryId src, dst;
  Layout src_layout, dst_layout;
  bool src_is_buffer = false;  // the hop reads an intermediate buffer (not the source instance)
  bool dst_is_buffer = false;  // the hop writes an intermediate buffer (not the destination)
  std::uint64_t prefix_bytes = 0;   // PREFIX(l_i, l_i+1): longest run both layouts keep contiguous
  std::uint64_t shuffle_bytes = 0;  // SUFFIX-bar(l_i, l_i+1); <= the threshold when both ends are buffers
  std::uint64_t request_bytes = 0;  // request size to send: PREFIX, capped by the buffers it touches
  double gbps = 0;                  // tp(request_bytes) of the channel
  bool converts() const noexcept { return !(src_layout == dst_layout); }
};

// An intermediate buffer between hops i-1 and i (buffers[i-1] sits between hops[i-1] and hops[i]).
struct Buffer {
  MemoryId memory;
  Layout layout;
  std::uint64_t bytes = 0;  // the least that keeps the plan's throughput; never above the threshold
};

struct Plan {
  PlannerKind planner = PlannerKind::full;
  MemoryId src, dst;
  std::vector<Hop> hops;
  std::vector<Buffer> buffers;  // hops.size() - 1 entries
  std::uint64_t bytes = 0;             // payload of the transfer
  std::uint64_t buffer_threshold = 0;  // TH the plan was made under
  double predicted_gbps = 0;  // min over hops of tp(request) and over shared resources of capacity / uses
  double upper_bound_gbps = 0;  // U: the widest path by peak bandwidth (section 4.2)
  std::string bottleneck;       // what limits predicted_gbps, e.g. "hop 2 (nic)" or "resource node0/nic.out"
  bool exhaustive = true;       // false if the full planner stopped at its search budget
  std::uint64_t paths_evaluated = 0;  // complete (path, layouts) candidates solved

  // "node0/rank0/fbm -[sdma]-> node0/rank0/zcm -[memcpy]-> ..."
  std::string route() const;
};

// Multi-path: the instance is cut along one dimension into pieces, each moved by its own plan
// at the same time.
struct PathShare {
  Plan plan;
  Rect piece;                // the part of the index space this path moves
  std::uint64_t bytes = 0;
  double gbps = 0;           // the rate this path is given (the LP's share, not its solo rate)
};

struct MultiPlan {
  std::vector<PathShare> shares;
  int split_dim = -1;               // the dimension the pieces are cut along; -1: one share
  double predicted_gbps = 0;        // bytes / time of the slowest share
  double best_single_gbps = 0;      // the full planner's single path
  double max_flow_gbps = 0;         // max-flow bound over the transfer graph (peaks, shared links once)
  std::uint64_t bytes = 0;
};

// Human-readable and JSON renderings (what `caravan plan` prints). The graph supplies resource
// names; it may be null.
std::string to_text(const Plan& plan);
std::string to_json(const Plan& plan);
std::string to_text(const MultiPlan& plan);
std::string to_json(const MultiPlan& plan);

}  // namespace caravan::planner
