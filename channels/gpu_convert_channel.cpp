#include "channels/gpu_convert_channel.h"

#include "runtime/gpu/copy_queue.h"
#include "runtime/gpu/op_kernel.h"

#include <fmt/format.h>

namespace caravan::channels {

GpuConvertChannel::GpuConvertChannel(MemoryId device_memory, int streams, int window)
    : GpuChannel(static_cast<int>(device_memory.index), streams, window,
                 fmt::format("gpu_convert {}", device_memory.to_string())),
      memory_(device_memory) {
  // Loaded now, not at the first request: a module load while other work waits on flags can stall.
  gpu::preload_op_kernel(static_cast<int>(device_memory.index));
}

GpuConvertChannel::~GpuConvertChannel() = default;

bool GpuConvertChannel::serves(MemoryId src, MemoryId dst) const noexcept { return src == memory_ && dst == memory_; }

void GpuConvertChannel::submit(const dma::Request& request, Completion done) {
  gpu::CopyEnds ends{request.src->gpu_address(), request.dst->gpu_address(), request.src->device(), request.dst->device()};
  if (ends.src_device != static_cast<int>(memory_.index) || ends.dst_device != static_cast<int>(memory_.index)) {
    done(make_failure(Errc::internal,
                      fmt::format("gpu_convert {} given a request outside its GPU's memory", memory_.to_string())));
    return;
  }
  queue().submit([&](hipStream_t stream) { gpu::enqueue_transfer_kernel(request.ops, ends, stream); }, std::move(done),
                 request.signal_flag, request.signal_value);
}

}  // namespace caravan::channels
