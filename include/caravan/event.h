// Events: the one way work is ordered in Caravan.
//
// An Event is a small value (16 bytes, trivially copyable) naming one generation of one slot in
// the runtime's event table, so it can be copied freely, compared, hashed and later sent to
// other ranks. The default-constructed Event is "no event": it has always triggered.
// An event triggers exactly once, either successfully or poisoned with a FailureCause; work that
// depends on a poisoned event fails with that same cause.
#pragma once

#include <caravan/error.h>

#include <chrono>
#include <compare>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>

namespace caravan {

enum class EventState { pending, triggered, poisoned };

class Event {
 public:
  constexpr Event() = default;

  // The "no event" value: already triggered, depends on nothing.
  static constexpr Event none() { return Event(); }
  constexpr bool is_none() const { return generation_ == 0; }
  constexpr explicit operator bool() const { return !is_none(); }

  EventState query() const;
  bool has_triggered() const { return query() != EventState::pending; }
  // The failure this event was poisoned with, or nullptr if it is pending or triggered fine.
  FailureCause failure() const;

  // Blocks until the event triggers. Throws EventPoisoned if it was poisoned.
  // Waiting inside a task occupies that task's worker thread; prefer preconditions there.
  // While it polls (CARAVAN_WAIT_SPIN_US), and in query(), the thread finishes GPU copy requests
  // that are done on the device while their channel's threads sleep (CARAVAN_WAIT_HELPS).
  void wait() const;
  // As wait(), but gives up after `timeout`: returns false then (the event stays pending).
  bool wait_for(std::chrono::nanoseconds timeout) const;

  // Calls `callback` exactly once when the event triggers (at once, on this thread, if it already
  // has), with nullptr on success or the failure cause. It runs on the triggering thread and
  // must not block; an exception it throws is logged and dropped. The triggering thread may be
  // one in wait() or query() of another event: waiting threads finish GPU copies whose service
  // threads sleep (CARAVAN_WAIT_HELPS), so a callback must not take a lock its waiters hold.
  // Runtime::shutdown from a callback throws Error(invalid_argument).
  using Callback = std::function<void(const FailureCause& failure)>;
  void on_trigger(Callback callback) const;

  std::string to_string() const;

  friend constexpr bool operator==(const Event&, const Event&) = default;
  friend constexpr auto operator<=>(const Event&, const Event&) = default;

  // Encoding (for the runtime and for shipping events between ranks).
  constexpr std::uint32_t slot() const { return slot_; }
  constexpr std::uint16_t owner_rank() const { return owner_rank_; }
  constexpr std::uint16_t runtime_instance() const { return runtime_instance_; }
  constexpr std::uint64_t generation() const { return generation_; }
  static constexpr Event from_parts(std::uint32_t slot, std::uint16_t owner_rank,
                                    std::uint16_t runtime_instance, std::uint64_t generation) {
    Event e;
    e.slot_ = slot;
    e.owner_rank_ = owner_rank;
    e.runtime_instance_ = runtime_instance;
    e.generation_ = generation;
    return e;
  }

 private:
  std::uint32_t slot_ = 0;
  std::uint16_t owner_rank_ = 0;
  std::uint16_t runtime_instance_ = 0;
  std::uint64_t generation_ = 0;  // 0 only for "no event"
};

// An event the application triggers itself. Only create() makes a pending one: a
// default-constructed UserEvent is "no event", and as a precondition it holds nothing back.
// trigger() and poison() may be called from any thread; a user event still pending when the
// runtime shuts down may be poisoned with Errc::shut_down (see Runtime::shutdown), and a
// trigger() after that throws Error(already_done) on the owning rank (from another rank the
// request is dropped, and the owner logs it). A handle received from another rank
// (from_event) may name any event of that rank, not only a user event.
class UserEvent : public Event {
 public:
  // A new pending event in the current runtime.
  static UserEvent create();
  UserEvent() = default;  // "no event" (has always triggered); trigger() on it throws

  // Triggers it. Throws Error(already_done) if it has triggered already, Error(invalid_argument)
  // for the empty UserEvent (poison() likewise).
  // A user event of another rank may be triggered too: the request travels to its owner and
  // takes effect there (asynchronously; a second trigger is then reported in the owner's log).
  void trigger() const;
  // Triggers it as failed; everything that depends on it fails with `cause`.
  void poison(FailureCause cause) const;
  void poison(const std::string& message) const;

  // A handle to a user event received from another rank (e.g. in task arguments).
  static UserEvent from_event(Event e) { return UserEvent(e); }

 private:
  explicit UserEvent(Event e) : Event(e) {}
};

// An event that triggers when all of `events` have triggered. It is poisoned as soon as any of
// them is poisoned (fail fast: a failure never waits behind unrelated pending work).
// Merging no events gives Event::none(); merging one gives that event back.
Event merge_events(std::span<const Event> events);
Event merge_events(std::initializer_list<Event> events);

}  // namespace caravan

template <>
struct std::hash<caravan::Event> {
  std::size_t operator()(const caravan::Event& e) const noexcept {
    std::uint64_t h = e.generation() * 0x9E3779B97F4A7C15ull;
    h ^= (std::uint64_t{e.slot()} << 32) | (std::uint64_t{e.owner_rank()} << 16) | e.runtime_instance();
    return static_cast<std::size_t>(h ^ (h >> 29));
  }
};
