#include "runtime/dma/calibrate.h"

#include "channels/file_channel.h"
#include "channels/memcpy_channel.h"
#include "runtime/gpu/devices.h"
#include "runtime/log.h"
#if CARAVAN_HAVE_GPU
#include "channels/gpu_convert_channel.h"
#include "channels/sdma_channel.h"
#include "channels/xgmi_channel.h"
#endif

#include <caravan/error.h>
#include <caravan/settings.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

namespace caravan::dma {
namespace {

// Request sizes as the planner means them: the length of the runs a hop moves. Runs shorter
// than 4 KiB are what layout conversions produce, so they are measured as strided element
// copies (every other element, on both sides), the way a conversion runs.
constexpr std::uint64_t kSizes[] = {1, 8, 64, 512, 4096, 65536, 1u << 20, 4u << 20};
constexpr std::uint64_t kRegion = 32u << 20;

// GB/s of back-to-back requests of runs of `size` bytes through `channel`, for at least 15 ms.
double measure(Channel& channel, const Storage& src, const Storage& dst, std::uint64_t size) {
  using Clock = std::chrono::steady_clock;
  std::uint64_t bytes = 0, offset = 0;
  const bool strided = size < 4096;
  const std::uint64_t count = strided ? std::max<std::uint64_t>(1, (64u << 10) / size) : 1;
  const std::uint64_t span = strided ? 2 * size * count : size;
  const std::uint64_t duration_ms = strided && size < 64 ? 5 : 15;
  const auto submit_at = [&](std::uint64_t at) {
    const auto stride = static_cast<std::int64_t>(2 * size);
    TransferOp op = strided ? TransferOp{at, at, size, count, stride, stride} : TransferOp{at, at, size, 1, 0, 0};
    Request request{std::span<const TransferOp>(&op, 1), size * count, &src, &dst};
    FailureCause failure;
    channel.submit(request, [&](const FailureCause& f) { failure = f; });
    if (failure) throw *failure;
  };
  // One request untimed first: a channel's one-time setup must not count as its throughput (the
  // memcpy channel measures its streaming stores, about 80 ms, at its first long run: the 1 MiB
  // point read 0.3 GB/s instead of 8.5 without this).
  submit_at(0);
  auto start = Clock::now();
  auto until = start + std::chrono::milliseconds(duration_ms);
  do {
    for (int i = 0; i < 16; ++i) {
      submit_at(offset);
      bytes += size * count;
      offset = (offset + span) % (kRegion - kRegion % span);
      if (offset + span > kRegion) offset = 0;
    }
  } while (Clock::now() < until);
  return static_cast<double>(bytes) / std::chrono::duration<double>(Clock::now() - start).count() / 1e9;
}

#if CARAVAN_HAVE_GPU
// GPU channels: sizes up to 64 MiB (the copy engines keep gaining up to there), a region that
// holds two of the largest requests, and strided runs of up to 4 MiB per request, at most 2^20
// rows (a narrow 2-D copy costs per row, and calibration must stay a few seconds on 4 GPUs).
// Requests of small runs must still be large: at 64 KiB each (the earlier rule) every channel
// measured the ~10 us cost of a request (about 6 GB/s), not what it does with narrow runs,
// which is where the copy engine (35 GB/s for 4-byte rows on H200) and the conversion kernel
// differ.
constexpr std::uint64_t kGpuSizes[] = {1, 8, 64, 512, 4096, 65536, 1u << 20, 4u << 20, 16u << 20, 64u << 20};
constexpr std::uint64_t kGpuRegion = 128u << 20;
constexpr std::uint64_t kGpuStridedBytes = 4u << 20;
constexpr std::uint64_t kGpuMaxRows = 1u << 20;

// GB/s of requests of runs of `size` bytes through an asynchronous channel, keeping its window
// full, for at least `duration_ms` (the time includes waiting for the last requests).
double measure_async(Channel& channel, const Storage& src, const Storage& dst, std::uint64_t size, std::uint64_t region) {
  using Clock = std::chrono::steady_clock;
  const bool strided = size < 4096;
  const std::uint64_t count = strided ? std::clamp<std::uint64_t>(kGpuStridedBytes / size, 1, kGpuMaxRows) : 1;
  const std::uint64_t span = strided ? 2 * size * count : size;
  const auto duration = std::chrono::milliseconds(strided ? 5 : 15);
  const int window = std::max(channel.window(), 1);
  std::mutex mutex;
  std::condition_variable cv;
  int in_flight = 0;
  FailureCause failure;
  std::uint64_t bytes = 0, offset = 0;
  auto start = Clock::now();
  auto until = start + duration;
  while (Clock::now() < until) {
    {
      std::unique_lock lock(mutex);
      cv.wait(lock, [&] { return in_flight < window; });
      if (failure) break;
      ++in_flight;
    }
    auto stride = static_cast<std::int64_t>(2 * size);
    TransferOp op = strided ? TransferOp{offset, offset, size, count, stride, stride} : TransferOp{offset, offset, size, 1, 0, 0};
    Request request{std::span<const TransferOp>(&op, 1), size * count, &src, &dst};
    channel.submit(request, [&](const FailureCause& f) {
      std::lock_guard lock(mutex);
      if (f && !failure) failure = f;
      --in_flight;
      cv.notify_all();
    });
    bytes += size * count;
    offset += span;
    if (offset + span > region) offset = 0;
  }
  std::unique_lock lock(mutex);
  cv.wait(lock, [&] { return in_flight == 0; });
  if (failure) throw *failure;
  return static_cast<double>(bytes) / std::chrono::duration<double>(Clock::now() - start).count() / 1e9;
}

#endif  // CARAVAN_HAVE_GPU

// The GPU channel tables. Measured on GPU 0 (and from GPU 0 to its first peer) and used for
// every GPU: the devices of one node are one model (a mixed node logs a warning).
std::vector<ChannelCalibration> calibrate_gpu_channels() {
  std::vector<ChannelCalibration> out;
#if CARAVAN_HAVE_GPU
  const gpu::Topology& topo = gpu::topology();
  if (topo.devices.empty()) return out;
  for (const auto& d : topo.devices)
    if (d.name != topo.devices[0].name)
      log::get("dma")->warn("GPU {} is a {}, GPU 0 a {}: every GPU gets GPU 0's calibration", d.index, d.name, topo.devices[0].name);
  const int streams = static_cast<int>(settings::get_int("CARAVAN_GPU_STREAMS"));
  const int window = static_cast<int>(settings::get_int("CARAVAN_GPU_WINDOW"));
  MemoryId sys{0, 0, MemoryKind::sys, 0}, zcm{0, 0, MemoryKind::zcm, 0}, fbm0{0, 0, MemoryKind::fbm, 0};
  auto host = Storage::allocate_host(sys, kGpuRegion);
  auto pinned = Storage::allocate_pinned(zcm, kGpuRegion);
  auto a = Storage::allocate_device(fbm0, 0, kGpuRegion), b = Storage::allocate_device(fbm0, 0, kGpuRegion);
  channels::SdmaChannel sdma(fbm0, streams, window);
  struct Case {
    const char* name;
    const Storage* src;
    const Storage* dst;
  };
  const Case cases[] = {{"sdma_h2d", pinned.get(), a.get()},          {"sdma_d2h", a.get(), pinned.get()},
                        {"sdma_h2d_pageable", host.get(), a.get()}, {"sdma_d2h_pageable", a.get(), host.get()},
                        {"sdma_local", a.get(), b.get()}};
  for (const Case& c : cases) {
    ChannelCalibration ch{c.name, {}};
    for (std::uint64_t size : kGpuSizes) ch.samples.push_back({size, measure_async(sdma, *c.src, *c.dst, size, kGpuRegion)});
    out.push_back(std::move(ch));
  }
  {
    channels::GpuConvertChannel convert(fbm0, streams, window);
    ChannelCalibration ch{"gpu_convert", {}};
    for (std::uint64_t size : kGpuSizes) ch.samples.push_back({size, measure_async(convert, *a, *b, size, kGpuRegion)});
    out.push_back(std::move(ch));
  }
  for (std::size_t j = 1; j < topo.devices.size(); ++j) {
    if (!topo.can_peer(0, static_cast<int>(j))) continue;
    MemoryId fbmj{0, 0, MemoryKind::fbm, static_cast<std::uint32_t>(j)};
    auto peer = Storage::allocate_device(fbmj, static_cast<int>(j), kGpuRegion);
    channels::XgmiChannel xgmi(fbm0, fbmj, streams, window);
    ChannelCalibration ch{"xgmi", {}};
    for (std::uint64_t size : kGpuSizes) ch.samples.push_back({size, measure_async(xgmi, *a, *peer, size, kGpuRegion)});
    out.push_back(std::move(ch));
    break;
  }
#endif
  return out;
}

// The channel tables a calibration of this machine holds.
std::set<std::string> expected_channels() {
  std::set<std::string> names{"memcpy", "file_write", "file_read"};
#if CARAVAN_HAVE_GPU
  const gpu::Topology& topo = gpu::topology();
  if (!topo.devices.empty()) {
    names.insert({"sdma_h2d", "sdma_d2h", "sdma_h2d_pageable", "sdma_d2h_pageable", "sdma_local", "gpu_convert"});
    for (std::size_t j = 1; j < topo.devices.size(); ++j)
      if (topo.can_peer(0, static_cast<int>(j))) names.insert("xgmi");
  }
#endif
  return names;
}

std::string host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

std::string machine_key() {
  const std::string host = host_name();
  std::string cpu = "cpu";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  // The version changes whenever what is measured changes, so old caches are not reused.
  // The GPU set (models, PCI addresses, peer matrix, driver) and the GPU channel settings are
  // part of the key: another GPU set or stream count is another machine.
  constexpr int kCalibrationVersion = 8;  // 8: an untimed request first (7: the SM engine's grid bound)
  std::string key = fmt::format("v{}|{}|{}|{}|{}|gpus:{}|streams:{}|window:{}|xgmi:{}:{}", kCalibrationVersion, host, cpu,
                                std::thread::hardware_concurrency(), settings::get_string("CARAVAN_DSK_DIR"),
                                gpu::topology_key(), settings::get_int("CARAVAN_GPU_STREAMS"),
                                settings::get_int("CARAVAN_GPU_WINDOW"), settings::get_string("CARAVAN_GPU_XGMI_ENGINE"),
                                settings::get_int("CARAVAN_GPU_XGMI_SM_BLOCKS"));
  return fmt::format("{}-{:016x}", host, std::hash<std::string>{}(key));
}

nlohmann::json to_json(const Calibration& c) {
  nlohmann::json channels = nlohmann::json::object();
  for (const auto& ch : c.channels) {
    nlohmann::json samples = nlohmann::json::array();
    for (const auto& s : ch.samples) samples.push_back({s.bytes, s.gbps});
    channels[ch.channel] = samples;
  }
  return {{"machine_key", c.machine_key}, {"seconds", c.seconds}, {"channels", channels}};
}

}  // namespace

Calibration calibrate_channels() {
  auto start = std::chrono::steady_clock::now();
  Calibration c;
  c.machine_key = machine_key();
  MemoryId sys{0, 0, MemoryKind::sys, 0}, dsk{0, 0, MemoryKind::dsk, 0};
  auto a = Storage::allocate_host(sys, kRegion), b = Storage::allocate_host(sys, kRegion);
  // A disk directory that cannot hold a file must not stop programs that never use dsk: the
  // file channel is then left out (live_machine gives dsk no channels, load_or_calibrate does
  // not cache the result) and only dsk instances fail, with the directory's error.
  std::shared_ptr<Storage> file;
  try {
    file = Storage::allocate_file(dsk, kRegion);
  } catch (const Error& e) {
    log::get("dma")->warn(
        "{}: the file channel is not calibrated, and dsk memory has no channels until "
        "CARAVAN_DSK_DIR names a writable directory",
        e.what());
  }
  channels::MemcpyChannel memcpy_channel(1, UINT64_MAX);
  channels::FileChannel file_channel;
  ChannelCalibration m{"memcpy", {}}, w{"file_write", {}}, r{"file_read", {}};
  for (std::uint64_t size : kSizes) {
    m.samples.push_back({size, measure(memcpy_channel, *a, *b, size)});
    if (!file) continue;
    w.samples.push_back({size, measure(file_channel, *a, *file, size)});
    r.samples.push_back({size, measure(file_channel, *file, *b, size)});
  }
  c.channels = {m};
  if (file) c.channels.insert(c.channels.end(), {w, r});
  for (auto& g : calibrate_gpu_channels()) c.channels.push_back(std::move(g));
  c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return c;
}

std::string calibration_path() {
  std::string dir = settings::get_string("CARAVAN_CACHE_DIR");
  if (dir.empty()) {
    const char* xdg = std::getenv("XDG_CACHE_HOME");
    const char* home = std::getenv("HOME");
    dir = xdg && *xdg ? std::string(xdg) + "/caravan" : std::string(home && *home ? home : "/tmp") + "/.cache/caravan";
  }
  return dir + "/calibration-" + machine_key() + ".json";
}

namespace {

// The cached calibration at `path`, if there is one for this machine with every channel.
std::optional<Calibration> read_cache(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  try {
    nlohmann::json j = nlohmann::json::parse(in);
    Calibration c;
    c.machine_key = j.at("machine_key").get<std::string>();
    c.seconds = j.value("seconds", 0.0);
    for (auto& [name, samples] : j.at("channels").items()) {
      ChannelCalibration ch{name, {}};
      for (auto& s : samples) ch.samples.push_back({s.at(0).get<std::uint64_t>(), s.at(1).get<double>()});
      c.channels.push_back(std::move(ch));
    }
    std::set<std::string> names;
    for (const auto& ch : c.channels) names.insert(ch.channel);
    if (c.machine_key == machine_key() && names == expected_channels()) return c;
  } catch (const std::exception& e) {
    log::get("dma")->warn("ignoring unreadable calibration cache {}: {}", path, e.what());
  }
  return std::nullopt;
}

// An advisory lock (flock) on one file of the cache directory, held while a process calibrates.
// The ranks of a job start together: without it each measured its channels against the others'
// traffic, and each used its own tables, so the same copy was cut into different tiles on
// different ranks. With it they measure one after another, and a rank that waited reads what
// the one before it wrote. The wait is bounded (a process stuck while calibrating must not hold
// the others forever); past it, this process calibrates without the lock.
class CalibrationLock {
 public:
  CalibrationLock(const std::string& path, std::chrono::seconds limit) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0 && errno == EACCES) fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);  // another user's lock file
    if (fd_ < 0) {
      const int error = errno;  // before the logger, whose calls may change errno
      log::get("dma")->warn("cannot open the calibration lock {} ({}); calibrating without it", path,
                            std::strerror(error));
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) {
        const int error = errno;
        log::get("dma")->warn("cannot lock {} ({}); calibrating without it", path, std::strerror(error));
        return;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        log::get("dma")->warn("another process held {} for over {} s; calibrating without it", path, limit.count());
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ~CalibrationLock() {
    if (fd_ >= 0) ::close(fd_);  // closing the descriptor releases the lock
  }
  CalibrationLock(const CalibrationLock&) = delete;
  CalibrationLock& operator=(const CalibrationLock&) = delete;

 private:
  int fd_ = -1;
};

// Written to a file of its own, then renamed over `path`: a reader sees the old file or the new
// one, never half of one. False (with a warning) when it could not be written.
bool write_cache(const std::string& path, const Calibration& c) {
  // Named by process and thread: two callers that both measured without the lock must not
  // write into one file.
  const std::string partial = fmt::format("{}.{}.{:x}.partial", path, static_cast<long>(::getpid()),
                                          std::hash<std::thread::id>{}(std::this_thread::get_id()));
  {
    std::ofstream out(partial);
    if (out) out << to_json(c).dump(2) << "\n";
    out.close();  // the last bytes are written here: check after it
    if (!out) {
      log::get("dma")->warn("could not write the calibration cache {} (it will be measured again next time)", path);
      std::error_code ignored;
      std::filesystem::remove(partial, ignored);
      return false;
    }
  }
  std::error_code ec;
  std::filesystem::rename(partial, path, ec);
  if (ec) {
    log::get("dma")->warn("could not move {} to {} ({}); it will be measured again next time", partial, path, ec.message());
    std::filesystem::remove(partial, ec);
    return false;
  }
  return true;
}

}  // namespace

