// sdma: a GPU's copy engines, for host -> GPU, GPU -> host and within-GPU copies (the paper's
// GPUWrite, GPURead and GPUCopy), including the strided 2-D/3-D copies that convert layouts.
// Requests go on the channel's own streams of that GPU and complete asynchronously (GpuChannel).
//
// Built only with a GPU toolchain (CARAVAN_HAVE_GPU); the header holds no HIP type.
#pragma once

#include "channels/gpu_channel.h"

namespace caravan::channels {

class SdmaChannel final : public GpuChannel {
 public:
  // The copy engines of the GPU behind `device_memory` (an fbm), with `streams` streams and up
  // to `window` requests in flight.
  SdmaChannel(MemoryId device_memory, int streams, int window);
  ~SdmaChannel() override;
  ChannelKind kind() const noexcept override { return ChannelKind::sdma; }
  // Host memory (sys, zcm, reg) <-> this GPU's fbm, and fbm -> the same fbm (also the same GPU's
  // memory of another rank of the node, mapped through IPC when a copy starts).
  bool serves(MemoryId src, MemoryId dst) const noexcept override;
  void submit(const dma::Request& request, Completion done) override;

 private:
  MemoryId memory_;
};

}  // namespace caravan::channels
