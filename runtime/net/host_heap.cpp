#include "runtime/net/host_heap.h"
#include "runtime/deadline.h"

#include "runtime/cpu_relax.h"
#include "runtime/log.h"
#include "runtime/net/network.h"
#include "runtime/runtime_impl.h"

#include <caravan/settings.h>

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <limits>
#include <string>
#include <vector>
#include <cerrno>
#include <cstring>
#include <thread>

namespace caravan::net {
namespace {

using Clock = std::chrono::steady_clock;

std::uint64_t round_up(std::uint64_t value, std::uint64_t to) { return (value + to - 1) / to * to; }

// Every rank's error text (empty: fine), as one message; empty when every rank is fine. A
// collective, so that all ranks give up together instead of some waiting for the others.
std::string gather_errors(Network& network, const std::string& mine, std::string_view what) {
  auto parts = network.allgather(std::as_bytes(std::span<const char>(mine.data(), mine.size())), std::nullopt, what);
  std::string all;
  for (std::size_t r = 0; r < parts.size(); ++r) {
    if (parts[r].empty()) continue;
    if (!all.empty()) all += "; ";
    all += fmt::format("rank {}: {}", r, std::string(reinterpret_cast<const char*>(parts[r].data()), parts[r].size()));
  }
  return all;
}

bool compare(std::uint64_t word, SignalCompare cmp, std::uint64_t value) {
  switch (cmp) {
    case SignalCompare::eq: return word == value;
    case SignalCompare::ne: return word != value;
    case SignalCompare::ge: return word >= value;
    case SignalCompare::gt: return word > value;
    case SignalCompare::le: return word <= value;
    case SignalCompare::lt: return word < value;
  }
  return false;
}

const char* compare_name(SignalCompare cmp) {
  switch (cmp) {
    case SignalCompare::eq: return "==";
    case SignalCompare::ne: return "!=";
    case SignalCompare::ge: return ">=";
    case SignalCompare::gt: return ">";
    case SignalCompare::le: return "<=";
    case SignalCompare::lt: return "<";
  }
  return "?";
}

}  // namespace

std::string heap_segment_prefix(std::string_view job_id) { return fmt::format("caravan-{}-node", job_id); }

HostHeap::HostHeap(Network* network, std::uint64_t bytes_per_rank)
    : network_(network), part_bytes_(round_up(bytes_per_rank, 4096)) {
  if (!network_) {
    // One rank alone: an anonymous shared mapping (no name to clean up, no collective).
    local_index_ = {0};
    mapped_bytes_ = part_bytes_;
    void* base = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED)
      throw Error(Errc::invalid_argument, fmt::format("symmetric heap: cannot map {} bytes (CARAVAN_SYMMETRIC_HEAP_BYTES): {}",
                                                      mapped_bytes_, std::strerror(errno)));
    base_ = static_cast<std::byte*>(base);
    dirty_ = std::make_unique<std::atomic<bool>[]>(1);
    return;
  }
  rank_ = network_->rank();
  world_size_ = network_->world_size();
  const auto& ranks = network_->ranks();
  const RankInfo& me = ranks[static_cast<std::size_t>(rank_)];
  int local_count = 0;
  for (const RankInfo& info : ranks) {
    local_index_.push_back(info.node == me.node ? info.local_rank : -1);
    if (info.node == me.node) ++local_count;
  }
  dirty_ = std::make_unique<std::atomic<bool>[]>(static_cast<std::size_t>(world_size_));
  mapped_bytes_ = part_bytes_ * static_cast<std::uint64_t>(local_count);
  const std::string name = fmt::format("/{}{}", heap_segment_prefix(network_->job_id()), me.node);
  const bool creator = me.local_rank == 0;

