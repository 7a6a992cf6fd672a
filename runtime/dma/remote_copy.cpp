// Cross-rank copies: a copy whose instances or hops live on several ranks (engine.h,
// DistributedState, has the protocol in brief; docs/dma.md "Copies between ranks" in full).
//
// Messages (ids from net::kFirstUserMessage; bodies start with the copy's id):
//   setup     initiator -> participant  the plan, tiles, buffer sizes and instance references:
//                                        build your part, reserve your buffers, answer `ready`
//   ready     participant -> initiator  reserved (with the remote keys of my buffers that other
//                                        ranks put into), or why not (then I hold nothing)
//   go        initiator -> participant  every remote key: start your XDs
//   tiles     rank -> rank               hop H has finished N tiles: "landed in your buffer"
//                                        (sent after a flush, so the bytes are there) to the
//                                        next hop's rank, "slots drained" to the previous one's
//   done      participant -> initiator  my XDs retired and my puts are flushed (or failed)
//   abort     initiator -> participant  stop your part with this cause, then say `done`
//   finished  initiator -> participant  the copy is over, and whether every participant was done
//                                        (then no put can land any more: pool your buffers)
//   quiesce   participant -> rank        my part ended without that guarantee: tell me when your
//                                        puts into my buffers are over (I keep them till then)
//   quiesced  rank -> participant        they are (my part is done and flushed, or I have none)
//
// Threads: `tiles` is handled on the progress thread (it only moves a counter and wakes a DMA
// worker). Everything else runs on the engine's control thread: the other messages, peer
// losses, the start of a copy past its precondition, its admission and buffer allocation (also
// when a finishing copy's reservations admit it on a DMA worker), stop_copy's abort, and a
// part's end once its XDs retired. They allocate and register memory and trigger events (which
// may run user callbacks), and on one thread none of them can race another: an abort cannot
// free what an admission is allocating. No engine lock is held across a UCX call (see
// docs/distributed.md, Locking rule).
#include "runtime/dma/engine.h"
#include "runtime/dma/instance_impl.h"
#include "runtime/gpu/devices.h"
#include "runtime/log.h"
#include "runtime/net/network.h"
#include "runtime/net/rma.h"
#include "runtime/net/wire.h"

#include <caravan/settings.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <set>

