// GPU processors on real GPUs (issue 6): task bodies enqueue copies and kernels on the stream
// their processor gives them, preconditions order that work across GPUs and the CPU, a task is
// done only once its stream's work is, and every body starts with its own GPU current. The
// scheduling itself (priorities, failures, shutdown, stress) is tested without a GPU in
// tests/runtime/gpu_processor_test.cpp. Each test skips with the reason where GPUs are missing.
#include "tests/gpu/require_gpus.h"
#include "tests/runtime/test_util.h"

#include <caravan/copy.h>
#include <caravan/platform.h>

#if CARAVAN_HAVE_GPU
#include "runtime/gpu/devices.h"
#include "runtime/gpu/platform.h"
#include "tests/gpu/task_kernels.h"
#endif

#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace caravan {
namespace {

using namespace std::chrono_literals;

#if CARAVAN_HAVE_GPU

using test::settles;
Processor gpu(int index) { return test::gpu_processor(index); }

hipStream_t stream_of(const TaskContext& ctx) { return static_cast<hipStream_t>(ctx.gpu_stream); }

TEST(GpuProcessor, ProcessorsListEveryGpuAndBodiesGetTheirOwn) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  const int gpus = probe_gpus().device_count;
  auto list = rt.processors();
  ASSERT_EQ(list.size(), static_cast<std::size_t>(1 + gpus));
  struct Seen {
    int context_device = -2;
    int current_device = -2;
    bool has_stream = false;
  };
  static std::vector<Seen> seen;
  seen.assign(static_cast<std::size_t>(gpus), Seen{});
  TaskId look = test::task("gpu_processor_gpu_test.look", [](TaskContext& ctx) {
    Seen& s = seen[ctx.processor.index];
    s.context_device = ctx.gpu_device;
    CARAVAN_HIP_CHECK(hipGetDevice(&s.current_device));
    s.has_stream = ctx.gpu_stream != nullptr;
    // Leave another GPU current: the next body on this processor must still start on its own.
    CARAVAN_HIP_CHECK(hipSetDevice((ctx.gpu_device + 1) % probe_gpus().device_count));
  });
  for (int round = 0; round < 2; ++round) {
    std::vector<Event> done;
    for (int g = 0; g < gpus; ++g) done.push_back(rt.spawn(look, {}, SpawnOptions{.processor = gpu(g)}));
    ASSERT_TRUE(merge_events(done).wait_for(60s));
    for (int g = 0; g < gpus; ++g) {
      EXPECT_EQ(seen[static_cast<std::size_t>(g)].context_device, g);
      EXPECT_EQ(seen[static_cast<std::size_t>(g)].current_device, g) << "round " << round;
      EXPECT_TRUE(seen[static_cast<std::size_t>(g)].has_stream);
    }
  }
}

