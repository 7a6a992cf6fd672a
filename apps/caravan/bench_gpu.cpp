// `caravan bench gpu`: Caravan's GPU channels against the raw HIP call on the same buffers, in
// the same run, alternating the two:
//   sdma H2D   zcm -> fbm0    vs hipMemcpyAsync      (pinned host -> GPU)
//   sdma D2H   fbm0 -> zcm    vs hipMemcpyAsync
//   sdma local fbm0 -> fbm0   vs hipMemcpyAsync      (device -> device, one GPU)
//   xgmi       fbm0 -> fbm1   vs hipMemcpyPeerAsync  (needs 2 GPUs that reach each other)
//   xgmi both ways fbm0 <-> fbm1 at once vs two hipMemcpyPeerAsync at once
//   sys -> fbm0 as planned    vs pageable hipMemcpyAsync
// and a 64 MiB high-priority copy on the copy engine under 16 x 1 GiB low-priority ones, against
// it alone and FIFO (goal: within 1.5x of alone); and
//   multipath host->fbm0      a 1 GiB zcm -> fbm0 copy split by the multi-path planner over
//                             every GPU's PCIe link (GPU 0's directly, the others' relayed over
//                             NVLink) vs one hipMemcpyAsync over GPU 0's link alone (goal >= 3x;
//                             skipped with fewer than 2 GPUs)
// Sources hold fresh random bytes; every destination is poisoned, copied by Caravan and
// compared with its source after the timing. Without a GPU it says why and skips.
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"
#include "runtime/dma/engine.h"
#include "runtime/dma/instance_impl.h"
#include "runtime/dma/transfer_ops.h"
#include "runtime/gpu/devices.h"

#include <caravan/caravan.h>
#include <caravan/copy.h>
#include <caravan/planner/plan.h>
#include <caravan/platform.h>
#include <caravan/settings.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <thread>
#include <utility>
#include <vector>

