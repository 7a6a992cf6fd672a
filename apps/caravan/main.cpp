// caravan: the command-line tool. Subcommands live in their own files (see commands.h).
#include "apps/caravan/commands.h"

#include <caravan/error.h>
#include <caravan/settings.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <exception>
#include <vector>

namespace {

// Exit statuses, the same for every command (apps/README.md): 0 success; 1 the command ran and
// failed; 2 the command was not accepted (a usage error: an unknown command or option, a missing,
// malformed or out-of-range value, a name that does not exist). `caravan run` passes on its
// first failed rank's status instead (run_ranks).
constexpr int kFailure = 1;
constexpr int kUsageError = 2;

// caravan::Errors that mean the input was not accepted: bad input to a call, nothing started
// (invalid_argument), or a named thing (a memory, a machine file, a setting) that does not exist.
bool is_usage_error(const caravan::Error& e) {
  return e.code() == caravan::Errc::invalid_argument || e.code() == caravan::Errc::not_found;
}

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
        return kUsageError;
      }
      if (option->get_expected_max() != 0 && word.find('=') == std::string::npos && i + 1 < argc) {
        // Its value; an optional one (`bench --json [FILE]`) only where CLI11 takes the next word
        // as one: neither a command of this level nor an option.
        const std::string next = argv[i + 1];
        bool is_command = false;
        for (CLI::App* sub : subcommands) is_command = is_command || sub->get_name() == next;
        if (option->get_expected_min() > 0 || !(is_command || next == "--" || (next.size() > 1 && next[0] == '-'))) ++i;
      }
      continue;
    }
    CLI::App* next = nullptr;
    for (CLI::App* sub : subcommands)
      if (sub->get_name() == word) next = sub;
    if (!next) {
      std::fprintf(stderr, "%s: unknown command '%s' (commands: %s; see %s --help)\n", path.c_str(), word.c_str(),
                   names.c_str(), path.c_str());
      return kUsageError;
    }
    level = next;
    path += " " + word;
  }
  return 0;
}

// A CARAVAN_* setting with an invalid value, or a CARAVAN_* variable that names no setting (a
// misspelt name), fails every command at once, named with its rule, even one that would not
// read it (there a typo would pass unnoticed, and a report would list the setting's default
// among the settings in effect). `caravan config` lists them all itself, and help is always shown.
void check_settings(const std::vector<char*>& args) {
  if (args.size() < 2 || std::string_view(args[1]) == "config") return;
  for (std::size_t i = 1; i < args.size(); ++i)
    if (std::string_view(args[i]) == "--help" || std::string_view(args[i]) == "-h") return;
  std::string invalid;
  for (const auto& s : caravan::settings::list())
    if (!s.error.empty()) invalid += (invalid.empty() ? "" : "; ") + s.error;
  for (const auto& unknown : caravan::settings::unknown_environment_variables())
    invalid += (invalid.empty() ? "" : "; ") +
               fmt::format("{}: not a Caravan setting{}", unknown.name,
                           unknown.suggestion.empty() ? "" : fmt::format(" (did you mean {}?)", unknown.suggestion));
  if (!invalid.empty())
    throw caravan::Error(caravan::Errc::invalid_argument,
                         invalid + " (`caravan config` lists every setting with its rule)");
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
    check_settings(args);
    app.parse(count, args.data());
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();  // `caravan run`: the failed rank's status, already reported
  } catch (const CLI::ParseError& e) {
    // Prints the message (or the help); CLI11's own codes (100-115) all mean the command line
    // was not accepted. --help and --version are successes (0).
    return app.exit(e) == 0 ? 0 : kUsageError;
  } catch (const caravan::Error& e) {
    std::fprintf(stderr, "caravan: error (%s): %s\n", std::string(caravan::to_string(e.code())).c_str(),
                 e.what());
    return is_usage_error(e) ? kUsageError : kFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "caravan: error: %s\n", e.what());
    return kFailure;
  }
  return 0;
}