namespace caravan::dma {
namespace {

enum Msg : std::uint16_t {
  kSetup = net::kFirstUserMessage,
  kReady,
  kGo,
  kTiles,
  kDone,
  kAbort,
  kFinished,
  kQuiesce,
  kQuiesced,
};

constexpr std::uint32_t kInstanceMagic = 0x4e494143;  // "CAIN": a Caravan instance descriptor

// How a hop reaches its output on another rank, the first byte of the target `ready` announces:
// UCX puts into registered memory (the nic channel), or the copy engines / SMs of this node's
// GPUs writing into the owner's GPU memory mapped through IPC (xgmi, and sdma on one GPU).
enum class TargetKind : std::uint8_t { ucx = 1, gpu_ipc = 2 };

bool puts_over_ucx(ChannelKind kind) { return kind == ChannelKind::nic; }

// An exportable GPU storage as a hop target (TargetKind::gpu_ipc): its allocation's serial,
// size, GPU (by PCI address, since ranks may number their GPUs differently) and IPC handle.
std::vector<std::byte> gpu_target_of(const Storage& storage) {
  const gpu::IpcHandle handle = storage.ipc_handle();
  net::WireWriter out;
  out.put(TargetKind::gpu_ipc).put(storage.serial()).put(storage.bytes());
  out.put_string(gpu::topology().devices.at(static_cast<std::size_t>(storage.device())).pci_bus_id).put(handle);
  return out.take();
}
std::atomic<std::uint64_t> g_next_copy{0};

void put_fields(net::WireWriter& out, const FieldSpace& fields) {
  out.put(static_cast<std::uint32_t>(fields.count()));
  for (const Field& f : fields.fields()) out.put_string(f.name).put(f.size);
}

FieldSpace get_fields(net::WireReader& in) {
  auto count = in.get<std::uint32_t>();
  if (count > 1u << 16) throw Error(Errc::invalid_argument, fmt::format("{} fields in a descriptor", count));
  std::vector<Field> fields;
  for (std::uint32_t i = 0; i < count; ++i) {
    Field f;
    f.name = in.get_string();
    f.size = in.get<std::uint32_t>();
    fields.push_back(std::move(f));
  }
  return FieldSpace(std::move(fields));
}

std::vector<std::byte> id_body(std::uint64_t id) {
  net::WireWriter out;
  out.put(id);
  return out.take();
}

std::vector<std::byte> failure_body(std::uint64_t id, const FailureCause& failure) {
  net::WireWriter out;
  out.put(id).put_failure(failure);
  return out.take();
}

}  // namespace

struct Engine::Hook {
  std::mutex mutex;
  Engine* engine = nullptr;  // null once the engine has shut down
};

namespace {

// Records `failure` as the copy's cause without touching its workers (they may be gone when a
// flush completes late): the part's `done` carries it to the initiator, which stops the copy.
void record_failure(CopyOperation& op, const FailureCause& failure) {
  std::lock_guard lock(op.failure_mutex);
  if (!op.failure) op.failure = failure;
}

// A flush whose completion tells another rank that tiles landed in its buffer. A failed flush
// (the peer lost, or the transport failing) fails the copy: the tiles are not known to be there.
struct LandedFlush {
  std::function<void(const FailureCause&)> on_failure;
  net::Network* network;
  int rank;
  std::vector<std::byte> body;
  static void done(void* user, const FailureCause& failure);
};

}  // namespace

// A flush at the end of a rank's part: the copy may report `done` once every put has landed.
namespace {
struct SegmentFlush {
  std::shared_ptr<void> hook;  // Engine::Hook, type-erased: the struct is private to Engine
  std::shared_ptr<CopyOperation> op;
  std::function<void()> on_last;
  std::shared_ptr<std::atomic<int>> left;
  static void done(void* user, const FailureCause& failure) {
    auto* self = static_cast<SegmentFlush*>(user);
    // The puts are not known to have landed: the part's `done` reports the failure.
    if (failure) record_failure(*self->op, failure);
    if (self->left->fetch_sub(1, std::memory_order_acq_rel) == 1) self->on_last();
    delete self;
  }
};

void LandedFlush::done(void* user, const FailureCause& failure) {
  auto* self = static_cast<LandedFlush*>(user);
  if (!failure) self->network->send(self->rank, kTiles, self->body);
  else self->on_failure(failure);
  delete self;
}
}  // namespace

// ------------------------------------------------------------------------ set-up and teardown

void Engine::dist_init() {
  if (!network_) return;
  std::random_device random;
  nonce_ = (static_cast<std::uint64_t>(random()) << 32) ^ random() ^
           static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  hook_ = std::make_shared<Hook>();
  hook_->engine = this;
  control_ = std::thread([this] { control_main(); });
  auto hook = hook_;
  auto queued = [hook](void (Engine::*handler)(int, const std::vector<std::byte>&)) {
    return [hook, handler](const net::AmMessage& message) {
      std::vector<std::byte> body(message.body.begin(), message.body.end());
      const int source = message.source;
      std::lock_guard lock(hook->mutex);
      Engine* engine = hook->engine;
      if (!engine) return;
      engine->post_control([engine, handler, source, body = std::move(body)] { (engine->*handler)(source, body); });
    };
  };
  network_->set_handler(kSetup, queued(&Engine::on_setup));
  network_->set_handler(kReady, queued(&Engine::on_ready));
  network_->set_handler(kGo, queued(&Engine::on_go));
  network_->set_handler(kDone, queued(&Engine::on_done));
  network_->set_handler(kAbort, queued(&Engine::on_abort));
  network_->set_handler(kFinished, queued(&Engine::on_finished));
  network_->set_handler(kQuiesce, queued(&Engine::on_quiesce));
  network_->set_handler(kQuiesced, queued(&Engine::on_quiesced));
  network_->set_handler(kTiles, [hook](const net::AmMessage& message) {
    std::lock_guard lock(hook->mutex);
    if (hook->engine) hook->engine->on_tiles(message.source, message.body);
  });
  network_->add_peer_lost_listener([hook](int rank, const FailureCause& cause) {
    std::lock_guard lock(hook->mutex);
    Engine* engine = hook->engine;
    if (!engine) return;
    engine->post_control([engine, rank, cause] { engine->dist_peer_lost(rank, cause); });
  });
}

// At shutdown a rank does not wait for its peers: every cross-rank copy ends as soon as this
// rank's part has (stop_copy has queued their stops before this).
void Engine::dist_shutdown() {
  if (!network_) return;
  post_control([this] {
    std::vector<std::shared_ptr<CopyOperation>> ops;
    {
      std::lock_guard lock(dist_mutex_);
      for (auto& [id, op] : dist_ops_) ops.push_back(op);
    }
    for (auto& op : ops) {
      if (op->dist->initiator == runtime_.rank()) {
        dist_check_complete(op);
      } else {
        bool done;
        {
          std::lock_guard lock(mutex_);
          done = op->dist->segment_done;
        }
        if (done) dist_finish_local(op);
      }
    }
  });
}

void Engine::dist_close() {
  if (hook_) {
    std::lock_guard lock(hook_->mutex);
    hook_->engine = nullptr;
  }
  {
    std::lock_guard lock(control_mutex_);
    control_stop_ = true;
  }
  control_cv_.notify_all();
  if (control_.joinable()) control_.join();
  std::multimap<std::uint64_t, std::shared_ptr<Storage>> idle;
  std::map<std::pair<int, std::vector<std::byte>>, std::shared_ptr<net::RemoteMemory>> keys;
  decltype(gpu_mappings_) mappings;
  {
    std::lock_guard lock(mutex_);
    idle.swap(idle_registered_);  // registrations and keys go before the network releases UCX
    idle_registered_bytes_ = 0;
    keys.swap(remote_keys_);
    mappings.swap(gpu_mappings_);
    // Quarantined buffers stay: peers may still put into them until they say bye, and the
    // network unregisters them only after that (Rma::shutdown); the engine frees the rest.
  }
}

void Engine::post_control(std::function<void()> work) {
  {
    std::lock_guard lock(control_mutex_);
    if (control_stop_) return;
    control_queue_.push_back(std::move(work));
  }
  control_cv_.notify_one();
}

void Engine::control_main() {
  const detail::RuntimeThreadRole role("the DMA engine's remote-copy control thread");
  std::unique_lock lock(control_mutex_);
  for (;;) {
    control_cv_.wait(lock, [&] { return control_stop_ || !control_queue_.empty(); });
    if (control_queue_.empty()) return;  // stopping, and nothing left
    auto work = std::move(control_queue_.front());
    control_queue_.pop_front();
    lock.unlock();
    try {
      work();
    } catch (const std::exception& e) {
      log::get("dma")->error("cross-rank copy: {}", e.what());
    }
    lock.lock();
  }
}

void Engine::send(int rank, std::uint16_t id, std::span<const std::byte> body) {
  if (!network_->send(rank, id, body))
    log::get("dma")->debug("cross-rank copy: message {} to rank {} not sent (the rank is gone)", id, rank);
}

std::shared_ptr<CopyOperation> Engine::dist_find(std::uint64_t id) {
  std::lock_guard lock(dist_mutex_);
  auto it = dist_ops_.find(id);
  return it == dist_ops_.end() ? nullptr : it->second;
}

// ------------------------------------------------------------------------ instances and storage

std::vector<std::byte> Engine::export_instance(const std::shared_ptr<InstanceImpl>& impl) {
  if (impl->remote) return impl->descriptor;  // passing another rank's descriptor on
  {
    std::lock_guard lock(exports_mutex_);
    if (impl->export_id == 0) {
      impl->export_id = ++next_export_;
      exports_[impl->export_id] = impl;
      // Forget instances that are gone, so that the table stays as small as the live set.
      if (exports_.size() % 256 == 0)
        std::erase_if(exports_, [](const auto& entry) { return entry.second.expired(); });
    }
  }
  net::WireWriter out;
  out.put(kInstanceMagic).put(static_cast<std::int32_t>(runtime_.rank())).put(nonce_).put(impl->export_id);
  out.put(impl->memory).put(impl->space);
  put_fields(out, impl->fields);
  out.put(impl->layout);
  // GPU memory: its IPC target, so that a rank of this node may write it without asking first
  // (CARAVAN_DMA_IPC_DIRECT).
  std::vector<std::byte> gpu_target;
  if (impl->storage && impl->storage->exportable()) {
    try {
      gpu_target = gpu_target_of(*impl->storage);
    } catch (const Error& e) {
      // Without it copies into the instance still work, through the set-up exchange (which
      // then reports the same failure if a copy needs the mapping).
      log::get("dma")->debug("{}: no IPC handle for its descriptor: {}", impl->memory.to_string(), e.what());
    }
  }
  out.put(static_cast<std::uint8_t>(!gpu_target.empty()));
  if (!gpu_target.empty()) out.put_bytes(gpu_target);
  return out.take();
}

std::shared_ptr<InstanceImpl> Engine::import_instance(std::span<const std::byte> descriptor) {
  try {
    net::WireReader in(descriptor, "instance descriptor");
    if (descriptor.size() < sizeof(kInstanceMagic) || in.get<std::uint32_t>() != kInstanceMagic)
      throw Error(Errc::invalid_argument, "the bytes are not an instance descriptor (from Instance::descriptor)");
    auto owner = in.get<std::int32_t>();
    auto nonce = in.get<std::uint64_t>();
    auto id = in.get<std::uint64_t>();
    auto memory = in.get<MemoryId>();
    auto space = in.get<Rect>();
    FieldSpace fields = get_fields(in);
    auto layout = in.get<Layout>();
    std::vector<std::byte> gpu_target;
    if (in.get<std::uint8_t>() != 0) {
      auto bytes = in.get_bytes();
      gpu_target.assign(bytes.begin(), bytes.end());
    }
    in.expect_end();
    if (owner < 0 || owner >= runtime_.world_size() || memory.rank != static_cast<std::uint32_t>(owner))
      throw Error(Errc::invalid_argument, fmt::format("the descriptor names rank {} ({}), not a rank of this job of {}", owner,
                                                      memory.to_string(), runtime_.world_size()));
    if (owner == runtime_.rank()) {
      std::lock_guard lock(exports_mutex_);
      auto it = exports_.find(id);
      std::shared_ptr<InstanceImpl> impl = it == exports_.end() ? nullptr : it->second.lock();
      if (nonce != nonce_ || !impl)
        throw Error(Errc::invalid_argument, fmt::format("instance #{} of this rank ({}) no longer exists, or belongs to an "
                                                        "earlier runtime", id, memory.to_string()));
      return impl;
    }
    graph_->require(memory, "instance memory");
    layout.validate(space.dims(), "instance layout");
    auto impl = std::make_shared<InstanceImpl>(memory, space, std::move(fields), layout);
    impl->remote = true;
    impl->export_id = id;
    impl->descriptor.assign(descriptor.begin(), descriptor.end());
    impl->gpu_target = std::move(gpu_target);
    return impl;
  } catch (const Error& e) {
    if (e.code() == Errc::invalid_argument) throw Error(Errc::invalid_argument, fmt::format("Instance::from_descriptor: {}", e.what()));
    throw Error(Errc::invalid_argument, fmt::format("Instance::from_descriptor: the descriptor is malformed ({})", e.what()));
  }
}

std::shared_ptr<Storage> Engine::allocate_instance_storage(MemoryId memory, std::uint64_t bytes, void* attach) {
  if (memory.kind == MemoryKind::reg && network_) {
    net::Rma& rma = network_->rma();
    if (attach) return Storage::wrap_registered(memory, rma.register_memory(attach, bytes), bytes);
    auto registration = rma.allocate(std::max<std::uint64_t>(bytes, 1));
    std::memset(registration->data(), 0, registration->size());  // instances start zeroed, as allocate_host's do
    return Storage::wrap_registered(memory, std::move(registration), bytes);
  }
  if (attach) return Storage::wrap_host(memory, attach, bytes);
  return allocate_storage(memory, bytes);
}

std::shared_ptr<Storage> Engine::allocate_buffer(MemoryId memory, std::uint64_t bytes) {
  if (memory.kind != MemoryKind::reg || !network_) return allocate_storage(memory, bytes);
  {
    std::lock_guard lock(mutex_);
    auto it = idle_registered_.find(bytes);
    if (it != idle_registered_.end()) {
      auto storage = std::move(it->second);
      idle_registered_.erase(it);
      idle_registered_bytes_ -= bytes;
      return storage;
    }
  }
  return Storage::wrap_registered(memory, network_->rma().allocate(bytes), bytes);
}

void Engine::release_buffer(std::shared_ptr<Storage> storage) {
  if (!storage || !storage->registration()) return;  // dropped here (remote keys, plain buffers)
  std::lock_guard lock(mutex_);
  if (stopping_ || idle_registered_bytes_ + storage->bytes() > pool_bytes_) return;  // unregistered after the unlock
  idle_registered_bytes_ += storage->bytes();
  idle_registered_.emplace(storage->bytes(), std::move(storage));
}

// ------------------------------------------------------------------------ the initiator

void Engine::dist_prepare(CopyOperation& op) {
  DistributedState& d = *op.dist;
  const int me = runtime_.rank();
  if (!network_)
    throw Error(Errc::invalid_argument, "copy: an instance or hop is on another rank, but this runtime is one rank alone");
  d.initiator = me;
  d.id = (static_cast<std::uint64_t>(me) << 48) | (g_next_copy.fetch_add(1, std::memory_order_relaxed) + 1);
  const int src_owner = static_cast<int>(op.src_instance.memory().rank);
  const int dst_owner = static_cast<int>(op.dst_instance.memory().rank);
  std::set<int> ranks{src_owner, dst_owner};
  for (const planner::Hop& hop : d.hops) {
    const int r = static_cast<int>(hop.src.rank);
    d.hop_rank.push_back(r);
    // Every participant must have its DMA engine running when `setup` arrives: the owners of
    // the instances do (they created them), and so does this rank.
    if (r != src_owner && r != dst_owner && r != me)
      throw Error(Errc::invalid_argument,
                  fmt::format("copy: the planned path ({}) runs a hop on rank {}, which owns neither instance; copy in two "
                              "steps through an instance on that rank", op.route(), r));
    ranks.insert(r);
  }
  d.participants.assign(ranks.begin(), ranks.end());
  // Global memory order: by node, then rank (MemoryId order), so that buffer reservations on
  // several ranks are taken in one order by every copy.
  std::sort(d.participants.begin(), d.participants.end(), [&](int a, int b) {
    return std::pair(runtime_.ranks()[static_cast<std::size_t>(a)].node, a) <
           std::pair(runtime_.ranks()[static_cast<std::size_t>(b)].node, b);
  });
  for (int p : d.participants)
    if (p != me) network_->require_alive(p, "copy");
  d.peers.assign(d.participants.size(), DistributedState::Peer::waiting);
  d.targets.assign(d.hops.size(), {});

  net::WireWriter out;
  out.put(d.id).put(static_cast<std::int32_t>(op.priority));
  for (const Instance* inst : {&op.src_instance, &op.dst_instance}) {
    // The owner looks its instance up by the number export_instance gives it.
    std::vector<std::byte> descriptor = export_instance(inst->impl());
    out.put_bytes(descriptor);
  }
  out.put(op.space);
  put_fields(out, op.fields);
  out.put(static_cast<std::uint32_t>(d.hops.size()));
  for (std::size_t i = 0; i < d.hops.size(); ++i) {
    const planner::Hop& hop = d.hops[i];
    out.put(hop.kind).put(hop.src).put(hop.dst).put(hop.src_layout).put(hop.dst_layout).put(op.xds[i]->request_bytes);
  }
  out.put(d.tile_points).put(static_cast<std::int32_t>(op.slots));
  for (const auto& b : op.buffers) out.put(b.slot_bytes);
  out.put(static_cast<std::uint32_t>(d.participants.size()));
  for (int p : d.participants) out.put(static_cast<std::int32_t>(p));
  d.setup = out.take();
}

void Engine::dist_begin(const std::shared_ptr<CopyOperation>& op) {
  {
    // Registered under the engine lock (then dist_mutex_, the order on_setup uses), so that a
    // cancel() cannot finish the copy between the state change and the registration and leave
    // it registered for ever.
    std::lock_guard lock(mutex_);
    if (op->state != CopyOperation::State::waiting_precondition) return;  // stopped meanwhile
    op->state = CopyOperation::State::waiting_buffers;
    std::lock_guard dist_lock(dist_mutex_);
    dist_ops_[op->dist->id] = op;
  }
  // A participant lost between copy() and now was reported while the copy was not registered:
  // look again, now that a later loss reaches it through dist_peer_lost.
  const int me = runtime_.rank();
  for (int p : op->dist->participants) {
    if (p == me) continue;
    try {
      network_->require_alive(p, "copy");
    } catch (const Error& e) {
      dist_peer_lost_for(op, p, std::make_shared<const Error>(e.code(), e.what()));
      return;
    }
  }
  dist_advance(op);
}

// Admits the participants one at a time, in global memory order; each `ready` (or this rank's
// own admission) moves on to the next. Once all are ready, `go`.
void Engine::dist_advance(const std::shared_ptr<CopyOperation>& op) {
  DistributedState& d = *op->dist;
  const int me = runtime_.rank();
  std::unique_lock lock(mutex_);
  if (d.aborted || op->state == CopyOperation::State::finished) return;
  if (d.next < d.participants.size()) {
    const int p = d.participants[d.next];
    if (d.peers[d.next] != DistributedState::Peer::waiting) return;  // its answer is awaited
    d.peers[d.next] = DistributedState::Peer::setup_sent;
    if (p == me) {
      admit(op);
      const bool admitted = op->state == CopyOperation::State::running;
      lock.unlock();
      if (admitted) dist_admitted(op);  // else when buffers free up: finish() -> start() -> here
      return;
    }
    std::vector<std::byte> body = d.setup;
    lock.unlock();
    send(p, kSetup, body);
    return;
  }
  // Everyone is ready: hand out the remote keys.
  net::WireWriter out;
  out.put(d.id);
  for (const auto& target : d.targets) out.put_bytes(target);
  std::vector<std::byte> body = out.take();
  std::vector<int> others;
  bool here = false;
  for (int p : d.participants) {
    if (p == me) here = true;
    else others.push_back(p);
  }
  lock.unlock();
  for (int p : others) send(p, kGo, body);
  if (here) dist_go(op);
  else dist_check_complete(op);
}

void Engine::on_ready(int source, const std::vector<std::byte>& body) {
  net::WireReader in(body, fmt::format("copy ready from rank {}", source));
  auto id = in.get<std::uint64_t>();
  FailureCause failure = in.get_failure();
  auto op = dist_find(id);
  if (!op || op->dist->initiator != runtime_.rank()) return;
  DistributedState& d = *op->dist;
  {
    std::lock_guard lock(mutex_);
    const std::size_t index = d.index_of(source);
    if (index == d.participants.size()) return;
    if (d.peers[index] != DistributedState::Peer::setup_sent) return;
    if (failure) {
      d.peers[index] = DistributedState::Peer::done;  // a participant that could not set up holds nothing
    } else {
      d.peers[index] = DistributedState::Peer::ready;
      while (!in.at_end()) {
        auto hop = in.get<std::uint32_t>();
        auto key = in.get_bytes();
        if (hop < d.targets.size()) d.targets[hop].assign(key.begin(), key.end());
      }
      if (index == d.next) ++d.next;
    }
  }
  if (failure) {
    dist_fail(op, failure);
    dist_check_complete(op);
    return;
  }
  dist_advance(op);
}

void Engine::on_done(int source, const std::vector<std::byte>& body) {
  net::WireReader in(body, fmt::format("copy done from rank {}", source));
  auto id = in.get<std::uint64_t>();
  FailureCause failure = in.get_failure();
  auto op = dist_find(id);
  if (!op || op->dist->initiator != runtime_.rank()) return;
  DistributedState& d = *op->dist;
  {
    std::lock_guard lock(mutex_);
    const std::size_t index = d.index_of(source);
    if (index == d.participants.size()) return;
    d.peers[index] = DistributedState::Peer::done;
  }
  if (failure) dist_fail(op, failure);
  dist_check_complete(op);
}

// The initiator's reaction to the first failure: poison the copy (this rank's XDs stop at the
// next request boundary) and tell every participant that may hold something to stop.
void Engine::dist_fail(const std::shared_ptr<CopyOperation>& op, const FailureCause& cause) {
  DistributedState& d = *op->dist;
  const int me = runtime_.rank();
  std::vector<int> to_abort;
  std::vector<std::shared_ptr<CopyOperation>> retry;
  bool local_done = false;
  {
    std::lock_guard lock(mutex_);
    if (op->state == CopyOperation::State::finished) return;
    op->fail(cause);
    if (d.aborted) return;
    d.aborted = true;
    for (std::size_t i = 0; i < d.participants.size(); ++i) {
      const int p = d.participants[i];
      if (d.peers[i] == DistributedState::Peer::done) continue;
      if (p != me) {
        if (d.peers[i] == DistributedState::Peer::waiting) d.peers[i] = DistributedState::Peer::done;  // never contacted
        else to_abort.push_back(p);
        continue;
      }
      if (d.started) continue;  // its XDs stop and retire: dist_segment_done follows
      // Not started: whatever it reserved goes back now (finish() releases the rest), and it
      // leaves the pools' queues (`running`: past admission, never admitted again).
      release_reservations(*op, retry);
      op->state = CopyOperation::State::running;
      d.started = true;
      d.segment_done = true;
      d.peers[i] = DistributedState::Peer::done;
      local_done = true;
    }
  }
  std::vector<std::byte> body = failure_body(d.id, cause);
  for (int p : to_abort) send(p, kAbort, body);
  dist_readmit(retry);
  if (local_done) dist_check_complete(op);
}

void Engine::dist_check_complete(const std::shared_ptr<CopyOperation>& op) {
  DistributedState& d = *op->dist;
  const int me = runtime_.rank();
  std::vector<int> contacted;
  {
    std::lock_guard lock(mutex_);
    if (op->state == CopyOperation::State::finished) return;
    bool all = true, mine = true;
    for (std::size_t i = 0; i < d.participants.size(); ++i) {
      const bool done = d.peers[i] == DistributedState::Peer::done;
      all = all && done;
      if (d.participants[i] == me) mine = done;
    }
    // At shutdown this rank does not wait for the others (their buffers are theirs to free).
    if (!all && !(stopping_ && mine)) return;
    op->state = CopyOperation::State::finished;
    d.clean = all;
    for (int p : d.participants)
      if (p != me) contacted.push_back(p);
  }
  // `clean`: every part is done and flushed, so the participants may pool their buffers; else
  // one may still be putting into another's, which keeps them in quarantine.
  net::WireWriter out;
  out.put(d.id).put(static_cast<std::uint8_t>(d.clean ? 1 : 0));
  for (int p : contacted) send(p, kFinished, out.bytes());
  finish(op);
}

// ------------------------------------------------------------------------ a participant

void Engine::on_setup(int source, const std::vector<std::byte>& body) {
  std::uint64_t id = 0;
  const int me = runtime_.rank();
  std::shared_ptr<CopyOperation> op;
  try {
    net::WireReader in(body, fmt::format("copy setup from rank {}", source));
    id = in.get<std::uint64_t>();
    op = std::make_shared<CopyOperation>();
    op->engine = this;
    op->priority = in.get<std::int32_t>();
    op->dist = std::make_unique<DistributedState>();
    DistributedState& d = *op->dist;
    d.id = id;
    d.initiator = source;
    std::shared_ptr<InstanceImpl> instances[2];
    for (auto& impl : instances) {
      auto descriptor = in.get_bytes();
      impl = import_instance(descriptor);
    }
    op->space = in.get<Rect>();
    op->fields = get_fields(in);
    auto hop_count = in.get<std::uint32_t>();
    std::vector<std::uint64_t> request_bytes;
    for (std::uint32_t i = 0; i < hop_count; ++i) {
      planner::Hop hop;
      hop.kind = in.get<ChannelKind>();
      hop.src = in.get<MemoryId>();
      hop.dst = in.get<MemoryId>();
      hop.src_layout = in.get<Layout>();
      hop.dst_layout = in.get<Layout>();
      request_bytes.push_back(in.get<std::uint64_t>());
      d.hop_rank.push_back(static_cast<int>(hop.src.rank));
      if (hop.src.rank == static_cast<std::uint32_t>(me)) hop.channel = channel_between(hop.src, hop.dst, hop.kind);
      d.hops.push_back(hop);
    }
    d.tile_points = in.get<std::uint64_t>();
    op->slots = in.get<std::int32_t>();
    std::vector<std::uint64_t> slot_bytes;
    for (std::uint32_t i = 0; i + 1 < hop_count; ++i) slot_bytes.push_back(in.get<std::uint64_t>());
    auto participants = in.get<std::uint32_t>();
    for (std::uint32_t i = 0; i < participants; ++i) d.participants.push_back(in.get<std::int32_t>());
    in.expect_end();
    if (hop_count == 0 || op->slots < 1) throw Error(Errc::internal, "a copy setup without hops or slots");
    op->set_route(d.hops);
    // The instances this rank owns are the real ones; the others only describe the far ends.
    // Over the whole instances: op->space may be a region of them (CopyOptions::region).
    op->src_view = View::of_layout(instances[0]->layout, instances[0]->space, op->fields, 0);
    op->dst_view = View::of_layout(instances[1]->layout, instances[1]->space, op->fields, 0);
    if (!instances[0]->remote) {
      d.src_impl = instances[0];
      op->src_storage = instances[0]->storage;
    }
    if (!instances[1]->remote) {
      d.dst_impl = instances[1];
      op->dst_storage = instances[1]->storage;
    }
    build_pipeline(*op, d.hops, d.tile_points, slot_bytes, request_bytes,
                   [&](std::size_t i) { return d.hop_rank[i] == me; });
  } catch (const std::exception& e) {
    // Any failure (not only Error) is answered: the initiator waits for this rank's `ready`.
    const auto* error = dynamic_cast<const Error*>(&e);
    log::get("dma")->warn("copy {:x} from rank {}: cannot take part: {}", id, source, e.what());
    send(source, kReady, failure_body(id, std::make_shared<const Error>(error ? error->code() : Errc::internal,
                                                                        fmt::format("rank {}: {}", me, e.what()))));
    return;
  }
  bool admitted = false;
  {
    std::unique_lock lock(mutex_);
    if (stopping_) {
      lock.unlock();  // no UCX call under the engine lock (the progress thread may want it)
      send(source, kReady, failure_body(id, make_failure(Errc::shut_down, fmt::format("rank {} is shutting down", me))));
      return;
    }
    op->sequence = ++next_sequence_;
    op->done = runtime_.events().create();  // this rank's part; nobody waits on it
    op->touch();
    active_.emplace(op->done, op);
    {
      std::lock_guard dist_lock(dist_mutex_);
      dist_ops_[id] = op;
    }
    op->state = CopyOperation::State::waiting_buffers;
    admit(op);
    admitted = op->state == CopyOperation::State::running;
  }
  if (admitted) dist_admitted(op);
}

std::vector<std::byte> Engine::export_target(const Storage* storage, const planner::Hop& hop, int writer) const {
  if (!storage) throw Error(Errc::internal, fmt::format("{} has no storage for rank {} to write into", hop.dst.to_string(), writer));
  if (puts_over_ucx(hop.kind)) {
    if (!storage->registration())
      throw Error(Errc::internal, fmt::format("{} is not registered with UCX, so rank {} cannot put into it",
                                              hop.dst.to_string(), writer));
    // The kind, then the registration's descriptor as it is (Rma::import reads it from byte 1).
    const auto& descriptor = storage->registration()->descriptor();
    std::vector<std::byte> key{static_cast<std::byte>(TargetKind::ucx)};
    key.insert(key.end(), descriptor.begin(), descriptor.end());
    return key;
  }
  if (!storage->exportable())
    throw Error(Errc::internal, fmt::format("{} is not GPU memory of this process, so rank {}'s {} hop cannot write it",
                                            hop.dst.to_string(), writer, to_string(hop.kind)));
  return gpu_target_of(*storage);
}

std::shared_ptr<Storage> Engine::map_target(MemoryId memory, const planner::Hop& hop, std::span<const std::byte> target,
                                            std::uint64_t buffer_bytes) {
  net::WireReader in(target, fmt::format("the IPC target {}", memory.to_string()));
  (void)in.get<TargetKind>();
  const auto serial = in.get<std::uint64_t>();
  const auto bytes = in.get<std::uint64_t>();
  const std::string pci = in.get_string();
  const auto handle = in.get<gpu::IpcHandle>();
  in.expect_end();
  const int device = gpu::device_of_pci_bus(pci);
  if (device < 0)
    throw Error(Errc::invalid_argument,
                fmt::format("{} is GPU {} of rank {}, which this process (rank {}) does not see; ranks of a node that copy "
                            "between their GPUs must see each other's (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)",
                            memory.to_string(), pci, memory.rank, runtime_.rank()));
  if (buffer_bytes > bytes)
    throw Error(Errc::internal, fmt::format("{}: the buffer of rank {} has {} bytes, {} expected", memory.to_string(),
                                            memory.rank, bytes, buffer_bytes));
  const auto key = std::pair(static_cast<int>(memory.rank), serial);
  std::shared_ptr<std::byte> mapping;
  {
    std::lock_guard lock(mutex_);
    if (auto it = gpu_mappings_.find(key); it != gpu_mappings_.end()) mapping = it->second;
  }
  if (!mapping) {
    // Mapped on the GPU that runs the hop (the source of an xgmi or sdma hop is this rank's).
    void* mapped = gpu::ipc_open(handle, static_cast<int>(hop.src.index));
    mapping = std::shared_ptr<std::byte>(static_cast<std::byte*>(mapped), [](std::byte* p) { gpu::ipc_close(p); });
    // Mappings of allocations long gone are dropped in bulk (their serials never come again);
    // unmapped after the unlock (a driver call), or when the last copy using one ends.
    decltype(gpu_mappings_) dropped;
    std::lock_guard lock(mutex_);
    if (gpu_mappings_.size() >= 64) dropped.swap(gpu_mappings_);
    gpu_mappings_.emplace(key, mapping);
  }
  return Storage::mapped_device(memory, std::move(mapping), device, buffer_bytes ? buffer_bytes : bytes);
}

// This rank's reservations are held: allocate its buffers and tell the initiator (or, on the
// initiator itself, move on to the next participant). On the control thread, like every abort
// and finish: the copy cannot be stopped while this runs.
void Engine::dist_admitted(const std::shared_ptr<CopyOperation>& op) {
  DistributedState& d = *op->dist;
  const int me = runtime_.rank();
  const std::size_t last = d.hops.size() - 1;
  {
    // Stopped between its admission (on another thread, maybe) and now: dist_fail or
    // dist_abort_here settled this rank's part, and finish() released or will release its
    // reservations. Allocate nothing.
    std::lock_guard lock(mutex_);
    if (op->state == CopyOperation::State::finished || d.started || d.aborted) return;
  }
  FailureCause failure;
  net::WireWriter out;
  out.put(d.id);
  std::vector<std::pair<std::uint32_t, std::vector<std::byte>>> keys;
  try {
    for (auto& b : op->buffers)
      if (b.memory.rank == static_cast<std::uint32_t>(me))
        b.storage = allocate_buffer(b.memory, b.slot_bytes * static_cast<std::uint64_t>(op->slots));
    // The outputs on this rank that another rank's hop puts into: their remote keys.
    for (std::size_t j = 0; j <= last; ++j) {
      const MemoryId out_memory = d.hops[j].dst;
      if (out_memory.rank != static_cast<std::uint32_t>(me) || d.hop_rank[j] == me) continue;
      const Storage* storage = j < last ? op->buffers[j].storage.get() : op->dst_storage.get();
      keys.emplace_back(static_cast<std::uint32_t>(j), export_target(storage, d.hops[j], d.hop_rank[j]));
    }
  } catch (const Error& e) {
    failure = std::make_shared<const Error>(e.code(), fmt::format("rank {}: {}", me, e.what()));
  }
  if (d.initiator == me) {
    if (failure) {
      dist_fail(op, failure);
      dist_check_complete(op);
      return;
    }
    {
      std::lock_guard lock(mutex_);
      for (auto& [hop, key] : keys) d.targets[hop] = std::move(key);
      d.peers[d.index_of(me)] = DistributedState::Peer::ready;
      ++d.next;
    }
    dist_advance(op);
    return;
  }
  if (failure) {
    // Nothing of this rank was announced (no rank can put into its buffers): release it at once
    // and say why.
    send(d.initiator, kReady, failure_body(d.id, failure));
    {
      std::lock_guard lock(mutex_);
      d.started = d.segment_done = true;
      d.clean = true;
    }
    op->fail(failure);
    dist_finish_local(op);
    return;
  }
  out.put_failure(nullptr);
  for (auto& [hop, key] : keys) out.put(hop).put_bytes(key);
  send(d.initiator, kReady, out.bytes());
}

void Engine::on_go(int source, const std::vector<std::byte>& body) {
  net::WireReader in(body, fmt::format("copy go from rank {}", source));
  auto id = in.get<std::uint64_t>();
  auto op = dist_find(id);
  if (!op) return;
  DistributedState& d = *op->dist;
  std::vector<std::vector<std::byte>> targets;
  for (std::size_t j = 0; j < d.hops.size(); ++j) {
    auto key = in.get_bytes();
    targets.emplace_back(key.begin(), key.end());
  }
  in.expect_end();
  {
    std::lock_guard lock(mutex_);
    d.targets = std::move(targets);
  }
  dist_go(op);
}

// Starts this rank's XDs: the outputs its nic hops put into become remote storages.
void Engine::dist_go(const std::shared_ptr<CopyOperation>& op) {
  DistributedState& d = *op->dist;
  const int me = runtime_.rank();
  const std::size_t last = d.hops.size() - 1;
  std::vector<std::vector<std::byte>> targets;
  {
    std::lock_guard lock(mutex_);
    if (d.started) return;
    d.started = true;
    targets = d.targets;
  }
  int local = 0;
  try {
    for (std::size_t j = 0; j <= last; ++j) {
      if (d.hop_rank[j] != me) continue;
      ++local;
      const MemoryId out_memory = d.hops[j].dst;
      if (out_memory.rank == static_cast<std::uint32_t>(me)) continue;
      if (targets[j].empty())
        throw Error(Errc::internal, fmt::format("no remote key for {} (hop {})", out_memory.to_string(), j));
      if (static_cast<TargetKind>(targets[j][0]) == TargetKind::gpu_ipc) {
        const std::uint64_t buffer_bytes = j < last ? op->buffers[j].slot_bytes * static_cast<std::uint64_t>(op->slots) : 0;
        auto storage = map_target(out_memory, d.hops[j], targets[j], buffer_bytes);
        if (j < last) op->buffers[j].storage = std::move(storage);
        else op->dst_storage = std::move(storage);
        continue;
      }
      if (static_cast<TargetKind>(targets[j][0]) != TargetKind::ucx)
        throw Error(Errc::internal, fmt::format("the target of hop {} ({}) is of an unknown kind {}", j,
                                                out_memory.to_string(), static_cast<int>(targets[j][0])));
      std::shared_ptr<net::RemoteMemory> remote;
      auto key = std::pair(static_cast<int>(out_memory.rank), targets[j]);
      {
        std::lock_guard lock(mutex_);
        auto it = remote_keys_.find(key);
        if (it != remote_keys_.end()) remote = it->second;
      }
      if (!remote) {
        remote = network_->rma().import(static_cast<int>(out_memory.rank),
                                        std::span<const std::byte>(targets[j]).subspan(1));
        // Keys of buffers and instances long gone are dropped in bulk (their descriptors never
        // come again: a new registration packs a new key); destroyed after the unlock, since
        // destroying a key calls into UCX.
        decltype(remote_keys_) dropped;
        std::lock_guard lock(mutex_);
        if (remote_keys_.size() >= 256) dropped.swap(remote_keys_);
        remote_keys_.emplace(std::move(key), remote);
      }
      const std::uint64_t bytes = j < last ? op->buffers[j].slot_bytes * static_cast<std::uint64_t>(op->slots)
                                           : static_cast<std::uint64_t>(remote->size());
      auto storage = Storage::remote(out_memory, std::move(remote), bytes);
      if (j < last) op->buffers[j].storage = std::move(storage);
      else op->dst_storage = std::move(storage);
    }
  } catch (const Error& e) {
    op->fail(std::make_shared<const Error>(e));
    local = 0;
  }
  if (local == 0 || op->cancelled.load(std::memory_order_acquire)) {
    dist_segment_done(op);
    return;
  }
  op->touch();
  // CopyReport::setup_us: from copy() until this rank's XDs start.
  op->started_ns = now_ns();
  op->live_xds.store(local);
  for (auto& xd : op->xds)
    if (xd->worker) xd->worker->add(xd.get());
}

// Every XD of this rank has retired. Before the part counts as done, the puts it made must
// have landed: a flush to every rank it put into (also after a failure, so that a buffer the
// far side frees and reuses can no longer be written by a late put).
void Engine::dist_segment_retired(const std::shared_ptr<CopyOperation>& op) {
  DistributedState& d = *op->dist;
  const int me = runtime_.rank();
  std::set<int> written;
  for (std::size_t j = 0; j < d.hops.size(); ++j)
    if (d.hop_rank[j] == me && d.hops[j].dst.rank != static_cast<std::uint32_t>(me) && puts_over_ucx(d.hops[j].kind))
      written.insert(static_cast<int>(d.hops[j].dst.rank));
  if (written.empty()) {
    dist_segment_done(op);
    return;
  }
  auto left = std::make_shared<std::atomic<int>>(static_cast<int>(written.size()) + 1);
  std::shared_ptr<Hook> hook = hook_;
  auto on_last = [hook, op] {
    std::lock_guard lock(hook->mutex);
    if (Engine* engine = hook->engine) engine->post_control([engine, op] { engine->dist_segment_done(op); });
  };
  for (int rank : written) {
    auto* flush = new SegmentFlush{hook, op, on_last, left};
    try {
      if (network_->rma().flush(rank, {&SegmentFlush::done, flush}) == net::RmaStatus::done) SegmentFlush::done(flush, nullptr);
    } catch (const Error&) {
      SegmentFlush::done(flush, nullptr);  // the peer is lost: nothing of ours can land there any more
    }
  }
  if (left->fetch_sub(1, std::memory_order_acq_rel) == 1) dist_segment_done(op);
}

void Engine::dist_segment_done(const std::shared_ptr<CopyOperation>& op) {
  DistributedState& d = *op->dist;
  const int me = runtime_.rank();
  FailureCause failure;
  bool finish_now = false, report = false;
  std::vector<int> quiesced;
  {
    std::lock_guard lock(mutex_);
    if (d.segment_done) return;
    d.segment_done = true;
    quiesced.swap(d.quiesce_waiters);
    if (d.initiator == me) {
      if (const std::size_t index = d.index_of(me); index < d.participants.size()) d.peers[index] = DistributedState::Peer::done;
    } else {
      report = !d.orphaned;
      finish_now = d.orphaned || stopping_;
    }
  }
  // Ranks that hold buffers this rank put into: its puts are over and flushed.
  for (int rank : quiesced) send(rank, kQuiesced, id_body(d.id));
  if (d.initiator == me) {
    dist_check_complete(op);
    return;
  }
  {
    std::lock_guard lock(op->failure_mutex);
    failure = op->failure;
  }
  if (report) send(d.initiator, kDone, failure_body(d.id, failure));
  if (finish_now) dist_finish_local(op);
}

void Engine::dist_finish_local(const std::shared_ptr<CopyOperation>& op) {
  {
    std::lock_guard lock(mutex_);
    if (op->state == CopyOperation::State::finished) return;
    op->state = CopyOperation::State::finished;
  }
  finish(op);
}

// A participant stops its part: on `abort`, when a peer of the copy is lost, at shutdown.
void Engine::dist_abort_here(const std::shared_ptr<CopyOperation>& op, const FailureCause& cause) {
  DistributedState& d = *op->dist;
  std::vector<std::shared_ptr<CopyOperation>> retry;
  bool not_started = false;
  {
    std::lock_guard lock(mutex_);
    if (op->state == CopyOperation::State::finished) return;
    op->fail(cause);
    if (!d.started) {
      not_started = true;
      d.started = true;  // a late `go` starts nothing
      if (op->state == CopyOperation::State::waiting_buffers) {
        release_reservations(*op, retry);
        op->state = CopyOperation::State::running;
      }
    }
  }
  dist_readmit(retry);
  if (not_started) dist_segment_done(op);  // else its XDs retire at the next request boundary
}

void Engine::on_abort(int source, const std::vector<std::byte>& body) {
  net::WireReader in(body, fmt::format("copy abort from rank {}", source));
  auto id = in.get<std::uint64_t>();
  FailureCause cause = in.get_failure();
  auto op = dist_find(id);
  if (!op) {
    // Nothing here (it could not set up, or finished): the initiator still counts on an answer.
    send(source, kDone, failure_body(id, cause));
    return;
  }
  dist_abort_here(op, cause ? cause : make_failure(Errc::cancelled, "the copy was aborted by its initiator"));
}

void Engine::on_finished(int source, const std::vector<std::byte>& body) {
  net::WireReader in(body, fmt::format("copy finished from rank {}", source));
  auto op = dist_find(in.get<std::uint64_t>());
  const bool all_done = in.get<std::uint8_t>() == 1;
  in.expect_end();
  if (!op || op->dist->initiator != source) return;
  bool running = false;
  {
    std::lock_guard lock(mutex_);
    // The initiator may finish without waiting (at its shutdown): this rank's XDs may still
    // have requests in flight on these buffers. Stop them and finish when they have retired.
    if (!op->dist->segment_done) {
      op->dist->orphaned = true;
      running = true;
    } else {
      op->dist->clean = all_done;
    }
  }
  if (running) dist_abort_here(op, make_failure(Errc::cancelled, fmt::format("rank {} finished the copy", source)));
  else dist_finish_local(op);
}

// ------------------------------------------------------------------------ buffers other ranks put into

// From finish(), on the control thread. A part that ended cleanly (every rank's puts flushed)
// gives its buffers back as a local copy does. Otherwise another rank may still be putting into
// this rank's REG buffers: a third rank that has not yet heard that the initiator is lost, or
// whose requests are still in flight when the initiator shuts down without waiting. Pooled, a
// buffer would take that late put into the next copy's data; unregistered and freed, the put
// could still land in whatever is mapped at the address next (UCX over tcp and cma write by
// address). So such buffers wait in quarantine until each rank that puts into them answers
// `quiesce` or is gone.
void Engine::dist_hold_buffers(CopyOperation& op) {
  DistributedState& d = *op.dist;
  const int me = runtime_.rank();
  Quarantined held;
  std::uint64_t bytes = 0;
  for (std::size_t j = 0; j < op.buffers.size(); ++j) {
    auto& b = op.buffers[j];
    const int writer = d.hop_rank[j];  // buffer j is hop j's output
    // Buffers of this rank that another rank writes: REG (UCX puts) or GPU memory (IPC).
    if (d.clean || !b.storage || writer == me) continue;
    if (network_->peer_state(writer) == net::PeerState::alive) held.writers.insert(writer);
    bytes += b.storage->bytes();
    held.storages.push_back(std::move(b.storage));
  }
  if (held.storages.empty()) return;
  std::vector<int> ask(held.writers.begin(), held.writers.end());
  bool kept = false;
  {
    std::lock_guard lock(mutex_);
    // Every writer gone (lost, or shut down after its parts ended): nothing can land any more.
    // At shutdown nothing is pooled: the quarantine waits for the network (dist_close).
    kept = !ask.empty() || stopping_;
    if (kept) quarantine_[d.id] = std::move(held);
  }
  if (!kept) {
    for (auto& storage : held.storages) release_buffer(std::move(storage));
    return;
  }
  log::get("dma")->debug("copy {:x}: {} bytes of buffers held until rank(s) {} stop putting into them", d.id, bytes,
                         fmt::join(ask, ", "));
  for (int rank : ask) send(rank, kQuiesce, id_body(d.id));
}

// `writer` answered `quiesced` for copy `id` (or, with writer -1, ranks were lost): buffers
// no rank can put into any more go back to the pool.
void Engine::dist_release_quarantined(std::uint64_t id, int writer) {
  std::vector<std::shared_ptr<Storage>> released;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;  // see dist_hold_buffers
    for (auto it = quarantine_.begin(); it != quarantine_.end();) {
      Quarantined& q = it->second;
      if (writer >= 0 && it->first != id) {
        ++it;
        continue;
      }
      if (writer >= 0) q.writers.erase(writer);
      else std::erase_if(q.writers, [&](int r) { return network_->peer_state(r) != net::PeerState::alive; });
      if (!q.writers.empty()) {
        ++it;
        continue;
      }
      for (auto& storage : q.storages) released.push_back(std::move(storage));
      it = quarantine_.erase(it);
    }
  }
  for (auto& storage : released) release_buffer(std::move(storage));
}

