#include "runtime/event_table.h"

#include "runtime/cpu_relax.h"
#include "runtime/log.h"
#include "runtime/progress.h"

#include <fmt/format.h>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>

namespace caravan::detail {
namespace {

// Notification trampoline state (see EventTable::notify).
struct PendingNotification {
  EventWaiter* waiters;
  FailureCause failure;
};
struct NotifyState {
  bool active = false;
  std::vector<PendingNotification> queue;
};
thread_local NotifyState t_notify;

// Parks a thread on a futex word until the event triggers.
//
// state_: 0 = pending, 1 = pending and the waiter is (about to be) asleep in the kernel,
// 2 = triggered. The notifier publishes failure_ and then state_ = 2 with release order; it
// calls futex-wake only if a sleeper announced itself (state_ was 1). The waiting thread may
// return and destroy this object as soon as it reads 2, possibly before the notifier's wake
// call runs: a futex wake on a stale address is harmless (at worst a spurious wake-up for
// whoever reuses the address, which every futex user must tolerate), and the notifier touches
// no member after its store. There is no lock to hand over, so the woken thread runs at once.
class BlockingWaiter final : public EventWaiter {
 public:
  void event_triggered(const FailureCause& failure) override {
    failure_ = failure;
    std::uint32_t* address = reinterpret_cast<std::uint32_t*>(&state_);
    if (state_.exchange(kDone, std::memory_order_acq_rel) == kSleeping) futex_wake(address);
  }

  // Returns false if `deadline` passed first.
  bool wait_until(const std::chrono::steady_clock::time_point* deadline) {
    for (;;) {
      std::uint32_t s = state_.load(std::memory_order_acquire);
      if (s == kDone) return true;
      if (s == kPending && !state_.compare_exchange_weak(s, kSleeping, std::memory_order_acq_rel)) continue;
      if (!futex_wait(reinterpret_cast<std::uint32_t*>(&state_), kSleeping, deadline))
        return state_.load(std::memory_order_acquire) == kDone;
    }
  }

  const FailureCause& failure() const { return failure_; }

 private:
  static constexpr std::uint32_t kPending = 0, kSleeping = 1, kDone = 2;

  static void futex_wake(std::uint32_t* address) {
    syscall(SYS_futex, address, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  }
  // Sleeps while *address == expected. Returns false on timeout.
  static bool futex_wait(std::uint32_t* address, std::uint32_t expected,
                         const std::chrono::steady_clock::time_point* deadline) {
    timespec ts{};
    timespec* timeout = nullptr;
    if (deadline) {
      // FUTEX_WAIT_BITSET takes an absolute CLOCK_MONOTONIC time, which is what steady_clock is.
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline->time_since_epoch()).count();
      if (ns < 0) ns = 0;
      ts.tv_sec = static_cast<time_t>(ns / 1000000000);
      ts.tv_nsec = static_cast<long>(ns % 1000000000);
      timeout = &ts;
    }
    long rc = syscall(SYS_futex, address, FUTEX_WAIT_BITSET_PRIVATE, expected, timeout, nullptr,
                      FUTEX_BITSET_MATCH_ANY);
    return !(rc == -1 && errno == ETIMEDOUT);
  }

  std::atomic<std::uint32_t> state_{kPending};
  FailureCause failure_;
};
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t), "futex word must be 32 bits");

}  // namespace

thread_local std::atomic<int>* t_blocked_wait_count = nullptr;
thread_local const char* t_runtime_thread_role = nullptr;
thread_local bool t_on_progress_thread = false;
thread_local int t_event_callback_depth = 0;

int wait_spin_us_for(std::int64_t setting, bool uses_gpu) {
  if (setting >= 0) return static_cast<int>(setting);
  return uses_gpu ? kGpuWaitSpinUs : 20;
}

EventTable::EventTable(std::uint16_t rank, std::uint16_t instance, int wait_spin_us)
    : rank_(rank), instance_(instance), wait_spin_us_(wait_spin_us), free_head_(kNil) {
  grow();
}

