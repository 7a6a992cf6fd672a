// `caravan bench ipc`: copies between the GPU memories of two ranks of one node (separate
// processes, as torchrun and Slurm start them) against the raw peer copy on the same buffers,
// both measured in this run.
//
// Caravan: copy(src in rank 0's GPU 0, dst in rank 1's GPU 1), planned as one xgmi hop into
// rank 1's allocation mapped through IPC, timed from copy() to the event: started at once
// through the IPC handle the destination's descriptor carries, and (a second row) through the
// set-up exchange with rank 1 (CARAVAN_DMA_IPC_DIRECT=false). Raw: rank 0 maps the same destination allocation itself
// (hipIpcOpenMemHandle) and times hipMemcpyPeerAsync from the same source, enqueue to stream
// synchronize. "Both ways": each rank copies to the other at once (after a barrier), each timed
// on its own rank; the raw version likewise. Every destination is checked after the runs.
//
// The ranks run as `caravan run -n 2 <this program> bench ipc-rank ...`; rank 0 writes the figures.
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"
#include "apps/caravan/launcher.h"
#include "runtime/dma/instance_impl.h"
#include "runtime/dma/storage.h"
#include "runtime/gpu/devices.h"
#include "runtime/net/network.h"
#include "runtime/runtime_impl.h"

