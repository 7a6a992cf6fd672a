// One spin-wait step: tells the core that this thread is polling (frees pipeline resources for
// a sibling hyper-thread, saves power). Used by every short poll before a thread parks.
#pragma once

namespace caravan {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace caravan
