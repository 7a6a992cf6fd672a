#include "kernels/gpu/gpu_heap.h"

#include "runtime/gpu/platform.h"
#include "runtime/net/network.h"
#include "runtime/runtime_impl.h"

#include <caravan/error.h>
#include <caravan/runtime.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <span>

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
    free_all();
    throw;
  }
}

// What each rank of the job tells the others in join_node().
struct JoinEntry {
  int node = 0;
  int local_rank = 0;
  int device = 0;
  char bus_id[32] = {};  // the GPU's PCI address: two ranks of a node must not share one
  std::uint64_t bytes = 0;
  hipIpcMemHandle_t handle{};
};

std::unique_ptr<GpuSymmetricHeap> GpuSymmetricHeap::join_node(int device, std::uint64_t bytes_per_rank) {
  Runtime& rt = Runtime::current();
  net::Network* network = rt.impl().network();
  std::unique_ptr<GpuSymmetricHeap> heap(new GpuSymmetricHeap());
  heap->bytes_ = bytes_per_rank;
  JoinEntry mine;
  mine.node = rt.node();
  mine.local_rank = rt.rank_info(rt.rank()).local_rank;
  mine.device = device;
  mine.bytes = bytes_per_rank;
  void* base = nullptr;
  try {
    if (bytes_per_rank == 0) throw Error(Errc::invalid_argument, "GpuSymmetricHeap::join_node: bytes_per_rank must be positive");
    CARAVAN_HIP_CHECK(hipSetDevice(device));
    CARAVAN_HIP_CHECK(hipDeviceGetPCIBusId(mine.bus_id, sizeof(mine.bus_id), device));
    CARAVAN_HIP_CHECK(hipMalloc(&base, bytes_per_rank));
    CARAVAN_HIP_CHECK(hipMemset(base, 0, bytes_per_rank));
    CARAVAN_HIP_CHECK(hipDeviceSynchronize());
    CARAVAN_HIP_CHECK(hipIpcGetMemHandle(&mine.handle, base));
  } catch (...) {
    if (base) (void)hipFree(base);
    throw;  // the peers' collective below fails too: this rank does not take part
  }
  std::vector<JoinEntry> team;
  try {
    if (!network) {
      team.push_back(mine);  // one rank alone
    } else {
      const auto parts = network->allgather(std::as_bytes(std::span<const JoinEntry, 1>(&mine, 1)), std::nullopt,
                                            "GpuSymmetricHeap::join_node");
      for (const auto& part : parts) {
        JoinEntry e;
        if (part.size() != sizeof(e)) throw Error(Errc::internal, "GpuSymmetricHeap::join_node: a rank sent a malformed entry");
        std::memcpy(&e, part.data(), sizeof(e));
        if (e.node == mine.node) team.push_back(e);
      }
    }
    std::sort(team.begin(), team.end(), [](const JoinEntry& a, const JoinEntry& b) { return a.local_rank < b.local_rank; });
    if (team.size() > static_cast<std::size_t>(kMaxHeapRanks))
      throw Error(Errc::invalid_argument, fmt::format("GpuSymmetricHeap::join_node: {} ranks on this node; at most {}",
                                                      team.size(), kMaxHeapRanks));
    for (const JoinEntry& e : team) {
      if (e.bytes != bytes_per_rank)
        throw Error(Errc::invalid_argument,
                    fmt::format("GpuSymmetricHeap::join_node: every rank of a node must ask for the same size; local rank "
                                "{} asked for {} bytes, this one for {}",
                                e.local_rank, e.bytes, bytes_per_rank));
      if (e.local_rank != mine.local_rank && std::strncmp(e.bus_id, mine.bus_id, sizeof(e.bus_id)) == 0)
        throw Error(Errc::invalid_argument,
                    fmt::format("GpuSymmetricHeap::join_node: local ranks {} and {} both chose GPU {} ({}); each rank "
                                "needs a GPU of its own",
                                e.local_rank, mine.local_rank, mine.device, mine.bus_id));
    }
    for (std::size_t i = 0; i < team.size(); ++i)
      if (team[i].local_rank == mine.local_rank) heap->own_rank_ = static_cast<int>(i);
    for (const JoinEntry& e : team) {
      heap->devices_.push_back(e.device);
      if (e.local_rank == mine.local_rank) {
        heap->bases_.push_back(static_cast<char*>(base));
        base = nullptr;  // the heap owns it now
        continue;
      }
      void* mapped = nullptr;
      const hipError_t status = hipIpcOpenMemHandle(&mapped, e.handle, hipIpcMemLazyEnablePeerAccess);
      if (status != hipSuccess) {
        (void)hipGetLastError();
        throw Error(Errc::device, fmt::format("GpuSymmetricHeap::join_node: cannot map local rank {}'s heap (GPU {}, {}) "
                                              "on GPU {}: {} ({})",
                                              e.local_rank, e.device, e.bus_id, device, hipGetErrorName(status),
                                              hipGetErrorString(status)));
      }
      heap->bases_.push_back(static_cast<char*>(mapped));
    }
  } catch (...) {
    if (base) (void)hipFree(base);  // not handed to the heap yet
    heap->free_all();
    heap->bases_.clear();
    throw;
  }
  return heap;
}

void GpuSymmetricHeap::free_all() noexcept {
  if (own_rank_ >= 0 && static_cast<std::size_t>(own_rank_) < devices_.size()) (void)hipSetDevice(devices_[own_rank_]);
  for (std::size_t i = 0; i < bases_.size(); ++i) {
    const bool own = own_rank_ < 0 || static_cast<int>(i) == own_rank_;
    if (own_rank_ < 0) (void)hipSetDevice(devices_[i]);
    if (own) (void)hipFree(bases_[i]);
    else (void)hipIpcCloseMemHandle(bases_[i]);
  }
}

GpuSymmetricHeap::~GpuSymmetricHeap() { free_all(); }

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
    if (own_rank_ >= 0 && static_cast<int>(i) != own_rank_) continue;  // a peer zeroes its own
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
