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
// themselves before they get SIGTERM, then, 5 s later, SIGKILL. SIGINT, SIGTERM, SIGHUP and
// SIGQUIT to the launcher are passed on to every rank, which then has 5 s to exit before
// SIGKILL (a second such signal kills at once); the launcher then exits with 128 + that signal.
// Ranks die with the launcher (PR_SET_PDEATHSIG), and the launcher is the subreaper of what the
// ranks start (PR_SET_CHILD_SUBREAPER): processes a rank leaves behind are stopped once every
// rank has exited, so none is left running.
#include "apps/caravan/commands.h"
#include "apps/caravan/launcher.h"
#include "runtime/net/host_heap.h"

#include <caravan/error.h>
#include <caravan/settings.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string_view>
#include <thread>
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
  int port = 0, bind_error = 0;
  for (int attempt = 0; attempt < 100 && port == 0; ++attempt) {
    int candidate = first + static_cast<int>(random() % static_cast<unsigned>(last - first));
    int fd = socket(found->ai_family, SOCK_STREAM, 0);
    if (fd < 0) break;
    sockaddr_storage bound{};
    std::memcpy(&bound, found->ai_addr, found->ai_addrlen);
    if (bound.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&bound)->sin_port = htons(static_cast<std::uint16_t>(candidate));
    else reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port = htons(static_cast<std::uint16_t>(candidate));
    if (bind(fd, reinterpret_cast<sockaddr*>(&bound), found->ai_addrlen) == 0) port = candidate;
    else
      bind_error = errno;
    close(fd);
    if (bind_error == EADDRNOTAVAIL) break;  // no port will do
  }
  freeaddrinfo(found);
  if (port == 0 && bind_error == EADDRNOTAVAIL)
    throw Error(Errc::invalid_argument,
                fmt::format("--addr {}: not an address of this host (rank 0 listens on it; ranks run here)", address));
  if (port == 0)
    throw Error(Errc::invalid_argument, fmt::format("--addr {}: found no free port there ({}; pass --port)", address,
                                                    bind_error ? std::strerror(bind_error) : "no socket"));
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

const char* const kJobVariables[] = {"RANK",        "WORLD_SIZE",   "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                     "MASTER_PORT", "CARAVAN_NODE", "GROUP_RANK", "CARAVAN_JOB_ID"};

// Removes the job's /dev/shm segments (net::heap_segment_prefix), which a rank killed while it
// made the heap leaves behind; returns how many there were.
std::size_t remove_job_segments(const std::string& job_id) {
  std::size_t removed = 0;
  std::error_code error;
  const std::string prefix = net::heap_segment_prefix(job_id);
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(prefix) && shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

// The most --grace may be (a year): past it a deadline would overflow the clock.
constexpr double kMaxGraceSeconds = 365.0 * 24 * 3600;

// How long ranks have between a stop signal (SIGTERM, or the one the launcher got) and SIGKILL.
constexpr auto kStopSeconds = std::chrono::seconds(5);

// The processes whose parent is this one (ranks, and what they left behind after exiting, which
// the subreaper inherits), from /proc.
std::vector<pid_t> children_of_this_process() {
  std::vector<pid_t> children;
  const pid_t me = getpid();
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc", std::filesystem::directory_options::skip_permission_denied)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || !std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    // pid (comm) state ppid ...: comm may hold spaces and parentheses, so read after the last ')'.
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 1));
    char state = 0;
    long ppid = 0;
    if (rest >> state >> ppid && ppid == me) children.push_back(static_cast<pid_t>(std::stol(name)));
  }
  return children;
}

