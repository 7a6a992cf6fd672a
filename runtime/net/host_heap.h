// HostHeap: the host symmetric heap behind caravan::SymmetricHeap (include/caravan/symmetric_heap.h).
//
// Layout: the ranks of a node share one POSIX shared-memory segment of local_world_size x
// CARAVAN_SYMMETRIC_HEAP_BYTES; the rank with local rank i owns bytes [i*P, (i+1)*P). A region
// (offset, bytes) is at base + i*P + offset in every rank's mapping, so a rank reaches its
// node's copies by pointer. With more than one node, each rank also registers its own part with
// UCX and the parts' descriptors are exchanged, so ranks of other nodes reach it by RMA.
//
// Creation (collective, during the runtime's start): the node's local rank 0 creates and sizes
// the segment; an allgather tells every rank whether that worked; the others map it; a second
// allgather confirms, after which local rank 0 unlinks the name (mappings stay valid; nothing
// is left in /dev/shm however the job ends). A runtime alone maps an anonymous shared region.
//
// Allocation is a bump pointer that every rank advances identically (collective calls in the
// same order); an allgather checks that the ranks agree before anyone uses the region. Memory is
// never reused, and fresh shared memory is zero, so regions start zeroed with no extra pass.
#pragma once

#include "runtime/net/rma.h"

#include <caravan/symmetric_heap.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace caravan {
class RuntimeImpl;
}

namespace caravan::net {

class Network;

// The name (in /dev/shm, without its leading '/') that node segments of job `job_id` start
// with; a node's is this followed by its number. `caravan run` removes what a killed job left.
std::string heap_segment_prefix(std::string_view job_id);

class HostHeap {
 public:
  // `network` null: a runtime alone. Collective otherwise.
  HostHeap(Network* network, std::uint64_t bytes_per_rank);
  ~HostHeap();
  HostHeap(const HostHeap&) = delete;
  HostHeap& operator=(const HostHeap&) = delete;

  std::uint64_t capacity() const { return part_bytes_; }
  std::uint64_t used() const;
  SymmetricRegion allocate(std::uint64_t bytes, std::uint64_t alignment);
  std::byte* local(const SymmetricRegion& region) const;
  std::byte* peer(const SymmetricRegion& region, int rank) const;
  void put(const SymmetricRegion& dst, std::uint64_t offset, const void* src, std::size_t bytes, int rank);
  void get(void* dst, const SymmetricRegion& src, std::uint64_t offset, std::size_t bytes, int rank);
  void signal(const SymmetricRegion& signals, std::size_t index, SignalOp op, std::uint64_t value, int rank,
              MemoryOrder order);
  std::uint64_t wait_until(const SymmetricRegion& signals, std::size_t index, SignalCompare cmp, std::uint64_t value,
                           std::optional<std::chrono::nanoseconds> timeout, MemoryOrder order) const;
  std::uint64_t read(const SymmetricRegion& signals, std::size_t index, MemoryOrder order) const;
  void quiet();
  void barrier();

  // Drops the UCX registrations (before UCX goes away); the mapping stays until destruction.
  void release_registrations();

 private:
  void check_region(const SymmetricRegion& region, std::uint64_t offset, std::size_t bytes, std::string_view what) const;
  void check_rank(int rank, std::string_view what) const;
  std::uint64_t* word(const SymmetricRegion& signals, std::size_t index, int rank, std::string_view what) const;
  std::uint64_t part_offset(int rank) const { return static_cast<std::uint64_t>(local_index_[static_cast<std::size_t>(rank)]) * part_bytes_; }

  Network* network_;
  int rank_ = 0;
  int world_size_ = 1;
  std::uint64_t part_bytes_;
  std::byte* base_ = nullptr;   // the node's segment
  std::size_t mapped_bytes_ = 0;
  std::vector<int> local_index_;           // rank -> its part's index in this node's segment, or -1
  // rank -> its part, for ranks of other nodes (guarded by remote_mutex_: shutdown releases them
  // while other threads may still call put/get/signal, which then fail with Errc::shut_down).
  std::vector<RemoteMemoryRef> remote_;
  mutable std::mutex remote_mutex_;
  RemoteMemoryRef remote_part(int rank, std::string_view what) const;
  LocalMemoryRef registration_;            // this rank's part, registered with UCX
  std::unique_ptr<std::atomic<bool>[]> dirty_;  // rank -> RMA issued since the last quiet()
  mutable std::mutex mutex_;
  std::uint64_t next_offset_ = 0;          // guarded by mutex_
  std::mutex allocate_mutex_;              // held for the whole of allocate()
  // Marks allocate()'s part of its collective, so that a rank that made another collective call
  // at the same point (and sent other bytes) is named instead of misread.
  static constexpr std::uint64_t kAllocateTag = 0x43524148'45415041ull;
};

}  // namespace caravan::net
