#include "runtime/net/network.h"
#include "runtime/deadline.h"

#include "runtime/log.h"
#include "runtime/net/launch.h"
#include "runtime/net/host_heap.h"
#include "runtime/net/remote_events.h"
#include "runtime/net/rma.h"
#include "runtime/net/ucx.h"
#include "runtime/runtime_impl.h"

#include <caravan/settings.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <cstring>
#include <ctime>
#include <random>

namespace caravan::net {
namespace {

using Clock = std::chrono::steady_clock;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// The pid namespace of this process: pids of peers are comparable only inside the same one.
std::uint64_t pid_namespace() {
  struct stat info {};
  if (stat("/proc/self/ns/pid", &info) != 0) return 0;
  return static_cast<std::uint64_t>(info.st_ino);
}

// This boot of this machine: host names repeat across machines (container images), and two
// processes compare pids, or share memory, only on the same one.
std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

std::chrono::nanoseconds seconds(double s) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(s));
}

}  // namespace

Network::Network(RuntimeImpl& runtime, const LaunchOptions& launch)
    : runtime_(runtime),
      launch_(launch),
      rank_(launch.rank),
      world_size_(launch.world_size),
      bootstrap_timeout_s_(settings::get_double("CARAVAN_BOOTSTRAP_TIMEOUT_S")),
      peer_timeout_s_(settings::get_double("CARAVAN_PEER_TIMEOUT_S")),
      shutdown_timeout_s_(settings::get_double("CARAVAN_SHUTDOWN_TIMEOUT_S")),
      heartbeat_(settings::get_int("CARAVAN_HEARTBEAT_MS")),
      peers_(new Peer[static_cast<std::size_t>(launch.world_size)]) {
  // A peer is judged by the heartbeats it sends (also checked by every caravan command).
  if (const std::string error = settings::peer_timeout_error(); !error.empty())
    throw Error(Errc::invalid_argument, error);
  Worker::Options options;
  options.tls = settings::get_string("CARAVAN_UCX_TLS");
  options.poll_us = static_cast<int>(settings::get_int("CARAVAN_UCX_POLL_US"));
  options.tick = heartbeat_;
  options.on_tick = [this] { tick(); };
  options.on_endpoint_error = [this](int rank, ucs_status_t status) { endpoint_error(rank, status); };
  worker_ = std::make_unique<Worker>(rank_, std::move(options));
  set_handler(static_cast<std::uint16_t>(MsgId::hello), [this](const AmMessage& m) { on_hello(m); });
  set_handler(static_cast<std::uint16_t>(MsgId::welcome), [this](const AmMessage& m) { on_welcome(m); });
  set_handler(static_cast<std::uint16_t>(MsgId::gather_part), [this](const AmMessage& m) { on_gather_part(m); });
  set_handler(static_cast<std::uint16_t>(MsgId::gather_result), [this](const AmMessage& m) { on_gather_result(m); });
  set_handler(static_cast<std::uint16_t>(MsgId::heartbeat), [](const AmMessage&) {});
  set_handler(static_cast<std::uint16_t>(MsgId::bye), [this](const AmMessage& m) {
    if (m.source < 0 || m.source >= world_size_ || m.source == rank_) return;
    lose_peer(m.source, make_failure(Errc::shut_down, fmt::format("{} shut down", describe(m.source))),
              PeerState::departed);
    if (rank_ == 0) fail_abandoned_gathers();
  });
  events_ = std::make_unique<RemoteEvents>(runtime_, *this);
  rma_ = std::make_unique<Rma>(*this);
}

Network::~Network() {
  // start() may have thrown half way: stop the progress thread before members go away, and
  // close the rendezvous endpoints (UCX refuses to destroy a worker with requests pending on
  // an endpoint that never connected).
  worker_->stop();
  close_rendezvous_endpoints();
  heap_.reset();
  if (rma_) rma_->shutdown(make_failure(Errc::shut_down, "the runtime failed to start"));
}

void Network::close_rendezvous_endpoints() {
  std::vector<ucp_ep_h> endpoints;
  {
    std::lock_guard lock(mutex_);
    endpoints.swap(rendezvous_eps_);
  }
  for (ucp_ep_h ep : endpoints) worker_->close(ep, true, std::chrono::milliseconds(200));
}

std::string Network::describe(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(ranks_.size())) return fmt::format("rank {}", rank);
  const RankInfo& info = ranks_[static_cast<std::size_t>(rank)];
  return fmt::format("rank {} (pid {} on {})", rank, info.pid, info.host);
}

