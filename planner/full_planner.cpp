// The full planner (Isometry section 4.2), as a best-first branch-and-bound search.
//
// A search state is a partial path with a layout chosen for every buffer so far. Its bound is
// an upper bound on the throughput of any completion: the smallest, over its hops, of the
// channel's tp at the largest request the hop's layouts allow (blocking factors at their most
// favourable), and the widest way on from its last memory by peak bandwidth. States are expanded
// best bound first (ties: shorter total path, then deeper), so the first complete path whose
// solved throughput reaches the breadth-first bound U ends the search, and any state whose bound
// does not beat the best solved path is dropped. A complete path is solved exactly: its blocking
// factors by binary search on throughput over the log-linear constraints (model.cpp). The
// result is the optimum over every acyclic path (self-loops at most once per memory) of at most
// max_hops hops and every assignment of candidate layouts (model.h) to its buffers.
#include "planner/context.h"

#include <caravan/error.h>

#include "runtime/log.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <queue>

namespace caravan::planner {
namespace {

using detail::Context;
using detail::HopConstraint;
using detail::kInf;
using detail::Model;

// Beyond this many states the search stops with the best path found so far (Plan::exhaustive).
constexpr std::size_t kMaxStates = 1u << 21;

struct State {
  int parent = -1;
  std::uint32_t vertex = 0;
  std::uint32_t channel = 0;  // the channel that led here
  std::int16_t layout = 0;    // candidate layout of the buffer here
  std::uint8_t depth = 0;
  bool self_loop_in = false;  // reached through a self-loop
  double bound = 0;
};

struct Queued {
  double bound;
  int length;  // depth + fewest remaining hops
  int depth;
  int state;
  bool operator<(const Queued& o) const {
    if (bound != o.bound) return bound < o.bound;
    if (length != o.length) return length > o.length;
    return depth < o.depth;
  }
};

class FullSearch {
 public:
  FullSearch(const Context& ctx, const Model& model) : ctx_(ctx), g_(ctx.graph), m_(model) {}

  void run() {
    states_.reserve(4096);
    State root;
    root.vertex = ctx_.src;
    root.layout = static_cast<std::int16_t>(m_.src);
    root.bound = ctx_.upper_bound;
    states_.push_back(root);
    queue_.push({root.bound, 0, 0, 0});
    while (!queue_.empty()) {
      Queued q = queue_.top();
      queue_.pop();
      if (done() || q.bound <= best_ * (1 + 1e-9)) break;
      expand(q.state);
      if (states_.size() >= kMaxStates) {
        exhaustive_ = false;
        break;
      }
    }
  }

  bool found() const { return best_state_ >= 0; }
  double best() const { return best_; }
  bool exhaustive() const { return exhaustive_; }
  std::uint64_t evaluated() const { return evaluated_; }

  // The best path as steps with concrete layouts.
  std::vector<detail::Step> best_steps() const {
    std::vector<int> chain;
    for (int s = best_state_; s > 0; s = states_[static_cast<std::size_t>(s)].parent) chain.push_back(s);
    std::reverse(chain.begin(), chain.end());
    std::vector<detail::Step> steps;
    for (int s : chain) {
      const State& st = states_[static_cast<std::size_t>(s)];
      steps.push_back({st.channel, m_.layout(st.layout, best_index_)});
    }
    return steps;
  }

 private:
  bool done() const { return best_ >= ctx_.upper_bound * (1 - 1e-9); }

  bool on_path(int state, std::uint32_t vertex, bool skip_root) const {
    for (int s = state; s >= 0; s = states_[static_cast<std::size_t>(s)].parent) {
      if (s == 0 && skip_root) break;
      if (states_[static_cast<std::size_t>(s)].vertex == vertex) return true;
    }
    return false;
  }

  double hop_bound(const Channel& c, int a, int b, double cap) const {
    double request = std::min(std::exp2(m_.pair(a, b).max_request_log2), cap);
    return std::min(c.peak_gbps, c.tp(request));
  }