// Three tasks on two GPUs, each consuming the one before: upload and scale on GPU 0 (behind 20 ms
// of other work), pull it over the peer link and scale again on GPU 1, download on GPU 1. Run
// twice on fresh data with the output poisoned, against a double-precision reference: ordered on
// the host, then on the GPUs (order_on_gpu).
TEST(GpuProcessor, AChainOfTasksOverTwoGpusMatchesTheReference) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  if (!gpu::topology().can_peer(0, 1)) GTEST_SKIP() << "GPU 1 cannot reach GPU 0's memory (no peer access)";
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  constexpr std::uint64_t n = std::uint64_t{1} << 22;
  constexpr std::uint64_t bytes = n * sizeof(float);
  struct Buffers {
    float* host_in;
    float* host_out;
    float* gpu0_in;
    float* gpu0_out;
    float* gpu1_in;
    float* gpu1_out;
  };
  Buffers b{static_cast<float*>(gpu::allocate_pinned(bytes)), static_cast<float*>(gpu::allocate_pinned(bytes)),
            static_cast<float*>(gpu::allocate_device(0, bytes)), static_cast<float*>(gpu::allocate_device(0, bytes)),
            static_cast<float*>(gpu::allocate_device(1, bytes)), static_cast<float*>(gpu::allocate_device(1, bytes))};
  constexpr float a1 = 1.5f, b1 = -0.25f, a2 = -0.75f, b2 = 2.0f;
  TaskId upload = test::task("gpu_processor_gpu_test.upload_scale", [](TaskContext& ctx) {
    auto buf = ctx.args_as<Buffers>();
    gpu::test::launch_spin(20'000'000, stream_of(ctx));
    CARAVAN_HIP_CHECK(hipMemcpyAsync(buf.gpu0_in, buf.host_in, bytes, hipMemcpyDefault, stream_of(ctx)));
    gpu::test::launch_axpb(buf.gpu0_out, buf.gpu0_in, a1, b1, n, stream_of(ctx));
  });
  TaskId pull = test::task("gpu_processor_gpu_test.pull_scale", [](TaskContext& ctx) {
    auto buf = ctx.args_as<Buffers>();
    CARAVAN_HIP_CHECK(hipMemcpyPeerAsync(buf.gpu1_in, 1, buf.gpu0_out, 0, bytes, stream_of(ctx)));
    gpu::test::launch_axpb(buf.gpu1_out, buf.gpu1_in, a2, b2, n, stream_of(ctx));
  });
  TaskId download = test::task("gpu_processor_gpu_test.download", [](TaskContext& ctx) {
    auto buf = ctx.args_as<Buffers>();
    CARAVAN_HIP_CHECK(hipMemcpyAsync(buf.host_out, buf.gpu1_out, bytes, hipMemcpyDefault, stream_of(ctx)));
  });
  std::random_device rd;
  for (int run = 0; run < 2; ++run) {
    const unsigned seed = rd();
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
    for (std::uint64_t i = 0; i < n; ++i) b.host_in[i] = dist(rng);
    std::memset(b.host_out, 0xFF, bytes);  // NaN everywhere
    Event e1 = rt.spawn(upload, task_args(b), SpawnOptions{.processor = gpu(0)});
    const bool on_gpu = run == 1;  // the second run orders the links on the GPUs (order_on_gpu)
    Event e2 = rt.spawn(pull, task_args(b), SpawnOptions{.precondition = e1, .processor = gpu(1), .order_on_gpu = on_gpu});
    Event e3 = rt.spawn(download, task_args(b),
                        SpawnOptions{.precondition = e2, .priority = 5, .processor = gpu(1), .order_on_gpu = on_gpu});
    ASSERT_TRUE(e3.wait_for(60s));
    std::uint64_t bad = 0;
    double worst = 0;
    for (std::uint64_t i = 0; i < n; ++i) {
      const double want = double(a2) * (double(a1) * double(b.host_in[i]) + double(b1)) + double(b2);
      const double err = std::abs(double(b.host_out[i]) - want) / std::max(1.0, std::abs(want));
      if (!(err <= 1e-5)) ++bad;
      worst = std::max(worst, std::isnan(err) ? 1e30 : err);
    }
    EXPECT_EQ(bad, 0u) << "run " << run << " (seed " << seed << "), worst relative error " << worst;
  }
  gpu::free_pinned(b.host_in);
  gpu::free_pinned(b.host_out);
  for (float* p : {b.gpu0_in, b.gpu0_out, b.gpu1_in, b.gpu1_out}) gpu::free_device(p);
}

