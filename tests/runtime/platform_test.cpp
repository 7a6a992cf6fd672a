// The GPU switch: what was compiled must match what the build says, and "no device" must say why.
#include "tests/runtime/test_util.h"

namespace caravan {
namespace {

TEST(Platform, ProbeMatchesTheBuildConfiguration) {
  GpuProbe probe = probe_gpus();
#ifdef CARAVAN_HAVE_GPU
  EXPECT_TRUE(probe.built);
  EXPECT_FALSE(probe.toolchain.empty());
#else
  EXPECT_FALSE(probe.built);
  EXPECT_TRUE(probe.toolchain.empty());
  EXPECT_EQ(probe.device_count, 0);
#endif
  EXPECT_GE(probe.device_count, 0);
  if (probe.device_count == 0) {
    EXPECT_FALSE(probe.reason.empty()) << "a build that sees no GPU must say why";
  }
}

TEST(Platform, DevicesAreUsableWhereTheyExist) {
  GpuProbe probe = probe_gpus();
  if (probe.device_count == 0) GTEST_SKIP() << "no GPU here: " << probe.reason;
  EXPECT_TRUE(probe.built);
  EXPECT_TRUE(probe.reason.empty());
}

}  // namespace
}  // namespace caravan