Calibration load_or_calibrate(bool force, bool* from_cache, bool* cached_now) {
  const std::string path = calibration_path();
  if (from_cache) *from_cache = false;
  if (cached_now) *cached_now = false;
  auto cached = [&]() -> std::optional<Calibration> {
    if (force) return std::nullopt;
    std::optional<Calibration> c = read_cache(path);
    if (c && from_cache) *from_cache = true;
    return c;
  };
  if (auto c = cached()) return *c;
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  std::filesystem::create_directories(dir, ec);
  // One lock per host, not per machine key: ranks that see different GPU sets have different
  // keys, and they too should not measure while another does. Not one per directory: a cache
  // directory shared by several hosts (a home on NFS, where flock reaches across hosts) must not
  // make the hosts wait for each other.
  CalibrationLock lock((dir / fmt::format("calibration-{}.lock", host_name())).string(), std::chrono::seconds(120));
  if (auto c = cached()) return *c;  // written by the process that held the lock before us
  Calibration c = calibrate_channels();
  std::set<std::string> names;
  for (const auto& ch : c.channels) names.insert(ch.channel);
  const bool written = names == expected_channels() && write_cache(path, c);  // an incomplete one is measured again
  if (cached_now) *cached_now = written;
  log::get("dma")->info("calibrated channels in {:.2f} s ({})", c.seconds, written ? path : "not cached");
  return c;
}