// A participant whose part ended uncleanly asks: are your puts into my buffers over?
void Engine::on_quiesce(int source, const std::vector<std::byte>& body) {
  net::WireReader in(body, fmt::format("copy quiesce from rank {}", source));
  auto id = in.get<std::uint64_t>();
  in.expect_end();
  if (auto op = dist_find(id)) {
    std::lock_guard lock(mutex_);
    if (!op->dist->segment_done) {
      op->dist->quiesce_waiters.push_back(source);  // answered by dist_segment_done
      return;
    }
  }
  // Done and flushed, or finished; or never set up here, in which case this rank has not
  // answered `ready`, so it was never told `go`, and never will be: the asker's part ended
  // uncleanly because the initiator is lost or has finished the copy. (An asker that is itself
  // shutting down does not pool what it holds, whatever the answer.)
  send(source, kQuiesced, id_body(id));
}

void Engine::on_quiesced(int source, const std::vector<std::byte>& body) {
  net::WireReader in(body, fmt::format("copy quiesced from rank {}", source));
  auto id = in.get<std::uint64_t>();
  in.expect_end();
  dist_release_quarantined(id, source);
}

void Engine::dist_readmit(std::vector<std::shared_ptr<CopyOperation>>& retry) {
  std::vector<std::shared_ptr<CopyOperation>> started;
  {
    std::lock_guard lock(mutex_);
    for (auto& waiter : retry) {
      if (waiter->state != CopyOperation::State::waiting_buffers) continue;
      admit(waiter);
      if (waiter->state == CopyOperation::State::running && std::find(started.begin(), started.end(), waiter) == started.end())
        started.push_back(waiter);
    }
  }
  for (auto& op : started) start(op);
}

