// Skipping a GPU test, with the reason, on a machine with too few GPUs (CI has none).
#pragma once

#include <caravan/platform.h>

#include <gtest/gtest.h>

#include <string>

// Skips the test unless the GPU runtime sees at least `n` devices, saying why not.
#define CARAVAN_REQUIRE_GPU_COUNT(n)                                                                      \
  do {                                                                                                    \
    ::caravan::GpuProbe probe_ = ::caravan::probe_gpus();                                                 \
    if (probe_.device_count < (n))                                                                        \
      GTEST_SKIP() << "needs " << (n) << " GPU(s); "                                                      \
                   << (probe_.device_count == 0 ? probe_.reason                                           \
                                                : "this machine has " + std::to_string(probe_.device_count)); \
  } while (0)
