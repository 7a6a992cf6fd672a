#include "channels/xgmi_channel.h"

#include "runtime/gpu/copy_queue.h"
#include "runtime/gpu/devices.h"
#include "runtime/gpu/op_kernel.h"

#include <caravan/settings.h>

#include <fmt/format.h>

namespace caravan::channels {

namespace {
// xgmi requests in flight per source GPU, over all its xgmi channels (this process).
constexpr int kMaxGpus = 64;
std::atomic<int>& gpu_in_flight(int device) {
  static std::atomic<int> counts[kMaxGpus];
  return counts[device % kMaxGpus];
}
}  // namespace

XgmiChannel::XgmiChannel(MemoryId src, MemoryId dst, int streams, int window)
    : GpuChannel(static_cast<int>(src.index), streams, window, fmt::format("xgmi {}->{}", src.to_string(), dst.to_string())),
      src_(src),
      dst_(dst),
      peer_(gpu::topology().can_peer(static_cast<int>(src.index), static_cast<int>(dst.index))) {
  const std::string engine = settings::get_string("CARAVAN_GPU_XGMI_ENGINE");
  engine_ = engine == "sm" ? Engine::sm : engine == "auto" ? Engine::automatic : Engine::copy;
  sm_blocks_ = static_cast<unsigned>(settings::get_int("CARAVAN_GPU_XGMI_SM_BLOCKS"));
  if (sm_blocks_ == 0) {
    // One block per SM: a GPU's kernels to three peers then run side by side (each a third of the
    // GPU's blocks resident at once) rather than one after another in launch order.
    const auto& devices = gpu::topology().devices;
    const auto index = static_cast<std::size_t>(src.index);
    sm_blocks_ = index < devices.size() && devices[index].multiprocessors > 0 ? static_cast<unsigned>(devices[index].multiprocessors) : 0;
  }
  // Loaded now, not at the first request (a module load while other work waits can stall).
  if (engine_ != Engine::copy) gpu::preload_op_kernel(static_cast<int>(src.index));
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
  bool sm = engine_ == Engine::sm;
  if (engine_ == Engine::automatic) {
    // The copy engines serve a GPU's peer copies about in issue order, so several at once go to
    // their receivers in whatever order the channels' workers issued them (docs/gpu.md,
    // "All-to-all"); kernels of a bounded grid share the GPU instead. One request alone keeps the
    // copy engines, which reach the link's rate with no SM.
    // The guard raises the counts as it is made and drops them when the completion runs, or when
    // the queue drops it unrun (a queue destroyed with requests in flight): it goes with the last
    // copy of the callback. This channel's count is read before the GPU's and dropped after it,
    // so a completion racing with this call can only make `others` smaller: a wrong guess falls
    // back to the copy engines.
    struct InFlight {
      InFlight(std::atomic<int>& gpu_count, std::shared_ptr<std::atomic<int>> channel_count)
          : gpu(gpu_count), channel(std::move(channel_count)) {
        const int own = channel->fetch_add(1, std::memory_order_acq_rel);
        others = gpu.fetch_add(1, std::memory_order_acq_rel) - own;
      }
      InFlight(const InFlight&) = delete;
      InFlight& operator=(const InFlight&) = delete;
      ~InFlight() {
        gpu.fetch_sub(1, std::memory_order_acq_rel);
        channel->fetch_sub(1, std::memory_order_acq_rel);
      }
      std::atomic<int>& gpu;
      std::shared_ptr<std::atomic<int>> channel;
      int others = 0;  // requests of the source GPU's other xgmi channels in flight at the call
    };
    auto guard = std::make_shared<InFlight>(gpu_in_flight(static_cast<int>(src_.index)), in_flight_);
    sm = guard->others > 0;
    done = [guard = std::move(guard), inner = std::move(done)](const FailureCause& failure) mutable {
      guard.reset();
      inner(failure);
    };
  }
  queue().submit(
      [&](hipStream_t stream) {
        if (sm) gpu::enqueue_transfer_kernel(request.ops, ends, stream, sm_blocks_);
        else gpu::enqueue_transfer_ops(request.ops, ends, stream);
      },
      std::move(done), request.signal_flag, request.signal_value);
}

}  // namespace caravan::channels
