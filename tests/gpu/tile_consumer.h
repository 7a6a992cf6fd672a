// Device side of the landing-flag tests (gpu_copy_test.cpp, CopyOptions::signal): a kernel that
// is running before a copy starts, waits on each tile's flag and then checksums that tile.
#pragma once

#include "runtime/gpu/platform.h"

#include <cstddef>
#include <cstdint>

namespace caravan::gpu::test {

// Tile i of the watched data: bytes [begin, end) of `data`, both multiples of 8.
struct TileBytes {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

// What the consumer saw for one tile.
struct TileSeen {
  std::uint64_t checksum = 0;  // tile_checksum of the tile's bytes, read after the flag
  std::uint64_t polls = 0;     // reads of the flag that did not show the value yet
  std::uint32_t status = 0;    // 1: the flag showed the value; 2: gave up (timeout or poll limit)
};

// Launches one block per tile on `stream` (a stream of the GPU holding `data`, `ranges`, `seen`;
// `flags` may be that GPU's memory or pinned mapped host memory). Block i reads flags[i] with
// volatile loads until it equals `value`, at most `max_polls` times and for at most `timeout_ns`,
// then fences (acquire) and checksums its tile into seen[i]. Block i sets started[i] = 1
// (pinned mapped host memory, zeroed) after its first read of its flag, so the host can start
// the copy once every block is polling. Checks the launch.
void launch_tile_consumer(const std::uint64_t* flags, std::uint64_t value, const std::byte* data, const TileBytes* ranges,
                          std::uint64_t tiles, std::uint64_t max_polls, std::uint64_t timeout_ns, TileSeen* seen,
                          unsigned* started, hipStream_t stream);

// The host's checksum of bytes [begin, end) of `data` (whose byte 0 is `data`): the sum over the
// range's 8-byte words w at word index k (from `data`) of w * (2k + 1), modulo 2^64, so a word in
// the wrong place changes it.
std::uint64_t tile_checksum(const std::byte* data, std::uint64_t begin, std::uint64_t end);

}  // namespace caravan::gpu::test