void Network::set_handler(std::uint16_t id, AmHandler handler) {
  // Every message is a sign of life of its sender, whatever it carries.
  worker_->set_handler(id, [this, handler = std::move(handler)](const AmMessage& m) {
    note_alive(m.source);
    handler(m);
  });
}

bool Network::send(int rank, std::uint16_t id, std::span<const std::byte> body) {
  // A departed peer still progresses until every rank has said bye (it needs ours, at least);
  // a failed one gets nothing more.
  if (rank < 0 || rank >= world_size_ || peer_state(rank) == PeerState::failed) return false;
  return worker_->send(worker_->endpoint(rank), id, body);
}

void Network::note_alive(int source) {
  if (source >= 0 && source < world_size_) peers_[source].last_seen_ns.store(now_ns(), std::memory_order_relaxed);
}

FailureCause Network::peer_failure(int rank) const {
  std::lock_guard lock(mutex_);
  return peers_[rank].cause;
}

FailureCause Network::any_failure() const {
  for (int r = 0; r < world_size_; ++r)
    if (peer_state(r) == PeerState::failed) return peer_failure(r);
  return nullptr;
}

void Network::require_alive(int rank, std::string_view what) const {
  if (peer_state(rank) == PeerState::alive) return;
  FailureCause cause = peer_failure(rank);
  throw Error(cause ? cause->code() : Errc::transport,
              fmt::format("{}: {}", what, cause ? cause->what() : fmt::format("rank {} is lost", rank)));
}

void Network::add_peer_lost_listener(PeerLostListener listener) {
  std::lock_guard lock(listener_mutex_);
  listeners_.push_back(std::move(listener));
}

void Network::lose_peer(int rank, const FailureCause& cause, PeerState how) {
  {
    std::lock_guard lock(mutex_);
    PeerState expected = PeerState::alive;
    if (!peers_[rank].state.compare_exchange_strong(expected, how, std::memory_order_acq_rel)) return;
    peers_[rank].cause = cause;
  }
  cv_.notify_all();  // collectives waiting on this rank give up
  if (how == PeerState::failed) log::get("net")->error("rank {}: lost {}", rank_, cause->what());
  else log::get("net")->debug("rank {}: {}", rank_, cause->what());
  std::vector<PeerLostListener> listeners;
  {
    std::lock_guard lock(listener_mutex_);
    listeners = listeners_;
  }
  for (auto& listener : listeners) {
    try {
      listener(rank, cause);
    } catch (const std::exception& e) {
      log::get("net")->error("a peer-lost listener failed: {}", e.what());
    }
  }
}

void Network::endpoint_error(int rank, ucs_status_t status) {
  if (rank == -1) {  // our rendezvous endpoint to rank 0: retry (see rendezvous_as_joiner)
    {
      std::lock_guard lock(mutex_);
      joiner_endpoint_error_ = status;
    }
    cv_.notify_all();
    return;
  }
  if (rank < 0 || rank >= world_size_ || closing_.load(std::memory_order_acquire)) return;
  if (peer_state(rank) != PeerState::alive) return;
  lose_peer(rank,
            make_failure(Errc::transport, fmt::format("UCX reported {} ({}) on the endpoint to {}", ucs_status_name(status),
                                                      ucs_status_string(status), describe(rank))),
            PeerState::failed);
}

