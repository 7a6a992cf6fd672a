// The GPU symmetric heap across processes (GpuSymmetricHeap::join_node): every rank of the job is
// one process driving one GPU (its local rank), run by `caravan run -n N` (ctest labels gpu and
// multiproc). Checked: each rank sees every peer's heap through its IPC mapping (host copies of
// fresh per-rank patterns), device-side system-scope atomics from every rank land on one rank
// exactly, and 10^5 flag hand-offs between pairs of GPUs lose or duplicate none. Skips with the
// reason where there is no job or fewer GPUs than ranks on the node.
#include "kernels/gpu/gpu_heap.h"
#include "kernels/gpu/overlap.h"
#include "tests/dma/dma_test_util.h"
#include "tests/gpu/flag_handoff.h"
#include "tests/net/remote_copy_util.h"
#include "tests/net/net_test_util.h"

#include <caravan/copy.h>
#include <caravan/platform.h>
#include <caravan/settings.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <limits>
#include <thread>

namespace caravan::gpu {
namespace {

using namespace std::chrono_literals;
using caravan::test::JobTest;

// Waits for `stream` without hanging. A flag never raised ends the process: with a GPU stuck on
// a wait, the teardown (a device free waits for the device) would hang instead of failing, so
// the rank aborts and `caravan run` reports it.
void finish(hipStream_t stream, std::chrono::seconds limit = 30s) {
  hipEvent_t done;
  CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&done, hipEventDisableTiming));
  CARAVAN_HIP_CHECK(hipEventRecord(done, stream));
  const auto deadline = std::chrono::steady_clock::now() + limit;
  hipError_t status;
  while ((status = hipEventQuery(done)) == hipErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "GPU work did not finish within %lld s (a flag never raised?): aborting this rank\n",
                   static_cast<long long>(limit.count()));
      std::abort();
    }
    std::this_thread::sleep_for(50us);
  }
  (void)hipEventDestroy(done);
  CARAVAN_HIP_CHECK(status);
}

// Why this machine cannot run the cross-process tests (empty when it can): every rank of the
// node needs a GPU of its own, and at least `min_ranks` ranks on the node.
std::string missing_gpus(Runtime& rt, int min_ranks) {
  const GpuProbe probe = probe_gpus();
  const int on_node = static_cast<int>(rt.ranks_on_node(rt.node()).size());
  if (probe.device_count >= on_node && on_node >= min_ranks) return {};
  return "needs " + std::to_string(min_ranks) + "+ ranks on the node and a GPU for each (" + std::to_string(on_node) +
         " ranks); " + (probe.device_count == 0 ? probe.reason : "this machine has " + std::to_string(probe.device_count));
}

class GpuHeapAcrossProcesses : public JobTest {
 protected:
  void SetUp() override {
    JobTest::SetUp();
    if (IsSkipped()) return;
    if (const std::string why = missing_gpus(rt(), 1); !why.empty()) GTEST_SKIP() << why;
    local_ = rt().rank_info(rank()).local_rank;
    heap_ = GpuSymmetricHeap::join_node(local_, 16 << 20);
    CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&stream_, hipStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_) (void)hipStreamDestroy(stream_);
    if (heap_) heap_->leave();  // collective: every rank unmaps, then frees (join_node failures are collective too)
    heap_.reset();
  }
  int local_ = 0;
  std::unique_ptr<GpuSymmetricHeap> heap_;
  hipStream_t stream_ = nullptr;
};

TEST_F(GpuHeapAcrossProcesses, EveryRankSeesEveryPeersHeap) {
  const int world = heap_->world();
  EXPECT_EQ(heap_->own_rank(), local_);
  const SymmetricRegion region = heap_->allocate(1 << 20);
  // A pattern per rank, fresh per run (rank 0's clock picks it for everyone).
  const unsigned mine = static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count() & 0x7F);
  const unsigned salt = caravan::test::all_gather(rt(), mine)[0];
  const auto value = [&](int r) { return static_cast<unsigned char>((salt + 17 * r + 1) & 0xFF); };
  CARAVAN_HIP_CHECK(hipMemset(heap_->at(region, local_), value(local_), region.bytes));
  CARAVAN_HIP_CHECK(hipDeviceSynchronize());
  rt().barrier(30s);
  std::vector<unsigned char> host(region.bytes);
  for (int p = 0; p < world; ++p) {
    const unsigned char want = value(p);
    std::fill(host.begin(), host.end(), static_cast<unsigned char>(~want));
    CARAVAN_HIP_CHECK(hipMemcpy(host.data(), heap_->at(region, p), region.bytes, hipMemcpyDefault));
    EXPECT_EQ(std::count(host.begin(), host.end(), want), static_cast<long>(region.bytes)) << "local rank " << p << "'s heap";
  }
}

