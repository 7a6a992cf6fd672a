// `caravan config`: every CARAVAN_* setting with its default, current value, source and doc.
#include "apps/caravan/commands.h"

#include <caravan/error.h>
#include <caravan/platform.h>
#include <caravan/settings.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>

namespace caravan::app {
namespace {

const char* source_name(settings::Source s) {
  switch (s) {
    case settings::Source::default_value: return "default";
    case settings::Source::environment: return "environment";
    case settings::Source::override_value: return "override";
  }
  return "?";
}

// After the listing: an error (exit status 2, a usage error) when any value is invalid or any CARAVAN_*
// variable is no setting, so that a script can check its environment with `caravan config`.
void fail_on_problems(const std::vector<settings::SettingView>& all,
                      const std::vector<settings::UnknownVariable>& unknown) {
  const auto invalid = std::count_if(all.begin(), all.end(), [](const auto& s) { return !s.error.empty(); });
  if (invalid == 0 && unknown.empty()) return;
  // The listing above went to stdout, the error goes to stderr: flush it first, so that a terminal
  // or a pipe taking both shows the list whole, then the error (unflushed, a long list was cut
  // mid-line by the error).
  std::fflush(stdout);
  throw Error(Errc::invalid_argument, fmt::format("config: {} invalid setting value(s) and {} unknown CARAVAN_* "
                                                  "variable(s) in the environment (listed above)",
                                                  invalid, unknown.size()));
}

void print_config(bool json) {
  auto all = settings::list();
  const auto unknown = settings::unknown_environment_variables();
  GpuProbe gpu = probe_gpus();
  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& s : all)
      out.push_back({{"name", s.name}, {"type", s.type}, {"default", s.default_value}, {"current", s.current_value},
                     {"source", source_name(s.source)}, {"doc", s.doc}, {"error", s.error}});
    nlohmann::json unknown_out = nlohmann::json::array();
    for (const auto& u : unknown) unknown_out.push_back({{"name", u.name}, {"suggestion", u.suggestion}});
    fmt::print("{}\n", nlohmann::json{{"settings", out},
                                      {"unknown_variables", unknown_out},
                                      {"gpu",
                                       {{"built", gpu.built},
                                        {"devices", gpu.device_count},
                                        {"toolchain", gpu.toolchain},
                                        {"reason", gpu.reason}}}}
                           .dump(2));
    fail_on_problems(all, unknown);
    return;
  }
  std::size_t name_width = 4, value_width = 7, default_width = 7;
  for (const auto& s : all) {
    name_width = std::max(name_width, s.name.size());
    value_width = std::max(value_width, s.current_value.size());
    default_width = std::max(default_width, s.default_value.size());
  }
  fmt::print("{:<{}}  {:<{}}  {:<{}}  {:<11}  {}\n", "name", name_width, "current", value_width, "default",
             default_width, "source", "doc");
  for (const auto& s : all) {
    fmt::print("{:<{}}  {:<{}}  {:<{}}  {:<11}  {} (type: {})\n", s.name, name_width, s.current_value, value_width,
               s.default_value, default_width, source_name(s.source), s.doc, s.type);
    if (!s.error.empty()) fmt::print("  ^ invalid: {}\n", s.error);
  }
  for (const auto& u : unknown)
    fmt::print("\n{}: not a Caravan setting, ignored{}", u.name,
               u.suggestion.empty() ? "" : fmt::format(" (did you mean {}?)", u.suggestion));
  if (!unknown.empty()) fmt::print("\n");
  fmt::print("\nGPU support: {}\n", gpu.built ? fmt::format("built ({}), {} device(s){}", gpu.toolchain,
                                                            gpu.device_count, gpu.reason.empty() ? "" : ": " + gpu.reason)
                                              : gpu.reason);
  fail_on_problems(all, unknown);
}

}  // namespace

void add_config_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("config", "List every CARAVAN_* setting with its default, current value and doc");
  static bool json = false;
  cmd->add_flag("--json", json, "Print JSON instead of a table");
  cmd->callback([] { print_config(json); });
}

}  // namespace caravan::app
