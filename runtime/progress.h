// Completion work that a waiting thread may do itself.
//
// A copy on a GPU channel finishes through service threads: the channel's completion thread
// notices the GPU event, and the DMA worker's bookkeeping triggers the copy's event. After an
// idle spell (more than CARAVAN_GPU_WORKER_SPIN_US) those threads sleep, and waking one took
// 150-200 us on the GPU machine (a virtual machine), many times a small copy's own time. A thread
// in Event::wait() or Event::query() is awake anyway: it runs the registered hooks, which finish
// whatever has completed on the device and is still waiting for its sleeping service thread.
//
// Hooks must be cheap when they have nothing to do (an atomic load), never block, and may run
// completion callbacks (so event callbacks may run on a thread that waits for another event).
// One thread helps at a time; a thread already helping does not help again from inside a hook.
// CARAVAN_WAIT_HELPS=false turns it off (hooks are then not registered).
#pragma once

namespace caravan::detail {

class ProgressHook {
 public:
  virtual ~ProgressHook() = default;
  // Finishes what it can without blocking.
  virtual void help() noexcept = 0;
};

// Registers `hook` (false: the table of hooks is full, and this one is never run).
bool add_progress_hook(ProgressHook* hook) noexcept;
// Unregisters `hook` and returns once no thread is running it (other hooks' work is not waited
// for). Not from inside a hook.
void remove_progress_hook(ProgressHook* hook) noexcept;
// Runs the hooks, unless another thread is running them or this thread already is.
void help_progress() noexcept;
// The CARAVAN_WAIT_HELPS setting, read now.
bool waiting_threads_help();

}  // namespace caravan::detail
