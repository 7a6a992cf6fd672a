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

#if !defined(CARAVAN_HAVE_GPU) && defined(CARAVAN_TEST_GPU_SWITCH)
// A build configured with CARAVAN_GPU=OFF says so, and how to turn it on; one where AUTO found
// no compiler says that instead (it said "no compiler was found" for both).
TEST(Platform, ABuildWithoutGpuSupportSaysWhy) {
  const std::string reason = probe_gpus().reason;
  if (std::string(CARAVAN_TEST_GPU_SWITCH) == "OFF") {
    EXPECT_NE(reason.find("turned off when the build was configured (CARAVAN_GPU=OFF)"), std::string::npos) << reason;
    EXPECT_NE(reason.find("-DCARAVAN_GPU=AUTO or -DCARAVAN_GPU=ON"), std::string::npos) << reason;
    EXPECT_EQ(reason.find("no CUDA compiler"), std::string::npos) << reason;
  } else {
    EXPECT_NE(reason.find("no CUDA compiler was found when the build was configured (CARAVAN_GPU=AUTO)"),
              std::string::npos)
        << reason;
  }
}
#endif

TEST(Platform, DevicesAreUsableWhereTheyExist) {
  GpuProbe probe = probe_gpus();
  if (probe.device_count == 0) GTEST_SKIP() << "no GPU here: " << probe.reason;
  EXPECT_TRUE(probe.built);
  EXPECT_TRUE(probe.reason.empty());
}

}  // namespace
}  // namespace caravan
