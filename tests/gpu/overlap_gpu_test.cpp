// The GPU symmetric heap, device-side flags and the overlapped operations (kernels/gpu), on the
// GPUs of this machine: one thread per GPU, as one process per GPU would drive them. Every
// output is poisoned before the run and compared with a float32 reference on fresh random data.
// Tests that need GPUs skip with the reason where there are fewer than two.
#include "kernels/gpu/overlap.h"
#include "kernels/gpu/tp_layer.h"
#include "tests/gpu/flag_handoff.h"
#include "tests/gpu/require_gpus.h"

#include <caravan/error.h>
#include <caravan/platform.h>
#include <caravan/settings.h>

#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace caravan::gpu {
namespace {

// Streams waiting on flags block their hardware queue: give streams more queues (CUDA reads this
// at its first call, so it is set during static initialisation).
const bool g_connections_set = [] { return ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0) == 0; }();

int team_size() { return std::min(probe_gpus().device_count, 4); }
std::vector<int> first_devices(int n) {
  std::vector<int> d(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) d[static_cast<std::size_t>(i)] = i;
  return d;
}

// Waits for everything enqueued on `stream`, failing (not hanging) after `limit`.
void finish(hipStream_t stream, std::chrono::seconds limit = std::chrono::seconds(20)) {
  hipEvent_t done;
  CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&done, hipEventDisableTiming));
  CARAVAN_HIP_CHECK(hipEventRecord(done, stream));
  const auto deadline = std::chrono::steady_clock::now() + limit;
  hipError_t status;
  while ((status = hipEventQuery(done)) == hipErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) {
      (void)hipEventDestroy(done);
      throw Error(Errc::timeout, "GPU work did not finish (a flag never raised?)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  (void)hipEventDestroy(done);
  CARAVAN_HIP_CHECK(status);
}

template <class T>
T* device_alloc(std::size_t count) {
  void* p = nullptr;
  CARAVAN_HIP_CHECK(hipMalloc(&p, count * sizeof(T)));
  return static_cast<T*>(p);
}

// One ErrorSums per thread (allocated once: hipFree would synchronise the whole device).
ErrorSums* thread_sums() {
  thread_local ErrorSums* sums = device_alloc<ErrorSums>(1);
  return sums;
}

// A barrier for the rank threads of one test that stops the others once one has failed. A rank
// that throws drops out of the barrier, so its peers are not left waiting for it; their next
// wait then throws too, instead of letting them queue more work on flags the failed rank will
// never raise (each such wait would end only at its own timeout, and a synchronous GPU call
// behind it not at all).
class RankBarrier {
 public:
  explicit RankBarrier(int ranks) : barrier_(ranks) {}
  void arrive_and_wait() {
    barrier_.arrive_and_wait();
    if (failed_.load()) throw Error(Errc::cancelled, "stopped at a barrier: another rank failed (see its message)");
  }
  // Called once by a rank that failed, instead of any further wait.
  void drop_failed_rank() {
    failed_.store(true);
    barrier_.arrive_and_drop();
  }

 private:
  std::barrier<> barrier_;
  std::atomic<bool> failed_{false};
};

// Runs body(rank, stream) on one thread per rank and reports the first failure.
void run_ranks(GpuTeam& team, const std::function<void(int, hipStream_t, RankBarrier&)>& body) {
  RankBarrier barrier(team.world());
  std::mutex mutex;
  std::string failure;
  std::vector<std::thread> threads;
  for (int r = 0; r < team.world(); ++r)
    threads.emplace_back([&, r] {
      hipStream_t stream = nullptr;
      try {
        team.use(r);
        CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&stream, hipStreamNonBlocking));
        // Allocated before any rank starts (see AllGatherGemmRanksRunAheadThroughMixedVariants).
        (void)thread_sums();
        barrier.arrive_and_wait();
        body(r, stream, barrier);
        finish(stream);
      } catch (const std::exception& e) {
        barrier.drop_failed_rank();
        std::fprintf(stderr, "rank %d failed: %s\n", r, e.what());  // now: teardown may hang after a stuck GPU
        std::lock_guard lock(mutex);
        // The first failure is the cause; the peers it stopped report only that.
        if (failure.empty()) failure = "rank " + std::to_string(r) + ": " + e.what();
      }
      if (stream) (void)hipStreamDestroy(stream);
    });
  for (auto& t : threads) t.join();
  if (!failure.empty()) FAIL() << failure;
}

void trace(int rank, const char* what) {
  if (std::getenv("CARAVAN_TEST_VERBOSE")) std::fprintf(stderr, "rank %d: %s\n", rank, what);
}


double relative_error(const bf16* out, long rows, long cols, const float* ref, hipStream_t stream) {
  ErrorSums* sums = thread_sums();
  compare(out, rows, cols, cols, ref, cols, sums, stream);
  finish(stream);  // bounded: a flag never raised fails here instead of hanging in the copy below
  ErrorSums host;
  CARAVAN_HIP_CHECK(hipMemcpy(&host, sums, sizeof(host), hipMemcpyDeviceToHost));
  if (host.nonfinite > 0) return INFINITY;
  return host.ref2 > 0 ? std::sqrt(host.diff2 / host.ref2) : 0.0;
}

void poison(bf16* p, std::size_t count, hipStream_t stream) {
  CARAVAN_HIP_CHECK(hipMemsetAsync(p, 0xFF, count * sizeof(bf16), stream));
}

std::uint64_t fresh_seed() {
  return static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ull;
}

TEST(GpuSymmetricHeap, RejectsBadDeviceLists) {
  // Checked before any GPU call: runs everywhere.
  EXPECT_THROW(GpuSymmetricHeap({}, 1 << 20), Error);
  EXPECT_THROW(GpuSymmetricHeap({0, 0}, 1 << 20), Error);
  EXPECT_THROW(GpuSymmetricHeap(std::vector<int>(9, 0), 1 << 20), Error);
}

TEST(GpuSymmetricHeap, AllocatesAtTheSameOffsetAndRejectsOverflow) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  GpuSymmetricHeap heap(first_devices(2), 1 << 20);
  const SymmetricRegion a = heap.allocate(1000);
  const SymmetricRegion b = heap.allocate(64, 4096);
  EXPECT_EQ(b.offset % 4096, 0u);
  EXPECT_GE(b.offset, a.offset + a.bytes);
  EXPECT_EQ(heap.at(b, 1) - heap.at(a, 1), heap.at(b, 0) - heap.at(a, 0));
  try {
    heap.allocate(2 << 20);
    FAIL() << "an allocation larger than the heap was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("do not fit"), std::string::npos) << e.what();
  }
  EXPECT_THROW(heap.allocate(8, 3), Error);
  const std::uint64_t mark = heap.mark();
  heap.allocate(4096);
  heap.release_to(mark);
  EXPECT_EQ(heap.used(), mark);
}

TEST(GpuFlags, MillionHandOffsNeitherLostNorDuplicated) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  const int world = team_size() / 2 * 2;
  GpuSymmetricHeap heap(first_devices(world), 1 << 20);
  const SymmetricRegion slots = heap.allocate(16);
  constexpr std::uint64_t kRounds = 1'000'000;
  std::vector<std::thread> threads;
  std::vector<test::HandoffResult> results(static_cast<std::size_t>(world));
  std::vector<std::string> failures(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        CARAVAN_HIP_CHECK(hipSetDevice(heap.device(r)));
        hipStream_t stream;
        CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&stream, hipStreamNonBlocking));
        auto* result = device_alloc<test::HandoffResult>(1);
        const int peer = r ^ 1;  // pairs (0,1), (2,3)
        test::launch_handoff(heap.view(r), heap.at<std::uint64_t>(slots, r), peer, r % 2 == 0, kRounds, result, stream);
        finish(stream, std::chrono::seconds(120));
        CARAVAN_HIP_CHECK(hipMemcpy(&results[static_cast<std::size_t>(r)], result, sizeof(test::HandoffResult),
                                    hipMemcpyDeviceToHost));
        (void)hipFree(result);
        (void)hipStreamDestroy(stream);
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(failures[static_cast<std::size_t>(r)], "") << "rank " << r;
    EXPECT_EQ(results[static_cast<std::size_t>(r)].wrong_payload, 0u) << "rank " << r;
    EXPECT_EQ(results[static_cast<std::size_t>(r)].flag_skips, 0u) << "rank " << r;
  }
}

struct AgRun {
  AgGemmVariant variant;
  int lanes;
};

// `runs` in turn on every rank of `team`, each call on fresh inputs against the float32
// reference, output poisoned first; a hang reported with the call that caused it.
void check_all_gather_gemm_calls(GpuTeam& team, const std::vector<AgRun>& runs) {
  const int world = team.world();
  const long m = 128L * world, k = 192, n = 320;
  AllGatherGemm op(team, m, k, n, 2);
  ASSERT_TRUE(op.low_latency()) << "the test's shard should fit the low-latency protocol";
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier&) {
    trace(r, "alloc");
    bf16* b = device_alloc<bf16>(static_cast<std::size_t>(k) * n);
    bf16* c = device_alloc<bf16>(static_cast<std::size_t>(m) * n);
    float *a32 = device_alloc<float>(static_cast<std::size_t>(m) * k), *b32 = device_alloc<float>(static_cast<std::size_t>(k) * n),
          *ref = device_alloc<float>(static_cast<std::size_t>(m) * n);
    const long rows = m / world;
    for (std::size_t call = 0; call < runs.size(); ++call) {
      // Fresh inputs every call; the shard is rewritten only once the peers finished reading it.
      const std::uint64_t sa = seed + 100 * call, sb = seed + 100 * call + 1 + r;
      trace(r, "wait_shard_free");
      op.wait_shard_free(r, stream);
      trace(r, "fill");
      fill_random(op.shard(r), rows, k, k, sa, r * rows, 0, 1.0f, stream);
      fill_random(b, k, n, n, sb, 0, 0, 1.0f, stream);
      poison(c, static_cast<std::size_t>(m) * n, stream);
      trace(r, "run");
      op.run(r, b, c, runs[call].variant, stream, runs[call].lanes);
      trace(r, "finish");
      try {
        finish(stream);  // a hang is reported with the variant that caused it
      } catch (const Error& e) {
        throw Error(e.code(), std::string(to_string(runs[call].variant)) + " lanes " + std::to_string(runs[call].lanes) +
                                  " call " + std::to_string(call) + ": " + e.what());
      }
      if (std::getenv("CARAVAN_TEST_VERBOSE"))
        std::fprintf(stderr, "rank %d call %zu %s lanes %d done\n", r, call, std::string(to_string(runs[call].variant)).c_str(),
                     runs[call].lanes);
      fill_random(a32, m, k, k, sa, 0, 0, 1.0f, stream);
      fill_random(b32, k, n, n, sb, 0, 0, 1.0f, stream);
      team.blas(r).gemm_reference(stream, m, n, k, a32, k, b32, n, ref, n);
      const double err = relative_error(c, m, n, ref, stream);
      if (!(err < 1e-2))
        throw Error(Errc::internal, std::string(to_string(runs[call].variant)) + " lanes " + std::to_string(runs[call].lanes) +
                                        " call " + std::to_string(call) + ": relative error " + std::to_string(err));
    }
    for (void* p : {static_cast<void*>(b), static_cast<void*>(c), static_cast<void*>(a32), static_cast<void*>(b32),
                    static_cast<void*>(ref)})
      (void)hipFree(p);
  });
}

TEST(Overlap, AllGatherGemmEveryVariantMatchesReferenceCallAfterCall) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  GpuTeam team(first_devices(team_size()), 64 << 20);
  check_all_gather_gemm_calls(
      team, {{AgGemmVariant::ce_pull, 1},      {AgGemmVariant::ce_push, 2}, {AgGemmVariant::ce_bulk, 1},
             {AgGemmVariant::ce_push_runs, 1}, {AgGemmVariant::ce_push, 1}, {AgGemmVariant::ce_pull_runs, 2},
             {AgGemmVariant::ce_pull, 2},      {AgGemmVariant::ll_bulk, 1}, {AgGemmVariant::ce_push, 2},
             {AgGemmVariant::ll_bulk, 1},      {AgGemmVariant::ce_pull, 1}, {AgGemmVariant::tile_push, 1},
             {AgGemmVariant::tile_pull, 1},    {AgGemmVariant::ce_push, 1}, {AgGemmVariant::tile_push, 1},
             {AgGemmVariant::sm_push, 1},      {AgGemmVariant::ce_pull, 1}, {AgGemmVariant::sm_bulk, 1},
             {AgGemmVariant::sm_push, 2},      {AgGemmVariant::sm_push, 1}, {AgGemmVariant::ll_bulk, 1},
             {AgGemmVariant::sm_bulk, 1}});
}

