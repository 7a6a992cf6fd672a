#include "apps/caravan/bench_ranks.h"

#include "apps/caravan/launcher.h"
#include "runtime/net/network.h"
#include "runtime/runtime_impl.h"

#include <caravan/error.h>

#include <fmt/format.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace caravan::app {

nlohmann::json run_self_as_ranks(int world, int nodes, const std::vector<std::string>& rank_args,
                                 const std::vector<std::pair<std::string, std::string>>& environment,
                                 const std::string& what) {
  char self[4096] = {};
  ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length <= 0) throw Error(Errc::internal, fmt::format("{}: cannot find this program (/proc/self/exe)", what));
  static int calls = 0;
  const std::string out = fmt::format("/tmp/caravan-{}-{}-{}.json", what, getpid(), ++calls);
  RunSpec spec;
  spec.ranks = world;
  spec.nodes = nodes;
  spec.command = {std::string(self, static_cast<std::size_t>(length))};
  spec.command.insert(spec.command.end(), rank_args.begin(), rank_args.end());
  spec.command.insert(spec.command.end(), {"--out", out});
  spec.environment = environment;
  spec.quiet = true;
  const int status = run_ranks(spec);
  if (status != 0) {
    std::remove(out.c_str());
    // Status 2 is a rank refusing its input (a setting, an option): a usage error here too.
    throw Error(status == 2 ? Errc::invalid_argument : Errc::transport,
                fmt::format("{}: the ranks failed (status {}; their messages are above)", what, status));
  }
  std::ifstream file(out);
  if (!file) throw Error(Errc::internal, fmt::format("{}: rank 0 wrote no figures to {}", what, out));
  nlohmann::json result = nlohmann::json::parse(file);
  std::remove(out.c_str());
  return result;
}

std::vector<std::vector<double>> gather_doubles(Runtime& rt, const std::vector<double>& mine) {
  net::Network* network = rt.impl().network();
  if (!network) return {mine};
  auto parts = network->allgather(std::as_bytes(std::span<const double>(mine)), std::chrono::seconds(120), "bench ranks");
  std::vector<std::vector<double>> out;
  for (const auto& part : parts) {
    std::vector<double> values(part.size() / sizeof(double));
    std::memcpy(values.data(), part.data(), values.size() * sizeof(double));
    out.push_back(std::move(values));
  }
  return out;
}

double load_average() {
  double load = -1;
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &load) != 1) load = -1;
    std::fclose(f);
  }
  return load;
}

StartLine::StartLine(Runtime& rt)
    : heap_(SymmetricHeap::current()), word_(heap_.allocate_signals(1)), world_(rt.world_size()) {}

void StartLine::wait() {
  ++starts_;
  for (int p = 0; p < world_; ++p) heap_.signal(word_, 0, SignalOp::add, 1, p, MemoryOrder::release);
  heap_.wait_until(word_, 0, SignalCompare::ge, starts_ * static_cast<std::uint64_t>(world_), std::chrono::seconds(60));
}

}  // namespace caravan::app
