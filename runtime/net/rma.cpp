#include "runtime/net/rma.h"

#include "runtime/host_memory.h"
#include "runtime/event_table.h"
#include "runtime/log.h"
#include "runtime/net/network.h"
#include "runtime/net/ucx.h"
#include "runtime/net/wire.h"

#include <fmt/format.h>

namespace caravan::net {

// One pending operation. It is linked in its rank's list from submission until it finishes
// (by UCX's callback, the peer's loss or shutdown: whichever comes first runs the user's
// callback, the `finished` flag decides); it is freed by UCX's callback only, since UCX may
// still use the memory the operation holds on to after a loss has been reported.
struct Rma::Op {
  Rma* rma = nullptr;
  int rank = -1;
  RmaCallback done;
  bool finished = false;  // guarded by rma->mutex_
  Op* prev = nullptr;
  Op* next = nullptr;
  std::uint64_t operand = 0;  // atomics read their operand from here
  std::uint64_t reply = 0;    // and a swap writes the old value here
  LocalMemoryRef local;       // kept alive while UCX may touch them
  RemoteMemoryRef remote;
  const char* what = "";
};

// --- memory handles ---

namespace {
std::atomic<std::uint64_t> g_next_serial{0};
}

RegisteredMemory::RegisteredMemory(std::shared_ptr<Rma*> owner, ucp_mem_h memh, std::byte* data, std::size_t size)
    : owner_(std::move(owner)), memh_(memh), data_(data), size_(size),
      serial_(g_next_serial.fetch_add(1, std::memory_order_relaxed) + 1) {}

RegisteredMemory::~RegisteredMemory() { release(); }

void RegisteredMemory::release() {
  Rma* rma = owner_ ? *owner_ : nullptr;
  if (!rma) return;
  ucp_mem_h memh = nullptr;
  {
    std::lock_guard lock(rma->mutex_);
    std::swap(memh, memh_);
    rma->registered_.erase(this);
  }
  if (!memh) return;
  ucs_status_t status = ucp_mem_unmap(rma->network_.worker().context(), memh);
  if (status != UCS_OK) log::get("net")->warn("ucp_mem_unmap failed: {}", ucs_status_name(status));
}

std::vector<std::byte> RegisteredMemory::descriptor() const {
  Rma* rma = owner_ ? *owner_ : nullptr;
  if (!rma || !memh_) throw Error(Errc::shut_down, "RegisteredMemory::descriptor: the runtime has shut down");
  void* packed = nullptr;
  std::size_t packed_size = 0;
  CARAVAN_UCX_CHECK(ucp_rkey_pack(rma->network_.worker().context(), memh_, &packed, &packed_size));
  WireWriter out;
  out.put(reinterpret_cast<std::uint64_t>(data_)).put(static_cast<std::uint64_t>(size_)).put(serial_);
  out.put_bytes(std::span<const std::byte>(static_cast<const std::byte*>(packed), packed_size));
  ucp_rkey_buffer_release(packed);
  return out.take();
}

RemoteMemory::~RemoteMemory() { release(); }

void RemoteMemory::release() {
  Rma* rma = owner_ ? *owner_ : nullptr;
  if (!rma) return;
  ucp_rkey_h rkey = nullptr;
  {
    std::lock_guard lock(rma->mutex_);
    std::swap(rkey, rkey_);
    rma->remote_.erase(this);
  }
  if (rkey) ucp_rkey_destroy(rkey);
}

// --- Rma ---

Rma::Rma(Network& network)
    : network_(network), self_(std::make_shared<Rma*>(this)), pending_(static_cast<std::size_t>(network.world_size()), nullptr) {
  network_.add_peer_lost_listener([this](int rank, const FailureCause& cause) { peer_lost(rank, cause); });
}

Rma::~Rma() {
  shutdown(make_failure(Errc::shut_down, "the runtime shut down"));
  *self_ = nullptr;
}

LocalMemoryRef Rma::allocate(std::size_t bytes) {
  if (bytes == 0) throw Error(Errc::invalid_argument, "Rma::allocate: bytes must be at least 1");
  detail::require_host_bytes(bytes, "Rma::allocate (registered host memory)");
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  CARAVAN_UCX_CHECK(ucp_mem_map(network_.worker().context(), &params, &memh));
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  ucs_status_t status = ucp_mem_query(memh, &attr);
  if (status != UCS_OK) {
    ucp_mem_unmap(network_.worker().context(), memh);
    CARAVAN_UCX_CHECK(status);
  }
  LocalMemoryRef memory(new RegisteredMemory(self_, memh, static_cast<std::byte*>(attr.address), bytes));
  std::lock_guard lock(mutex_);
  registered_.insert(memory.get());
  return memory;
}

LocalMemoryRef Rma::register_memory(void* address, std::size_t bytes) {
  if (!address || bytes == 0)
    throw Error(Errc::invalid_argument, "Rma::register_memory: address must not be null and bytes at least 1");
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = address;
  params.length = bytes;
  ucp_mem_h memh = nullptr;
  CARAVAN_UCX_CHECK(ucp_mem_map(network_.worker().context(), &params, &memh));
  LocalMemoryRef memory(new RegisteredMemory(self_, memh, static_cast<std::byte*>(address), bytes));
  std::lock_guard lock(mutex_);
  registered_.insert(memory.get());
  return memory;
}

ucp_ep_h Rma::endpoint_for(int rank, std::string_view what) {
  if (rank < 0 || rank >= network_.world_size())
    throw Error(Errc::invalid_argument, fmt::format("{}: rank {} is outside [0, {})", what, rank, network_.world_size()));
  if (network_.peer_state(rank) == PeerState::failed) network_.require_alive(rank, what);
  return network_.worker().endpoint(rank);
}

RemoteMemoryRef Rma::import(int rank, std::span<const std::byte> descriptor) {
  ucp_ep_h ep = endpoint_for(rank, "Rma::import");
  WireReader in(descriptor, fmt::format("memory descriptor of rank {}", rank));
  auto address = in.get<std::uint64_t>();
  auto size = in.get<std::uint64_t>();
  auto serial = in.get<std::uint64_t>();
  auto packed = in.get_bytes();
  in.expect_end();
  ucp_rkey_h rkey = nullptr;
  CARAVAN_UCX_CHECK(ucp_ep_rkey_unpack(ep, packed.data(), &rkey));
  RemoteMemoryRef remote(new RemoteMemory(self_, rank, address, size, serial, rkey));
  std::lock_guard lock(mutex_);
  remote_.insert(remote.get());
  return remote;
}

std::vector<RemoteMemoryRef> Rma::exchange(const RegisteredMemory& mine, std::string_view what) {
  auto parts = network_.allgather(mine.descriptor(), std::nullopt, what);
  std::vector<RemoteMemoryRef> out;
  for (int r = 0; r < static_cast<int>(parts.size()); ++r) out.push_back(import(r, parts[static_cast<std::size_t>(r)]));
  return out;
}

void Rma::check_range(const RemoteMemory& remote, std::uint64_t offset, std::size_t bytes, std::string_view what) const {
  if (!remote.rkey_)
    throw Error(Errc::shut_down, fmt::format("{}: the remote memory of rank {} was released at shutdown", what, remote.rank_));
  if (offset > remote.size_ || bytes > remote.size_ - offset)
    throw Error(Errc::invalid_argument, fmt::format("{}: bytes [{}, {}) are outside rank {}'s registered memory of {} bytes",
                                                    what, offset, offset + bytes, remote.rank_, remote.size_));
}

Rma::Op* Rma::new_op(int rank, RmaCallback done, std::string_view what) {
  if (!done.fn) throw Error(Errc::invalid_argument, fmt::format("{}: the completion callback is empty", what));
  auto* op = new Op;
  op->rma = this;
  op->rank = rank;
  op->done = done;
  return op;
}

// Never call UCX with mutex_ held: op_done takes mutex_ inside ucp_worker_progress, which holds
// UCX's worker lock (see Network::broadcast_result). So: link, unlock, post.
template <class Post>
RmaStatus Rma::submit(Op* op, const char* what, Post post) {
  op->what = what;
  {
    std::lock_guard lock(mutex_);
    if (shut_down_) {
      delete op;
      throw Error(Errc::shut_down, fmt::format("{}: the runtime is shutting down", what));
    }
    Op*& head = pending_[static_cast<std::size_t>(op->rank)];
    op->next = head;
    if (head) head->prev = op;
    head = op;
    ++pending_total_;
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &Rma::op_done;
  param.user_data = op;
  ucs_status_ptr_t request = post(param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) {
    // Completed (or refused) at once: UCX will not call op_done, so we unlink and free here.
    bool ours = false;
    {
      std::lock_guard lock(mutex_);
      if (!op->finished) {
        op->finished = true;
        ours = true;
        Op*& head = pending_[static_cast<std::size_t>(op->rank)];
        if (op->prev) op->prev->next = op->next;
        else head = op->next;
        if (op->next) op->next->prev = op->prev;
        --pending_total_;
      }
    }
    ucs_status_t status = request ? UCS_PTR_STATUS(request) : UCS_OK;
    delete op;
    // Not ours: the peer was lost between linking and posting, and its listener has already
    // reported the failure to the callback; the caller must not hear of the operation twice.
    if (!ours) return RmaStatus::pending;
    if (status != UCS_OK) throw_ucx_error(what, __FILE__, __LINE__, status);
    return RmaStatus::done;
  }
  if (!network_.worker().on_progress_thread()) network_.worker().wake();
  return RmaStatus::pending;
}

void Rma::op_done(void* request, ucs_status_t status, void* user) {
  auto* op = static_cast<Op*>(user);
  FailureCause failure;
  if (status != UCS_OK)
    failure = make_failure(status == UCS_ERR_CANCELED ? Errc::shut_down : Errc::transport,
                           fmt::format("{} to rank {} failed: {} ({})", op->what, op->rank, ucs_status_name(status),
                                       ucs_status_string(status)));
  op->rma->finish(op, failure);
  ucp_request_free(request);
  delete op;
}

void Rma::finish(Op* op, const FailureCause& failure) {
  {
    std::lock_guard lock(mutex_);
    if (op->finished) return;
    op->finished = true;
    Op*& head = pending_[static_cast<std::size_t>(op->rank)];
    if (op->prev) op->prev->next = op->next;
    else head = op->next;
    if (op->next) op->next->prev = op->prev;
    --pending_total_;
  }
  op->done.fn(op->done.user, failure);
}

void Rma::peer_lost(int rank, const FailureCause& cause) {
  std::vector<RmaCallback> callbacks;
  {
    std::lock_guard lock(mutex_);
    Op*& head = pending_[static_cast<std::size_t>(rank)];
    for (Op* op = head; op; op = op->next) {
      op->finished = true;
      callbacks.push_back(op->done);
      --pending_total_;
    }
    // Unlinked all at once; the ops stay alive until UCX's callbacks free them.
    for (Op* op = head; op;) {
      Op* next = op->next;
      op->prev = op->next = nullptr;
      op = next;
    }
    head = nullptr;
  }
  for (auto& callback : callbacks) callback.fn(callback.user, cause);
}

RmaStatus Rma::put(const RemoteMemoryRef& dst, std::uint64_t dst_offset, const void* src, std::size_t bytes,
                   const LocalMemoryRef& src_memory, RmaCallback done) {
  if (!dst) throw Error(Errc::invalid_argument, "Rma::put: the destination is null");
  check_range(*dst, dst_offset, bytes, "Rma::put");
  if (bytes == 0) return RmaStatus::done;
  ucp_ep_h ep = endpoint_for(dst->rank(), "Rma::put");
  Op* op = new_op(dst->rank(), done, "Rma::put");
  op->local = src_memory;
  op->remote = dst;
  return submit(op, "ucp_put_nbx", [&](ucp_request_param_t& param) {
    if (src_memory) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = src_memory->handle();
    }
    return ucp_put_nbx(ep, src, bytes, dst->address() + dst_offset, dst->rkey(), &param);
  });
}

RmaStatus Rma::get(void* dst, const LocalMemoryRef& dst_memory, const RemoteMemoryRef& src, std::uint64_t src_offset,
                   std::size_t bytes, RmaCallback done) {
  if (!src) throw Error(Errc::invalid_argument, "Rma::get: the source is null");
  check_range(*src, src_offset, bytes, "Rma::get");
  if (bytes == 0) return RmaStatus::done;
  ucp_ep_h ep = endpoint_for(src->rank(), "Rma::get");
  Op* op = new_op(src->rank(), done, "Rma::get");
  op->local = dst_memory;
  op->remote = src;
  return submit(op, "ucp_get_nbx", [&](ucp_request_param_t& param) {
    if (dst_memory) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = dst_memory->handle();
    }
    return ucp_get_nbx(ep, dst, bytes, src->address() + src_offset, src->rkey(), &param);
  });
}

