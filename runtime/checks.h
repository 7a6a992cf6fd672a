// Private: argument checks several public calls share, so that each rule is written (and
// worded) once.
#pragma once

#include <caravan/error.h>
#include <caravan/task.h>

#include <fmt/format.h>

#include <string_view>

namespace caravan::detail {

// Error(invalid_argument) "<who>: priority <p> is outside [kMinPriority, kMaxPriority]".
inline void check_priority(int priority, std::string_view who) {
  if (priority < kMinPriority || priority > kMaxPriority)
    throw Error(Errc::invalid_argument,
                fmt::format("{}: priority {} is outside [{}, {}]", who, priority, kMinPriority, kMaxPriority));
}

}  // namespace caravan::detail
