// `caravan bench nic`: put bandwidth of the RMA layer under the nic channel (net::Rma, between
// two ranks in two logical nodes) against `ucx_perftest -t ucp_put_bw` on the same transports
// and message sizes, both measured in this run, interleaved repetition by repetition.
//
// Both sides do the same thing: one process puts `size` bytes from registered memory into the
// same registered buffer of the other process, back to back, `iterations` times, and the clock
// stops when the last put is complete at the target (a flush; perftest's final report does the
// same). Sizes and iteration counts are equal; the transports come from UCX_TLS for perftest and
// CARAVAN_UCX_TLS for Caravan, so both use the same UCX transports.
//
// Caravan's side runs as `caravan run -n 2 --nodes 2 <this program> bench nic-rank ...`: rank 0
// measures and writes its figures to a file, rank 1 serves (over tcp its progress thread
// executes the emulated puts).
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"
#include "apps/caravan/launcher.h"
#include "runtime/net/network.h"
#include "runtime/net/rma.h"
#include "runtime/runtime_impl.h"

#include <caravan/caravan.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

extern char** environ;

namespace caravan::app {
namespace {

using Clock = std::chrono::steady_clock;

struct NicOptions {
  std::vector<std::string> sizes = {"64K", "1M", "4M"};
  std::vector<std::string> transports = {"default", "tcp"};
  int repetitions = 3;
  std::string shm_bytes = "1G";  // bytes put per measurement over shared-memory transports
  std::string net_bytes = "256M";  // ... over tcp
  int window = 16;
};
NicOptions g_nic;

struct RankOptions {  // the hidden `bench nic-rank` run by each rank
  std::vector<std::uint64_t> sizes;
  std::vector<std::uint64_t> iterations;
  int window = 16;
  std::string out;
};
RankOptions g_rank;

// "4096", "64K", "4M", "1G" (powers of 1024).
std::uint64_t parse_size(const std::string& text, const char* option) {
  std::size_t end = 0;
  std::uint64_t value = 0;
  try {
    value = std::stoull(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  std::string suffix = text.substr(end);
  unsigned shift = suffix.empty() ? 0 : suffix == "K" || suffix == "k" ? 10 : suffix == "M" || suffix == "m" ? 20
                                                                       : suffix == "G" || suffix == "g"     ? 30
                                                                                                            : 99;
  if (end == 0 || shift == 99)
    throw Error(Errc::invalid_argument, fmt::format("{} {}: expected a byte count such as 4096, 64K, 4M or 1G", option, text));
  return value << shift;
}

std::string fmt_size(std::uint64_t bytes) {
  if (bytes % (1u << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  if (bytes % (1u << 10) == 0) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

// --- the ranks' side ---

// Keeps `window` puts in flight. Each completion callback posts the next put itself, on the
// progress thread, which is how a DMA worker should drive the layer: no thread hand-off per
// request, and no lock ping-pong between a posting thread and the progress thread. Puts that
// complete at once (shared memory) are followed by the next one in the same loop.
class PutPipeline {
 public:
  PutPipeline(net::Rma& rma, net::RemoteMemoryRef dst, net::LocalMemoryRef src, std::uint64_t size, std::uint64_t total)
      : rma_(rma), dst_(std::move(dst)), src_(std::move(src)), size_(size), total_(total) {}

  void run(int window) {
    for (int k = 0; k < window; ++k) chain();
    for (std::uint64_t c = completed_.load(std::memory_order_acquire); c < total_; c = completed_.load(std::memory_order_acquire))
      completed_.wait(c, std::memory_order_acquire);
    if (failed_.load() > 0) throw Error(Errc::transport, fmt::format("bench nic: {} puts failed", failed_.load()));
  }

 private:
  void chain() {
    for (;;) {
      if (next_.fetch_add(1, std::memory_order_relaxed) >= total_) return;
      if (rma_.put(dst_, 0, src_->data(), size_, src_, {&PutPipeline::done, this}) == net::RmaStatus::pending) return;
      complete();
    }
  }
  void complete() {
    if (completed_.fetch_add(1, std::memory_order_acq_rel) + 1 == total_) completed_.notify_all();
  }
  static void done(void* user, const FailureCause& failure) {
    auto* self = static_cast<PutPipeline*>(user);
    if (failure) self->failed_.fetch_add(1);
    self->complete();
    self->chain();
  }

  net::Rma& rma_;
  net::RemoteMemoryRef dst_;
  net::LocalMemoryRef src_;
  std::uint64_t size_, total_;
  std::atomic<std::uint64_t> next_{0}, completed_{0};
  std::atomic<int> failed_{0};
};

void run_rank() {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  net::Network* network = rt.impl().network();
  if (!network || rt.world_size() != 2) throw Error(Errc::invalid_argument, "bench nic-rank runs as 2 ranks (caravan run -n 2)");
  net::Rma& rma = network->rma();
  nlohmann::json out = nlohmann::json::array();
  for (std::size_t i = 0; i < g_rank.sizes.size(); ++i) {
    std::uint64_t size = g_rank.sizes[i], iterations = g_rank.iterations[i];
    auto mine = rma.allocate(size);
    std::memset(mine->data(), rt.rank() + 1, size);  // touch every page before timing
    auto all = rma.exchange(*mine, "bench nic");
    double seconds = 0;
    if (rt.rank() == 0) {
      auto flush = [&] {
        net::RmaWait flushed;
        flushed.wait(rma.flush(1, flushed.callback()));
      };
      PutPipeline(rma, all[1], mine, size, 8).run(g_rank.window);  // warm-up: connection, caches
      flush();
      auto start = Clock::now();
      PutPipeline(rma, all[1], mine, size, iterations).run(g_rank.window);
      flush();
      seconds = std::chrono::duration<double>(Clock::now() - start).count();
      out.push_back({{"size", size}, {"iterations", iterations}, {"seconds", seconds}});
    }
    rt.barrier();
  }
  if (rt.rank() == 0) std::ofstream(g_rank.out) << out.dump();
}

// --- the driver's side ---

// Runs `argv` with `environment`, returns (exit status, stdout+stderr); kills it after `timeout`.
std::pair<int, std::string> run_captured(const std::vector<std::string>& argv, const std::vector<std::string>& environment,
                                         std::chrono::seconds timeout) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) throw Error(Errc::internal, "bench nic: pipe failed");
  std::vector<std::string> args = argv, env = environment;
  std::vector<char*> c_args, c_env;
  for (auto& a : args) c_args.push_back(a.data());
  c_args.push_back(nullptr);
  for (auto& e : env) c_env.push_back(e.data());
  c_env.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(pipe_fds[1], 1);
    dup2(pipe_fds[1], 2);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    execvpe(c_args[0], c_args.data(), c_env.data());
    _exit(127);
  }
  close(pipe_fds[1]);
  std::string output;
  char buffer[4096];
  auto deadline = Clock::now() + timeout;
  // The output is small; read until EOF (the child closes it when it exits).
  for (;;) {
    ssize_t n = read(pipe_fds[0], buffer, sizeof(buffer));
    if (n <= 0) break;
    output.append(buffer, static_cast<std::size_t>(n));
    if (Clock::now() > deadline) kill(pid, SIGKILL);
  }
  close(pipe_fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return {status, output};
}

std::vector<std::string> environment_with_tls(const std::string& variable, const std::string& tls) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string_view entry(*e);
    if (entry.starts_with("UCX_TLS=") || entry.starts_with("CARAVAN_UCX_TLS=")) continue;
    env.emplace_back(entry);
  }
  if (!tls.empty()) env.push_back(variable + "=" + tls);
  return env;
}

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (access((dir + "/" + program).c_str(), X_OK) == 0) return true;
  return false;
}

// One ucx_perftest pair: returns GB/s (10^9 bytes per second), or nullopt with a reason.
std::optional<double> perftest_put_bw(const std::string& tls, std::uint64_t size, std::uint64_t iterations, std::string* why) {
  auto env = environment_with_tls("UCX_TLS", tls);
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::string port = std::to_string(free_port("127.0.0.1"));
    std::vector<std::string> server = {"ucx_perftest", "-p", port};
    // Like Caravan's side: 8 warm-up puts (perftest's default is 10000), registered memory passed
    // with the put (-z), the same number of puts in flight (-O).
    std::vector<std::string> client = {"ucx_perftest", "127.0.0.1", "-p", port, "-t", "ucp_put_bw",
                                       "-s", std::to_string(size), "-n", std::to_string(iterations),
                                       "-w", "8", "-z", "-O", std::to_string(g_nic.window)};
    std::pair<int, std::string> server_result;
    std::thread server_thread([&] { server_result = run_captured(server, env, std::chrono::seconds(300)); });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the server listen
    auto [status, output] = run_captured(client, env, std::chrono::seconds(300));
    server_thread.join();
    std::istringstream lines(output);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("Final:", 0) != 0) continue;
      // Final: iterations, latency 50%, average, overall (us), bandwidth average, overall (MB/s,
      // where perftest's MB is 2^20 bytes), message rate average, overall.
      std::istringstream fields(line.substr(6));
      double values[8] = {};
      for (double& v : values) fields >> v;
      if (fields) return values[5] * 1048576.0 / 1e9;
    }
    *why = fmt::format("ucx_perftest printed no result (status {}): {}", status, output.substr(0, 300));
  }
  return std::nullopt;
}

