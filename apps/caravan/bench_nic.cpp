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
//
// Second part, the cross-node host path of a copy (`bench nic-path-rank`, 2 ranks in 2 logical
// nodes): copy(src in rank 0's sys, dst in rank 1's sys) as planned, SYS -> REG -> REG* -> SYS*
// pipelined tile by tile through bounded buffers, against the staged version (each hop run to
// completion into a full-size intermediate instance, as a runtime without path planning does)
// and against the slowest of those hops alone, interleaved repetition by repetition.
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"
#include "apps/caravan/launcher.h"
#include "runtime/gpu/devices.h"
#include "runtime/host_memory.h"
#include "runtime/net/network.h"
#include "runtime/net/rma.h"
#include "runtime/runtime_impl.h"

#include <caravan/caravan.h>
#include <caravan/copy.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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

struct PathOptions {  // the hidden `bench nic-path-rank`
  std::uint64_t bytes = 0;
  int repetitions = 3;
  std::string memory = "sys";  // where the source and destination live: sys, or fbm (rank r's GPU r)
  std::string out;
};
PathOptions g_path;
std::string g_path_shm_bytes = "256M", g_path_net_bytes = "64M", g_path_memory = "sys";
bool g_path_only = false;

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

// Rank 0 times the three versions of one cross-node copy; rank 1 owns the destination and the
// staged version's second intermediate, and serves. The ends are in sys, or in GPU memory (rank
// r's GPU r, so that the two ends use different GPUs and PCIe links, as on two hosts).
void run_path_rank() {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  if (rt.world_size() != 2 || rt.node_count() != 2)
    throw Error(Errc::invalid_argument, "bench nic-path-rank runs as 2 ranks in 2 nodes (caravan run -n 2 --nodes 2)");
  net::Network& network = *rt.impl().network();
  const int me = rt.rank();
  auto memory = [&](int rank, MemoryKind kind) {
    return MemoryId{static_cast<std::uint32_t>(rt.rank_info(rank).node), static_cast<std::uint32_t>(rank), kind,
                    kind == MemoryKind::fbm ? static_cast<std::uint32_t>(rank) : 0u};
  };
  const MemoryKind end_kind = g_path.memory == "fbm" ? MemoryKind::fbm : MemoryKind::sys;
  FieldSpace fields({{"v", 16}});
  auto space = Rect::from_extents({static_cast<std::int64_t>(std::max<std::uint64_t>(g_path.bytes / 16, 1))});
  const Layout layout = Layout::parse("F,x");
  // Rank 0: the source and the staged version's REG intermediate; rank 1: the destination and
  // the staged version's REG* intermediate. Every page is touched before timing.
  Instance src = Instance::create(memory(me, end_kind), space, fields, layout);
  Instance staging = Instance::create(memory(me, MemoryKind::reg), space, fields, layout);
  std::vector<std::byte> fill(src.footprint_bytes(), std::byte(me + 1));
  src.write_bytes(0, fill);
  std::memset(staging.data(), 0, staging.footprint_bytes());
  auto share = [&](const Instance& mine) {
    auto parts = network.allgather(mine.descriptor(), std::chrono::seconds(60), "bench nic-path");
    return Instance::from_descriptor(parts[1]);
  };
  Instance dst = share(src);            // rank 1's sys or fbm instance
  Instance remote_staging = share(staging);  // rank 1's reg instance
  nlohmann::json out = {{"pipelined", nlohmann::json::array()}, {"staged", nlohmann::json::array()},
                        {"hops", nlohmann::json::array()}, {"route", ""}, {"buffers", nlohmann::json::array()}};
  if (me == 0) {
    auto timed = [](const Instance& from, const Instance& to, CopyReport* report = nullptr) {
      auto start = Clock::now();
      copy(from, to, {.report = report}).wait();
      return std::chrono::duration<double>(Clock::now() - start).count();
    };
    CopyReport report;
    timed(src, dst);  // warm-up: buffers registered, pages mapped, connections up
    timed(src, staging);
    timed(staging, remote_staging);
    timed(remote_staging, dst);
    for (int rep = 0; rep < g_path.repetitions; ++rep) {
      out["pipelined"].push_back(timed(src, dst, &report));
      // Staged: every hop to completion before the next starts, through full-size intermediates.
      double hop0 = timed(src, staging), hop1 = timed(staging, remote_staging), hop2 = timed(remote_staging, dst);
      out["staged"].push_back(hop0 + hop1 + hop2);
      out["hops"].push_back({hop0, hop1, hop2});
    }
    out["route"] = report.route;
    out["buffers"] = report.buffer_bytes;
    out["tiles"] = report.tiles;
  }
  rt.barrier(std::chrono::seconds(600));
  if (me == 1) {  // the last copy into the destination was the staged one's hop 2; both carried rank 0's bytes
    std::vector<std::byte> got(src.footprint_bytes());
    src.read_bytes(0, got);
    auto bad = std::count_if(got.begin(), got.end(), [](std::byte b) { return b != std::byte{1}; });
    if (bad != 0) throw Error(Errc::internal, fmt::format("bench nic-path-rank: {} bytes of the destination are wrong", bad));
  }
  rt.barrier(std::chrono::seconds(60));
  if (me == 0) std::ofstream(g_path.out) << out.dump();
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
  // Every byte count is read now, not when the run reaches the transport that uses it (after
  // minutes of measurements, which a bad value would then throw away).
  for (const auto& [text, option] :
       {std::pair{g_nic.shm_bytes, "--shm-bytes"}, std::pair{g_nic.net_bytes, "--net-bytes"},
        std::pair{g_path_shm_bytes, "--path-shm-bytes"}, std::pair{g_path_net_bytes, "--path-net-bytes"}})
    if (parse_size(text, option) == 0)
      throw Error(Errc::invalid_argument, fmt::format("{} {}: must be at least 1 byte", option, text));
  // Both ranks run on this host: refuse what it cannot hold before starting them (each would
  // pass its own check, and together they would exhaust the host's memory).
  if (!g_path_only)
    detail::require_host_bytes(2 * *std::max_element(sizes.begin(), sizes.end()),
                               "--sizes: the 2 ranks each register a buffer of the largest size");
  char self[4096] = {};
  ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length <= 0) throw Error(Errc::internal, "bench nic: cannot find this program (/proc/self/exe)");
  const bool have_perftest = on_path("ucx_perftest");

  if (g_path_memory != "sys" && g_path_memory != "fbm")
    throw Error(Errc::invalid_argument, fmt::format("--path-memory {}: must be sys or fbm", g_path_memory));
  if (g_path_memory == "fbm" && gpu::topology().devices.size() < 2)
    throw Error(Errc::invalid_argument, fmt::format("--path-memory fbm: needs 2 GPUs on this host (rank r uses GPU r); {}",
                                                    gpu::topology().devices.empty() ? gpu::topology().reason : "this host has 1"));

  BenchReport report;
  report.figures["transports"] = nlohmann::json::object();
  for (const std::string& transport : g_nic.transports) {
    if (g_path_only) break;
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
  if (!g_path_only)
    report.notes.push_back("caravan: net::Rma puts between 2 ranks in 2 logical nodes (caravan run -n 2 --nodes 2), registered "
                           "source and target, flush at the end; ucx_perftest -t ucp_put_bw between 2 local processes; GB/s = 10^9 B/s");

  // The cross-node host path of a copy: pipelined vs staged vs its slowest hop alone.
  report.figures["path"] = nlohmann::json::object();
  for (const std::string& transport : g_nic.transports) {
    std::string tls = transport == "default" ? "" : transport;
    const char* bytes_option = tls == "tcp" ? "--path-net-bytes" : "--path-shm-bytes";
    const std::uint64_t bytes = parse_size(tls == "tcp" ? g_path_net_bytes : g_path_shm_bytes, bytes_option);
    // Per rank: its end of the copy (unless in GPU memory), the staged version's REG
    // intermediate and the pattern written into the source.
    detail::require_host_bytes(2 * (g_path_memory == "sys" ? 3 : 2) * bytes,
                               fmt::format("{}: the 2 ranks' copies of this size", bytes_option));
    std::string out = fmt::format("/tmp/caravan-bench-nic-path-{}.json", getpid());
    RunSpec spec;
    spec.ranks = 2;
    spec.nodes = 2;
    spec.command = {std::string(self, static_cast<std::size_t>(length)), "bench", "nic-path-rank", "--out", out, "--bytes",
                    std::to_string(bytes), "--reps", std::to_string(g_nic.repetitions), "--memory", g_path_memory};
    spec.environment = {{"CARAVAN_UCX_TLS", tls}};
    spec.quiet = true;
    int status = run_ranks(spec);
    if (status != 0) throw Error(Errc::transport, fmt::format("bench nic: the path ranks failed (status {})", status));
    nlohmann::json r = nlohmann::json::parse(std::ifstream(out));
    std::remove(out.c_str());
    std::vector<double> pipelined, staged, slowest;
    const std::uint64_t moved = bytes / 16 * 16;
    for (double t : r["pipelined"]) pipelined.push_back(static_cast<double>(moved) / t / 1e9);
    for (double t : r["staged"]) staged.push_back(static_cast<double>(moved) / t / 1e9);
    std::vector<std::vector<double>> hop_gbps(3);
    for (const auto& hops : r["hops"]) {
      double worst = 0;
      for (std::size_t h = 0; h < 3; ++h) {
        worst = std::max(worst, hops[h].get<double>());
        hop_gbps[h].push_back(static_cast<double>(moved) / hops[h].get<double>() / 1e9);
      }
      slowest.push_back(static_cast<double>(moved) / worst / 1e9);
    }
    Summary p = summarize(pipelined), s = summarize(staged), w = summarize(slowest);
    const bool on_gpu = g_path_memory == "fbm";
    std::string label = tls.empty() ? "UCX default (shared memory)" : "UCX_TLS=" + tls;
    std::string buffers;
    for (const auto& b : r["buffers"]) buffers += (buffers.empty() ? "" : ", ") + fmt_size(b.get<std::uint64_t>());
    BenchTable table{fmt::format("cross-node copy of {} {} (16-byte points, F,x), GB/s, {}: {} ({} repetitions; pipelined "
                                 "buffers {}, {} tiles)",
                                 fmt_size(moved), on_gpu ? "GPU to GPU" : "host to host", label, r["route"].get<std::string>(),
                                 g_nic.repetitions, buffers,
                                 r.value("tiles", 0)),
                     {"version", "median", "p10..p90", "pipelined / this"},
                     {}};
    auto row = [&](const std::string& name, const Summary& x) {
      table.rows.push_back({name, fmt::format("{:.2f}", x.median), fmt::format("{:.2f}..{:.2f}", x.p10, x.p90),
                            fmt::format("{:.2f}", p.median / x.median)});
    };
    row("pipelined (planned path)", p);
    row("staged (hop by hop, full-size intermediates)", s);
    row("slowest hop alone", w);
    const char* hop_names[3] = {on_gpu ? "  hop 0 alone: sdma fbm0 -> reg" : "  hop 0 alone: memcpy sys -> reg",
                                "  hop 1 alone: nic reg -> reg*",
                                on_gpu ? "  hop 2 alone: sdma reg* -> fbm1*" : "  hop 2 alone: memcpy reg* -> sys*"};
    for (std::size_t h = 0; h < 3; ++h) row(hop_names[h], summarize(hop_gbps[h]));
    report.tables.push_back(table);
    report.figures["path"][transport] = {{"memory", g_path_memory}, {"bytes", moved},       {"route", r["route"]},           {"pipelined_gbps", pipelined},
                                         {"staged_gbps", staged}, {"slowest_hop_gbps", slowest}, {"pipelined_over_staged", p.median / s.median},
                                         {"pipelined_over_slowest_hop", p.median / w.median}};
    report.headlines.push_back(fmt::format("{}: cross-node {} copy {:.2f} GB/s pipelined, {:.2f}x the staged version, {:.2f}x its "
                                           "slowest hop alone",
                                           label, on_gpu ? "GPU -> GPU" : "host -> host", p.median, p.median / s.median, p.median / w.median));
  }
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
  sub.add_option("--path-shm-bytes", g_path_shm_bytes, "Size of the cross-node copy over shared memory")->capture_default_str();
  sub.add_option("--path-net-bytes", g_path_net_bytes, "Size of the cross-node copy over tcp")->capture_default_str();
  sub.add_option("--path-memory", g_path_memory,
                 "Ends of the cross-node copy: sys, or fbm (GPU memory: rank 0's GPU 0 to rank 1's GPU 1, through REG)")
      ->capture_default_str();
  sub.add_flag("--path-only", g_path_only, "Only the cross-node copy (skip the put bandwidth against ucx_perftest)");
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
  CLI::App* path = bench.add_subcommand("nic-path-rank", "One rank of `bench nic`'s cross-node copy (internal)");
  path->group("");
  path->add_option("--bytes", g_path.bytes)->required();
  path->add_option("--reps", g_path.repetitions);
  path->add_option("--memory", g_path.memory);
  path->add_option("--out", g_path.out)->required();
  path->callback([] { run_path_rank(); });
}

}  // namespace caravan::app
