#include "runtime/net/remote_events.h"

#include "runtime/log.h"
#include "runtime/net/network.h"
#include "runtime/net/wire.h"
#include "runtime/runtime_impl.h"
#include "runtime/task_registry.h"

#include <fmt/format.h>

namespace caravan::net {
namespace {

constexpr auto id(MsgId m) { return static_cast<std::uint16_t>(m); }

// At the owner: answers one subscription when the event triggers.
class NotifyWaiter final : public detail::EventWaiter {
 public:
  NotifyWaiter(Network& network, int subscriber, Event event)
      : network_(network), subscriber_(subscriber), event_(event) {}
  void event_triggered(const FailureCause& failure) override {
    WireWriter out;
    out.put(event_).put_failure(failure);
    network_.send(subscriber_, id(MsgId::notify), out.bytes());  // a lost subscriber needs no answer
    delete this;
  }

 private:
  Network& network_;
  int subscriber_;
  Event event_;
};

// At the target of a remote spawn: reports the local completion back to the spawner.
class SpawnDoneWaiter final : public detail::EventWaiter {
 public:
  SpawnDoneWaiter(Network& network, int spawner, Event completion)
      : network_(network), spawner_(spawner), completion_(completion) {}
  void event_triggered(const FailureCause& failure) override {
    WireWriter out;
    out.put(completion_).put_failure(failure);
    network_.send(spawner_, id(MsgId::spawn_done), out.bytes());
    delete this;
  }

 private:
  Network& network_;
  int spawner_;
  Event completion_;
};

}  // namespace

// At the spawner: holds a spawn request until its (local) precondition triggers.
class DeferredSpawn final : public detail::EventWaiter {
 public:
  DeferredSpawn(RemoteEvents& owner, int target, Event completion, std::vector<std::byte> body)
      : owner_(owner), target_(target), completion_(completion), body_(std::move(body)) {}
  void event_triggered(const FailureCause& failure) override {
    if (failure) owner_.finish_spawn(completion_, failure);  // the task never runs, as locally
    else owner_.send_spawn(target_, completion_, body_);
    delete this;
  }