std::uint64_t iterations_for(std::uint64_t size, const std::string& tls) {
  std::uint64_t total = tls == "tcp" ? parse_size(g_nic.net_bytes, "--net-bytes") : parse_size(g_nic.shm_bytes, "--shm-bytes");
  return std::clamp<std::uint64_t>(total / size, 20, 200000);
}

BenchReport run_nic_bench() {
  if (g_nic.repetitions < 1) throw Error(Errc::invalid_argument, fmt::format("--reps {}: must be at least 1", g_nic.repetitions));
  if (g_nic.window < 1) throw Error(Errc::invalid_argument, fmt::format("--window {}: must be at least 1", g_nic.window));
  std::vector<std::uint64_t> sizes;
  for (const auto& s : g_nic.sizes) sizes.push_back(parse_size(s, "--sizes"));
  for (std::uint64_t s : sizes)
    if (s == 0) throw Error(Errc::invalid_argument, "--sizes: every size must be at least 1 byte");
  char self[4096] = {};
  ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length <= 0) throw Error(Errc::internal, "bench nic: cannot find this program (/proc/self/exe)");
  const bool have_perftest = on_path("ucx_perftest");

  BenchReport report;
  report.figures["transports"] = nlohmann::json::object();
  for (const std::string& transport : g_nic.transports) {
    std::string tls = transport == "default" ? "" : transport;
    std::map<std::uint64_t, std::vector<double>> caravan, perftest;
    std::string perftest_problem = have_perftest ? "" : "ucx_perftest is not on PATH (Debian: apt-get install ucx-utils)";
    for (int rep = 0; rep < g_nic.repetitions; ++rep) {
      // Interleaved, so that drift in the machine's load hits both alike.
      if (perftest_problem.empty())
        for (std::uint64_t size : sizes) {
          auto gbps = perftest_put_bw(tls, size, iterations_for(size, tls), &perftest_problem);
          if (!gbps) break;
          perftest[size].push_back(*gbps);
        }
      std::string out = fmt::format("/tmp/caravan-bench-nic-{}-{}.json", getpid(), rep);
      RunSpec spec;
      spec.ranks = 2;
      spec.nodes = 2;  // two logical nodes: the nic path, not the node's shared heap
      spec.command = {std::string(self, static_cast<std::size_t>(length)), "bench", "nic-rank", "--out", out,
                      "--window", std::to_string(g_nic.window)};
      for (std::uint64_t size : sizes) {
        spec.command.push_back("--size");
        spec.command.push_back(std::to_string(size));
        spec.command.push_back("--iterations");
        spec.command.push_back(std::to_string(iterations_for(size, tls)));
      }
      spec.environment = {{"CARAVAN_UCX_TLS", tls}};
      spec.quiet = true;
      int status = run_ranks(spec);
      if (status != 0) throw Error(Errc::transport, fmt::format("bench nic: the ranks failed (status {})", status));
      nlohmann::json results = nlohmann::json::parse(std::ifstream(out));
      std::remove(out.c_str());
      for (const auto& r : results)
        caravan[r["size"].get<std::uint64_t>()].push_back(static_cast<double>(r["size"].get<std::uint64_t>()) *
                                                          r["iterations"].get<double>() / r["seconds"].get<double>() / 1e9);
    }
    std::string label = tls.empty() ? "UCX default (shared memory: sysv/posix/cma)" : "UCX_TLS=" + tls;
    BenchTable table{fmt::format("RMA put bandwidth, GB/s, {} ({} repetitions, window {})", label, g_nic.repetitions, g_nic.window),
                     {"size", "iterations", "caravan median", "p10..p90", "ucx_perftest median", "p10..p90", "ratio"},
                     {}};
    nlohmann::json figures = nlohmann::json::array();
    for (std::uint64_t size : sizes) {
      Summary ours = summarize(caravan[size]);
      Summary theirs = summarize(perftest[size]);
      bool baseline = theirs.count > 0;
      double ratio = baseline ? ours.median / theirs.median : 0;
      table.rows.push_back({fmt_size(size), std::to_string(iterations_for(size, tls)), fmt::format("{:.2f}", ours.median),
                            fmt::format("{:.2f}..{:.2f}", ours.p10, ours.p90),
                            baseline ? fmt::format("{:.2f}", theirs.median) : "-",
                            baseline ? fmt::format("{:.2f}..{:.2f}", theirs.p10, theirs.p90) : "-",
                            baseline ? fmt::format("{:.2f}", ratio) : "-"});
      figures.push_back({{"size", size}, {"caravan_gbps", caravan[size]}, {"perftest_gbps", perftest[size]},
                         {"caravan_median", ours.median}, {"perftest_median", theirs.median}, {"ratio", ratio}});
      if (size == sizes.back())
        report.headlines.push_back(baseline ? fmt::format("{}: {} puts: caravan {:.2f} GB/s, ucx_perftest {:.2f} GB/s, ratio {:.2f}",
                                                          label, fmt_size(size), ours.median, theirs.median, ratio)
                                            : fmt::format("{}: {} puts: caravan {:.2f} GB/s (no ucx_perftest baseline)", label,
                                                          fmt_size(size), ours.median));
    }
    report.tables.push_back(table);
    report.figures["transports"][transport] = figures;
    if (!perftest_problem.empty()) report.notes.push_back(fmt::format("{}: no baseline: {}", label, perftest_problem));
  }
  report.notes.push_back("caravan: net::Rma puts between 2 ranks in 2 logical nodes (caravan run -n 2 --nodes 2), registered "
                         "source and target, flush at the end; ucx_perftest -t ucp_put_bw between 2 local processes; GB/s = 10^9 B/s");
  return report;
}

}  // namespace