RmaStatus Rma::atomic_add(const RemoteMemoryRef& dst, std::uint64_t offset, std::uint64_t value, RmaCallback done) {
  if (!dst) throw Error(Errc::invalid_argument, "Rma::atomic_add: the destination is null");
  check_range(*dst, offset, 8, "Rma::atomic_add");
  if (offset % 8 != 0) throw Error(Errc::invalid_argument, fmt::format("Rma::atomic_add: offset {} is not 8-byte aligned", offset));
  ucp_ep_h ep = endpoint_for(dst->rank(), "Rma::atomic_add");
  Op* op = new_op(dst->rank(), done, "Rma::atomic_add");
  op->operand = value;
  op->remote = dst;
  return submit(op, "ucp_atomic_op_nbx(ADD)", [&](ucp_request_param_t& param) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_contig(8);
    return ucp_atomic_op_nbx(ep, UCP_ATOMIC_OP_ADD, &op->operand, 1, dst->address() + offset, dst->rkey(), &param);
  });
}

RmaStatus Rma::atomic_set(const RemoteMemoryRef& dst, std::uint64_t offset, std::uint64_t value, RmaCallback done) {
  if (!dst) throw Error(Errc::invalid_argument, "Rma::atomic_set: the destination is null");
  check_range(*dst, offset, 8, "Rma::atomic_set");
  if (offset % 8 != 0) throw Error(Errc::invalid_argument, fmt::format("Rma::atomic_set: offset {} is not 8-byte aligned", offset));
  ucp_ep_h ep = endpoint_for(dst->rank(), "Rma::atomic_set");
  Op* op = new_op(dst->rank(), done, "Rma::atomic_set");
  op->operand = value;
  op->remote = dst;
  return submit(op, "ucp_atomic_op_nbx(SWAP)", [&](ucp_request_param_t& param) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_REPLY_BUFFER;
    param.datatype = ucp_dt_make_contig(8);
    param.reply_buffer = &op->reply;
    return ucp_atomic_op_nbx(ep, UCP_ATOMIC_OP_SWAP, &op->operand, 1, dst->address() + offset, dst->rkey(), &param);
  });
}

