// The event table: the storage behind caravan::Event.
//
// An event is one generation of one slot. A slot is taken from a free list when an event is
// created and returned to it as soon as that event triggers; the next event in the slot gets
// the next generation. "Has event (slot, g) triggered?" is then one atomic load:
// triggered_generation >= g, which stays true for every older generation. This is Realm's
// generational-event scheme; it makes handles plain values that can later travel between ranks,
// and it recycles storage without reference counting.
//
// Who waits on an event registers an EventWaiter: an intrusive list node (no allocation per
// waiter) whose event_triggered() runs exactly once. Tasks, merges, callbacks and blocking
// waits are all waiters.
#pragma once

#include <caravan/error.h>
#include <caravan/event.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace caravan::detail {

class EventWaiter {
 public:
  // Called exactly once, when the event triggers: failure is nullptr on success. It may
  // delete the waiter. It runs on the triggering thread and must not block.
  virtual void event_triggered(const FailureCause& failure) = 0;

 protected:
  virtual ~EventWaiter() = default;

 private:
  friend class EventTable;
  EventWaiter* next_waiter_ = nullptr;
};

// A tiny test-and-set lock for a slot's waiter list: held for a few instructions, so it spins,
// yielding the core when it does not get the lock at once (this machine may have 2 cores).
class SlotLock {
 public:
  void lock() noexcept {
    for (int spins = 0; flag_.exchange(true, std::memory_order_acquire); ++spins) {
      while (flag_.load(std::memory_order_relaxed)) {
        if (spins > 16) std::this_thread::yield();
        ++spins;
      }
    }
  }
  void unlock() noexcept { flag_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> flag_{false};
};

// How long Event::wait polls before it blocks, from CARAVAN_WAIT_SPIN_US: the setting itself,
// or for -1 (automatic) 20 us, and kGpuWaitSpinUs once the runtime uses a GPU. On the GPU
// machine a blocked waiter took 150-200 us to wake: Event::wait() of a 256 MiB peer copy (0.7 ms)
// ran at 0.82 of the raw copy's speed, against 0.98 when it polled for 5 ms (docs/gpu.md).
inline constexpr int kGpuWaitSpinUs = 5000;
int wait_spin_us_for(std::int64_t setting, bool uses_gpu);

// A CPU worker thread, or a GPU processor's launcher thread (where GPU task bodies run), points
// this at its processor's count of bodies blocked in EventTable::wait, so that shutdown can tell
// a task blocked on an event from one still computing.
extern thread_local std::atomic<int>* t_blocked_wait_count;

// Every other thread the runtime owns (DMA workers, GPU lanes and completion threads, the
// network's progress thread...) names itself here for its whole life, and an Event::on_trigger
// callback counts itself while it runs: Runtime::shutdown from either would join the thread it
// runs on (or one that waits for it), so it is refused with an error instead of hanging.
extern thread_local const char* t_runtime_thread_role;
extern thread_local int t_event_callback_depth;

// The network's progress thread delivers every message from other ranks, and runs the
// on_trigger callbacks of events they trigger: a wait there (Event::wait, a heap put to another
// node) would stop the very thread that must complete it, so such waits are refused.
// Its own flag, not a comparison of the role's text by address: string literals are not merged
// across files in every build (AddressSanitizer's keeps them apart), so that test failed there.
extern thread_local bool t_on_progress_thread;
inline bool on_progress_thread() noexcept { return t_on_progress_thread; }

class RuntimeThreadRole {
 public:
  explicit RuntimeThreadRole(const char* role) : previous_(t_runtime_thread_role) { t_runtime_thread_role = role; }
  ~RuntimeThreadRole() { t_runtime_thread_role = previous_; }
  RuntimeThreadRole(const RuntimeThreadRole&) = delete;
  RuntimeThreadRole& operator=(const RuntimeThreadRole&) = delete;

 private:
  const char* previous_;
};

class EventTable {
 public:
  EventTable(std::uint16_t rank, std::uint16_t instance, int wait_spin_us);
  // The runtime started using a GPU: with the automatic setting, waits poll longer.
  void set_wait_spin_us(int us) { wait_spin_us_.store(us, std::memory_order_relaxed); }
  int wait_spin_us() const { return wait_spin_us_.load(std::memory_order_relaxed); }
  ~EventTable();
  EventTable(const EventTable&) = delete;
  EventTable& operator=(const EventTable&) = delete;

