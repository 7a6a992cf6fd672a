// Network: what one rank of a distributed job owns (runtime/net, namespace caravan::net).
//
// Object graph:
//   RuntimeImpl -> Network (this file): rendezvous, rank table, liveness, collectives
//                    -> Worker (worker.h): UCX context/worker, endpoints, progress thread, AM dispatch
//                    -> RemoteEvents (remote_events.h): event proxies, remote trigger, remote spawn
//                    -> Rma (rma.h): registered memory, remote keys, put/get/atomics, flush/fence
//                    -> HostHeap (symmetric_heap.cpp): the node's POSIX shared-memory symmetric heap
//
// Rendezvous (through UCX itself): rank 0 listens on MASTER_ADDR:MASTER_PORT with a UCX
// listener; every other rank connects a client endpoint there and sends `hello` (its rank,
// node key, host, pid and UCX worker address). When all have joined, rank 0 answers each with
// `welcome`: the whole table. Every rank then creates one endpoint per rank from the worker
// addresses, and a first barrier over those endpoints proves that all of them carry messages
// before the rendezvous endpoints and the listener are closed. A joiner that finds nobody
// listening yet retries until CARAVAN_BOOTSTRAP_TIMEOUT_S.
//
// Liveness: every CARAVAN_HEARTBEAT_MS the progress thread sends `heartbeat` to each live peer;
// any message from a peer counts as a sign of life. A peer is lost when it has sent nothing for
// CARAVAN_PEER_TIMEOUT_S, when UCX reports an error on its endpoint, or (a peer on this host,
// in this pid namespace) when its process no longer exists. A peer that shuts down says `bye`
// first, so that its silence afterwards is not a failure. Losing a peer runs every listener
// once (event proxies, remote spawns, RMA operations, collectives...), which poisons the work
// that depended on it with an Errc::transport cause naming the rank.
#pragma once

#include "runtime/net/worker.h"

#include <caravan/error.h>
#include <caravan/runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace caravan {
class RuntimeImpl;
}

namespace caravan::net {

class RemoteEvents;
class Rma;
class HostHeap;

enum class PeerState : std::uint8_t { alive, failed, departed };

class Network {
 public:
  Network(RuntimeImpl& runtime, const LaunchOptions& launch);
  ~Network();
  Network(const Network&) = delete;
  Network& operator=(const Network&) = delete;

  // The rendezvous, endpoints, first barrier, and the parts built on them. Throws Error
  // (timeout, transport, invalid_argument) when the job cannot form.
  void start();
  // Says bye, serves peers until they have all said bye (or CARAVAN_SHUTDOWN_TIMEOUT_S),
  // poisons what still waits on them, and releases UCX. Idempotent.
  void shutdown();
  // The runtime has begun to shut down: collectives waiting here end with Error(shut_down).
  void wake_collectives();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::vector<RankInfo>& ranks() const { return ranks_; }
  int node_count() const { return node_count_; }
  const std::string& job_id() const { return job_id_; }
  Worker& worker() { return *worker_; }
  RuntimeImpl& runtime() { return runtime_; }
  RemoteEvents& events() { return *events_; }
  Rma& rma() { return *rma_; }
  HostHeap* heap() { return heap_.get(); }  // nullptr when CARAVAN_SYMMETRIC_HEAP_BYTES is 0

  // Messages for other parts: `handler` runs on the progress thread (see Worker).
  void set_handler(std::uint16_t id, AmHandler handler);
  // Sends to `rank`; false (nothing sent) if that rank failed or UCX refused.
  bool send(int rank, std::uint16_t id, std::span<const std::byte> body);

  PeerState peer_state(int rank) const { return peers_[rank].state.load(std::memory_order_acquire); }
  // Why `rank` is lost, or nullptr while it is alive.
  FailureCause peer_failure(int rank) const;
  // The first failed (not departed) peer's cause, or nullptr.
  FailureCause any_failure() const;
  // Throws the cause of `rank` if it is lost (for calls that are about to need it).
  void require_alive(int rank, std::string_view what) const;

  // Called once per lost peer, on the thread that noticed (usually the progress thread);
  // must not block. Listeners are never removed.
  using PeerLostListener = std::function<void(int rank, const FailureCause& cause)>;
  void add_peer_lost_listener(PeerLostListener listener);

