#include "kernels/host/thread_team.h"

#include "runtime/cpu_relax.h"

#include <caravan/error.h>

#include <fmt/format.h>

namespace caravan::kernels::detail {

ThreadTeam::ThreadTeam(int size) {
  if (size < 1) throw Error(Errc::invalid_argument, fmt::format("ThreadTeam: size {} must be at least 1", size));
  threads_.reserve(static_cast<std::size_t>(size - 1));
  for (int member = 1; member < size; ++member) threads_.emplace_back([this, member] { member_loop(member); });
}

ThreadTeam::~ThreadTeam() {
  stop_ = true;
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (auto& thread : threads_) thread.join();
}

void ThreadTeam::execute(int member) {
  if (member < count_) {
    try {
      (*fn_)(member);
    } catch (...) {
      failed_.store(true, std::memory_order_relaxed);
      std::lock_guard lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
  // The last member to finish wakes the caller (member 0 waits on remaining_).
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) remaining_.notify_all();
}

void ThreadTeam::member_loop(int member) {
  std::uint64_t seen = 0;
  for (;;) {
    // Launches come back to back in a benchmark or a layer: spin a little before sleeping.
    std::uint64_t now = generation_.load(std::memory_order_acquire);
    for (int spin = 0; now == seen && spin < 2000; ++spin) {
      cpu_relax();
      now = generation_.load(std::memory_order_acquire);
    }
    while (now == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      now = generation_.load(std::memory_order_acquire);
    }
    seen = now;
    if (stop_) return;
    execute(member);
  }
}

void ThreadTeam::run(int count, const std::function<void(int)>& fn) {
  if (count < 1 || count > size())
    throw Error(Errc::invalid_argument, fmt::format("ThreadTeam::run: {} members requested of a team of {}", count, size()));
  fn_ = &fn;
  count_ = count;
  error_ = nullptr;
  failed_.store(false, std::memory_order_relaxed);
  // Every member passes through execute() (those past `count` only count down), so the next
  // run cannot start while a member still reads this run's fn_ and count_.
  remaining_.store(size(), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  execute(0);
  for (int left = remaining_.load(std::memory_order_acquire); left != 0; left = remaining_.load(std::memory_order_acquire))
    remaining_.wait(left, std::memory_order_acquire);
  if (error_) std::rethrow_exception(error_);
}

}  // namespace caravan::kernels::detail
