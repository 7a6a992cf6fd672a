// Planner: the cache in front of the simple and full planners.
#include "planner/context.h"

#include <caravan/error.h>

#include <algorithm>
#include <numeric>

namespace caravan::planner {
namespace {

// The largest divisor of n that is at most c, from the divisor pairs (d, n / d) with d up to
// sqrt(n): a cached block near 2^28 over a prime extent would otherwise count down 2^28 times
// on every copy.
std::uint64_t divisor_at_most(std::uint64_t n, std::uint64_t c) {
  if (n <= c) return n;
  std::uint64_t best = 1;
  for (std::uint64_t d = 1; d <= n / d; ++d) {
    if (n % d != 0) continue;
    if (d <= c) best = std::max(best, d);
    if (n / d <= c) best = std::max(best, n / d);
  }
  return best;
}

// A cached plan's path with its layouts fitted to another index space of the same size class:
// blocks that no longer divide their extent shrink to the nearest divisor below.
std::optional<Plan> retarget(const TransferGraph& graph, const TransferRequest& request, const PlannerOptions& options,
                             const Plan& cached) {
  detail::Context ctx(graph, request, options);
  std::vector<detail::Step> steps;
  for (const auto& hop : cached.hops) {
    Layout fitted;
    for (const auto& c : hop.dst_layout) {
      if (c.kind == LayoutComponent::Kind::dim_in) {
        auto ext = static_cast<std::uint64_t>(request.space.extent(c.dim));
        fitted.push_back(LayoutComponent::inner(c.dim, divisor_at_most(ext, c.block)));
      } else {
        fitted.push_back(c);
      }
    }
    steps.push_back({hop.channel, fitted});
  }
  bool valid = true;
  Plan plan = detail::make_plan(ctx, cached.planner, steps, &valid);
  if (!valid) return std::nullopt;
  return plan;
}

// A fitted plan is kept if it predicts at least this share of the cached plan's rate.
constexpr double kRetargetKeeps = 0.9;

}  // namespace

Planner::Planner(std::shared_ptr<const TransferGraph> graph, PlannerOptions options)
    : graph_(std::move(graph)), options_(options), cache_(options.cache_entries) {
  if (!graph_) throw Error(Errc::invalid_argument, "Planner: the transfer graph is null");
}

std::shared_ptr<const Plan> Planner::plan(const TransferRequest& request) {
  PlannerKind kind = request.bytes() >= options_.full_min_bytes ? PlannerKind::full : PlannerKind::simple;
  auto key = PathCacheKey::of(request, kind);
  if (auto hit = cache_.lookup(key)) {
    // The same space (and whole instances): the cached plan as it is. A region's instances may
    // differ within the key's run classes, so its predictions are recomputed below.
    if (hit->space == request.space && !request.src_instance_space && !request.dst_instance_space) return hit->plan;
    // The cached path with its blocks fitted to this space, unless fitting cost it much of its
    // rate (a block that no longer divides the extent can shrink to 1 and leave a hop with
    // one-value requests): then a plan of its own. Either replaces the entry.
    if (auto fitted = retarget(*graph_, request, options_, *hit->plan);
        fitted && fitted->predicted_gbps >= kRetargetKeeps * hit->plan->predicted_gbps) {
      auto plan = std::make_shared<const Plan>(std::move(*fitted));
      cache_.insert(key, request.space, plan);
      return plan;
    }
  }
  auto plan = std::make_shared<const Plan>(kind == PlannerKind::full ? plan_full(*graph_, request, options_)
                                                                     : plan_simple(*graph_, request, options_));
  cache_.insert(key, request.space, plan);
  return plan;
}

MultiPlan Planner::plan_multipath(const TransferRequest& request) const {
  return planner::plan_multipath(*graph_, request, options_);
}

}  // namespace caravan::planner