  std::string error;
  int fd = -1;
  bool named = false;  // this rank created the name and has not unlinked it yet
  // A collective below may throw (a peer failed during start-up): nothing may stay behind then,
  // neither the descriptor, nor the name in /dev/shm, nor the mapping (the destructor never runs).
  const auto undo = [&] {
    if (fd >= 0) close(fd);
    if (named) shm_unlink(name.c_str());
    if (base_) munmap(base_, mapped_bytes_);
    base_ = nullptr;
    registration_.reset();
    remote_.clear();
  };
  try {
    if (creator) {
      fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      named = fd >= 0;
      struct statvfs fs {};
      if (fd < 0) {
        error = fmt::format("shm_open({}) failed: {}", name, std::strerror(errno));
      } else if (ftruncate(fd, static_cast<off_t>(mapped_bytes_)) != 0) {
        error = fmt::format("sizing {} to {} bytes failed: {}", name, mapped_bytes_, std::strerror(errno));
      } else if (fstatvfs(fd, &fs) == 0 && static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize < mapped_bytes_) {
        // The segment is sparse: a node whose /dev/shm is too small would crash (SIGBUS) only
        // when the heap fills up. Say so now instead.
        error = fmt::format(
            "the node's heap needs {} bytes ({} ranks x CARAVAN_SYMMETRIC_HEAP_BYTES) but /dev/shm has "
            "{} free; lower CARAVAN_SYMMETRIC_HEAP_BYTES or enlarge /dev/shm",
            mapped_bytes_, local_count, static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize);
      }
    }
    std::string all = gather_errors(*network_, error, "symmetric heap: create");
    if (all.empty() && !creator) {
      fd = shm_open(name.c_str(), O_RDWR, 0);
      if (fd < 0) error = fmt::format("shm_open({}) failed: {}", name, std::strerror(errno));
    }
    if (all.empty() && error.empty()) {
      void* base = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (base == MAP_FAILED)
        error = fmt::format("mapping {} failed: {}", name, std::strerror(errno));
      else
        base_ = static_cast<std::byte*>(base);
    }
    if (fd >= 0) close(fd);
    fd = -1;
    if (all.empty()) all = gather_errors(*network_, error, "symmetric heap: map");
    // Every rank of the node has mapped the segment (or given up): the name can go.
    if (named) shm_unlink(name.c_str());
    named = false;
    if (!all.empty()) throw Error(Errc::transport, "symmetric heap: " + all);
    if (network_->node_count() > 1) {
      registration_ = network_->rma().register_memory(base_ + part_offset(rank_), part_bytes_);
      remote_ = network_->rma().exchange(*registration_, "symmetric heap: exchange keys");
      for (int r = 0; r < world_size_; ++r)
        if (local_index_[static_cast<std::size_t>(r)] >= 0) remote_[static_cast<std::size_t>(r)].reset();
    }
  } catch (...) {
    undo();
    throw;
  }
}

HostHeap::~HostHeap() {
  release_registrations();
  if (base_) munmap(base_, mapped_bytes_);
}

void HostHeap::release_registrations() {
  std::vector<RemoteMemoryRef> released;
  {
    std::lock_guard lock(remote_mutex_);
    for (auto& r : remote_) released.push_back(std::exchange(r, nullptr));  // keeps the size: see remote_part
  }
  released.clear();
  registration_.reset();
}

RemoteMemoryRef HostHeap::remote_part(int rank, std::string_view what) const {
  std::lock_guard lock(remote_mutex_);
  RemoteMemoryRef part = remote_.at(static_cast<std::size_t>(rank));
  if (!part)
    throw Error(
        Errc::shut_down,
        fmt::format("{}: rank {}'s part of the heap is released: this rank's runtime is shutting down", what, rank));
  return part;
}

std::uint64_t HostHeap::used() const {
  std::lock_guard lock(mutex_);
  return next_offset_;
}

