#include "runtime/progress.h"

#include <caravan/settings.h>

#include <array>
#include <atomic>
#include <thread>

namespace caravan::detail {
namespace {

// A fixed table, so that helping takes no lock and allocates nothing: one slot per GPU channel
// queue (8 GPUs have 8 x 7 peer pairs and a few host queues each).
constexpr std::size_t kSlots = 256;
std::array<std::atomic<ProgressHook*>, kSlots> g_hooks{};
// Slot i's hook is being run (or about to be): its removal waits for this, and for nothing else.
std::array<std::atomic<bool>, kSlots> g_running{};
std::atomic<std::size_t> g_used{0};      // slots [0, g_used) may hold hooks
std::atomic<int> g_registered{0};
std::atomic<bool> g_busy{false};         // a thread is running the hooks (one at a time)
thread_local bool t_helping = false;

}  // namespace

bool add_progress_hook(ProgressHook* hook) noexcept {
  for (std::size_t i = 0; i < kSlots; ++i) {
    ProgressHook* expected = nullptr;
    if (g_hooks[i].compare_exchange_strong(expected, hook)) {
      std::size_t used = g_used.load();
      while (used < i + 1 && !g_used.compare_exchange_weak(used, i + 1)) {
      }
      g_registered.fetch_add(1);
      return true;
    }
  }
  return false;
}

void remove_progress_hook(ProgressHook* hook) noexcept {
  std::size_t slot = kSlots;
  for (std::size_t i = 0; i < kSlots && slot == kSlots; ++i) {
    ProgressHook* expected = hook;
    if (g_hooks[i].compare_exchange_strong(expected, nullptr)) slot = i;
  }
  if (slot == kSlots) return;
  g_registered.fetch_sub(1);
  // A helper that read the slot before it was cleared marked it running first (both sequentially
  // consistent), so that mark is seen here until the helper is done with the hook. Other hooks'
  // work (completions that may run user callbacks) is not waited for.
  // Removed from inside a hook (a completion that tears down another queue): this thread is the
  // one helper (g_busy), so no other thread can be running any hook.
  if (t_helping) return;
  while (g_running[slot].load()) std::this_thread::yield();
}

void help_progress() noexcept {
  if (t_helping || g_registered.load(std::memory_order_relaxed) == 0) return;
  if (g_busy.load(std::memory_order_relaxed) || g_busy.exchange(true)) return;
  t_helping = true;
  const std::size_t used = g_used.load();
  for (std::size_t i = 0; i < used; ++i) {
    if (g_hooks[i].load(std::memory_order_relaxed) == nullptr) continue;  // a cheap look first
    g_running[i].store(true);
    if (ProgressHook* hook = g_hooks[i].load()) hook->help();
    g_running[i].store(false);
  }
  t_helping = false;
  g_busy.store(false);
}

bool waiting_threads_help() { return settings::get_bool("CARAVAN_WAIT_HELPS"); }

}  // namespace caravan::detail
