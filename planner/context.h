// Private: what every planner computes first for one request, and the Plan assembly they share.
#pragma once

#include "planner/model.h"

#include <caravan/planner/planner.h>

#include <span>
#include <vector>

namespace caravan::planner::detail {

// One step of a path: the channel taken and the layout the data has where it lands.
struct Step {
  std::uint32_t channel = 0;
  Layout layout;
};

struct Context {
  Context(const TransferGraph& graph, const TransferRequest& request, const PlannerOptions& options);

  const TransferGraph& graph;
  const TransferRequest& request;
  const PlannerOptions& options;
  std::uint32_t src = 0, dst = 0;  // vertices
  std::vector<char> allowed;       // vertices a path may use (the transit-node rule)
  std::vector<double> limit;       // the most an intermediate buffer may hold there: min(TH, capacity)
  std::vector<double> reach;       // widest path by peak from each vertex to dst (dst: infinity)
  std::vector<int> distance;       // fewest hops from each vertex to dst (-1: unreachable)
  double dst_self_loop_peak = 0;   // best self-loop at dst (to finish from a buffer in dst)
  double upper_bound = 0;          // U
  // The longest runs the region's points keep in the source and destination instances
  // (region_run_bytes; infinity when the request is a whole instance): a hop reading the source or
  // writing the destination cannot send larger requests than these.
  double src_run = kInf, dst_run = kInf;

  double run_cap(bool from_buffer, bool to_buffer) const {
    return std::min(from_buffer ? kInf : src_run, to_buffer ? kInf : dst_run);
  }

  bool buffer_ok(std::uint32_t v) const { return allowed[v] && limit[v] >= static_cast<double>(request.fields.max_size()); }
  // Error(invalid_argument) explaining why no plan exists (unreachable, or the threshold).
  [[noreturn]] void no_plan(std::string_view planner) const;
};

// Assembles a Plan from a path and the layouts along it: PREFIX, SUFFIX-bar and request sizes
// per hop (through the public layout functions), buffer sizes, shared-resource bounds, the
// bottleneck. Returns false in `valid` if a buffer would exceed its limit.
Plan make_plan(const Context& ctx, PlannerKind planner, std::span<const Step> steps, bool* valid = nullptr);

}  // namespace caravan::planner::detail
