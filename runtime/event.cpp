// The public Event API: each call finds the event's table through the running runtime.
#include "runtime/log.h"
#include "runtime/deadline.h"
#include "runtime/net/network.h"
#include "runtime/net/remote_events.h"
#include "runtime/progress.h"
#include "runtime/runtime_impl.h"

#include <fmt/format.h>

#include <atomic>

namespace caravan {
namespace {

using detail::EventTable;
using detail::EventWaiter;

class CallbackWaiter final : public EventWaiter {
 public:
  explicit CallbackWaiter(Event::Callback callback) : callback_(std::move(callback)) {}
  void event_triggered(const FailureCause& failure) override {
    ++detail::t_event_callback_depth;  // Runtime::shutdown refuses to run inside a callback
    try {
      callback_(failure);
    } catch (const std::exception& e) {
      log::get("event")->error("an event callback threw (ignored): {}", e.what());
    } catch (...) {
      log::get("event")->error("an event callback threw an unknown exception (ignored)");
    }
    --detail::t_event_callback_depth;
    delete this;
  }

 private:
  Event::Callback callback_;
};

// Joins N events. Each input needs its own intrusive list node, so the record holds one Input
// per pending event; the record is freed by whichever input is notified last.
class MergeRecord {
 public:
  MergeRecord(EventTable& table, Event result, std::size_t inputs)
      : table_(table), result_(result), inputs_(inputs), remaining_(static_cast<std::int64_t>(inputs)) {
    for (auto& input : inputs_) input.record = this;
  }
  void attach(std::size_t i, Event e) { table_.add_waiter(e, &inputs_[i]); }

 private:
  struct Input final : EventWaiter {
    MergeRecord* record = nullptr;
    void event_triggered(const FailureCause& failure) override { record->input_triggered(failure); }
  };

  void input_triggered(const FailureCause& failure) {
    // Fail fast: the first failure triggers the result; later inputs only count down.
    if (failure && !fired_.exchange(true, std::memory_order_acq_rel)) table_.trigger(result_, failure);
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      if (!fired_.exchange(true, std::memory_order_acq_rel)) table_.trigger(result_, nullptr);
      delete this;
    }
  }

  EventTable& table_;
  Event result_;
  std::vector<Input> inputs_;
  std::atomic<std::int64_t> remaining_;
  std::atomic<bool> fired_{false};
};

// The network of the running job when another rank owns `e`; nullptr when it is ours.
net::Network* remote_owner(const Event& e) {
  RuntimeImpl* rt = RuntimeImpl::current();
  if (!rt || e.owner_rank() == rt->rank() || !rt->network() || e.owner_rank() >= rt->world_size()) return nullptr;
  return rt->network();
}

}  // namespace

EventState Event::query() const {
  if (is_none()) return EventState::triggered;
  auto local = RuntimeImpl::local_view(*this);
  const EventState state = local.table->query(local.event);
  if (state != EventState::pending) return state;
  // A caller polling the event is awake: it finishes device work whose service thread sleeps
  // (runtime/progress.h), which may trigger this very event.
  detail::help_progress();
  return local.table->query(local.event);
}

FailureCause Event::failure() const {
  if (is_none()) return nullptr;
  auto local = RuntimeImpl::local_view(*this);
  return local.table->failure(local.event);
}

void Event::wait() const {
  if (is_none()) return;
  FailureCause failure;
  auto local = RuntimeImpl::local_view(*this);
  local.table->wait(local.event, nullptr, &failure);
  if (failure) throw EventPoisoned(failure);
}

bool Event::wait_for(std::chrono::nanoseconds timeout) const {
  if (is_none()) return true;
  auto deadline = detail::deadline_after(timeout);
  FailureCause failure;
  auto local = RuntimeImpl::local_view(*this);
  if (!local.table->wait(local.event, &deadline, &failure)) return false;
  if (failure) throw EventPoisoned(failure);
  return true;
}

void Event::on_trigger(Callback callback) const {
  if (!callback) throw Error(Errc::invalid_argument, "Event::on_trigger: the callback is empty");
  if (is_none()) {
    CallbackWaiter* waiter = new CallbackWaiter(std::move(callback));
    waiter->event_triggered(nullptr);
    return;
  }
  auto local = RuntimeImpl::local_view(*this);
  local.table->add_waiter(local.event, new CallbackWaiter(std::move(callback)));
}

std::string Event::to_string() const {
  if (is_none()) return "event(none)";
  return fmt::format("event(rank {}, slot {}, gen {})", owner_rank_, slot_, generation_);
}

UserEvent UserEvent::create() {
  RuntimeImpl* rt = RuntimeImpl::current();
  if (!rt) throw Error(Errc::shut_down, "UserEvent::create: no Caravan runtime is running");
  return UserEvent(rt->events().create(/*user_event=*/true));
}

void UserEvent::trigger() const {
  if (is_none()) throw Error(Errc::invalid_argument, "UserEvent::trigger: this is the empty UserEvent (use UserEvent::create())");
  if (net::Network* network = remote_owner(*this)) return network->events().trigger(*this, nullptr);
  if (!RuntimeImpl::table_for(*this).trigger(*this, nullptr))
    throw Error(Errc::already_done, fmt::format("UserEvent::trigger: {} has already triggered", to_string()));
}

void UserEvent::poison(FailureCause cause) const {
  if (is_none()) throw Error(Errc::invalid_argument, "UserEvent::poison: this is the empty UserEvent (use UserEvent::create())");
  if (!cause) throw Error(Errc::invalid_argument, "UserEvent::poison: the cause must not be null");
  if (net::Network* network = remote_owner(*this)) return network->events().trigger(*this, cause);
  if (!RuntimeImpl::table_for(*this).trigger(*this, std::move(cause)))
    throw Error(Errc::already_done, fmt::format("UserEvent::poison: {} has already triggered", to_string()));
}

void UserEvent::poison(const std::string& message) const { poison(make_failure(Errc::poisoned, message)); }

Event merge_events(std::span<const Event> events) {
  // Drop inputs that have triggered already; a poisoned one decides the result at once.
  std::vector<Event> pending;
  pending.reserve(events.size());
  EventTable* table = nullptr;
  for (const Event& e : events) {
    if (e.is_none()) continue;
    auto local = RuntimeImpl::local_view(e);  // events of other ranks are merged through their proxies
    table = local.table;
    switch (table->query(local.event)) {
      case EventState::triggered: break;
      case EventState::poisoned: return local.event;
      case EventState::pending: pending.push_back(local.event); break;
    }
  }
  if (pending.empty()) return Event::none();
  if (pending.size() == 1) return pending.front();
  Event result = table->create();
  auto* record = new MergeRecord(*table, result, pending.size());
  for (std::size_t i = 0; i < pending.size(); ++i) record->attach(i, pending[i]);
  return result;
}

Event merge_events(std::initializer_list<Event> events) {
  return merge_events(std::span<const Event>(events.begin(), events.size()));
}

}  // namespace caravan