// CARAVAN_TEST_RUN_AHEAD_VARIANTS="ce-push:2, sm-bulk" (variant names as to_string(AgGemmVariant)
// gives them, e.g. "ce-pull runs", each with an optional ":lanes", 1 or 2): the mixed run-ahead
// tests cycle through these instead of their mix, `calls` calls in all, to find which variants
// the unpaced hang needs.
std::vector<std::pair<AgGemmVariant, int>> run_ahead_variants_from(std::string_view list, std::size_t calls) {
  const auto trim = [](std::string_view v) {
    while (!v.empty() && v.front() == ' ') v.remove_prefix(1);
    while (!v.empty() && v.back() == ' ') v.remove_suffix(1);
    return v;
  };
  const auto refuse = [](const std::string& why) {
    return Error(Errc::invalid_argument, "CARAVAN_TEST_RUN_AHEAD_VARIANTS: " + why);
  };
  std::vector<std::pair<AgGemmVariant, int>> chosen;
  while (!list.empty()) {
    const std::size_t comma = list.find(',');
    std::string_view item = trim(list.substr(0, comma));
    list = comma == std::string_view::npos ? std::string_view{} : list.substr(comma + 1);
    int lanes = 1;
    if (const std::size_t colon = item.find(':'); colon != std::string_view::npos) {
      const std::string_view count = trim(item.substr(colon + 1));
      if (count != "1" && count != "2") throw refuse("lanes must be 1 or 2, got '" + std::string(count) + "'");
      lanes = count[0] - '0';
      item = trim(item.substr(0, colon));
    }
    bool known = false;
    for (int v = 0; v <= static_cast<int>(AgGemmVariant::sm_bulk); ++v)
      if (to_string(static_cast<AgGemmVariant>(v)) == item) {
        chosen.emplace_back(static_cast<AgGemmVariant>(v), lanes);
        known = true;
      }
    if (!known) throw refuse("unknown variant '" + std::string(item) + "' (e.g. ce-push, ce-pull runs, sm-bulk, ll-bulk)");
  }
  if (chosen.empty()) throw refuse("no variant named");
  std::vector<std::pair<AgGemmVariant, int>> runs;
  for (std::size_t i = 0; i < calls; ++i) runs.push_back(chosen[i % chosen.size()]);
  return runs;
}

// Ranks queue sixteen calls each without waiting (each rank sleeping at random between them, on
// two streams in turn if asked), mixing variants (`only`: these instead), after every rank had one
// call rejected: the epochs must stay in step, no peer may overwrite a buffer still in use, and
// calls of one rank stay ordered across streams. Every call has its own inputs and output; all
// are checked at the end.
// `devices` empty: the machine's GPUs, one rank each.
void run_ahead_through_mixed_variants(bool two_streams, bool low_latency,
                                      std::vector<std::pair<AgGemmVariant, int>> only = {},
                                      std::vector<int> devices = {}, DeviceSharing sharing = DeviceSharing::refused) {
  if (devices.empty()) devices = first_devices(team_size());
  const int world = static_cast<int>(devices.size());
  GpuTeam team(devices, 64 << 20, sharing);
  const long m = 64L * world, k = 128, n = 192, rows = m / world;
  AllGatherGemm op(team, m, k, n);
  ASSERT_TRUE(op.low_latency());
  const AgGemmVariant ll = low_latency ? AgGemmVariant::ll_bulk : AgGemmVariant::ce_bulk;
  std::vector<std::pair<AgGemmVariant, int>> runs = {
      {AgGemmVariant::ce_push, 1}, {AgGemmVariant::ce_pull, 2},      {ll, 1},
      {AgGemmVariant::ce_push, 2}, {AgGemmVariant::ce_bulk, 1},      {AgGemmVariant::ce_push_runs, 1},
      {AgGemmVariant::ce_pull, 1}, {AgGemmVariant::ce_pull_runs, 2}, {AgGemmVariant::ce_push, 1},
      {ll, 1},                     {AgGemmVariant::ce_pull, 1},      {AgGemmVariant::ce_push, 2},
      {AgGemmVariant::sm_push, 1}, {AgGemmVariant::ce_pull, 1},      {AgGemmVariant::sm_bulk, 1},
      {AgGemmVariant::sm_push, 2}};
  if (!only.empty()) {
    const std::size_t calls = runs.size();
    runs.clear();
    for (std::size_t i = 0; i < calls; ++i) runs.push_back(only[i % only.size()]);
  }
  // Only the mixed tests take the list: the no-pacing test must not be given a pull.
  if (const char* list = std::getenv("CARAVAN_TEST_RUN_AHEAD_VARIANTS"); list && only.empty())
    runs = run_ahead_variants_from(list, runs.size());
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
    hipStream_t other;
    CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&other, hipStreamNonBlocking));
    // A rejected call takes no epoch (the next calls would wait forever if it did).
    EXPECT_THROW(op.run(r, nullptr, nullptr, AgGemmVariant::ce_push, stream, 3), Error);
    // Every rank allocates everything before any rank makes its first call, and the reference
    // GEMMs start only once every rank is done: an allocation (or a first kernel launch) while
    // any GPU of the process waits on a peer's flag can wait for ever (seen on 4 x H200).
    std::vector<bf16*> b(runs.size()), c(runs.size());
    for (std::size_t call = 0; call < runs.size(); ++call) {
      b[call] = device_alloc<bf16>(static_cast<std::size_t>(k) * n);
      c[call] = device_alloc<bf16>(static_cast<std::size_t>(m) * n);
    }
    float *a32 = device_alloc<float>(static_cast<std::size_t>(m) * k), *b32 = device_alloc<float>(static_cast<std::size_t>(k) * n),
          *ref = device_alloc<float>(static_cast<std::size_t>(m) * n);
    barrier.arrive_and_wait();
    std::mt19937 rng(static_cast<unsigned>(seed) + static_cast<unsigned>(r));
    for (std::size_t call = 0; call < runs.size(); ++call) {
      hipStream_t on = two_streams && call % 2 == 1 ? other : stream;
      op.wait_shard_free(r, on);
      fill_random(op.shard(r), rows, k, k, seed + 100 * call, r * rows, 0, 1.0f, on);
      fill_random(b[call], k, n, n, seed + 100 * call + 1 + r, 0, 0, 1.0f, on);
      poison(c[call], static_cast<std::size_t>(m) * n, on);
      op.run(r, b[call], c[call], runs[call].first, on, runs[call].second);
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
    }
    try {
      finish(other);
      finish(stream);
    } catch (const Error& e) {
      throw Error(e.code(), std::string(e.what()) + "\n" + op.describe_flags());
    }
    barrier.arrive_and_wait();
    for (std::size_t call = 0; call < runs.size(); ++call) {
      fill_random(a32, m, k, k, seed + 100 * call, 0, 0, 1.0f, stream);
      fill_random(b32, k, n, n, seed + 100 * call + 1 + r, 0, 0, 1.0f, stream);
      team.blas(r).gemm_reference(stream, m, n, k, a32, k, b32, n, ref, n);
      const double err = relative_error(c[call], m, n, ref, stream);
      if (!(err < 1e-2))
        throw Error(Errc::internal, std::string(to_string(runs[call].first)) + " call " + std::to_string(call) +
                                        ": relative error " + std::to_string(err));
    }
    for (std::size_t call = 0; call < runs.size(); ++call) {
      (void)hipFree(b[call]);
      (void)hipFree(c[call]);
    }
    (void)hipFree(a32);
    (void)hipFree(b32);
    (void)hipFree(ref);
    (void)hipStreamDestroy(other);
  });
}

// These hang on 4 x H200 when no call is paced (every run, one stream or two, with or without
// the LL variant; docs/overlap.md, "Run-ahead": the copy-engine pulls need it) and pass with
// the default pacing (CARAVAN_OVERLAP_GPU_PACE=pulls: only around those pulls; the pushes and
// SM variants of the mix run ahead). With no pacing they run only on request.
#define CARAVAN_REQUIRE_RUN_AHEAD()                                                                          \
  do {                                                                                                      \
    if (settings::get_string("CARAVAN_OVERLAP_GPU_PACE") == "none" && !std::getenv("CARAVAN_TEST_RUN_AHEAD"))           \
      GTEST_SKIP() << "known hang when copy-engine pulls are queued without pacing (docs/overlap.md, "   \
                      "'Run-ahead'); set CARAVAN_TEST_RUN_AHEAD=1 to run it with CARAVAN_OVERLAP_GPU_PACE=none"; \
  } while (0)

TEST(Overlap, AllGatherGemmRanksRunAheadThroughMixedVariants) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  CARAVAN_REQUIRE_RUN_AHEAD();
  run_ahead_through_mixed_variants(false, true);
}
TEST(Overlap, AllGatherGemmRanksRunAheadThroughMixedVariantsWithoutLowLatency) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  CARAVAN_REQUIRE_RUN_AHEAD();
  run_ahead_through_mixed_variants(false, false);
}
TEST(Overlap, AllGatherGemmRanksRunAheadOnTwoStreams) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  CARAVAN_REQUIRE_RUN_AHEAD();
  run_ahead_through_mixed_variants(true, true);
}
// Pushes and the SM variants need no pacing: with none at all, sixteen calls queued back to back
// on every rank (each rank sleeping at random between them) land every shard.
TEST(Overlap, AllGatherGemmPushesRunAheadWithoutPacing) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  settings::ScopedOverride no_pacing("CARAVAN_OVERLAP_GPU_PACE", "none");
  run_ahead_through_mixed_variants(false, true,
                                   {{AgGemmVariant::ce_push, 1},
                                    {AgGemmVariant::sm_push, 2},
                                    {AgGemmVariant::ll_bulk, 1},
                                    {AgGemmVariant::ce_push_runs, 2},
                                    {AgGemmVariant::sm_bulk, 1},
                                    {AgGemmVariant::ce_push, 2}});
}

// Several operations on one team, queued back to back as a layer queues them: a pulling
// AllGather+GEMM, a pushing GEMM+ReduceScatter, a second AllGather+GEMM and GEMM+ReduceScatter
// (2 lanes, two parts per destination), four rounds, each rank sleeping at random between calls
// and waiting only at the end. Pacing is per object and rank for pushes, and per GPU around
// copy-engine pulls (docs/overlap.md, "Run-ahead"): every call must land, and every output must
// match the float32 reference.
class OperationMix {
 public:
  static constexpr long kRowsPerRank = 64, kK = 128, kN = 192;
  explicit OperationMix(GpuTeam& team)
      : world_(team.world()),
        m_(kRowsPerRank * world_),
        qkv_(team, m_, kK, kN),
        up_(team, m_, kK, kN + 64),
        out_(team, m_, kK, kN),
        down_(team, m_, kK, kN + 64, 2) {}

  struct Call {
    int op;  // 0 qkv, 1 out, 2 up, 3 down (the layer's order)
    AgGemmVariant ag;
    GemmRsVariant rs;
    int lanes;
  };
  long n_of(int op) const { return op < 2 ? kN : kN + 64; }
  // The output's rows on each rank: all m for AllGather+GEMM, m / world for GEMM+ReduceScatter.
  long rows_of(int op) const { return op % 2 == 0 ? m_ : m_ / world_; }