void Network::tick() {
  if (!connected_.load(std::memory_order_acquire)) return;
  const std::int64_t now = now_ns();
  const auto timeout_ns = static_cast<std::int64_t>(peer_timeout_s_ * 1e9);
  // This thread itself was held up (a long message handler, the machine overloaded): the peers'
  // heartbeats are still queued, unread. Judging them now would declare every peer failed, so
  // they get a fresh window instead.
  const std::int64_t since_tick = now - std::exchange(last_tick_ns_, now);
  if (since_tick > timeout_ns / 2) {
    log::get("net")->warn(
        "rank {}: the network's progress thread was held up for {:.1f} s; peers get a fresh {} s "
        "(CARAVAN_PEER_TIMEOUT_S) before they are judged",
        rank_, static_cast<double>(since_tick) / 1e9, peer_timeout_s_);
    for (int r = 0; r < world_size_; ++r) peers_[r].last_seen_ns.store(now, std::memory_order_relaxed);
  }
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_ || peer_state(r) != PeerState::alive) continue;
    worker_->send(worker_->endpoint(r), static_cast<std::uint16_t>(MsgId::heartbeat), {});
    std::int64_t silent = now - peers_[r].last_seen_ns.load(std::memory_order_relaxed);
    if (silent > timeout_ns) {
      lose_peer(r,
                make_failure(Errc::transport,
                             fmt::format("{} sent nothing for {:.1f} s (CARAVAN_PEER_TIMEOUT_S = {})", describe(r),
                                         static_cast<double>(silent) / 1e9, peer_timeout_s_)),
                PeerState::failed);
    } else if (peers_[r].same_process_namespace && kill(ranks_[r].pid, 0) != 0 && errno == ESRCH) {
      // A peer on this host whose process is gone: no need to wait for the timeout. Its bye
      // may still be waiting in our receive queue (it flushed it before exiting): drain the
      // worker first, so that a peer that shut down properly is not taken for a failed one.
      // Bounded: a peer streaming into this rank without pause would keep it here for ever.
      for (int i = 0; i < 100000 && ucp_worker_progress(worker_->worker()) != 0; ++i) {
      }
      if (peer_state(r) == PeerState::alive)
        lose_peer(r, make_failure(Errc::transport, fmt::format("{} has exited", describe(r))), PeerState::failed);
    }
  }
}

// UCX's error handling mode, per peer. PEER lets an endpoint survive its peer's failure (the
// error comes to endpoint_error) but, in UCX 1.13, excludes the shared-memory transports. NONE
// keeps them, but UCX aborts the process on some transport errors it cannot report (seen over
// tcp: a target serving an emulated put to a rank that just died). Between ranks of one host
// with shared memory allowed, NONE is safe in practice (shared-memory writes to a dead process
// do not fail) and the heartbeat notices the failure; elsewhere PEER is required.
std::vector<bool> Network::error_modes() const {
  std::string mode = settings::get_string("CARAVAN_UCX_ERROR_MODE");
  std::string tls = settings::get_string("CARAVAN_UCX_TLS");
  bool shared_memory = tls.empty() || tls[0] == '^';  // UCX's default, or an exclusion list
  for (std::string_view name : {"all", "sm", "shm", "posix", "sysv", "cma", "xpmem", "knem"})
    if (tls.find(name) != std::string::npos) shared_memory = true;
  std::vector<bool> peer(static_cast<std::size_t>(world_size_));
  for (int r = 0; r < world_size_; ++r)
    peer[static_cast<std::size_t>(r)] = mode == "peer" || (mode == "auto" && !(same_machine(r) && shared_memory));
  return peer;
}

// --- rendezvous ---

void Network::start() {
  worker_->start();
  auto deadline = Clock::now() + seconds(bootstrap_timeout_s_);
  if (rank_ == 0) rendezvous_as_root(deadline);
  else rendezvous_as_joiner(deadline);

  std::vector<std::vector<std::byte>> addresses;
  {
    std::lock_guard lock(mutex_);
    apply_table(welcome_);
    addresses.resize(joined_.size());
    for (std::size_t r = 0; r < joined_.size(); ++r) addresses[r] = joined_[r].address;
  }
  worker_->connect_all(addresses, error_modes());
  last_tick_ns_ = now_ns();  // read by tick() once connected_ is set
  for (int r = 0; r < world_size_; ++r) {
    peers_[r].last_seen_ns.store(now_ns(), std::memory_order_relaxed);
    peers_[r].same_process_namespace =
        same_machine(r) && joined_[r].pid_namespace == joined_[rank_].pid_namespace && r != rank_;
  }
  connected_.store(true, std::memory_order_release);
  // Every endpoint carries messages before the rendezvous endpoints go away.
  auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now());
  barrier(std::max(left, std::chrono::nanoseconds(std::chrono::seconds(1))));
  // Joiners close their rendezvous endpoint now; rank 0 keeps its side until the job ends.
  // Whoever closes a TCP connection first keeps its port in TIME_WAIT, and rank 0 must be able
  // to listen on MASTER_PORT again in the next job on this host.
  if (rank_ != 0) close_rendezvous_endpoints();
  worker_->stop_listening();
  // Every rank must size its part of the heap alike: a rank with another size (or none) would
  // place the parts of its node elsewhere and write into its neighbours' data, or skip the
  // heap's collectives and pair every later one wrongly.
  const std::uint64_t bytes = settings::get_bytes("CARAVAN_SYMMETRIC_HEAP_BYTES");
  {
    // The whole bootstrap timeout again, not what is left of it: on a loaded machine the ranks
    // may arrive here with little left, and the exchange must not fail the start for that.
    const auto parts = allgather(
        std::as_bytes(std::span<const std::uint64_t, 1>(&bytes, 1)),
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(bootstrap_timeout_s_)),
        "the heap size");
    for (std::size_t r = 0; r < parts.size(); ++r) {
      std::uint64_t theirs = 0;
      if (parts[r].size() == sizeof theirs) std::memcpy(&theirs, parts[r].data(), sizeof theirs);
      if (theirs != bytes)
        throw Error(Errc::invalid_argument,
                    fmt::format("CARAVAN_SYMMETRIC_HEAP_BYTES differs between ranks: rank {} has {}, rank {} has {}; "
                                "every rank of a job must set the same",
                                rank_, bytes, r, theirs));
    }
  }
  if (bytes > 0) heap_ = std::make_unique<HostHeap>(this, bytes);
  log::get("net")->info("rank {}/{} joined job {} ({} node(s), {})", rank_, world_size_, job_id_, node_count_,
                        worker_->transports());
}

