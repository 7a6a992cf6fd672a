// The runtime: one per process (one rank). It owns the event table, the processors and their
// worker threads. Create it first, shut it down last; events of a runtime that was shut down
// can no longer be used, and saying so is an error, not a hang.
#pragma once

#include <caravan/event.h>
#include <caravan/task.h>

#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace caravan {

struct RuntimeOptions {
  // Worker threads of this rank's CPU processor. Unset: the CARAVAN_CPU_WORKERS setting
  // (whose default, 0, means one per core).
  std::optional<int> cpu_workers;
};

class RuntimeImpl;

class Runtime {
 public:
  // Starts the runtime. Throws Error(already_done) if one is running in this process and
  // Error(invalid_argument) for bad options.
  explicit Runtime(RuntimeOptions options = {});
  ~Runtime();  // shutdown()
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // The running runtime; throws Error(shut_down) if there is none.
  static Runtime& current();
  static bool is_running();

  int rank() const;
  int world_size() const;
  std::vector<Processor> processors() const;
  int cpu_worker_count() const;

  // Spawns a task; returns the event that triggers when it has run. Bad input (an unknown
  // task, a priority out of range, an unknown processor) throws before anything is queued.
  Event spawn(TaskId task, std::span<const std::byte> args = {}, const SpawnOptions& options = {});
  Event spawn(std::string_view task_name, std::span<const std::byte> args = {},
              const SpawnOptions& options = {});

  // Stops the workers after the tasks running now return. Work that has not run (queued tasks,
  // tasks waiting on preconditions, pending user events) is poisoned with Error(shut_down), so
  // nobody waits forever. Idempotent.
  void shutdown();

  RuntimeImpl& impl() { return *impl_; }

 private:
  std::unique_ptr<RuntimeImpl> impl_;
};

}  // namespace caravan