  std::uint16_t rank() const { return rank_; }
  std::uint16_t instance() const { return instance_; }

  // A new pending event. A user event (UserEvent::create) has no producer inside the runtime:
  // shutdown may have to poison it so that a task waiting on it returns.
  Event create(bool user_event = false);

  // Triggers `e` (poisoned if failure is set) and runs its waiters. Returns false, changing
  // nothing, if it had already triggered.
  bool trigger(Event e, FailureCause failure);

  EventState query(Event e) const;
  FailureCause failure(Event e) const;

  // Runs waiter->event_triggered() when `e` triggers, at once if it already has.
  void add_waiter(Event e, EventWaiter* waiter);
  // Takes back a waiter whose event has not triggered. Returns false if the event triggered
  // first (the waiter has been or is being called).
  bool remove_waiter(Event e, EventWaiter* waiter);

  // Blocks until `e` triggers or `deadline` passes (nullptr: no deadline). Returns false on
  // timeout; otherwise sets *failure to the event's failure (nullptr on success).
  bool wait(Event e, const std::chrono::steady_clock::time_point* deadline, FailureCause* failure);

  // Poisons every pending event with `failure` (used at shutdown so that nothing waits forever).
  void poison_all_pending(const FailureCause& failure) { (void)poison_pending(failure, false); }
  // Poisons the pending events made by create(true); returns how many.
  std::size_t poison_pending_user_events(const FailureCause& failure) { return poison_pending(failure, true); }

  std::size_t pending_count() const;
  // How many events have triggered so far (a progress count for shutdown).
  std::uint64_t trigger_count() const { return triggered_.load(std::memory_order_relaxed); }

  // Runs `waiters` (a list taken from a slot) with `failure`. Nested calls on one thread are
  // queued and run by the outermost call, so long dependency chains do not grow the stack.
  static void notify(EventWaiter* waiters, const FailureCause& failure);

 private:
  struct Slot {
    std::atomic<std::uint64_t> triggered_generation{0};
    std::atomic<std::uint64_t> issued_generation{0};
    std::atomic<std::uint32_t> next_free{0};
    std::atomic<bool> has_poison_record{false};
    std::atomic<bool> user_event{false};  // of the generation issued last
    SlotLock lock;
    EventWaiter* waiters = nullptr;  // guarded by lock; newest first
    // Generations of this slot that triggered poisoned, with their causes; guarded by lock.
    // Kept (rarely large: only failures add to it) so that old handles still report poisoning.
    std::unique_ptr<std::vector<std::pair<std::uint64_t, FailureCause>>> poison_records;
  };

  static constexpr std::uint32_t kChunkBits = 12;  // 4096 slots per chunk
  static constexpr std::uint32_t kChunkSize = 1u << kChunkBits;
  static constexpr std::uint32_t kMaxChunks = 1u << 14;  // 64 M slots at most
  static constexpr std::uint32_t kNil = UINT32_MAX;

  std::size_t poison_pending(const FailureCause& failure, bool user_events_only);
  Slot& slot(std::uint32_t index) const;
  Slot& checked_slot(const Event& e) const;
  std::uint32_t pop_free();
  void push_free(std::uint32_t index);
  void grow();
  FailureCause find_poison(Slot& s, std::uint64_t generation) const;

  const std::uint16_t rank_;
  const std::uint16_t instance_;
  std::atomic<int> wait_spin_us_;
  std::array<std::atomic<Slot*>, kMaxChunks> chunks_{};
  std::atomic<std::uint32_t> chunk_count_{0};
  std::mutex grow_mutex_;
  // Treiber stack of free slots; the upper 32 bits are a tag bumped on every pop so that a
  // slot popped and pushed back between another thread's load and CAS cannot fool it (ABA).
  std::atomic<std::uint64_t> free_head_;
  // Events made and triggered so far: pending_count() is their difference, trigger_count() the
  // second (a progress count for shutdown).
  std::atomic<std::uint64_t> created_{0};
  std::atomic<std::uint64_t> triggered_{0};
};

}  // namespace caravan::detail