EventTable::~EventTable() {
  auto n = chunk_count_.load();
  for (std::uint32_t c = 0; c < n; ++c) delete[] chunks_[c].load();
}

EventTable::Slot& EventTable::slot(std::uint32_t index) const {
  return chunks_[index >> kChunkBits].load(std::memory_order_acquire)[index & (kChunkSize - 1)];
}

EventTable::Slot& EventTable::checked_slot(const Event& e) const {
  if (e.owner_rank() != rank_ || e.runtime_instance() != instance_)
    throw Error(Errc::invalid_argument, fmt::format("{} does not belong to this runtime (rank {}, instance {})",
                                                    e.to_string(), rank_, instance_));
  if ((e.slot() >> kChunkBits) >= chunk_count_.load(std::memory_order_acquire))
    throw Error(Errc::invalid_argument,
                fmt::format("{} was never issued by this runtime (it has no slot {})", e.to_string(), e.slot()));
  Slot& s = slot(e.slot());
  if (const std::uint64_t issued = s.issued_generation.load(std::memory_order_acquire); e.generation() > issued)
    throw Error(Errc::invalid_argument,
                fmt::format("{} was never issued by this runtime (slot {} has reached generation {})", e.to_string(),
                            e.slot(), issued));
  return s;
}

void EventTable::grow() {
  std::lock_guard lock(grow_mutex_);
  std::uint32_t c = chunk_count_.load();
  if (c == kMaxChunks)
    throw Error(Errc::internal, fmt::format("event table full: {} events pending", pending_count()));
  auto* chunk = new Slot[kChunkSize];
  std::uint32_t base = c << kChunkBits;
  // Chain the new slots and publish the chunk before pushing the chain on the free list.
  for (std::uint32_t i = 0; i + 1 < kChunkSize; ++i) chunk[i].next_free.store(base + i + 1, std::memory_order_relaxed);
  chunks_[c].store(chunk, std::memory_order_release);
  chunk_count_.store(c + 1, std::memory_order_release);
  std::uint64_t head = free_head_.load(std::memory_order_relaxed);
  for (;;) {
    chunk[kChunkSize - 1].next_free.store(static_cast<std::uint32_t>(head), std::memory_order_relaxed);
    std::uint64_t desired = (head & ~0xFFFFFFFFull) + (1ull << 32) + base;
    if (free_head_.compare_exchange_weak(head, desired, std::memory_order_release, std::memory_order_relaxed)) break;
  }
}

std::uint32_t EventTable::pop_free() {
  for (;;) {
    std::uint64_t head = free_head_.load(std::memory_order_acquire);
    while (static_cast<std::uint32_t>(head) != kNil) {
      auto index = static_cast<std::uint32_t>(head);
      // next_free may be stale if another thread pops this slot first; the tag makes our CAS
      // fail in that case, so the stale value is never used.
      std::uint32_t next = slot(index).next_free.load(std::memory_order_relaxed);
      std::uint64_t desired = (head & ~0xFFFFFFFFull) + (1ull << 32) + next;
      if (free_head_.compare_exchange_weak(head, desired, std::memory_order_acquire, std::memory_order_acquire))
        return index;
    }
    grow();
  }
}

void EventTable::push_free(std::uint32_t index) {
  Slot& s = slot(index);
  std::uint64_t head = free_head_.load(std::memory_order_relaxed);
  for (;;) {
    s.next_free.store(static_cast<std::uint32_t>(head), std::memory_order_relaxed);
    std::uint64_t desired = (head & ~0xFFFFFFFFull) + index;
    if (free_head_.compare_exchange_weak(head, desired, std::memory_order_release, std::memory_order_relaxed)) return;
  }
}

Event EventTable::create(bool user_event) {
  std::uint32_t index = pop_free();
  Slot& s = slot(index);
  // The slot is ours until its event triggers; only we advance issued_generation (and the
  // release store below publishes user_event with it).
  s.user_event.store(user_event, std::memory_order_relaxed);
  std::uint64_t generation = s.issued_generation.load(std::memory_order_relaxed) + 1;
  s.issued_generation.store(generation, std::memory_order_release);
  created_.fetch_add(1, std::memory_order_relaxed);
  return Event::from_parts(index, rank_, instance_, generation);
}

