#include "channels/sdma_channel.h"

#include "runtime/gpu/copy_queue.h"

#include <fmt/format.h>

namespace caravan::channels {

SdmaChannel::SdmaChannel(MemoryId device_memory, int streams, int window)
    : GpuChannel(static_cast<int>(device_memory.index), streams, window, fmt::format("sdma {}", device_memory.to_string())),
      memory_(device_memory) {}

SdmaChannel::~SdmaChannel() = default;

bool SdmaChannel::serves(MemoryId src, MemoryId dst) const noexcept {
  if (src.node != memory_.node || dst.node != memory_.node) return false;
  const bool src_here = src == memory_, dst_here = dst == memory_;
  // The same GPU's memory as another rank of the node sees it (mapped through IPC).
  const bool same_gpu_other_rank = dst.kind == MemoryKind::fbm && dst.index == memory_.index && dst.rank != memory_.rank;
  return (src_here && (dst_here || same_gpu_other_rank)) || (src_here && is_host(dst.kind)) || (is_host(src.kind) && dst_here);
}

void SdmaChannel::submit(const dma::Request& request, Completion done) {
  gpu::CopyEnds ends{request.src->gpu_address(), request.dst->gpu_address(), request.src->device(), request.dst->device()};
  if (!ends.src || !ends.dst) {
    done(make_failure(Errc::internal, fmt::format("sdma {} given a request on file-backed storage", memory_.to_string())));
    return;
  }
  queue().submit([&](hipStream_t stream) { gpu::enqueue_transfer_ops(request.ops, ends, stream); }, std::move(done),
                 request.signal_flag, request.signal_value);
}

}  // namespace caravan::channels
