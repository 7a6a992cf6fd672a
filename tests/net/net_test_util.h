// Helpers for the distributed tests. Multi-process tests are GoogleTest programs that every rank
// runs under `caravan run -n N [--nodes K]` (see CMakeLists.txt): each rank runs the same test
// bodies in the same order, so collectives (allgather, barrier) line up.
#pragma once

#include "runtime/net/network.h"
#include "runtime/runtime_impl.h"
#include "tests/runtime/test_util.h"

#include <caravan/caravan.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <cstdlib>
#include <vector>

namespace caravan::test {

inline net::Network& network(Runtime& rt) {
  net::Network* n = rt.impl().network();
  if (!n) throw Error(Errc::internal, "this runtime is one rank alone; the test needs a job");
  return *n;
}

// Every rank's value of a trivially copyable T, by rank (a collective).
template <class T>
std::vector<T> all_gather(Runtime& rt, const T& mine) {
  auto parts = network(rt).allgather(std::as_bytes(std::span<const T, 1>(&mine, 1)), std::chrono::seconds(30), "test");
  std::vector<T> out;
  for (auto& part : parts) {
    T value;
    EXPECT_EQ(part.size(), sizeof(T));
    std::memcpy(&value, part.data(), sizeof(T));
    out.push_back(value);
  }
  return out;
}

// A runtime per test: every test rendezvous afresh, so a test that breaks the job (a rank
// that fails, shuts down early) leaves nothing behind for the next one.
class JobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::getenv("WORLD_SIZE")) GTEST_SKIP() << "not started as a rank (run under caravan run; ctest label multiproc)";
    rt_.emplace(RuntimeOptions{.cpu_workers = 2});
  }
  Runtime& rt() { return *rt_; }
  int rank() { return rt_->rank(); }
  int world() { return rt_->world_size(); }
  std::optional<Runtime> rt_;
};

}  // namespace caravan::test
