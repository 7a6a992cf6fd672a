// `caravan run -n N [--nodes K] PROGRAM ARGS...`: starts N ranks of PROGRAM on this host.
//
// Each rank gets the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus CARAVAN_NODE, its logical node, so that
// the same program also runs unchanged under torchrun or a Slurm script. Ranks are split into K
// logical nodes of contiguous ranks; ranks of different logical nodes do not share host memory,
// so data between them crosses the NIC channel (UCX) even on one host.
//
// Failure handling: the launcher reaps every rank as it exits (SIGCHLD). The first rank that
// fails (non-zero status or a signal) is reported at once, naming the rank; the others then
// have --grace seconds to notice (they do, within CARAVAN_PEER_TIMEOUT_S) and exit by
// themselves before they get SIGTERM, then SIGKILL. SIGINT/SIGTERM to the launcher are passed
// on to every rank. Ranks die with the launcher (PR_SET_PDEATHSIG), so none is left behind.
#include "apps/caravan/commands.h"
#include "apps/caravan/launcher.h"

#include <caravan/error.h>
#include <caravan/settings.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string_view>
#include <vector>

extern char** environ;

namespace caravan::app {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

// A port that is free on `address` now (the rendezvous binds it moments later). It is drawn
// below the kernel's ephemeral range: a port from that range (what binding port 0 gives) can be
// taken in the meantime as the local end of any outgoing connection, the other ranks' included.
int free_port(const std::string& address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(address.c_str(), "0", &hints, &found) != 0 || !found)
    throw Error(Errc::invalid_argument, fmt::format("--addr {}: cannot resolve it", address));
  int low = 32768;
  if (std::FILE* range = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    int high = 0;
    if (std::fscanf(range, "%d %d", &low, &high) != 2) low = 32768;
    std::fclose(range);
  }
  int first = std::max(1024, low - 12000), last = std::max(first + 1, low);
  std::mt19937 random(static_cast<unsigned>(getpid()) ^ static_cast<unsigned>(Clock::now().time_since_epoch().count()));
  int port = 0;
  for (int attempt = 0; attempt < 100 && port == 0; ++attempt) {
    int candidate = first + static_cast<int>(random() % static_cast<unsigned>(last - first));
    int fd = socket(found->ai_family, SOCK_STREAM, 0);
    if (fd < 0) break;
    sockaddr_storage bound{};
    std::memcpy(&bound, found->ai_addr, found->ai_addrlen);
    if (bound.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&bound)->sin_port = htons(static_cast<std::uint16_t>(candidate));
    else reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port = htons(static_cast<std::uint16_t>(candidate));
    if (bind(fd, reinterpret_cast<sockaddr*>(&bound), found->ai_addrlen) == 0) port = candidate;
    close(fd);
  }
  freeaddrinfo(found);
  if (port == 0) throw Error(Errc::invalid_argument, fmt::format("--addr {}: found no free port there (pass --port)", address));
  return port;
}

namespace {

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return "stopped";
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

const char* const kJobVariables[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                     "MASTER_PORT", "CARAVAN_NODE", "GROUP_RANK"};

}  // namespace