SymmetricRegion HostHeap::allocate(std::uint64_t bytes, std::uint64_t alignment) {
  // One allocation at a time on this rank: two threads allocating at once would both read the
  // same next offset and get the same region.
  std::lock_guard serial(allocate_mutex_);
  std::string refused;
  if (bytes == 0)
    refused = "SymmetricHeap::allocate: bytes must be at least 1";
  else if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    refused = fmt::format("SymmetricHeap::allocate: alignment {} is not a power of two", alignment);
  if (!refused.empty() && !network_) throw Error(Errc::invalid_argument, refused);
  std::uint64_t offset = 0;
  if (refused.empty()) {
    std::lock_guard lock(mutex_);
    offset = round_up(next_offset_, alignment);
  }
  if (network_) {
    // The ranks must agree before anyone uses the region; a mismatch is a program error that
    // would otherwise corrupt the other ranks' data silently. A rank whose own arguments are bad
    // still takes part (saying so), so that its peers fail with it instead of waiting for it.
    struct Ask {
      std::uint64_t tag, offset, bytes, alignment, refused;
    } mine{kAllocateTag, offset, bytes, alignment, refused.empty() ? 0u : 1u};
    auto parts = network_->allgather(std::as_bytes(std::span<const Ask, 1>(&mine, 1)), std::nullopt,
                                     "SymmetricHeap::allocate");
    if (!refused.empty()) throw Error(Errc::invalid_argument, refused);
    std::vector<Ask> asks(parts.size());
    for (std::size_t r = 0; r < parts.size(); ++r) {
      if (parts[r].size() == sizeof(Ask)) std::memcpy(&asks[r], parts[r].data(), sizeof(Ask));
      if (parts[r].size() != sizeof(Ask) || asks[r].tag != kAllocateTag)
        throw Error(Errc::invalid_argument,
                    fmt::format("SymmetricHeap::allocate: rank {} called another collective (barrier, a heap "
                                "creation...) at this point; every rank must make the same calls in the same order",
                                r));
      if (asks[r].refused)
        throw Error(Errc::invalid_argument,
                    fmt::format("SymmetricHeap::allocate: rank {} gave bad arguments ({} bytes aligned to {}); every "
                                "rank must allocate the same, in the same order",
                                r, asks[r].bytes, asks[r].alignment));
    }
    const Ask& first = asks[0];
    for (std::size_t r = 1; r < parts.size(); ++r) {
      const Ask& other = asks[r];
      if (other.offset != first.offset || other.bytes != first.bytes || other.alignment != first.alignment)
        throw Error(Errc::invalid_argument,
                    fmt::format("SymmetricHeap::allocate: rank {} asked for {} bytes aligned to {} at offset {}, but rank 0 "
                                "for {} bytes aligned to {} at offset {} (every rank must allocate the same, in the same order)",
                                r, other.bytes, other.alignment, other.offset, first.bytes, first.alignment, first.offset));
    }
  }
  if (offset > part_bytes_ || bytes > part_bytes_ - offset)
    throw Error(Errc::invalid_argument,
                fmt::format("SymmetricHeap::allocate: {} bytes do not fit; {} of CARAVAN_SYMMETRIC_HEAP_BYTES = {} are left",
                            bytes, offset > part_bytes_ ? 0 : part_bytes_ - offset, part_bytes_));
  std::lock_guard lock(mutex_);
  next_offset_ = offset + bytes;
  return SymmetricRegion{offset, bytes};
}

void HostHeap::check_rank(int rank, std::string_view what) const {
  if (rank < 0 || rank >= world_size_)
    throw Error(Errc::invalid_argument, fmt::format("{}: rank {} is outside [0, {})", what, rank, world_size_));
}

void HostHeap::check_region(const SymmetricRegion& region, std::uint64_t offset, std::size_t bytes,
                            std::string_view what) const {
  if (region.offset > part_bytes_ || region.bytes > part_bytes_ - region.offset)
    throw Error(Errc::invalid_argument, fmt::format("{}: region [{}, +{}) is not in this heap of {} bytes", what,
                                                    region.offset, region.bytes, part_bytes_));
  if (offset > region.bytes || bytes > region.bytes - offset)
    throw Error(Errc::invalid_argument, fmt::format("{}: bytes [{}, {}) are outside the region of {} bytes", what, offset,
                                                    offset + bytes, region.bytes));
}

std::byte* HostHeap::local(const SymmetricRegion& region) const {
  check_region(region, 0, 0, "SymmetricHeap::local");
  return base_ + part_offset(rank_) + region.offset;
}

std::byte* HostHeap::peer(const SymmetricRegion& region, int rank) const {
  check_rank(rank, "SymmetricHeap::peer");
  check_region(region, 0, 0, "SymmetricHeap::peer");
  if (local_index_[static_cast<std::size_t>(rank)] < 0) return nullptr;
  return base_ + part_offset(rank) + region.offset;
}

