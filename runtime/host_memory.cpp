#include "runtime/host_memory.h"

#include <caravan/error.h>

#include <fmt/format.h>

#include <fstream>
#include <string>

namespace caravan::detail {

std::optional<std::uint64_t> available_host_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return std::nullopt;
}

void require_host_bytes(std::uint64_t bytes, std::string_view what) {
  // Below this a request cannot be what exhausts a host, and reading /proc/meminfo (some
  // microseconds) would be a noticeable share of creating a small instance.
  constexpr std::uint64_t kCheckedFrom = std::uint64_t{64} << 20;
  if (bytes < kCheckedFrom) return;
  const std::optional<std::uint64_t> available = available_host_bytes();
  if (!available || bytes <= *available) return;
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  throw Error(
      Errc::invalid_argument,
      fmt::format("{}: {} bytes ({:.1f} GiB) requested, but the host has only {} bytes ({:.1f} GiB) available "
                  "(MemAvailable in /proc/meminfo); ask for less",
                  what, bytes, static_cast<double>(bytes) / kGiB, *available, static_cast<double>(*available) / kGiB));
}

}  // namespace caravan::detail
