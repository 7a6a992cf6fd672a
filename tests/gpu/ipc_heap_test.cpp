// The GPU symmetric heap across processes (GpuSymmetricHeap::join_node): every rank of the job is
// one process driving one GPU (its local rank), run by `caravan run -n N` (ctest labels gpu and
// multiproc). Checked: each rank sees every peer's heap through its IPC mapping (host copies of
// fresh per-rank patterns), device-side system-scope atomics from every rank land on one rank
// exactly, and 10^5 flag hand-offs between pairs of GPUs lose or duplicate none. Skips with the
// reason where there is no job or fewer GPUs than ranks on the node.
#include "kernels/gpu/gpu_heap.h"
#include "tests/gpu/flag_handoff.h"
#include "tests/net/net_test_util.h"

#include <caravan/platform.h>

#include <chrono>
#include <thread>

namespace caravan::gpu {
namespace {

using namespace std::chrono_literals;
using caravan::test::JobTest;

// Waits for `stream` without hanging: a flag never raised fails the test.
void finish(hipStream_t stream, std::chrono::seconds limit = 30s) {
  hipEvent_t done;
  CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&done, hipEventDisableTiming));
  CARAVAN_HIP_CHECK(hipEventRecord(done, stream));
  const auto deadline = std::chrono::steady_clock::now() + limit;
  hipError_t status;
  while ((status = hipEventQuery(done)) == hipErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) throw Error(Errc::timeout, "GPU work did not finish (a flag never raised?)");
    std::this_thread::sleep_for(50us);
  }
  (void)hipEventDestroy(done);
  CARAVAN_HIP_CHECK(status);
}

class GpuHeapAcrossProcesses : public JobTest {
 protected:
  void SetUp() override {
    JobTest::SetUp();
    if (IsSkipped()) return;
    const GpuProbe probe = probe_gpus();
    const int on_node = static_cast<int>(rt().ranks_on_node(rt().node()).size());
    if (probe.device_count < on_node)
      GTEST_SKIP() << "needs a GPU per rank of the node (" << on_node << "); "
                   << (probe.device_count == 0 ? probe.reason : "this machine has " + std::to_string(probe.device_count));
    local_ = rt().rank_info(rank()).local_rank;
    heap_ = GpuSymmetricHeap::join_node(local_, 16 << 20);
    CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&stream_, hipStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_) (void)hipStreamDestroy(stream_);
    if (heap_) rt().barrier(30s);  // no rank unmaps or frees while a peer still uses its heap
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

}  // namespace
}  // namespace caravan::gpu
