// Rma: one-sided data movement between ranks through UCX, the layer the DMA engine's `nic`
// channel drives (docs/distributed.md, "The RMA interface").
//
// REG memory is host memory registered with UCX (ucp_mem_map): allocate() lets UCX allocate it,
// which shared-memory transports can map directly (the fastest path on one host);
// register_memory() registers memory that exists (the symmetric heap, a pinned staging buffer).
// A RegisteredMemory's descriptor() (address, size, packed remote key) travels to other ranks,
// which import() it as a RemoteMemory (an unpacked remote key for their endpoint to the owner);
// exchange() does both for every rank at once (a collective).
//
// Operations are non-blocking. Each returns RmaStatus::done when it completed at once (its
// callback is then NOT called) or RmaStatus::pending, in which case the callback runs exactly
// once, with nullptr or the failure: a UCX error, or the loss of the peer (Errc::transport,
// naming it), or the runtime shutting down (Errc::shut_down). It runs on the progress thread,
// or, when the peer is lost meanwhile, on the thread that noticed (possibly before the call
// returns); it must not block. Errors known at submission (bad offsets, a peer already lost)
// throw instead.
//
// Completion means *local* completion: the source buffer of a put may be reused. Remote
// completion (the bytes are in the target's memory) needs flush(rank) to complete; fence()
// orders the operations posted after it behind those posted before it (UCX's worker fence),
// which is what a release signal after a put needs. To tell a peer "your bytes are there",
// flush to it and send a message from the flush's callback: UCX does not order active
// messages with RMA.
//
// Lifetimes: an operation keeps the memory objects it uses alive until UCX is done with them.
// Registered and remote memory must not outlive the runtime; whatever is left at shutdown is
// released then (its pointers are dangling afterwards) and its pending operations fail.
#pragma once

#include "runtime/net/worker.h"

