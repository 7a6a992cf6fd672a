#pragma once

#include "kernels/gpu/heap_view.h"
#include "runtime/gpu/platform.h"

#include <cstdint>

namespace caravan::gpu::test {

struct HandoffResult {
  unsigned long long wrong_payload = 0;
  unsigned long long flag_skips = 0;
};

// One side of a `rounds`-long hand-off between this rank and `peer` (see flag_handoff.cu).
// `slots`: this rank's copy of a zeroed 16-byte symmetric region; `result`: device memory.
void launch_handoff(const HeapView& heap, std::uint64_t* slots, int peer, bool first, std::uint64_t rounds,
                    HandoffResult* result, hipStream_t stream);

}  // namespace caravan::gpu::test

namespace caravan::gpu::test {
// `threads` device threads each add 1 to the 64-bit word `counter` (this rank's copy of a
// symmetric region) on rank `target`, `per_thread` times, with system-scope atomics.
void launch_remote_adds(const HeapView& heap, std::uint64_t* counter, int target, int threads, int per_thread,
                        hipStream_t stream);
}  // namespace caravan::gpu::test