int run_ranks(const RunSpec& spec) {
  if (spec.ranks < 1 || spec.ranks > 65535)
    throw Error(Errc::invalid_argument, fmt::format("-n {}: the number of ranks must be in [1, 65535]", spec.ranks));
  if (spec.nodes < 1 || spec.nodes > spec.ranks)
    throw Error(Errc::invalid_argument,
                fmt::format("--nodes {}: must be in [1, -n {}] (every logical node holds at least one rank)", spec.nodes,
                            spec.ranks));
  if (spec.command.empty()) throw Error(Errc::invalid_argument, "caravan run: no PROGRAM to start");
  double grace = spec.grace_s >= 0 ? spec.grace_s : settings::get_double("CARAVAN_PEER_TIMEOUT_S") + 10.0;
  int port = spec.port != 0 ? spec.port : free_port(spec.address);
  if (port < 1 || port > 65535)
    throw Error(Errc::invalid_argument,
                fmt::format("--port {}: must be in [1, 65535], or 0 to pick a free port", port));

  // The environment every rank shares: ours, minus any job variables of an enclosing launcher.
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    std::string_view entry(*e);
    bool job_variable = false;
    for (const char* name : kJobVariables)
      if (entry.substr(0, entry.find('=')) == name) job_variable = true;
    if (!job_variable) base.emplace_back(entry);
  }
  for (const auto& [name, value] : spec.environment) base.push_back(name + "=" + value);

  // Block the signals we wait for, and let the ranks start with an empty mask.
  sigset_t waited, previous;
  sigemptyset(&waited);
  sigaddset(&waited, SIGCHLD);
  sigaddset(&waited, SIGINT);
  sigaddset(&waited, SIGTERM);
  sigprocmask(SIG_BLOCK, &waited, &previous);

  std::map<pid_t, int> rank_of_pid;
  std::vector<pid_t> pids(static_cast<std::size_t>(spec.ranks), -1);
  auto kill_all = [&](int signal) {
    for (pid_t pid : pids)
      if (pid > 0) kill(pid, signal);
  };
  const pid_t launcher = getpid();
  for (int r = 0; r < spec.ranks; ++r) {
    // Logical node k holds ranks [k*N/K, (k+1)*N/K).
    int node = 0;
    while ((node + 1) * spec.ranks / spec.nodes <= r) ++node;
    int first = node * spec.ranks / spec.nodes, last = (node + 1) * spec.ranks / spec.nodes;
    std::vector<std::string> env = base;
    env.push_back(fmt::format("RANK={}", r));
    env.push_back(fmt::format("WORLD_SIZE={}", spec.ranks));
    env.push_back(fmt::format("LOCAL_RANK={}", r - first));
    env.push_back(fmt::format("LOCAL_WORLD_SIZE={}", last - first));
    env.push_back(fmt::format("MASTER_ADDR={}", spec.address));
    env.push_back(fmt::format("MASTER_PORT={}", port));
    env.push_back(fmt::format("CARAVAN_NODE={}", node));
    std::vector<char*> envp, argv;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> command = spec.command;
    for (auto& s : command) argv.push_back(s.data());
    argv.push_back(nullptr);
    pid_t pid = fork();
    if (pid == 0) {
      // Only async-signal-safe calls until exec.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(126);
      sigprocmask(SIG_SETMASK, &previous, nullptr);
      execvpe(argv[0], argv.data(), envp.data());
      const char prefix[] = "caravan run: cannot start ";
      (void)!write(2, prefix, sizeof(prefix) - 1);
      (void)!write(2, argv[0], strlen(argv[0]));
      (void)!write(2, "\n", 1);
      _exit(127);
    }
    if (pid < 0) {
      int error = errno;
      kill_all(SIGKILL);
      for (pid_t p : pids)
        if (p > 0) waitpid(p, nullptr, 0);
      sigprocmask(SIG_SETMASK, &previous, nullptr);
      throw Error(Errc::internal, fmt::format("caravan run: fork failed for rank {}: {}", r, std::strerror(error)));
    }
    pids[static_cast<std::size_t>(r)] = pid;
    rank_of_pid[pid] = r;
  }

  int running = spec.ranks;
  std::optional<int> first_failed;
  int first_status = 0, failed_count = 0;
  std::optional<Clock::time_point> stop_at;  // when the survivors get SIGTERM
  bool terminated = false, killed = false;
  while (running > 0) {
    timespec wait_time{0, 200'000'000};
    int signal = sigtimedwait(&waited, nullptr, &wait_time);
    if (signal == SIGINT || signal == SIGTERM) {
      fmt::print(stderr, "caravan run: got signal {}, stopping every rank\n", signal);
      kill_all(SIGTERM);
      terminated = true;
      stop_at = Clock::now();
    }
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      auto it = rank_of_pid.find(pid);
      if (it == rank_of_pid.end()) continue;
      int r = it->second;
      pids[static_cast<std::size_t>(r)] = -1;
      --running;
      bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (ok) continue;
      ++failed_count;
      fmt::print(stderr, "caravan run: rank {} (pid {}) {}\n", r, pid, describe_status(status));
      if (!first_failed) {
        first_failed = r;
        first_status = status;
        if (!stop_at) stop_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace));
      }
    }
    if (running > 0 && stop_at && Clock::now() >= *stop_at) {
      if (!terminated) {
        fmt::print(stderr, "caravan run: {} rank(s) still running {:.0f} s after rank {} failed; sending SIGTERM\n",
                   running, grace, *first_failed);
        kill_all(SIGTERM);
        terminated = true;
        stop_at = Clock::now() + std::chrono::seconds(5);
      } else if (!killed) {
        kill_all(SIGKILL);
        killed = true;
      }
    }
  }
  sigprocmask(SIG_SETMASK, &previous, nullptr);
  if (!first_failed) {
    if (!spec.quiet && terminated) fmt::print(stderr, "caravan run: stopped by a signal\n");
    return terminated ? 130 : 0;
  }
  fmt::print(stderr, "caravan run: failed: rank {} {} ({} of {} rank(s) failed)\n", *first_failed,
             describe_status(first_status), failed_count, spec.ranks);
  return exit_code(first_status) == 0 ? 1 : exit_code(first_status);
}