// The way an application feeds a GPU task: a copy fills an instance in GPU memory, a task on
// that GPU works on it through Instance::gpu_data() after the copy's event, a second task writes
// its result into pinned host memory (zcm) through its GPU address, and a copy takes the first
// task's output back to host memory. Fresh random data, results poisoned, against a double
// reference.
TEST(GpuProcessor, TasksWorkOnInstancesThroughTheirGpuAddresses) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  constexpr std::uint64_t n = std::uint64_t{1} << 21;
  const FieldSpace value({{"v", sizeof(float)}});
  const Rect space = Rect::from_extents({static_cast<std::int64_t>(n)});
  const Layout layout = Layout::parse("F,x");
  Instance host = Instance::create({0, 0, MemoryKind::sys, 0}, space, value, layout);
  Instance on_gpu = Instance::create({0, 0, MemoryKind::fbm, 0}, space, value, layout);
  Instance pinned = Instance::create({0, 0, MemoryKind::zcm, 0}, space, value, layout);
  Instance back = Instance::create({0, 0, MemoryKind::sys, 0}, space, value, layout);
  struct Axpb {
    float* y;
    const float* x;
    float a, b;
  };
  TaskId axpb = test::task("gpu_processor_gpu_test.instance_axpb", [](TaskContext& ctx) {
    auto args = ctx.args_as<Axpb>();
    gpu::test::launch_spin(5'000'000, stream_of(ctx));  // still running when the body returns
    gpu::test::launch_axpb(args.y, args.x, args.a, args.b, n, stream_of(ctx));
  });
  auto* in = reinterpret_cast<float*>(host.data());
  auto* out = reinterpret_cast<float*>(back.data());
  auto* via_zcm = reinterpret_cast<float*>(pinned.data());
  auto* gpu_values = static_cast<float*>(on_gpu.gpu_data());
  constexpr float a1 = 2.5f, b1 = -1.0f, a2 = 0.5f, b2 = 3.0f;
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  for (std::uint64_t i = 0; i < n; ++i) in[i] = dist(rng);
  std::memset(out, 0xFF, n * sizeof(float));  // NaN everywhere
  std::memset(via_zcm, 0xFF, n * sizeof(float));

  Event up = copy(host, on_gpu);
  Event scaled = rt.spawn(axpb, task_args(Axpb{gpu_values, gpu_values, a1, b1}),
                          SpawnOptions{.precondition = up, .processor = gpu(0)});
  Event to_zcm = rt.spawn(axpb, task_args(Axpb{static_cast<float*>(pinned.gpu_data()), gpu_values, a2, b2}),
                          SpawnOptions{.precondition = scaled, .processor = gpu(0), .order_on_gpu = true});
  Event down = copy(on_gpu, back, {.precondition = to_zcm});
  ASSERT_TRUE(down.wait_for(60s));
  std::uint64_t bad_back = 0, bad_zcm = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    const double first = double(a1) * double(in[i]) + double(b1);
    const double second = double(a2) * first + double(b2);
    if (!(std::abs(double(out[i]) - first) <= 1e-5 * std::max(1.0, std::abs(first)))) ++bad_back;
    if (!(std::abs(double(via_zcm[i]) - second) <= 1e-5 * std::max(1.0, std::abs(second)))) ++bad_zcm;
  }
  EXPECT_EQ(bad_back, 0u) << "seed " << seed;
  EXPECT_EQ(bad_zcm, 0u) << "seed " << seed;
  CARAVAN_EXPECT_ERROR(host.gpu_data(), Errc::invalid_argument, "is not memory a GPU addresses");
}

// A counter in GPU 0's memory, incremented by a plain load and store (no atomic) from tasks on
// every GPU: one chain of 400 tasks hopping between GPUs, and beside it one chain per GPU on its
// own counter, spawned from threads of their own. Every 8th task first spins for 50 us, so work
// that ran before its predecessor had finished would lose an update. Ordered on the host (each
// task launched once the one before has finished) and on the GPU (order_on_gpu: launched at
// once, the stream waiting for the other's work).
class GpuProcessorChains : public testing::TestWithParam<bool> {};