void Network::rendezvous_as_root(Clock::time_point deadline) {
  {
    std::lock_guard lock(mutex_);
    joined_.assign(static_cast<std::size_t>(world_size_), Joined{});
    Joined& self = joined_[0];
    self.present = true;
    self.pid = static_cast<std::uint32_t>(getpid());
    self.pid_namespace = pid_namespace();
    self.node_key = launch_.node_key;
    self.host = host_name();
    self.boot_id = boot_id();
    self.address = worker_->address();
    joined_count_ = 1;
    std::random_device random;
    job_id_ = !launch_.job_id.empty()
                  ? launch_.job_id
                  : fmt::format("{:x}{:04x}", static_cast<std::uint64_t>(std::time(nullptr)), random() & 0xFFFF);
  }
  worker_->listen(launch_.master_addr, launch_.master_port, [this](ucp_conn_request_h request) {
    try {
      ucp_ep_h ep = worker_->accept(request);
      std::lock_guard lock(mutex_);
      rendezvous_eps_.push_back(ep);
    } catch (const std::exception& e) {
      log::get("net")->warn("rank 0: could not accept a rendezvous connection: {}", e.what());
    }
  });
  std::unique_lock lock(mutex_);
  if (!cv_.wait_until(lock, deadline, [&] { return welcomed_; })) {
    std::vector<int> missing;
    for (int r = 0; r < world_size_; ++r)
      if (!joined_[static_cast<std::size_t>(r)].present) missing.push_back(r);
    throw Error(Errc::timeout,
                fmt::format("rank 0: rank(s) {} did not join at {}:{} within {} s (CARAVAN_BOOTSTRAP_TIMEOUT_S)",
                            fmt::join(missing, ", "), launch_.master_addr, launch_.master_port, bootstrap_timeout_s_));
  }
  if (!rendezvous_error_.empty()) throw Error(Errc::invalid_argument, rendezvous_error_);
}

