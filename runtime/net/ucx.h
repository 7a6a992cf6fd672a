// The thin UCX layer: one check macro for every UCX call, and status names for messages.
//
// CARAVAN_UCX_CHECK(call) throws caravan::Error(Errc::transport) whose message holds the call's
// text, file:line, the UCX status name and UCX's own description, e.g.
//   "ucp_ep_create(worker_, &params, &ep) failed at runtime/net/worker.cpp:212:
//    UCS_ERR_UNREACHABLE (Destination is unreachable)"
// CARAVAN_UCX_CHECK_PTR(call) does the same for calls returning ucs_status_ptr_t and yields
// the request pointer (nullptr when the operation completed at once).
#pragma once

#include <caravan/error.h>

#include <ucp/api/ucp.h>

#include <string>
#include <string_view>

namespace caravan::net {

// "UCS_ERR_NO_MEMORY" for UCS_ERR_NO_MEMORY, "UCS_ERR_<code>" for codes this table lacks.
std::string ucs_status_name(ucs_status_t status);

// "<call> failed at <file>:<line>: <name> (<description>)", file relative to the source tree.
std::string describe_ucx_failure(const char* call, const char* file, int line, ucs_status_t status);

[[noreturn]] void throw_ucx_error(const char* call, const char* file, int line, ucs_status_t status);

inline void* checked_request(ucs_status_ptr_t result, const char* call, const char* file, int line) {
  if (UCS_PTR_IS_ERR(result)) throw_ucx_error(call, file, line, UCS_PTR_STATUS(result));
  return result;
}

}  // namespace caravan::net

#define CARAVAN_UCX_CHECK(call)                                                          \
  do {                                                                                   \
    ucs_status_t caravan_ucx_status_ = (call);                                           \
    if (caravan_ucx_status_ != UCS_OK)                                                   \
      ::caravan::net::throw_ucx_error(#call, __FILE__, __LINE__, caravan_ucx_status_);   \
  } while (0)

#define CARAVAN_UCX_CHECK_PTR(call) ::caravan::net::checked_request((call), #call, __FILE__, __LINE__)