TEST_F(GpuHeapAcrossProcesses, RemoteAtomicsFromEveryRankLandExactly) {
  const int world = heap_->world();
  const SymmetricRegion counter = heap_->allocate(sizeof(std::uint64_t));
  rt().barrier(30s);
  constexpr int kThreads = 1024, kPerThread = 100;
  test::launch_remote_adds(heap_->view(local_), heap_->at<std::uint64_t>(counter, local_), 0, kThreads, kPerThread, stream_);
  finish(stream_);
  rt().barrier(30s);
  if (local_ == 0) {
    std::uint64_t total = 0;
    CARAVAN_HIP_CHECK(hipMemcpy(&total, heap_->at<std::uint64_t>(counter, 0), sizeof(total), hipMemcpyDefault));
    EXPECT_EQ(total, static_cast<std::uint64_t>(world) * kThreads * kPerThread);
  }
}

TEST_F(GpuHeapAcrossProcesses, FlagHandOffsBetweenPairsLoseAndDuplicateNone) {
  const int world = heap_->world();
  const SymmetricRegion slots = heap_->allocate(16);
  test::HandoffResult* result = nullptr;
  CARAVAN_HIP_CHECK(hipMalloc(reinterpret_cast<void**>(&result), sizeof(*result)));
  CARAVAN_HIP_CHECK(hipMemset(result, 0xFF, sizeof(*result)));  // poisoned: the kernel must write it
  CARAVAN_HIP_CHECK(hipDeviceSynchronize());
  rt().barrier(30s);
  const int peer = local_ ^ 1;
  constexpr std::uint64_t kRounds = 100'000;
  if (peer < world) {
    test::launch_handoff(heap_->view(local_), heap_->at<std::uint64_t>(slots, local_), peer, local_ % 2 == 0, kRounds, result,
                         stream_);
    finish(stream_, 120s);
    test::HandoffResult host;
    CARAVAN_HIP_CHECK(hipMemcpy(&host, result, sizeof(host), hipMemcpyDefault));
    EXPECT_EQ(host.wrong_payload, 0u);
    EXPECT_EQ(host.flag_skips, 0u);
  }
  (void)hipFree(result);
}