void HostHeap::put(const SymmetricRegion& dst, std::uint64_t offset, const void* src, std::size_t bytes, int rank) {
  check_rank(rank, "SymmetricHeap::put");
  check_region(dst, offset, bytes, "SymmetricHeap::put");
  if (bytes == 0) return;
  if (!src)
    throw Error(Errc::invalid_argument, fmt::format("SymmetricHeap::put: src is null ({} bytes to put)", bytes));
  if (std::byte* target = peer(dst, rank)) {
    std::memcpy(target + offset, src, bytes);  // plain stores; a release signal publishes them
    return;
  }
  RmaWait wait;
  dirty_[static_cast<std::size_t>(rank)].store(true, std::memory_order_relaxed);
  const RemoteMemoryRef target = remote_part(rank, "SymmetricHeap::put");
  wait.wait(network_->rma().put(target, dst.offset + offset, src, bytes, nullptr, wait.callback()));
}

void HostHeap::get(void* dst, const SymmetricRegion& src, std::uint64_t offset, std::size_t bytes, int rank) {
  check_rank(rank, "SymmetricHeap::get");
  check_region(src, offset, bytes, "SymmetricHeap::get");
  if (bytes == 0) return;
  if (!dst)
    throw Error(Errc::invalid_argument, fmt::format("SymmetricHeap::get: dst is null ({} bytes to get)", bytes));
  if (const std::byte* source = peer(src, rank)) {
    std::memcpy(dst, source + offset, bytes);
    return;
  }
  RmaWait wait;
  const RemoteMemoryRef source = remote_part(rank, "SymmetricHeap::get");
  wait.wait(network_->rma().get(dst, nullptr, source, src.offset + offset, bytes, wait.callback()));
}

std::uint64_t* HostHeap::word(const SymmetricRegion& signals, std::size_t index, int rank, std::string_view what) const {
  check_rank(rank, what);
  if (index > (std::numeric_limits<std::uint64_t>::max() - 8) / 8)
    throw Error(Errc::invalid_argument, fmt::format("{}: signal index {} is past any region", what, index));
  check_region(signals, 8 * static_cast<std::uint64_t>(index), 8, what);
  if (signals.offset % 8 != 0)
    throw Error(Errc::invalid_argument, fmt::format("{}: signal words must be 8-byte aligned (region offset {})", what, signals.offset));
  std::byte* copy = peer(signals, rank);
  return copy ? reinterpret_cast<std::uint64_t*>(copy + 8 * index) : nullptr;
}

void HostHeap::signal(const SymmetricRegion& signals, std::size_t index, SignalOp op, std::uint64_t value, int rank,
                      MemoryOrder order) {
  if (order == MemoryOrder::acquire)
    throw Error(Errc::invalid_argument, "SymmetricHeap::signal: acquire ordering belongs to waits (use release)");
  if (std::uint64_t* target = word(signals, index, rank, "SymmetricHeap::signal")) {
    // Same node: an atomic on the shared word. Lock-free 64-bit atomics are address-free, so
    // they synchronise processes that map the same memory as they do threads.
    std::atomic_ref<std::uint64_t> shared(*target);
    std::memory_order mo = order == MemoryOrder::relaxed   ? std::memory_order_relaxed
                           : order == MemoryOrder::release ? std::memory_order_release
                           : order == MemoryOrder::acq_rel ? std::memory_order_acq_rel
                                                           : std::memory_order_seq_cst;
    if (op == SignalOp::add) shared.fetch_add(value, mo);
    else shared.store(value, mo == std::memory_order_acq_rel ? std::memory_order_release : mo);
    return;
  }
  // Other node. Release: our own earlier stores first (a peer may get() them after seeing the
  // signal), then UCX's fence, so that earlier puts complete at their targets before the
  // atomic; then the atomic itself.
  Rma& rma = network_->rma();
  if (order != MemoryOrder::relaxed) {
    std::atomic_thread_fence(std::memory_order_release);
    rma.fence();
  }
  const RemoteMemoryRef target = remote_part(rank, "SymmetricHeap::signal");
  std::uint64_t at = signals.offset + 8 * static_cast<std::uint64_t>(index);
  dirty_[static_cast<std::size_t>(rank)].store(true, std::memory_order_relaxed);
  RmaWait wait;
  wait.wait(op == SignalOp::add ? rma.atomic_add(target, at, value, wait.callback())
                                : rma.atomic_set(target, at, value, wait.callback()));
  if (order == MemoryOrder::seq_cst) {
    RmaWait flushed;
    flushed.wait(rma.flush(rank, flushed.callback()));
  }
}

