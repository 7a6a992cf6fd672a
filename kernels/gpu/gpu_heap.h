// The GPU symmetric heap: every GPU of a team ("rank") holds one heap of the same size, and an
// allocation has the same offset in each, so a kernel on one GPU reaches another GPU's copy by
// pointer translation (kernels/gpu/symmetric.cuh) over NVLink/xGMI.
//
// Two forms, the same HeapView for kernels:
//  - in-process: one process drives the team's GPUs, the heaps are plain device allocations and
//    peer access is enabled between every pair, so each rank's base is the same address on
//    every GPU;
//  - across processes (join_node): each process of a node is one rank driving one GPU; each
//    allocates its heap, exports an IPC handle, the handles are exchanged through the job's
//    runtime, and each process maps its peers' heaps (their bases are addresses in this
//    process).
#pragma once

#include "kernels/gpu/heap_view.h"

#include <caravan/symmetric_heap.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace caravan::gpu {

// Remote atomics (atomic_add/exchange/cas and notify with add in symmetric.cuh) need native
// peer atomics, which NVLink/xGMI links have and PCIe peer links do not; loads, stores,
// notify(set) and stream flag operations work over either.
// Whether ranks of an in-process heap may share a GPU. `refused` is the real case: one rank per
// GPU. `allowed` is for testing the copy-engine schedules on a machine with fewer GPUs than
// ranks (a rank's heap is then another allocation on the same GPU, and its "peer" copies are
// copies within it). Only work that never spins on a peer's flag is safe there: copy engines,
// stream flag operations and cuBLAS. A kernel that waits on SMs for a peer (sm-*, tile-*, ll
// variants) can hold the SMs the peer's kernel needs and hang.
enum class DeviceSharing { refused, allowed };

class GpuSymmetricHeap {
 public:
  // Allocates `bytes_per_rank` on each of `devices` (one rank each, in that order) and enables
  // peer access between every pair. Throws Error(invalid_argument) for an empty or too long
  // device list, a device listed twice (unless `sharing` allows it), or a pair of GPUs that
  // cannot reach each other.
  GpuSymmetricHeap(std::vector<int> devices, std::uint64_t bytes_per_rank,
                   DeviceSharing sharing = DeviceSharing::refused);
  // The cross-process form, collective over every rank of the running job (each calls it once,
  // in the same order as its other collectives): this process's rank becomes rank `local_rank`
  // of its node's team, whose world is the ranks of the node. Its heap is `bytes_per_rank` on
  // `device`; a peer's is mapped through its IPC handle. Throws Error(invalid_argument) when
  // ranks of a node ask for different sizes or the same GPU, Error(device) when a handle cannot
  // be mapped (no peer path), and what the runtime's collective throws (a rank lost, ...).
  // Every failure is collective: a rank that cannot set up still takes part in the exchanges,
  // and every rank of the node throws the same error. Waits are bounded by
  // CARAVAN_OVERLAP_TIMEOUT_S.
  static std::unique_ptr<GpuSymmetricHeap> join_node(int device, std::uint64_t bytes_per_rank);
  // Cross-process: collective teardown (unmap the peers' heaps, barrier, free this rank's), as
  // CUDA wants importers to unmap before the exporter frees. Call it on every rank, with no work
  // in flight, before the heap is destroyed; the destructor alone unmaps and frees at once.
  void leave();
  ~GpuSymmetricHeap();
  GpuSymmetricHeap(const GpuSymmetricHeap&) = delete;
  GpuSymmetricHeap& operator=(const GpuSymmetricHeap&) = delete;

  int world() const { return static_cast<int>(devices_.size()); }
  // The rank this process drives in the cross-process form; -1 in-process (it drives all).
  int own_rank() const { return own_rank_; }
  int device(int rank) const { return devices_.at(static_cast<std::size_t>(rank)); }
  std::uint64_t capacity() const { return bytes_; }
  std::uint64_t used() const { return used_; }

  // The same offset on every rank, zero-filled. Throws Error(invalid_argument) when the heap is
  // full (naming the sizes) or the alignment is not a power of two.
  SymmetricRegion allocate(std::uint64_t bytes, std::uint64_t alignment = 256);

  // `rank`'s copy of `region` (a device address every GPU of the team may load and store).
  template <class T = std::byte>
  T* at(const SymmetricRegion& region, int rank) const {
    check_rank(rank, "GpuSymmetricHeap::at");
    return reinterpret_cast<T*>(bases_[static_cast<std::size_t>(rank)] + region.offset);
  }
  HeapView view(int rank) const;

  // Scoped reuse: everything allocated after mark() is released by release_to(mark) (and zeroed
  // again), e.g. between benchmark cases. The caller guarantees that nothing uses it any more.
  // Cross-process: collective (every rank calls it; barriers before and after each rank zeroes
  // its own heap).
  std::uint64_t mark() const { return used_; }
  void release_to(std::uint64_t mark);

 private:
  // Error(invalid_argument) naming `call` when `rank` is not one of the team's.
  void check_rank(int rank, const char* call) const;
  GpuSymmetricHeap() = default;
  void free_all() noexcept;

  std::vector<int> devices_;
  std::vector<char*> bases_;
  std::uint64_t bytes_ = 0;
  std::uint64_t used_ = 0;
  int own_rank_ = -1;  // cross-process: the only base this process allocated; the others are mapped
};

}  // namespace caravan::gpu