TEST_F(GpuHeapAcrossProcesses, DmaCopiesIntoAPeerRaiseLandingFlagsInItsHeap) {
  // Each rank copies its GPU memory into the next rank's (one xgmi hop into the destination
  // mapped through IPC, CARAVAN_DMA_IPC_DIRECT) with landing flags in the destination rank's
  // heap, as this process maps it: the copy engine's stream writes them behind each tile.
  if (world() < 2) GTEST_SKIP() << "needs 2+ ranks";
  const int target = (rank() + 1) % world(), writer = (rank() + world() - 1) % world();
  const auto fbm = MemoryId{static_cast<std::uint32_t>(rt().node()), static_cast<std::uint32_t>(rank()), MemoryKind::fbm,
                            static_cast<std::uint32_t>(local_)};
  const std::uint64_t seed = caravan::test::fresh_seed(rt());
  FieldSpace fields({{"a", 8}, {"b", 8}});
  // 512 MiB and a partial tile: a one-hop copy's tiles hold a full-speed request of its channel
  // (tens of MiB for a peer link), so the copy must be large to land in several.
  auto space = Rect::from_extents({(1 << 25) + 3});
  auto src = Instance::create(fbm, space, fields, Layout::parse("F,x"));
  auto dst = Instance::create(fbm, space, fields, Layout::parse("F,x"));
  caravan::test::write_pattern(src, seed + static_cast<std::uint64_t>(rank()));
  caravan::test::poison(dst);
  auto dsts = caravan::test::share(rt(), dst);
  const Instance& peer_dst = dsts[static_cast<std::size_t>(target)];
  const CopyTiling tiling = copy_tiling(src, peer_dst);
  // Each rank's copy is cut by the measured throughput of its own link, so the ranks' tile
  // counts may differ (seen on 4 x H200: 6 against 9 or 10). The flags are sized by the largest
  // (the heap stays symmetric), and each rank checks its writer's count. Gathered before any
  // rank may stop on the check below, so that none waits for it.
  const auto tile_counts = caravan::test::all_gather(rt(), static_cast<std::uint64_t>(tiling.tiles.size()));
  ASSERT_GE(tiling.tiles.size(), 2u) << "the copy should land in several tiles";
  const std::uint64_t most = *std::max_element(tile_counts.begin(), tile_counts.end());
  if (rank() == 0 && most != *std::min_element(tile_counts.begin(), tile_counts.end()))
    std::fprintf(stderr, "note: the ranks' copies have different tile counts: %s\n", fmt::format("{}", fmt::join(tile_counts, " ")).c_str());
  const SymmetricRegion flags = heap_->allocate(most * sizeof(std::uint64_t));
  rt().barrier(30s);  // every heap allocated and zeroed before any copy writes into one
  const std::uint64_t epoch = 0x5eed0000u + static_cast<std::uint64_t>(rank()) + 1;
  CopyReport report;
  Event done = copy(src, peer_dst,
                    {.report = &report,
                     .signal = {.flags = heap_->at<std::uint64_t>(flags, target), .value = epoch, .tiles = tiling.tiles.size()}});
  ASSERT_TRUE(done.wait_for(60s));
  EXPECT_EQ(report.route, fmt::format("{} -[xgmi]-> {}", fbm.to_string(), peer_dst.memory().to_string()));
  rt().barrier(30s);
  // My flags were written by my writer's copy, one per tile of it, each with its epoch; the rest
  // of the region stays as allocated.
  std::vector<std::uint64_t> seen(most);
  CARAVAN_HIP_CHECK(hipMemcpy(seen.data(), heap_->at<std::uint64_t>(flags, rank()), seen.size() * sizeof(std::uint64_t),
                              hipMemcpyDeviceToHost));
  const std::uint64_t written = tile_counts[static_cast<std::size_t>(writer)];
  const auto expected = [&](std::size_t t) { return t < written ? 0x5eed0000u + static_cast<std::uint64_t>(writer) + 1 : 0; };
  for (std::size_t t = 0; t < seen.size(); ++t)
    EXPECT_EQ(seen[t], expected(t)) << "flag " << t << " (the writer's copy has " << written << " tiles)";
  EXPECT_EQ(caravan::test::count_mismatches(dst, seed + static_cast<std::uint64_t>(writer)), 0u);
  rt().barrier(30s);
}

TEST_F(GpuHeapAcrossProcesses, RanksAskingForDifferentSizesAreTold) {
  // Every rank calls join_node again; rank 0 asks for a different size.
  try {
    auto other = GpuSymmetricHeap::join_node(local_, rank() == 0 ? (8 << 20) : (4 << 20));
    ADD_FAILURE() << "join_node accepted different sizes";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("same size"), std::string::npos) << e.what();
  }
}

TEST_F(GpuHeapAcrossProcesses, RanksSeeingDifferentProtocolSettingsAreTold) {
  // Rank 0 sees another round size for the SM-driven ReduceScatter: the operations' flag words
  // would count rounds differently, so the heap is refused, on every rank, naming the setting.
  settings::ScopedOverride rounds("CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES", rank() == 0 ? "8M" : "4M");
  try {
    auto other = GpuSymmetricHeap::join_node(local_, 4 << 20);
    if (world() > 1) ADD_FAILURE() << "join_node accepted ranks with different CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES";
    other->leave();
  } catch (const Error& e) {
    EXPECT_GT(world(), 1) << e.what();
    EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES"), std::string::npos) << e.what();
  }
}