  // Queues `call` on rank r with fresh inputs from `seed`: the AllGather+GEMM shard and b, or the
  // ReduceScatter's a (m x k per rank) and b; `a` is that call's own input buffer (unused by
  // AllGather+GEMM), `c` its poisoned output.
  void queue(int r, const Call& call, std::uint64_t seed, bf16* a, bf16* b, bf16* c, hipStream_t stream) {
    const long n = n_of(call.op), rows = m_ / world_;
    if (call.op % 2 == 0) {
      AllGatherGemm& op = call.op == 0 ? qkv_ : up_;
      op.wait_shard_free(r, stream);
      fill_random(op.shard(r), rows, kK, kK, seed, r * rows, 0, 1.0f, stream);
      fill_random(b, kK, n, n, seed + 1 + r, 0, 0, 1.0f, stream);
      poison(c, static_cast<std::size_t>(m_) * n, stream);
      op.run(r, b, c, call.ag, stream, call.lanes);
    } else {
      fill_random(a, m_, kK, kK, seed + r, 0, 0, 1.0f, stream);
      fill_random(b, kK, n, n, seed + 50 + r, 0, 0, 1.0f, stream);
      poison(c, static_cast<std::size_t>(rows) * n, stream);
      (call.op == 1 ? out_ : down_).run(r, a, b, c, call.rs, stream, call.lanes);
    }
  }
  // The float32 reference of the call queued with `seed` on rank r, into ref (a32, b32: scratch
  // of m x k*world and k*world x n floats).
  void reference(GpuTeam& team, int r, const Call& call, std::uint64_t seed, float* a32, float* b32, float* ref,
                 hipStream_t stream) const {
    const long n = n_of(call.op), rows = m_ / world_, kk = kK * world_;
    if (call.op % 2 == 0) {
      fill_random(a32, m_, kK, kK, seed, 0, 0, 1.0f, stream);
      fill_random(b32, kK, n, n, seed + 1 + r, 0, 0, 1.0f, stream);
      team.blas(r).gemm_reference(stream, m_, n, kK, a32, kK, b32, n, ref, n);
    } else {
      for (int q = 0; q < world_; ++q) {
        fill_random(a32 + q * kK, rows, kK, kk, seed + q, r * rows, 0, 1.0f, stream);
        fill_random(b32 + q * kK * n, kK, n, n, seed + 50 + q, 0, 0, 1.0f, stream);
      }
      team.blas(r).gemm_reference(stream, rows, n, kk, a32, kk, b32, n, ref, n);
    }
  }
  // One rank's buffers for `calls` calls: each call's own inputs and output, and the reference's
  // scratch. Allocated before any rank's first call (see run_ahead_through_mixed_variants);
  // release() frees them (not a destructor: a free waits for the device, which after a failure
  // may wait for ever).
  struct RankBuffers {
    std::vector<bf16*> a, b, c;
    float *a32 = nullptr, *b32 = nullptr, *ref = nullptr;
    void release() {
      for (std::size_t i = 0; i < a.size(); ++i)
        for (bf16* p : {a[i], b[i], c[i]}) (void)hipFree(p);
      for (float* p : {a32, b32, ref}) (void)hipFree(p);
    }
  };
  RankBuffers allocate(std::size_t calls) const {
    const long big_n = kN + 64, kk = kK * world_;
    RankBuffers buffers;
    for (std::size_t i = 0; i < calls; ++i) {
      buffers.a.push_back(device_alloc<bf16>(static_cast<std::size_t>(m_) * kK));
      buffers.b.push_back(device_alloc<bf16>(static_cast<std::size_t>(kK) * big_n));
      buffers.c.push_back(device_alloc<bf16>(static_cast<std::size_t>(m_) * big_n));
    }
    buffers.a32 = device_alloc<float>(static_cast<std::size_t>(m_) * kk);
    buffers.b32 = device_alloc<float>(static_cast<std::size_t>(kk) * big_n);
    buffers.ref = device_alloc<float>(static_cast<std::size_t>(m_) * big_n);
    return buffers;
  }
  // Checks every call's output (queued with seed + 100 x its index) against the float32
  // reference; throws naming the first call that does not match.
  void check(GpuTeam& team, int r, const std::vector<Call>& calls, std::uint64_t seed, const RankBuffers& buffers,
             hipStream_t stream) const {
    for (std::size_t i = 0; i < calls.size(); ++i) {
      reference(team, r, calls[i], seed + 100 * i, buffers.a32, buffers.b32, buffers.ref, stream);
      const double err = relative_error(buffers.c[i], rows_of(calls[i].op), n_of(calls[i].op), buffers.ref, stream);
      if (!(err < 1e-2))
        throw Error(Errc::internal, "call " + std::to_string(i) + " (operation " + std::to_string(calls[i].op) +
                                        "): relative error " + std::to_string(err));
    }
  }
  std::string describe_flags() const {
    return "qkv:\n" + qkv_.describe_flags() + "out:\n" + out_.describe_flags() + "up:\n" + up_.describe_flags() +
           "down:\n" + down_.describe_flags();
  }

 private:
  int world_;
  long m_;
  AllGatherGemm qkv_, up_;
  GemmReduceScatter out_, down_;
};

TEST(Overlap, OperationsQueuedTogetherRunAheadAsALayerQueuesThem) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  CARAVAN_REQUIRE_RUN_AHEAD();
  const int world = team_size();
  GpuTeam team(first_devices(world), 64 << 20);
  OperationMix mix(team);
  // The configuration the layer test named when it hung on 4 x H200 ("ce-pull 2 lanes, x2 parts
  // 2 lanes"), then pushes, then the pulls again; the ReduceScatters as rings (ce_ring) in the
  // last two rounds, queued back to back after ce_push calls and after each other.
  using Call = OperationMix::Call;
  std::vector<Call> calls;
  for (int round = 0; round < 4; ++round) {
    const AgGemmVariant ag = round == 2 ? AgGemmVariant::ce_push : AgGemmVariant::ce_pull;
    const GemmRsVariant rs = round >= 2 ? GemmRsVariant::ce_ring : GemmRsVariant::ce_push;
    calls.push_back({0, ag, {}, 2});
    calls.push_back({1, {}, rs, 1});
    calls.push_back({2, ag, {}, 2});
    calls.push_back({3, {}, rs, 2});
  }
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
    OperationMix::RankBuffers buffers = mix.allocate(calls.size());
    barrier.arrive_and_wait();
    std::mt19937 rng(static_cast<unsigned>(seed) + static_cast<unsigned>(r));
    for (std::size_t i = 0; i < calls.size(); ++i) {
      mix.queue(r, calls[i], seed + 100 * i, buffers.a[i], buffers.b[i], buffers.c[i], stream);
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
    }
    try {
      finish(stream);
    } catch (const Error& e) {
      throw Error(e.code(), std::string(e.what()) + "\n" + mix.describe_flags());
    }
    barrier.arrive_and_wait();
    mix.check(team, r, calls, seed, buffers, stream);
    buffers.release();
  });
}

// A copy-engine pull is paced against the calls of every operation on its GPU, not only its
// own. Rank 1 comes 300 ms late: rank 0's call of another operation right after its pull may be
// queued only once that pull is done, and in the second round its pull, queued right after
// another operation's push, only once that push is done. Both outputs are checked as well.
TEST(Overlap, CopyEnginePullIsPacedAgainstEveryOperationOnItsGpu) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  if (settings::get_string("CARAVAN_OVERLAP_GPU_PACE") == "none")
    GTEST_SKIP() << "CARAVAN_OVERLAP_GPU_PACE=none: no call is paced";
  GpuTeam team(first_devices(2), 64 << 20);
  OperationMix mix(team);
  using Call = OperationMix::Call;
  const Call pull{0, AgGemmVariant::ce_pull, {}, 1}, push{2, AgGemmVariant::ce_push, {}, 1};
  const std::vector<Call> calls = {pull, push, push, pull};
  constexpr auto kLate = std::chrono::milliseconds(300);
  std::vector<std::chrono::duration<double>> queued(calls.size());  // rank 0's time in each run()
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
    OperationMix::RankBuffers buffers = mix.allocate(calls.size());
    barrier.arrive_and_wait();
    for (std::size_t i = 0; i < calls.size(); ++i) {
      // Rank 1 is late to each round's first call (0 and 2); rank 0's second call of the round
      // can only be queued once its first is done, which needs rank 1.
      if (r == 1 && i % 2 == 0) std::this_thread::sleep_for(kLate);
      const auto start = std::chrono::steady_clock::now();
      mix.queue(r, calls[i], seed + 100 * i, buffers.a[i], buffers.b[i], buffers.c[i], stream);
      if (r == 0) queued[i] = std::chrono::steady_clock::now() - start;
      if (i % 2 == 1) barrier.arrive_and_wait();  // rounds start together
    }
    finish(stream);
    barrier.arrive_and_wait();  // no reference kernel's first launch while a peer waits on a flag
    mix.check(team, r, calls, seed, buffers, stream);
    buffers.release();
  });
  const double late = std::chrono::duration<double>(kLate).count();
  // The calls that may start at once take far less than the 300 ms (their own operation has no
  // call in flight, and no pull is); the paced ones wait for rank 1.
  EXPECT_LT(queued[0].count(), late / 2) << "the first pull waited for nothing on the GPU";
  EXPECT_GT(queued[1].count(), late / 2) << "a push of another operation was queued while the pull was in flight";
  EXPECT_LT(queued[2].count(), late / 2) << "a push after a push waits for nothing";
  EXPECT_GT(queued[3].count(), late / 2) << "a pull was queued while another operation's push was in flight";
}

// The tile variants on shapes that leave partial tiles everywhere (72 rows per rank: tiles span
// two shards; k = 136: a K tail of 8; n = 200: a partial column tile), with one rank writing
// its shard late, so the other ranks' blocks really wait on their rows' flags.
TEST(Overlap, TileVariantsHandlePartialTilesAndLateRows) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  const int world = team_size();
  GpuTeam team(first_devices(world), 64 << 20);
  const long m = 72L * world, k = 136, n = 200, rows = m / world;
  AllGatherGemm op(team, m, k, n);
  const std::vector<AgGemmVariant> runs = {AgGemmVariant::tile_pull, AgGemmVariant::tile_push, AgGemmVariant::tile_push,
                                           AgGemmVariant::tile_pull};
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
    bf16 *b = device_alloc<bf16>(static_cast<std::size_t>(k) * n), *c = device_alloc<bf16>(static_cast<std::size_t>(m) * n);
    float *a32 = device_alloc<float>(static_cast<std::size_t>(m) * k), *b32 = device_alloc<float>(static_cast<std::size_t>(k) * n),
          *ref = device_alloc<float>(static_cast<std::size_t>(m) * n);
    barrier.arrive_and_wait();
    for (std::size_t call = 0; call < runs.size(); ++call) {
      const std::uint64_t sa = seed + 100 * call, sb = seed + 100 * call + 1 + static_cast<std::uint64_t>(r);
      op.wait_shard_free(r, stream);
      if (r == world - 1 && call == 2) std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a late shard
      fill_random(op.shard(r), rows, k, k, sa, r * rows, 0, 1.0f, stream);
      fill_random(b, k, n, n, sb, 0, 0, 1.0f, stream);
      poison(c, static_cast<std::size_t>(m) * n, stream);
      op.run(r, b, c, runs[call], stream);
      finish(stream);
      barrier.arrive_and_wait();  // every rank done before any launches its reference GEMM
      fill_random(a32, m, k, k, sa, 0, 0, 1.0f, stream);
      fill_random(b32, k, n, n, sb, 0, 0, 1.0f, stream);
      team.blas(r).gemm_reference(stream, m, n, k, a32, k, b32, n, ref, n);
      const double err = relative_error(c, m, n, ref, stream);
      if (!(err < 1e-2))
        throw Error(Errc::internal, std::string(to_string(runs[call])) + " call " + std::to_string(call) + ": relative error " +
                                        std::to_string(err));
      barrier.arrive_and_wait();
    }
    (void)hipFree(b), (void)hipFree(c), (void)hipFree(a32), (void)hipFree(b32), (void)hipFree(ref);
  });
}

