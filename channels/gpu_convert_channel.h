// gpu_convert: a GPU's threads converting layouts within its own memory (fbm -> the same fbm), the
// self-loop the transfer graph gives each GPU next to the copy engine's (sdma fbm -> fbm). A
// request's byte operations run as kernels (runtime/gpu/op_kernel.h) on the channel's own
// streams: where a conversion moves narrow strided runs (one field of a point at a time), the
// copy engine pays per row and this channel does not. The planner picks between the two by
// their calibrated throughputs (`caravan calibrate`: table gpu_convert).
//
// Built only with a GPU toolchain (CARAVAN_HAVE_GPU); the header holds no HIP type.
#pragma once

#include "channels/gpu_channel.h"

namespace caravan::channels {

class GpuConvertChannel final : public GpuChannel {
 public:
  // The GPU behind `device_memory` (an fbm), with `streams` streams and up to `window` requests
  // in flight.
  GpuConvertChannel(MemoryId device_memory, int streams, int window);
  ~GpuConvertChannel() override;
  ChannelKind kind() const noexcept override { return ChannelKind::gpu_convert; }
  // fbm -> the same fbm only.
  bool serves(MemoryId src, MemoryId dst) const noexcept override;
  void submit(const dma::Request& request, Completion done) override;

 private:
  MemoryId memory_;
};

}  // namespace caravan::channels