// The overlapped operations with one process per rank (GpuTeam's cross-process form), every
// variant call after call against a float32 reference on fresh random data, outputs poisoned.
class OverlapAcrossProcesses : public JobTest {
 protected:
  void SetUp() override {
    JobTest::SetUp();
    if (IsSkipped()) return;
    if (const std::string why = missing_gpus(rt(), 2); !why.empty()) GTEST_SKIP() << why;
    local_ = rt().rank_info(rank()).local_rank;
    team_ = std::make_unique<GpuTeam>(GpuSymmetricHeap::join_node(local_, 64 << 20));
    CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&stream_, hipStreamNonBlocking));
    CARAVAN_HIP_CHECK(hipMalloc(reinterpret_cast<void**>(&sums_), sizeof(ErrorSums)));
  }
  void TearDown() override {
    free_buffers();  // also after a failed expectation: every rank ended its last call before its barrier
    if (stream_) (void)hipStreamDestroy(stream_);
    if (sums_) (void)hipFree(sums_);
    if (team_) team_->leave();  // collective: every rank unmaps, then frees
    team_.reset();
  }
  template <class T>
  T* alloc(std::size_t count) {
    void* p = nullptr;
    CARAVAN_HIP_CHECK(hipMalloc(&p, count * sizeof(T)));
    buffers_.push_back(p);
    return static_cast<T*>(p);
  }
  void free_buffers() {
    for (void* p : buffers_) (void)hipFree(p);
    buffers_.clear();
  }
  double relative_error(const bf16* out, long rows, long cols, const float* ref) {
    compare(out, rows, cols, cols, ref, cols, sums_, stream_);
    finish(stream_);
    ErrorSums host;
    CARAVAN_HIP_CHECK(hipMemcpy(&host, sums_, sizeof(host), hipMemcpyDefault));
    if (host.nonfinite > 0) return std::numeric_limits<double>::infinity();
    return host.ref2 > 0 ? std::sqrt(host.diff2 / host.ref2) : 0.0;
  }
  std::uint64_t fresh_seed() {
    const auto mine = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    return caravan::test::all_gather(rt(), mine)[0] * 0x9E3779B97F4A7C15ull;  // the same on every rank
  }
  int local_ = 0;
  std::unique_ptr<GpuTeam> team_;
  hipStream_t stream_ = nullptr;
  ErrorSums* sums_ = nullptr;
  std::vector<void*> buffers_;
};

// Processes that build different shapes (or operations in another order) would have their peers
// write into the wrong buffers and flags: every rank's construction fails, naming both.
TEST_F(OverlapAcrossProcesses, RanksBuildingDifferentShapesAreTold) {
  const int world = team_->world();
  const long m = 64L * world, k = 128, n = local_ == 0 ? 192 : 256;
  CARAVAN_EXPECT_ERROR(AllGatherGemm(*team_, m, k, n), Errc::invalid_argument,
                       "every rank must build the same operations, with the same shapes, in the same order");
}

TEST_F(OverlapAcrossProcesses, AllGatherGemmEveryVariantMatchesTheReference) {
  const int world = team_->world(), r = local_;
  const long m = 64L * world, k = 128, n = 192, rows = m / world;
  AllGatherGemm op(*team_, m, k, n);
  EXPECT_THROW(op.run((r + 1) % world, nullptr, nullptr, AgGemmVariant::ce_push, stream_), Error);  // a peer's rank
  bf16 *b = alloc<bf16>(static_cast<std::size_t>(k) * n), *c = alloc<bf16>(static_cast<std::size_t>(m) * n);
  float *a32 = alloc<float>(static_cast<std::size_t>(m) * k), *b32 = alloc<float>(static_cast<std::size_t>(k) * n),
        *ref = alloc<float>(static_cast<std::size_t>(m) * n);
  rt().barrier(60s);  // every rank allocated before any calls
  const std::uint64_t seed = fresh_seed();
  const std::vector<std::pair<AgGemmVariant, int>> runs = {
      {AgGemmVariant::ce_pull, 1}, {AgGemmVariant::ce_push, 2}, {AgGemmVariant::ce_bulk, 1},
      {AgGemmVariant::ce_push_runs, 1}, {AgGemmVariant::ce_pull_runs, 2}, {AgGemmVariant::ll_bulk, 1},
      {AgGemmVariant::tile_push, 1}, {AgGemmVariant::tile_pull, 1}, {AgGemmVariant::sm_push, 1},
      {AgGemmVariant::sm_bulk, 1},   {AgGemmVariant::ce_pull, 1}};
  for (std::size_t call = 0; call < runs.size(); ++call) {
    const std::uint64_t sa = seed + 100 * call, sb = seed + 100 * call + 1 + static_cast<std::uint64_t>(r);
    op.wait_shard_free(r, stream_);
    fill_random(op.shard(r), rows, k, k, sa, r * rows, 0, 1.0f, stream_);
    fill_random(b, k, n, n, sb, 0, 0, 1.0f, stream_);
    CARAVAN_HIP_CHECK(hipMemsetAsync(c, 0xFF, static_cast<std::size_t>(m) * n * sizeof(bf16), stream_));
    op.run(r, b, c, runs[call].first, stream_, runs[call].second);
    finish(stream_);
    rt().barrier(60s);  // every rank's call done before any launches its reference GEMM
    fill_random(a32, m, k, k, sa, 0, 0, 1.0f, stream_);
    fill_random(b32, k, n, n, sb, 0, 0, 1.0f, stream_);
    team_->blas(r).gemm_reference(stream_, m, n, k, a32, k, b32, n, ref, n);
    const double err = relative_error(c, m, n, ref);
    EXPECT_LT(err, 1e-2) << to_string(runs[call].first) << " lanes " << runs[call].second << " call " << call;
    rt().barrier(60s);
  }
  free_buffers();
}

