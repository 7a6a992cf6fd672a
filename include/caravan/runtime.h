// The runtime: one per process (one rank). It owns the event table, the processors and their
// worker threads. Create it first, shut it down last; events of a runtime that was shut down
// can no longer be used, and saying so is an error, not a hang.
#pragma once

#include <caravan/event.h>
#include <caravan/task.h>

#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace caravan {

// Where this process sits in a job of several ranks. `caravan run`, torchrun and Slurm scripts
// describe it with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (see docs/distributed.md).
struct LaunchOptions {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";  // where rank 0 listens for the rendezvous
  int master_port = 0;                      // 1..65535 when world_size > 1
  // Ranks with equal node keys form one node (share host memory). Empty: the host name.
  // `caravan run --nodes K` gives each logical node its own key.
  std::string node_key;
  // Names what the job creates on each node (the symmetric heap's /dev/shm segment): letters,
  // digits, '_' and '-', at most 64. Empty: rank 0 picks one. `caravan run` sets CARAVAN_JOB_ID,
  // so that it can remove what a job that was killed leaves there.
  std::string job_id;
};

struct RuntimeOptions {
  // Worker threads of this rank's CPU processor, 1 to 4096. Unset: the CARAVAN_CPU_WORKERS setting
  // (whose default, 0, means one per core).
  std::optional<int> cpu_workers;
  // The job this runtime joins. Unset: read from the environment (RANK, WORLD_SIZE, ...);
  // when the environment names no job either, the runtime is one rank on its own.
  std::optional<LaunchOptions> launch;
};

// One rank of the job, as every rank sees it after the rendezvous.
struct RankInfo {
  int rank = 0;
  int node = 0;        // index of its node, 0..node_count()-1, in order of the nodes' lowest rank
  int local_rank = 0;  // its index among the ranks of its node
  std::string host;
  int pid = 0;
};

class RuntimeImpl;

class Runtime {
 public:
  // Starts the runtime. Throws Error(already_done) if one is running in this process and
  // Error(invalid_argument) for bad options.
  explicit Runtime(RuntimeOptions options = {});
  ~Runtime();  // shutdown(); on one of the runtime's own threads or in a callback it logs an error and leaks it
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // The running runtime; throws Error(shut_down) if there is none.
  static Runtime& current();
  static bool is_running();

  int rank() const;
  int world_size() const;
  // Nodes: ranks that share host memory (one host, or one logical node of `caravan run --nodes`).
  int node() const;
  int node_count() const;
  // Throws Error(invalid_argument) for a rank outside [0, world_size()).
  const RankInfo& rank_info(int rank) const;
  std::vector<int> ranks_on_node(int node) const;
  // This rank's processors: cpu0, then gpu0..gpuN-1, one per GPU the rank sees (the first call
  // asks the GPU runtime). A GPU processor starts (its streams and threads) at its first task.
  std::vector<Processor> processors() const;
  int cpu_worker_count() const;

  // Spawns a task; returns the event that triggers when it has run. Any thread may spawn, tasks
  // included (a task that spawns and waits on its child occupies its worker meanwhile: prefer
  // a precondition). Bad input (an unknown
  // task, a priority out of range, an unknown processor) throws before anything is queued.
  // A processor of another rank runs the task there, found by its name (every rank registers
  // the same tasks); its completion event lives on this rank. If that rank fails, the
  // completion is poisoned with an Errc::transport cause naming it.
  Event spawn(TaskId task, std::span<const std::byte> args = {}, const SpawnOptions& options = {});
  Event spawn(std::string_view task_name, std::span<const std::byte> args = {},
              const SpawnOptions& options = {});

  // Blocks until every rank has called barrier() as many times as this one. Throws
  // Error(transport) if a rank fails first, Error(timeout) after `timeout` (when given).
  // One rank alone returns at once.
  void barrier(std::optional<std::chrono::nanoseconds> timeout = std::nullopt);

  // Stops the workers after the tasks running now return. Work that has not run (queued tasks,
  // tasks waiting on preconditions, pending user events) is poisoned with Error(shut_down), so
  // nobody waits forever. Queued CPU tasks fail at once; GPU tasks keep launching until the CPU
  // tasks have returned (one may wait on them), then queued GPU tasks fail. When nothing moves
  // any more (every task body still running blocked in Event::wait, no GPU work in flight, no
  // event triggering) for 20 ms (CARAVAN_SHUTDOWN_TIMEOUT_S with several ranks), pending user
  // events fail; after another such spell, every pending event fails. A task that computes, or
  // waits on work that progresses, is waited for, as is one blocked in anything but
  // Event::wait. Call it from a thread of the application: from a task body, an event callback
  // or any other thread of the runtime's it throws Error(invalid_argument) (it would wait for
  // the thread it runs on). With several ranks it then waits (at most
  // CARAVAN_SHUTDOWN_TIMEOUT_S) until every live rank has shut down too, serving their requests
  // meanwhile. Idempotent.
  void shutdown();

  RuntimeImpl& impl() { return *impl_; }

 private:
  std::unique_ptr<RuntimeImpl> impl_;
};

}  // namespace caravan
