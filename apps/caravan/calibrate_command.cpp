// `caravan calibrate`: each channel's throughput against request size, as the planner uses it.
#include "apps/caravan/commands.h"
#include "runtime/dma/calibrate.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace caravan::app {
namespace {

std::string size_label(std::uint64_t bytes) {
  if (bytes >= (1u << 20)) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= 1024) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

void run_calibrate(bool force, bool json) {
  bool cached = false;
  dma::Calibration c = dma::load_or_calibrate(force, &cached);
  if (json) {
    nlohmann::json channels = nlohmann::json::object();
    for (const auto& ch : c.channels) {
      nlohmann::json rows = nlohmann::json::array();
      for (const auto& s : ch.samples) rows.push_back({{"bytes", s.bytes}, {"gbps", s.gbps}});
      channels[ch.channel] = rows;
    }
    fmt::print("{}\n", nlohmann::json{{"cache", dma::calibration_path()}, {"from_cache", cached},
                                      {"machine_key", c.machine_key}, {"seconds", c.seconds}, {"channels", channels}}
                           .dump(2));
    return;
  }
  fmt::print("calibration {} {} ({:.2f} s to measure)\n", cached ? "read from" : "measured and written to",
             dma::calibration_path(), c.seconds);
  fmt::print("runs under 4 KiB are strided element copies, as layout conversions produce\n\n");
  fmt::print("{:<12}", "request");
  for (const auto& ch : c.channels) fmt::print("{:>14}", ch.channel);
  fmt::print("\n");
  for (std::size_t i = 0; i < c.channels.front().samples.size(); ++i) {
    fmt::print("{:<12}", size_label(c.channels.front().samples[i].bytes));
    for (const auto& ch : c.channels) fmt::print("{:>9.3f} GB/s", ch.samples[i].gbps);
    fmt::print("\n");
  }
}

}  // namespace

void add_calibrate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("calibrate", "Measure each channel's throughput against request size (cached per machine)");
  static bool force = false, json = false;
  cmd->add_flag("--force", force, "Measure again even if a cached calibration exists");
  cmd->add_flag("--json", json, "Print JSON");
  cmd->callback([] { run_calibrate(force, json); });
}

}  // namespace caravan::app