bool EventTable::trigger(Event e, FailureCause failure) {
  Slot& s = checked_slot(e);
  s.lock.lock();
  if (s.triggered_generation.load(std::memory_order_relaxed) >= e.generation()) {
    s.lock.unlock();
    return false;
  }
  if (failure) {
    try {
      if (!s.poison_records) s.poison_records = std::make_unique<std::vector<std::pair<std::uint64_t, FailureCause>>>();
      s.poison_records->emplace_back(e.generation(), failure);
    } catch (...) {
      s.lock.unlock();  // out of memory: the slot must not stay locked for every later access
      throw;
    }
    s.has_poison_record.store(true, std::memory_order_release);
  }
  s.triggered_generation.store(e.generation(), std::memory_order_release);
  EventWaiter* waiters = s.waiters;
  s.waiters = nullptr;
  s.lock.unlock();
  triggered_.fetch_add(1, std::memory_order_relaxed);
  push_free(e.slot());  // the slot may be reused from here on; its waiters are already taken
  notify(waiters, failure);
  return true;
}

void EventTable::notify(EventWaiter* waiters, const FailureCause& failure) {
  if (waiters == nullptr) return;
  NotifyState& state = t_notify;
  if (state.active) {
    state.queue.push_back({waiters, failure});
    return;
  }
  state.active = true;
  auto run_list = [](EventWaiter* list, const FailureCause& f) {
    // The list is newest-first; reverse it so waiters run in registration order.
    EventWaiter* ordered = nullptr;
    while (list) {
      EventWaiter* next = list->next_waiter_;
      list->next_waiter_ = ordered;
      ordered = list;
      list = next;
    }
    while (ordered) {
      EventWaiter* next = ordered->next_waiter_;  // read first: the call may delete the waiter
      ordered->next_waiter_ = nullptr;
      ordered->event_triggered(f);
      ordered = next;
    }
  };
  try {
    run_list(waiters, failure);
    for (std::size_t i = 0; i < state.queue.size(); ++i) {
      PendingNotification item = std::move(state.queue[i]);
      run_list(item.waiters, item.failure);
    }
  } catch (...) {
    // A waiter threw (out of memory): this thread must not stay "notifying", or every later
    // notification on it would be queued and never run.
    state.queue.clear();
    state.active = false;
    throw;
  }
  state.queue.clear();
  state.active = false;
}

FailureCause EventTable::find_poison(Slot& s, std::uint64_t generation) const {
  if (!s.has_poison_record.load(std::memory_order_acquire)) return nullptr;
  std::lock_guard lock(s.lock);
  if (!s.poison_records) return nullptr;
  for (auto it = s.poison_records->rbegin(); it != s.poison_records->rend(); ++it)
    if (it->first == generation) return it->second;
  return nullptr;
}

EventState EventTable::query(Event e) const {
  Slot& s = checked_slot(e);
  if (s.triggered_generation.load(std::memory_order_acquire) < e.generation()) return EventState::pending;
  return find_poison(s, e.generation()) ? EventState::poisoned : EventState::triggered;
}

FailureCause EventTable::failure(Event e) const {
  Slot& s = checked_slot(e);
  if (s.triggered_generation.load(std::memory_order_acquire) < e.generation()) return nullptr;
  return find_poison(s, e.generation());
}

void EventTable::add_waiter(Event e, EventWaiter* waiter) {
  Slot& s = checked_slot(e);
  s.lock.lock();
  if (s.triggered_generation.load(std::memory_order_relaxed) >= e.generation()) {
    s.lock.unlock();
    waiter->next_waiter_ = nullptr;
    notify(waiter, find_poison(s, e.generation()));
    return;
  }
  waiter->next_waiter_ = s.waiters;
  s.waiters = waiter;
  s.lock.unlock();
}