TEST_P(GpuProcessorChains, ChainedIncrementsOverEveryGpuLoseNothing) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  const bool order_on_gpu = GetParam();
  const int gpus = probe_gpus().device_count;
  for (int g = 1; g < gpus; ++g)
    if (!gpu::topology().can_peer(g, 0)) GTEST_SKIP() << "GPU " << g << " cannot reach GPU 0's memory";
  Runtime rt(RuntimeOptions{.cpu_workers = 2});
  auto* counters = static_cast<std::uint64_t*>(gpu::allocate_device(0, sizeof(std::uint64_t) * (1 + gpus)));
  struct Args {
    std::uint64_t* counter;
    int index;
  };
  TaskId inc = test::task("gpu_processor_gpu_test.increment", [](TaskContext& ctx) {
    auto a = ctx.args_as<Args>();
    if (a.index % 8 == 0) gpu::test::launch_spin(50'000, stream_of(ctx));
    gpu::test::launch_increment(a.counter, stream_of(ctx));
  });
  constexpr int kHops = 400, kPerGpu = 200;
  std::vector<Event> ends(static_cast<std::size_t>(1 + gpus));
  std::vector<std::thread> spawners;
  spawners.emplace_back([&] {
    Event previous;
    for (int i = 0; i < kHops; ++i)
      previous = rt.spawn(inc, task_args(Args{counters, i}),
                          SpawnOptions{.precondition = previous, .priority = (i % 3) - 1, .processor = gpu(i % gpus),
                                       .order_on_gpu = order_on_gpu});
    ends[0] = previous;
  });
  for (int g = 0; g < gpus; ++g) {
    spawners.emplace_back([&, g] {
      Event previous;
      for (int i = 0; i < kPerGpu; ++i)
        previous = rt.spawn(inc, task_args(Args{counters + 1 + g, i}),
                            SpawnOptions{.precondition = previous, .priority = i % 2, .processor = gpu(g),
                                         .order_on_gpu = order_on_gpu});
      ends[static_cast<std::size_t>(1 + g)] = previous;
    });
  }
  for (auto& t : spawners) t.join();
  ASSERT_TRUE(merge_events(ends).wait_for(120s));
  std::vector<std::uint64_t> values(static_cast<std::size_t>(1 + gpus));
  gpu::copy_sync(values.data(), counters, sizeof(std::uint64_t) * values.size());
  EXPECT_EQ(values[0], static_cast<std::uint64_t>(kHops)) << "the chain over every GPU";
  for (int g = 0; g < gpus; ++g) EXPECT_EQ(values[static_cast<std::size_t>(1 + g)], static_cast<std::uint64_t>(kPerGpu)) << "GPU " << g;
  gpu::free_device(counters);
}

INSTANTIATE_TEST_SUITE_P(OrderedOnHostOrGpu, GpuProcessorChains, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& param) { return param.param ? "OrderedOnTheGpu" : "OrderedOnTheHost"; });

// A body that enqueues work and then throws: its completion is poisoned with the message, and
// only once that work has finished (whoever sees the failure may free what the work uses).
TEST(GpuProcessor, AThrowingBodyIsReportedAfterTheWorkItEnqueued) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  auto* word = static_cast<std::uint64_t*>(gpu::allocate_pinned(2 * sizeof(std::uint64_t)));
  word[0] = 0;
  word[1] = 0xC0FFEE;
  TaskId t = test::task("gpu_processor_gpu_test.throws", [](TaskContext& ctx) {
    auto* w = ctx.args_as<std::uint64_t*>();
    gpu::test::launch_spin(30'000'000, stream_of(ctx));
    CARAVAN_HIP_CHECK(hipMemcpyAsync(w, w + 1, sizeof(std::uint64_t), hipMemcpyDefault, stream_of(ctx)));
    throw std::runtime_error("the body gave up");
  });
  Event e = rt.spawn(t, task_args(word), SpawnOptions{.processor = gpu(0)});
  ASSERT_TRUE(settles(e, 60s));
  ASSERT_EQ(e.query(), EventState::poisoned);
  EXPECT_EQ(e.failure()->code(), Errc::task_failed);
  EXPECT_NE(std::string(e.failure()->what()).find("the body gave up"), std::string::npos);
  EXPECT_EQ(reinterpret_cast<volatile std::uint64_t*>(word)[0], 0xC0FFEEu) << "reported before its work finished";
  gpu::free_pinned(word);
}

#else

TEST(GpuProcessor, NeedsAGpuBuild) {
  GTEST_SKIP() << probe_gpus().reason;
}

#endif

}  // namespace
}  // namespace caravan