// `runs` in turn on every rank of `team`, each call on fresh inputs against the float32
// reference, output poisoned first (the variants' shape checks asserted: every one applies).
void check_gemm_reduce_scatter_calls(GpuTeam& team, const std::vector<std::pair<GemmRsVariant, int>>& runs) {
  const int world = team.world();
  const long m = 192L * world, k = 160, n = 256;
  GemmReduceScatter op(team, m, k, n, 2);
  ASSERT_TRUE(op.low_latency());
  ASSERT_TRUE(op.pull());
  ASSERT_TRUE(op.push());
  ASSERT_TRUE(op.scatter());
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier&) {
    const long rows = m / world, kk = k * world;
    bf16 *a = device_alloc<bf16>(static_cast<std::size_t>(m) * k), *b = device_alloc<bf16>(static_cast<std::size_t>(k) * n),
         *out = device_alloc<bf16>(static_cast<std::size_t>(rows) * n);
    float *a32 = device_alloc<float>(static_cast<std::size_t>(rows) * kk),
          *b32 = device_alloc<float>(static_cast<std::size_t>(kk) * n), *ref = device_alloc<float>(static_cast<std::size_t>(rows) * n);
    for (std::size_t call = 0; call < runs.size(); ++call) {
      const std::uint64_t sa = seed + 100 * call, sb = seed + 100 * call + 50;
      fill_random(a, m, k, k, sa + r, 0, 0, 1.0f, stream);
      fill_random(b, k, n, n, sb + r, 0, 0, 1.0f, stream);
      poison(out, static_cast<std::size_t>(rows) * n, stream);
      op.run(r, a, b, out, runs[call].first, stream, runs[call].second);
      finish(stream);
      for (int q = 0; q < world; ++q) {
        fill_random(a32 + q * k, rows, k, kk, sa + q, r * rows, 0, 1.0f, stream);
        fill_random(b32 + q * k * n, k, n, n, sb + q, 0, 0, 1.0f, stream);
      }
      team.blas(r).gemm_reference(stream, rows, n, kk, a32, kk, b32, n, ref, n);
      const double err = relative_error(out, rows, n, ref, stream);
      if (!(err < 1e-2))
        throw Error(Errc::internal, std::string(to_string(runs[call].first)) + " call " + std::to_string(call) +
                                        ": relative error " + std::to_string(err));
    }
    for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(out), static_cast<void*>(a32),
                    static_cast<void*>(b32), static_cast<void*>(ref)})
      (void)hipFree(p);
  });
  // The hang report: each rank's calls, and its arrived words, which count the parts landed from
  // each source: (e - 1) x splits + splits after the last copy-engine call (epoch e), none from itself.
  std::size_t last_copy_engine_call = 0;
  for (std::size_t call = 0; call < runs.size(); ++call)
    if (runs[call].first == GemmRsVariant::ce_push || runs[call].first == GemmRsVariant::ce_bulk ||
        runs[call].first == GemmRsVariant::tile_push)
      last_copy_engine_call = call;
  const std::string report = op.describe_flags();
  for (int r = 0; r < world; ++r) {
    std::string arrived;
    for (int q = 0; q < world; ++q)
      arrived += (q ? " " : "") + std::to_string(q == r ? 0 : (last_copy_engine_call + 1) * 2);
    const std::string line =
        "rank " + std::to_string(r) + ": " + std::to_string(runs.size()) + " calls; arrived [" + arrived + "]";
    EXPECT_NE(report.find(line), std::string::npos) << "expected '" << line << "' in\n" << report;
  }
}

TEST(Overlap, GemmReduceScatterMatchesReferenceCallAfterCall) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  GpuTeam team(first_devices(team_size()), 64 << 20);
  // Every variant after every other, sm_pull and sm_push also twice in a row (both of their
  // buffers), and each after the other (they share the buffers); tile_push twice in a row and
  // after other variants (its done words count its own calls only); tile_scatter likewise, both
  // inbox parities after each other and after other variants, its two ranges per rank (96 rows)
  // smaller than a row tile, so tiles add to two ranges and to two destinations; blas_scatter,
  // which shares tile_scatter's inboxes and words, after it, before it and after others; ce_ring
  // (its running sums in the slots ce_push lands in, a word of its own) after itself and others,
  // with 1 and 2 lanes. Rows per rank (192) are
  // 1.5 row tiles and parts (96 rows) 0.75: tile_push's tiles serve two destinations, and its
  // parts span two tiles.
  const std::vector<std::pair<GemmRsVariant, int>> runs = {
      {GemmRsVariant::ce_push, 1},      {GemmRsVariant::ll_bulk, 1},      {GemmRsVariant::ce_bulk, 1},
      {GemmRsVariant::ll_bulk, 1},      {GemmRsVariant::ll_bulk, 1},      {GemmRsVariant::ce_push, 2},
      {GemmRsVariant::sm_pull, 1},      {GemmRsVariant::sm_pull, 1},      {GemmRsVariant::sm_pull, 1},
      {GemmRsVariant::ce_push, 1},      {GemmRsVariant::sm_pull, 1},      {GemmRsVariant::ll_bulk, 1},
      {GemmRsVariant::sm_pull, 1},      {GemmRsVariant::ce_bulk, 1},      {GemmRsVariant::sm_push, 1},
      {GemmRsVariant::sm_push, 1},      {GemmRsVariant::ce_push, 1},      {GemmRsVariant::sm_push, 1},
      {GemmRsVariant::sm_pull, 1},      {GemmRsVariant::sm_push, 1},      {GemmRsVariant::ll_bulk, 1},
      {GemmRsVariant::sm_push, 1},      {GemmRsVariant::tile_push, 1},    {GemmRsVariant::tile_push, 1},
      {GemmRsVariant::ce_push, 1},      {GemmRsVariant::tile_push, 1},    {GemmRsVariant::sm_pull, 1},
      {GemmRsVariant::tile_push, 1},    {GemmRsVariant::tile_scatter, 1}, {GemmRsVariant::tile_scatter, 1},
      {GemmRsVariant::ce_push, 1},      {GemmRsVariant::tile_scatter, 1}, {GemmRsVariant::sm_push, 1},
      {GemmRsVariant::tile_scatter, 1}, {GemmRsVariant::ll_bulk, 1},      {GemmRsVariant::tile_scatter, 1},
      {GemmRsVariant::tile_push, 1},    {GemmRsVariant::tile_scatter, 1}, {GemmRsVariant::blas_scatter, 1},
      {GemmRsVariant::blas_scatter, 2}, {GemmRsVariant::tile_scatter, 1}, {GemmRsVariant::ce_push, 1},
      {GemmRsVariant::blas_scatter, 2}, {GemmRsVariant::sm_pull, 1},      {GemmRsVariant::blas_scatter, 1},
      {GemmRsVariant::ce_ring, 1},      {GemmRsVariant::ce_ring, 2},      {GemmRsVariant::ce_push, 2},
      {GemmRsVariant::ce_ring, 2},      {GemmRsVariant::sm_push, 1},      {GemmRsVariant::ce_ring, 1},
      {GemmRsVariant::tile_scatter, 1}, {GemmRsVariant::ce_ring, 1},      {GemmRsVariant::ce_bulk, 1},
      {GemmRsVariant::ce_ring, 2}};
  check_gemm_reduce_scatter_calls(team, runs);
}

void gemm_reduce_scatter_one_kernel_calls_run_ahead(long rows_per_rank, int expected_rounds);

// sm_pull and sm_push run unpaced: ranks queue sixteen calls each without waiting (sleeping at
// random between them), the one-kernel variants mixed, both parities of their shared buffers
// back to back, and with a paced copy-engine call among them. Every call has its own inputs and
// output; all are checked at the end. sm_push in one round (64 rows a rank) and in two (4096
// rows a rank: 2 MiB to each peer, two passes of the kernel's grid, 512 KiB asked a round):
// its words then count rounds from call to call.
TEST(Overlap, GemmReduceScatterOneKernelCallsRunAhead) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  for (const auto& [round_bytes, rows, rounds] : {std::tuple{"0", 64L, 1}, std::tuple{"512K", 4096L, 2}}) {
    SCOPED_TRACE(std::string("CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES=") + round_bytes);
    settings::ScopedOverride setting("CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES", round_bytes);
    gemm_reduce_scatter_one_kernel_calls_run_ahead(rows, rounds);
  }
}

void gemm_reduce_scatter_one_kernel_calls_run_ahead(long rows_per_rank, int expected_rounds) {
  const int world = team_size();
  GpuTeam team(first_devices(world), 64 << 20);
  const long m = rows_per_rank * world, k = 160, n = 256, rows = m / world, kk = k * world;
  GemmReduceScatter op(team, m, k, n);
  ASSERT_TRUE(op.pull());
  EXPECT_EQ(op.push_rounds(), expected_rounds);
  const std::vector<GemmRsVariant> runs = {
      GemmRsVariant::sm_push, GemmRsVariant::sm_push, GemmRsVariant::sm_pull, GemmRsVariant::sm_pull,
      GemmRsVariant::sm_push, GemmRsVariant::sm_pull, GemmRsVariant::sm_push, GemmRsVariant::ce_push,
      GemmRsVariant::sm_pull, GemmRsVariant::sm_push, GemmRsVariant::sm_push, GemmRsVariant::sm_push,
      GemmRsVariant::sm_pull, GemmRsVariant::sm_pull, GemmRsVariant::sm_pull, GemmRsVariant::sm_push};
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
    // Everything allocated before any rank's first call (see run_ahead_through_mixed_variants).
    std::vector<bf16*> a(runs.size()), b(runs.size()), out(runs.size());
    for (std::size_t call = 0; call < runs.size(); ++call) {
      a[call] = device_alloc<bf16>(static_cast<std::size_t>(m) * k);
      b[call] = device_alloc<bf16>(static_cast<std::size_t>(k) * n);
      out[call] = device_alloc<bf16>(static_cast<std::size_t>(rows) * n);
    }
    float *a32 = device_alloc<float>(static_cast<std::size_t>(rows) * kk),
          *b32 = device_alloc<float>(static_cast<std::size_t>(kk) * n), *ref = device_alloc<float>(static_cast<std::size_t>(rows) * n);
    barrier.arrive_and_wait();
    std::mt19937 rng(static_cast<unsigned>(seed) + static_cast<unsigned>(r));
    for (std::size_t call = 0; call < runs.size(); ++call) {
      const std::uint64_t sa = seed + 100 * call, sb = seed + 100 * call + 50;
      fill_random(a[call], m, k, k, sa + r, 0, 0, 1.0f, stream);
      fill_random(b[call], k, n, n, sb + r, 0, 0, 1.0f, stream);
      poison(out[call], static_cast<std::size_t>(rows) * n, stream);
      op.run(r, a[call], b[call], out[call], runs[call], stream);
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
    }
    finish(stream);
    barrier.arrive_and_wait();
    for (std::size_t call = 0; call < runs.size(); ++call) {
      const std::uint64_t sa = seed + 100 * call, sb = seed + 100 * call + 50;
      for (int q = 0; q < world; ++q) {
        fill_random(a32 + q * k, rows, k, kk, sa + q, r * rows, 0, 1.0f, stream);
        fill_random(b32 + q * k * n, k, n, n, sb + q, 0, 0, 1.0f, stream);
      }
      team.blas(r).gemm_reference(stream, rows, n, kk, a32, kk, b32, n, ref, n);
      const double err = relative_error(out[call], rows, n, ref, stream);
      if (!(err < 1e-2))
        throw Error(Errc::internal, std::string(to_string(runs[call])) + " call " + std::to_string(call) +
                                        ": relative error " + std::to_string(err));
    }
    for (std::size_t call = 0; call < runs.size(); ++call)
      for (bf16* p : {a[call], b[call], out[call]}) (void)hipFree(p);
    for (float* p : {a32, b32, ref}) (void)hipFree(p);
  });
}

// A ChunkTrace whose events this object makes (with timing) and destroys; `wrong` is one of the
// wrong sizes the operations must refuse.
struct TraceEvents {
  ChunkTrace trace, wrong;
  std::vector<hipEvent_t*> all;
  explicit TraceEvents(std::size_t chunks) {
    trace.ready.resize(chunks), trace.gemm_done.resize(chunks), trace.pushed.resize(chunks);
    all.push_back(&trace.start);
    for (auto* list : {&trace.ready, &trace.gemm_done, &trace.pushed})
      for (hipEvent_t& e : *list) all.push_back(&e);
    for (hipEvent_t* e : all) CARAVAN_HIP_CHECK(hipEventCreate(e));
    wrong = trace;
    wrong.ready.pop_back();
  }
  ~TraceEvents() {
    for (hipEvent_t* e : all) (void)hipEventDestroy(*e);
  }
  TraceEvents(const TraceEvents&) = delete;
  TraceEvents& operator=(const TraceEvents&) = delete;
  float at(hipEvent_t e) const {  // ms after start
    float ms = -1;
    CARAVAN_HIP_CHECK(hipEventElapsedTime(&ms, trace.start, e));
    return ms;
  }
};

// `set(&wrong)` must throw invalid_argument naming the rule.
template <typename Set>
void expect_trace_refused(const Set& set, ChunkTrace& wrong) {
  try {
    set(&wrong);
    ADD_FAILURE() << "a trace with too few ready events was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("world x splits"), std::string::npos) << e.what();
  }
}

