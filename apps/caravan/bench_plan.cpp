// `caravan bench plan`: how long planning takes. Simple, full, cached and multi-path plans on
// the paper's two-node cluster and on a generated 64-node x 8-GPU cluster, for a plain copy and
// for a transposition (a layout conversion). Goals: simple <= 10 us and full <= 100 us on two
// nodes (the paper measured 2-9 us and 12-102 us), a cached plan <= 200 ns, full on 64 x 8 <= 1 ms.
// The baseline measured in the same run is the simple planner: full / simple is the price of
// the search.
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"

#include <caravan/planner/machine_file.h>
#include <caravan/planner/planner.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <exception>
#include <string>

namespace caravan::app {
namespace {

using Clock = std::chrono::steady_clock;
using namespace caravan::planner;

struct PlanBenchOptions {
  double seconds_per_case = 0.4;
  int nodes = 64;
  int gpus = 8;
};
PlanBenchOptions g_plan_options;

// Per-call times in microseconds: one call per sample, until the time budget or the sample cap.
template <class F>
Summary time_calls(F&& fn, double budget_s, int max_samples = 2000) {
  for (int i = 0; i < 3; ++i) fn();  // warm caches and memo tables
  std::vector<double> us;
  auto deadline = Clock::now() + std::chrono::duration<double>(budget_s);
  while (static_cast<int>(us.size()) < max_samples && (us.size() < 11 || Clock::now() < deadline)) {
    auto start = Clock::now();
    fn();
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  return summarize(us);
}

// Per-call times in nanoseconds of a fast call: batches of 1000 calls per sample.
template <class F>
Summary time_batched_ns(F&& fn, double budget_s) {
  for (int i = 0; i < 1000; ++i) fn();
  std::vector<double> ns;
  auto deadline = Clock::now() + std::chrono::duration<double>(budget_s);
  while (ns.size() < 11 || (Clock::now() < deadline && ns.size() < 2000)) {
    auto start = Clock::now();
    for (int i = 0; i < 1000; ++i) fn();
    ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count() / 1000.0);
  }
  return summarize(ns);
}

struct Scenario {
  std::string machine_label;
  std::string transfer_label;
  std::shared_ptr<const TransferGraph> graph;
  TransferRequest request;
  std::uint64_t threshold = 0;  // 0: the default TH
};

BenchReport run_plan_bench() {
  const auto& o = g_plan_options;
  auto two = std::make_shared<const TransferGraph>(builtin_machine("isometry-two-node"));
  auto cluster = std::make_shared<const TransferGraph>(generate_cluster({o.nodes, o.gpus}));
  std::string cluster_label = fmt::format("{}x{}", o.nodes, o.gpus);
  auto last_gpu = MemoryId{static_cast<std::uint32_t>(o.nodes - 1), static_cast<std::uint32_t>((o.nodes - 1) * o.gpus), MemoryKind::fbm, 0};
  FieldSpace f16 = FieldSpace::uniform(4, 4);
  std::vector<Scenario> scenarios{
      {"two-node", "copy 64 MiB fbm->remote fbm", two,
       {MemoryId::parse("node0/rank0/fbm"), MemoryId::parse("node1/rank1/fbm"), Rect::from_extents({4 << 20}), f16, Layout::aos(1), Layout::aos(1)}},
      {"two-node", "transpose 1 GiB fbm->remote fbm", two,
       {MemoryId::parse("node0/rank0/fbm"), MemoryId::parse("node1/rank1/fbm"), Rect::from_extents({8192, 8192}), f16,
        Layout::parse("F,x,y"), Layout::parse("F,y,x")}},
      // A threshold so small that no path reaches U: the search cannot stop early (no goal set).
      {"two-node", "transpose 1 GiB, TH 64 KiB", two,
       {MemoryId::parse("node0/rank0/fbm"), MemoryId::parse("node1/rank1/fbm"), Rect::from_extents({8192, 8192}), f16,
        Layout::parse("F,x,y"), Layout::parse("F,y,x")},
       64 << 10},
      {cluster_label, "copy 64 MiB fbm->remote fbm", cluster,
       {MemoryId::parse("node0/rank0/fbm"), last_gpu, Rect::from_extents({4 << 20}), f16, Layout::aos(1), Layout::aos(1)}},
      {cluster_label, "transpose 1 GiB fbm->remote fbm", cluster,
       {MemoryId::parse("node0/rank0/fbm"), last_gpu, Rect::from_extents({8192, 8192}), f16, Layout::parse("F,x,y"),
        Layout::parse("F,y,x")}},
  };
  PlannerOptions defaults;  // independent of the environment
  BenchReport report;
  BenchTable table{"planning time per call (median, p10-p90 spread)",
                   {"machine", "transfer", "planner", "median", "p10", "p90", "samples", "goal", "predicted GB/s"},
                   {}};
  nlohmann::json figures = nlohmann::json::array();
  auto fmt_us = [](double us) { return us < 1.0 ? fmt::format("{:.0f} ns", us * 1000) : fmt::format("{:.2f} us", us); };
  double two_simple = 0, two_full = 0, two_cached = 0, cluster_full = 0;
  for (const auto& sc : scenarios) {
    bool is_two = sc.machine_label == "two-node";
    bool has_goal = sc.threshold == 0;
    PlannerOptions options = defaults;
    if (sc.threshold) options.buffer_threshold = sc.threshold;
    const TransferGraph& g = *sc.graph;
    Plan simple = plan_simple(g, sc.request, options);
    Plan full = plan_full(g, sc.request, options);
    MultiPlan multi = plan_multipath(g, sc.request, options);
    Summary s_simple = time_calls([&] { plan_simple(g, sc.request, options); }, o.seconds_per_case);
    Summary s_full = time_calls([&] { plan_full(g, sc.request, options); }, o.seconds_per_case);
    Summary s_multi = time_calls([&] { plan_multipath(g, sc.request, options); }, o.seconds_per_case, 500);
    Planner planner(sc.graph, options);
    planner.plan(sc.request);
    Summary s_cached = time_batched_ns([&] { planner.plan(sc.request); }, o.seconds_per_case / 2);
    struct Row {
      const char* name;
      Summary s;
      bool ns;
      std::string goal;
      double gbps;
    };
    std::vector<Row> rows{
        {"simple", s_simple, false, !has_goal ? "" : is_two ? "<= 10 us" : "", simple.predicted_gbps},
        {"full", s_full, false, !has_goal ? "" : is_two ? "<= 100 us" : "<= 1 ms", full.predicted_gbps},
        {"cached", s_cached, true, !has_goal ? "" : "<= 200 ns", planner.plan(sc.request)->predicted_gbps},
        {"multipath", s_multi, false, "", multi.predicted_gbps},
    };
    for (const auto& r : rows) {
      double scale = r.ns ? 1e-3 : 1.0;  // to microseconds
      table.rows.push_back({sc.machine_label, sc.transfer_label, r.name, fmt_us(r.s.median * scale), fmt_us(r.s.p10 * scale),
                            fmt_us(r.s.p90 * scale), std::to_string(r.s.count), r.goal, fmt::format("{:.3f}", r.gbps)});
      figures.push_back({{"machine", sc.machine_label},
                         {"transfer", sc.transfer_label},
                         {"planner", r.name},
                         {"median_us", r.s.median * scale},
                         {"p10_us", r.s.p10 * scale},
                         {"p90_us", r.s.p90 * scale},
                         {"samples", r.s.count},
                         {"predicted_gbps", r.gbps}});
    }
    if (!has_goal) {
      report.notes.push_back(fmt::format("{} {}: no path reaches U ({:.3f} GB/s), so the full search runs to the end: {} paths solved",
                                         sc.machine_label, sc.transfer_label, full.upper_bound_gbps, full.paths_evaluated));
    } else if (is_two) {
      two_simple = std::max(two_simple, s_simple.median);
      two_full = std::max(two_full, s_full.median);
      two_cached = std::max(two_cached, s_cached.median);
    } else {
      cluster_full = std::max(cluster_full, s_full.median);
    }
    report.notes.push_back(fmt::format("{} {}: full {} ({:.3f} GB/s), simple {} ({:.3f} GB/s), multipath {} paths ({:.3f} GB/s)",
                                       sc.machine_label, sc.transfer_label, full.route(), full.predicted_gbps, simple.route(),
                                       simple.predicted_gbps, multi.shares.size(), multi.predicted_gbps));
  }
  report.tables.push_back(table);
  report.headlines.push_back(fmt::format("two-node: simple {} (goal 10 us), full {} (goal 100 us; {:.1f}x simple), cached {} (goal 200 ns)",
                                         fmt_us(two_simple), fmt_us(two_full), two_full / two_simple, fmt_us(two_cached / 1000)));
  report.headlines.push_back(fmt::format("{}: full {} (goal 1 ms)", cluster_label, fmt_us(cluster_full)));
  report.notes.push_back("medians are the slower of the two transfers per machine in the headlines; the table has each");
  report.figures["cases"] = figures;
  report.figures["goals_us"] = {{"simple_two_node", 10}, {"full_two_node", 100}, {"cached", 0.2}, {"full_cluster", 1000}};
  report.figures["headline_us"] = {{"simple_two_node", two_simple},
                                   {"full_two_node", two_full},
                                   {"cached", two_cached / 1000},
                                   {"full_cluster", cluster_full}};
  return report;
}

}  // namespace

void add_bench_plan(CLI::App& bench) {
  CLI::App& sub = add_bench_case(bench, "plan", "Planning time: simple, full, cached and multi-path plans, two-node and 64x8 clusters",
                                 run_plan_bench);
  sub.add_option("--seconds", g_plan_options.seconds_per_case, "Time budget per measurement")
      ->capture_default_str()
      ->check([](const std::string& text) -> std::string {
        double seconds = 0;
        try {
          std::size_t used = 0;
          seconds = std::stod(text, &used);
          if (used != text.size()) return "expected a number of seconds, got '" + text + "'";
        } catch (const std::exception&) {
          return "expected a number of seconds, got '" + text + "'";
        }
        if (!std::isfinite(seconds) || seconds <= 0 || seconds > 3600)
          return "must be a finite number of seconds in (0, 3600], got '" + text + "'";
        return "";
      });
  sub.add_option("--nodes", g_plan_options.nodes, "Nodes of the generated cluster")->capture_default_str();
  sub.add_option("--gpus", g_plan_options.gpus, "GPUs per node of the generated cluster")->capture_default_str();
}

}  // namespace caravan::app