namespace caravan::app {
namespace {

using Clock = std::chrono::steady_clock;

struct GpuBenchOptions {
  std::uint64_t mib = 256;
  int repetitions = 20;
  bool priority = true;
  bool multipath = true;
  bool multipath_only = false;
  bool all_to_all_only = false;
  std::uint64_t multipath_mib = 1024;
  bool priority_only = false;
  bool conversion_only = false;
  bool idle_only = false;
  // The idle case: each copy after this long with nothing to do, longer than the service threads
  // poll (CARAVAN_GPU_WORKER_SPIN_US), so that they sleep when it comes.
  int idle_ms = 5;
  // The priority case: one high-priority copy under a backlog of low-priority ones, all
  // zcm -> fbm0 on GPU 0's copy engine (issue 6: 64 MiB under 16 x 1 GiB).
  std::uint64_t priority_mib = 64;
  int priority_load_copies = 16;
  std::uint64_t priority_load_mib = 1024;
  int priority_runs = 5;
};
GpuBenchOptions g_gpu;

// Every option, checked before anything runs, so that a machine without a GPU (the benchmark
// skips there) refuses nonsense as one with a GPU does.
void validate_options(const GpuBenchOptions& o) {
  constexpr std::uint64_t kMaxMib = std::uint64_t{1} << 24;  // 16 TiB: MiB << 20 stays far from overflowing
  const std::pair<const char*, std::uint64_t> sizes[] = {{"--mib", o.mib},
                                                         {"--multipath-mib", o.multipath_mib},
                                                         {"--priority-mib", o.priority_mib},
                                                         {"--priority-load-mib", o.priority_load_mib}};
  for (const auto& [name, mib] : sizes)
    if (mib < 1 || mib > kMaxMib)
      throw Error(Errc::invalid_argument, fmt::format("{} {}: must be in [1, {}]", name, mib, kMaxMib));
  const std::pair<const char*, int> counts[] = {{"--reps", o.repetitions},
                                                {"--priority-load-copies", o.priority_load_copies},
                                                {"--priority-runs", o.priority_runs},
                                                {"--idle-ms", o.idle_ms}};
  for (const auto& [name, count] : counts)
    if (count < 1) throw Error(Errc::invalid_argument, fmt::format("{} {}: must be at least 1", name, count));
}

const FieldSpace& fields() {
  static const FieldSpace f({{"a", 8}, {"b", 8}});
  return f;
}

double gbps(std::uint64_t bytes, double seconds) { return static_cast<double>(bytes) / seconds / 1e9; }

// Seconds from copy() to the copy's event, polled as hipStreamSynchronize polls in the raw
// baselines (the same waiting policy); throws if the copy failed.
double polled_copy_seconds(const Instance& src, const Instance& dst, const CopyOptions& options = {}) {
  const auto start = Clock::now();
  Event e = copy(src, dst, options);
  while (!e.has_triggered()) {
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  e.wait();
  return seconds;
}

nlohmann::json summary_json(const Summary& s) {
  return {{"median", s.median}, {"p10", s.p10}, {"p90", s.p90}, {"min", s.min}, {"max", s.max}, {"count", s.count}};
}

std::vector<std::string> row(const std::string& name, const Summary& s) {
  return {name, fmt::format("{:.2f}", s.median), fmt::format("{:.2f}", s.p10), fmt::format("{:.2f}", s.p90),
          fmt::format("{:.2f}", s.min), fmt::format("{:.2f}", s.max)};
}

void* address(const Instance& inst) { return inst.impl()->storage->gpu_address(); }

// Poisons `dst`, copies with Caravan, and compares every byte with `src`.
bool verify(const Instance& src, const Instance& dst) {
  std::vector<std::byte> a(src.footprint_bytes()), b(dst.footprint_bytes(), std::byte{0xAB});
  dst.write_bytes(0, b);
  copy(src, dst).wait();
  src.read_bytes(0, a);
  dst.read_bytes(0, b);
  return a == b;
}

// "multipath host->fbm0": a multi-path copy from pinned host memory to GPU 0 against one raw
// hipMemcpyAsync over GPU 0's PCIe link, on the same buffers, alternating.
void run_multipath_case(BenchReport& out, nlohmann::json& figures, std::uint32_t rank) {
  const std::string name = "multipath host->fbm0";
  const gpu::Topology& topo = gpu::topology();
  auto skip = [&](const std::string& reason) {
    out.headlines.push_back(fmt::format("{}: skipped: {}", name, reason));
    figures["multipath"] = {{"skipped", true}, {"reason", reason}};
  };
  if (topo.devices.size() < 2) {
    skip(fmt::format("{} GPU(s); a multi-path copy to GPU 0 needs at least 2 (each GPU's PCIe link is one path)",
                     topo.devices.size()));
    return;
  }
  const MemoryId zcm{0, rank, MemoryKind::zcm, 0}, fbm0{0, rank, MemoryKind::fbm, 0};
  const Rect space = Rect::from_extents({static_cast<std::int64_t>((g_gpu.multipath_mib << 20) / fields().total_size())});
  const std::uint64_t bytes = space.volume() * fields().total_size();
  const Layout aos = Layout::parse("F,x");
  Instance src = Instance::create(zcm, space, fields(), aos), dst = Instance::create(fbm0, space, fields(), aos);
  {  // fresh random bytes
    std::mt19937_64 rng(std::random_device{}());
    auto* p = reinterpret_cast<std::uint64_t*>(src.data());
    for (std::uint64_t i = 0; i < bytes / 8; ++i) p[i] = rng();
  }
  std::shared_ptr<const planner::MultiPlan> plan = plan_copy_multipath(src, dst);
  if (plan->shares.size() < 2) {
    skip(fmt::format("the multi-path planner found one path from {} to {} ({}): no GPU relays (peer access?)",
                     zcm.to_string(), fbm0.to_string(), plan->shares.front().plan.route()));
    return;
  }
  const CopyOptions multipath{.planner = PlannerChoice::multipath};
  copy(src, dst, multipath).wait();  // warm-up: streams, first touch of the relay buffers' pools
  const gpu::RawCopy raw{.dst = address(dst), .src = address(src), .bytes = bytes, .device = 0};
  gpu::time_raw_copies(raw, 1);
  // The host side's ceiling: a share of the same pinned source into every GPU over its own
  // link at once (raw hipMemcpyAsync, no relays). A multi-path copy cannot beat it.
  std::vector<Instance> spread_dst;
  std::vector<gpu::RawCopy> spread;
  const std::uint64_t share = bytes / topo.devices.size() / 4096 * 4096;
  for (std::size_t g = 0; g < topo.devices.size(); ++g) {
    spread_dst.push_back(Instance::create(MemoryId{0, rank, MemoryKind::fbm, static_cast<std::uint32_t>(g)},
                                          Rect::from_extents({static_cast<std::int64_t>(share / fields().total_size())}), fields(), aos));
    spread.push_back({.dst = address(spread_dst.back()), .src = static_cast<const std::byte*>(address(src)) + g * share,
                      .bytes = share, .device = static_cast<int>(g)});
  }
  gpu::time_raw_concurrent(spread, 1);
  // The engine cuts each copy by the rates its paths were measured at in the copies before
  // (CARAVAN_DMA_MULTIPATH_LEARN); the planner's own cut alternates with it, learning off.
  dma::Engine& engine = dma::Engine::current();
  const double learn = settings::get_double("CARAVAN_DMA_MULTIPATH_LEARN");
  std::vector<double> caravan, planned_cut, baseline, ceiling;
  for (int r = 0; r < g_gpu.repetitions; ++r) {
    ceiling.push_back(gbps(share * spread.size(), gpu::time_raw_concurrent(spread, 1).front()));
    baseline.push_back(gbps(bytes, gpu::time_raw_copies(raw, 1).front()));
    if (learn > 0) {
      engine.set_multipath_learn(0);
      planned_cut.push_back(gbps(bytes, polled_copy_seconds(src, dst, multipath)));
      engine.set_multipath_learn(learn);
    }
    caravan.push_back(gbps(bytes, polled_copy_seconds(src, dst, multipath)));
  }
  // Verification: poison the destination, copy once more (with a report), compare every byte.
  auto verified_copy = [&](CopyReport& report) {
    std::vector<std::byte> check(bytes, std::byte{0xAB});
    dst.write_bytes(0, check);
    copy(src, dst, {.planner = PlannerChoice::multipath, .report = &report}).wait();
    dst.read_bytes(0, check);
    return std::memcmp(check.data(), src.data(), bytes) == 0;
  };
  CopyReport report, planned_report;
  bool verified = verified_copy(report);
  if (learn > 0) {
    engine.set_multipath_learn(0);
    verified = verified_copy(planned_report) && verified;
    engine.set_multipath_learn(learn);
  }
  if (!verified) out.failure = fmt::format("{}: the destination differs from the source after a multi-path copy", name);

  Summary sc = summarize(caravan), sb = summarize(baseline), sh = summarize(ceiling);
  BenchTable t{fmt::format("{}: GB/s, {} MiB per copy over {} paths, each timed from submission to completion (event "
                           "polled), alternating with one hipMemcpyAsync on GPU 0's link",
                           name, bytes >> 20, report.paths.size()),
               {"copy", "median", "p10", "p90", "min", "max"}, {}};
  t.rows.push_back(row(learn > 0 ? "multi-path zcm->fbm0 (caravan, cut by learned rates)" : "multi-path zcm->fbm0 (caravan)", sc));
  Summary sp{};
  if (learn > 0) {
    sp = summarize(planned_cut);
    t.rows.push_back(row("multi-path zcm->fbm0 (caravan, the planner's cut)", sp));
  }
  t.rows.push_back(row("hipMemcpyAsync H2D, one PCIe link (raw, same buffers)", sb));
  t.rows.push_back(row(fmt::format("host-side ceiling: {} raw H2D at once, a share into each GPU", spread.size()), sh));
  out.tables.push_back(t);
  const double ratio = sc.median / sb.median;
  out.headlines.push_back(fmt::format("{}: {} paths, caravan / one PCIe link = {:.2f}x ({:.1f} vs {:.1f} GB/s; planned "
                                      "{:.1f} GB/s) (goal >= 3x); {:.2f} of the host-side ceiling ({:.1f} GB/s into all "
                                      "GPUs at once, raw){}{}",
                                      name, report.paths.size(), ratio, sc.median, sb.median, plan->predicted_gbps,
                                      sc.median / sh.median, sh.median,
                                      learn > 0 ? fmt::format("; the planner's cut alone {:.2f}x, learned / planner's = "
                                                              "{:.3f}", sp.median / sb.median, sc.median / sp.median)
                                                : std::string(" (CARAVAN_DMA_MULTIPATH_LEARN=0)"),
                                      verified ? "" : " DATA MISMATCH"));
  nlohmann::json path_figures = nlohmann::json::array();
  auto path_table = [&](const CopyReport& r, const char* cut) {
    BenchTable paths{fmt::format("{}: the paths of a verified copy {} ({:.1f} GB/s overall, {:.0f} us from the first "
                                 "path's start to the last request's end)",
                                 name, cut, r.elapsed_us > 0 ? static_cast<double>(bytes) / r.elapsed_us / 1e3 : 0.0,
                                 r.elapsed_us),
                     {"path", "MiB", "share", "cut at GB/s", "start us", "end us", "GB/s"}, {}};
    for (const CopyPathReport& p : r.paths) {
      const double us = p.end_us - p.start_us;
      const double achieved = us > 0 ? static_cast<double>(p.bytes) / us / 1e3 : 0;
      paths.rows.push_back({p.report.route, fmt::format("{:.1f}", static_cast<double>(p.bytes) / (1 << 20)),
                            fmt::format("{:.1f}%", 100.0 * static_cast<double>(p.bytes) / static_cast<double>(bytes)),
                            fmt::format("{:.1f}", p.share_gbps), fmt::format("{:.0f}", p.start_us),
                            fmt::format("{:.0f}", p.end_us), fmt::format("{:.1f}", achieved)});
      path_figures.push_back({{"cut", cut}, {"route", p.report.route}, {"bytes", p.bytes}, {"cut_gbps", p.share_gbps},
                              {"start_us", p.start_us}, {"end_us", p.end_us}, {"gbps", achieved}});
    }
    out.tables.push_back(paths);
  };
  path_table(report, learn > 0 ? "cut by learned rates" : "cut by the planner");
  if (learn > 0) path_table(planned_report, "cut by the planner");
  out.notes.push_back(fmt::format("{}: route {}; {} runs; destination verified: {}", name, report.route, g_gpu.repetitions,
                                  verified ? "yes" : "NO"));
  figures["multipath"] = {{"caravan_gbps", summary_json(sc)}, {"raw_one_link_gbps", summary_json(sb)}, {"ratio", ratio},
                          {"learn", learn}, {"planner_cut_gbps", learn > 0 ? summary_json(sp) : nlohmann::json()},
                          {"raw_all_links_gbps", summary_json(sh)},
                          {"goal", 3.0}, {"planned_gbps", plan->predicted_gbps}, {"paths", path_figures},
                          {"bytes", bytes}, {"verified", verified}};
}

// "copy engine priority": a high-priority zcm -> fbm0 copy submitted right after a backlog of
// low-priority copies on the same channel (GPU 0's PCIe link), against the same copy alone and
// against the backlog without priorities (FIFO). The low copies read one shared pinned source
// into destinations of their own. Every high-priority result is verified (destination poisoned
// before each run), and the last low-priority destination once at the end.
void run_priority_case(BenchReport& out, nlohmann::json& figures, std::uint32_t rank) {
  const GpuBenchOptions& o = g_gpu;
  const MemoryId zcm{0, rank, MemoryKind::zcm, 0}, fbm0{0, rank, MemoryKind::fbm, 0};
  const Layout aos = Layout::parse("F,x");
  auto space_of = [](std::uint64_t mib) {
    return Rect::from_extents({static_cast<std::int64_t>((mib << 20) / fields().total_size())});
  };
  // The backlog's destinations take copies x MiB on GPU 0: where that is more than half of its
  // memory (a smaller GPU), each copy shrinks to fit and the report says so.
  std::uint64_t load_mib = o.priority_load_mib;
  const std::uint64_t gpu_mib = gpu::topology().devices.at(0).memory_bytes >> 20;
  const std::uint64_t budget_mib = gpu_mib / 2 / static_cast<std::uint64_t>(o.priority_load_copies);
  if (budget_mib < load_mib) {
    if (budget_mib == 0)
      throw Error(
          Errc::invalid_argument,
          fmt::format("the priority case's backlog (--priority-load-copies {}) does not fit in half of GPU 0's {} MiB",
                      o.priority_load_copies, gpu_mib));
    out.notes.push_back(
        fmt::format("copy engine priority: {} x {} MiB is more than half of GPU 0's {} MiB: ran {} x {} MiB "
                    "(--priority-load-mib)",
                    o.priority_load_copies, load_mib, gpu_mib, o.priority_load_copies, budget_mib));
    load_mib = budget_mib;
  }
  const Rect low_space = space_of(load_mib), high_space = space_of(o.priority_mib);
  Instance low_src = Instance::create(zcm, low_space, fields(), aos);
  std::vector<Instance> low_dst;
  for (int i = 0; i < o.priority_load_copies; ++i) low_dst.push_back(Instance::create(fbm0, low_space, fields(), aos));
  Instance hs = Instance::create(zcm, high_space, fields(), aos),
           hd = Instance::create(fbm0, high_space, fields(), aos);
  {  // fresh random bytes in both sources
    std::mt19937_64 rng(std::random_device{}());
    for (Instance* src : {&low_src, &hs}) {
      auto* p = reinterpret_cast<std::uint64_t*>(src->data());
      for (std::uint64_t i = 0; i < src->footprint_bytes() / 8; ++i) p[i] = rng();
    }
  }
  const std::vector<std::byte> poison(hd.footprint_bytes(), std::byte{0xAB});
  std::vector<std::byte> seen(hd.footprint_bytes());
  int mismatches = 0;
  auto timed = [&](int priority, CopyReport* report) {
    hd.write_bytes(0, poison);
    auto start = Clock::now();
    copy(hs, hd, {.priority = priority, .report = report}).wait();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    hd.read_bytes(0, seen);
    if (std::memcmp(seen.data(), hs.data(), seen.size()) != 0) ++mismatches;
    return ms;
  };
  timed(10, nullptr);  // warm-up
  std::vector<double> alone, prioritized, fifo, interleaved;
  // Where the prioritized copy's time went: when its first request was handed to the channel
  // and when that request ended (from the copy's start), and the request sizes on both sides.
  std::vector<double> first_issue_us, first_end_us;
  std::uint64_t high_request_bytes = 0, low_request_bytes = 0;
  auto request_bytes = [](const CopyReport& r) {
    return r.hop_requests.empty() || r.hop_requests[0] == 0 ? std::uint64_t{0} : r.bytes / r.hop_requests[0];
  };
  for (int r = 0; r < o.priority_runs; ++r) {
    alone.push_back(timed(10, nullptr));
    for (int high : {10, 0}) {
      std::vector<Event> load;
      CopyReport low_report;
      for (const Instance& dst : low_dst)
        load.push_back(
            copy(low_src, dst, {.priority = high == 10 ? -10 : 0, .report = load.empty() ? &low_report : nullptr}));
      CopyReport report;
      const double ms = timed(high, &report);
      merge_events(load).wait();
      if (high == 10) {
        prioritized.push_back(ms);
        interleaved.push_back(static_cast<double>(report.hop_interleaved.empty() ? 0 : report.hop_interleaved[0]));
        if (!report.timeline.empty() && !report.timeline[0].requests.empty()) {
          first_issue_us.push_back(report.timeline[0].requests.front().start_us);
          first_end_us.push_back(report.timeline[0].requests.front().end_us);
        }
        high_request_bytes = request_bytes(report);
        low_request_bytes = request_bytes(low_report);
      } else {
        fifo.push_back(ms);
      }
    }
  }
  const bool low_verified = [&] {
    std::vector<std::byte> a(low_src.footprint_bytes());
    low_dst.back().read_bytes(0, a);
    return std::memcmp(a.data(), low_src.data(), a.size()) == 0;
  }();
  const bool verified = mismatches == 0 && low_verified;
  if (!verified)
    out.failure =
        fmt::format("copy engine priority: {} of {} high-priority results differ from their source{}", mismatches,
                    1 + 3 * o.priority_runs, low_verified ? "" : "; the last low-priority destination differs");
  const Summary s_alone = summarize(alone), s_prio = summarize(prioritized), s_fifo = summarize(fifo),
                s_inter = summarize(interleaved);
  const std::string load = fmt::format("{} x {} MiB", o.priority_load_copies, load_mib);
  BenchTable t{
      fmt::format("Completion time of a {} MiB zcm->fbm0 copy, ms ({} runs; load: {} low-priority copies on the same "
                  "sdma channel, submitted just before it)",
                  o.priority_mib, o.priority_runs, load),
      {"case", "median", "p10", "p90", "min", "max"},
      {}};
  t.rows.push_back(row("alone", s_alone));
  t.rows.push_back(row("under load, high priority", s_prio));
  t.rows.push_back(row("under load, no priorities (FIFO)", s_fifo));
  out.tables.push_back(t);
  const double ratio = s_prio.median / s_alone.median;
  out.headlines.push_back(fmt::format(
      "copy engine priority: {} MiB under {}: high priority under load / alone = {:.2f}x (goal "
      "<= 1.5x), FIFO {:.2f}x; low-priority requests interleaved (median) {:.0f}{}",
      o.priority_mib, load, ratio, s_fifo.median / s_alone.median, s_inter.median, verified ? "" : "; DATA MISMATCH"));
  const Summary s_issue = summarize(first_issue_us), s_first_end = summarize(first_end_us);
  out.notes.push_back(fmt::format(
      "copy engine priority: requests of {:.1f} MiB (high priority) and {:.1f} MiB (load); under load the first "
      "high-priority request was handed to the channel {:.0f} us after the copy started (median; p10 {:.0f}, p90 "
      "{:.0f}) and ended at {:.0f} us (p10 {:.0f}, p90 {:.0f})",
      static_cast<double>(high_request_bytes) / (1 << 20), static_cast<double>(low_request_bytes) / (1 << 20),
      s_issue.median, s_issue.p10, s_issue.p90, s_first_end.median, s_first_end.p10, s_first_end.p90));
  figures["priority_ms"] = {{"alone", summary_json(s_alone)},
                            {"prioritized", summary_json(s_prio)},
                            {"fifo", summary_json(s_fifo)},
                            {"interleaved", summary_json(s_inter)},
                            {"ratio", ratio},
                            {"goal", 1.5},
                            {"high_mib", o.priority_mib},
                            {"load_copies", o.priority_load_copies},
                            {"load_mib", load_mib},
                            {"high_request_bytes", high_request_bytes},
                            {"load_request_bytes", low_request_bytes},
                            {"first_request_issue_us", summary_json(s_issue)},
                            {"first_request_end_us", summary_json(s_first_end)},
                            {"verified", verified}};
}

struct Pair {
  std::string name, raw_name;
  Instance src, dst;
  gpu::RawCopy raw;
  int repetitions = 0;
  std::vector<double> caravan, caravan_wait, baseline;  // GB/s
  std::string route;
  std::uint64_t requests = 0;
  bool verified = false;
};

// "xgmi all-to-all": every GPU sends a copy of `random` (an fbm0 instance of random bytes) to
// every other at once, against the same copies as raw hipMemcpyPeerAsync calls on the copy
// engines, each on a stream of its own; in two issue orders. Skipped (silently, as before) unless
// every GPU reaches every other.
void run_all_to_all_case(BenchReport& out, nlohmann::json& figures, std::uint32_t rank, const Instance& random) {
  const gpu::Topology& topo = gpu::topology();
  const int reps = g_gpu.repetitions;
  const std::uint64_t bytes = random.footprint_bytes();
  auto make = [&](MemoryId m) { return Instance::create(m, random.space(), random.fields(), random.layout()); };
  bool all_peers = topo.devices.size() >= 2;
  for (std::size_t i = 0; i < topo.devices.size(); ++i)
    for (std::size_t j = 0; j < topo.devices.size(); ++j)
      if (i != j && !topo.can_peer(static_cast<int>(i), static_cast<int>(j))) all_peers = false;
  if (!all_peers) return;
  const std::size_t gpus = topo.devices.size();
  auto fbm = [&](std::size_t i) { return MemoryId{0, rank, MemoryKind::fbm, static_cast<std::uint32_t>(i)}; };
  std::vector<Instance> sources;
  // One destination per (sender, receiver); targets[i * gpus + j] (unused where i == j).
  std::vector<Instance> targets(gpus * gpus);
  for (std::size_t i = 0; i < gpus; ++i) {
    sources.push_back(make(fbm(i)));
    copy(random, sources.back()).wait();  // random data
  }
  for (std::size_t i = 0; i < gpus; ++i)
    for (std::size_t j = 0; j < gpus; ++j)
      if (i != j) targets[i * gpus + j] = make(fbm(j));
  // Two orders of the same copies. Each GPU's copy engines serve its peer copies about in the
  // order they were issued, so the order decides which receivers collide: "receivers
  // ascending" (0 -> 1, 2, 3; 1 -> 0, 2, 3; ...) starts three senders on GPU 0 at once and
  // halves the rate; "rotation" (every GPU to its next, then the one after...) keeps each
  // phase a permutation (scripts/probes/all_to_all_probe.cu measured 384 vs 194 GB/s).
  struct Order {
    std::string name;
    std::vector<std::pair<std::size_t, std::size_t>> pairs;
  };
  std::vector<Order> orders(2);
  orders[0].name = "receivers ascending";
  for (std::size_t i = 0; i < gpus; ++i)
    for (std::size_t j = 0; j < gpus; ++j)
      if (i != j) orders[0].pairs.emplace_back(i, j);
  orders[1].name = "rotation";
  for (std::size_t step = 1; step < gpus; ++step)
    for (std::size_t i = 0; i < gpus; ++i) orders[1].pairs.emplace_back(i, (i + step) % gpus);
  const std::string engine = settings::get_string("CARAVAN_GPU_XGMI_ENGINE");
  const double per_gpu_bytes = static_cast<double>(bytes) * static_cast<double>(gpus - 1);
  BenchTable at{fmt::format("All-to-all over the peer links: each of {} GPUs sends {} MiB to every other at once, GB/s sent per GPU",
                            gpus, bytes >> 20),
                {"copy", "median", "p10", "p90", "min", "max"}, {}};
  figures["all_to_all"] = {{"engine", engine}};
  for (const Order& order : orders) {
    std::vector<gpu::RawCopy> raws;
    for (auto [i, j] : order.pairs)
      raws.push_back({.dst = address(targets[i * gpus + j]), .src = address(sources[i]), .bytes = bytes,
                      .device = static_cast<int>(i), .peer = true, .src_device = static_cast<int>(i),
                      .dst_device = static_cast<int>(j)});
    auto all_to_all = [&] {
      std::vector<Event> events;
      for (auto [i, j] : order.pairs) events.push_back(copy(sources[i], targets[i * gpus + j]));
      for (Event& e : events) e.wait();
    };
    all_to_all();  // warm-up: plans, streams
    gpu::time_raw_concurrent(raws, 1);
    std::vector<double> caravan_gbps, raw_gbps;
    for (int r = 0; r < std::max(reps / 2, 5); ++r) {
      raw_gbps.push_back(per_gpu_bytes / gpu::time_raw_concurrent(raws, 1).front() / 1e9);
      auto start = Clock::now();
      all_to_all();
      caravan_gbps.push_back(per_gpu_bytes / std::chrono::duration<double>(Clock::now() - start).count() / 1e9);
    }
    bool verified = true;
    for (auto [i, j] : order.pairs) verified = verified && verify(sources[i], targets[i * gpus + j]);
    Summary sc = summarize(caravan_gbps), sr = summarize(raw_gbps);
    at.rows.push_back(row(fmt::format("caravan xgmi ({}), {}", engine, order.name), sc));
    at.rows.push_back(row(fmt::format("hipMemcpyPeerAsync, a stream per pair, {}", order.name), sr));
    out.headlines.push_back(fmt::format("xgmi all-to-all, {} GPUs, engine {}, {}: caravan / raw copy engines = {:.2f}x ({:.1f} vs "
                                        "{:.1f} GB/s per GPU){}",
                                        gpus, engine, order.name, sc.median / sr.median, sc.median, sr.median,
                                        verified ? "" : " DATA MISMATCH"));
    if (!verified) out.failure = "xgmi all-to-all: a destination differs from its source";
    figures["all_to_all"][order.name] = {{"caravan_gbps_per_gpu", summary_json(sc)}, {"raw_gbps_per_gpu", summary_json(sr)},
                                         {"verified", verified}};
  }
  out.tables.push_back(at);
}

// "xgmi both ways": fbm0 -> fbm1 and fbm1 -> fbm0 at once (the links carry both directions),
// two Caravan copies against two hipMemcpyPeerAsync on a stream each, alternating; GB/s of both
// directions together. `forward_src` on GPU 0 holds random bytes; `forward_dst` is on GPU 1.
void run_both_ways_case(BenchReport& out, nlohmann::json& figures, const Instance& forward_src,
                        const Instance& forward_dst, int reps) {
  const std::string name = "xgmi both ways fbm0<->fbm1";
  const Instance back_src = Instance::create(forward_dst.memory(), forward_src.space(), fields(), forward_src.layout());
  const Instance back_dst = Instance::create(forward_src.memory(), forward_src.space(), fields(), forward_src.layout());
  copy(forward_src, back_src).wait();  // random bytes on GPU 1 too
  const std::uint64_t bytes = forward_src.footprint_bytes();
  const std::vector<gpu::RawCopy> raws{{.dst = address(forward_dst),
                                        .src = address(forward_src),
                                        .bytes = bytes,
                                        .device = 0,
                                        .peer = true,
                                        .src_device = 0,
                                        .dst_device = 1},
                                       {.dst = address(back_dst),
                                        .src = address(back_src),
                                        .bytes = bytes,
                                        .device = 1,
                                        .peer = true,
                                        .src_device = 1,
                                        .dst_device = 0}};
  auto both = [&] {
    Event there = copy(forward_src, forward_dst), back = copy(back_src, back_dst);
    while (!there.has_triggered() || !back.has_triggered()) {
    }
    there.wait();  // throws if a copy failed
    back.wait();
  };
  both();  // warm-up: plans, streams
  gpu::time_raw_concurrent(raws, 1);
  std::vector<double> caravan, baseline;
  for (int r = 0; r < reps; ++r) {
    baseline.push_back(gbps(2 * bytes, gpu::time_raw_concurrent(raws, 1).front()));
    const auto start = Clock::now();
    both();
    caravan.push_back(gbps(2 * bytes, std::chrono::duration<double>(Clock::now() - start).count()));
  }
  const bool verified = verify(forward_src, forward_dst) && verify(back_src, back_dst);
  if (!verified) out.failure = name + ": a destination differs from its source";
  const Summary sc = summarize(caravan), sb = summarize(baseline);
  BenchTable t{fmt::format("{}: GB/s of both directions together, {} MiB each way, raw and Caravan alternating", name,
                           bytes >> 20),
               {"copy", "median", "p10", "p90", "min", "max"},
               {}};
  t.rows.push_back(row(name + " (caravan, event polled)", sc));
  t.rows.push_back(row("hipMemcpyPeerAsync 0->1 and 1->0 at once (raw, same buffers)", sb));
  out.tables.push_back(t);
  const double ratio = sc.median / sb.median;
  out.headlines.push_back(fmt::format("{}: caravan / raw = {:.3f} ({:.1f} vs {:.1f} GB/s both ways) (goal >= 0.95){}",
                                      name, ratio, sc.median, sb.median, verified ? "" : " DATA MISMATCH"));
  figures[name] = {
      {"caravan_gbps", summary_json(sc)}, {"raw_gbps", summary_json(sb)}, {"ratio", ratio}, {"verified", verified}};
}

// A layout conversion within GPU 0: 48 MiB of points with three 4-byte fields, AOS -> SOA, as
// planned (the gpu_convert kernel where calibration finds it faster) against the copy engine
// doing it as raw per-field 2-D copies (4-byte rows), and against a plain device-to-device copy
// of the same bytes, which no conversion can beat (it reads and writes each byte once, in order);
// verified word by word.
void run_conversion_case(BenchReport& out, nlohmann::json& figures, MemoryId fbm0, int reps) {
  const FieldSpace xyz({{"x", 4}, {"y", 4}, {"z", 4}});
  const std::uint64_t points = (48u << 20) / 12, conv_bytes = points * 12;
  const Rect line = Rect::from_extents({static_cast<std::int64_t>(points)});
  Instance cs = Instance::create(fbm0, line, xyz, Layout::parse("F,x")),
           cd = Instance::create(fbm0, line, xyz, Layout::parse("x,F"));
  std::vector<std::uint32_t> words(points * 3), got(points * 3);
  std::mt19937_64 rng(0xC0417);
  for (auto& w : words) w = static_cast<std::uint32_t>(rng());
  cs.write_bytes(0, std::as_bytes(std::span(words)));
  std::fill(got.begin(), got.end(), 0xDEADBEEFu);
  cd.write_bytes(0, std::as_bytes(std::span(got)));
  CopyReport report;
  copy(cs, cd, {.report = &report}).wait();
  cd.read_bytes(0, std::as_writable_bytes(std::span(got)));
  std::uint64_t wrong = 0;
  auto count_wrong = [&] {  // words of the destination (read into got) not where SOA puts them
    std::uint64_t n = 0;
    for (std::uint64_t i = 0; i < points; ++i)
      for (std::uint64_t f = 0; f < 3; ++f) n += got[f * points + i] != words[i * 3 + f];
    return n;
  };
  wrong += count_wrong();
  gpu::RawCopy raw{.dst = address(cd),
                   .src = address(cs),
                   .device = 0,
                   .width = 4,
                   .height = points,
                   .src_pitch = 12,
                   .dst_pitch = 4,
                   .src_slice = 4,
                   .dst_slice = points * 4,
                   .slices = 3};
  const gpu::RawCopy plain{.dst = address(cd), .src = address(cs), .bytes = conv_bytes, .device = 0};
  gpu::time_raw_copies(raw, 1);
  gpu::time_raw_copies(plain, 1);
  std::vector<double> caravan_gbps, raw_gbps, plain_gbps, kernel_us, setup_us, teardown_us;
  // Per request, in issue order: when it was handed to the channel (by the caller or the DMA
  // worker) and when it completed.
  std::vector<std::vector<double>> request_start_us, request_end_us;
  const int runs = std::max(reps / 2, 5);
  for (int r = 0; r < runs; ++r) {
    raw_gbps.push_back(gbps(conv_bytes, gpu::time_raw_copies(raw, 1).front()));
    plain_gbps.push_back(gbps(conv_bytes, gpu::time_raw_copies(plain, 1).front()));
    // Poisoned before the last run (the raw 2-D copy wrote the right answer there): the check
    // after its timed conversion sees only what that conversion wrote.
    if (r == runs - 1) {
      std::fill(got.begin(), got.end(), 0xDEADBEEFu);
      cd.write_bytes(0, std::as_bytes(std::span(got)));
    }
    // Timed without a report (building one is on the way to the event), polled like the raw
    // copies' hipStreamSynchronize; then once more with a report, for where the time goes.
    caravan_gbps.push_back(gbps(conv_bytes, polled_copy_seconds(cs, cd)));
    if (r == runs - 1) {  // checked before the copy with a report writes it again
      cd.read_bytes(0, std::as_writable_bytes(std::span(got)));
      wrong += count_wrong();
    }
    CopyReport timed;
    polled_copy_seconds(cs, cd, {.report = &timed});
    kernel_us.push_back(timed.elapsed_us);
    setup_us.push_back(timed.setup_us);
    teardown_us.push_back(timed.teardown_us);
    if (!timed.timeline.empty()) {
      const auto& spans = timed.timeline.front().requests;
      request_start_us.resize(std::max(request_start_us.size(), spans.size()));
      request_end_us.resize(request_start_us.size());
      for (std::size_t i = 0; i < spans.size(); ++i) {
        request_start_us[i].push_back(spans[i].start_us);
        request_end_us[i].push_back(spans[i].end_us);
      }
    }
  }
  Summary sc = summarize(caravan_gbps), sr = summarize(raw_gbps), sp = summarize(plain_gbps), sk = summarize(kernel_us);
  BenchTable ct{
      fmt::format("Layout conversion within GPU 0, {} MiB, three 4-byte fields, AOS -> SOA, GB/s", conv_bytes >> 20),
      {"copy", "median", "p10", "p90", "min", "max"},
      {}};
  ct.rows.push_back(row("caravan copy(), as planned", sc));
  ct.rows.push_back(row("hipMemcpy2DAsync per field (raw copy engine)", sr));
  ct.rows.push_back(row("hipMemcpyAsync D2D, same bytes, no conversion", sp));
  out.tables.push_back(ct);
  const std::uint64_t requests = report.hop_requests.empty() ? 0 : report.hop_requests.front();
  out.headlines.push_back(
      fmt::format("layout conversion fbm0 AOS->SOA: caravan / raw copy-engine 2-D copies = {:.2f}x ({:.1f} vs "
                  "{:.1f} GB/s), {:.2f} of a plain D2D copy ({:.1f} GB/s) via {}{}",
                  sc.median / sr.median, sc.median, sr.median, sc.median / sp.median, sp.median, report.route,
                  wrong == 0 ? "" : fmt::format(" DATA MISMATCH ({} words)", wrong)));
  out.notes.push_back(
      fmt::format("layout conversion: {} request(s) on the channel; the copy's start to its last request's end "
                  "(CopyReport::elapsed_us) median {:.1f} us (p10 {:.1f}, p90 {:.1f}); destination checked "
                  "after the first and after the last timed run",
                  requests, sk.median, sk.p10, sk.p90));
  {  // where the copy's time goes on the host's clock: before the start, each request, after the end
    std::string spans;
    for (std::size_t i = 0; i < request_start_us.size(); ++i)
      spans += fmt::format("{}request {} {:.1f}-{:.1f}", i ? ", " : "", i, summarize(request_start_us[i]).median,
                           summarize(request_end_us[i]).median);
    out.notes.push_back(fmt::format(
        "layout conversion, medians in us: {:.1f} from copy() to the start (planning, "
        "buffers), then from the start: {}; {:.1f} from the last request's end to the event "
        "(copies with a report, untimed)",
        summarize(setup_us).median, spans.empty() ? "no request timeline" : spans, summarize(teardown_us).median));
  }
  if (wrong != 0) out.failure = fmt::format("layout conversion: {} words wrong after the copy", wrong);
  figures["conversion"] = {{"caravan_gbps", summary_json(sc)},
                           {"raw_2d_gbps", summary_json(sr)},
                           {"plain_d2d_gbps", summary_json(sp)},
                           {"elapsed_us", summary_json(sk)},
                           {"requests", requests},
                           {"route", report.route},
                           {"verified", wrong == 0}};
}

// The conversion cases against the kernel op by op: `runs` rounds of the same ops through the
// kernel one op each (`by_op`), a plain D2D copy of the same bytes, and Caravan's copy cs -> cd.
// The last round's op-by-op kernel and Caravan's copy each write a poisoned destination, which
// `count_wrong` then checks (it reads cd into `got`, this poisons it).
struct ConversionTimes {
  Summary caravan, by_op, plain;
  std::uint64_t wrong = 0;
};
ConversionTimes time_conversion(const Instance& cs, const Instance& cd, const gpu::RawCopy& by_op,
                                std::uint64_t conv_bytes, int reps, std::vector<std::uint32_t>& got,
                                const std::function<std::uint64_t()>& count_wrong) {
  const gpu::RawCopy plain{.dst = address(cd), .src = address(cs), .bytes = conv_bytes, .device = 0};
  gpu::time_raw_copies(by_op, 1);
  gpu::time_raw_copies(plain, 1);
  auto poison = [&] {
    std::fill(got.begin(), got.end(), 0xDEADBEEFu);
    cd.write_bytes(0, std::as_bytes(std::span(got)));
  };
  auto check = [&] {
    cd.read_bytes(0, std::as_writable_bytes(std::span(got)));
    return count_wrong();
  };
  std::vector<double> caravan_gbps, by_op_gbps, plain_gbps;
  ConversionTimes t;
  const int runs = std::max(reps / 2, 5);
  for (int r = 0; r < runs; ++r) {
    const bool last = r == runs - 1;
    if (last) poison();
    by_op_gbps.push_back(gbps(conv_bytes, gpu::time_raw_copies(by_op, 1).front()));
    if (last) t.wrong += check();
    plain_gbps.push_back(gbps(conv_bytes, gpu::time_raw_copies(plain, 1).front()));
    if (last) poison();
    caravan_gbps.push_back(gbps(conv_bytes, polled_copy_seconds(cs, cd)));
  }
  t.wrong += check();
  t.caravan = summarize(caravan_gbps), t.by_op = summarize(by_op_gbps), t.plain = summarize(plain_gbps);
  return t;
}

// The table, headline, failure and figures of a conversion case timed by time_conversion.
void report_conversion(BenchReport& out, nlohmann::json& figures, const std::string& key, const std::string& title,
                       const std::string& name, const ConversionTimes& t, std::size_t ops, const std::string& route) {
  BenchTable table{title, {"copy", "median", "p10", "p90", "min", "max"}, {}};
  table.rows.push_back(row("caravan copy(), as planned", t.caravan));
  table.rows.push_back(row(fmt::format("conversion kernel, one op each ({} ops)", ops), t.by_op));
  table.rows.push_back(row("hipMemcpyAsync D2D, same bytes, no conversion", t.plain));
  out.tables.push_back(table);
  out.headlines.push_back(fmt::format(
      "{}: caravan / the kernel op by op = {:.2f}x ({:.1f} vs {:.1f} GB/s), {:.2f} of a plain D2D copy ({:.1f} GB/s) "
      "via {}{}",
      name, t.caravan.median / t.by_op.median, t.caravan.median, t.by_op.median, t.caravan.median / t.plain.median,
      t.plain.median, route, t.wrong == 0 ? "" : fmt::format(" DATA MISMATCH ({} words)", t.wrong)));
  if (t.wrong != 0) out.failure = fmt::format("{}: {} words wrong", name, t.wrong);
  figures[key] = {{"caravan_gbps", summary_json(t.caravan)}, {"kernel_op_by_op_gbps", summary_json(t.by_op)},
                  {"plain_d2d_gbps", summary_json(t.plain)}, {"ops", ops},
                  {"route", route}, {"verified", t.wrong == 0}};
}

// A 2-D layout conversion within GPU 0 whose rows are apart on one side: 48 MiB of points with
// three 4-byte fields in rows of 1024 points, F,x,y -> x,F,y (each row's fields one after
// another). The row walker gives one op of 4096 rows per field (until the 28th session one op
// per field and row, 12288 here); the gpu_convert channel moves them as one group of fields by
// rows. Against those 12288 one-row ops through the same kernel one op each (what the channel
// did before it grouped rows), and a plain D2D copy of the same bytes; verified word by word
// after a poisoned last run.
void run_conversion_2d_case(BenchReport& out, nlohmann::json& figures, MemoryId fbm0, int reps) {
  const FieldSpace xyz({{"x", 4}, {"y", 4}, {"z", 4}});
  constexpr std::uint64_t kRow = 1024;
  const std::uint64_t rows = (48u << 20) / 12 / kRow, points = rows * kRow, conv_bytes = points * 12;
  const Rect plane = Rect::from_extents({static_cast<std::int64_t>(kRow), static_cast<std::int64_t>(rows)});
  Instance cs = Instance::create(fbm0, plane, xyz, Layout::parse("F,x,y")),
           cd = Instance::create(fbm0, plane, xyz, Layout::parse("x,F,y"));
  std::vector<std::uint32_t> words(points * 3), got(points * 3);
  std::mt19937_64 rng(0x2D2D);
  for (auto& w : words) w = static_cast<std::uint32_t>(rng());
  cs.write_bytes(0, std::as_bytes(std::span(words)));
  auto count_wrong = [&] {  // destination words (read into got) not where x,F,y puts them
    std::uint64_t n = 0;
    for (std::uint64_t y = 0; y < rows; ++y)
      for (std::uint64_t x = 0; x < kRow; ++x)
        for (std::uint64_t f = 0; f < 3; ++f) n += got[(y * 3 + f) * kRow + x] != words[(y * kRow + x) * 3 + f];
    return n;
  };
  CopyReport report;
  copy(cs, cd, {.report = &report}).wait();  // plans, and loads what the first copy loads
  gpu::RawCopy by_op{.dst = address(cd), .src = address(cs), .device = 0};
  std::vector<dma::TransferOp> field_ops;
  dma::append_tile_ops(plane, xyz, dma::View::of_layout(Layout::parse("F,x,y"), plane, xyz, 0),
                       dma::View::of_layout(Layout::parse("x,F,y"), plane, xyz, 0), field_ops);
  for (const dma::TransferOp& op : field_ops)
    for (std::uint64_t r = 0; r < op.rows; ++r) by_op.kernel_ops.push_back(op.row(r));
  const ConversionTimes t = time_conversion(cs, cd, by_op, conv_bytes, reps, got, count_wrong);
  report_conversion(out, figures, "conversion_2d",
                    fmt::format("2-D layout conversion within GPU 0, {} MiB, rows of {} points, F,x,y -> x,F,y, GB/s",
                                conv_bytes >> 20, kRow),
                    "2-D layout conversion fbm0 F,x,y->x,F,y", t, by_op.kernel_ops.size(), report.route);
  {  // one more copy with a report: where its time goes
    CopyReport timed;
    polled_copy_seconds(cs, cd, {.report = &timed});
    std::string spans;
    if (!timed.timeline.empty())
      for (const auto& span : timed.timeline.front().requests)
        spans += fmt::format("{}{:.1f}-{:.1f}", spans.empty() ? "" : ", ", span.start_us, span.end_us);
    out.notes.push_back(fmt::format("2-D layout conversion: {} tile(s), {} request(s) on the channel; one copy with a "
                                    "report: {:.1f} us from copy() to the start, requests (us from the start) {}, "
                                    "{:.1f} us from the last request's end to the event",
                                    timed.tiles, timed.hop_requests.empty() ? 0 : timed.hop_requests.front(),
                                    timed.setup_us, spans, timed.teardown_us));
  }
}

// A 3-D layout conversion within GPU 0 with the dimensions permuted: 48 MiB of points with three
// 4-byte fields over 1024 x 64 x 64, F,x,y,z -> x,F,z,y. Per tile and field the row walker gives
// one op of rows (y) per plane (z), the planes apart on the destination; each plane's fields are
// listed together (29th session), so the gpu_convert channel moves them as one group. Against the
// same ops in the order the walker listed them before (field by field), through the same kernel
// one op each, as the channel then moved them (32 ops a launch: each launch one field's planes,
// the interleaved source read once per field), and a plain D2D copy of the same bytes; verified
// word by word after a poisoned last run.
void run_conversion_3d_case(BenchReport& out, nlohmann::json& figures, MemoryId fbm0, int reps) {
  const FieldSpace xyz({{"u", 4}, {"v", 4}, {"w", 4}});
  constexpr std::uint64_t kX = 1024, kY = 64, kZ = 64, points = kX * kY * kZ, conv_bytes = points * 12;
  const Rect box = Rect::from_extents({kX, kY, kZ});
  Instance cs = Instance::create(fbm0, box, xyz, Layout::parse("F,x,y,z")),
           cd = Instance::create(fbm0, box, xyz, Layout::parse("x,F,z,y"));
  std::vector<std::uint32_t> words(points * 3), got(points * 3);
  std::mt19937_64 rng(0x3D3D);
  for (auto& w : words) w = static_cast<std::uint32_t>(rng());
  cs.write_bytes(0, std::as_bytes(std::span(words)));
  auto count_wrong = [&] {  // destination words (read into got) not where x,F,z,y puts them
    std::uint64_t n = 0;
    for (std::uint64_t y = 0; y < kY; ++y)
      for (std::uint64_t z = 0; z < kZ; ++z)
        for (std::uint64_t f = 0; f < 3; ++f)
          for (std::uint64_t x = 0; x < kX; ++x)
            n += got[((y * kZ + z) * 3 + f) * kX + x] != words[((z * kY + y) * kX + x) * 3 + f];
    return n;
  };
  CopyReport report;
  copy(cs, cd, {.report = &report}).wait();  // plans, and loads what the first copy loads
  gpu::RawCopy by_op{.dst = address(cd), .src = address(cs), .device = 0};
  std::vector<dma::TransferOp> by_plane;  // the walker's order now: each plane's three fields
  dma::append_tile_ops(box, xyz, dma::View::of_layout(Layout::parse("F,x,y,z"), box, xyz, 0),
                       dma::View::of_layout(Layout::parse("x,F,z,y"), box, xyz, 0), by_plane);
  for (std::size_t f = 0; f < 3; ++f)  // back to field by field
    for (std::size_t p = f; p < by_plane.size(); p += 3) by_op.kernel_ops.push_back(by_plane[p]);
  const ConversionTimes t = time_conversion(cs, cd, by_op, conv_bytes, reps, got, count_wrong);
  report_conversion(out, figures, "conversion_3d",
                    fmt::format("3-D layout conversion within GPU 0, {} MiB, {} x {} x {}, F,x,y,z -> x,F,z,y, GB/s",
                                conv_bytes >> 20, kX, kY, kZ),
                    "3-D layout conversion fbm0 F,x,y,z->x,F,z,y", t, by_op.kernel_ops.size(), report.route);
  out.notes.push_back(fmt::format("3-D layout conversion: {} tile(s), {} request(s) on the channel", report.tiles,
                                  report.hop_requests.empty() ? 0 : report.hop_requests.front()));
}

// Where one copy's time goes, split at the engine's own timestamps (call -> start -> the first
// request's issue -> its completion callback -> the copy's finish) and the moment the calling
// thread saw the event (polled). Building the report falls in the retire step.
struct CopyBreakdown {
  std::vector<double> setup_us, issue_us, request_us, teardown_us, notice_us;

  bool empty() const { return setup_us.empty(); }
  void time(const Instance& src, const Instance& dst) {
    CopyReport report;
    auto start = Clock::now();
    Event e = copy(src, dst, {.report = &report});
    while (!e.has_triggered()) {
    }
    const double total = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    e.wait();
    if (report.timeline.empty() || report.timeline.front().requests.empty()) return;
    const RequestSpan& request = report.timeline.front().requests.front();
    setup_us.push_back(report.setup_us);
    issue_us.push_back(request.start_us);
    request_us.push_back(request.end_us - request.start_us);
    teardown_us.push_back(report.teardown_us + (report.elapsed_us - request.end_us));
    notice_us.push_back(total - report.setup_us - report.elapsed_us - report.teardown_us);
  }
  void add_rows(BenchTable& t, const std::string& first) const {
    if (empty()) return;
    t.rows.push_back(row(first + "call -> start (plan, admit)", summarize(setup_us)));
    t.rows.push_back(row("  start -> request issued", summarize(issue_us)));
    t.rows.push_back(row("  issued -> completion callback (channel)", summarize(request_us)));
    t.rows.push_back(row("  callback -> event triggered (retire, report)", summarize(teardown_us)));
    t.rows.push_back(row("  triggered -> seen by the polling caller", summarize(notice_us)));
  }
  nlohmann::json json() const {
    return {{"setup", summary_json(summarize(setup_us))},
            {"issue", summary_json(summarize(issue_us))},
            {"request", summary_json(summarize(request_us))},
            {"retire", summary_json(summarize(teardown_us))},
            {"notice", summary_json(summarize(notice_us))}};
  }
};

// "copies after idle": small copies, each after --idle-ms with nothing to do, when the channels'
// service threads sleep. Caravan's time from copy() to the event (waited for, and polled) against
// hipMemcpyAsync + hipStreamSynchronize on the same buffers after the same idle time, in turn.
// Before waiting threads helped (runtime/progress.h), waking those threads cost 150-200 us here.
void run_idle_case(BenchReport& out, nlohmann::json& figures, std::uint32_t rank) {
  const FieldSpace& f = fields();
  const Layout aos = Layout::parse("F,x");
  const MemoryId zcm{0, rank, MemoryKind::zcm, 0}, fbm0{0, rank, MemoryKind::fbm, 0};
  struct Case {
    std::string name;
    MemoryId src, dst;
    std::uint64_t bytes;
  };
  const std::vector<Case> cases = {{"64 KiB zcm->fbm0", zcm, fbm0, 64u << 10}, {"16 MiB fbm0->fbm0", fbm0, fbm0, 16u << 20}};
  const auto idle = std::chrono::milliseconds(g_gpu.idle_ms);
  const int reps = std::max(g_gpu.repetitions, 10);
  BenchTable t{fmt::format("Time of one copy after {} ms idle, us ({} runs each, the four kinds in turn)", g_gpu.idle_ms, reps),
               {"copy", "median", "p10", "p90", "min", "max"}, {}};
  for (const Case& c : cases) {
    const Rect space = Rect::from_extents({static_cast<std::int64_t>(c.bytes / f.total_size())});
    Instance src = Instance::create(c.src, space, f, aos), dst = Instance::create(c.dst, space, f, aos);
    gpu::RawCopy raw{.dst = address(dst), .src = address(src), .bytes = c.bytes, .device = 0};
    copy(src, dst).wait();  // plan, streams, first touch
    gpu::time_raw_copies(raw, 1);
    std::vector<double> waited_us, polled_us, raw_us;
    CopyBreakdown breakdown;
    for (int r = 0; r < reps; ++r) {
      std::this_thread::sleep_for(idle);
      raw_us.push_back(gpu::time_raw_copies(raw, 1).front() * 1e6);
      std::this_thread::sleep_for(idle);
      auto start = Clock::now();
      copy(src, dst).wait();
      waited_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
      std::this_thread::sleep_for(idle);
      polled_us.push_back(polled_copy_seconds(src, dst) * 1e6);
      std::this_thread::sleep_for(idle);
      breakdown.time(src, dst);
    }
    const bool verified = verify(src, dst);
    Summary sw = summarize(waited_us), sp = summarize(polled_us), sr = summarize(raw_us);
    t.rows.push_back(row(c.name + " caravan, Event::wait", sw));
    t.rows.push_back(row(c.name + " caravan, event polled", sp));
    t.rows.push_back(row(c.name + " hipMemcpyAsync + hipStreamSynchronize", sr));
    breakdown.add_rows(t, "  with a report, polled: ");
    out.headlines.push_back(fmt::format("{} after {} ms idle: caravan {:.1f} us (Event::wait), {:.1f} us (polled) vs raw {:.1f} us: "
                                        "{:.2f}x / {:.2f}x raw's time{}",
                                        c.name, g_gpu.idle_ms, sw.median, sp.median, sr.median, sw.median / sr.median,
                                        sp.median / sr.median, verified ? "" : " DATA MISMATCH"));
    figures["idle"][c.name] = {{"waited_us", summary_json(sw)}, {"polled_us", summary_json(sp)}, {"raw_us", summary_json(sr)},
                               {"idle_ms", g_gpu.idle_ms}, {"verified", verified}};
    if (!breakdown.empty()) figures["idle"][c.name]["with_report"] = breakdown.json();
  }
  out.notes.push_back(fmt::format("idle case: waiting threads help = {} (CARAVAN_WAIT_HELPS), service threads poll {} us "
                                  "(CARAVAN_GPU_WORKER_SPIN_US)",
                                  settings::get_bool("CARAVAN_WAIT_HELPS"), settings::get_int("CARAVAN_GPU_WORKER_SPIN_US")));
  out.tables.push_back(t);
}

BenchReport run_gpu_bench() {
  validate_options(g_gpu);
  BenchReport out;
  GpuProbe probe = probe_gpus();
  if (probe.device_count == 0) {
    out.headlines.push_back("skipped: " + no_gpu_reason(probe));
    out.figures = {{"skipped", true}, {"reason", no_gpu_reason(probe)}};
    return out;
  }
  Runtime rt;
  const gpu::Topology& topo = gpu::topology();
  const auto rank = static_cast<std::uint32_t>(rt.rank());
  if (g_gpu.multipath_only || g_gpu.priority_only) {
    nlohmann::json figures = nlohmann::json::object();
    if (g_gpu.multipath_only) run_multipath_case(out, figures, rank);
    if (g_gpu.priority_only) run_priority_case(out, figures, rank);
    out.figures = figures;
    return out;
  }
  if (g_gpu.idle_only) {
    nlohmann::json figures = nlohmann::json::object();
    run_idle_case(out, figures, rank);
    out.figures = figures;
    return out;
  }
  if (g_gpu.conversion_only) {
    nlohmann::json figures = nlohmann::json::object();
    run_conversion_case(out, figures, {0, rank, MemoryKind::fbm, 0}, g_gpu.repetitions);
    run_conversion_2d_case(out, figures, {0, rank, MemoryKind::fbm, 0}, g_gpu.repetitions);
    run_conversion_3d_case(out, figures, {0, rank, MemoryKind::fbm, 0}, g_gpu.repetitions);
    out.figures = figures;
    return out;
  }
  const MemoryId sys{0, rank, MemoryKind::sys, 0}, zcm{0, rank, MemoryKind::zcm, 0}, fbm0{0, rank, MemoryKind::fbm, 0},
      fbm1{0, rank, MemoryKind::fbm, 1};
  const Rect space = Rect::from_extents({static_cast<std::int64_t>((g_gpu.mib << 20) / fields().total_size())});
  const std::uint64_t bytes = space.volume() * fields().total_size();
  const Layout aos = Layout::parse("F,x");
  auto make = [&](MemoryId m) { return Instance::create(m, space, fields(), aos); };

  Instance host = make(zcm), pageable = make(sys), a = make(fbm0), b = make(fbm0);
  {  // fresh random bytes in the sources (the GPU sources get theirs from the pinned one)
    std::mt19937_64 rng(std::random_device{}());
    auto* p = reinterpret_cast<std::uint64_t*>(host.data());
    for (std::uint64_t i = 0; i < bytes / 8; ++i) p[i] = rng();
    std::memcpy(pageable.data(), host.data(), bytes);
    copy(host, a).wait();
  }
  if (g_gpu.all_to_all_only) {
    nlohmann::json figures = nlohmann::json::object();
    run_all_to_all_case(out, figures, rank, a);
    out.figures = figures;
    return out;
  }
  const bool peer = topo.devices.size() >= 2 && topo.can_peer(0, 1);
  Instance c;
  if (peer) c = make(fbm1);

  std::vector<Pair> pairs;
  auto add = [&](std::string name, std::string raw_name, const Instance& src, const Instance& dst, gpu::RawCopy raw, int reps) {
    raw.dst = address(dst);
    raw.src = address(src);
    raw.bytes = bytes;
    pairs.push_back({std::move(name), std::move(raw_name), src, dst, raw, reps, {}, {}, {}, {}, 0, false});
  };
  const int reps = g_gpu.repetitions;
  add("sdma H2D zcm->fbm0", "hipMemcpyAsync H2D", host, a, {.device = 0}, reps);
  add("sdma D2H fbm0->zcm", "hipMemcpyAsync D2H", a, host, {.device = 0}, reps);
  add("sdma local fbm0->fbm0", "hipMemcpyAsync D2D", a, b, {.device = 0}, reps);
  if (peer) add("xgmi fbm0->fbm1", "hipMemcpyPeerAsync 0->1", a, c, {.device = 0, .peer = true, .src_device = 0, .dst_device = 1}, reps);
  add("sys->fbm0 (planned path)", "hipMemcpyAsync pageable H2D", pageable, a, {.device = 0}, std::max(reps / 4, 3));

  for (Pair& p : pairs) {
    CopyReport report;
    copy(p.src, p.dst, {.report = &report}).wait();  // warm-up: plan, streams, first touch
    gpu::time_raw_copies(p.raw, 1);
    for (int r = 0; r < p.repetitions; ++r) {
      p.baseline.push_back(gbps(bytes, gpu::time_raw_copies(p.raw, 1).front()));
      // Polled like hipStreamSynchronize polls in the raw baseline (the same waiting policy),
      // and without a report (building one is on the way to the event; the warm-up copy's
      // report names the route)...
      p.caravan.push_back(gbps(bytes, polled_copy_seconds(p.src, p.dst)));
      // ...and with Event::wait(), which sleeps after CARAVAN_WAIT_SPIN_US.
      auto start = Clock::now();
      copy(p.src, p.dst).wait();
      p.caravan_wait.push_back(gbps(bytes, std::chrono::duration<double>(Clock::now() - start).count()));
    }
    p.route = report.route;
    p.requests = report.hop_requests.empty() ? 0 : report.hop_requests.back();
    p.verified = verify(p.src, p.dst);
  }

  BenchTable t{fmt::format("GB/s, {} MiB per copy, each timed from submission to completion, raw and Caravan alternating; "
                           "(caravan) polls the event as hipStreamSynchronize polls the stream", bytes >> 20),
               {"copy", "median", "p10", "p90", "min", "max"}, {}};
  nlohmann::json figures = nlohmann::json::object();
  for (const Pair& p : pairs) {
    Summary sc = summarize(p.caravan), sw = summarize(p.caravan_wait), sb = summarize(p.baseline);
    t.rows.push_back(row(p.name + " (caravan)", sc));
    t.rows.push_back(row(p.name + " (caravan, Event::wait)", sw));
    t.rows.push_back(row(p.raw_name + " (raw, same buffers)", sb));
    double ratio = sc.median / sb.median;
    out.headlines.push_back(fmt::format("{}: caravan / raw = {:.3f} ({:.1f} vs {:.1f} GB/s){}{}", p.name, ratio, sc.median, sb.median,
                                        p.name.rfind("sys", 0) == 0 ? "" : " (goal >= 0.95)", p.verified ? "" : " DATA MISMATCH"));
    out.notes.push_back(fmt::format("{}: route {}, {} requests, {} runs, destination verified: {}; with Event::wait() "
                                    "caravan / raw = {:.3f}",
                                    p.name, p.route, p.requests, p.repetitions, p.verified ? "yes" : "NO", sw.median / sb.median));
    figures[p.name] = {{"caravan_gbps", summary_json(sc)}, {"caravan_wait_gbps", summary_json(sw)}, {"raw_gbps", summary_json(sb)},
                       {"ratio", ratio}, {"ratio_wait", sw.median / sb.median}, {"route", p.route}, {"verified", p.verified}};
  }
  out.tables.push_back(t);
  if (peer && topo.can_peer(1, 0)) run_both_ways_case(out, figures, a, c, reps);

  // Diagnostic: the per-request cost of the copy engines (raw, 4 MiB pieces).
  {
    BenchTable d{"Raw copies cut into 4 MiB pieces (what one request costs), GB/s", {"copy", "median", "p10", "p90", "min", "max"}, {}};
    auto piece = [&](const std::string& name, gpu::RawCopy raw, int streams) {
      raw.chunk = 4u << 20;
      raw.streams = streams;
      std::vector<double> g;
      for (double s : gpu::time_raw_copies(raw, std::max(reps / 2, 3))) g.push_back(gbps(bytes, s));
      Summary s = summarize(g);
      d.rows.push_back(row(name, s));
      figures["pieces"][name] = summary_json(s);
    };
    piece("H2D 4 MiB pieces, 1 stream", pairs[0].raw, 1);
    piece("H2D 4 MiB pieces, 3 streams", pairs[0].raw, 3);
    if (peer) {
      piece("peer 4 MiB pieces, 1 stream", pairs[3].raw, 1);
      piece("peer 4 MiB pieces, 3 streams", pairs[3].raw, 3);
    }
    out.tables.push_back(d);
  }

  run_conversion_case(out, figures, fbm0, reps);
  run_conversion_2d_case(out, figures, fbm0, reps);
  run_conversion_3d_case(out, figures, fbm0, reps);

  run_all_to_all_case(out, figures, rank, a);

  // Diagnostic: the fixed cost of one copy (a 64 KiB copy, where bandwidth does not matter).
  {
    const Rect small = Rect::from_extents({static_cast<std::int64_t>((64u << 10) / fields().total_size())});
    Instance ss = Instance::create(zcm, small, fields(), aos), sd = Instance::create(fbm0, small, fields(), aos);
    gpu::RawCopy raw{.dst = address(sd), .src = address(ss), .bytes = 64u << 10, .device = 0};
    copy(ss, sd).wait();
    std::vector<double> caravan_us, raw_us;
    for (int r = 0; r < 50; ++r) {
      raw_us.push_back(gpu::time_raw_copies(raw, 1).front() * 1e6);
      caravan_us.push_back(polled_copy_seconds(ss, sd) * 1e6);
    }
    // Where the caravan copy's time goes: the same copy with a report.
    CopyBreakdown breakdown;
    for (int r = 0; r < 50; ++r) breakdown.time(ss, sd);
    Summary sc = summarize(caravan_us), sr = summarize(raw_us);
    BenchTable l{"Time of one 64 KiB zcm->fbm0 copy, us (50 runs): the fixed cost per copy", {"copy", "median", "p10", "p90", "min", "max"}, {}};
    l.rows.push_back(row("caravan copy(), event polled", sc));
    l.rows.push_back(row("hipMemcpyAsync + hipStreamSynchronize", sr));
    breakdown.add_rows(l, "  with a report: ");
    out.tables.push_back(l);
    figures["latency_us"] = {{"caravan", summary_json(sc)}, {"raw", summary_json(sr)}};
    if (!breakdown.empty()) figures["latency_us"]["with_report"] = breakdown.json();
  }

  run_idle_case(out, figures, rank);
  if (g_gpu.priority) run_priority_case(out, figures, rank);
  if (g_gpu.multipath) run_multipath_case(out, figures, rank);
  out.notes.push_back(fmt::format("GPUs: {} x {}; peer copies {}", topo.devices.size(), topo.devices[0].name,
                                  peer ? "GPU 0 -> GPU 1" : "not measured (needs 2 GPUs with peer access)"));
  out.figures = figures;
  out.figures["bytes"] = bytes;
  return out;
}

}  // namespace

void add_bench_gpu(CLI::App& bench) {
  CLI::App& c = add_bench_case(bench, "gpu", "sdma and xgmi copies vs the raw HIP calls on the same buffers; copy-engine priorities; "
                                             "a multi-path host->fbm0 copy vs one PCIe link",
                               run_gpu_bench);
  c.add_option("--mib", g_gpu.mib, "MiB per copy")->capture_default_str();
  c.add_option("--reps", g_gpu.repetitions, "Runs of each case")->capture_default_str();
  CLI::Option* no_priority = c.add_flag("!--no-priority", g_gpu.priority, "Skip the copy-engine priority case");
  CLI::Option* no_multipath = c.add_flag("!--no-multipath", g_gpu.multipath, "Skip the multi-path host->fbm0 case");
  CLI::Option* multipath_only =
      c.add_flag("--multipath-only", g_gpu.multipath_only, "Run only the multi-path host->fbm0 case")
          ->excludes(no_multipath);
  c.add_option("--multipath-mib", g_gpu.multipath_mib, "MiB per copy of the multi-path case")->capture_default_str();
  CLI::Option* priority_only =
      c.add_flag("--priority-only", g_gpu.priority_only, "Run only the copy-engine priority case")
          ->excludes(no_priority);
  // With --multipath-only or --priority-only, --all-to-all-only was ignored.
  CLI::Option* all_to_all_only =
      c.add_flag("--all-to-all-only", g_gpu.all_to_all_only, "Run only the all-to-all case over the peer links")
          ->excludes(multipath_only)
          ->excludes(priority_only);
  CLI::Option* conversion_only =
      c.add_flag("--conversion-only", g_gpu.conversion_only, "Run only the layout-conversion case within GPU 0")
          ->excludes(multipath_only)
          ->excludes(priority_only)
          ->excludes(all_to_all_only);
  c.add_flag("--idle-only", g_gpu.idle_only, "Run only the small copies after idle time (service threads asleep)")
      ->excludes(multipath_only)
      ->excludes(priority_only)
      ->excludes(all_to_all_only)
      ->excludes(conversion_only);
  c.add_option("--idle-ms", g_gpu.idle_ms, "Idle time before each copy of the idle case (ms)")->capture_default_str();
  c.add_option("--priority-mib", g_gpu.priority_mib, "MiB of the high-priority copy")->capture_default_str();
  c.add_option("--priority-load-copies", g_gpu.priority_load_copies, "Low-priority copies queued before it")
      ->capture_default_str();
  c.add_option("--priority-load-mib", g_gpu.priority_load_mib, "MiB per low-priority copy")->capture_default_str();
  c.add_option("--priority-runs", g_gpu.priority_runs, "Runs of the priority case")->capture_default_str();
}

}  // namespace caravan::app
