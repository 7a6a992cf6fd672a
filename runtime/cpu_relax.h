// One spin-wait step: tells the core that this thread is polling (frees pipeline resources for
// a sibling hyper-thread, saves power). Used by every short poll before a thread parks.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace caravan {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls `counter` for up to `ns` nanoseconds until it differs from `seen` (a thread about to
// park waiting for a signal that bumps it). Returns whether it changed. The clock is read every
// 64 polls.
inline bool poll_for_change(const std::atomic<std::uint64_t>& counter, std::uint64_t seen, std::int64_t ns) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
  for (int i = 0;; ++i) {
    if (counter.load(std::memory_order_acquire) != seen) return true;
    if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) return false;
    cpu_relax();
  }
}

}  // namespace caravan
