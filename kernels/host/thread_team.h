// A persistent team of threads for the CPU kernels: one launch of an overlapped operation runs
// one function on every member (the calling thread is member 0) and returns when all are done.
// Starting threads per launch would cost tens of microseconds, as much as a small collective.
//
// Members park on a generation counter (C++20 atomic wait: a futex on Linux) after a short
// spin. When a member throws, the team is marked failed so that the others' flag waits give up
// at once (Abort) instead of waiting for chunks that will never come; run() then rethrows the
// first exception.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace caravan::kernels::detail {

class ThreadTeam {
 public:
  explicit ThreadTeam(int size);
  ~ThreadTeam();
  ThreadTeam(const ThreadTeam&) = delete;
  ThreadTeam& operator=(const ThreadTeam&) = delete;

  int size() const { return static_cast<int>(threads_.size()) + 1; }
  // Runs fn(member) for member in [0, count) (count <= size()); member 0 is the caller.
  void run(int count, const std::function<void(int member)>& fn);
  // True once a member of the current run has thrown.
  bool failed() const { return failed_.load(std::memory_order_relaxed); }

 private:
  void member_loop(int member);
  void execute(int member);

  std::vector<std::thread> threads_;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<bool> failed_{false};
  bool stop_ = false;                       // written before a generation bump
  int count_ = 0;                           // idem
  const std::function<void(int)>* fn_ = nullptr;  // idem
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

}  // namespace caravan::kernels::detail
