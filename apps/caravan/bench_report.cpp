#include "apps/caravan/bench_report.h"

#include "apps/caravan/commands.h"

#include <caravan/error.h>
#include <caravan/settings.h>
#include <caravan/platform.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

namespace caravan::app {
namespace {

struct BenchCaseEntry {
  std::string name;
  BenchRunner run;
};

std::vector<BenchCaseEntry>& bench_cases() {
  static std::vector<BenchCaseEntry> cases;
  return cases;
}

// Where --json sends the figures: "" (nowhere: tables), "-" (stdout, instead of tables) or a file.
std::string g_json;
bool g_json_written = false;  // the file has been started (truncated) by this process
// `bench all`: one object per case, each on one line (JSON Lines), so that the stream parses;
// a single case prints one indented object.
bool g_json_lines = false;

std::string json_text(const nlohmann::json& j) { return g_json_lines ? j.dump() : j.dump(2); }

// `--json [FILE]`, on `bench` and on every case (one destination: the last one given wins).
void add_json_option(CLI::App& app) {
  app.add_option_function<std::string>(
         "--json", [](const std::string& file) { g_json = file.empty() ? "-" : file; },
         "Print the figures as one JSON object per case: on stdout instead of tables (no FILE, or -), "
         "or to FILE besides the tables")
      ->expected(0, 1)
      ->type_name("[FILE]");
}

// --json FILE: fails before a case runs, not after, when FILE cannot be written (opened for
// appending: nothing is truncated yet; ranks of a job other than rank 0 only check). A FILE the
// check created is removed again, so that a case that then refuses its options leaves none (a
// symbolic link, even a dangling one, counts as existing: the link is never removed).
void check_json_file() {
  if (g_json.empty() || g_json == "-") return;
  std::error_code ignored;
  const bool existed = std::filesystem::exists(std::filesystem::symlink_status(g_json, ignored));
  if (!std::ofstream(g_json, std::ios::app))
    throw Error(Errc::invalid_argument, fmt::format("--json {}: cannot write it", g_json));
  if (!existed) std::filesystem::remove(g_json, ignored);
}

void print_table(const BenchTable& table) {
  std::vector<std::size_t> width(table.columns.size(), 0);
  for (std::size_t c = 0; c < table.columns.size(); ++c) width[c] = table.columns[c].size();
  for (const auto& row : table.rows)
    for (std::size_t c = 0; c < row.size() && c < width.size(); ++c)
      width[c] = std::max(width[c], row[c].size());
  if (!table.title.empty()) fmt::print("\n{}\n", table.title);
  auto print_row = [&](const std::vector<std::string>& row) {
    std::string line;
    for (std::size_t c = 0; c < width.size(); ++c) {
      const std::string& cell = c < row.size() ? row[c] : std::string();
      // First column left-aligned (labels), the rest right-aligned (numbers).
      line += c == 0 ? fmt::format("{:<{}}", cell, width[c]) : fmt::format("  {:>{}}", cell, width[c]);
    }
    fmt::print("{}\n", line);
  };
  print_row(table.columns);
  std::size_t total = 0;
  for (auto w : width) total += w + 2;
  fmt::print("{}\n", std::string(total - 2, '-'));
  for (const auto& row : table.rows) print_row(row);
}

}  // namespace

std::string describe_machine() {
  std::string cpu = "unknown CPU";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  GpuProbe gpus = probe_gpus();
  std::string gpu = gpus.device_count > 0 ? fmt::format("{} GPU(s)", gpus.device_count) : "no GPU";
  return fmt::format("{} x {} ({}), {}", std::thread::hardware_concurrency(), cpu, "cores", gpu);
}

// The CARAVAN_* settings this run did not take at their defaults (from the environment or set by
// the program): the figures depend on them, so a report says which, and two runs' reports show
// whether they ran alike.
namespace {
std::vector<settings::SettingView> changed_settings() {
  std::vector<settings::SettingView> changed;
  for (auto& s : settings::list())
    if (s.source != settings::Source::default_value) changed.push_back(std::move(s));
  return changed;
}

std::string settings_line() {
  const auto changed = changed_settings();
  if (changed.empty()) return "settings: every CARAVAN_* setting at its default (`caravan config` lists them)";
  std::string line = "settings not at their defaults:";
  for (const auto& s : changed) line += fmt::format(" {}={}", s.name, s.current_value);
  return line;
}
}  // namespace

nlohmann::json report_json(const BenchReport& report) {
  nlohmann::json out = report.figures;
  out["bench"] = report.name;
  out["machine"] = report.machine;
  nlohmann::json changed = nlohmann::json::object();
  for (const auto& s : changed_settings()) changed[s.name] = s.current_value;
  out["settings"] = changed;  // those not at their defaults
  out["headlines"] = report.headlines;
  out["notes"] = report.notes;
  return out;
}

void emit_report(const BenchReport& report) {
  if (g_json == "-") return print_report(report, true);
  print_report(report, false);
  if (g_json.empty()) return;
  std::ofstream out(g_json, g_json_written ? std::ios::app : std::ios::trunc);
  g_json_written = true;
  out << json_text(report_json(report)) << "\n";
  // After the run: a failure, not a usage error (check_json_file refused an unwritable FILE before).
  if (!out) throw Error(Errc::io, fmt::format("--json {}: cannot write it", g_json));
}

void print_report(const BenchReport& report, bool json) {
  if (json) {
    fmt::print("{}\n", json_text(report_json(report)));
    return;
  }
  fmt::print("== caravan bench {} ==\nmachine: {}\n{}\n", report.name, report.machine, settings_line());
  for (const auto& table : report.tables) print_table(table);
  if (!report.notes.empty()) fmt::print("\n");
  for (const auto& note : report.notes) fmt::print("note: {}\n", note);
  fmt::print("\n");
  for (const auto& line : report.headlines) fmt::print("{}\n", line);
}

CLI::App& add_bench_case(CLI::App& bench, const std::string& name, const std::string& description,
                         BenchRunner run) {
  CLI::App* sub = bench.add_subcommand(name, description);
  add_json_option(*sub);
  bench_cases().push_back({name, run});
  sub->callback([name, run] {
    check_json_file();
    BenchReport report = run();
    report.name = name;
    report.machine = describe_machine();
    if (!report.printed) emit_report(report);
    if (!report.failure.empty()) throw Error(Errc::internal, report.failure);
  });
  return *sub;
}

void add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Run benchmarks; each prints a ratio against a baseline measured in the same run");
  add_json_option(*bench);
  bench->require_subcommand(1);
  add_bench_tasks(*bench);
  add_bench_copy(*bench);
  add_bench_gpu(*bench);
  add_bench_gpu_tasks(*bench);
  add_bench_plan(*bench);
  add_bench_nic(*bench);
  add_bench_ipc(*bench);
  add_bench_overlap(*bench);
  add_bench_llm(*bench);
  add_bench_attention(*bench);
  add_bench_gemm(*bench);
  CLI::App* all = bench->add_subcommand("all", "Run every benchmark case with its default options");
  add_json_option(*all);
  all->callback([] {
    check_json_file();
    g_json_lines = true;
    std::string failures;
    for (const auto& entry : bench_cases()) {
      BenchReport report = entry.run();
      report.name = entry.name;
      report.machine = describe_machine();
      if (!report.printed) emit_report(report);
      if (!report.failure.empty()) failures += (failures.empty() ? "" : "; ") + report.failure;
    }
    if (!failures.empty()) throw Error(Errc::internal, failures);
  });
}