// The ring's trace (GemmReduceScatter::set_ring_trace, `bench overlap --stamps`): every event of
// a traced call recorded, each chunk's wait, GEMM and push in that order on the GPU's clock, the
// traced call's output still right, and a trace of the wrong size refused with the rule.
TEST(Overlap, GemmReduceScatterRingTraceTimesEveryChunkInOrder) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  const int world = team_size();
  constexpr int kSplits = 2;
  GpuTeam team(first_devices(world), 64 << 20);
  const long m = 128L * world, k = 160, n = 256, rows = m / world, kk = k * world;
  GemmReduceScatter op(team, m, k, n, kSplits);
  const auto chunks = static_cast<std::size_t>(world * kSplits);
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
    TraceEvents events(chunks);
    expect_trace_refused([&](ChunkTrace* t) { op.set_ring_trace(r, t); }, events.wrong);
    bf16* a = device_alloc<bf16>(static_cast<std::size_t>(m) * k);
    bf16* b = device_alloc<bf16>(static_cast<std::size_t>(k) * n);
    bf16* out = device_alloc<bf16>(static_cast<std::size_t>(rows) * n);
    float *a32 = device_alloc<float>(static_cast<std::size_t>(rows) * kk),
          *b32 = device_alloc<float>(static_cast<std::size_t>(kk) * n), *ref = device_alloc<float>(static_cast<std::size_t>(rows) * n);
    for (int q = 0; q < world; ++q) {
      fill_random(a32 + q * k, rows, k, kk, seed + q, r * rows, 0, 1.0f, stream);
      fill_random(b32 + q * k * n, k, n, n, seed + 50 + q, 0, 0, 1.0f, stream);
    }
    team.blas(r).gemm_reference(stream, rows, n, kk, a32, kk, b32, n, ref, n);
    fill_random(a, m, k, k, seed + r, 0, 0, 1.0f, stream);
    fill_random(b, k, n, n, seed + 50 + r, 0, 0, 1.0f, stream);
    barrier.arrive_and_wait();
    op.run(r, a, b, out, GemmRsVariant::ce_ring, stream, 2);  // untraced first: the trace is per call
    op.set_ring_trace(r, &events.trace);
    poison(out, static_cast<std::size_t>(rows) * n, stream);
    op.run(r, a, b, out, GemmRsVariant::ce_ring, stream, 2);
    op.set_ring_trace(r, nullptr);
    const double err = relative_error(out, rows, n, ref, stream);  // waits for the call
    EXPECT_LT(err, 1e-2) << "rank " << r << ": the traced ring call";
    const ChunkTrace& t = events.trace;
    for (std::size_t c = 0; c < chunks; ++c) {
      SCOPED_TRACE("rank " + std::to_string(r) + " chunk " + std::to_string(c));
      EXPECT_GE(events.at(t.ready[c]), 0.0f);
      EXPECT_GE(events.at(t.gemm_done[c]), events.at(t.ready[c]));
      if (c < chunks - kSplits) {
        EXPECT_GE(events.at(t.pushed[c]), events.at(t.gemm_done[c]));
      }
      // Chunks kSplits (2) apart share a lane (chunks alternate over the 2 lanes): in stream order.
      if (c >= static_cast<std::size_t>(kSplits)) {
        EXPECT_GT(events.at(t.gemm_done[c]), events.at(t.gemm_done[c - kSplits]));
      }
    }
    barrier.arrive_and_wait();
    for (bf16* p : {a, b, out}) (void)hipFree(p);
    for (float* p : {a32, b32, ref}) (void)hipFree(p);
  });
}

// CARAVAN_OVERLAP_GPU_RING_PUSH_BYTES: a ring of x4 parts pushes a part at a time, two parts
// at a time, or a whole step at a time (3 parts' bytes round up to 4, the least group dividing
// the parts; 1G is more than a step). Each setting: three calls with 1 and 2 lanes, each checked
// against the float32 reference; a traced call shows every part of a group pushed only once the
// group's last part's GEMM is done. Last, ranks that group differently in one ring
// (set_ring_push_bytes: rank 0 two parts a push, the others one).
void check_ring_push_groups(GpuTeam& team) {
  const int world = team.world();
  constexpr int kSplits = 4;
  const long m = 128L * world, k = 160, n = 256, rows = m / world, kk = k * world;
  constexpr std::size_t kPartBytes = 128 / kSplits * 256 * sizeof(bf16);
  const std::uint64_t seed = fresh_seed();
  constexpr std::size_t kMixed = ~std::size_t{0};  // rank 0 pushes two parts at a time, the others one
  for (const auto& [push_bytes, group] : std::vector<std::pair<std::size_t, int>>{
           {0, 1}, {kPartBytes, 1}, {2 * kPartBytes, 2}, {3 * kPartBytes, 4}, {std::size_t{1} << 30, 4}, {kMixed, 2}}) {
    SCOPED_TRACE("CARAVAN_OVERLAP_GPU_RING_PUSH_BYTES=" + std::to_string(push_bytes));
    settings::ScopedOverride setting("CARAVAN_OVERLAP_GPU_RING_PUSH_BYTES",
                                     std::to_string(push_bytes == kMixed ? 0 : push_bytes));
    GemmReduceScatter op(team, m, k, n, kSplits);
    if (push_bytes == kMixed) {
      op.set_ring_push_bytes(0, 2 * kPartBytes);
      for (int r = 1; r < world; ++r) EXPECT_EQ(op.ring_push_group(r), 1) << "rank " << r;
      try {
        op.set_ring_push_bytes(world, 0);
        ADD_FAILURE() << "a rank past the team accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("is outside 0.."), std::string::npos) << e.what();
      }
    }
    EXPECT_EQ(op.ring_push_group(), group) << "parts a push carries";
    const auto chunks = static_cast<std::size_t>(world * kSplits);
    run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
      TraceEvents events(chunks);
      bf16* a = device_alloc<bf16>(static_cast<std::size_t>(m) * k);
      bf16* b = device_alloc<bf16>(static_cast<std::size_t>(k) * n);
      bf16* out = device_alloc<bf16>(static_cast<std::size_t>(rows) * n);
      float *a32 = device_alloc<float>(static_cast<std::size_t>(rows) * kk),
            *b32 = device_alloc<float>(static_cast<std::size_t>(kk) * n),
            *ref = device_alloc<float>(static_cast<std::size_t>(rows) * n);
      for (int call = 0; call < 3; ++call) {
        const std::uint64_t sa = seed + 100 * call + push_bytes, sb = sa + 50;
        for (int q = 0; q < world; ++q) {
          fill_random(a32 + q * k, rows, k, kk, sa + q, r * rows, 0, 1.0f, stream);
          fill_random(b32 + q * k * n, k, n, n, sb + q, 0, 0, 1.0f, stream);
        }
        team.blas(r).gemm_reference(stream, rows, n, kk, a32, kk, b32, n, ref, n);
        fill_random(a, m, k, k, sa + r, 0, 0, 1.0f, stream);
        fill_random(b, k, n, n, sb + r, 0, 0, 1.0f, stream);
        poison(out, static_cast<std::size_t>(rows) * n, stream);
        const int lanes = call == 1 ? 1 : 2;
        if (call == 2) op.set_ring_trace(r, &events.trace);
        op.run(r, a, b, out, GemmRsVariant::ce_ring, stream, lanes);
        op.set_ring_trace(r, nullptr);
        const double err = relative_error(out, rows, n, ref, stream);  // waits for the call
        EXPECT_LT(err, 1e-2) << "rank " << r << " call " << call << " (" << lanes << " lanes)";
      }
      const ChunkTrace& t = events.trace;
      const auto mine = static_cast<std::size_t>(op.ring_push_group(r));
      for (std::size_t c = 0; c < chunks - kSplits; ++c) {  // the pushed parts: all steps but the last
        const std::size_t group_last = c - c % mine + mine - 1;
        EXPECT_GE(events.at(t.pushed[c]), events.at(t.gemm_done[group_last]))
            << "rank " << r << ": part " << c << " pushed before part " << group_last << "'s GEMM ended";
      }
      barrier.arrive_and_wait();
      for (bf16* p : {a, b, out}) (void)hipFree(p);
      for (float* p : {a32, b32, ref}) (void)hipFree(p);
    });
  }
}

TEST(Overlap, GemmReduceScatterRingPushesGroupsOfParts) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  GpuTeam team(first_devices(team_size()), 64 << 20);
  check_ring_push_groups(team);
}

// AllGatherGemm's trace (set_trace) on ce_push with 2 lanes: every chunk's wait and GEMM, and
// every copy this rank pushes, recorded in order; the traced call still right; a trace of the
// wrong size refused with the rule.
TEST(Overlap, AllGatherGemmTraceTimesEveryChunkInOrder) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  const int world = team_size();
  GpuTeam team(first_devices(world), 64 << 20);
  const long m = 96L * world, k = 160, n = 256, rows = m / world;
  AllGatherGemm op(team, m, k, n);
  const auto chunks = static_cast<std::size_t>(world);
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
    TraceEvents events(chunks);
    expect_trace_refused([&](ChunkTrace* t) { op.set_trace(r, t); }, events.wrong);
    bf16* b = device_alloc<bf16>(static_cast<std::size_t>(k) * n);
    bf16* c = device_alloc<bf16>(static_cast<std::size_t>(m) * n);
    float *a32 = device_alloc<float>(static_cast<std::size_t>(m) * k), *b32 = device_alloc<float>(static_cast<std::size_t>(k) * n),
          *ref = device_alloc<float>(static_cast<std::size_t>(m) * n);
    fill_random(a32, m, k, k, seed, 0, 0, 1.0f, stream);
    fill_random(b32, k, n, n, seed + 50 + r, 0, 0, 1.0f, stream);
    team.blas(r).gemm_reference(stream, m, n, k, a32, k, b32, n, ref, n);
    fill_random(op.shard(r), rows, k, k, seed, r * rows, 0, 1.0f, stream);
    fill_random(b, k, n, n, seed + 50 + r, 0, 0, 1.0f, stream);
    poison(c, static_cast<std::size_t>(m) * n, stream);
    barrier.arrive_and_wait();
    op.set_trace(r, &events.trace);
    op.run(r, b, c, AgGemmVariant::ce_push, stream, 2);
    op.set_trace(r, nullptr);
    const double err = relative_error(c, m, n, ref, stream);  // waits for the call
    EXPECT_LT(err, 1e-2) << "rank " << r << ": the traced call";
    const ChunkTrace& t = events.trace;
    for (std::size_t ch = 0; ch < chunks; ++ch) {
      SCOPED_TRACE("rank " + std::to_string(r) + " chunk " + std::to_string(ch));
      EXPECT_GE(events.at(t.ready[ch]), 0.0f);
      EXPECT_GE(events.at(t.gemm_done[ch]), events.at(t.ready[ch]));
      if (ch >= 2) {
        EXPECT_GT(events.at(t.gemm_done[ch]), events.at(t.gemm_done[ch - 2]));  // one lane
      }
    }
    for (std::size_t j = 0; j + 1 < chunks; ++j) {  // the copies, one after another on the comm stream
      EXPECT_GE(events.at(t.pushed[j]), 0.0f) << "rank " << r << " copy " << j;
      if (j > 0) {
        EXPECT_GE(events.at(t.pushed[j]), events.at(t.pushed[j - 1])) << "rank " << r << " copy " << j;
      }
    }
    barrier.arrive_and_wait();
    for (bf16* p : {b, c}) (void)hipFree(p);
    for (float* p : {a32, b32, ref}) (void)hipFree(p);
  });
}

TEST(Overlap, GemmAllScatterMatchesReferenceCallAfterCall) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  const int world = team_size();
  GpuTeam team(first_devices(world), 64 << 20);
  const long m = 256, k = 128, n = 96L * world, block = n / world;
  GemmAllScatter op(team, m, k, n, 4);
  // tile_fused and tile_specialized twice in a row each (their shared done words are running
  // counts), after each other, and after and before the copy-engine variants; sm_bulk twice in a
  // row, and after and before each of the others.
  const std::vector<std::pair<GemmAsVariant, int>> runs = {
      {GemmAsVariant::ce_push, 1},          {GemmAsVariant::ce_push, 2},          {GemmAsVariant::ce_bulk, 1},
      {GemmAsVariant::sm_bulk, 1},          {GemmAsVariant::ce_push, 1},          {GemmAsVariant::tile_fused, 1},
      {GemmAsVariant::tile_fused, 1},       {GemmAsVariant::sm_bulk, 1},          {GemmAsVariant::sm_bulk, 1},
      {GemmAsVariant::tile_specialized, 1}, {GemmAsVariant::tile_specialized, 1}, {GemmAsVariant::ce_push, 2},
      {GemmAsVariant::sm_bulk, 1},          {GemmAsVariant::tile_specialized, 1}, {GemmAsVariant::tile_fused, 1},
      {GemmAsVariant::sm_bulk, 1},          {GemmAsVariant::ce_bulk, 1}};
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier&) {
    bf16 *a = device_alloc<bf16>(static_cast<std::size_t>(m) * k), *b = device_alloc<bf16>(static_cast<std::size_t>(k) * block);
    float *a32 = device_alloc<float>(static_cast<std::size_t>(m) * k), *b32 = device_alloc<float>(static_cast<std::size_t>(k) * n),
          *ref = device_alloc<float>(static_cast<std::size_t>(m) * n);
    for (std::size_t call = 0; call < runs.size(); ++call) {
      const std::uint64_t sa = seed + 100 * call, sb = seed + 100 * call + 50;
      fill_random(a, m, k, k, sa, 0, 0, 1.0f, stream);
      fill_random(b, k, block, block, sb + r, 0, 0, 1.0f, stream);
      poison(op.output(r), static_cast<std::size_t>(m) * n, stream);
      op.run(r, a, b, runs[call].first, stream, runs[call].second);
      finish(stream);
      fill_random(a32, m, k, k, sa, 0, 0, 1.0f, stream);
      for (int q = 0; q < world; ++q) fill_random(b32 + q * block, k, block, n, sb + q, 0, 0, 1.0f, stream);
      team.blas(r).gemm_reference(stream, m, n, k, a32, k, b32, n, ref, n);
      const double err = relative_error(op.output(r), m, n, ref, stream);
      if (!(err < 1e-2))
        throw Error(Errc::internal, std::string(to_string(runs[call].first)) + " call " + std::to_string(call) +
                                        ": relative error " + std::to_string(err));
    }
    for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(a32), static_cast<void*>(b32),
                    static_cast<void*>(ref)})
      (void)hipFree(p);
  });
}