// ------------------------------------------------------------------------ progress between ranks

// A local XD finished a tile. If the next hop runs elsewhere, its rank learns that the tile
// landed (for puts once a flush says so; a GPU hop's requests have landed when they complete);
// if the previous hop runs elsewhere, its rank learns that a slot of the buffer it puts into is
// free again.
void Engine::dist_tile_progress(Xd* xd) {
  CopyOperation& op = *xd->op;
  DistributedState& d = *op.dist;
  const std::size_t n = op.xds.size();
  net::WireWriter out;
  out.put(d.id).put(static_cast<std::uint32_t>(xd->hop)).put(xd->tiles_done.load(std::memory_order_acquire));
  if (xd->hop + 1 < n && !op.xds[xd->hop + 1]->worker) {
    if (!puts_over_ucx(d.hops[xd->hop].kind)) {
      // A GPU hop into another rank's mapped memory: its requests completed on the stream, so
      // the bytes are there already.
      send(d.hop_rank[xd->hop + 1], kTiles, out.bytes());
    } else {
      const int rank = d.hop_rank[xd->hop + 1];
      // A failed flush fails the copy, if the engine (and so the copy's workers) still exists.
      auto on_failure = [hook = hook_, id = d.id](const FailureCause& failure) {
        std::lock_guard lock(hook->mutex);
        if (Engine* engine = hook->engine)
          if (auto failed = engine->dist_find(id)) failed->fail(failure);
      };
      auto* flush = new LandedFlush{std::move(on_failure), network_, rank,
                                    std::vector<std::byte>(out.bytes().begin(), out.bytes().end())};
      try {
        if (network_->rma().flush(rank, {&LandedFlush::done, flush}) == net::RmaStatus::done) LandedFlush::done(flush, nullptr);
      } catch (const Error&) {
        delete flush;  // the peer is lost; its listener fails the copy
      }
    }
  }
  if (xd->hop > 0 && !op.xds[xd->hop - 1]->worker) send(d.hop_rank[xd->hop - 1], kTiles, out.bytes());
}