  void expand(int index) {
    const State cur = states_[static_cast<std::size_t>(index)];
    bool cur_is_buffer = index != 0;
    int depth = cur.depth + 1;
    if (depth > ctx_.options.max_hops) return;
    // A buffer in dst can only be finished through dst's self-loop.
    bool finish_only = cur_is_buffer && cur.vertex == ctx_.dst;
    for (auto e : g_.out_channels(cur.vertex)) {
      const Channel& c = g_.channel(e);
      std::uint32_t w = c.dst;
      if (!ctx_.allowed[w]) continue;
      bool self = c.self_loop();
      if (finish_only && !self) continue;
      if (self && cur.self_loop_in) continue;  // a self-loop at most once per memory
      double cap_from = cur_is_buffer ? ctx_.limit[cur.vertex] : kInf;
      // Finish at dst.
      if (w == ctx_.dst) {
        bool allowed = self ? true : !on_path(index, w, /*skip_root=*/ctx_.src == ctx_.dst);
        if (allowed) {
          double bound = std::min(
              cur.bound, hop_bound(c, cur.layout, m_.dst, std::min(cap_from, ctx_.run_cap(cur_is_buffer, false))));
          if (bound > best_ * (1 + 1e-9)) complete(index, e, bound);
          if (done()) return;
        }
      }
      // Continue through a buffer at w.
      if (depth >= ctx_.options.max_hops || !ctx_.buffer_ok(w)) continue;
      if (!self && on_path(index, w, false)) continue;
      double ahead = w == ctx_.dst ? ctx_.dst_self_loop_peak : ctx_.reach[w];
      if (w == ctx_.dst && self) continue;  // already in dst's buffer: only finishing remains
      if (!(ahead > best_ * (1 + 1e-9))) continue;
      double cap = std::min({cap_from, ctx_.limit[w], ctx_.run_cap(cur_is_buffer, true)});
      double base = std::min(cur.bound, ahead);
      int remaining = w == ctx_.dst ? 1 : std::max(ctx_.distance[w], 0);
      for (int b = 0; b < m_.count; ++b) {
        if (cur_is_buffer && m_.pair(cur.layout, b).min_shuffle_log2 > std::log2(cap) + 1e-9) continue;
        double bound = std::min(base, hop_bound(c, cur.layout, b, cap));
        if (!(bound > best_ * (1 + 1e-9))) continue;
        State next;
        next.parent = index;
        next.vertex = w;
        next.channel = e;
        next.layout = static_cast<std::int16_t>(b);
        next.depth = static_cast<std::uint8_t>(depth);
        next.self_loop_in = self;
        next.bound = bound;
        states_.push_back(next);
        queue_.push({bound, depth + remaining, depth, static_cast<int>(states_.size() - 1)});
      }
    }
  }

