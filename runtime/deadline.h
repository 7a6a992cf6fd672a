// A deadline `timeout` from now that saturates: a timeout past the clock's range (a caller's
// nanoseconds::max() for "no limit") must mean no deadline, where `now + timeout` would overflow
// (undefined behaviour, and in practice a deadline already past, so the wait gave up at once).
#pragma once

#include <chrono>

namespace caravan::detail {

template <class Clock = std::chrono::steady_clock, class Rep, class Period>
typename Clock::time_point deadline_after(std::chrono::duration<Rep, Period> timeout,
                                          typename Clock::time_point now = Clock::now()) {
  using Duration = typename Clock::duration;
  if (timeout <= std::chrono::duration<Rep, Period>::zero()) return now;
  // Compared in the timeout's own units first, so that converting it cannot overflow either.
  const auto room = Clock::time_point::max() - now;
  if (timeout >= std::chrono::duration_cast<std::chrono::duration<Rep, Period>>(room)) return Clock::time_point::max();
  return now + std::chrono::duration_cast<Duration>(timeout);
}

}  // namespace caravan::detail
