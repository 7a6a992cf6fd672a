// The host side both Hopper (sm_90a) kernels share (flag_gemm_sm90.cu, attention_sm90.cu): the
// per-device decision whether a device runs them, with its one-time setup, and TMA tensor maps
// through the driver's encoder, reached through the runtime so that Caravan links no driver
// library.
#pragma once

#include "kernels/gpu/bf16.h"

#include <cuda.h>  // CUtensorMap

#include <array>
#include <atomic>
#include <functional>

namespace caravan::gpu::sm90 {

// Per device, whether it runs sm_90a code (compute capability 9.0 exactly), decided on the first
// call on each device, which also runs `setup` there (grant the kernels' shared memory, find the
// encoder). Each kernel keeps one, for its own setup. Devices past the first 64 are answered
// "no": the portable kernels run there.
class HopperDevices {
 public:
  bool ready_on_current_device(const std::function<void()>& setup);

 private:
  static constexpr int kMaxDevices = 64;
  std::array<std::atomic<int>, kMaxDevices> state_{};  // 0 unknown, 1 Hopper and set up, -1 not Hopper
};

// Finds cuTensorMapEncodeTiled once per process; throws Error(device) where the driver lacks it.
void find_tensor_map_encoder();

// A row-major bf16 matrix (rows x cols, leading dimension ld elements) as 128-byte swizzled boxes
// of box_cols x box_rows; reads past its edges are zeros. `who` prefixes the error message.
CUtensorMap tensor_map(const char* who, const bf16* base, long rows, long cols, long ld, int box_cols, int box_rows);

// The multiprocessor count of the current device (the persistent grids' size).
int current_multiprocessors();

}  // namespace caravan::gpu::sm90
