#include "runtime/task_registry.h"

#include <caravan/error.h>

#include <fmt/format.h>

#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <mutex>

namespace caravan {
namespace {

constexpr std::uint32_t kMaxTasks = 1u << 16;

struct Registry {
  std::mutex mutex;
  std::deque<detail::TaskEntry> entries;                 // stable addresses
  std::map<std::string, std::uint32_t, std::less<>> by_name;
  std::array<std::atomic<const detail::TaskEntry*>, kMaxTasks> by_id{};
  std::uint32_t count = 0;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

TaskId register_task(std::string name, TaskFn fn) {
  if (name.empty()) throw Error(Errc::invalid_argument, "register_task: name must not be empty");
  if (!fn) throw Error(Errc::invalid_argument, fmt::format("register_task('{}'): the task function is empty", name));
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  if (r.by_name.count(name))
    throw Error(Errc::already_done, fmt::format("register_task: a task named '{}' is already registered", name));
  if (r.count == kMaxTasks)
    throw Error(Errc::invalid_argument, fmt::format("register_task('{}'): at most {} tasks can be registered", name, kMaxTasks));
  r.entries.push_back({name, std::move(fn)});
  std::uint32_t id = r.count++;
  r.by_name.emplace(std::move(name), id);
  r.by_id[id].store(&r.entries.back(), std::memory_order_release);
  return TaskId{id};
}

TaskId find_task(std::string_view name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  auto it = r.by_name.find(name);
  if (it == r.by_name.end())
    throw Error(Errc::not_found, fmt::format("no task named '{}' is registered (register it with caravan::register_task)", name));
  return TaskId{it->second};
}

std::string_view task_name(TaskId id) {
  const detail::TaskEntry* entry = detail::lookup_task(id);
  if (!entry) throw Error(Errc::not_found, fmt::format("no task has id {}", id.value));
  return entry->name;
}

void TaskContext::check_args_size(std::size_t expected) const {
  if (args.size() != expected)
    throw Error(Errc::invalid_argument, fmt::format("task '{}': arguments are {} bytes, but {} were expected",
                                                    task_name, args.size(), expected));
}

namespace detail {

const TaskEntry* lookup_task(TaskId id) noexcept {
  if (id.value >= kMaxTasks) return nullptr;
  return registry().by_id[id.value].load(std::memory_order_acquire);
}

}  // namespace detail
}  // namespace caravan