std::string no_gpu_reason(const GpuProbe& probe) {
  return probe.built ? "no GPU (" + probe.reason + ")" : probe.reason;
}

std::string no_gpu_kernels_reason() {
  const GpuProbe probe = probe_gpus();
  if (!probe.built) return probe.reason;
  return "this build has GPU support but no GPU kernels backend: NCCL (the baseline) was not found when it was "
         "configured";
}

BenchReport run_on_gpu_or_skip(const std::function<BenchReport()>& on_gpu) {
  std::string reason = no_gpu_kernels_reason();
  if (on_gpu) {
    const GpuProbe probe = probe_gpus();
    if (probe.device_count > 0) return on_gpu();
    reason = no_gpu_reason(probe);
  }
  BenchReport out;
  out.headlines.push_back("skipped: " + reason);
  out.figures = {{"skipped", true}, {"reason", reason}};
  return out;
}

Summary summarize(std::vector<double> samples) {
  Summary s;
  s.count = samples.size();
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  auto at = [&](double q) {
    double pos = q * static_cast<double>(samples.size() - 1);
    auto lo = static_cast<std::size_t>(std::floor(pos));
    auto hi = std::min(lo + 1, samples.size() - 1);
    double frac = pos - static_cast<double>(lo);
    return samples[lo] * (1 - frac) + samples[hi] * frac;
  };
  s.median = at(0.5);
  s.p10 = at(0.1);
  s.p90 = at(0.9);
  s.min = samples.front();
  s.max = samples.back();
  return s;
}

// "4096", "64K", "4M", "1G": the grammar of every byte count (settings::parse_byte_count).
std::uint64_t parse_size(const std::string& text, const char* option) {
  return settings::parse_byte_count(text, option);
}

std::string fmt_size(std::uint64_t bytes) {
  if (bytes % (1u << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  if (bytes % (1u << 10) == 0) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

}  // namespace caravan::app
