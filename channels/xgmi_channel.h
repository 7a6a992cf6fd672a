// xgmi: copies between two GPUs of a node over their peer link (NVLink on NVIDIA, xGMI on AMD),
// run by the source GPU (it pushes), with peer access enabled at discovery (runtime/gpu/devices.h):
// by its copy engines (strided ops become 2-D/3-D peer copies), or with CARAVAN_GPU_XGMI_ENGINE=sm
// by a kernel on its SMs storing into the peer's memory (runtime/gpu/op_kernel.h), which holds
// more bandwidth when every GPU sends to every other at once; `auto` picks per request. Asynchronous
// like sdma.
//
// Built only with a GPU toolchain (CARAVAN_HAVE_GPU); the header holds no HIP type.
#pragma once

#include "channels/gpu_channel.h"

#include <atomic>
#include <memory>

namespace caravan::channels {

class XgmiChannel final : public GpuChannel {
 public:
  XgmiChannel(MemoryId src, MemoryId dst, int streams, int window);
  ~XgmiChannel() override;
  ChannelKind kind() const noexcept override { return ChannelKind::xgmi; }
  // Its own pair: fbm of one GPU -> fbm of another GPU of the same node and rank that it reaches.
  bool serves(MemoryId src, MemoryId dst) const noexcept override;
  void submit(const dma::Request& request, Completion done) override;

 private:
  enum class Engine { copy, sm, automatic };
  MemoryId src_, dst_;
  bool peer_;           // the source GPU reaches the destination's memory (peer access enabled)
  unsigned sm_blocks_;  // the grid of a request's kernel (CARAVAN_GPU_XGMI_SM_BLOCKS, or one per SM)
  Engine engine_;       // CARAVAN_GPU_XGMI_ENGINE
  // Requests of this channel in flight; with those of the source GPU's other xgmi channels
  // (a counter per GPU shared by them), what `auto` decides by. Shared with the completions,
  // which may run on the queue's thread while the channel is being destroyed.
  std::shared_ptr<std::atomic<int>> in_flight_ = std::make_shared<std::atomic<int>>(0);
};

}  // namespace caravan::channels