void Rma::fence() { CARAVAN_UCX_CHECK(ucp_worker_fence(network_.worker().worker())); }

RmaStatus Rma::flush(int rank, RmaCallback done) {
  ucp_ep_h ep = endpoint_for(rank, "Rma::flush");
  Op* op = new_op(rank, done, "Rma::flush");
  return submit(op, "ucp_ep_flush_nbx", [&](ucp_request_param_t& param) { return ucp_ep_flush_nbx(ep, &param); });
}

std::size_t Rma::pending_count() const {
  std::lock_guard lock(mutex_);
  return pending_total_;
}

void Rma::shutdown(const FailureCause& cause) {
  {
    std::lock_guard lock(mutex_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  for (int r = 0; r < network_.world_size(); ++r) peer_lost(r, cause);
  // Release what the program still holds: UCX is about to go away under it.
  std::vector<RegisteredMemory*> registered;
  std::vector<RemoteMemory*> remote;
  {
    std::lock_guard lock(mutex_);
    registered.assign(registered_.begin(), registered_.end());
    remote.assign(remote_.begin(), remote_.end());
  }
  if (!registered.empty() || !remote.empty())
    log::get("net")->debug("releasing {} registration(s) and {} remote key(s) still held at shutdown", registered.size(),
                           remote.size());
  for (RemoteMemory* r : remote) r->release();
  for (RegisteredMemory* r : registered) r->release();
}

void RmaWait::complete(void* user, const FailureCause& failure) {
  auto* self = static_cast<RmaWait*>(user);
  self->failure_ = failure;
  self->state_.store(1, std::memory_order_release);
  self->state_.notify_one();
}

RmaWait::RmaWait() {
  // Only the progress thread completes the operation: waiting there would wait for ever. Checked
  // before the operation is issued (it holds this object's address until it completes).
  if (detail::on_progress_thread())
    throw Error(Errc::invalid_argument,
                "a put, get, signal or quiet to another node on the network's progress thread (in an "
                "Event::on_trigger callback of an event another rank triggered) would wait for that thread itself; "
                "callbacks must not block: issue it from a task (Runtime::spawn) instead");
}

void RmaWait::wait(RmaStatus status) {
  if (status == RmaStatus::done) return;
  // A short poll first: most operations on one host finish within microseconds.
  for (int i = 0; i < 2000 && state_.load(std::memory_order_acquire) == 0; ++i) std::this_thread::yield();
  while (state_.load(std::memory_order_acquire) == 0) state_.wait(0, std::memory_order_acquire);
  if (failure_) throw Error(failure_->code(), failure_->what());
}

}  // namespace caravan::net