// Stops what the ranks left behind (reparented to this subreaper): SIGTERM, up to 2 s, SIGKILL;
// returns how many there were.
std::size_t stop_leftovers() {
  std::vector<pid_t> left = children_of_this_process();
  if (left.empty()) return 0;
  for (pid_t pid : left) kill(pid, SIGTERM);
  const auto until = Clock::now() + std::chrono::seconds(2);
  std::size_t reaped = 0;
  while (reaped < left.size() && Clock::now() < until) {
    while (waitpid(-1, nullptr, WNOHANG) > 0) ++reaped;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (pid_t pid : children_of_this_process()) kill(pid, SIGKILL);
  while (waitpid(-1, nullptr, 0) > 0) {
  }
  return left.size();
}

}  // namespace

int run_ranks(const RunSpec& spec) {
  if (spec.ranks < 1 || spec.ranks > 65535)
    throw Error(Errc::invalid_argument, fmt::format("-n {}: the number of ranks must be in [1, 65535]", spec.ranks));
  if (spec.nodes < 1 || spec.nodes > spec.ranks)
    throw Error(Errc::invalid_argument,
                fmt::format("--nodes {}: must be in [1, -n {}] (every logical node holds at least one rank)", spec.nodes,
                            spec.ranks));
  if (spec.command.empty()) throw Error(Errc::invalid_argument, "caravan run: no PROGRAM to start");
  if (spec.grace_s > kMaxGraceSeconds)
    throw Error(Errc::invalid_argument,
                fmt::format("--grace {}: must be at most {:.0f} s (a year)", spec.grace_s, kMaxGraceSeconds));
  double grace = spec.grace_s >= 0 ? spec.grace_s : settings::get_double("CARAVAN_PEER_TIMEOUT_S") + 10.0;
  if (spec.port != 0) {  // the address is still checked: every rank is told it
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(spec.address.c_str(), nullptr, &hints, &found) != 0 || !found)
      throw Error(Errc::invalid_argument, fmt::format("--addr {}: cannot resolve it", spec.address));
    freeaddrinfo(found);
  }
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
  // The job's name on this host (what it leaves in /dev/shm is found by it).
  std::random_device random;
  const std::string job_id =
      fmt::format("{:x}{:06x}", static_cast<std::uint64_t>(std::time(nullptr)), random() & 0xFFFFFF);
  base.push_back("CARAVAN_JOB_ID=" + job_id);

  // Block the signals we wait for, and let the ranks start with the mask we had. SIGHUP and
  // SIGQUIT too: UCX, linked in, installs a SIGHUP handler of its own (UCX_DEBUG_SIGNO), so a
  // closed terminal would otherwise leave the job running.
  sigset_t waited, previous;
  sigemptyset(&waited);
  for (int signal : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&waited, signal);
  sigprocmask(SIG_BLOCK, &waited, &previous);
  // What a rank starts and leaves behind becomes our child, to be stopped at the end.
  prctl(PR_SET_CHILD_SUBREAPER, 1);

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
    // exec's failure comes back through a pipe that a successful exec closes.
    int exec_pipe[2] = {-1, -1};
    const bool piped = pipe2(exec_pipe, O_CLOEXEC) == 0;
    pid_t pid = fork();
    if (pid == 0) {
      // Only async-signal-safe calls until exec.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(126);
      sigprocmask(SIG_SETMASK, &previous, nullptr);
      execvpe(argv[0], argv.data(), envp.data());
      const int error = errno;
      if (piped) (void)!write(exec_pipe[1], &error, sizeof error);
      _exit(127);
    }
    const auto give_up = [&](const std::string& why) {
      kill_all(SIGKILL);
      for (pid_t p : pids)
        if (p > 0) waitpid(p, nullptr, 0);
      stop_leftovers();
      remove_job_segments(job_id);
      prctl(PR_SET_CHILD_SUBREAPER, 0);
      sigprocmask(SIG_SETMASK, &previous, nullptr);
      throw Error(Errc::invalid_argument, why);
    };
    if (pid < 0) {
      const int error = errno;
      if (piped) {
        close(exec_pipe[0]);
        close(exec_pipe[1]);
      }
      give_up(fmt::format("caravan run: fork failed for rank {}: {}", r, std::strerror(error)));
    }
    pids[static_cast<std::size_t>(r)] = pid;
    rank_of_pid[pid] = r;
    if (piped) {
      close(exec_pipe[1]);
      int error = 0;
      ssize_t got = 0;
      do {
        got = read(exec_pipe[0], &error, sizeof error);
      } while (got < 0 && errno == EINTR);
      close(exec_pipe[0]);
      if (got == static_cast<ssize_t>(sizeof error)) {
        waitpid(pid, nullptr, 0);
        pids[static_cast<std::size_t>(r)] = -1;
        give_up(fmt::format("caravan run: cannot start {}: {}", spec.command.front(), std::strerror(error)));
      }
    }
  }

  int running = spec.ranks;
  std::optional<int> first_failed;
  int first_status = 0, failed_count = 0, stopped_count = 0;
  std::optional<Clock::time_point> stop_at;  // the next step: SIGTERM to the survivors, then SIGKILL
  bool terminated = false, killed = false;
  int received = 0;  // the stop signal the launcher got, if any
  while (running > 0) {
    timespec wait_time{0, 200'000'000};
    int signal = sigtimedwait(&waited, nullptr, &wait_time);
    if (signal == SIGINT || signal == SIGTERM || signal == SIGHUP || signal == SIGQUIT) {
      if (received == 0) {
        // Passed on as it came (a rank may handle SIGINT as an interrupt); SIGKILL follows if
        // they have not exited within kStopSeconds.
        fmt::print(stderr, "caravan run: got signal {} ({}), passing it on to every rank\n", signal, strsignal(signal));
        received = signal;
        kill_all(signal);
        terminated = true;
        stop_at = Clock::now() + kStopSeconds;
      } else if (!killed) {
        fmt::print(stderr, "caravan run: got signal {} again, killing every rank\n", signal);
        kill_all(SIGKILL);
        killed = true;
      }
    }
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      auto it = rank_of_pid.find(pid);
      if (it == rank_of_pid.end()) continue;  // something a rank left behind (we are its subreaper)
      int r = it->second;
      pids[static_cast<std::size_t>(r)] = -1;
      --running;
      bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (ok) continue;
      // Ended by the launcher's own signal (after a failure elsewhere, or passing one on): not a
      // failure of its own.
      if (terminated && (WIFSIGNALED(status) || received != 0)) {
        ++stopped_count;
        continue;
      }
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
        stop_at = Clock::now() + kStopSeconds;
      } else if (!killed) {
        fmt::print(stderr, "caravan run: {} rank(s) still running {} s after SIGTERM; sending SIGKILL\n", running,
                   kStopSeconds.count());
        kill_all(SIGKILL);
        killed = true;
      }
    }
  }
  if (const std::size_t left = stop_leftovers(); left > 0)
    fmt::print(stderr, "caravan run: stopped {} process(es) the ranks had started and left running\n", left);
  if (const std::size_t segments = remove_job_segments(job_id); segments > 0)
    fmt::print(stderr, "caravan run: removed {} shared-memory segment(s) the job left in /dev/shm\n", segments);
  prctl(PR_SET_CHILD_SUBREAPER, 0);
  sigprocmask(SIG_SETMASK, &previous, nullptr);
  const std::string stopped =
      stopped_count > 0 ? fmt::format("; {} stopped by the launcher", stopped_count) : std::string();
  if (received != 0) {
    if (first_failed)
      fmt::print(stderr, "caravan run: rank {} {} ({} of {} rank(s) failed{})\n", *first_failed,
                 describe_status(first_status), failed_count, spec.ranks, stopped);
    if (!spec.quiet) fmt::print(stderr, "caravan run: stopped by signal {} ({})\n", received, strsignal(received));
    return 128 + received;
  }
  if (!first_failed) return 0;
  fmt::print(stderr, "caravan run: failed: rank {} {} ({} of {} rank(s) failed{})\n", *first_failed,
             describe_status(first_status), failed_count, spec.ranks, stopped);
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
