#include <caravan/error.h>

namespace caravan {

std::string_view to_string(Errc code) noexcept {
  switch (code) {
    case Errc::invalid_argument: return "invalid_argument";
    case Errc::not_found: return "not_found";
    case Errc::already_done: return "already_done";
    case Errc::timeout: return "timeout";
    case Errc::poisoned: return "poisoned";
    case Errc::cancelled: return "cancelled";
    case Errc::shut_down: return "shut_down";
    case Errc::task_failed: return "task_failed";
    case Errc::transport: return "transport";
    case Errc::device: return "device";
    case Errc::io: return "io";
    case Errc::internal: return "internal";
  }
  return "unknown";
}

EventPoisoned::EventPoisoned(FailureCause cause)
    : Error(Errc::poisoned, "event poisoned: " + std::string(cause ? cause->what() : "unknown cause")),
      cause_(std::move(cause)) {}

FailureCause make_failure(Errc code, const std::string& message) {
  return std::make_shared<const Error>(code, message);
}

}  // namespace caravan
