// What every benchmark prints: a readable table (the default) or, with --json, one JSON object
// holding the same figures. Also the statistics the tables use (median and spread).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace caravan {
struct GpuProbe;
}

namespace caravan::app {

struct BenchTable {
  std::string title;
  std::vector<std::string> columns;
  std::vector<std::vector<std::string>> rows;
};

struct BenchReport {
  std::string name;                    // the bench case, e.g. "tasks"
  std::string machine;                 // filled in by the framework
  std::vector<BenchTable> tables;
  std::vector<std::string> headlines;  // one-line results, e.g. "1.23 M tasks/s"
  std::vector<std::string> notes;
  nlohmann::json figures = nlohmann::json::object();
  bool printed = false;   // the case printed its own output (a backend with its own report, a rank other than 0)
  std::string failure;    // not empty: the case ran but its results are wrong; the command fails after printing
};

// Prints the report as tables or as one JSON object.
void print_report(const BenchReport& report, bool json);
// The report as the JSON object --json gives: the figures, with bench, machine, headlines, notes.
nlohmann::json report_json(const BenchReport& report);
// Prints the report as --json asks: tables (no --json), one JSON object on stdout instead of
// tables (--json or --json -), or tables and the JSON object written to FILE (--json FILE; the
// cases of one command, `bench all`, one object after another). For a case that prints its own
// report (a backend of its own); the framework calls it for every other.
void emit_report(const BenchReport& report);

// Registers a case: adds `bench <name>` with the common --json [FILE] option and lets `bench
// all` run it. `run` runs it; the caller adds the case's own options to the returned subcommand.
using BenchRunner = std::function<BenchReport()>;
CLI::App& add_bench_case(CLI::App& bench, const std::string& name, const std::string& description,
                         BenchRunner run);

// Why a GPU benchmark cannot run here: "no GPU (why)" in a build with GPU support; without it,
// why the build has none (turned off with CARAVAN_GPU=OFF, or no GPU compiler found).
std::string no_gpu_reason(const GpuProbe& probe);
// Why this build has no GPU backend for the benchmarks of kernels/gpu (bench overlap, llm,
// attention, gemm): no GPU support at all (as above), or no NCCL found at configure time.
std::string no_gpu_kernels_reason();

// The report of a benchmark of the GPU kernels: `on_gpu()` where this build has them (`on_gpu`
// not null) and the runtime sees a GPU; otherwise a skip that says which is missing.
BenchReport run_on_gpu_or_skip(const std::function<BenchReport()>& on_gpu);

struct Summary {
  double median = 0, p10 = 0, p90 = 0, min = 0, max = 0;
  std::size_t count = 0;
};
Summary summarize(std::vector<double> samples);
std::string describe_machine();
// A byte count given on the command line: "4096", "64K", "4M", "1G" (powers of 1024); `option`
// names it in the error.
std::uint64_t parse_size(const std::string& text, const char* option);
// "4 MiB", "64 KiB" or "77 B", whichever is exact.
std::string fmt_size(std::uint64_t bytes);

}  // namespace caravan::app
