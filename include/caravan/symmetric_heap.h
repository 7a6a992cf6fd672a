// The host symmetric heap: memory that every rank allocates together, at the same offset, and
// that ranks reach with put/get and 64-bit signal (flag) operations.
//
// Each rank owns one part of CARAVAN_SYMMETRIC_HEAP_BYTES. The ranks of a node map one POSIX
// shared-memory segment holding all their parts, so a rank reaches the parts of its node's
// ranks with plain loads, stores and atomics (peer() gives the pointer); parts on other nodes
// are reached through UCX (put/get, and UCX atomics for signals). The same calls work for both.
//
// Ordering (the memory model of C++ atomics, extended across ranks):
//  - signal(..., release) makes every put and store this rank issued before it visible to
//    whoever observes the signal's new value with an acquire wait_until() or read(). Same
//    node: a release store / fetch_add on the shared word. Other node: a release fence, then
//    UCX's worker fence (earlier puts complete at the target first), then a UCX atomic.
//  - wait_until(..., acquire) and read(..., acquire) make what was released visible.
//  - relaxed orders nothing but the signal word itself. seq_cst on a signal also waits until
//    the signal is done at its target before returning.
//  - quiet(): every put and signal this rank issued has completed at its target.
#pragma once

#include <caravan/error.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <type_traits>

namespace caravan {

namespace net {
class HostHeap;
}

// A region of the symmetric heap: the same offset and size on every rank. A plain value: pass
// it to other ranks in task arguments, or use it on every rank after a collective allocate().
struct SymmetricRegion {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  friend constexpr bool operator==(const SymmetricRegion&, const SymmetricRegion&) = default;
};
static_assert(std::is_trivially_copyable_v<SymmetricRegion>);

enum class MemoryOrder { relaxed, acquire, release, acq_rel, seq_cst };
enum class SignalOp { set, add };
enum class SignalCompare { eq, ne, ge, gt, le, lt };

class SymmetricHeap {
 public:
  // The heap of the running runtime (one rank alone has one too). Throws Error(shut_down)
  // without a runtime and Error(invalid_argument) if CARAVAN_SYMMETRIC_HEAP_BYTES is 0.
  static SymmetricHeap current();

  // Bytes of each rank's part.
  std::uint64_t capacity() const;
  std::uint64_t used() const;

  // Collective: every rank calls it with the same arguments, in the same order. The region is
  // zero on every rank (fresh heap memory is never reused) and can be used as soon as the call
  // returns on this rank. Throws Error(invalid_argument) when the heap is full, the alignment
  // is not a power of two, or ranks asked for different things.
  SymmetricRegion allocate(std::uint64_t bytes, std::uint64_t alignment = 64);
  // `count` signal words (8 bytes each), zero.
  SymmetricRegion allocate_signals(std::size_t count) {
    // 8 * count must not wrap to a small size (allocate refuses a size past the heap).
    return allocate(count > (~std::uint64_t{0}) / 8 ? ~std::uint64_t{0} : 8 * static_cast<std::uint64_t>(count), 64);
  }

  // This rank's copy of `region`.
  std::byte* local(const SymmetricRegion& region) const;
  // `rank`'s copy, when `rank` is on this node (load/store it directly); nullptr otherwise.
  std::byte* peer(const SymmetricRegion& region, int rank) const;

  // Copies `bytes` from `src` into `rank`'s copy of `dst` at `offset`; returns when `src` may be
  // reused. Ordered before a later release signal to any rank; complete at `rank` after quiet().
  void put(const SymmetricRegion& dst, std::uint64_t offset, const void* src, std::size_t bytes, int rank);
  // Copies `bytes` of `rank`'s copy of `src` at `offset` into `dst`; returns when they are there.
  void get(void* dst, const SymmetricRegion& src, std::uint64_t offset, std::size_t bytes, int rank);

  // Sets or adds to signal word `index` of `signals` in `rank`'s copy.
  // Throws Error(invalid_argument) for `acquire` (a signal writes; waits acquire).
  void signal(const SymmetricRegion& signals, std::size_t index, SignalOp op, std::uint64_t value, int rank,
              MemoryOrder order = MemoryOrder::release);
  // put() then a release signal(): the signal's observer also sees the data.
  void put_signal(const SymmetricRegion& dst, std::uint64_t offset, const void* src, std::size_t bytes,
                  const SymmetricRegion& signals, std::size_t index, SignalOp op, std::uint64_t value, int rank);

  // Waits until this rank's signal word `index` compares `cmp` with `value`; returns the word.
  // Throws Error(timeout) after `timeout`, Error(transport) naming the rank when a rank of the
  // job fails meanwhile (a writer may be gone), and Error(shut_down) once this rank's runtime is
  // shutting down (a task waiting here would otherwise hold the shutdown up). Orders: acquire
  // (default) or relaxed. A writer that shut down normally is not noticed: give a timeout where
  // that can happen.
  std::uint64_t wait_until(const SymmetricRegion& signals, std::size_t index, SignalCompare cmp, std::uint64_t value,
                           std::optional<std::chrono::nanoseconds> timeout = std::nullopt,
                           MemoryOrder order = MemoryOrder::acquire) const;
  // This rank's signal word `index` now.
  std::uint64_t read(const SymmetricRegion& signals, std::size_t index, MemoryOrder order = MemoryOrder::acquire) const;

  // Every put and signal this rank issued has completed at its target.
  void quiet();
  // quiet(), then a barrier of all ranks.
  void barrier();

 private:
  SymmetricHeap(net::HostHeap* impl, std::uint16_t runtime) : impl_(impl), runtime_(runtime) {}
  // The heap, if the runtime it belongs to still runs; else Error(shut_down) (the heap went with it).
  net::HostHeap& checked(const char* call) const;
  net::HostHeap* impl_;
  std::uint16_t runtime_;  // the runtime's instance number (Event::runtime_instance)
};

}  // namespace caravan
