#include "channels/gpu_channel.h"

#include "runtime/gpu/copy_queue.h"

#include <algorithm>

namespace caravan::channels {

GpuChannel::GpuChannel(int device, int streams, int window, std::string name)
    : window_(std::max(window, 1)), queue_(std::make_unique<gpu::CopyQueue>(device, streams, std::move(name))) {}

GpuChannel::~GpuChannel() = default;

}  // namespace caravan::channels