// In both line formats (CARAVAN_LL128_MIN_BYTES forces each): 24 KiB is 3072 words, so the
// last 128-byte line is partly filled.
class LowLatencyFormats : public ::testing::TestWithParam<LlFormat> {};

TEST_P(LowLatencyFormats, AllGatherIsExactOnEveryCall) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
#if defined(CARAVAN_GPU_AMD)
  if (GetParam() == LlFormat::lines128) GTEST_SKIP() << "128-byte lines are for NVIDIA GPUs (NVLink)";
#endif
  const int world = team_size();
  GpuTeam team(first_devices(world), 16 << 20);
  constexpr std::size_t kBytes = 24 << 10;
  constexpr long kElems = kBytes / sizeof(bf16);
  settings::ScopedOverride from("CARAVAN_LL128_MIN_BYTES", GetParam() == LlFormat::lines128 ? "8" : "0");
  LowLatencyAllGather op(team, kBytes);
  if (GetParam() == LlFormat::lines128 && op.format() == LlFormat::pairs)
    GTEST_SKIP() << "CUDA reports no native peer atomics between some pair of these GPUs (no NVLink): 16-byte lines only";
  ASSERT_EQ(op.format(), GetParam()) << to_string(op.format());
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier&) {
    bf16 *in = device_alloc<bf16>(kElems), *out = device_alloc<bf16>(static_cast<std::size_t>(kElems) * world);
    float* ref = device_alloc<float>(static_cast<std::size_t>(kElems) * world);
    for (int call = 0; call < 500; ++call) {
      // Different data every call, so a line left from an earlier call is caught.
      fill_random(in, 1, kElems, kElems, seed + 1000 * call + r, 0, 0, 1.0f, stream);
      poison(out, static_cast<std::size_t>(kElems) * world, stream);
      op.run(r, in, out, stream);
      for (int q = 0; q < world; ++q)
        fill_random(ref + q * kElems, 1, kElems, kElems, seed + 1000 * call + q, 0, 0, 1.0f, stream);
      const double err = relative_error(out, world, kElems, ref, stream);
      if (err != 0)
        throw Error(Errc::internal,
                    "call " + std::to_string(call) + ": gathered data differ, error " + std::to_string(err));
    }
    (void)hipFree(in);
    (void)hipFree(out);
    (void)hipFree(ref);
  });
}

INSTANTIATE_TEST_SUITE_P(Overlap, LowLatencyFormats, ::testing::Values(LlFormat::pairs, LlFormat::lines128),
                         [](const ::testing::TestParamInfo<LlFormat>& param) {
                           return param.param == LlFormat::pairs ? std::string("Lines16") : std::string("Lines128");
                         });

// Calls queued back to back with no other kernel between them (with early launch, each call's
// grid may be scheduled while the one before it ends), then the same calls, a kernel between
// every other pair, captured into a graph and replayed twice on new data: every call's output
// is exact. With early launch on and off, at 40 KiB per rank and at the largest size (1024
// blocks, which must all be resident at once).
TEST(Overlap, LowLatencyAllGatherBackToBackAndReplayedFromAGraph) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  const int world = team_size();
  GpuTeam team(first_devices(world), 64 << 20);
  const std::uint64_t seed = fresh_seed();
  for (const char* early : {"true", "false"})
    for (const std::size_t bytes : {std::size_t{40} << 10, kLlMaxBytes}) {
      SCOPED_TRACE(std::string("early launch ") + early + ", " + std::to_string(bytes) + " bytes per rank");
      settings::ScopedOverride early_launch("CARAVAN_OVERLAP_GPU_EARLY_LAUNCH", early);
      const long elems = static_cast<long>(bytes / sizeof(bf16));
      const int calls = bytes == kLlMaxBytes ? 6 : 32;
      const std::uint64_t mark = team.heap().mark();
      {
        LowLatencyAllGather op(team, bytes);
        run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
          const std::size_t out_elems = static_cast<std::size_t>(elems) * world;
          bf16* in = device_alloc<bf16>(static_cast<std::size_t>(elems) * calls);
          bf16* out = device_alloc<bf16>(out_elems * calls);
          bf16* scratch = device_alloc<bf16>(1 << 16);
          float* ref = device_alloc<float>(out_elems);
          // No allocation, capture or instantiation while a peer's call may wait on this rank.
          barrier.arrive_and_wait();
          auto prepare = [&](std::uint64_t round) {
            for (int call = 0; call < calls; ++call)
              fill_random(in + call * elems, 1, elems, elems, seed + round * 100000 + 1000 * call + r, 0, 0, 1.0f,
                          stream);
            poison(out, out_elems * calls, stream);
            CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
          };
          auto check = [&](std::uint64_t round, const char* how) {
            for (int call = 0; call < calls; ++call) {
              for (int q = 0; q < world; ++q)
                fill_random(ref + q * elems, 1, elems, elems, seed + round * 100000 + 1000 * call + q, 0, 0, 1.0f,
                            stream);
              const double err = relative_error(out + call * out_elems, world, elems, ref, stream);
              if (err != 0)
                throw Error(Errc::internal, std::string(how) + ", round " + std::to_string(round) + ", call " +
                                                std::to_string(call) + ": gathered data differ, error " +
                                                std::to_string(err));
            }
          };
          auto queue_calls = [&](bool kernels_between) {
            for (int call = 0; call < calls; ++call) {
              if (kernels_between && call % 2 == 1) poison(scratch, 1 << 16, stream);
              op.run(r, in + call * elems, out + call * out_elems, stream);
            }
          };
          prepare(0);
          queue_calls(false);
          check(0, "launched back to back");

          hipGraph_t graph = nullptr;
          hipGraphExec_t exec = nullptr;
          barrier.arrive_and_wait();  // every rank's calls done before any captures
          CARAVAN_HIP_CHECK(hipStreamBeginCapture(stream, hipStreamCaptureModeThreadLocal));
          queue_calls(true);
          CARAVAN_HIP_CHECK(hipStreamEndCapture(stream, &graph));
          CARAVAN_HIP_CHECK(hipGraphInstantiate(&exec, graph, nullptr, nullptr, 0));
          CARAVAN_HIP_CHECK(hipGraphDestroy(graph));
          barrier.arrive_and_wait();  // every graph ready before any replays
          for (std::uint64_t round = 1; round <= 2; ++round) {
            prepare(round);
            CARAVAN_HIP_CHECK(hipGraphLaunch(exec, stream));
            check(round, "replayed from a graph");
          }
          finish(stream);
          barrier.arrive_and_wait();  // no rank frees while a peer's replay may still wait on it
          CARAVAN_HIP_CHECK(hipGraphExecDestroy(exec));
          for (void* p :
               {static_cast<void*>(in), static_cast<void*>(out), static_cast<void*>(scratch), static_cast<void*>(ref)})
            (void)hipFree(p);
        });
      }
      team.heap().release_to(mark);
    }
}

// The AllGather alone, every variant mixed call after call: each call gathers fresh random
// shards (written in place after wait_shard_free) into a buffer whose other rows were poisoned
// first, and every row must be exact. Three rounds of a sequence that puts each variant after
// every other.
TEST(Overlap, AllGatherAloneEveryVariantCallAfterCall) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  const int world = team_size();
  GpuTeam team(first_devices(world), 32 << 20);
  constexpr long kRows = 96, kCols = 256;  // 48 KiB a shard: within the ll protocol's limit
  AllGather op(team, kRows, kCols, /*splits=*/2);
  ASSERT_TRUE(op.low_latency());
  EXPECT_EQ(op.automatic(), AllGatherVariant::ll);  // the rule: ll wherever it is available
  using V = AllGatherVariant;
  const V sequence[] = {V::ce_push, V::ce_pull, V::sm,      V::ll,      V::ce_pull, V::ce_pull, V::sm, V::ce_push,
                        V::ll,      V::ll,      V::ce_push, V::ce_push, V::sm,      V::sm,      V::ll, V::ce_pull};
  const std::uint64_t seed = fresh_seed();
  const long all_rows = kRows * world;
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
    float* ref = device_alloc<float>(static_cast<std::size_t>(all_rows * kCols));
    bf16* mine = op.shard(r) - r * kRows * kCols;  // this rank's gathered buffer
    barrier.arrive_and_wait();                     // no allocation while a peer's call may wait on this rank
    for (int round = 0; round < 3; ++round)
      for (std::size_t i = 0; i < std::size(sequence); ++i) {
        const std::uint64_t call_seed = seed + 1000 * (static_cast<std::uint64_t>(round) * 100 + i);
        op.wait_shard_free(r, stream);
        fill_random(op.shard(r), kRows, kCols, kCols, call_seed, r * kRows, 0, 1.0f, stream);
        poison(mine, static_cast<std::size_t>(r * kRows * kCols), stream);
        poison(op.shard(r) + kRows * kCols, static_cast<std::size_t>((world - 1 - r) * kRows * kCols), stream);
        const bf16* out = op.run(r, sequence[i], stream);
        EXPECT_EQ(out, mine);
        fill_random(ref, all_rows, kCols, kCols, call_seed, 0, 0, 1.0f, stream);
        const double err = relative_error(out, all_rows, kCols, ref, stream);
        if (err != 0)
          throw Error(Errc::internal, "round " + std::to_string(round) + ", call " + std::to_string(i) + " (" +
                                          std::string(to_string(sequence[i])) + "): gathered rows differ, error " +
                                          std::to_string(err));
      }
    barrier.arrive_and_wait();  // every rank done before any frees
    (void)hipFree(ref);
  });
}

void reduce_scatter_every_variant_call_after_call();
void reduce_scatter_calls(long rows, long cols, std::uint64_t heap_bytes, const std::vector<ReduceScatterVariant>& sequence,
                          int repeats, int expected_rounds);

// The ReduceScatter alone, every variant mixed call after call: each call sums fresh random
// inputs (a different one per rank) into an output poisoned first, against a float32 sum of the
// same values. Three rounds of a sequence that puts each variant after every other; ll in both
// line formats (CARAVAN_LL128_MIN_BYTES: 0 keeps 16-byte lines; 128-byte lines on NVIDIA).
TEST(Overlap, ReduceScatterAloneEveryVariantCallAfterCall) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  for (const char* ll128_from : {"0", "8"}) {
    SCOPED_TRACE(std::string("CARAVAN_LL128_MIN_BYTES=") + ll128_from);
    settings::ScopedOverride from("CARAVAN_LL128_MIN_BYTES", ll128_from);
    reduce_scatter_every_variant_call_after_call();
  }
}

