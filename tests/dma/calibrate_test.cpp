// The calibration cache shared by processes (and threads) that start together: one measures, the
// others wait for it and read what it wrote.
#include "runtime/dma/calibrate.h"

#include <caravan/settings.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace caravan {
namespace {

// A cache directory of its own, removed afterwards.
struct FreshCacheDir {
  std::filesystem::path path;
  settings::ScopedOverride setting;
  explicit FreshCacheDir(const std::string& name)
      : path(std::filesystem::temp_directory_path() / (name + "-" + std::to_string(::getpid()))),
        setting("CARAVAN_CACHE_DIR", path.string()) {
    std::filesystem::remove_all(path);
  }
  ~FreshCacheDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

// The same channels with the same samples (a cache lists its channels by name, so compare by name).
bool same_samples(const dma::Calibration& a, const dma::Calibration& b) {
  auto by_name = [](const dma::Calibration& c) {
    std::map<std::string, std::vector<std::pair<std::uint64_t, double>>> out;
    for (const auto& ch : c.channels)
      for (const auto& s : ch.samples) out[ch.channel].emplace_back(s.bytes, s.gbps);
    return out;
  };
  return !a.channels.empty() && by_name(a) == by_name(b);
}

TEST(Calibration, CallersStartingTogetherMeasureOnceAndShareTheTables) {
  FreshCacheDir dir("caravan-calibrate-together");
  constexpr int kCallers = 3;
  std::vector<std::future<std::pair<dma::Calibration, bool>>> callers;
  std::atomic<int> ready{0};
  for (int i = 0; i < kCallers; ++i)
    callers.push_back(std::async(std::launch::async, [&] {
      ++ready;
      while (ready.load() < kCallers) std::this_thread::yield();  // all start at once
      bool from_cache = false;
      dma::Calibration c = dma::load_or_calibrate(false, &from_cache);
      return std::pair{std::move(c), from_cache};
    }));
  std::vector<std::pair<dma::Calibration, bool>> got;
  for (auto& f : callers) {
    ASSERT_EQ(f.wait_for(std::chrono::seconds(120)), std::future_status::ready) << "a caller is still calibrating";
    got.push_back(f.get());
  }
  int measured = 0;
  for (const auto& [c, from_cache] : got) measured += from_cache ? 0 : 1;
  EXPECT_EQ(measured, 1) << "exactly one caller should measure; the others read its cache";
  for (const auto& [c, from_cache] : got) EXPECT_TRUE(same_samples(c, got.front().first)) << "every caller gets the same tables";
  // Nothing half-written is left beside the cache.
  for (const auto& entry : std::filesystem::directory_iterator(dir.path))
    EXPECT_EQ(entry.path().string().find(".partial"), std::string::npos) << entry.path();
}

TEST(Calibration, AnUnreadableCacheIsMeasuredAgainAndReplaced) {
  FreshCacheDir dir("caravan-calibrate-unreadable");
  std::filesystem::create_directories(dir.path);
  std::ofstream(dma::calibration_path()) << "{ \"machine_key\": ";  // cut off mid-write
  bool from_cache = true;
  const dma::Calibration first = dma::load_or_calibrate(false, &from_cache);
  EXPECT_FALSE(from_cache);
  const dma::Calibration second = dma::load_or_calibrate(false, &from_cache);
  EXPECT_TRUE(from_cache);
  EXPECT_TRUE(same_samples(first, second));
}

}  // namespace
}  // namespace caravan
