// Helpers of the benchmarks whose measurements run as several ranks (bench overlap, bench llm):
// start this program again as the ranks of a job, collect their figures, and line ranks up.
#pragma once

#include <caravan/runtime.h>
#include <caravan/symmetric_heap.h>

#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

namespace caravan::app {

// Runs `caravan <rank_args...> --out FILE` as `world` ranks in `nodes` logical nodes through the
// launcher of `caravan run`, with `environment` added; returns the JSON rank 0 wrote to FILE.
// Throws Error(transport) when a rank fails (their messages are on stderr already).
nlohmann::json run_self_as_ranks(int world, int nodes, const std::vector<std::string>& rank_args,
                                 const std::vector<std::pair<std::string, std::string>>& environment,
                                 const std::string& what);

// Every rank's doubles, by rank (a collective; one rank alone: its own).
std::vector<std::vector<double>> gather_doubles(Runtime& rt, const std::vector<double>& mine);

// The 1-minute load average of this host (-1 when unknown).
double load_average();

// A start line for timed launches: each rank adds 1 to a word on every rank and spins until its
// own word has all W adds. Spinning on the symmetric heap releases the ranks within microseconds
// of each other; the runtime's barrier (a message through rank 0 and a thread wake-up) let them
// start up to ~100 us apart, which the launch times then included.
class StartLine {
 public:
  explicit StartLine(Runtime& rt);
  void wait();

 private:
  SymmetricHeap heap_;
  SymmetricRegion word_;
  int world_;
  std::uint64_t starts_ = 0;
};

}  // namespace caravan::app
