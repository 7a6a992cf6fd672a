// caravan: the command-line tool. Subcommands live in their own files (see commands.h).
#include "apps/caravan/commands.h"

#include <caravan/error.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <exception>
#include <vector>

namespace {

// CLI11 reports "A subcommand is required" before an unknown word or option at a level that has
// subcommands (`caravan --bogus`, `caravan bench nosuch`); name the word and the level instead.
// Returns the exit status to end with, or 0 to let CLI11 parse.
int check_command_words(CLI::App& app, int argc, char** argv) {
  CLI::App* level = &app;
  std::string path = "caravan";
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    const std::vector<CLI::App*> subcommands = level->get_subcommands([](CLI::App*) { return true; });
    if (subcommands.empty() || word == "-h" || word == "--help") return 0;  // a leaf: CLI11 checks the rest
    std::string names;
    for (CLI::App* sub : subcommands)
      if (!sub->get_group().empty()) names += (names.empty() ? "" : ", ") + sub->get_name();  // not the hidden ones
    if (word.starts_with("-")) {
      const CLI::Option* option = level->get_option_no_throw(word.substr(0, word.find('=')));
      if (!option) {
        std::fprintf(stderr, "%s: unknown option '%s' (commands: %s; see %s --help)\n", path.c_str(), word.c_str(),
                     names.c_str(), path.c_str());
        return 2;
      }
      if (option->get_expected_max() != 0 && word.find('=') == std::string::npos) ++i;  // its value
      continue;
    }
    CLI::App* next = nullptr;
    for (CLI::App* sub : subcommands)
      if (sub->get_name() == word) next = sub;
    if (!next) {
      std::fprintf(stderr, "%s: unknown command '%s' (commands: %s; see %s --help)\n", path.c_str(), word.c_str(),
                   names.c_str(), path.c_str());
      return 2;
    }
    level = next;
    path += " " + word;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // GPU streams that wait on a peer's flag (kernels/gpu) block the hardware queue they run on;
  // more queues keep unrelated streams of the device off it. CUDA reads this once, at its first
  // call, so it is set before anything else (a value the user set wins).
  ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  CLI::App app{"Caravan: task-graph runtime with a path-planning data-movement engine"};
  app.require_subcommand(1);
  caravan::app::add_config_command(app);
  caravan::app::add_bench_command(app);
  caravan::app::add_calibrate_command(app);
  caravan::app::add_plan_command(app);
  caravan::app::add_run_command(app);
  std::vector<char*> args(argv, argv + argc);
  try {
    caravan::app::strip_run_separator(app, args);
    const int count = static_cast<int>(args.size());
    if (const int status = check_command_words(app, count, args.data()); status != 0) return status;
    app.parse(count, args.data());
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const caravan::Error& e) {
    std::fprintf(stderr, "caravan: error (%s): %s\n", std::string(caravan::to_string(e.code())).c_str(),
                 e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "caravan: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