// CARAVAN_OVERLAP_GPU_SM_RS_MAX_BYTES bounds GEMM+ReduceScatter's sm-pull and sm-push buffers
// only: below the partial, the GEMM+ReduceScatter refuses them naming the setting, while the
// ReduceScatter alone of the same partial still offers sm (and the call-after-call sequence above
// passes with it, every variant against float32, with the limit at 1 KiB).
TEST(Overlap, ReduceScatterAloneTakesSmAboveTheGemmLimit) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  settings::ScopedOverride limit("CARAVAN_OVERLAP_GPU_SM_RS_MAX_BYTES", "1K");
  const int world = team_size();
  {
    GpuTeam team(first_devices(world), 32 << 20);
    constexpr long kRows = 64, kCols = 256;
    ReduceScatter alone(team, kRows, kCols);
    EXPECT_TRUE(alone.sm());
    GemmReduceScatter with_gemm(team, kRows * world, 64, kCols);
    EXPECT_FALSE(with_gemm.pull());
    EXPECT_FALSE(with_gemm.push());
    // Real buffers (the null checks come first): the refusal comes before any of them is used.
    CARAVAN_HIP_CHECK(hipSetDevice(first_devices(world).front()));
    bf16* a = device_alloc<bf16>(static_cast<std::size_t>(kRows) * world * 64);
    bf16* b = device_alloc<bf16>(64 * static_cast<std::size_t>(kCols));
    bf16* out = device_alloc<bf16>(static_cast<std::size_t>(kRows) * kCols);
    try {
      with_gemm.run(0, a, b, out, GemmRsVariant::sm_push, nullptr);
      ADD_FAILURE() << "sm-push accepted above CARAVAN_OVERLAP_GPU_SM_RS_MAX_BYTES";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("CARAVAN_OVERLAP_GPU_SM_RS_MAX_BYTES"), std::string::npos) << e.what();
    }
    for (bf16* p : {a, b, out}) CARAVAN_HIP_CHECK(hipFree(p));
  }
  reduce_scatter_every_variant_call_after_call();
}

void reduce_scatter_every_variant_call_after_call() {
  using V = ReduceScatterVariant;
  // 32 KiB out per rank: within the ll protocol's limit, and one grid pass of sm's kernel, so
  // one round whatever CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES says.
  reduce_scatter_calls(64, 256, 32 << 20,
                       {V::ce_push, V::sm, V::ll, V::sm, V::sm, V::ce_push, V::ce_push, V::ll, V::ll, V::ce_push}, 3, 1);
}

// sm in rounds: 2000 x 1024 out per rank (4096000 bytes to each peer, 256000 16-byte vectors:
// four passes of sm's 128 x 512 threads, the last a partial one). CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES
// = 1M asks for 3 rounds, which take 2 passes each, so 2 rounds (each thread loops within a
// round); 512K asks for 7, at most one a pass, so 4; 0 for one. Call after call, against the
// float32 sum, with ce-push between.
TEST(Overlap, ReduceScatterAloneSmInRoundsMatchesTheSum) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  using V = ReduceScatterVariant;
  for (const auto& [round_bytes, rounds] : {std::pair{"1M", 2}, std::pair{"512K", 4}, std::pair{"0", 1}}) {
    SCOPED_TRACE(std::string("CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES=") + round_bytes);
    settings::ScopedOverride setting("CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES", round_bytes);
    const std::uint64_t in_bytes = 2000ull * 1024 * sizeof(bf16) * static_cast<std::uint64_t>(team_size());
    reduce_scatter_calls(2000, 1024, 3 * in_bytes + (16 << 20), {V::sm, V::sm, V::ce_push, V::sm}, 1, rounds);
  }
}

void reduce_scatter_calls(long rows, long cols, std::uint64_t heap_bytes, const std::vector<ReduceScatterVariant>& sequence,
                          int repeats, int expected_rounds) {
  const int world = team_size();
  GpuTeam team(first_devices(world), heap_bytes);
  const long kRows = rows, kCols = cols;
  ReduceScatter op(team, kRows, kCols);
  ASSERT_TRUE(op.sm());
  EXPECT_EQ(op.sm_rounds(), expected_rounds);
  EXPECT_EQ(op.automatic(), ReduceScatterVariant::sm);  // the rule: sm wherever it is available
  if (std::find(sequence.begin(), sequence.end(), ReduceScatterVariant::ll) != sequence.end()) {
    ASSERT_TRUE(op.low_latency());
  }
  const std::uint64_t seed = fresh_seed();
  const long all_rows = kRows * world;
  const auto rank_seed = [&](std::uint64_t call_seed, int q) {
    return call_seed + 7919 * static_cast<std::uint64_t>(q + 1);
  };
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
    const auto mine = static_cast<std::size_t>(kRows * kCols);
    bf16* in = device_alloc<bf16>(static_cast<std::size_t>(all_rows * kCols));
    bf16* out = device_alloc<bf16>(mine);
    float* part = device_alloc<float>(mine);
    float* ref = device_alloc<float>(mine);
    std::vector<float> host_part(mine), host_sum(mine);
    barrier.arrive_and_wait();  // no allocation while a peer's call may wait on this rank
    for (int round = 0; round < repeats; ++round)
      for (std::size_t i = 0; i < sequence.size(); ++i) {
        const std::uint64_t call_seed = seed + 1000 * (static_cast<std::uint64_t>(round) * 100 + i);
        fill_random(in, all_rows, kCols, kCols, rank_seed(call_seed, r), 0, 0, 1.0f, stream);
        poison(out, mine, stream);
        op.run(r, in, out, sequence[i], stream);
        // The reference: every rank's values at this rank's rows, summed here in float32.
        std::fill(host_sum.begin(), host_sum.end(), 0.0f);
        for (int q = 0; q < world; ++q) {
          fill_random(part, kRows, kCols, kCols, rank_seed(call_seed, q), r * kRows, 0, 1.0f, stream);
          finish(stream);
          CARAVAN_HIP_CHECK(hipMemcpy(host_part.data(), part, mine * sizeof(float), hipMemcpyDefault));
          for (std::size_t j = 0; j < mine; ++j) host_sum[j] += host_part[j];
        }
        CARAVAN_HIP_CHECK(hipMemcpy(ref, host_sum.data(), mine * sizeof(float), hipMemcpyDefault));
        const double err = relative_error(out, kRows, kCols, ref, stream);
        if (!(err < 1e-2))
          throw Error(Errc::internal, "round " + std::to_string(round) + ", call " + std::to_string(i) + " (" +
                                          std::string(to_string(sequence[i])) + "): relative error " +
                                          std::to_string(err));
      }
    barrier.arrive_and_wait();  // every rank done before any frees
    for (void* p : {static_cast<void*>(in), static_cast<void*>(out), static_cast<void*>(part), static_cast<void*>(ref)})
      (void)hipFree(p);
  });
}

// The All-Scatter alone, both variants mixed call after call: each rank writes a fresh random
// column block into its own output, whose other columns were poisoned first, and every rank's
// output must then hold every block exactly.
TEST(Overlap, AllScatterAloneCallAfterCall) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  const int world = team_size();
  GpuTeam team(first_devices(world), 32 << 20);
  constexpr long kRows = 96, kColsPerRank = 64;
  AllScatter op(team, kRows, kColsPerRank, /*chunks=*/3);
  EXPECT_EQ(op.automatic(), AllScatterVariant::sm);  // the rule: sm up to 64 MiB of output
  const long cols = kColsPerRank * world;
  const std::uint64_t seed = fresh_seed();
  run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
    float* ref = device_alloc<float>(static_cast<std::size_t>(kRows * cols));
    bf16* output = op.block(r) - r * kColsPerRank;
    barrier.arrive_and_wait();  // no allocation while a peer's call may wait on this rank
    using V = AllScatterVariant;
    const V sequence[] = {V::ce_push, V::sm, V::sm, V::ce_push, V::ce_push, V::sm};
    for (int call = 0; call < 12; ++call) {
      const std::uint64_t call_seed = seed + 1000 * static_cast<std::uint64_t>(call);
      poison(output, static_cast<std::size_t>(kRows * cols), stream);
      fill_random(op.block(r), kRows, kColsPerRank, cols, call_seed, 0, r * kColsPerRank, 1.0f, stream);
      const V variant = sequence[call % std::size(sequence)];
      const bf16* got = op.run(r, variant, stream);
      EXPECT_EQ(got, output);
      fill_random(ref, kRows, cols, cols, call_seed, 0, 0, 1.0f, stream);
      const double err = relative_error(got, kRows, cols, ref, stream);
      if (err != 0)
        throw Error(Errc::internal, "call " + std::to_string(call) + " (" + std::string(to_string(variant)) +
                                        "): scattered blocks differ, error " + std::to_string(err));
    }
    barrier.arrive_and_wait();  // every rank done before any frees
    (void)hipFree(ref);
  });
}

TEST(Overlap, RejectsShapesThatDoNotDivide) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  GpuTeam team(first_devices(2), 16 << 20);
  EXPECT_THROW(AllGatherGemm(team, 101, 64, 64), Error);
  EXPECT_THROW(AllGatherGemm(team, 128, 64, 64, 0), Error);
  EXPECT_THROW(GemmReduceScatter(team, 3, 64, 64), Error);
  EXPECT_THROW(GemmAllScatter(team, 64, 64, 63, 2), Error);
  EXPECT_THROW(LowLatencyAllGather(team, 12), Error);
  EXPECT_THROW(LowLatencyAllGather(team, kLlMaxBytes + 8), Error);
  EXPECT_THROW(AllGatherGemm(team, 128, 60, 64), Error);  // k not a multiple of 8
  EXPECT_THROW(GemmReduceScatter(team, 128, 64, 36), Error);  // n not a multiple of 8
  EXPECT_THROW(AllGather(team, 0, 64), Error);
  EXPECT_THROW(AllGather(team, 5, 64, 2), Error);  // rows per rank not a multiple of splits
  EXPECT_THROW(AllGatherGemm(team, 128, 64, -8), Error);
  AllGatherGemm gather_only(team, 128, 64, 0);
  try {
    gather_only.run(0, nullptr, nullptr, AgGemmVariant::ce_push, nullptr);
    ADD_FAILURE() << "run() of an AllGatherGemm built without a GEMM was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("call gather()"), std::string::npos) << e.what();
  }
  try {
    gather_only.gather(0, AgGemmVariant::ce_push_runs, nullptr);
    ADD_FAILURE() << "gather() with a GEMM schedule was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ce-push runs"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ReduceScatter(team, 0, 64), Error);
  EXPECT_THROW(ReduceScatter(team, 8, 60), Error);   // cols not a multiple of 8
  EXPECT_THROW(AllScatter(team, 64, 60), Error);     // cols per rank not a multiple of 8
  EXPECT_THROW(AllScatter(team, 64, 64, 3), Error);  // chunks do not divide rows
  const auto expect_refused = [](const std::function<void()>& call, const std::string& reason) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected a refusal naming \"" << reason << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  };
  GemmReduceScatter reduce_only(team, 128, 0, 64);
  expect_refused([&] { reduce_only.run(0, nullptr, nullptr, nullptr, GemmRsVariant::ce_bulk, nullptr); },
                 "call reduce_scatter()");
  expect_refused([&] { reduce_only.reduce_scatter(0, nullptr, nullptr, GemmRsVariant::sm_pull, nullptr); }, "sm-pull");
  GemmAllScatter scatter_only(team, 64, 0, 128, 1);
  expect_refused([&] { scatter_only.run(0, nullptr, nullptr, GemmAsVariant::ce_bulk, nullptr); }, "call scatter()");
  ReduceScatter large(team, 1024, 1024);  // 2 MiB out per rank: above the ll protocol's limit
  expect_refused([&] { large.run(0, nullptr, nullptr, ReduceScatterVariant::ll, nullptr); }, "ll needs an output");
}