std::uint64_t HostHeap::read(const SymmetricRegion& signals, std::size_t index, MemoryOrder order) const {
  if (order != MemoryOrder::relaxed && order != MemoryOrder::acquire && order != MemoryOrder::seq_cst)
    throw Error(Errc::invalid_argument, "SymmetricHeap::read: a read orders relaxed, acquire or seq_cst");
  std::uint64_t* own = word(signals, index, rank_, "SymmetricHeap::read");
  return std::atomic_ref<std::uint64_t>(*own).load(order == MemoryOrder::relaxed ? std::memory_order_relaxed
                                                   : order == MemoryOrder::acquire ? std::memory_order_acquire
                                                                                   : std::memory_order_seq_cst);
}

std::uint64_t HostHeap::wait_until(const SymmetricRegion& signals, std::size_t index, SignalCompare cmp,
                                   std::uint64_t value, std::optional<std::chrono::nanoseconds> timeout,
                                   MemoryOrder order) const {
  if (order != MemoryOrder::relaxed && order != MemoryOrder::acquire)
    throw Error(Errc::invalid_argument, "SymmetricHeap::wait_until: a wait orders relaxed or acquire");
  std::atomic_ref<std::uint64_t> own(*word(signals, index, rank_, "SymmetricHeap::wait_until"));
  const std::memory_order mo = order == MemoryOrder::relaxed ? std::memory_order_relaxed : std::memory_order_acquire;
  // Spin first (a flag that flips within microseconds costs no syscall), then back off to
  // short sleeps so that a long wait leaves the core to the rank's other threads. Every few
  // hundred microseconds: the deadline, whether this rank's runtime is shutting down, and whether
  // a rank of the job has failed (the writer may be gone; this wait must not outlive it).
  auto start = Clock::now();
  auto deadline = timeout ? detail::deadline_after<Clock>(*timeout, start) : Clock::time_point::max();
  auto sleep = std::chrono::microseconds(1);
  for (unsigned i = 0;; ++i) {
    std::uint64_t word = own.load(mo);
    if (compare(word, cmp, value)) return word;
    if (i < 2000) {
      cpu_relax();
      continue;
    }
    if (i % 16 == 0) {
      auto now = Clock::now();
      if (now >= deadline)
        throw Error(Errc::timeout, fmt::format("SymmetricHeap::wait_until: signal {} is {}, still not {} {} after {:.3f} s",
                                               index, word, compare_name(cmp), value,
                                               std::chrono::duration<double>(now - start).count()));
      // This rank shutting down: nothing will be delivered now, and a task waiting here would hold
      // up the shutdown (which waits for task bodies blocked anywhere but Event::wait).
      if (const RuntimeImpl* rt = RuntimeImpl::current(); rt && !rt->accepting_work())
        throw Error(Errc::shut_down, fmt::format("SymmetricHeap::wait_until: signal {} is {}, waiting for {} {}: the "
                                                 "runtime is shutting down",
                                                 index, word, compare_name(cmp), value));
      if (network_) {
        if (FailureCause failure = network_->any_failure())
          throw Error(Errc::transport, fmt::format("SymmetricHeap::wait_until: signal {} is {}, waiting for {} {}: {}", index,
                                                   word, compare_name(cmp), value, failure->what()));
      }
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::microseconds(100));
  }
}

void HostHeap::quiet() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!network_) return;
  for (int r = 0; r < world_size_; ++r) {
    if (!dirty_[static_cast<std::size_t>(r)].exchange(false, std::memory_order_relaxed)) continue;
    RmaWait wait;
    wait.wait(network_->rma().flush(r, wait.callback()));
  }
}

void HostHeap::barrier() {
  quiet();
  if (network_) network_->barrier(std::nullopt);
}

}  // namespace caravan::net