void Engine::on_tiles(int source, std::span<const std::byte> body) {
  net::WireReader in(body, fmt::format("copy tiles from rank {}", source));
  auto id = in.get<std::uint64_t>();
  auto hop = in.get<std::uint32_t>();
  auto count = in.get<std::uint64_t>();
  auto op = dist_find(id);
  if (!op || hop >= op->xds.size()) return;
  Xd& mirror = *op->xds[hop];
  if (mirror.worker || op->dist->hop_rank[hop] != source) return;  // not a hop of the sender's
  // Messages may arrive out of order: the count only grows.
  std::uint64_t seen = mirror.tiles_done.load(std::memory_order_acquire);
  while (count > seen && !mirror.tiles_done.compare_exchange_weak(seen, count, std::memory_order_acq_rel)) {
  }
  op->touch();
  if (hop + 1 < op->xds.size() && op->xds[hop + 1]->worker) op->xds[hop + 1]->worker->wake();
  if (hop > 0 && op->xds[hop - 1]->worker) op->xds[hop - 1]->worker->wake();
}

// ------------------------------------------------------------------------ lost peers

void Engine::dist_peer_lost(int rank, const FailureCause& cause) {
  std::vector<std::shared_ptr<net::RemoteMemory>> dead_keys;  // released after the unlock
  std::vector<std::shared_ptr<std::byte>> dead_mappings;
  {
    std::lock_guard lock(mutex_);
    std::erase_if(gpu_mappings_, [&](auto& entry) {
      if (entry.first.first != rank) return false;
      dead_mappings.push_back(std::move(entry.second));
      return true;
    });
    for (auto it = remote_keys_.begin(); it != remote_keys_.end();) {
      if (it->first.first == rank) {
        dead_keys.push_back(std::move(it->second));
        it = remote_keys_.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::vector<std::shared_ptr<CopyOperation>> ops;
  {
    std::lock_guard lock(dist_mutex_);
    for (auto& [id, op] : dist_ops_) ops.push_back(op);
  }
  for (auto& op : ops) dist_peer_lost_for(op, rank, cause);
  dist_release_quarantined(0, -1);  // a lost rank puts no more
}

// What losing `rank` does to one copy of this rank's: the initiator fails it and counts the
// lost rank's part as done; a participant whose initiator is lost finishes alone.
void Engine::dist_peer_lost_for(const std::shared_ptr<CopyOperation>& op, int rank, const FailureCause& cause) {
  const int me = runtime_.rank();
  {
    DistributedState& d = *op->dist;
    const bool involved = d.initiator == rank || d.index_of(rank) < d.participants.size();
    if (!involved) return;
    if (d.initiator == me) {
      {
        std::lock_guard lock(mutex_);
        d.peers[d.index_of(rank)] = DistributedState::Peer::done;
      }
      dist_fail(op, cause);
      dist_check_complete(op);
      return;
    }
    bool finish_now = false;
    if (d.initiator == rank) {
      std::lock_guard lock(mutex_);
      d.orphaned = true;
      finish_now = d.segment_done;
    }
    if (finish_now) {
      op->fail(cause);
      dist_finish_local(op);
    } else {
      dist_abort_here(op, cause);
    }
  }
}

}  // namespace caravan::dma