void add_bench_nic(CLI::App& bench) {
  CLI::App& sub = add_bench_case(bench, "nic", "RMA put bandwidth between ranks (the nic channel's layer) vs ucx_perftest",
                                 run_nic_bench);
  sub.add_option("--sizes", g_nic.sizes, "Put sizes (bytes, K/M/G suffixes)")->capture_default_str();
  sub.add_option("--transports", g_nic.transports, "UCX transports to compare: default and/or UCX_TLS values")
      ->capture_default_str();
  sub.add_option("--reps", g_nic.repetitions, "Repetitions of each measurement")->capture_default_str();
  sub.add_option("--shm-bytes", g_nic.shm_bytes, "Bytes put per measurement over shared memory")->capture_default_str();
  sub.add_option("--net-bytes", g_nic.net_bytes, "Bytes put per measurement over tcp")->capture_default_str();
  sub.add_option("--window", g_nic.window, "Puts in flight at once on Caravan's side")->capture_default_str();
  // What each rank of Caravan's side runs; not meant for users (hence no group: hidden).
  CLI::App* rank = bench.add_subcommand("nic-rank", "One rank of `bench nic` (internal)");
  rank->group("");
  rank->add_option("--size", g_rank.sizes)->required();
  rank->add_option("--iterations", g_rank.iterations)->required();
  rank->add_option("--window", g_rank.window);
  rank->add_option("--out", g_rank.out)->required();
  rank->callback([] {
    if (g_rank.sizes.size() != g_rank.iterations.size())
      throw Error(Errc::invalid_argument, "bench nic-rank: give one --iterations per --size");
    run_rank();
  });
}

}  // namespace caravan::app
