#include "channels/xgmi_channel.h"

#include "runtime/gpu/copy_queue.h"
#include "runtime/gpu/devices.h"
#include "runtime/gpu/op_kernel.h"

#include <caravan/settings.h>

#include <fmt/format.h>

namespace caravan::channels {

XgmiChannel::XgmiChannel(MemoryId src, MemoryId dst, int streams, int window)
    : GpuChannel(static_cast<int>(src.index), streams, window, fmt::format("xgmi {}->{}", src.to_string(), dst.to_string())),
      src_(src),
      dst_(dst),
      peer_(gpu::topology().can_peer(static_cast<int>(src.index), static_cast<int>(dst.index))),
      sm_(settings::get_string("CARAVAN_GPU_XGMI_ENGINE") == "sm") {
  // Loaded now, not at the first request (a module load while other work waits can stall).
  if (sm_) gpu::preload_op_kernel(static_cast<int>(src.index));
}

XgmiChannel::~XgmiChannel() = default;

bool XgmiChannel::serves(MemoryId src, MemoryId dst) const noexcept {
  // Within a rank between two GPUs that reach each other, or into another rank's GPU memory of
  // this node (mapped through IPC; the live machine has those channels only between GPUs that
  // reach each other, sdma taking the same-GPU case).
  if (src.kind != MemoryKind::fbm || dst.kind != MemoryKind::fbm || src.node != dst.node || src != src_ || dst != dst_)
    return false;
  return src.rank == dst.rank ? src.index != dst.index && peer_ : true;
}

void XgmiChannel::submit(const dma::Request& request, Completion done) {
  gpu::CopyEnds ends{request.src->gpu_address(), request.dst->gpu_address(), request.src->device(), request.dst->device()};
  if (ends.src_device < 0 || ends.dst_device < 0) {
    done(make_failure(Errc::internal, fmt::format("xgmi {}->{} given a request on host storage", src_.to_string(), dst_.to_string())));
    return;
  }
  queue().submit(
      [&](hipStream_t stream) {
        if (sm_) gpu::enqueue_transfer_kernel(request.ops, ends, stream);
        else gpu::enqueue_transfer_ops(request.ops, ends, stream);
      },
      std::move(done), request.signal_flag, request.signal_value);
}

}  // namespace caravan::channels
