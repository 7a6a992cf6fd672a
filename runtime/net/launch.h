// The job a rank belongs to, as a launcher describes it in the environment.
//
// Caravan reads the names torchrun sets and Slurm scripts commonly export, so that a job started
// by them needs nothing new: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK and
// LOCAL_WORLD_SIZE are accepted and ignored: Caravan derives local ranks from node keys). The
// node key is the host name, extended by CARAVAN_NODE (set by `caravan run --nodes`) or
// torchrun's GROUP_RANK when present, so that one host can hold several logical nodes.
#pragma once

#include <caravan/runtime.h>

#include <optional>
#include <string>

namespace caravan::net {

// The job described by the environment, or nullopt when WORLD_SIZE is not set.
// Throws Error(invalid_argument) naming the variable for a malformed value.
std::optional<LaunchOptions> launch_from_environment();

// Checks ranges (world size 1..65535, rank inside it, a port when world_size > 1) and fills
// an empty node key with the host name. `from_environment` picks the names errors use.
LaunchOptions validated(LaunchOptions launch, bool from_environment);

std::string host_name();

}  // namespace caravan::net
