// caravan: the command-line tool. Subcommands live in their own files (see commands.h).
#include "apps/caravan/commands.h"

#include <caravan/error.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  CLI::App app{"Caravan: task-graph runtime with a path-planning data-movement engine"};
  app.require_subcommand(1);
  caravan::app::add_config_command(app);
  caravan::app::add_bench_command(app);
  caravan::app::add_calibrate_command(app);
  caravan::app::add_plan_command(app);
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
