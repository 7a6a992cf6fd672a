// GPU memories and channels (issue 6): every hop kind (host <-> fbm over sdma, fbm -> same fbm,
// fbm -> peer fbm over xgmi, zcm <-> fbm) with layout changes, on fresh random data and with the
// destination poisoned first, verified per (point, field); the copy engine's op translation
// (runs, batched runs, 2-D, 3-D, fills, the per-element fallback) against the host reference;
// priorities on the copy engine; HIP errors as caravan::Error. Every test that needs a device
// skips with the reason when there is none (CI has nvcc but no GPU).
#include "runtime/dma/calibrate.h"
#include "runtime/dma/channel.h"
#include "runtime/dma/storage.h"
#include "runtime/gpu/devices.h"
#include "tests/dma/dma_test_util.h"

#include <caravan/planner/plan.h>
#include <caravan/platform.h>

#if CARAVAN_HAVE_GPU
#include "channels/sdma_channel.h"
#include "channels/xgmi_channel.h"
#include "runtime/gpu/platform.h"
#endif

#include <chrono>
#include <cstring>
#include <future>
#include <random>

namespace caravan {
namespace {

using namespace std::chrono_literals;

// Skips the test unless this machine has at least `n` GPUs (and, for n >= 2, GPU 0 reaches GPU 1).
#define CARAVAN_REQUIRE_GPUS(n)                                                                           \
  do {                                                                                                    \
    GpuProbe probe_ = probe_gpus();                                                                       \
    if (probe_.device_count < (n))                                                                        \
      GTEST_SKIP() << "needs " << (n) << " GPU(s); "                                                      \
                   << (probe_.device_count == 0 ? probe_.reason                                           \
                                                : "this machine has " + std::to_string(probe_.device_count)); \
    if ((n) >= 2 && !gpu::topology().can_peer(0, 1)) GTEST_SKIP() << "GPU 0 cannot reach GPU 1 (no peer access)"; \
  } while (0)

MemoryId sys() { return {0, 0, MemoryKind::sys, 0}; }
MemoryId zcm() { return {0, 0, MemoryKind::zcm, 0}; }
MemoryId fbm(std::uint32_t i) { return {0, 0, MemoryKind::fbm, i}; }

std::uint64_t fresh_seed() {
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

const FieldSpace kFields({{"a", 4}, {"b", 8}, {"c", 2}});

// Copies src (layout a, memory from) -> dst (layout b, memory to) on fresh random data with the
// destination poisoned, verifies every (point, field), and returns the route.
std::string copy_and_verify(const Rect& space, const char* a, const char* b, MemoryId from, MemoryId to) {
  const std::uint64_t seed = fresh_seed();
  Instance src = Instance::create(from, space, kFields, Layout::parse(a));
  Instance dst = Instance::create(to, space, kFields, Layout::parse(b));
  test::write_pattern(src, seed);
  test::poison(dst);
  CopyReport report;
  Event e = copy(src, dst, {.report = &report});
  EXPECT_TRUE(e.wait_for(60s)) << a << " -> " << b;
  EXPECT_EQ(test::count_mismatches(dst, seed), 0u)
      << from.to_string() << " " << a << " -> " << to.to_string() << " " << b << " over " << space.to_string()
      << " via " << report.route << " (seed " << seed << ")";
  EXPECT_EQ(test::count_mismatches(src, seed), 0u) << "the source changed";
  return report.route;
}

bool uses(const std::string& route, const char* channel) { return route.find(std::string("[") + channel + "]") != std::string::npos; }

const std::vector<std::pair<const char*, const char*>> k1dPairs = {
    {"F,x", "F,x"}, {"F,x", "x,F"}, {"x,F", "x_in=4,F,x_out"}, {"x_in=3,F,x_out", "F,x"}, {"F,x_in=5,x_out", "x,F"}};
const std::vector<std::pair<const char*, const char*>> k2dPairs = {
    {"F,x,y", "y,x,F"}, {"x,y,F", "F,y,x"}, {"x_in=4,y_in=3,x_out,y_out,F", "F,x,y"}};

class GpuCopyTest : public ::testing::Test {
 protected:
  Runtime rt_{RuntimeOptions{.cpu_workers = 2}};
};

TEST_F(GpuCopyTest, ZeroCopyMemoryToGpuAndBack) {
  CARAVAN_REQUIRE_GPUS(1);
  const Rect space = Rect::from_extents({300001});  // ~4.2 MB: several tiles
  for (auto [a, b] : k1dPairs) {
    copy_and_verify(space, a, b, zcm(), fbm(0));
    copy_and_verify(space, b, a, fbm(0), zcm());
  }
  for (auto [a, b] : k2dPairs) {
    copy_and_verify(Rect::from_extents({997, 61}), a, b, zcm(), fbm(0));
    copy_and_verify(Rect::from_extents({997, 61}), b, a, fbm(0), zcm());
  }
  // Same layouts go straight over the copy engine, one hop.
  EXPECT_TRUE(uses(copy_and_verify(space, "F,x", "F,x", zcm(), fbm(0)), "sdma"));
  EXPECT_TRUE(uses(copy_and_verify(space, "F,x", "F,x", fbm(0), zcm()), "sdma"));
}

TEST_F(GpuCopyTest, PageableHostMemoryToGpuAndBack) {
  CARAVAN_REQUIRE_GPUS(1);
  const Rect space = Rect::from_extents({300001});
  for (auto [a, b] : k1dPairs) {
    EXPECT_TRUE(uses(copy_and_verify(space, a, b, sys(), fbm(0)), "sdma"));
    EXPECT_TRUE(uses(copy_and_verify(space, b, a, fbm(0), sys()), "sdma"));
  }
  copy_and_verify(Rect::from_extents({311, 97}), "F,x,y", "y,x,F", sys(), fbm(0));
  copy_and_verify(Rect::from_extents({311, 97}), "y,x,F", "F,x,y", fbm(0), sys());
}

TEST_F(GpuCopyTest, WithinOneGpu) {
  CARAVAN_REQUIRE_GPUS(1);
  const Rect space = Rect::from_extents({300001});
  EXPECT_TRUE(uses(copy_and_verify(space, "F,x", "F,x", fbm(0), fbm(0)), "sdma"));
  for (auto [a, b] : k1dPairs) copy_and_verify(space, a, b, fbm(0), fbm(0));
  for (auto [a, b] : k2dPairs) copy_and_verify(Rect::from_extents({997, 61}), a, b, fbm(0), fbm(0));
}

TEST_F(GpuCopyTest, BetweenPeerGpus) {
  CARAVAN_REQUIRE_GPUS(2);
  const Rect space = Rect::from_extents({300001});
  EXPECT_TRUE(uses(copy_and_verify(space, "F,x", "F,x", fbm(0), fbm(1)), "xgmi"));
  EXPECT_TRUE(uses(copy_and_verify(space, "F,x", "F,x", fbm(1), fbm(0)), "xgmi"));
  for (auto [a, b] : k1dPairs) copy_and_verify(space, a, b, fbm(0), fbm(1));
  for (auto [a, b] : k2dPairs) copy_and_verify(Rect::from_extents({997, 61}), a, b, fbm(1), fbm(0));
}

TEST_F(GpuCopyTest, EveryGpuAndEveryPeerPair) {
  CARAVAN_REQUIRE_GPUS(1);
  const auto n = static_cast<std::uint32_t>(gpu::topology().devices.size());
  const Rect space = Rect::from_extents({65537});
  for (std::uint32_t i = 0; i < n; ++i) {
    copy_and_verify(space, "F,x", "x,F", zcm(), fbm(i));
    copy_and_verify(space, "x,F", "F,x", fbm(i), sys());
    for (std::uint32_t j = 0; j < n; ++j) {
      if (i != j && gpu::topology().can_peer(static_cast<int>(i), static_cast<int>(j))) {
        EXPECT_TRUE(uses(copy_and_verify(space, "F,x", "F,x", fbm(i), fbm(j)), "xgmi")) << i << " -> " << j;
      }
    }
  }
}

TEST_F(GpuCopyTest, FillGpuMemory) {
  CARAVAN_REQUIRE_GPUS(1);
  for (const char* layout : {"F,x", "x,F", "x_in=3,F,x_out"}) {
    Instance dst = Instance::create(fbm(0), Rect::from_extents({100003}), kFields, Layout::parse(layout));
    test::poison(dst);
    std::vector<std::byte> value(kFields.total_size());
    std::mt19937_64 rng(fresh_seed());
    for (auto& v : value) v = static_cast<std::byte>(rng());
    ASSERT_TRUE(fill(dst, value).wait_for(60s));
    std::vector<std::byte> bytes = test::footprint(dst);
    std::uint64_t bad = 0;
    test::for_each_point(dst.space(), [&](const Point& p) {
      for (std::size_t f = 0; f < kFields.count(); ++f)
        if (std::memcmp(bytes.data() + dst.offset(p, f), value.data() + kFields.offset(f), kFields.fields()[f].size) != 0) ++bad;
    });
    EXPECT_EQ(bad, 0u) << layout;
  }
}

TEST_F(GpuCopyTest, GpuInstancesAreReadThroughReadBytesOnly) {
  CARAVAN_REQUIRE_GPUS(1);
  Instance dst = Instance::create(fbm(0), Rect::from_extents({16}), kFields, Layout::parse("F,x"));
  CARAVAN_EXPECT_ERROR(dst.data(), Errc::invalid_argument, "GPU memory");
  Instance pinned = Instance::create(zcm(), Rect::from_extents({16}), kFields, Layout::parse("F,x"));
  EXPECT_NE(pinned.data(), nullptr);  // zcm is host memory
}

// A high-priority copy behind many large low-priority copies on one copy engine channel: it
// takes the channel at the next request boundaries (at most a window of low-priority requests
// is already queued on the streams) and finishes near its time alone.
TEST_F(GpuCopyTest, HighPriorityCopyOvertakesLowPriorityCopiesOnTheCopyEngine) {
  CARAVAN_REQUIRE_GPUS(1);
  const FieldSpace fields({{"v", 16}});
  Layout aos = Layout::parse("F,x");
  const Rect low_space = Rect::from_extents({(16 << 20) / 16}), high_space = Rect::from_extents({(64 << 20) / 16});
  std::vector<Instance> low_src, low_dst;
  for (int i = 0; i < 32; ++i) {
    low_src.push_back(Instance::create(zcm(), low_space, fields, aos));
    low_dst.push_back(Instance::create(fbm(0), low_space, fields, aos));
  }
  Instance hs = Instance::create(zcm(), high_space, fields, aos), hd = Instance::create(fbm(0), high_space, fields, aos);
  const std::uint64_t seed = fresh_seed();
  test::write_pattern(hs, seed);
  auto timed = [&](CopyReport* report) {
    auto start = std::chrono::steady_clock::now();
    copy(hs, hd, {.priority = 10, .report = report}).wait();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  };
  timed(nullptr);  // warm-up (plan cache)
  double alone = timed(nullptr);
  test::poison(hd);
  std::vector<Event> load;
  for (int i = 0; i < 32; ++i) load.push_back(copy(low_src[static_cast<std::size_t>(i)], low_dst[static_cast<std::size_t>(i)], {.priority = -10}));
  CopyReport report;
  double loaded = timed(&report);
  merge_events(load).wait();
  EXPECT_EQ(test::count_mismatches(hd, seed), 0u);
  ASSERT_EQ(report.hop_interleaved.size(), 1u) << report.route;
  const auto window = static_cast<std::uint64_t>(settings::get_int("CARAVAN_GPU_WINDOW"));
  EXPECT_LE(report.hop_interleaved[0], window) << "low-priority requests ran in the middle of the urgent copy";
  // Timing is the benchmark's job (caravan bench gpu); here only a loose bound for a shared machine.
  EXPECT_LT(loaded, 2.0 * alone + 5.0) << "alone " << alone << " ms, under load " << loaded << " ms";
  std::printf("[ priority ] %s: alone %.3f ms, under 32 x 16 MiB low-priority copies %.3f ms, %llu requests, %llu interleaved\n",
              report.route.c_str(), alone, loaded, static_cast<unsigned long long>(report.hop_requests[0]),
              static_cast<unsigned long long>(report.hop_interleaved[0]));
}

TEST(GpuMachine, LiveMachineHasEveryGpuMemoryAndChannel) {
  CARAVAN_REQUIRE_GPUS(1);
  const gpu::Topology& topo = gpu::topology();
  planner::MachineDescription m = dma::live_machine(0);
  std::size_t fbms = 0, sdma = 0, xgmi = 0, peers = 0;
  for (const auto& mem : m.memories) fbms += mem.id.kind == MemoryKind::fbm ? 1 : 0;
  for (const auto& ch : m.channels) {
    sdma += ch.kind == ChannelKind::sdma ? 1 : 0;
    xgmi += ch.kind == ChannelKind::xgmi ? 1 : 0;
    if (ch.kind == ChannelKind::xgmi) {
      EXPECT_EQ(ch.shares.size(), 2u);
    }
    if (ch.kind == ChannelKind::sdma && ch.src.kind != ch.dst.kind) {
      EXPECT_EQ(ch.shares.size(), 1u);
    }
  }
  for (std::size_t i = 0; i < topo.devices.size(); ++i)
    for (std::size_t j = 0; j < topo.devices.size(); ++j) peers += topo.can_peer(static_cast<int>(i), static_cast<int>(j)) ? 1 : 0;
  EXPECT_EQ(fbms, topo.devices.size());
  EXPECT_EQ(sdma, 5 * topo.devices.size());
  EXPECT_EQ(xgmi, peers);
  bool from_cache = false;
  dma::Calibration c = dma::load_or_calibrate(false, &from_cache);
  for (const auto& ch : c.channels) {
    std::string row;
    for (const auto& s : ch.samples) row += " " + std::to_string(s.bytes) + ":" + std::to_string(s.gbps);
    std::printf("[ calibration ] %s%s\n", ch.channel.c_str(), row.c_str());
  }
  std::printf("[ calibration ] measured in %.2f s (%s)\n", c.seconds, from_cache ? "from the cache" : "now");
}

TEST(GpuMachine, WithoutAGpuThereAreNoGpuMemories) {
  GpuProbe probe = probe_gpus();
  if (probe.device_count > 0) GTEST_SKIP() << "this machine has " << probe.device_count << " GPU(s)";
  EXPECT_FALSE(probe.reason.empty());
  EXPECT_TRUE(gpu::topology().devices.empty());
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  CARAVAN_EXPECT_ERROR(Instance::create(fbm(0), Rect::from_extents({4}), kFields, Layout::parse("F,x")), Errc::not_found, "fbm");
  CARAVAN_EXPECT_ERROR(dma::allocate_storage(zcm(), 64), Errc::invalid_argument, "zcm");
}

#if CARAVAN_HAVE_GPU

TEST(GpuPlatform, HipErrorsBecomeCaravanErrorsNamingTheCall) {
  // Runs with or without a device: an invalid ordinal fails either way, without aborting.
  try {
    CARAVAN_HIP_CHECK(hipSetDevice(12345));
    ADD_FAILURE() << "hipSetDevice(12345) succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::device);
    std::string what = e.what();
    EXPECT_NE(what.find("hipSetDevice(12345)"), std::string::npos) << what;
    EXPECT_NE(what.find("gpu_copy_test.cpp:"), std::string::npos) << what;
    EXPECT_NE(what.find("cuda"), std::string::npos) << what;  // the error's name, e.g. cudaErrorInvalidDevice
  }
  // With a device, the failure must not linger as the runtime's last error (without a driver
  // every call keeps failing with the same initialization error, by design of the runtime).
  if (probe_gpus().device_count > 0) {
    EXPECT_EQ(hipGetLastError(), hipSuccess) << "the error must not stay sticky";
  }
}

// The op translation against the host reference (copy_host_ops): random shapes of every kind,
// each in its own part of the destination, random source and poisoned destination bytes.
struct OpCase {
  std::vector<dma::TransferOp> ops;
  std::string describe;
};

OpCase random_ops(std::mt19937_64& rng, std::uint64_t region) {
  constexpr std::uint64_t kChunk = 256 << 10;
  OpCase c;
  auto pick = [&](std::uint64_t lo, std::uint64_t hi) { return lo + rng() % (hi - lo + 1); };
  const std::uint64_t elems[] = {1, 2, 4, 8, 12, 16, 24};
  for (std::uint64_t base = 0; base + kChunk <= region; base += kChunk) {
    const std::uint64_t src_base = pick(0, region - kChunk);
    switch (rng() % 7) {
      case 0: {  // one run
        std::uint64_t len = pick(1, kChunk);
        c.ops.push_back({src_base, base, len, 1, 0, 0});
        c.describe += "run ";
        break;
      }
      case 1: {  // runs of one length at constant distances (one 2-D copy)
        std::uint64_t len = pick(1, 512), k = pick(2, 64), ds = len + pick(0, 300), dd = len + pick(0, 300);
        while (k * std::max(ds, dd) > kChunk) k /= 2;
        for (std::uint64_t i = 0; i < std::max<std::uint64_t>(k, 1); ++i) c.ops.push_back({src_base + i * ds, base + i * dd, len, 1, 0, 0});
        c.describe += "runs ";
        break;
      }
      case 2: {  // one strided op (2-D)
        std::uint64_t e = elems[rng() % 7], ss = e + pick(0, 40), dsd = e + pick(0, 40);
        std::uint64_t n = pick(2, kChunk / std::max(ss, dsd));
        c.ops.push_back({src_base, base, e, n, static_cast<std::int64_t>(ss), static_cast<std::int64_t>(dsd)});
        c.describe += "strided ";
        break;
      }
      case 3: {  // strided ops of one shape at whole-row distances (one 3-D copy)
        std::uint64_t e = elems[rng() % 7], ss = e + pick(0, 24), dsd = e + pick(0, 24), n = pick(2, 40);
        std::uint64_t ms = n + pick(0, 3), md = n + pick(0, 3), k = pick(2, 16);
        while (k > 1 && k * md * dsd > kChunk) --k;
        while (k > 1 && k * ms * ss > kChunk) --k;
        for (std::uint64_t i = 0; i < k; ++i)
          c.ops.push_back({src_base + i * ms * ss, base + i * md * dsd, e, n, static_cast<std::int64_t>(ss), static_cast<std::int64_t>(dsd)});
        c.describe += "slices ";
        break;
      }
      case 4: {  // fill: one element repeated
        std::uint64_t e = elems[rng() % 7], dsd = e + pick(0, 40), n = pick(2, kChunk / dsd);
        c.ops.push_back({src_base, base, e, n, 0, static_cast<std::int64_t>(dsd)});
        c.describe += "fill ";
        break;
      }
      case 5: {  // overlapping source reads (stride < element): the per-element fallback
        std::uint64_t e = 8, n = pick(2, 200);
        c.ops.push_back({src_base, base, e, n, 3, 16});
        c.describe += "overlap ";
        break;
      }
      default: {  // contiguous both sides with count > 1: one run
        std::uint64_t e = elems[rng() % 7], n = pick(2, kChunk / e);
        c.ops.push_back({src_base, base, e, n, static_cast<std::int64_t>(e), static_cast<std::int64_t>(e)});
        c.describe += "dense ";
      }
    }
  }
  return c;
}

void check_channel_ops(dma::Channel& channel, const dma::Storage& src, const dma::Storage& dst, std::uint64_t seed) {
  const std::uint64_t region = std::min(src.bytes(), dst.bytes());
  std::mt19937_64 rng(seed);
  std::vector<std::byte> s(region), d(region, std::byte{0xAB}), got(region);
  for (auto& b : s) b = static_cast<std::byte>(rng());
  src.write(0, s);
  dst.write(0, d);
  OpCase c = random_ops(rng, region);
  // In requests of a few ops each, several in flight at once, like the DMA worker sends them.
  std::vector<std::promise<FailureCause>> results;
  results.reserve(c.ops.size());
  std::vector<std::future<FailureCause>> futures;
  for (std::size_t i = 0; i < c.ops.size(); i += 5) {
    std::size_t n = std::min<std::size_t>(5, c.ops.size() - i);
    dma::Request r{std::span<const dma::TransferOp>(c.ops.data() + i, n), 0, &src, &dst};
    for (std::size_t k = i; k < i + n; ++k) r.bytes += c.ops[k].bytes();
    results.emplace_back();
    futures.push_back(results.back().get_future());
    channel.submit(r, [p = &results.back()](const FailureCause& f) { p->set_value(f); });
  }
  for (auto& f : futures) {
    ASSERT_EQ(f.wait_for(60s), std::future_status::ready);
    FailureCause failure = f.get();
    ASSERT_FALSE(failure) << failure->what();
  }
  dma::copy_host_ops(c.ops, s.data(), d.data());
  dst.read(0, got);
  std::uint64_t first_bad = region;
  for (std::uint64_t i = 0; i < region && first_bad == region; ++i)
    if (got[i] != d[i]) first_bad = i;
  EXPECT_EQ(first_bad, region) << src.memory().to_string() << " -> " << dst.memory().to_string() << ": first wrong byte at "
                               << first_bad << " (ops: " << c.describe << "seed " << seed << ")";
}

TEST(GpuChannelOps, EveryOpShapeOnEverySdmaDirection) {
  CARAVAN_REQUIRE_GPUS(1);
  const std::uint64_t region = 4 << 20;
  auto host = dma::Storage::allocate_host(sys(), region);
  auto pinned = dma::Storage::allocate_pinned(zcm(), region);
  auto a = dma::Storage::allocate_device(fbm(0), 0, region), b = dma::Storage::allocate_device(fbm(0), 0, region);
  channels::SdmaChannel sdma(fbm(0), 3, 3);
  for (int round = 0; round < 3; ++round) {
    check_channel_ops(sdma, *pinned, *a, fresh_seed());
    check_channel_ops(sdma, *a, *pinned, fresh_seed());
    check_channel_ops(sdma, *host, *a, fresh_seed());
    check_channel_ops(sdma, *a, *host, fresh_seed());
    check_channel_ops(sdma, *a, *b, fresh_seed());
  }
}

TEST(GpuChannelOps, EveryOpShapeOverThePeerLink) {
  CARAVAN_REQUIRE_GPUS(2);
  const std::uint64_t region = 4 << 20;
  auto a = dma::Storage::allocate_device(fbm(0), 0, region), b = dma::Storage::allocate_device(fbm(1), 1, region);
  channels::XgmiChannel forward(fbm(0), fbm(1), 3, 3), backward(fbm(1), fbm(0), 3, 3);
  EXPECT_TRUE(forward.serves(fbm(0), fbm(1)));
  EXPECT_FALSE(forward.serves(fbm(0), fbm(0)));
  for (int round = 0; round < 3; ++round) {
    check_channel_ops(forward, *a, *b, fresh_seed());
    check_channel_ops(backward, *b, *a, fresh_seed());
  }
}

#endif  // CARAVAN_HAVE_GPU

}  // namespace
}  // namespace caravan
