// Errors: every failure Caravan reports is a caravan::Error carrying a code that says what broke,
// and a message that names the argument or object at fault and the rule it broke.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

namespace caravan {

// What a failure breaks, so a caller knows what is still usable.
enum class Errc {
  invalid_argument,  // bad input to a public call; nothing was started
  not_found,         // a named thing (task, memory, setting) does not exist
  already_done,      // an operation that may happen once happened twice (e.g. triggering an event)
  timeout,           // a bounded wait ran out
  poisoned,          // waited-on work failed; the cause is attached
  cancelled,         // work was cancelled before it finished
  shut_down,         // the runtime the object belongs to has been shut down
  task_failed,       // a task body threw
  transport,         // a transport (UCX, a channel) failed
  device,            // a GPU reported an error
  io,                // reading or writing a file failed (after the call was accepted)
  internal,          // a bug in Caravan
};

std::string_view to_string(Errc code) noexcept;

class Error : public std::runtime_error {
 public:
  Error(Errc code, const std::string& message) : std::runtime_error(message), code_(code) {}
  Errc code() const noexcept { return code_; }

 private:
  Errc code_;
};

// The cause attached to a poisoned event. Shared because one failure poisons many events.
using FailureCause = std::shared_ptr<const Error>;

// Thrown when waiting on an event that triggered as failed. cause() is the first failure (a
// task's, a transport's...), however many events it travelled through. A task body that threw
// is reported as Errc::task_failed with the task's name and the exception's what() in the
// message (the exception object itself, and a caravan::Error's own code, are not kept); a body
// that rethrew an EventPoisoned passes the earlier cause on unchanged.
class EventPoisoned : public Error {
 public:
  explicit EventPoisoned(FailureCause cause);
  const FailureCause& cause() const noexcept { return cause_; }

 private:
  FailureCause cause_;
};

// Builds a FailureCause in one call.
FailureCause make_failure(Errc code, const std::string& message);

}  // namespace caravan
