// The table a kernel needs to reach every rank's copy of the GPU symmetric heap, passed to
// kernels by value (host and device code share it).
#pragma once

namespace caravan::gpu {

inline constexpr int kMaxHeapRanks = 8;

struct HeapView {
  char* bases[kMaxHeapRanks] = {};  // rank p's heap base, as mapped on this GPU
  int rank = 0;                     // the GPU this view is for
  int world = 0;
};

}  // namespace caravan::gpu
