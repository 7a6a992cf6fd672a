#include "runtime/net/ucx.h"

#include <fmt/format.h>

namespace caravan::net {

std::string ucs_status_name(ucs_status_t status) {
  switch (status) {
#define CARAVAN_UCS_NAME(s) \
  case s: return #s;
    CARAVAN_UCS_NAME(UCS_OK)
    CARAVAN_UCS_NAME(UCS_INPROGRESS)
    CARAVAN_UCS_NAME(UCS_ERR_NO_MESSAGE)
    CARAVAN_UCS_NAME(UCS_ERR_NO_RESOURCE)
    CARAVAN_UCS_NAME(UCS_ERR_IO_ERROR)
    CARAVAN_UCS_NAME(UCS_ERR_NO_MEMORY)
    CARAVAN_UCS_NAME(UCS_ERR_INVALID_PARAM)
    CARAVAN_UCS_NAME(UCS_ERR_UNREACHABLE)
    CARAVAN_UCS_NAME(UCS_ERR_INVALID_ADDR)
    CARAVAN_UCS_NAME(UCS_ERR_NOT_IMPLEMENTED)
    CARAVAN_UCS_NAME(UCS_ERR_MESSAGE_TRUNCATED)
    CARAVAN_UCS_NAME(UCS_ERR_NO_PROGRESS)
    CARAVAN_UCS_NAME(UCS_ERR_BUFFER_TOO_SMALL)
    CARAVAN_UCS_NAME(UCS_ERR_NO_ELEM)
    CARAVAN_UCS_NAME(UCS_ERR_SOME_CONNECTS_FAILED)
    CARAVAN_UCS_NAME(UCS_ERR_NO_DEVICE)
    CARAVAN_UCS_NAME(UCS_ERR_BUSY)
    CARAVAN_UCS_NAME(UCS_ERR_CANCELED)
    CARAVAN_UCS_NAME(UCS_ERR_SHMEM_SEGMENT)
    CARAVAN_UCS_NAME(UCS_ERR_ALREADY_EXISTS)
    CARAVAN_UCS_NAME(UCS_ERR_OUT_OF_RANGE)
    CARAVAN_UCS_NAME(UCS_ERR_TIMED_OUT)
    CARAVAN_UCS_NAME(UCS_ERR_EXCEEDS_LIMIT)
    CARAVAN_UCS_NAME(UCS_ERR_UNSUPPORTED)
    CARAVAN_UCS_NAME(UCS_ERR_REJECTED)
    CARAVAN_UCS_NAME(UCS_ERR_NOT_CONNECTED)
    CARAVAN_UCS_NAME(UCS_ERR_CONNECTION_RESET)
    CARAVAN_UCS_NAME(UCS_ERR_ENDPOINT_TIMEOUT)
#undef CARAVAN_UCS_NAME
    default: return fmt::format("UCS_ERR_{}", static_cast<int>(status));
  }
}

std::string describe_ucx_failure(const char* call, const char* file, int line, ucs_status_t status) {
  // Keep the path from the source tree's top folder on, so messages do not depend on where the
  // tree was checked out. The top folder is where this very file's path leaves off.
  constexpr std::string_view kThisFile = __FILE__;
  constexpr std::string_view kSuffix = "runtime/net/ucx.cpp";
  std::string_view root = kThisFile.ends_with(kSuffix) ? kThisFile.substr(0, kThisFile.size() - kSuffix.size()) : "";
  std::string_view path(file);
  if (!root.empty() && path.starts_with(root)) path.remove_prefix(root.size());
  return fmt::format("{} failed at {}:{}: {} ({})", call, path, line, ucs_status_name(status),
                     ucs_status_string(status));
}

void throw_ucx_error(const char* call, const char* file, int line, ucs_status_t status) {
  throw Error(Errc::transport, describe_ucx_failure(call, file, line, status));
}

}  // namespace caravan::net
