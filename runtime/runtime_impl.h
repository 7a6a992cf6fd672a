// RuntimeImpl: what one running runtime owns, and the process-wide pointer that event handles
// use to find it.
#pragma once

#include "runtime/cpu_processor.h"
#include "runtime/event_table.h"

#include <caravan/runtime.h>

#include <atomic>
#include <memory>

namespace caravan {

class RuntimeImpl {
 public:
  RuntimeImpl(Runtime* owner, const RuntimeOptions& options);
  ~RuntimeImpl();

  detail::EventTable& events() { return *events_; }
  detail::CpuProcessor& cpu() { return *cpu_; }
  Runtime* owner() const { return owner_; }
  int rank() const { return 0; }
  int world_size() const { return 1; }
  bool accepting_work() const { return !stopping_.load(std::memory_order_acquire); }

  Event spawn(TaskId task, std::span<const std::byte> args, const SpawnOptions& options);
  void shutdown();

  // The running runtime, or nullptr.
  static RuntimeImpl* current() { return g_current.load(std::memory_order_acquire); }
  // The event table that `e` lives in; throws Error(shut_down) if its runtime is gone.
  static detail::EventTable& table_for(const Event& e);

 private:
  static std::atomic<RuntimeImpl*> g_current;

  Runtime* owner_;
  std::unique_ptr<detail::EventTable> events_;
  std::unique_ptr<detail::CpuProcessor> cpu_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> stopped_{false};
};

}  // namespace caravan