  // Collective (every rank calls it, in the same order): each rank's bytes, by rank.
  // Throws Error(transport) if a rank fails first, Error(shut_down) if one left, Error(timeout)
  // when `timeout` runs out. `what` names it in errors.
  std::vector<std::vector<std::byte>> allgather(std::span<const std::byte> mine,
                                                std::optional<std::chrono::nanoseconds> timeout, std::string_view what);
  void barrier(std::optional<std::chrono::nanoseconds> timeout);

  // Marks `rank` lost (used by the liveness checks and by tests of them).
  void lose_peer(int rank, const FailureCause& cause, PeerState how);

 private:
  struct Peer {
    std::atomic<PeerState> state{PeerState::alive};
    std::atomic<std::int64_t> last_seen_ns{0};
    FailureCause cause;  // guarded by mutex_
    bool same_process_namespace = false;
  };
  struct Joined {  // rank 0's record of a joiner during the rendezvous
    bool present = false;
    std::uint32_t pid = 0;
    std::uint64_t pid_namespace = 0;
    std::string node_key, host;
    std::string boot_id;  // with the host name, tells machines apart (see same_machine)
    std::vector<std::byte> address;
    ucp_ep_h reply_ep = nullptr;
  };
  struct Gather {
    std::vector<std::optional<std::vector<std::byte>>> parts;
    int count = 0;
  };

  void note_alive(int source);
  void tick();
  void endpoint_error(int rank, ucs_status_t status);
  void on_hello(const AmMessage& message);
  void on_welcome(const AmMessage& message);
  void on_gather_part(const AmMessage& message);
  void on_gather_result(const AmMessage& message);
  void finish_rendezvous_locked();
  void apply_table(std::span<const std::byte> welcome);
  // Stores a part; returns the gather_result body to broadcast when the collective is complete.
  std::vector<std::byte> add_part_locked(std::uint64_t seq, int source, std::vector<std::byte> bytes);
  void broadcast_result(const std::vector<std::byte>& result);
  std::vector<std::byte> finish_gather_locked(std::uint64_t seq);
  void fail_abandoned_gathers();
  void rendezvous_as_root(std::chrono::steady_clock::time_point deadline);
  void rendezvous_as_joiner(std::chrono::steady_clock::time_point deadline);
  void close_rendezvous_endpoints();
  std::vector<bool> error_modes() const;
  // Rank r runs on this machine and boot (its pids and shared memory are ours to use).
  bool same_machine(int r) const {
    return ranks_[static_cast<std::size_t>(r)].host == ranks_[static_cast<std::size_t>(rank_)].host &&
           joined_[static_cast<std::size_t>(r)].boot_id == joined_[static_cast<std::size_t>(rank_)].boot_id;
  }
  std::string describe(int rank) const;

  RuntimeImpl& runtime_;
  const LaunchOptions launch_;
  const int rank_;
  const int world_size_;
  const double bootstrap_timeout_s_;
  const double peer_timeout_s_;
  const double shutdown_timeout_s_;
  const std::chrono::milliseconds heartbeat_;
  std::unique_ptr<Peer[]> peers_;
  std::unique_ptr<Worker> worker_;
  std::vector<RankInfo> ranks_;
  int node_count_ = 1;
  std::string job_id_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  // Rendezvous state, guarded by mutex_.
  std::vector<Joined> joined_;
  int joined_count_ = 0;
  bool welcomed_ = false;
  std::vector<std::byte> welcome_;
  std::string rendezvous_error_;
  ucs_status_t joiner_endpoint_error_ = UCS_OK;
  std::vector<ucp_ep_h> rendezvous_eps_;
  // Collectives, guarded by mutex_.
  std::uint64_t next_gather_ = 0;
  std::map<std::uint64_t, Gather> gathers_;  // rank 0: collectives being assembled
  struct GatherResult {
    std::vector<std::vector<std::byte>> parts;
    std::string error;  // set when the collective cannot complete
  };
  std::map<std::uint64_t, GatherResult> results_;

  std::mutex listener_mutex_;
  std::vector<PeerLostListener> listeners_;
  std::atomic<bool> connected_{false};
  std::atomic<bool> closing_{false};
  std::atomic<bool> shut_down_{false};
  std::int64_t last_tick_ns_ = 0;  // the progress thread's last tick (tick() only, after start)
  int collective_callers_ = 0;  // threads inside allgather (under mutex_): shutdown waits for them

  std::unique_ptr<RemoteEvents> events_;
  std::unique_ptr<Rma> rma_;  // destroyed before worker_: it releases UCX objects
  std::unique_ptr<HostHeap> heap_;  // destroyed before rma_: it holds registrations
};

}  // namespace caravan::net