void Network::rendezvous_as_joiner(Clock::time_point deadline) {
  WireWriter hello;
  hello.put(static_cast<std::uint32_t>(rank_))
      .put(static_cast<std::uint32_t>(world_size_))
      .put(static_cast<std::uint32_t>(getpid()))
      .put(pid_namespace())
      .put_string(launch_.node_key)
      .put_string(host_name())
      .put_string(boot_id())
      .put_bytes(worker_->address());
  ucs_status_t last_error = UCS_OK;
  int attempts = 0;
  for (;;) {
    // Rank 0 may not be listening yet: a connection error means "try again shortly".
    ucp_ep_h ep = nullptr;
    {
      std::lock_guard lock(mutex_);
      joiner_endpoint_error_ = UCS_OK;
    }
    ++attempts;
    ep = worker_->connect_sockaddr(launch_.master_addr, launch_.master_port);
    {
      std::lock_guard lock(mutex_);
      rendezvous_eps_.push_back(ep);
    }
    worker_->send(ep, static_cast<std::uint16_t>(MsgId::hello), hello.bytes(), true);
    std::unique_lock lock(mutex_);
    // The welcome comes when *every* rank has joined, which may take long; only an error on
    // the endpoint (nobody listening) makes us try again.
    cv_.wait_until(lock, deadline, [&] { return welcomed_ || joiner_endpoint_error_ != UCS_OK; });
    if (welcomed_) break;
    if (joiner_endpoint_error_ != UCS_OK) last_error = joiner_endpoint_error_;
    if (Clock::now() >= deadline)
      throw Error(Errc::timeout,
                  fmt::format("rank {}: no welcome from rank 0 at {}:{} within {} s (CARAVAN_BOOTSTRAP_TIMEOUT_S; {} "
                              "attempt(s), last UCX status {})",
                              rank_, launch_.master_addr, launch_.master_port, bootstrap_timeout_s_, attempts,
                              ucs_status_name(last_error)));
    std::erase(rendezvous_eps_, ep);
    lock.unlock();
    worker_->close(ep, true, std::chrono::milliseconds(200));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::lock_guard lock(mutex_);
  if (!rendezvous_error_.empty()) throw Error(Errc::invalid_argument, rendezvous_error_);
}

void Network::on_hello(const AmMessage& message) {
  WireReader in(message.body, "hello");
  auto rank = static_cast<int>(in.get<std::uint32_t>());
  auto world = static_cast<int>(in.get<std::uint32_t>());
  Joined joiner;
  joiner.present = true;
  joiner.pid = in.get<std::uint32_t>();
  joiner.pid_namespace = in.get<std::uint64_t>();
  joiner.node_key = in.get_string();
  joiner.host = in.get_string();
  joiner.boot_id = in.get_string();
  auto address = in.get_bytes();
  joiner.address.assign(address.begin(), address.end());
  joiner.reply_ep = message.reply_ep;
  std::lock_guard lock(mutex_);
  if (rank_ != 0 || joined_.empty()) return;
  if (welcomed_) {
    // A retry from a joiner whose first welcome is still on its way: answer again.
    worker_->send(message.reply_ep, static_cast<std::uint16_t>(MsgId::welcome), welcome_);
    return;
  }
  if (world != world_size_) {
    rendezvous_error_ = fmt::format("rank {} (pid {} on {}) has WORLD_SIZE={}, but rank 0 has {}", rank, joiner.pid,
                                    joiner.host, world, world_size_);
  } else if (rank <= 0 || rank >= world_size_) {
    rendezvous_error_ = fmt::format("a process (pid {} on {}) joined as rank {}, outside [1, {})", joiner.pid,
                                    joiner.host, rank, world_size_);
  } else {
    Joined& slot = joined_[static_cast<std::size_t>(rank)];
    if (slot.present && (slot.pid != joiner.pid || slot.host != joiner.host)) {
      rendezvous_error_ = fmt::format("rank {} was claimed by two processes (pid {} on {} and pid {} on {})", rank,
                                      slot.pid, slot.host, joiner.pid, joiner.host);
    } else {
      if (!slot.present) ++joined_count_;
      slot = std::move(joiner);
    }
  }
  if (rendezvous_error_.empty() && joined_count_ < world_size_) return;
  finish_rendezvous_locked();
  // The process refused (a wrong rank or world size, a rank claimed twice) holds no slot: it
  // learns why here instead of waiting out CARAVAN_BOOTSTRAP_TIMEOUT_S.
  if (!rendezvous_error_.empty() && message.reply_ep)
    worker_->send(message.reply_ep, static_cast<std::uint16_t>(MsgId::welcome), welcome_);
  // Sending with mutex_ held is safe here only because this is the progress thread, which
  // already holds UCX's (recursive) worker lock.
}

void Network::finish_rendezvous_locked() {
  WireWriter out;
  out.put(static_cast<std::uint8_t>(rendezvous_error_.empty() ? 1 : 0));
  if (!rendezvous_error_.empty()) {
    out.put_string(rendezvous_error_);
  } else {
    out.put_string(job_id_).put(static_cast<std::uint32_t>(world_size_));
    for (const Joined& j : joined_)
      out.put(j.pid)
          .put(j.pid_namespace)
          .put_string(j.node_key)
          .put_string(j.host)
          .put_string(j.boot_id)
          .put_bytes(j.address);
  }
  welcome_ = out.take();
  welcomed_ = true;
  for (const Joined& j : joined_)
    if (j.reply_ep) worker_->send(j.reply_ep, static_cast<std::uint16_t>(MsgId::welcome), welcome_);
  cv_.notify_all();
}

void Network::on_welcome(const AmMessage& message) {
  std::lock_guard lock(mutex_);
  if (welcomed_ || rank_ == 0) return;
  welcome_.assign(message.body.begin(), message.body.end());
  WireReader in(welcome_, "welcome");
  if (in.get<std::uint8_t>() == 0) rendezvous_error_ = "rank 0 refused the job: " + in.get_string();
  welcomed_ = true;
  cv_.notify_all();
}

void Network::apply_table(std::span<const std::byte> welcome) {
  WireReader in(welcome, "welcome");
  in.get<std::uint8_t>();
  job_id_ = in.get_string();
  auto world = static_cast<int>(in.get<std::uint32_t>());
  if (world != world_size_)
    throw Error(Errc::internal, fmt::format("welcome lists {} ranks, this rank expects {}", world, world_size_));
  joined_.assign(static_cast<std::size_t>(world), Joined{});
  ranks_.assign(static_cast<std::size_t>(world), RankInfo{});
  std::map<std::string, int> node_of_key;
  std::vector<int> node_sizes;
  for (int r = 0; r < world; ++r) {
    Joined& j = joined_[static_cast<std::size_t>(r)];
    j.present = true;
    j.pid = in.get<std::uint32_t>();
    j.pid_namespace = in.get<std::uint64_t>();
    j.node_key = in.get_string();
    j.host = in.get_string();
    j.boot_id = in.get_string();
    auto address = in.get_bytes();
    j.address.assign(address.begin(), address.end());
    // Nodes are numbered in order of their lowest rank, so every rank computes the same table.
    auto [it, fresh] = node_of_key.emplace(j.node_key, static_cast<int>(node_sizes.size()));
    if (fresh) node_sizes.push_back(0);
    RankInfo& info = ranks_[static_cast<std::size_t>(r)];
    info.rank = r;
    info.node = it->second;
    info.local_rank = node_sizes[static_cast<std::size_t>(it->second)]++;
    info.host = j.host;
    info.pid = static_cast<int>(j.pid);
  }
  node_count_ = static_cast<int>(node_sizes.size());
  in.expect_end();
}

// --- collectives ---
//
// An allgather goes through rank 0: each rank sends `gather_part` (sequence number, bytes);
// when rank 0 holds all parts of a sequence number it sends `gather_result` to everyone.
// Sequence numbers count collective calls per rank, so every rank must call collectives in the
// same order (as with MPI). Parts of later collectives may arrive before earlier ones end;
// they wait in `gathers_` under their own number.
//
// Who may end a collective early: a *failed* rank ends every collective at once, everywhere.
// A rank that *shut down* has contributed to every collective it ever will (it flushes its
// messages before its bye, so rank 0 sees its parts before its bye); only rank 0 can tell
// which collectives now lack a part for good, and it answers those with a failed
// `gather_result`. Other ranks therefore wait for rank 0's answer even after a peer's bye
// (whose bye may overtake rank 0's result), unless rank 0 itself is gone.

std::vector<std::vector<std::byte>> Network::allgather(std::span<const std::byte> mine,
                                                       std::optional<std::chrono::nanoseconds> timeout,
                                                       std::string_view what) {
  if (worker_->on_progress_thread())
    throw Error(Errc::invalid_argument,
                fmt::format("{}: a collective cannot run on the network's progress thread (where Event::on_trigger "
                            "callbacks of remote events run; callbacks must not block)",
                            what));
  auto failed_peer = [&]() -> int {
    for (int r = 0; r < world_size_; ++r)
      if (r != rank_ && peer_state(r) == PeerState::failed) return r;
    return -1;
  };
  // This rank shutting down ends the wait too: nothing waits for it here, and a thread still
  // in a collective would outlive the Network (its shutdown waits for the callers to leave).
  auto leaving = [&] { return shut_down_.load(std::memory_order_acquire) || !runtime_.accepting_work(); };
  auto give_up = [&]() { return leaving() || failed_peer() >= 0 || (rank_ != 0 && peer_state(0) != PeerState::alive); };
  auto fail = [&](std::uint64_t seq) {
    if (leaving())
      throw Error(Errc::shut_down,
                  fmt::format("{}: collective #{} abandoned: rank {} is shutting down", what, seq, rank_));
    int lost = failed_peer() >= 0 ? failed_peer() : 0;
    FailureCause cause = peer_failure(lost);
    throw Error(cause ? cause->code() : Errc::transport,
                fmt::format("{}: collective #{} cannot complete: {}", what, seq, cause ? cause->what() : "a rank is lost"));
  };
  std::uint64_t seq = 0;
  std::vector<std::byte> result;
  {
    std::lock_guard lock(mutex_);
    ++collective_callers_;
  }
  const auto leave = [this](void*) {
    {
      std::lock_guard lock(mutex_);
      --collective_callers_;
    }
    cv_.notify_all();
  };
  const std::unique_ptr<void, decltype(leave)> left(this, leave);
  {
    std::lock_guard lock(mutex_);
    seq = next_gather_++;
    if (rank_ == 0) result = add_part_locked(seq, 0, std::vector<std::byte>(mine.begin(), mine.end()));
  }
  broadcast_result(result);
  if (give_up()) fail(seq);
  if (rank_ != 0) {
    WireWriter out;
    out.put(seq).put_bytes(mine);
    send(0, static_cast<std::uint16_t>(MsgId::gather_part), out.bytes());
  }
  std::unique_lock lock(mutex_);
  auto done = [&] { return results_.count(seq) > 0 || give_up(); };
  if (timeout) {
    if (!cv_.wait_until(lock, detail::deadline_after(*timeout), done))
      throw Error(Errc::timeout,
                  fmt::format("{}: collective #{} did not complete within {:.3f} s on rank {}", what, seq,
                              std::chrono::duration<double>(*timeout).count(), rank_));
  } else {
    cv_.wait(lock, done);
  }
  auto it = results_.find(seq);
  if (it != results_.end()) {
    GatherResult out = std::move(it->second);
    results_.erase(it);
    if (!out.error.empty()) throw Error(Errc::shut_down, fmt::format("{}: {}", what, out.error));
    return std::move(out.parts);
  }
  lock.unlock();
  fail(seq);
  return {};
}

void Network::barrier(std::optional<std::chrono::nanoseconds> timeout) { allgather({}, timeout, "barrier"); }

// Never call UCX with mutex_ held: a handler that takes mutex_ runs inside ucp_worker_progress,
// holding UCX's worker lock, so a thread that held mutex_ and then waited for the worker lock
// would deadlock with it. Hence results are sent by the caller, after unlocking.
void Network::broadcast_result(const std::vector<std::byte>& result) {
  if (result.empty()) return;
  for (int r = 1; r < world_size_; ++r) send(r, static_cast<std::uint16_t>(MsgId::gather_result), result);
}

std::vector<std::byte> Network::add_part_locked(std::uint64_t seq, int source, std::vector<std::byte> bytes) {
  Gather& gather = gathers_[seq];
  if (gather.parts.empty()) gather.parts.resize(static_cast<std::size_t>(world_size_));
  auto& slot = gather.parts[static_cast<std::size_t>(source)];
  if (slot) {
    log::get("net")->error("rank {} sent part of collective #{} twice (ignored)", source, seq);
    return {};
  }
  slot = std::move(bytes);
  ++gather.count;
  return finish_gather_locked(seq);
}

// Rank 0: completes collective `seq` if it has every part, or fails it if a rank that shut
// down never gave one. Returns the gather_result body to broadcast (empty: nothing yet).
std::vector<std::byte> Network::finish_gather_locked(std::uint64_t seq) {
  auto it = gathers_.find(seq);
  if (it == gathers_.end()) return {};
  Gather& gather = it->second;
  WireWriter out;
  out.put(seq);
  GatherResult result;
  if (gather.count == world_size_) {
    out.put(std::uint8_t{1});
    for (auto& part : gather.parts) {
      out.put_bytes(*part);
      result.parts.push_back(std::move(*part));
    }
  } else {
    int missing = -1;
    for (int r = 1; r < world_size_ && missing < 0; ++r)
      if (!gather.parts[static_cast<std::size_t>(r)] && peer_state(r) == PeerState::departed) missing = r;
    if (missing < 0) return {};
    result.error = fmt::format("collective #{} cannot complete: {} shut down without joining it", seq, describe(missing));
    out.put(std::uint8_t{0}).put_string(result.error);
  }
  gathers_.erase(it);
  results_[seq] = std::move(result);
  cv_.notify_all();
  return out.take();
}

void Network::fail_abandoned_gathers() {
  std::vector<std::vector<std::byte>> results;
  {
    std::lock_guard lock(mutex_);
    std::vector<std::uint64_t> open;
    for (auto& [seq, gather] : gathers_) open.push_back(seq);
    for (std::uint64_t seq : open)
      if (auto body = finish_gather_locked(seq); !body.empty()) results.push_back(std::move(body));
  }
  for (auto& body : results) broadcast_result(body);
}

void Network::on_gather_part(const AmMessage& message) {
  if (message.source <= 0 || message.source >= world_size_ || rank_ != 0) return;
  WireReader in(message.body, fmt::format("gather_part from rank {}", message.source));
  auto seq = in.get<std::uint64_t>();
  auto bytes = in.get_bytes();
  std::vector<std::byte> result;
  {
    std::lock_guard lock(mutex_);
    result = add_part_locked(seq, message.source, std::vector<std::byte>(bytes.begin(), bytes.end()));
  }
  broadcast_result(result);
}

void Network::on_gather_result(const AmMessage& message) {
  WireReader in(message.body, "gather_result");
  auto seq = in.get<std::uint64_t>();
  GatherResult result;
  if (in.get<std::uint8_t>() == 1) {
    for (int r = 0; r < world_size_; ++r) {
      auto bytes = in.get_bytes();
      result.parts.emplace_back(bytes.begin(), bytes.end());
    }
  } else {
    result.error = in.get_string();
  }
  in.expect_end();
  {
    std::lock_guard lock(mutex_);
    results_[seq] = std::move(result);
  }
  cv_.notify_all();
}

// --- shutdown ---

void Network::wake_collectives() {
  { std::lock_guard lock(mutex_); }
  cv_.notify_all();
}

void Network::shutdown() {
  if (shut_down_.exchange(true)) return;
  wake_collectives();  // collectives in progress here give up (Errc::shut_down)
  if (!connected_.load(std::memory_order_acquire)) {
    worker_->stop();
    return;
  }
  auto logger = log::get("net");
  auto deadline = Clock::now() + seconds(shutdown_timeout_s_);
  // The runtime has just poisoned its pending events, which queued notifications to peers.
  // Flush them out first, so that they are delivered before our bye (the bye tells peers that
  // nothing more will come from us).
  ucp_request_param_t flush{};
  worker_->wait(ucp_worker_flush_nbx(worker_->worker(), &flush), std::chrono::milliseconds(1000));
  for (int r = 0; r < world_size_; ++r)
    if (r != rank_) send(r, static_cast<std::uint16_t>(MsgId::bye), {});
  // The byes must be out before this rank can exit: a peer that never gets ours would take our
  // exit for a failure.
  worker_->wait(ucp_worker_flush_nbx(worker_->worker(), &flush), std::chrono::milliseconds(1000));
  // Serve the peers (their subscriptions, and over tcp their RMA, which our progress
  // emulates) until each has said bye or is lost.
  {
    std::unique_lock lock(mutex_);
    bool all_gone = cv_.wait_until(lock, deadline, [&] {
      for (int r = 0; r < world_size_; ++r)
        if (r != rank_ && peer_state(r) == PeerState::alive) return false;
      return true;
    });
    if (!all_gone) {
      std::vector<int> alive;
      for (int r = 0; r < world_size_; ++r)
        if (r != rank_ && peer_state(r) == PeerState::alive) alive.push_back(r);
      logger->warn("rank {}: rank(s) {} had not shut down after {} s (CARAVAN_SHUTDOWN_TIMEOUT_S); closing anyway",
                   rank_, fmt::join(alive, ", "), shutdown_timeout_s_);
    }
  }
  closing_.store(true, std::memory_order_release);
  // Whatever still waits on a peer now fails rather than hangs.
  for (int r = 0; r < world_size_; ++r)
    if (r != rank_)
      lose_peer(r, make_failure(Errc::shut_down, fmt::format("rank {} shut down while {} was still running", rank_,
                                                             describe(r))),
                PeerState::departed);
  {
    // Threads still in a collective have been woken and are leaving; the Network must outlive them.
    std::unique_lock lock(mutex_);
    if (!cv_.wait_for(lock, std::chrono::seconds(5), [&] { return collective_callers_ == 0; }))
      logger->warn("rank {}: {} thread(s) still in a collective after 5 s of shutting down", rank_,
                   collective_callers_);
  }
  if (heap_) heap_->release_registrations();
  // The progress thread stops before the RMA layer lets go of what it still holds: an operation
  // completing there could free a registration (its last reference) under that release.
  worker_->stop();
  rma_->shutdown(make_failure(Errc::shut_down, fmt::format("rank {} shut down", rank_)));
  worker_->close_all(std::vector<bool>(static_cast<std::size_t>(world_size_), true), std::chrono::milliseconds(500));
  close_rendezvous_endpoints();
  logger->info("rank {}: network shut down", rank_);
}

}  // namespace caravan::net