TEST_F(OverlapAcrossProcesses, GemmReduceScatterEveryVariantMatchesTheReference) {
  const int world = team_->world(), r = local_;
  const long m = 64L * world, k = 160, n = 256, rows = m / world, kk = k * world;
  GemmReduceScatter op(*team_, m, k, n, 2);
  ASSERT_TRUE(op.low_latency());
  ASSERT_TRUE(op.pull());
  ASSERT_TRUE(op.scatter());
  bf16 *a = alloc<bf16>(static_cast<std::size_t>(m) * k), *b = alloc<bf16>(static_cast<std::size_t>(k) * n),
       *out = alloc<bf16>(static_cast<std::size_t>(rows) * n);
  float *a32 = alloc<float>(static_cast<std::size_t>(rows) * kk), *b32 = alloc<float>(static_cast<std::size_t>(kk) * n),
        *ref = alloc<float>(static_cast<std::size_t>(rows) * n);
  rt().barrier(60s);
  const std::uint64_t seed = fresh_seed();
  const std::vector<std::pair<GemmRsVariant, int>> runs = {
      {GemmRsVariant::ce_push, 1},      {GemmRsVariant::ll_bulk, 1},      {GemmRsVariant::ce_bulk, 1},
      {GemmRsVariant::ce_push, 2},      {GemmRsVariant::sm_pull, 1},      {GemmRsVariant::sm_pull, 1},
      {GemmRsVariant::ce_push, 1},      {GemmRsVariant::sm_pull, 1},      {GemmRsVariant::sm_push, 1},
      {GemmRsVariant::sm_push, 1},      {GemmRsVariant::ce_bulk, 1},      {GemmRsVariant::sm_push, 1},
      {GemmRsVariant::sm_pull, 1},      {GemmRsVariant::sm_push, 1},      {GemmRsVariant::tile_push, 1},
      {GemmRsVariant::ce_push, 2},      {GemmRsVariant::tile_push, 1},    {GemmRsVariant::tile_scatter, 1},
      {GemmRsVariant::tile_scatter, 1}, {GemmRsVariant::ce_push, 1},      {GemmRsVariant::tile_scatter, 1},
      {GemmRsVariant::blas_scatter, 2}, {GemmRsVariant::blas_scatter, 1}, {GemmRsVariant::tile_scatter, 1},
      {GemmRsVariant::ce_ring, 1},      {GemmRsVariant::ce_ring, 2},      {GemmRsVariant::ce_push, 1},
      {GemmRsVariant::ce_ring, 2}};
  for (std::size_t call = 0; call < runs.size(); ++call) {
    const std::uint64_t sa = seed + 100 * call, sb = seed + 100 * call + 50;
    fill_random(a, m, k, k, sa + static_cast<std::uint64_t>(r), 0, 0, 1.0f, stream_);
    fill_random(b, k, n, n, sb + static_cast<std::uint64_t>(r), 0, 0, 1.0f, stream_);
    CARAVAN_HIP_CHECK(hipMemsetAsync(out, 0xFF, static_cast<std::size_t>(rows) * n * sizeof(bf16), stream_));
    op.run(r, a, b, out, runs[call].first, stream_, runs[call].second);
    finish(stream_);
    rt().barrier(60s);
    // The reference: rows r of sum_q A_q B_q = [A_0 | A_1 | ...] (rows r) x [B_0; B_1; ...].
    for (int q = 0; q < world; ++q) {
      fill_random(a32 + q * k, rows, k, kk, sa + static_cast<std::uint64_t>(q), r * rows, 0, 1.0f, stream_);
      fill_random(b32 + q * k * n, k, n, n, sb + static_cast<std::uint64_t>(q), 0, 0, 1.0f, stream_);
    }
    team_->blas(r).gemm_reference(stream_, rows, n, kk, a32, kk, b32, n, ref, n);
    const double err = relative_error(out, rows, n, ref);
    EXPECT_LT(err, 1e-2) << to_string(runs[call].first) << " lanes " << runs[call].second << " call " << call;
    rt().barrier(60s);
  }
  free_buffers();
}

}  // namespace
}  // namespace caravan::gpu