 private:
  RemoteEvents& owner_;
  int target_;
  Event completion_;
  std::vector<std::byte> body_;
};

RemoteEvents::RemoteEvents(RuntimeImpl& runtime, Network& network) : runtime_(runtime), network_(network) {
  network_.set_handler(id(MsgId::subscribe), [this](const AmMessage& m) { on_subscribe(m); });
  network_.set_handler(id(MsgId::notify), [this](const AmMessage& m) { on_notify(m); });
  network_.set_handler(id(MsgId::trigger), [this](const AmMessage& m) { on_trigger(m); });
  network_.set_handler(id(MsgId::spawn), [this](const AmMessage& m) { on_spawn(m); });
  network_.set_handler(id(MsgId::spawn_done), [this](const AmMessage& m) { on_spawn_done(m); });
  network_.add_peer_lost_listener([this](int rank, const FailureCause& cause) { peer_lost(rank, cause); });
}

std::size_t RemoteEvents::proxy_count() const {
  std::lock_guard lock(mutex_);
  return proxies_.size();
}

std::size_t RemoteEvents::pending_spawn_count() const {
  std::lock_guard lock(mutex_);
  return spawns_.size();
}

Event RemoteEvents::proxy(const Event& remote) {
  Event local;
  {
    std::lock_guard lock(mutex_);
    auto it = proxies_.find(remote);
    if (it != proxies_.end()) return it->second.local;
    local = runtime_.events().create();
    proxies_.emplace(remote, Proxy{local, false});
  }
  int owner = remote.owner_rank();
  WireWriter out;
  out.put(remote);
  // A lost owner is caught either here or by peer_lost, which sees the new entry: whichever
  // comes second finds the proxy already triggered. An owner that has shut down would never
  // answer, so it counts as lost here although messages to it are still allowed.
  if (network_.peer_state(owner) != PeerState::alive || !network_.send(owner, id(MsgId::subscribe), out.bytes())) {
    FailureCause cause = network_.peer_failure(owner);
    complete_proxy(remote, cause ? cause
                                 : make_failure(Errc::transport, fmt::format("cannot reach rank {} to wait on {}",
                                                                             owner, remote.to_string())));
  }
  return local;
}

void RemoteEvents::mark_triggered_locked(const Event& remote) {
  triggered_order_.push_back(remote);
  while (triggered_order_.size() > kKeptTriggeredProxies) {
    auto it = proxies_.find(triggered_order_.front());
    if (it != proxies_.end() && it->second.triggered) proxies_.erase(it);  // never a pending one
    triggered_order_.pop_front();
  }
}

void RemoteEvents::complete_proxy(const Event& remote, const FailureCause& failure) {
  Event local;
  {
    std::lock_guard lock(mutex_);
    auto it = proxies_.find(remote);
    if (it == proxies_.end() || it->second.triggered) return;
    it->second.triggered = true;
    local = it->second.local;
    mark_triggered_locked(remote);
  }
  // Outside the lock: triggering runs waiters, which may use remote events again.
  runtime_.events().trigger(local, failure);
}

void RemoteEvents::trigger(const Event& remote, const FailureCause& failure) {
  WireWriter out;
  out.put(remote).put_failure(failure);
  int owner = remote.owner_rank();
  if (network_.peer_state(owner) != PeerState::alive || !network_.send(owner, id(MsgId::trigger), out.bytes())) {
    network_.require_alive(owner, fmt::format("triggering {}", remote.to_string()));
    throw Error(Errc::transport, fmt::format("triggering {}: cannot reach rank {}", remote.to_string(), owner));
  }
}

Event RemoteEvents::spawn(int target, std::string_view name, std::span<const std::byte> args,
                          const SpawnOptions& options) {
  Event completion = runtime_.events().create();
  {
    std::lock_guard lock(mutex_);
    spawns_.emplace(completion, target);
  }
  Event pre = options.precondition;
  bool defer = !pre.is_none() && pre.owner_rank() == runtime_.rank();
  WireWriter out;
  out.put(completion)
      .put(defer ? Event::none() : pre)
      .put(static_cast<std::int32_t>(options.priority))
      .put(options.processor.kind)
      .put(options.processor.index)
      .put_string(name)
      .put_bytes(args);
  if (defer) runtime_.events().add_waiter(pre, new DeferredSpawn(*this, target, completion, out.take()));
  else send_spawn(target, completion, out.bytes());
  return completion;
}

void RemoteEvents::send_spawn(int target, Event completion, std::span<const std::byte> body) {
  if (network_.peer_state(target) == PeerState::alive && network_.send(target, id(MsgId::spawn), body)) return;
  FailureCause cause = network_.peer_failure(target);
  finish_spawn(completion, cause ? cause : make_failure(Errc::transport, fmt::format("cannot reach rank {}", target)));
}

void RemoteEvents::finish_spawn(Event completion, const FailureCause& failure) {
  {
    std::lock_guard lock(mutex_);
    if (spawns_.erase(completion) == 0) return;  // peer_lost got there first
  }
  runtime_.events().trigger(completion, failure);
}

void RemoteEvents::on_subscribe(const AmMessage& message) {
  WireReader in(message.body, fmt::format("subscribe from rank {}", message.source));
  auto event = in.get<Event>();
  auto* waiter = new NotifyWaiter(network_, message.source, event);
  try {
    runtime_.events().add_waiter(event, waiter);  // runs at once if the event has triggered
  } catch (const Error& e) {
    // Not ours (a stale handle of an earlier runtime, or never created): the subscriber's
    // proxy fails with the reason instead of waiting forever.
    delete waiter;
    WireWriter out;
    out.put(event).put_failure(make_failure(e.code() == Errc::invalid_argument ? Errc::shut_down : e.code(),
                                            fmt::format("rank {}: {}", runtime_.rank(), e.what())));
    network_.send(message.source, id(MsgId::notify), out.bytes());
  }
}

void RemoteEvents::on_notify(const AmMessage& message) {
  WireReader in(message.body, fmt::format("notify from rank {}", message.source));
  auto event = in.get<Event>();
  FailureCause failure = in.get_failure();
  complete_proxy(event, failure);
}

void RemoteEvents::on_trigger(const AmMessage& message) {
  WireReader in(message.body, fmt::format("trigger from rank {}", message.source));
  auto event = in.get<Event>();
  FailureCause failure = in.get_failure();
  try {
    if (!runtime_.events().trigger(event, failure))
      log::get("event")->warn("rank {} asked to trigger {}, which has already triggered (ignored)", message.source,
                              event.to_string());
  } catch (const Error& e) {
    log::get("event")->warn("rank {} asked to trigger {}: {} (ignored)", message.source, event.to_string(), e.what());
  }
}

void RemoteEvents::on_spawn(const AmMessage& message) {
  WireReader in(message.body, fmt::format("spawn from rank {}", message.source));
  auto completion = in.get<Event>();
  auto precondition = in.get<Event>();
  SpawnOptions options;
  options.precondition = precondition;
  options.priority = in.get<std::int32_t>();
  options.processor.kind = in.get<ProcessorKind>();
  options.processor.index = in.get<std::uint16_t>();
  options.processor.rank = static_cast<std::uint16_t>(runtime_.rank());
  std::string name = in.get_string();
  auto args = in.get_bytes();
  Event local;
  try {
    local = runtime_.spawn(find_task(name), args, options);
  } catch (const Error& e) {
    WireWriter out;
    out.put(completion).put_failure(make_failure(
        e.code(), fmt::format("task '{}' spawned by rank {} on rank {}: {}", name, message.source, runtime_.rank(), e.what())));
    network_.send(message.source, id(MsgId::spawn_done), out.bytes());
    return;
  }
  runtime_.events().add_waiter(local, new SpawnDoneWaiter(network_, message.source, completion));
}

void RemoteEvents::on_spawn_done(const AmMessage& message) {
  WireReader in(message.body, fmt::format("spawn_done from rank {}", message.source));
  auto completion = in.get<Event>();
  FailureCause failure = in.get_failure();
  finish_spawn(completion, failure);
}

void RemoteEvents::peer_lost(int rank, const FailureCause& cause) {
  std::vector<Event> poisoned;
  {
    std::lock_guard lock(mutex_);
    for (auto& [remote, proxy] : proxies_) {
      if (remote.owner_rank() != rank || proxy.triggered) continue;
      proxy.triggered = true;
      poisoned.push_back(proxy.local);
      triggered_order_.push_back(remote);
    }
    for (auto it = spawns_.begin(); it != spawns_.end();) {
      if (it->second == rank) {
        poisoned.push_back(it->first);
        it = spawns_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const Event& e : poisoned) runtime_.events().trigger(e, cause);
}

}  // namespace caravan::net
