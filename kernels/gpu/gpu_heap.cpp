#include "kernels/gpu/gpu_heap.h"

#include "runtime/gpu/platform.h"

#include <caravan/error.h>

#include <fmt/format.h>

#include <algorithm>

namespace caravan::gpu {

GpuSymmetricHeap::GpuSymmetricHeap(std::vector<int> devices, std::uint64_t bytes_per_rank)
    : devices_(std::move(devices)), bytes_(bytes_per_rank) {
  if (devices_.empty() || devices_.size() > static_cast<std::size_t>(kMaxHeapRanks))
    throw Error(Errc::invalid_argument,
                fmt::format("GpuSymmetricHeap: devices must list 1 to {} GPUs, got {}", kMaxHeapRanks, devices_.size()));
  for (std::size_t i = 0; i < devices_.size(); ++i)
    if (std::count(devices_.begin(), devices_.end(), devices_[i]) > 1)
      throw Error(Errc::invalid_argument, fmt::format("GpuSymmetricHeap: device {} is listed twice", devices_[i]));
  try {
    for (int a : devices_) {
      CARAVAN_HIP_CHECK(hipSetDevice(a));
      for (int b : devices_) {
        if (a == b) continue;
        int can = 0;
        CARAVAN_HIP_CHECK(hipDeviceCanAccessPeer(&can, a, b));
        if (!can)
          throw Error(Errc::invalid_argument,
                      fmt::format("GpuSymmetricHeap: GPU {} cannot reach GPU {} (no peer access)", a, b));
        hipError_t status = hipDeviceEnablePeerAccess(b, 0);
        if (status == hipErrorPeerAccessAlreadyEnabled) (void)hipGetLastError();
        else CARAVAN_HIP_CHECK(status);
      }
      void* base = nullptr;
      CARAVAN_HIP_CHECK(hipMalloc(&base, bytes_));
      bases_.push_back(static_cast<char*>(base));
      CARAVAN_HIP_CHECK(hipMemset(base, 0, bytes_));
    }
    for (int d : devices_) {
      CARAVAN_HIP_CHECK(hipSetDevice(d));
      CARAVAN_HIP_CHECK(hipDeviceSynchronize());
    }
  } catch (...) {
    for (std::size_t i = 0; i < bases_.size(); ++i) {
      (void)hipSetDevice(devices_[i]);
      (void)hipFree(bases_[i]);
    }
    throw;
  }
}

GpuSymmetricHeap::~GpuSymmetricHeap() {
  for (std::size_t i = 0; i < bases_.size(); ++i) {
    (void)hipSetDevice(devices_[i]);
    (void)hipFree(bases_[i]);
  }
}

SymmetricRegion GpuSymmetricHeap::allocate(std::uint64_t bytes, std::uint64_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    throw Error(Errc::invalid_argument,
                fmt::format("GpuSymmetricHeap::allocate: alignment {} is not a power of two", alignment));
  const std::uint64_t offset = (used_ + alignment - 1) / alignment * alignment;
  if (offset > bytes_ || bytes > bytes_ - offset)
    throw Error(Errc::invalid_argument,
                fmt::format("GpuSymmetricHeap::allocate: {} bytes do not fit ({} of {} bytes per rank used)", bytes,
                            used_, bytes_));
  used_ = offset + bytes;
  return {offset, bytes};
}

void GpuSymmetricHeap::release_to(std::uint64_t mark) {
  if (mark > used_)
    throw Error(Errc::invalid_argument,
                fmt::format("GpuSymmetricHeap::release_to: mark {} is beyond the {} bytes in use", mark, used_));
  for (std::size_t i = 0; i < bases_.size(); ++i) {
    CARAVAN_HIP_CHECK(hipSetDevice(devices_[i]));
    CARAVAN_HIP_CHECK(hipMemset(bases_[i] + mark, 0, used_ - mark));
    CARAVAN_HIP_CHECK(hipDeviceSynchronize());  // the memset is on the legacy stream: finish it
  }
  used_ = mark;
}

HeapView GpuSymmetricHeap::view(int rank) const {
  if (rank < 0 || rank >= world())
    throw Error(Errc::invalid_argument, fmt::format("GpuSymmetricHeap::view: rank {} outside 0..{}", rank, world() - 1));
  HeapView v;
  for (int p = 0; p < world(); ++p) v.bases[p] = bases_[static_cast<std::size_t>(p)];
  v.rank = rank;
  v.world = world();
  return v;
}

}  // namespace caravan::gpu
