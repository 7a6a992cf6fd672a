#include "runtime/host_memory.h"
#include "tests/runtime/test_util.h"

#include <caravan/error.h>

#include <gtest/gtest.h>

namespace caravan {
namespace {

TEST(HostMemory, AvailableBytesComeFromTheKernel) {
  const auto available = detail::available_host_bytes();
  ASSERT_TRUE(available.has_value()) << "/proc/meminfo has no MemAvailable line";
  EXPECT_GT(*available, 0u);
}

TEST(HostMemory, ARequestLargerThanTheHostIsRefusedWithBothSizes) {
  const auto available = detail::available_host_bytes();
  ASSERT_TRUE(available.has_value());
  // Small requests are not checked; one at the checked size that the host holds passes.
  ASSERT_GT(*available, std::uint64_t{64} << 20);
  EXPECT_NO_THROW(detail::require_host_bytes(std::uint64_t{64} << 20, "64 MiB"));
  const std::uint64_t too_many = *available * 2 + (std::uint64_t{1} << 30);
  CARAVAN_EXPECT_ERROR(detail::require_host_bytes(too_many, "the test's buffer"), Errc::invalid_argument,
                       "the test's buffer: " + std::to_string(too_many) + " bytes");
  CARAVAN_EXPECT_ERROR(detail::require_host_bytes(too_many, "the test's buffer"), Errc::invalid_argument,
                       "MemAvailable");
}

}  // namespace
}  // namespace caravan