planner::MachineDescription live_machine(std::uint32_t rank, const std::vector<RankInfo>& ranks) {
  Calibration c = load_or_calibrate(false);
  planner::MachineDescription m;
  m.name = "live";
  m.description = "this host: system memory, file-backed storage, memcpy and file channels (calibrated)";
  auto node_of = [&](std::uint32_t r) -> std::uint32_t {
    for (const RankInfo& info : ranks)
      if (static_cast<std::uint32_t>(info.rank) == r) return static_cast<std::uint32_t>(info.node);
    return 0;
  };
  const std::uint32_t node = node_of(rank);
  MemoryId sys{node, rank, MemoryKind::sys, 0}, dsk{node, rank, MemoryKind::dsk, 0};
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  std::uint64_t sys_bytes = pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
  struct statvfs fs{};
  std::uint64_t dsk_bytes = 0;
  if (::statvfs(settings::get_string("CARAVAN_DSK_DIR").c_str(), &fs) == 0)
    dsk_bytes = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
  auto table = [&](const std::string& name) {
    for (const auto& ch : c.channels)
      if (ch.channel == name) return planner::ThroughputFunction(ch.samples);
    throw Error(Errc::internal, fmt::format("calibration has no '{}' channel", name));
  };
  // No file tables: CARAVAN_DSK_DIR was unusable at calibration (calibrate_channels).
  const bool files =
      std::any_of(c.channels.begin(), c.channels.end(), [](const auto& ch) { return ch.channel == "file_write"; });
  const bool job = ranks.size() > 1;
  if (!job) {
    m.memories = {{sys, sys_bytes}, {dsk, dsk_bytes}};
    m.channels.push_back({ChannelKind::memcpy, sys, sys, table("memcpy"), {}});
    if (files) {
      m.channels.push_back({ChannelKind::file, sys, dsk, table("file_write"), {}});
      m.channels.push_back({ChannelKind::file, dsk, sys, table("file_read"), {}});
    }
  } else {
    // A job: every rank's host memories (the ranks of one host run the same calibration, and
    // ranks on other hosts are taken to be alike), and the nic between every two ranks' reg.
    // Ranks of one node are separate processes too, so between them the nic (UCX over shared
    // memory) is the only way as well.
    m.description = fmt::format("this job: {} ranks, host memories (sys, reg, dsk) of each, memcpy and file channels "
                                "(calibrated), nic between every two ranks' reg (CARAVAN_NIC_GBPS)", ranks.size());
    constexpr std::uint64_t K = 1024, M = K * K;
    const auto nic_tp = planner::ThroughputFunction::scaled({{K, 0.05}, {16 * K, 0.35}, {256 * K, 0.85}, {M, 1.0}},
                                                           settings::get_double("CARAVAN_NIC_GBPS"));
    for (const RankInfo& info : ranks) {
      const auto r = static_cast<std::uint32_t>(info.rank), n = static_cast<std::uint32_t>(info.node);
      MemoryId rs{n, r, MemoryKind::sys, 0}, rr{n, r, MemoryKind::reg, 0}, rd{n, r, MemoryKind::dsk, 0};
      m.memories.push_back({rs, sys_bytes});
      m.memories.push_back({rr, sys_bytes});
      m.memories.push_back({rd, dsk_bytes});
      m.channels.push_back({ChannelKind::memcpy, rs, rs, table("memcpy"), {}});
      m.channels.push_back({ChannelKind::memcpy, rs, rr, table("memcpy"), {}});
      m.channels.push_back({ChannelKind::memcpy, rr, rs, table("memcpy"), {}});
      if (files) {
        m.channels.push_back({ChannelKind::file, rs, rd, table("file_write"), {}});
        m.channels.push_back({ChannelKind::file, rd, rs, table("file_read"), {}});
      }
    }
    for (const RankInfo& a : ranks)
      for (const RankInfo& b : ranks)
        if (a.rank != b.rank)
          m.channels.push_back({ChannelKind::nic,
                                MemoryId{static_cast<std::uint32_t>(a.node), static_cast<std::uint32_t>(a.rank), MemoryKind::reg, 0},
                                MemoryId{static_cast<std::uint32_t>(b.node), static_cast<std::uint32_t>(b.rank), MemoryKind::reg, 0},
                                nic_tp, {}});
  }
  const gpu::Topology& topo = gpu::topology();
  if (topo.devices.empty()) return m;

  // GPUs: zcm (pinned host memory, a host memory for memcpy and file too), one fbm per GPU, the
  // copy engines (sdma) between host memories and each fbm and within it, and peer copies
  // (xgmi) between GPUs that reach each other. Shared links are planner resources: each GPU's
  // PCIe link per direction (sys and zcm traffic to one GPU share it) and its NVLink egress and
  // ingress (all of its peer copies share them), at the calibrated peaks.
  // In a job every rank gets them (ranks of one host see its GPUs; ranks elsewhere are taken to
  // be alike, as for host memory), and REG, pinned for the GPUs too (Storage::wrap_registered),
  // is reached by the copy engines like zcm: GPU memory crosses to another node as
  // fbm -[sdma]-> reg -[nic]-> reg* -[sdma]-> fbm*, pipelined.
  m.description =
      job ? fmt::format("this job ({} ranks): system memory, file-backed storage, pinned host memory and {} x {} per rank, "
                        "reg; memcpy, file, sdma and xgmi channels (calibrated, also between the GPU memories of ranks "
                        "of one node), nic between every two ranks' reg (CARAVAN_NIC_GBPS)",
                        ranks.size(), topo.devices.size(), topo.devices[0].name)
          : fmt::format("this host: system memory, file-backed storage, pinned host memory and {} x {}; memcpy, file, "
                        "sdma and xgmi channels (calibrated)",
                        topo.devices.size(), topo.devices[0].name);
  const bool peers = std::any_of(c.channels.begin(), c.channels.end(), [](const auto& ch) { return ch.channel == "xgmi"; });
  auto add_resource = [&](const std::string& name, double gbps) {  // once per node, however many ranks use it
    if (std::none_of(m.resources.begin(), m.resources.end(), [&](const auto& x) { return x.name == name; }))
      m.resources.push_back({name, gbps});
  };
  std::vector<std::pair<std::uint32_t, std::uint32_t>> gpu_ranks;  // (node, rank)
  if (!job) gpu_ranks.emplace_back(node, rank);
  else
    for (const RankInfo& info : ranks)
      gpu_ranks.emplace_back(static_cast<std::uint32_t>(info.node), static_cast<std::uint32_t>(info.rank));
  for (auto [n, r] : gpu_ranks) {
    const MemoryId host{n, r, MemoryKind::sys, 0}, zcm{n, r, MemoryKind::zcm, 0}, disk{n, r, MemoryKind::dsk, 0},
        reg{n, r, MemoryKind::reg, 0};
    std::vector<MemoryId> pinned{zcm};  // host memories the copy engines reach directly
    if (job) pinned.push_back(reg);
    m.memories.push_back({zcm, sys_bytes});
    for (MemoryId a : {host, zcm})
      for (MemoryId b : {host, zcm})
        if (!(a == host && b == host)) m.channels.push_back({ChannelKind::memcpy, a, b, table("memcpy"), {}});
    if (job) {
      m.channels.push_back({ChannelKind::memcpy, zcm, reg, table("memcpy"), {}});
      m.channels.push_back({ChannelKind::memcpy, reg, zcm, table("memcpy"), {}});
    }
    if (files) {
      m.channels.push_back({ChannelKind::file, zcm, disk, table("file_write"), {}});
      m.channels.push_back({ChannelKind::file, disk, zcm, table("file_read"), {}});
    }
    auto fbm = [&](std::size_t i) { return MemoryId{n, r, MemoryKind::fbm, static_cast<std::uint32_t>(i)}; };
    // Resources are the node's physical links: ranks of one node that use one GPU share them.
    auto resource = [&](std::size_t i, const char* what) { return fmt::format("node{}/gpu{}.{}", n, i, what); };
    for (std::size_t i = 0; i < topo.devices.size(); ++i) {
      m.memories.push_back({fbm(i), topo.devices[i].memory_bytes});
      add_resource(resource(i, "pcie.h2d"), table("sdma_h2d").peak());
      add_resource(resource(i, "pcie.d2h"), table("sdma_d2h").peak());
      if (peers) {
        add_resource(resource(i, "nvlink.out"), table("xgmi").peak());
        add_resource(resource(i, "nvlink.in"), table("xgmi").peak());
      }
      for (MemoryId p : pinned) {
        m.channels.push_back({ChannelKind::sdma, p, fbm(i), table("sdma_h2d"), {resource(i, "pcie.h2d")}});
        m.channels.push_back({ChannelKind::sdma, fbm(i), p, table("sdma_d2h"), {resource(i, "pcie.d2h")}});
      }
      // Pageable copies only outside a job: their rate hides the CPU copies the driver makes to
      // stage them, and in a job the planner then sent host -> host copies between nodes through
      // GPU memory (sys -> fbm -> reg ..., measured slower than sys -> reg on 4 x H200). In a job
      // sys reaches a GPU through reg or zcm instead, which is what the driver's staging does.
      if (!job) {
        m.channels.push_back({ChannelKind::sdma, host, fbm(i), table("sdma_h2d_pageable"), {resource(i, "pcie.h2d")}});
        m.channels.push_back({ChannelKind::sdma, fbm(i), host, table("sdma_d2h_pageable"), {resource(i, "pcie.d2h")}});
      }
      m.channels.push_back({ChannelKind::sdma, fbm(i), fbm(i), table("sdma_local"), {}});
      m.channels.push_back({ChannelKind::gpu_convert, fbm(i), fbm(i), table("gpu_convert"), {}});
    }
    if (peers) {
      for (std::size_t i = 0; i < topo.devices.size(); ++i)
        for (std::size_t j = 0; j < topo.devices.size(); ++j)
          if (i != j && topo.can_peer(static_cast<int>(i), static_cast<int>(j)))
            m.channels.push_back({ChannelKind::xgmi, fbm(i), fbm(j), table("xgmi"), {resource(i, "nvlink.out"), resource(j, "nvlink.in")}});
    }
  }
  // Between the ranks of one node (separate processes), GPU memory is reached through IPC: the
  // source rank maps the destination's allocation and its GPU writes it as it writes its own,
  // over the peer link (xgmi) or, on one GPU, with its copy engines (sdma). Without these the
  // only way from one rank's GPU memory to another's was through REG and UCX.
  if (job)
    for (const RankInfo& a : ranks)
      for (const RankInfo& b : ranks) {
        if (a.rank == b.rank || a.node != b.node) continue;
        const auto n = static_cast<std::uint32_t>(a.node);
        auto fbm = [&](const RankInfo& r, std::size_t i) {
          return MemoryId{n, static_cast<std::uint32_t>(r.rank), MemoryKind::fbm, static_cast<std::uint32_t>(i)};
        };
        auto resource = [&](std::size_t i, const char* what) { return fmt::format("node{}/gpu{}.{}", n, i, what); };
        for (std::size_t i = 0; i < topo.devices.size(); ++i)
          for (std::size_t j = 0; j < topo.devices.size(); ++j) {
            if (i == j)
              m.channels.push_back({ChannelKind::sdma, fbm(a, i), fbm(b, j), table("sdma_local"), {}});
            else if (peers && topo.can_peer(static_cast<int>(i), static_cast<int>(j)))
              m.channels.push_back({ChannelKind::xgmi, fbm(a, i), fbm(b, j), table("xgmi"),
                                    {resource(i, "nvlink.out"), resource(j, "nvlink.in")}});
          }
      }
  return m;
}

}  // namespace caravan::dma
