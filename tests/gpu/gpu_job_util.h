// For multi-process tests with GPUs (tests/gpu/remote_gpu_copy_test.cpp, ipc_copy_test.cpp): a
// rank of a job that skips, with the reason, where its host has fewer GPUs than the job has
// ranks (rank r uses GPU r).
#pragma once

#include "runtime/gpu/devices.h"
#include "tests/net/net_test_util.h"

#include <string>

namespace caravan::test {

class GpuJobTest : public JobTest {
 protected:
  void SetUp() override {
    JobTest::SetUp();
    if (IsSkipped()) return;
    const auto& devices = gpu::topology().devices;
    if (devices.size() < static_cast<std::size_t>(world()))
      GTEST_SKIP() << "needs a GPU per rank on this host (" << world() << " ranks, "
                   << (devices.empty() ? gpu::topology().reason : std::to_string(devices.size()) + " GPUs") << ")";
  }
};

}  // namespace caravan::test
