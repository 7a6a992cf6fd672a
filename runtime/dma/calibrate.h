// Channel calibration: each channel's throughput against request size, measured with the real
// channel implementations, cached on disk keyed by the machine, and turned into the live
// machine description the planner works on.
#pragma once

#include <caravan/planner/machine_file.h>
#include <caravan/runtime.h>

#include <string>
#include <vector>

namespace caravan::dma {

struct ChannelCalibration {
  // "memcpy", "file_write" (host -> dsk), "file_read" (dsk -> host); with GPUs also "sdma_h2d"
  // (zcm -> fbm), "sdma_d2h" (fbm -> zcm), "sdma_h2d_pageable" (sys -> fbm), "sdma_d2h_pageable"
  // (fbm -> sys), "sdma_local" (fbm -> same fbm) and, when GPUs reach each other, "xgmi".
  std::string channel;
  std::vector<planner::ThroughputFunction::Sample> samples;
};

struct Calibration {
  std::string machine_key;
  std::vector<ChannelCalibration> channels;
  double seconds = 0;  // how long measuring took
};

// Measures every channel now (about a quarter of a second on a CPU host; GPU channels are
// measured on GPU 0 and from GPU 0 to one peer, a few seconds, and used for every GPU).
Calibration calibrate_channels();
// The cache file for this machine: CARAVAN_CACHE_DIR (default ~/.cache/caravan) + machine key.
std::string calibration_path();
// The cached calibration if it exists and matches this machine, else a new one (then cached).
// `force` always measures.
// `cached_now`: whether a calibration measured by this call was written to the cache.
Calibration load_or_calibrate(bool force, bool* from_cache = nullptr, bool* cached_now = nullptr);

// The live machine of `rank`: sys and dsk memories, the memcpy self-loop and the file channels
// both ways; with GPUs also zcm, fbm<i> per GPU, sdma channels (zcm/sys <-> fbm<i>, the fbm<i>
// self-loop), xgmi fbm<i> -> fbm<j> where peer access works, and each GPU's PCIe and NVLink
// directions as shared resources; all with calibrated throughput.
//
// In a job of several ranks (`ranks`, the rank table; empty or one entry: a rank alone) every
// rank's host memories appear under its node, node<n>/rank<r>/{sys,reg,dsk}, with its memcpy
// (sys <-> reg) and file channels, and a `nic` channel from each rank's reg to every other
// rank's reg (UCX puts need registered memory at both ends; CARAVAN_NIC_GBPS with a
// network-shaped curve, not calibrated: measuring it would take two ranks). GPU memories and
// channels are this rank's only.
planner::MachineDescription live_machine(std::uint32_t rank, const std::vector<RankInfo>& ranks = {});

}  // namespace caravan::dma
