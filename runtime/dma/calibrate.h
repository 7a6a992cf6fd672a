// Channel calibration: each channel's throughput against request size, measured with the real
// channel implementations, cached on disk keyed by the machine, and turned into the live
// machine description the planner works on.
#pragma once

#include <caravan/planner/machine_file.h>

#include <string>
#include <vector>

namespace caravan::dma {

struct ChannelCalibration {
  std::string channel;  // "memcpy", "file_write" (host -> dsk), "file_read" (dsk -> host)
  std::vector<planner::ThroughputFunction::Sample> samples;
};

struct Calibration {
  std::string machine_key;
  std::vector<ChannelCalibration> channels;
  double seconds = 0;  // how long measuring took
};

// Measures every channel now (about a quarter of a second).
Calibration calibrate_channels();
// The cache file for this machine: CARAVAN_CACHE_DIR (default ~/.cache/caravan) + machine key.
std::string calibration_path();
// The cached calibration if it exists and matches this machine, else a new one (then cached).
// `force` always measures.
Calibration load_or_calibrate(bool force, bool* from_cache = nullptr);

// The live machine of `rank` on a CPU host: sys and dsk memories, the memcpy self-loop and the
// file channels both ways, with calibrated throughput.
planner::MachineDescription live_machine(std::uint32_t rank);

}  // namespace caravan::dma
