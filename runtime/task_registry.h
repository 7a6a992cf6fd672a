// The process-wide table of registered tasks. Registration takes a lock; lookup by TaskId from
// worker threads does not (entries are never removed or moved).
#pragma once

#include <caravan/task.h>

#include <string>

namespace caravan::detail {

struct TaskEntry {
  std::string name;
  TaskFn fn;
};

// The entry for `id`, or nullptr if no task has that id.
const TaskEntry* lookup_task(TaskId id) noexcept;

}  // namespace caravan::detail
