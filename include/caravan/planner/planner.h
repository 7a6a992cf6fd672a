// The path planners (Isometry section 4) and the Planner that fronts them with a cache.
//
//   plan_full      section 4.2: every acyclic path (a self-loop at most once per memory), layouts
//                  per hop chosen among the source, destination and tiled layouts, blocking factors
//                  solved from constraints that are linear in their logarithms, the best
//                  throughput of each path found by binary search, and best-first search pruned
//                  by upper bounds (the breadth-first bound U first of all).
//   plan_simple    section 4.4: the shortest path, converting layouts once, on a memcpy channel.
//   plan_multipath beyond the paper: split one transfer over several paths at once, in proportion
//                  to what each can carry with shared hardware counted once (max-flow + LP).
//
// All take the graph and the request and throw caravan::Error: not_found for a memory the
// machine lacks, invalid_argument for layouts that do not describe the instance, no path between
// the memories, or a buffer threshold too small for any path.
#pragma once

#include <caravan/planner/path_cache.h>
#include <caravan/planner/plan.h>
#include <caravan/planner/transfer_graph.h>

#include <cstdint>
#include <memory>
#include <span>

namespace caravan::planner {

struct PlannerOptions {
  std::uint64_t buffer_threshold = 32ull << 20;  // TH: no intermediate buffer is larger
  std::uint64_t full_min_bytes = 16ull << 20;    // Planner::plan uses plan_full from this size up
  int max_hops = 6;                              // longest path considered (self-loops count)
  bool transit_nodes = false;  // may paths pass through memories of nodes other than src's and dst's?
  int max_paths = 8;           // multi-path: most paths one transfer is split over
  std::size_t cache_entries = 4096;

  // The CARAVAN_PLANNER_* settings (see `caravan config`).
  static PlannerOptions from_settings();
};

Plan plan_full(const TransferGraph& graph, const TransferRequest& request, const PlannerOptions& options = {});
Plan plan_simple(const TransferGraph& graph, const TransferRequest& request, const PlannerOptions& options = {});
MultiPlan plan_multipath(const TransferGraph& graph, const TransferRequest& request, const PlannerOptions& options = {});

// Cuts `plan`'s pieces of `space` again along plan.split_dim, in proportion to `rates` (GB/s, one
// per share, each > 0), keeping the paths; a share that rounds to no rows is dropped. Sets each
// share's piece, bytes and gbps and the plan's predicted_gbps (the slowest share at those rates).
// plan_multipath cuts by the LP's rates; the DMA engine cuts again by the rates it measured the
// paths at (CARAVAN_DMA_MULTIPATH_LEARN). Throws Error(invalid_argument) for a rate count other
// than the share count, a rate that is not a positive number, or a plan with no split dimension.
void spread_shares(MultiPlan& plan, const Rect& space, std::span<const double> rates);

// The max-flow from src to dst with every channel at its peak and every shared resource counted
// once: no split of one transfer over paths can beat it.
double max_flow_bound(const TransferGraph& graph, MemoryId src, MemoryId dst, const PlannerOptions& options = {});

// What the DMA engine holds: the graph, the options, and the cache. Thread-safe.
class Planner {
 public:
  explicit Planner(std::shared_ptr<const TransferGraph> graph, PlannerOptions options = PlannerOptions::from_settings());

  // A cached plan, or a new one: plan_simple below options().full_min_bytes, plan_full from there.
  std::shared_ptr<const Plan> plan(const TransferRequest& request);
  MultiPlan plan_multipath(const TransferRequest& request) const;

  const TransferGraph& graph() const noexcept { return *graph_; }
  const PlannerOptions& options() const noexcept { return options_; }
  PathCache& cache() noexcept { return cache_; }

 private:
  std::shared_ptr<const TransferGraph> graph_;
  PlannerOptions options_;
  PathCache cache_;
};

}  // namespace caravan::planner