bool EventTable::remove_waiter(Event e, EventWaiter* waiter) {
  Slot& s = checked_slot(e);
  std::lock_guard lock(s.lock);
  if (s.triggered_generation.load(std::memory_order_relaxed) >= e.generation()) return false;
  for (EventWaiter** link = &s.waiters; *link; link = &(*link)->next_waiter_) {
    if (*link == waiter) {
      *link = waiter->next_waiter_;
      return true;
    }
  }
  return false;
}

bool EventTable::wait(Event e, const std::chrono::steady_clock::time_point* deadline, FailureCause* failure) {
  Slot& s = checked_slot(e);
  using Clock = std::chrono::steady_clock;
  // Poll briefly first: most waits on a busy runtime end within microseconds, and a futex
  // sleep/wake round trip costs more than that.
  const int spin_us = wait_spin_us();
  if (s.triggered_generation.load(std::memory_order_acquire) < e.generation() && spin_us > 0) {
    auto spin_until = Clock::now() + std::chrono::microseconds(spin_us);
    if (deadline && *deadline < spin_until) spin_until = *deadline;
    for (unsigned i = 0; s.triggered_generation.load(std::memory_order_acquire) < e.generation(); ++i) {
      cpu_relax();
      if ((i & 63) == 63) {
        // Awake anyway: finish device work whose service thread sleeps (runtime/progress.h).
        help_progress();
        if (Clock::now() >= spin_until) break;
        if ((i & 1023) == 1023) std::this_thread::yield();
      }
    }
  }
  if (s.triggered_generation.load(std::memory_order_acquire) >= e.generation()) {
    *failure = find_poison(s, e.generation());
    return true;
  }
  if (on_progress_thread())
    throw Error(Errc::invalid_argument,
                "Event::wait on the network's progress thread (in an Event::on_trigger callback of an event another "
                "rank triggered, or of a copy between ranks): it would stop the thread that delivers the event; "
                "callbacks must not block (chain work with Runtime::spawn or a UserEvent instead)");
  // Counted for shutdown while blocked (see t_blocked_wait_count).
  struct BlockedScope {
    std::atomic<int>* count = t_blocked_wait_count;
    BlockedScope() {
      if (count) count->fetch_add(1, std::memory_order_relaxed);
    }
    ~BlockedScope() {
      if (count) count->fetch_sub(1, std::memory_order_relaxed);
    }
  } blocked;
  BlockingWaiter waiter;
  add_waiter(e, &waiter);
  if (!waiter.wait_until(deadline)) {
    if (remove_waiter(e, &waiter)) return false;
    // The event triggered while we were timing out: its notification is on its way.
    waiter.wait_until(nullptr);
  }
  *failure = waiter.failure();
  return true;
}

std::size_t EventTable::poison_pending(const FailureCause& failure, bool user_events_only) {
  std::size_t poisoned = 0;
  std::uint32_t chunks = chunk_count_.load(std::memory_order_acquire);
  for (std::uint32_t c = 0; c < chunks; ++c) {
    for (std::uint32_t i = 0; i < kChunkSize; ++i) {
      std::uint32_t index = (c << kChunkBits) | i;
      Slot& s = slot(index);
      std::uint64_t issued = s.issued_generation.load(std::memory_order_acquire);
      // If the slot was reused since the load above, the generation named here has triggered
      // already and trigger() changes nothing (user_event may then be the newer event's).
      if (issued > s.triggered_generation.load(std::memory_order_acquire) &&
          (!user_events_only || s.user_event.load(std::memory_order_relaxed)) &&
          trigger(Event::from_parts(index, rank_, instance_, issued), failure))
        ++poisoned;
    }
  }
  return poisoned;
}

std::size_t EventTable::pending_count() const {
  // An estimate while events are made and triggered concurrently (the two counters are read one
  // after the other), never below 0.
  const auto triggered = triggered_.load(std::memory_order_relaxed);
  const auto n = static_cast<std::int64_t>(created_.load(std::memory_order_relaxed) - triggered);
  return n > 0 ? static_cast<std::size_t>(n) : 0;
}

}  // namespace caravan::detail
