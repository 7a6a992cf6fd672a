// The live machine as the planner sees it before GPU and NIC channels exist: this host's system
// memory and the CPU memcpy channel, with throughput measured now.
#include <caravan/planner/machine_file.h>

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <vector>

namespace caravan::planner {
namespace {

// GB/s of back-to-back memcpy requests of `request` bytes over a buffer that does not fit in
// cache, for about a millisecond.
double measure_memcpy(std::vector<char>& from, std::vector<char>& to, std::size_t request) {
  using clock = std::chrono::steady_clock;
  std::size_t span = from.size() - from.size() % request;
  std::size_t bytes = 0, offset = 0;
  auto start = clock::now();
  auto deadline = start + std::chrono::microseconds(1000);
  do {
    for (int i = 0; i < 64; ++i) {
      std::memcpy(to.data() + offset, from.data() + offset, request);
      bytes += request;
      offset += request;
      if (offset >= span) offset = 0;
    }
  } while (clock::now() < deadline);
  double seconds = std::chrono::duration<double>(clock::now() - start).count();
  return static_cast<double>(bytes) / seconds / 1e9;
}

}  // namespace

MachineDescription describe_local_machine() {
  MachineDescription m;
  m.name = "local";
  m.description = "this host: system memory and the CPU memcpy channel (throughput measured at startup)";
  MemoryId sys{0, 0, MemoryKind::sys, 0};
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  m.memories.push_back({sys, pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0});
  std::vector<char> from(64u << 20, 1), to(64u << 20, 0);
  std::vector<ThroughputFunction::Sample> samples;
  for (std::size_t request : {std::size_t{16}, std::size_t{256}, std::size_t{4096}, std::size_t{65536}, std::size_t{1} << 20})
    samples.push_back({request, measure_memcpy(from, to, request)});
  m.channels.push_back({ChannelKind::memcpy, sys, sys, ThroughputFunction(samples), {}});
  return m;
}

}  // namespace caravan::planner