#include <caravan/error.h>

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace caravan::net {

class Network;
class Rma;

enum class RmaStatus { done, pending };

// Called exactly once for a pending operation; `user` is passed back unchanged.
struct RmaCallback {
  void (*fn)(void* user, const FailureCause& failure) = nullptr;
  void* user = nullptr;
};

// REG: host memory registered with UCX on this rank.
class RegisteredMemory {
 public:
  ~RegisteredMemory();
  RegisteredMemory(const RegisteredMemory&) = delete;
  RegisteredMemory& operator=(const RegisteredMemory&) = delete;

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  ucp_mem_h handle() const { return memh_; }
  // This registration's number, unique in the process: two registrations of the same bytes
  // (registered, released, registered again) have different serials.
  std::uint64_t serial() const { return serial_; }
  // What import() on another rank needs: address, size, serial, packed remote key. The serial
  // makes descriptors of different registrations differ even where UCX packs the same key
  // (registering one address twice does, and over tcp so does a new allocation at a freed
  // address), so that a descriptor names one registration: a cache of imported keys keyed by
  // descriptor can never hand out the key of a registration that is gone.
  std::vector<std::byte> descriptor() const;

 private:
  friend class Rma;
  RegisteredMemory(std::shared_ptr<Rma*> owner, ucp_mem_h memh, std::byte* data, std::size_t size);
  void release();  // unmaps once (destructor or runtime shutdown)
  std::shared_ptr<Rma*> owner_;  // *owner_ is nullptr once the Rma is gone
  ucp_mem_h memh_;
  std::byte* data_;
  std::size_t size_;
  std::uint64_t serial_;
};

// Another rank's registered memory, addressable from this rank.
class RemoteMemory {
 public:
  ~RemoteMemory();
  RemoteMemory(const RemoteMemory&) = delete;
  RemoteMemory& operator=(const RemoteMemory&) = delete;

  int rank() const { return rank_; }
  std::uint64_t address() const { return address_; }
  std::size_t size() const { return size_; }
  // The owner's RegisteredMemory::serial().
  std::uint64_t serial() const { return serial_; }
  ucp_rkey_h rkey() const { return rkey_; }

 private:
  friend class Rma;
  RemoteMemory(std::shared_ptr<Rma*> owner, int rank, std::uint64_t address, std::size_t size, std::uint64_t serial,
               ucp_rkey_h rkey)
      : owner_(std::move(owner)), rank_(rank), address_(address), size_(size), serial_(serial), rkey_(rkey) {}
  void release();
  std::shared_ptr<Rma*> owner_;
  int rank_;
  std::uint64_t address_;
  std::size_t size_;
  std::uint64_t serial_;
  ucp_rkey_h rkey_;
};

using LocalMemoryRef = std::shared_ptr<RegisteredMemory>;
using RemoteMemoryRef = std::shared_ptr<RemoteMemory>;

class Rma {
 public:
  explicit Rma(Network& network);
  ~Rma();
  Rma(const Rma&) = delete;
  Rma& operator=(const Rma&) = delete;

  // REG memory. Throws Error(invalid_argument) for 0 bytes, Error(transport) if UCX refuses.
  LocalMemoryRef allocate(std::size_t bytes);
  LocalMemoryRef register_memory(void* address, std::size_t bytes);
  // The registered memory `descriptor` (from RegisteredMemory::descriptor on `rank`) describes.
  RemoteMemoryRef import(int rank, std::span<const std::byte> descriptor);
  // Collective: every rank's `mine`, by rank (this rank's own too, through its self endpoint).
  std::vector<RemoteMemoryRef> exchange(const RegisteredMemory& mine, std::string_view what);

  // Writes `bytes` from `src` to `dst` at `dst_offset`. `src_memory`, when given, is the
  // registered memory `src` lies in (zero-copy transports need it); it may be null.
  RmaStatus put(const RemoteMemoryRef& dst, std::uint64_t dst_offset, const void* src, std::size_t bytes,
                const LocalMemoryRef& src_memory, RmaCallback done);
  // Reads `bytes` of `src` at `src_offset` into `dst` (inside `dst_memory` when given).
  RmaStatus get(void* dst, const LocalMemoryRef& dst_memory, const RemoteMemoryRef& src, std::uint64_t src_offset,
                std::size_t bytes, RmaCallback done);
  // 64-bit remote atomics at an 8-byte aligned offset: add, and set (a swap whose old value is
  // dropped).
  RmaStatus atomic_add(const RemoteMemoryRef& dst, std::uint64_t offset, std::uint64_t value, RmaCallback done);
  RmaStatus atomic_set(const RemoteMemoryRef& dst, std::uint64_t offset, std::uint64_t value, RmaCallback done);
  // Operations posted after fence() complete after those posted before it (worker-wide).
  void fence();
  // Completes when every operation posted to `rank` before it has completed at `rank`.
  RmaStatus flush(int rank, RmaCallback done);

  std::size_t pending_count() const;

  // Fails every pending operation with `cause` and releases every registration and remote key
  // still alive. Called by Network::shutdown before the endpoints close.
  void shutdown(const FailureCause& cause);

 private:
  struct Op;
  friend class RegisteredMemory;
  friend class RemoteMemory;
  static void op_done(void* request, ucs_status_t status, void* user);
  // Links `op`, calls `post` (UCX), and sorts out the three possible outcomes.
  template <class Post>
  RmaStatus submit(Op* op, const char* what, Post post);
  Op* new_op(int rank, RmaCallback done, std::string_view what);
  void finish(Op* op, const FailureCause& failure);
  void peer_lost(int rank, const FailureCause& cause);
  ucp_ep_h endpoint_for(int rank, std::string_view what);
  void check_range(const RemoteMemory& remote, std::uint64_t offset, std::size_t bytes, std::string_view what) const;

  Network& network_;
  std::shared_ptr<Rma*> self_;  // handles reach the Rma through this; reset at destruction
  mutable std::mutex mutex_;
  std::vector<Op*> pending_;  // per rank: intrusive list of pending operations; guarded by mutex_
  std::size_t pending_total_ = 0;
  std::unordered_set<RegisteredMemory*> registered_;  // alive, guarded by mutex_
  std::unordered_set<RemoteMemory*> remote_;          // alive, guarded by mutex_
  bool shut_down_ = false;                            // guarded by mutex_
};

// Waits for one operation from a thread that may block (not the progress thread).
class RmaWait {
 public:
  // Throws Error(invalid_argument) on the network's progress thread, which alone completes it.
  RmaWait();
  RmaCallback callback() { return {&RmaWait::complete, this}; }
  // Returns once the operation completed; throws its failure (an Error with its code). No
  // timeout is needed: a pending operation completes, or fails when its peer is lost (within
  // CARAVAN_PEER_TIMEOUT_S) or at shutdown.
  void wait(RmaStatus status);

 private:
  static void complete(void* user, const FailureCause& failure);
  std::atomic<std::uint32_t> state_{0};  // 0 pending, 1 done
  FailureCause failure_;
};

}  // namespace caravan::net
