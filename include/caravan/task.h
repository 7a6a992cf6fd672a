// Tasks: functions registered by name, spawned with argument bytes, a precondition event and a
// priority, returning a completion event. Names make tasks spawnable on other ranks.
#pragma once

#include <caravan/event.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

namespace caravan {

// Task priorities: among ready tasks on a processor, higher runs first.
inline constexpr int kMinPriority = -1000;
inline constexpr int kMaxPriority = 1000;

enum class ProcessorKind : std::uint8_t { cpu, gpu };

// A processor: where tasks run. The default value is the CPU processor of the rank that uses
// it (rank kThisRank); Runtime::processors() lists processors with their real rank numbers.
struct Processor {
  static constexpr std::uint16_t kThisRank = 0xFFFF;  // never a real rank (at most 65535 ranks)
  ProcessorKind kind = ProcessorKind::cpu;
  std::uint16_t rank = kThisRank;
  std::uint16_t index = 0;
  friend constexpr bool operator==(const Processor&, const Processor&) = default;
  std::string to_string() const;
};

struct TaskId {
  std::uint32_t value = UINT32_MAX;
  constexpr bool valid() const { return value != UINT32_MAX; }
  friend constexpr bool operator==(const TaskId&, const TaskId&) = default;
};

// What a running task sees.
struct TaskContext {
  TaskId task;
  std::string_view task_name;
  std::span<const std::byte> args;
  Processor processor;
  Event completion;  // the event that triggers when this task is done (see below for GPU tasks)

  // On a GPU processor: the GPU (its HIP/CUDA ordinal, current on the calling thread) and the
  // stream to enqueue the task's work on (a hipStream_t / cudaStream_t). The task is done when
  // the work on that stream, as of the body's return, has finished; a GPU error poisons the
  // completion. The body should enqueue and return: the processor launches its tasks from one
  // thread. On a CPU processor: -1 and nullptr.
  int gpu_device = -1;
  void* gpu_stream = nullptr;

  // The arguments as a trivially copyable T; throws Error(invalid_argument) if sizes differ.
  template <class T>
  T args_as() const {
    static_assert(std::is_trivially_copyable_v<T>, "task arguments are raw bytes");
    check_args_size(sizeof(T));
    T value;
    std::memcpy(&value, args.data(), sizeof(T));
    return value;
  }

 private:
  void check_args_size(std::size_t expected) const;
};

// A task body. An exception it throws poisons the task's completion event with its message.
using TaskFn = std::function<void(TaskContext&)>;

// Registers a task under `name` (process-wide, before or after the runtime starts).
// Throws Error(invalid_argument) for an empty name, Error(already_done) if the name is taken.
TaskId register_task(std::string name, TaskFn fn);
// The task registered as `name`; throws Error(not_found) naming it otherwise.
TaskId find_task(std::string_view name);
std::string_view task_name(TaskId id);

// The bytes of a trivially copyable value, for spawn's args.
template <class T>
std::span<const std::byte> task_args(const T& value) {
  static_assert(std::is_trivially_copyable_v<T>, "task arguments are raw bytes");
  return std::as_bytes(std::span<const T, 1>(&value, 1));
}

struct SpawnOptions {
  // The task runs after this triggers; if it is poisoned, the task never runs. The default (and
  // a default-constructed UserEvent) is "no event": the task is ready at once.
  Event precondition;
  int priority = 0;     // in [kMinPriority, kMaxPriority]
  Processor processor;  // default: this rank's CPU processor
  // For a task on a GPU processor whose precondition is the completion of another GPU task of
  // this rank: launch it as soon as that task has been launched, with its stream waiting on the
  // GPU for that task's work, instead of waiting on the host for that work to finish. This
  // saves a host round trip per link of a chain of GPU tasks. The body then runs while the
  // precondition's GPU work may still be running, so it must not read on the host what that
  // work writes. If the precondition task fails before its work is enqueued (its own
  // precondition failed, its body threw, shutdown), this task never runs, as usual; a GPU error
  // in that work reaches this task through the GPU (it is poisoned by the same sticky error).
  // With any other precondition this flag changes nothing.
  bool order_on_gpu = false;
};

}  // namespace caravan
