#include "runtime/dma/calibrate.h"

#include "channels/file_channel.h"
#include "channels/memcpy_channel.h"
#include "runtime/log.h"

#include <caravan/error.h>
#include <caravan/settings.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
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
  auto start = Clock::now();
  auto until = start + std::chrono::milliseconds(duration_ms);
  do {
    for (int i = 0; i < 16; ++i) {
      auto stride = static_cast<std::int64_t>(2 * size);
      TransferOp op = strided ? TransferOp{offset, offset, size, count, stride, stride} : TransferOp{offset, offset, size, 1, 0, 0};
      Request request{std::span<const TransferOp>(&op, 1), size * count, &src, &dst};
      FailureCause failure;
      channel.submit(request, [&](const FailureCause& f) { failure = f; });
      if (failure) throw *failure;
      bytes += size * count;
      offset = (offset + span) % (kRegion - kRegion % span);
      if (offset + span > kRegion) offset = 0;
    }
  } while (Clock::now() < until);
  return static_cast<double>(bytes) / std::chrono::duration<double>(Clock::now() - start).count() / 1e9;
}

std::string machine_key() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::string cpu = "cpu";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  // The version changes whenever what is measured changes, so old caches are not reused.
  constexpr int kCalibrationVersion = 2;
  std::string key = fmt::format("v{}|{}|{}|{}|{}", kCalibrationVersion, host, cpu, std::thread::hardware_concurrency(),
                                settings::get_string("CARAVAN_DSK_DIR"));
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
  auto file = Storage::allocate_file(dsk, kRegion);
  channels::MemcpyChannel memcpy_channel(1, UINT64_MAX);
  channels::FileChannel file_channel;
  ChannelCalibration m{"memcpy", {}}, w{"file_write", {}}, r{"file_read", {}};
  for (std::uint64_t size : kSizes) {
    m.samples.push_back({size, measure(memcpy_channel, *a, *b, size)});
    w.samples.push_back({size, measure(file_channel, *a, *file, size)});
    r.samples.push_back({size, measure(file_channel, *file, *b, size)});
  }
  c.channels = {m, w, r};
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

Calibration load_or_calibrate(bool force, bool* from_cache) {
  std::string path = calibration_path();
  if (from_cache) *from_cache = false;
  if (!force) {
    std::ifstream in(path);
    if (in) {
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
        if (c.machine_key == machine_key() && c.channels.size() == 3) {
          if (from_cache) *from_cache = true;
          return c;
        }
      } catch (const std::exception& e) {
        log::get("dma")->warn("ignoring unreadable calibration cache {}: {}", path, e.what());
      }
    }
  }
  Calibration c = calibrate_channels();
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  std::ofstream out(path);
  if (out) out << to_json(c).dump(2) << "\n";
  else log::get("dma")->warn("could not write the calibration cache {} (it will be measured again next time)", path);
  log::get("dma")->info("calibrated channels in {:.2f} s ({})", c.seconds, path);
  return c;
}

planner::MachineDescription live_machine(std::uint32_t rank) {
  Calibration c = load_or_calibrate(false);
  planner::MachineDescription m;
  m.name = "live";
  m.description = "this host: system memory, file-backed storage, memcpy and file channels (calibrated)";
  MemoryId sys{0, rank, MemoryKind::sys, 0}, dsk{0, rank, MemoryKind::dsk, 0};
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  std::uint64_t sys_bytes = pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
  struct statvfs fs{};
  std::uint64_t dsk_bytes = 0;
  if (::statvfs(settings::get_string("CARAVAN_DSK_DIR").c_str(), &fs) == 0)
    dsk_bytes = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
  m.memories = {{sys, sys_bytes}, {dsk, dsk_bytes}};
  auto table = [&](const std::string& name) {
    for (const auto& ch : c.channels)
      if (ch.channel == name) return planner::ThroughputFunction(ch.samples);
    throw Error(Errc::internal, fmt::format("calibration has no '{}' channel", name));
  };
  m.channels.push_back({ChannelKind::memcpy, sys, sys, table("memcpy"), {}});
  m.channels.push_back({ChannelKind::file, sys, dsk, table("file_write"), {}});
  m.channels.push_back({ChannelKind::file, dsk, sys, table("file_read"), {}});
  return m;
}

}  // namespace caravan::dma
