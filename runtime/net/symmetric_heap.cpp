// caravan::SymmetricHeap: the public handle over net::HostHeap.
#include "runtime/net/host_heap.h"
#include "runtime/net/network.h"
#include "runtime/runtime_impl.h"

#include <caravan/settings.h>

#include <fmt/format.h>

namespace caravan {
namespace {

// A runtime alone creates its heap on first use (no collective is needed for one rank).
struct AloneHeap final : RuntimeService {
  explicit AloneHeap(std::uint64_t bytes) : heap(nullptr, bytes) {}
  void shutdown() override {}
  net::HostHeap heap;
};

}  // namespace

SymmetricHeap SymmetricHeap::current() {
  RuntimeImpl* rt = RuntimeImpl::current();
  if (!rt) throw Error(Errc::shut_down, "SymmetricHeap::current: no Caravan runtime is running");
  if (net::Network* network = rt->network()) {
    if (!network->heap())
      throw Error(Errc::invalid_argument, "SymmetricHeap::current: CARAVAN_SYMMETRIC_HEAP_BYTES was 0 when the job started");
    return SymmetricHeap(network->heap(), rt->events().instance());
  }
  std::uint64_t bytes = settings::get_bytes("CARAVAN_SYMMETRIC_HEAP_BYTES");
  if (bytes == 0) throw Error(Errc::invalid_argument, "SymmetricHeap::current: CARAVAN_SYMMETRIC_HEAP_BYTES is 0");
  auto& service = rt->service("symmetric-heap", [bytes] { return std::make_unique<AloneHeap>(bytes); });
  return SymmetricHeap(&static_cast<AloneHeap&>(service).heap, rt->events().instance());
}

net::HostHeap& SymmetricHeap::checked(const char* call) const {
  RuntimeImpl* rt = RuntimeImpl::current();
  if (!rt || rt->events().instance() != runtime_)
    throw Error(Errc::shut_down,
                fmt::format("SymmetricHeap::{}: the runtime this heap belongs to has shut down (take the heap of the "
                            "running one with SymmetricHeap::current())",
                            call));
  return *impl_;
}

std::uint64_t SymmetricHeap::capacity() const { return checked("capacity").capacity(); }
std::uint64_t SymmetricHeap::used() const { return checked("used").used(); }
SymmetricRegion SymmetricHeap::allocate(std::uint64_t bytes, std::uint64_t alignment) {
  return checked("allocate").allocate(bytes, alignment);
}
std::byte* SymmetricHeap::local(const SymmetricRegion& region) const { return checked("local").local(region); }
std::byte* SymmetricHeap::peer(const SymmetricRegion& region, int rank) const {
  return checked("peer").peer(region, rank);
}

void SymmetricHeap::put(const SymmetricRegion& dst, std::uint64_t offset, const void* src, std::size_t bytes, int rank) {
  checked("put").put(dst, offset, src, bytes, rank);
}

void SymmetricHeap::get(void* dst, const SymmetricRegion& src, std::uint64_t offset, std::size_t bytes, int rank) {
  checked("get").get(dst, src, offset, bytes, rank);
}

void SymmetricHeap::signal(const SymmetricRegion& signals, std::size_t index, SignalOp op, std::uint64_t value, int rank,
                           MemoryOrder order) {
  checked("signal").signal(signals, index, op, value, rank, order);
}

void SymmetricHeap::put_signal(const SymmetricRegion& dst, std::uint64_t offset, const void* src, std::size_t bytes,
                               const SymmetricRegion& signals, std::size_t index, SignalOp op, std::uint64_t value,
                               int rank) {
  net::HostHeap& heap = checked("put_signal");
  heap.put(dst, offset, src, bytes, rank);
  heap.signal(signals, index, op, value, rank, MemoryOrder::release);
}

std::uint64_t SymmetricHeap::wait_until(const SymmetricRegion& signals, std::size_t index, SignalCompare cmp,
                                        std::uint64_t value, std::optional<std::chrono::nanoseconds> timeout,
                                        MemoryOrder order) const {
  return checked("wait_until").wait_until(signals, index, cmp, value, timeout, order);
}

std::uint64_t SymmetricHeap::read(const SymmetricRegion& signals, std::size_t index, MemoryOrder order) const {
  return checked("read").read(signals, index, order);
}

void SymmetricHeap::quiet() { checked("quiet").quiet(); }
void SymmetricHeap::barrier() { checked("barrier").barrier(); }

}  // namespace caravan
