// Helpers shared by the runtime tests.
#pragma once

#include <caravan/caravan.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <thread>

namespace caravan::test {

// Registers `fn` under `name`, or returns the id it already has (tasks are process-wide, and a
// test binary may run a test body more than once with --gtest_repeat).
inline TaskId task(const std::string& name, TaskFn fn) {
  try {
    return register_task(name, std::move(fn));
  } catch (const Error& e) {
    if (e.code() != Errc::already_done) throw;
    return find_task(name);
  }
}

// Waits until `e` has triggered, successfully or poisoned; false after `timeout`.
inline bool settles(const Event& e, std::chrono::nanoseconds timeout) {
  try {
    return e.wait_for(timeout);
  } catch (const EventPoisoned&) {
    return true;
  }
}

// Runs rt.shutdown() on another thread; false if it has not returned after `timeout`. That thread
// is then detached, and the caller should leak the runtime (and what its tasks write to) rather
// than destroy it under the hung shutdown: the test reports the failure instead of hanging.
inline bool shuts_down_within(Runtime& rt, std::chrono::nanoseconds timeout) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> returned = done->get_future();
  std::thread([&rt, done] {
    rt.shutdown();
    done->set_value();
  }).detach();
  return returned.wait_for(timeout) == std::future_status::ready;
}

// This rank's GPU processor `index`.
inline Processor gpu_processor(int index) {
  return Processor{ProcessorKind::gpu, Processor::kThisRank, static_cast<std::uint16_t>(index)};
}

// Expects `statement` to throw caravan::Error with `code` and a message containing `text`.
#define CARAVAN_EXPECT_ERROR(statement, expected_code, text)                                 \
  do {                                                                                       \
    try {                                                                                    \
      statement;                                                                             \
      ADD_FAILURE() << "expected caravan::Error from: " #statement;                          \
    } catch (const ::caravan::Error& caravan_error_) {                                       \
      EXPECT_EQ(caravan_error_.code(), expected_code) << caravan_error_.what();              \
      EXPECT_NE(std::string(caravan_error_.what()).find(text), std::string::npos)            \
          << "message was: " << caravan_error_.what();                                       \
    }                                                                                        \
  } while (0)

}  // namespace caravan::test