#include <caravan/caravan.h>
#include <caravan/copy.h>
#include <caravan/settings.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace caravan::app {
namespace {

using Clock = std::chrono::steady_clock;

struct IpcOptions {
  std::vector<std::string> sizes = {"16M", "256M", "1G"};
  int repetitions = 10;
};
IpcOptions g_ipc;

struct IpcRankOptions {
  std::vector<std::uint64_t> sizes;
  int repetitions = 10;
  std::string out;
};
IpcRankOptions g_ipc_rank;

// Rank 0's view of rank 1's raw allocation behind an instance, mapped for the raw baseline.
struct Mapped {
  void* ptr = nullptr;
  explicit Mapped(const gpu::IpcHandle& handle, int device) : ptr(gpu::ipc_open(handle, device)) {}
  ~Mapped() { gpu::ipc_close(ptr); }
  Mapped(const Mapped&) = delete;
  Mapped& operator=(const Mapped&) = delete;
};

void run_ipc_rank() {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  if (rt.world_size() != 2 || rt.node_count() != 1)
    throw Error(Errc::invalid_argument, "bench ipc-rank runs as 2 ranks of one node (caravan run -n 2)");
  net::Network& network = *rt.impl().network();
  const int me = rt.rank(), peer = 1 - me;
  auto fbm = [&](int rank) {
    return MemoryId{static_cast<std::uint32_t>(rt.node()), static_cast<std::uint32_t>(rank), MemoryKind::fbm,
                    static_cast<std::uint32_t>(rank)};
  };
  FieldSpace fields({{"v", 16}});
  const Layout layout = Layout::parse("F,x");
  nlohmann::json out = nlohmann::json::array();
  for (std::uint64_t bytes : g_ipc_rank.sizes) {
    auto space = Rect::from_extents({static_cast<std::int64_t>(std::max<std::uint64_t>(bytes / 16, 1))});
    Instance src = Instance::create(fbm(me), space, fields, layout);
    Instance dst = Instance::create(fbm(me), space, fields, layout);
    const std::uint64_t moved = src.footprint_bytes();
    std::vector<std::byte> fill(moved, std::byte(me + 1));
    src.write_bytes(0, fill);
    auto parts = network.allgather(dst.descriptor(), std::chrono::seconds(60), "bench ipc descriptors");
    Instance peer_dst = Instance::from_descriptor(parts[static_cast<std::size_t>(peer)]);
    // The raw baseline maps the peer's allocation behind its instance (the same bytes Caravan writes).
    const gpu::IpcHandle mine = dst.impl()->storage->ipc_handle();
    std::vector<std::byte> handle_bytes(reinterpret_cast<const std::byte*>(mine.bytes),
                                        reinterpret_cast<const std::byte*>(mine.bytes) + gpu::kIpcHandleBytes);
    auto handles = network.allgather(handle_bytes, std::chrono::seconds(60), "bench ipc handles");
    gpu::IpcHandle theirs;
    std::memcpy(theirs.bytes, handles[static_cast<std::size_t>(peer)].data(), gpu::kIpcHandleBytes);
    const void* src_ptr = src.impl()->storage->gpu_address();

    std::vector<double> one_raw, one_caravan, one_exchange, both_raw, both_caravan;
    std::string route;
    std::vector<double> setup_us, teardown_us;  // timed direct one-way copies: where the time beyond the copy goes
    auto caravan_copy = [&](bool record_phases = false) {
      CopyReport report;
      auto start = Clock::now();
      copy(src, peer_dst, {.report = &report}).wait();
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      route = report.route;
      if (record_phases) {
        setup_us.push_back(report.setup_us);
        teardown_us.push_back(report.teardown_us);
      }
      return seconds;
    };
    {
      // Raw first, with its own mapping closed again before Caravan maps the same allocation.
      Mapped mapped(theirs, me);
      gpu::RawCopy raw{.dst = mapped.ptr, .src = src_ptr, .bytes = moved, .device = me, .peer = true,
                       .src_device = me, .dst_device = peer};
      if (me == 0) {
        gpu::time_raw_copies(raw, 1);  // warm-up
        one_raw = gpu::time_raw_copies(raw, g_ipc_rank.repetitions);
      }
      rt.barrier(std::chrono::seconds(120));
      for (int rep = 0; rep <= g_ipc_rank.repetitions; ++rep) {
        rt.barrier(std::chrono::seconds(120));
        double t = gpu::time_raw_copies(raw, 1).front();
        if (rep > 0) both_raw.push_back(t);  // the first is a warm-up
      }
      rt.barrier(std::chrono::seconds(120));
    }
    if (me == 0) {
      caravan_copy();  // warm-up: the mapping, the channel's streams
      for (int rep = 0; rep < g_ipc_rank.repetitions; ++rep) one_caravan.push_back(caravan_copy(true));
      // The same copies through the set-up exchange with rank 1 (as before the direct start).
      settings::ScopedOverride exchange("CARAVAN_DMA_IPC_DIRECT", "false");
      caravan_copy();
      for (int rep = 0; rep < g_ipc_rank.repetitions; ++rep) one_exchange.push_back(caravan_copy());
    }
    rt.barrier(std::chrono::seconds(120));
    for (int rep = 0; rep <= g_ipc_rank.repetitions; ++rep) {
      rt.barrier(std::chrono::seconds(120));
      double t = caravan_copy();
      if (rep > 0) both_caravan.push_back(t);
    }
    rt.barrier(std::chrono::seconds(120));
    // Every copy into this rank's destination carried the peer's bytes.
    std::vector<std::byte> got(moved);
    dst.read_bytes(0, got);
    const auto bad = std::count_if(got.begin(), got.end(), [&](std::byte b) { return b != std::byte(peer + 1); });
    if (bad != 0) throw Error(Errc::internal, fmt::format("bench ipc-rank: {} bytes of rank {}'s destination are wrong", bad, me));
    // Rank 1's both-ways times reach rank 0, which takes the slower rank per repetition.
    std::vector<std::byte> times(both_caravan.size() * sizeof(double) * 2);
    std::memcpy(times.data(), both_caravan.data(), both_caravan.size() * sizeof(double));
    std::memcpy(times.data() + both_caravan.size() * sizeof(double), both_raw.data(), both_raw.size() * sizeof(double));
    auto all_times = network.allgather(times, std::chrono::seconds(60), "bench ipc times");
    if (me == 0) {
      const auto* other = reinterpret_cast<const double*>(all_times[1].data());
      const std::size_t n = both_caravan.size();
      for (std::size_t i = 0; i < n; ++i) {
        both_caravan[i] = std::max(both_caravan[i], other[i]);
        both_raw[i] = std::max(both_raw[i], other[n + i]);
      }
      out.push_back({{"bytes", moved}, {"route", route},
                     {"one_way", {{"caravan_s", one_caravan}, {"raw_s", one_raw}, {"setup_us", setup_us}, {"teardown_us", teardown_us}}},
                     {"one_way_exchange", {{"caravan_s", one_exchange}, {"raw_s", one_raw}}},
                     {"both_ways", {{"caravan_s", both_caravan}, {"raw_s", both_raw}}}});
    }
    rt.barrier(std::chrono::seconds(60));
  }
  if (me == 0) std::ofstream(g_ipc_rank.out) << out.dump();
}

BenchReport run_ipc_bench() {
  BenchReport report;
  if (g_ipc.repetitions < 1) throw Error(Errc::invalid_argument, fmt::format("--reps {}: must be at least 1", g_ipc.repetitions));
  std::vector<std::uint64_t> sizes;
  for (const auto& s : g_ipc.sizes) {
    sizes.push_back(parse_size(s, "--sizes"));
    if (sizes.back() < 16) throw Error(Errc::invalid_argument, fmt::format("--sizes {}: each size must be at least 16 bytes", s));
  }
  const auto& topo = gpu::topology();
  if (topo.devices.size() < 2 || !topo.can_peer(0, 1) || !topo.can_peer(1, 0)) {
    const std::string reason = topo.devices.empty() ? topo.reason
                                                    : fmt::format("needs GPUs 0 and 1 reaching each other ({} GPU(s))", topo.devices.size());
    report.headlines.push_back("skipped: " + reason);
    report.figures = {{"skipped", true}, {"reason", reason}};
    return report;
  }
  char self[4096] = {};
  ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length <= 0) throw Error(Errc::internal, "bench ipc: cannot find this program (/proc/self/exe)");
  std::string out = fmt::format("/tmp/caravan-bench-ipc-{}.json", getpid());
  RunSpec spec;
  spec.ranks = 2;
  spec.command = {std::string(self, static_cast<std::size_t>(length)), "bench", "ipc-rank", "--out", out, "--reps",
                  std::to_string(g_ipc.repetitions)};
  for (std::uint64_t size : sizes) {
    spec.command.push_back("--size");
    spec.command.push_back(std::to_string(size));
  }
  spec.quiet = true;
  int status = run_ranks(spec);
  if (status != 0) throw Error(Errc::transport, fmt::format("bench ipc: the ranks failed (status {})", status));
  nlohmann::json results = nlohmann::json::parse(std::ifstream(out));
  std::remove(out.c_str());
  BenchTable table{fmt::format("GPU memory of rank 0 (GPU 0) -> rank 1 (GPU 1), one node, GB/s ({} repetitions; both ways: "
                               "each rank copies to the other at once, per direction, slower rank)",
                               g_ipc.repetitions),
                   {"size", "direction", "caravan median", "p10..p90", "raw peer copy median", "p10..p90", "ratio"},
                   {}};
  nlohmann::json figures = nlohmann::json::array();
  std::string route;
  for (const auto& r : results) {
    const auto bytes = r["bytes"].get<std::uint64_t>();
    route = r["route"].get<std::string>();
    nlohmann::json entry = {{"bytes", bytes}, {"route", route}};
    for (const char* way : {"one_way", "one_way_exchange", "both_ways"}) {
      auto gbps = [&](const char* which) {
        std::vector<double> v;
        for (double t : r[way][which]) v.push_back(static_cast<double>(bytes) / t / 1e9);
        return v;
      };
      std::vector<double> ours = gbps("caravan_s"), raw = gbps("raw_s");
      Summary o = summarize(ours), w = summarize(raw);
      const double ratio = o.median / w.median;
      const std::string direction = std::strcmp(way, "one_way") == 0            ? "one way"
                                    : std::strcmp(way, "one_way_exchange") == 0 ? "one way, set-up exchange"
                                                                                : "both ways";
      table.rows.push_back({fmt_size(bytes), direction,
                            fmt::format("{:.1f}", o.median), fmt::format("{:.1f}..{:.1f}", o.p10, o.p90),
                            fmt::format("{:.1f}", w.median), fmt::format("{:.1f}..{:.1f}", w.p10, w.p90), fmt::format("{:.3f}", ratio)});
      entry[way] = {{"caravan_gbps", ours}, {"raw_gbps", raw}, {"ratio", ratio}};
      if (std::strcmp(way, "one_way") == 0) {
        Summary setup = summarize(r[way]["setup_us"].get<std::vector<double>>());
        Summary rest = summarize(r[way]["teardown_us"].get<std::vector<double>>());
        report.notes.push_back(fmt::format("{} one way: copy() to the start of rank 0's hop {:.0f} us (p10..p90 {:.0f}..{:.0f}), "
                                           "from there to the event {:.0f} us ({:.0f}..{:.0f}); the raw copy takes {:.0f} us",
                                           fmt_size(bytes), setup.median, setup.p10, setup.p90, rest.median, rest.p10, rest.p90,
                                           static_cast<double>(bytes) / w.median / 1e3));
      }
      if (bytes == sizes.back())
        report.headlines.push_back(fmt::format("{} {}: caravan {:.1f} GB/s, raw peer copy {:.1f} GB/s, ratio {:.3f}", fmt_size(bytes),
                                               direction, o.median, w.median, ratio));
    }
    figures.push_back(entry);
  }
  report.tables.push_back(table);
  report.figures["sizes"] = figures;
  report.notes.push_back(fmt::format("route: {}; caravan timed from copy() to its event: started directly through the "
                                     "destination's IPC handle (CARAVAN_DMA_IPC_DIRECT), or through the set-up exchange with its "
                                     "owner (set-up messages included); raw: hipMemcpyPeerAsync into the same allocation mapped by rank 0, enqueue to "
                                     "stream synchronize; GB/s = 10^9 B/s; destinations verified",
                                     route));
  return report;
}

}  // namespace

void add_bench_ipc(CLI::App& bench) {
  CLI::App& sub = add_bench_case(bench, "ipc",
                                 "Copies between GPU memories of two ranks of one node (IPC) vs the raw peer copy", run_ipc_bench);
  sub.add_option("--sizes", g_ipc.sizes, "Copy sizes (bytes, K/M/G suffixes)")->capture_default_str();
  sub.add_option("--reps", g_ipc.repetitions, "Repetitions of each measurement")->capture_default_str();
  CLI::App* rank = bench.add_subcommand("ipc-rank", "One rank of `bench ipc` (internal)");
  rank->group("");
  rank->add_option("--size", g_ipc_rank.sizes)->required();
  rank->add_option("--reps", g_ipc_rank.repetitions);
  rank->add_option("--out", g_ipc_rank.out)->required();
  rank->callback([] { run_ipc_rank(); });
}

}  // namespace caravan::app
