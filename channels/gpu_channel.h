// What the GPU channels (sdma, xgmi, gpu_convert) share: a request runs asynchronously on the
// channel's own streams of one GPU (runtime/gpu/copy_queue.h), so the DMA worker keeps window()
// requests in flight, and its landing flag is written by hipStreamWriteValue64 behind its work.
//
// Built only with a GPU toolchain (CARAVAN_HAVE_GPU); the header holds no HIP type.
#pragma once

#include "runtime/dma/channel.h"

#include <memory>
#include <string>

namespace caravan::gpu {
class CopyQueue;
}

namespace caravan::channels {

class GpuChannel : public dma::Channel {
 public:
  ~GpuChannel() override;
  int window() const noexcept final { return window_; }
  dma::FlagWriter flag_writer() const noexcept final { return dma::FlagWriter::gpu; }
  // submit() queues the request on the channel's streams (CopyQueue::submit is thread-safe and
  // leaves the calling thread's current device as it found it).
  bool submits_from_any_thread() const noexcept final { return true; }

 protected:
  // `streams` streams on `device`, up to `window` requests in flight (at least 1); `name` names
  // the queue in logs and errors.
  GpuChannel(int device, int streams, int window, std::string name);
  gpu::CopyQueue& queue() noexcept { return *queue_; }

 private:
  int window_;
  std::unique_ptr<gpu::CopyQueue> queue_;
};

}  // namespace caravan::channels