  // Solves the blocking factors of the path ending with channel `last` into dst.
  void complete(int index, std::uint32_t last, double bound) {
    ++evaluated_;
    chain_.clear();
    for (int s = index; s > 0; s = states_[static_cast<std::size_t>(s)].parent) chain_.push_back(s);
    std::reverse(chain_.begin(), chain_.end());
    hops_.clear();
    resources_.clear();
    int prev_layout = m_.src;
    std::uint32_t prev_vertex = ctx_.src;
    auto add_hop = [&](std::uint32_t channel, int layout, std::uint32_t vertex, bool from_buffer, bool to_buffer) {
      const Channel& c = g_.channel(channel);
      const auto& p = m_.pair(prev_layout, layout);
      HopConstraint h;
      h.tp = &c.tp;
      h.request = &p.request;
      if (from_buffer) h.cap = std::min(h.cap, ctx_.limit[prev_vertex]);
      if (to_buffer) h.cap = std::min(h.cap, ctx_.limit[vertex]);
      h.cap = std::min(h.cap, ctx_.run_cap(from_buffer, to_buffer));  // a region's runs in its instances
      if (from_buffer && to_buffer) {
        h.shuffle = &p.shuffle;
        h.shuffle_limit = h.cap;
      }
      hops_.push_back(h);
      for (auto r : c.resources) {
        auto it = std::find_if(resources_.begin(), resources_.end(), [&](const auto& u) { return u.first == r; });
        if (it == resources_.end()) resources_.push_back({r, 1});
        else ++it->second;
      }
      prev_layout = layout;
      prev_vertex = vertex;
    };
    for (std::size_t i = 0; i < chain_.size(); ++i) {
      const State& st = states_[static_cast<std::size_t>(chain_[i])];
      add_hop(st.channel, st.layout, st.vertex, i > 0, true);
    }
    add_hop(last, m_.dst, ctx_.dst, !chain_.empty(), false);
    double cap = bound;
    for (const auto& [r, count] : resources_) cap = std::min(cap, g_.resource(r).gbps / count);
    auto solution = detail::solve_blocks(m_, hops_, cap);
    if (!solution.feasible || !(solution.gbps > best_ * (1 + 1e-9))) return;
    // Record the path: a terminal state pointing at the chain.
    State end;
    end.parent = index;
    end.vertex = ctx_.dst;
    end.channel = last;
    end.layout = static_cast<std::int16_t>(m_.dst);
    end.depth = static_cast<std::uint8_t>(chain_.size() + 1);
    states_.push_back(end);
    best_state_ = static_cast<int>(states_.size() - 1);
    best_ = solution.gbps;
    best_index_ = solution.index;
  }

  const Context& ctx_;
  const TransferGraph& g_;
  const Model& m_;
  std::vector<State> states_;
  std::priority_queue<Queued> queue_;
  std::vector<int> chain_;
  std::vector<HopConstraint> hops_;
  std::vector<std::pair<std::uint32_t, int>> resources_;
  double best_ = 0;
  int best_state_ = -1;
  std::array<int, kMaxDims> best_index_{};
  bool exhaustive_ = true;
  std::uint64_t evaluated_ = 0;
};

}  // namespace

Plan plan_full(const TransferGraph& graph, const TransferRequest& request, const PlannerOptions& options) {
  Context ctx(graph, request, options);
  Model model = detail::build_model(request);
  FullSearch search(ctx, model);
  search.run();
  if (!search.found() && !search.exhaustive())
    throw Error(Errc::invalid_argument,
                fmt::format("full planner: no path from {} to {} found within its search budget of {} states (a "
                            "machine this large needs fewer hops: CARAVAN_PLANNER_MAX_HOPS, or the simple planner)",
                            request.src.to_string(), request.dst.to_string(), kMaxStates));
  if (!search.found()) ctx.no_plan("full");
  auto steps = search.best_steps();
  bool valid = true;
  Plan plan = detail::make_plan(ctx, PlannerKind::full, steps, &valid);
  plan.exhaustive = search.exhaustive();
  plan.paths_evaluated = search.evaluated();
  if (!valid)  // the search kept every buffer within its limit: a planner bug, not to be run
    throw Error(Errc::internal, fmt::format("full planner: the chosen path {} needs a buffer over its limit "
                                            "(a planner bug; please report it with the machine file)\n{}",
                                            plan.route(), to_text(plan)));
  if (plan.predicted_gbps < search.best() * (1 - 1e-6)) {
    // The model and the plan's own figures disagree: a planner bug, reported, not hidden.
    caravan::log::get("planner")->error("full plan {} predicted {} GB/s by the model but {} GB/s from its hops (valid={})",
                                        plan.route(), search.best(), plan.predicted_gbps, valid);
  }
  if (!search.exhaustive())
    caravan::log::get("planner")->warn("full planner stopped after {} search states for {} -> {}; using the best path found",
                                       kMaxStates, request.src.to_string(), request.dst.to_string());
  return plan;
}

}  // namespace caravan::planner
