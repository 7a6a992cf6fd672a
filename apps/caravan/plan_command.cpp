// `caravan plan`: plan one copy on a machine (a file, a built-in, a generated cluster or the live
// machine) and print the path, per-hop layouts and request sizes, buffer sizes, the predicted
// throughput and the planning time. `caravan machine generate` writes a cluster's machine file.
#include "apps/caravan/commands.h"

#include "runtime/dma/calibrate.h"

#include <caravan/error.h>
#include <caravan/planner/machine_file.h>
#include <caravan/settings.h>
#include <caravan/planner/planner.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <fstream>

namespace caravan::app {
namespace {

// The machine a command plans on or shows: --machine, else CARAVAN_PLANNER_MACHINE.
std::string machine_or_setting(const std::string& option) {
  return option.empty() ? settings::get_string("CARAVAN_PLANNER_MACHINE") : option;
}

struct PlanArgs {
  std::string machine;  // empty: CARAVAN_PLANNER_MACHINE
  std::string src, dst;
  std::string src_layout = "F,x", dst_layout;
  std::string size = "64M";
  std::string extents;
  std::string fields = "4x4";
  std::string planner = "auto";
  std::string threshold;
  int max_hops = 0;
  bool transit = false;
  bool json = false;
};

// "4x4": four fields of four bytes; "8,4,4": fields of those sizes.
FieldSpace parse_fields(const std::string& text) {
  std::vector<Field> fields;
  auto x = text.find('x');
  auto number = [&](std::string_view s) {
    std::uint32_t v = 0;
    auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || ptr != s.data() + s.size() || v == 0)
      throw Error(Errc::invalid_argument,
                  fmt::format("--fields '{}': expected COUNTxBYTES (e.g. 4x4) or sizes (e.g. 8,4,4), each a whole "
                              "number of at least 1",
                              text));
    return v;
  };
  if (x != std::string::npos) {
    auto count = number(std::string_view(text).substr(0, x));
    auto size = number(std::string_view(text).substr(x + 1));
    constexpr std::uint32_t kMaxFields = 65536;
    if (count > kMaxFields)
      throw Error(Errc::invalid_argument, fmt::format("--fields '{}': at most {} fields", text, kMaxFields));
    return FieldSpace::uniform(static_cast<int>(count), size);
  }
  std::string_view rest = text;
  while (true) {
    auto comma = rest.find(',');
    fields.push_back({fmt::format("f{}", fields.size()), number(rest.substr(0, comma))});
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return FieldSpace(std::move(fields));
}

int dims_of(const Layout& l) {
  int dims = 0;
  for (const auto& c : l)
    if (c.kind != LayoutComponent::Kind::fields) dims = std::max(dims, c.dim + 1);
  return std::max(dims, 1);
}

// The index space: --extents, or --size bytes of points in `dims` about equal dimensions.
IndexSpace make_space(const PlanArgs& a, int dims, const FieldSpace& fields) {
  std::vector<std::int64_t> extents;
  if (!a.extents.empty()) {
    std::string_view rest = a.extents;
    while (true) {
      auto comma = rest.find(',');
      std::int64_t v = 0;
      auto part = rest.substr(0, comma);
      auto [ptr, ec] = std::from_chars(part.data(), part.data() + part.size(), v);
      if (ec != std::errc() || ptr != part.data() + part.size())
        throw Error(Errc::invalid_argument, fmt::format("--extents '{}': expected extents such as 8192,8192", a.extents));
      if (v < 1)
        throw Error(Errc::invalid_argument,
                    fmt::format("--extents '{}': each extent must be at least 1 (got {})", a.extents, v));
      extents.push_back(v);
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
    return Rect::from_extents(extents);
  }
  const std::uint64_t bytes = settings::parse_byte_count(a.size, "--size");
  if (bytes == 0) throw Error(Errc::invalid_argument, "--size '0': must be at least 1 byte");
  if (bytes < fields.total_size())
    throw Error(Errc::invalid_argument,
                fmt::format("--size '{}': {} bytes is less than one point of --fields ({} bytes)", a.size, bytes,
                            fields.total_size()));
  std::uint64_t points = bytes / fields.total_size();
  auto side = static_cast<std::int64_t>(std::llround(std::pow(static_cast<double>(points), 1.0 / dims)));
  side = std::max<std::int64_t>(side, 1);
  std::uint64_t rest = points;
  for (int d = 0; d + 1 < dims; ++d) {
    extents.push_back(side);
    rest = std::max<std::uint64_t>(1, rest / static_cast<std::uint64_t>(side));
  }
  extents.push_back(static_cast<std::int64_t>(rest));
  return Rect::from_extents(extents);
}

// The machine's description cut to about 80 characters at a word, marked when cut.
std::string short_description(const std::string& text) {
  constexpr std::size_t kWidth = 80;
  if (text.size() <= kWidth) return text;
  const std::size_t space = text.rfind(' ', kWidth);
  return text.substr(0, space == std::string::npos ? kWidth : space) + " ...";
}

template <class F>
double median_us(F&& fn, int runs) {
  std::vector<double> us;
  for (int i = 0; i < runs; ++i) {
    auto start = std::chrono::steady_clock::now();
    fn();
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

void run_plan(const PlanArgs& a) {
  using namespace caravan::planner;
  // "local": this rank as the runtime sees it (files, GPUs, calibrated throughput), as copies are planned.
  const std::string machine = machine_or_setting(a.machine);
  TransferGraph graph(machine == "local" ? dma::live_machine(0) : resolve_machine(machine));
  TransferRequest request;
  request.src = MemoryId::parse(a.src);
  request.dst = MemoryId::parse(a.dst);
  request.src_layout = Layout::parse(a.src_layout);
  request.dst_layout = Layout::parse(a.dst_layout.empty() ? a.src_layout : a.dst_layout);
  request.fields = parse_fields(a.fields);
  request.space = make_space(a, std::max(dims_of(request.src_layout), dims_of(request.dst_layout)), request.fields);
  PlannerOptions options = PlannerOptions::from_settings();
  if (!a.threshold.empty()) {
    options.buffer_threshold = settings::parse_byte_count(a.threshold, "--threshold");
    if (options.buffer_threshold == 0)
      throw Error(Errc::invalid_argument, fmt::format("--threshold '{}': must be at least 1 byte", a.threshold));
  }
  if (a.max_hops > 0) options.max_hops = a.max_hops;
  if (a.transit) options.transit_nodes = true;
  std::string kind = a.planner;
  if (kind == "auto") kind = request.bytes() >= options.full_min_bytes ? "full" : "simple";
  constexpr int kRuns = 5;
  if (kind == "multipath") {
    MultiPlan plan = plan_multipath(graph, request, options);
    double us = median_us([&] { plan_multipath(graph, request, options); }, kRuns);
    if (a.json) {
      auto out = nlohmann::json::parse(to_json(plan));
      out["machine"] = graph.name();
      out["space"] = request.space.to_string();
      out["planning_us"] = us;
      fmt::print("{}\n", out.dump(2));
    } else {
      fmt::print("machine {} ({}), instance {} x |F| = {} B\n{}planning time: {:.1f} us (median of {})\n", graph.name(),
                 short_description(graph.description().description), request.space.to_string(),
                 request.fields.total_size(), to_text(plan), us, kRuns);
    }
    return;
  }
  auto run = [&] { return kind == "full" ? plan_full(graph, request, options) : plan_simple(graph, request, options); };
  if (kind != "full" && kind != "simple")
    throw Error(Errc::invalid_argument, fmt::format("--planner '{}': expected auto, full, simple or multipath", kind));
  Plan plan = run();
  double us = median_us(run, kRuns);
  if (a.json) {
    auto out = nlohmann::json::parse(to_json(plan));
    out["machine"] = graph.name();
    out["space"] = request.space.to_string();
    out["planning_us"] = us;
    fmt::print("{}\n", out.dump(2));
  } else {
    fmt::print("machine {}, instance {} x |F| = {} B\n{}planning time: {:.1f} us (median of {})\n", graph.name(),
               request.space.to_string(), request.fields.total_size(), to_text(plan), us, kRuns);
  }
}

// `caravan machine show`: memories (with capacity and channels out) and channels (kind, peak,
// shared resources), so that a newcomer finds the names Instance::create and copy() take.
void show_machine(const std::string& spec, bool json) {
  // "local" as the runtime sees this rank (with files and calibrated throughput), which is more
  // than the planner's own view of the host.
  const planner::MachineDescription description = spec == "local" ? dma::live_machine(0) : planner::resolve_machine(spec);
  if (json) {
    fmt::print("{}\n", planner::to_machine_json(description));
    return;
  }
  const planner::TransferGraph graph(description);
  fmt::print("machine {}: {}\n\n", graph.name(), graph.description().description);
  fmt::print("{:<28} {:>12} {:>9}\n", "memory", "capacity", "channels");
  for (std::uint32_t v = 0; v < graph.memory_count(); ++v) {
    const auto& m = graph.memory(v);
    const std::string capacity = m.capacity ? fmt::format("{:.1f} GiB", static_cast<double>(m.capacity) / (1u << 30)) : "-";
    fmt::print("{:<28} {:>12} {:>9}\n", m.id.to_string(), capacity, graph.out_channels(v).size());
  }
  fmt::print("\n{:<12} {:<28} {:<28} {:>10}  {}\n", "channel", "from", "to", "peak GB/s", "shares");
  for (std::uint32_t c = 0; c < graph.channel_count(); ++c) {
    const auto& ch = graph.channel(c);
    std::string shares;
    for (std::uint32_t r : ch.resources) shares += (shares.empty() ? "" : ", ") + graph.resource(r).name;
    fmt::print("{:<12} {:<28} {:<28} {:>10.1f}  {}\n", to_string(ch.kind), graph.memory(ch.src).id.to_string(),
               ch.self_loop() ? std::string("(itself: layout conversion)") : graph.memory(ch.dst).id.to_string(),
               ch.peak_gbps, shares);
  }
}

}  // namespace

void add_plan_command(CLI::App& app) {
  static PlanArgs args;
  CLI::App* plan = app.add_subcommand("plan", "Plan a copy: print the path, per-hop layouts and request sizes, buffers, predicted GB/s");
  plan->add_option("--machine", args.machine,
                   "local, a built-in machine (isometry-two-node, h200x4), generate:NODESxGPUS, or a machine file "
                   "(default: CARAVAN_PLANNER_MACHINE, local unless set)");
  plan->add_option("--src", args.src, "Source memory, e.g. node0/rank0/fbm")->required();
  plan->add_option("--dst", args.dst, "Destination memory, e.g. node1/rank1/fbm")->required();
  plan->add_option("--src-layout", args.src_layout, "Source layout, e.g. F,x,y")->capture_default_str();
  plan->add_option("--dst-layout", args.dst_layout, "Destination layout (default: the source layout)");
  CLI::Option* size = plan->add_option("--size", args.size,
                                       "Payload bytes (K/M/G suffixes); the instance is made of about equal dimensions")
                          ->capture_default_str();
  plan->add_option("--extents", args.extents, "Instead of --size: the extent of each dimension, e.g. 8192,8192")
      ->excludes(size);
  plan->add_option("--fields", args.fields, "Field space: COUNTxBYTES (4x4) or a list of sizes (8,4,4)")->capture_default_str();
  plan->add_option("--planner", args.planner, "auto (by CARAVAN_PLANNER_FULL_MIN_BYTES), full, simple or multipath")
      ->capture_default_str();
  plan->add_option("--threshold", args.threshold, "Buffer threshold TH (default CARAVAN_PLANNER_BUFFER_THRESHOLD)");
  plan->add_option("--max-hops", args.max_hops, "Longest path considered (default CARAVAN_PLANNER_MAX_HOPS)")
      ->check(CLI::Range(1, 16));  // the setting's range
  plan->add_flag("--transit", args.transit, "Allow paths through memories of other nodes");
  plan->add_flag("--json", args.json, "Print the plan as JSON");
  plan->callback([] { run_plan(args); });

  static int nodes = 2, gpus = 8;
  static std::string output;
  CLI::App* machine = app.add_subcommand("machine", "Machine description files: show one, or generate one");
  machine->require_subcommand(0, 1);
  machine->callback([machine] {
    if (machine->get_subcommands().empty())
      throw Error(Errc::invalid_argument,
                  "caravan machine: name a subcommand: show (a machine's memories and channels) or generate (write a "
                  "machine file); see caravan machine --help");
  });
  CLI::App* generate = machine->add_subcommand("generate", "Write the machine file of N nodes x G GPUs (H200-like, one NIC per node)");
  generate->add_option("--nodes", nodes, "Nodes")->capture_default_str();
  generate->add_option("--gpus", gpus, "GPUs (ranks) per node")->capture_default_str();
  generate->add_option("-o,--output", output, "File to write (default: standard output)");
  static std::string shown;  // empty: CARAVAN_PLANNER_MACHINE
  static bool show_json = false;
  CLI::App* show = machine->add_subcommand("show", "List a machine's memories and channels (what Instance::create and copy() accept)");
  show->add_option("--machine", shown,
                   "local (this machine, as the runtime sees it), a built-in machine (isometry-two-node, h200x4), "
                   "generate:NODESxGPUS, or a machine file (default: CARAVAN_PLANNER_MACHINE, local unless set)");
  show->add_flag("--json", show_json, "Print the machine file (JSON) instead of tables");
  show->callback([] { show_machine(machine_or_setting(shown), show_json); });
  generate->callback([] {
    // generate_cluster checks --nodes and --gpus (their bounds and their product).
    std::string text = planner::to_machine_json(planner::generate_cluster({nodes, gpus}));
    if (output.empty()) {
      fmt::print("{}\n", text);
      return;
    }
    std::ofstream out(output);
    if (!out)
      throw Error(Errc::invalid_argument,
                  fmt::format("machine generate --output '{}': cannot open it: {}", output, std::strerror(errno)));
    out << text << "\n";
    out.close();  // a full disk shows only when the buffer is written
    if (!out)
      throw Error(Errc::io, fmt::format("machine generate --output '{}': writing {} bytes failed: {}", output,
                                        text.size() + 1, std::strerror(errno)));
  });
}

}  // namespace caravan::app