// The transformer layer (kernels/gpu/tp_layer.h) with grouped-query attention over several
// query blocks, against the float32 reference layer of the CPU backend, for several
// communication variants, twice in a row with fresh inputs (the second call runs on the epochs
// and buffers the first left).
void check_layer_variants(const std::vector<int>& devices, DeviceSharing sharing,
                          const std::vector<LayerCommunication>& variants) {
  const int world = static_cast<int>(devices.size());
  const kernels::TpLayerShape shape{.tokens = 64L * world, .hidden = 256, .heads = 8, .ffn = 128L * world, .kv_heads = 4};
  const long rows = shape.tokens / world;
  const std::uint64_t seed = fresh_seed();
  const kernels::TpLayerWeights weights = kernels::random_layer_weights(shape, seed);
  std::vector<std::vector<kernels::Bf16>> inputs;
  std::vector<std::vector<float>> refs;
  for (int call = 0; call < 2; ++call) {
    std::mt19937_64 rng(seed + 1 + static_cast<std::uint64_t>(call));
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    inputs.emplace_back(static_cast<std::size_t>(shape.tokens * shape.hidden));
    for (auto& v : inputs.back()) v = kernels::Bf16::from_float(dist(rng));
    refs.push_back(kernels::reference_layer(shape, weights, inputs.back(), world));
  }
  GpuTeam team(devices, 2 * GpuTpLayer::heap_bytes(shape, world), sharing);
  for (const auto& variant : variants) {
    SCOPED_TRACE(variant.name);
    const std::uint64_t mark = team.heap().mark();
    {
      GpuTpLayer layer(team, shape, variant, /*query_block=*/48);
      layer.set_weights(weights);
      run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
        // Inputs and references in place before any rank starts (see the run-ahead test above).
        const std::size_t mine = static_cast<std::size_t>(rows * shape.hidden);
        bf16 *x[2], *y = device_alloc<bf16>(mine);
        float* ref[2];
        for (int call = 0; call < 2; ++call) {
          x[call] = device_alloc<bf16>(mine);
          ref[call] = device_alloc<float>(mine);
          CARAVAN_HIP_CHECK(hipMemcpy(x[call], inputs[static_cast<std::size_t>(call)].data() + r * mine, mine * sizeof(bf16),
                                      hipMemcpyDefault));
          CARAVAN_HIP_CHECK(hipMemcpy(ref[call], refs[static_cast<std::size_t>(call)].data() + r * mine, mine * sizeof(float),
                                      hipMemcpyDefault));
        }
        barrier.arrive_and_wait();
        for (int call = 0; call < 2; ++call) {
          poison(y, mine, stream);
          layer.run(r, x[call], y, stream);
          const kernels::LayerTimes times = layer.step_times(r);
          for (double t : times) EXPECT_GE(t, 0.0);
          const double err = relative_error(y, rows, shape.hidden, ref[call], stream);
          if (!(err < 1e-2))
            throw Error(Errc::internal, variant.name + " call " + std::to_string(call) + ": relative error " + std::to_string(err));
        }
        barrier.arrive_and_wait();  // every rank done before any frees (a free waits for the device)
        for (int call = 0; call < 2; ++call) (void)hipFree(x[call]), (void)hipFree(ref[call]);
        (void)hipFree(y);
      });
      // The hang report of a finished layer: every rank past its last step.
      const std::string progress = layer.describe_progress();
      for (int r = 0; r < world; ++r)
        EXPECT_NE(progress.find("rank " + std::to_string(r) + ": its last run is done"), std::string::npos) << progress;
      for (const char* op : {"qkv AllGather+GEMM:\nrank 0: ", "out GEMM+ReduceScatter:\nrank 0: ",
                             "up/gate AllGather+GEMM:\nrank 0: ", "down GEMM+ReduceScatter:\nrank 0: "})
        EXPECT_NE(progress.find(op), std::string::npos) << progress;
    }
    team.heap().release_to(mark);
  }
}

TEST(GpuTpLayer, MatchesTheFloat32ReferenceLayer) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  check_layer_variants(
      first_devices(team_size()), DeviceSharing::refused,
      {{.name = "ce-push", .all_gather = AgGemmVariant::ce_push, .reduce_scatter = GemmRsVariant::ce_push},
       {.name = "ce-pull 2 lanes, x2 parts 2 lanes",
        .all_gather = AgGemmVariant::ce_pull,
        .all_gather_lanes = 2,
        .reduce_scatter = GemmRsVariant::ce_push,
        .reduce_scatter_lanes = 2,
        .reduce_scatter_splits = 2},
       {.name = "ll-bulk, ce-bulk", .all_gather = AgGemmVariant::ll_bulk, .reduce_scatter = GemmRsVariant::ce_bulk},
       {.name = "ce-push, blas-scatter x2 parts 2 lanes",
        .all_gather = AgGemmVariant::ce_push,
        .reduce_scatter = GemmRsVariant::blas_scatter,
        .reduce_scatter_lanes = 2,
        .reduce_scatter_splits = 2},
       {.name = "ce-push 2 lanes, ce-ring x4/x2 parts 2 lanes",  // the out projection in 4 parts
        .all_gather = AgGemmVariant::ce_push,
        .all_gather_lanes = 2,
        .reduce_scatter = GemmRsVariant::ce_ring,
        .reduce_scatter_lanes = 2,
        .reduce_scatter_splits = 2,
        .out_proj_splits = 4}});
}

// GpuTpLayer::heap_bytes is enough for one layer of any variant: the variants whose inboxes are
// taken last, where they fit (tile-scatter, blas-scatter), run in a heap of exactly that size. The
// shape's partials are small enough that every GEMM+ReduceScatter also takes sm-pull's two
// (at most GemmReduceScatter::pull_max_bytes()), which the estimate once left out: the second
// operation's inboxes then found no room (outputs are not checked here;
// MatchesTheFloat32ReferenceLayer checks them).
TEST(GpuTpLayer, HeapBytesHoldEveryVariant) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  const int world = team_size();
  const kernels::TpLayerShape shape{
      .tokens = 1024L * world, .hidden = 1024, .heads = 8, .ffn = 256L * world, .kv_heads = 4};
  ASSERT_LE(static_cast<std::uint64_t>(shape.tokens * shape.hidden) * sizeof(bf16), GemmReduceScatter::pull_max_bytes());
  const long rows = shape.tokens / world;
  const kernels::TpLayerWeights weights = kernels::random_layer_weights(shape, fresh_seed());
  GpuTeam team(first_devices(world), GpuTpLayer::heap_bytes(shape, world));
  const std::vector<LayerCommunication> variants = {
      {.name = "tile-scatter x4", .reduce_scatter = GemmRsVariant::tile_scatter, .reduce_scatter_splits = 4},
      {.name = "blas-scatter x2 2 lanes",
       .reduce_scatter = GemmRsVariant::blas_scatter,
       .reduce_scatter_lanes = 2,
       .reduce_scatter_splits = 2}};
  for (const auto& variant : variants) {
    SCOPED_TRACE(variant.name);
    const std::uint64_t mark = team.heap().mark();
    {
      GpuTpLayer layer(team, shape, variant, /*query_block=*/256);
      layer.set_weights(weights);
      run_ranks(team, [&](int r, hipStream_t stream, RankBarrier& barrier) {
        const std::size_t mine = static_cast<std::size_t>(rows * shape.hidden);
        bf16* x = device_alloc<bf16>(mine);
        bf16* y = device_alloc<bf16>(mine);
        CARAVAN_HIP_CHECK(hipMemsetAsync(x, 0, mine * sizeof(bf16), stream));
        CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
        barrier.arrive_and_wait();
        layer.run(r, x, y, stream);  // throws if the variant found no room
        CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
        barrier.arrive_and_wait();
        CARAVAN_HIP_CHECK(hipFree(x));
        CARAVAN_HIP_CHECK(hipFree(y));
      });
    }
    team.heap().release_to(mark);
  }
}

TEST(GpuTpLayer, RejectsShapesTheWorldDoesNotDivide) {
  CARAVAN_REQUIRE_GPU_COUNT(2);
  GpuTeam team(first_devices(2), 64 << 20);
  LayerCommunication comm{.name = "ce-push"};
  EXPECT_THROW(GpuTpLayer(team, {.tokens = 128, .hidden = 256, .heads = 8, .ffn = 256, .kv_heads = 3}, comm), Error);
  EXPECT_THROW(GpuTpLayer(team, {.tokens = 127, .hidden = 256, .heads = 8, .ffn = 256}, comm), Error);
  EXPECT_THROW(GpuTpLayer(team, {.tokens = 128, .hidden = 256, .heads = 8, .ffn = 24}, comm), Error);
  EXPECT_THROW(GpuTpLayer(team, {.tokens = 128, .hidden = 256, .heads = 8, .ffn = 256}, comm, 0), Error);
}

// ---- Ranks sharing one GPU (DeviceSharing::allowed) ----
// The copy-engine schedules' logic at four ranks on a machine with a single GPU: a rank's "peer"
// copies are copies within the GPU, its flags and waits the same stream operations as between
// GPUs. Only variants that never wait on SMs for a peer run here (see DeviceSharing): copy
// engines, stream flag operations, cuBLAS and the layer's own kernels. Outputs are checked as
// on separate GPUs; times mean nothing here. With four ranks the GEMM+ReduceScatter ring has
// middle steps, whose pushes leave from the slot (two GPUs have none).
std::vector<int> one_gpu_four_ranks() { return {0, 0, 0, 0}; }

TEST(SharedGpu, HeapPutsSeveralRanksOnOneGpuOnlyWhenAllowed) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  try {
    GpuSymmetricHeap refused({0, 0}, 1 << 20);
    FAIL() << "a device listed twice was accepted by default";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("listed twice"), std::string::npos) << e.what();
  }
  GpuSymmetricHeap heap({0, 0, 0}, 1 << 20, DeviceSharing::allowed);
  ASSERT_EQ(heap.world(), 3);
  const SymmetricRegion a = heap.allocate(1000);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(heap.device(r), 0);
  EXPECT_NE(heap.at(a, 0), heap.at(a, 1)) << "each rank has a heap of its own on the shared GPU";
  EXPECT_NE(heap.at(a, 1), heap.at(a, 2));
}

TEST(SharedGpu, AllGatherGemmCopyEngineSchedulesAtFourRanks) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  GpuTeam team(one_gpu_four_ranks(), 64 << 20, DeviceSharing::allowed);
  check_all_gather_gemm_calls(team, {{AgGemmVariant::ce_pull, 1},
                                     {AgGemmVariant::ce_push, 2},
                                     {AgGemmVariant::ce_bulk, 1},
                                     {AgGemmVariant::ce_push_runs, 1},
                                     {AgGemmVariant::ce_push, 1},
                                     {AgGemmVariant::ce_pull_runs, 2},
                                     {AgGemmVariant::ce_pull, 2},
                                     {AgGemmVariant::ce_push_runs, 2},
                                     {AgGemmVariant::ce_pull_runs, 1}});
}

// Four ranks queue sixteen calls each without waiting, mixing the copy-engine schedules on two
// streams (the run-ahead test above, with the variants a shared GPU can run).
TEST(SharedGpu, AllGatherGemmRanksRunAheadThroughCopyEngineSchedulesAtFourRanks) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  run_ahead_through_mixed_variants(/*two_streams=*/true, /*low_latency=*/false,
                                   {{AgGemmVariant::ce_push, 1},
                                    {AgGemmVariant::ce_pull, 2},
                                    {AgGemmVariant::ce_push_runs, 2},
                                    {AgGemmVariant::ce_bulk, 1},
                                    {AgGemmVariant::ce_pull_runs, 1},
                                    {AgGemmVariant::ce_push, 2},
                                    {AgGemmVariant::ce_pull, 1}},
                                   one_gpu_four_ranks(), DeviceSharing::allowed);
}

TEST(SharedGpu, GemmReduceScatterCopyEngineVariantsAtFourRanks) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  GpuTeam team(one_gpu_four_ranks(), 64 << 20, DeviceSharing::allowed);
  check_gemm_reduce_scatter_calls(team, {{GemmRsVariant::ce_push, 1},
                                         {GemmRsVariant::ce_ring, 2},
                                         {GemmRsVariant::ce_bulk, 1},
                                         {GemmRsVariant::ce_push, 2},
                                         {GemmRsVariant::ce_ring, 1},
                                         {GemmRsVariant::ce_ring, 1},
                                         {GemmRsVariant::ce_push, 1},
                                         {GemmRsVariant::ce_ring, 2},
                                         {GemmRsVariant::ce_bulk, 1}});
}

TEST(SharedGpu, GemmReduceScatterRingPushesGroupsAtFourRanks) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  GpuTeam team(one_gpu_four_ranks(), 64 << 20, DeviceSharing::allowed);
  check_ring_push_groups(team);
}

TEST(SharedGpu, LayerWithCopyEngineSchedulesAtFourRanks) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  check_layer_variants(
      one_gpu_four_ranks(), DeviceSharing::allowed,
      {{.name = "ce-push", .all_gather = AgGemmVariant::ce_push, .reduce_scatter = GemmRsVariant::ce_push},
       {.name = "ce-pull 2 lanes, x2 parts 2 lanes",
        .all_gather = AgGemmVariant::ce_pull,
        .all_gather_lanes = 2,
        .reduce_scatter = GemmRsVariant::ce_push,
        .reduce_scatter_lanes = 2,
        .reduce_scatter_splits = 2},
       {.name = "ce-push 2 lanes, ce-ring x4/x2 parts 2 lanes",
        .all_gather = AgGemmVariant::ce_push,
        .all_gather_lanes = 2,
        .reduce_scatter = GemmRsVariant::ce_ring,
        .reduce_scatter_lanes = 2,
        .reduce_scatter_splits = 2,
        .out_proj_splits = 4}});
}

}  // namespace
}  // namespace caravan::gpu
