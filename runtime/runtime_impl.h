// RuntimeImpl: what one running runtime owns, and the process-wide pointer that event handles
// use to find it.
#pragma once

#include "runtime/cpu_processor.h"
#include "runtime/event_table.h"

#include <caravan/runtime.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace caravan {

// A subsystem that lives as long as one runtime (the DMA engine, ...). Services are created on
// first use and shut down before the runtime poisons its pending events, newest first.
class RuntimeService {
 public:
  virtual ~RuntimeService() = default;
  virtual void shutdown() = 0;
};

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

  // The service registered as `name`, created by `make` on first use. Throws Error(shut_down)
  // once the runtime is shutting down.
  RuntimeService& service(const std::string& name, const std::function<std::unique_ptr<RuntimeService>()>& make);

  // The running runtime, or nullptr.
  static RuntimeImpl* current() { return g_current.load(std::memory_order_acquire); }
  // The event table that `e` lives in; throws Error(shut_down) if its runtime is gone.
  static detail::EventTable& table_for(const Event& e);

 private:
  static std::atomic<RuntimeImpl*> g_current;

  Runtime* owner_;
  std::unique_ptr<detail::EventTable> events_;
  std::unique_ptr<detail::CpuProcessor> cpu_;
  std::mutex services_mutex_;
  std::map<std::string, RuntimeService*> services_by_name_;
  std::vector<std::unique_ptr<RuntimeService>> services_;  // in creation order
  std::atomic<bool> stopping_{false};
  std::atomic<bool> stopped_{false};
};

}  // namespace caravan