// CLI11 2.1 ends a subcommand without positional options at `--` and hands the rest to the top
// level, which refuses it ("The following arguments were not expected"). `caravan run` takes the
// first `--` among its own options to mean "PROGRAM follows": it is removed here, before
// parsing, and everything after it is the program's (options that look like run's included).
void strip_run_separator(CLI::App& app, std::vector<char*>& args) {
  if (args.size() < 2 || std::string_view(args[1]) != "run") return;  // the top level has no options but --help
  CLI::App* run = app.get_subcommand("run");
  for (std::size_t i = 2; i < args.size(); ++i) {
    const std::string word = args[i];
    if (word == "--") {
      // Without the `--`, a PROGRAM that starts with '-' would be parsed as an option of run.
      if (i + 1 < args.size() && std::string_view(args[i + 1]).starts_with("-"))
        throw Error(Errc::invalid_argument,
                    fmt::format("caravan run: PROGRAM '{}' (after --) starts with '-'; name a program of that name "
                                "as ./{}",
                                args[i + 1], args[i + 1]));
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
    if (!word.starts_with("-")) return;  // PROGRAM: what follows is the program's
    // One of run's options (its value skipped), or a word the callback refuses by name.
    const CLI::Option* option = run->get_option_no_throw(word.substr(0, word.find('=')));
    if (option && option->get_expected_max() != 0 && word.find('=') == std::string::npos) ++i;
  }
}

void add_run_command(CLI::App& app) {
  static RunSpec spec;
  CLI::App* run = app.add_subcommand("run", "Start N ranks of PROGRAM on this host (split into K logical nodes)");
  run->add_option("-n,--ranks", spec.ranks, "Number of ranks")->required();
  run->add_option("--nodes", spec.nodes, "Logical nodes: ranks of different nodes share no host memory")
      ->capture_default_str();
  run->add_option("--addr", spec.address, "MASTER_ADDR: the address rank 0 listens on")->capture_default_str();
  run->add_option("--port", spec.port, "MASTER_PORT (0: pick a free port)")->capture_default_str();
  run->add_option("--grace", spec.grace_s,
                  "Seconds the other ranks may run on after one fails (default: CARAVAN_PEER_TIMEOUT_S + 10)")
      ->check(
          [](const std::string& text) {
            double seconds = 0;
            auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), seconds);
            if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(seconds) || seconds < 0)
              return fmt::format("'{}' must be a number of seconds, at least 0", text);
            return std::string();
          },
          "seconds >= 0");
  // Everything from PROGRAM on belongs to the program, options included; `--` before PROGRAM
  // is optional (strip_run_separator).
  run->prefix_command();
  run->footer(
      "Example: caravan run -n 4 --nodes 2 [--] ./my_program --size 1G\n"
      "Everything from PROGRAM on is the program's; `--` may separate run's options from it.");
  run->callback([run] {
    spec.command = run->remaining();
    if (spec.command.empty()) throw Error(Errc::invalid_argument, "caravan run: no PROGRAM given (caravan run -n N PROGRAM ARGS...)");
    const std::string& program = spec.command.front();
    // Everything from the first word that is not run's own option on is the program's, so a
    // misspelt option of run would otherwise be started as the program.
    if (program.starts_with("-"))
      throw Error(Errc::invalid_argument,
                  fmt::format("caravan run: '{}' is not an option of run (see caravan run --help; "
                              "run's options go before PROGRAM)",
                              program));
    // A path that cannot be executed: say why here, where errno can be reported (the ranks'
    // exec failure can only say that it failed).
    if (program.find('/') != std::string::npos && ::access(program.c_str(), X_OK) != 0)
      throw Error(Errc::invalid_argument,
                  fmt::format("caravan run: cannot start {}: {}", program, std::strerror(errno)));
    int status = run_ranks(spec);
    if (status != 0) throw CLI::RuntimeError(status);
  });
}

}  // namespace caravan::app
