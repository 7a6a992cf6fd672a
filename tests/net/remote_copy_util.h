// Helpers for multi-process copy tests (tests/net/remote_copy_test.cpp,
// tests/gpu/remote_gpu_copy_test.cpp): instances named across ranks by their descriptors, a seed
// fresh in every run, and a bounded wait for this rank's DMA engine to have no copy left.
#pragma once

#include "runtime/dma/engine.h"
#include "tests/net/net_test_util.h"

#include <caravan/copy.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

namespace caravan::test {

// Every rank's descriptor of its `mine`, imported here (this rank's own comes back as itself).
inline std::vector<Instance> share(Runtime& rt, const Instance& mine) {
  auto parts = network(rt).allgather(mine.descriptor(), std::chrono::seconds(30), "test descriptors");
  std::vector<Instance> out;
  for (auto& part : parts) out.push_back(Instance::from_descriptor(part));
  return out;
}

// A seed drawn on rank 0 and shared: fresh data every run.
inline std::uint64_t fresh_seed(Runtime& rt) {
  std::uint64_t seed = std::random_device{}() | (static_cast<std::uint64_t>(std::random_device{}()) << 32);
  return all_gather(rt, seed)[0];
}

// Rank `rank`'s seed of a test whose ranks write different patterns from one shared seed.
inline std::uint64_t rank_seed(std::uint64_t seed, int rank) { return seed ^ (0x9E37ull * static_cast<std::uint64_t>(rank + 1)); }

inline std::size_t engine_active_copies() { return dma::Engine::current().stats().active_copies; }

// Waits (bounded) until this rank's engine has no copy left: a part waiting for `finished`, or
// buffers left behind, would show here.
inline bool engine_drains(std::chrono::seconds limit) {
  auto until = std::chrono::steady_clock::now() + limit;
  while (engine_active_copies() != 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return engine_active_copies() == 0;
}

}  // namespace caravan::test
