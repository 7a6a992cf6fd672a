// `caravan calibrate`: each channel's throughput against request size, as the planner uses it.
#include "apps/caravan/commands.h"
#include "runtime/dma/calibrate.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>
#include <vector>

namespace caravan::app {
namespace {

std::string size_label(std::uint64_t bytes) {
  if (bytes >= (1u << 20)) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= 1024) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

void run_calibrate(bool force, bool json) {
  bool cached = false, written = false;
  dma::Calibration c = dma::load_or_calibrate(force, &cached, &written);
  // Columns in one order whether measured now or read back (the cache keeps them by name).
  std::sort(c.channels.begin(), c.channels.end(), [](const auto& x, const auto& y) { return x.channel < y.channel; });
  if (json) {
    nlohmann::json channels = nlohmann::json::object();
    for (const auto& ch : c.channels) {
      nlohmann::json rows = nlohmann::json::array();
      for (const auto& s : ch.samples) rows.push_back({{"bytes", s.bytes}, {"gbps", s.gbps}});
      channels[ch.channel] = rows;
    }
    fmt::print("{}\n", nlohmann::json{{"cache", dma::calibration_path()},
                                      {"from_cache", cached},
                                      {"written", written},
                                      {"machine_key", c.machine_key},
                                      {"seconds", c.seconds},
                                      {"channels", channels}}
                           .dump(2));
    return;
  }
  fmt::print("calibration {} {} ({:.2f} s to measure)\n",
             cached    ? "read from"
             : written ? "measured and written to"
                       : "measured; it could not be written (see the warning above) to",
             dma::calibration_path(), c.seconds);
  fmt::print("runs under 4 KiB are strided element copies, as layout conversions produce\n\n");
  // Rows: every request size any channel was measured at (GPU channels go up to 64 MiB, host
  // channels to 4 MiB); "-" where a channel has no sample of that size.
  std::set<std::uint64_t> sizes;
  for (const auto& ch : c.channels)
    for (const auto& s : ch.samples) sizes.insert(s.bytes);
  std::vector<std::size_t> widths;
  fmt::print("{:<12}", "request");
  for (const auto& ch : c.channels) {
    widths.push_back(std::max<std::size_t>(14, ch.channel.size() + 2));
    fmt::print("{:>{}}", ch.channel, widths.back());
  }
  fmt::print("\n");
  for (std::uint64_t bytes : sizes) {
    fmt::print("{:<12}", size_label(bytes));
    for (std::size_t k = 0; k < c.channels.size(); ++k) {
      const auto& samples = c.channels[k].samples;
      auto it = std::find_if(samples.begin(), samples.end(), [&](const auto& s) { return s.bytes == bytes; });
      fmt::print("{:>{}}", it == samples.end() ? std::string("-") : fmt::format("{:.3f} GB/s", it->gbps), widths[k]);
    }
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
