// caravan: the command-line tool. Subcommands live in their own files (see commands.h).
#include "apps/caravan/commands.h"

#include <caravan/error.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <exception>

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
  // CLI11 reports a missing subcommand before an unexpected word; name the word instead.
  if (argc > 1 && argv[1][0] != '-') {
    std::string word = argv[1], names;
    bool known = false;
    for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
      known |= sub->get_name() == word;
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "caravan: unknown command '%s' (commands: %s; see caravan --help)\n", word.c_str(), names.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
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
