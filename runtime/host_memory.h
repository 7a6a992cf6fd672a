// How much host memory a request may take. Allocations of host memory (sys, reg, zcm instances
// and buffers, the symmetric heap) check against it first: Linux hands out address space
// freely and charges pages only when they are touched, so a request larger than the machine
// would otherwise succeed and then have the process, or a neighbour, killed by the kernel (or
// fill /dev/shm, where UCX puts registered memory, and bring the host down) part-way through a
// copy. A clear error at the call is better.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace caravan::detail {

// MemAvailable from /proc/meminfo, in bytes: what can still be allocated without swapping.
// nullopt where the kernel does not say (not Linux, or /proc unreadable): then nothing is
// checked.
std::optional<std::uint64_t> available_host_bytes();

// Throws Error(invalid_argument) naming `what` and both sizes when `bytes` is more than
// available_host_bytes(). Requests under 64 MiB are not checked.
void require_host_bytes(std::uint64_t bytes, std::string_view what);

}  // namespace caravan::detail
