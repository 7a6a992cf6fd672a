// Distributed events and remote task spawn.
//
// An Event names its owner rank, so a handle can travel anywhere; only the owner's table holds
// its state. Another rank uses it through a *proxy*: a local event that triggers when the
// remote one does. The first use of a remote event on a rank creates the proxy and sends
// `subscribe` to the owner; the owner registers a waiter on the event (immediately satisfied
// if it has already triggered) that answers `notify` with the outcome, and the subscriber
// triggers its proxy with it (poisoned with the same code and message if it failed). Waits,
// preconditions, merges and callbacks on a remote event are then the local ones on its proxy,
// so the single-rank code paths are reused unchanged. One subscription per (rank, event):
// later uses find the proxy in a map; triggered proxies stay in the map for a while (the most
// recent kKeptTriggeredProxies) so that query() keeps answering "triggered" without a new round
// trip. Messages need no ordering: a notify for an unknown or already triggered proxy is dropped.
//
// Triggering a remote user event sends `trigger` to the owner; it is asynchronous, so a second
// trigger of the same event is reported in the owner's log rather than thrown to the caller.
//
// Remote spawn: the spawner creates the completion event locally and sends `spawn` (task name,
// argument bytes, priority, processor, precondition, completion) to the target, which spawns
// the task by name and answers `spawn_done` when its local completion triggers. A precondition
// owned by the spawner is waited for here before the message goes out, since the target would
// otherwise have to subscribe back to us for it. Proxies and completions that wait on a rank
// that is lost are poisoned with that rank's cause.
#pragma once

#include "runtime/net/worker.h"

#include <caravan/event.h>
#include <caravan/task.h>

#include <deque>
#include <mutex>
#include <span>
#include <string_view>
#include <unordered_map>

namespace caravan {
class RuntimeImpl;
}

namespace caravan::net {

class Network;

class RemoteEvents {
 public:
  static constexpr std::size_t kKeptTriggeredProxies = 4096;

  RemoteEvents(RuntimeImpl& runtime, Network& network);

  // The local proxy of `remote`, an event of another rank of this job.
  Event proxy(const Event& remote);
  // Asks the owner of `remote` to trigger it (poisoned when `failure` is set). Throws
  // Error(transport) if the owner is lost.
  void trigger(const Event& remote, const FailureCause& failure);
  // Spawns task `name` on `options.processor` (a processor of rank `target`); returns the local
  // completion event.
  Event spawn(int target, std::string_view name, std::span<const std::byte> args, const SpawnOptions& options);

  std::size_t proxy_count() const;
  std::size_t pending_spawn_count() const;

 private:
  friend class DeferredSpawn;
  void on_subscribe(const AmMessage& message);
  void on_notify(const AmMessage& message);
  void on_trigger(const AmMessage& message);
  void on_spawn(const AmMessage& message);
  void on_spawn_done(const AmMessage& message);
  void peer_lost(int rank, const FailureCause& cause);
  // Marks the proxy of `remote` triggered and triggers it; nothing if it is unknown or done.
  void complete_proxy(const Event& remote, const FailureCause& failure);
  void mark_triggered_locked(const Event& remote);
  void send_spawn(int target, Event completion, std::span<const std::byte> body);
  void finish_spawn(Event completion, const FailureCause& failure);

  struct Proxy {
    Event local;
    bool triggered = false;
  };

  RuntimeImpl& runtime_;
  Network& network_;
  mutable std::mutex mutex_;
  std::unordered_map<Event, Proxy> proxies_;    // remote event -> its proxy here
  std::deque<Event> triggered_order_;           // oldest triggered proxies first, for pruning
  std::unordered_map<Event, int> spawns_;       // completion here -> target rank
};

}  // namespace caravan::net
