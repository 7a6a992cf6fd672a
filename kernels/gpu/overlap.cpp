#include "kernels/gpu/overlap.h"

#include "runtime/net/network.h"
#include "runtime/runtime_impl.h"

#include <caravan/error.h>
#include <caravan/runtime.h>
#include <caravan/settings.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <exception>
#include <limits>
#include <string_view>
#include <thread>
#include <type_traits>
#include <chrono>

namespace caravan::gpu {
namespace {

constexpr std::uint64_t kFlagBytes = sizeof(std::uint64_t);

void require(bool ok, std::string_view what) {
  if (!ok) throw Error(Errc::invalid_argument, std::string(what));
}
// The same with the message made only on failure: calls check their arguments on every call,
// before their GEMM is queued, so the check must cost nothing when it passes.
template <class Message>
requires std::is_invocable_r_v<std::string, Message>
void require(bool ok, Message&& what) {
  if (!ok) throw Error(Errc::invalid_argument, what());
}

// The checks every operation makes of its shape: positive sizes (n may be 0 where `n_optional`:
// no GEMM), `splits` >= 1, and m divisible into world x splits row blocks.
void require_shape(const char* op, long m, long k, long n, int world, int splits, bool n_optional = false) {
  require(m > 0 && k > 0 && (n > 0 || (n_optional && n == 0)), [&] {
    return fmt::format("{}: m, k must be positive and n {}, got {}, {}, {}", op,
                       n_optional ? "positive or 0" : "positive", m, k, n);
  });
  require(k % 8 == 0 && n % 8 == 0, [&] {
    return fmt::format("{}: k = {} and n = {} must be multiples of 8 (16-byte rows, so chunks stay aligned)", op, k, n);
  });
  require(splits >= 1, [&] { return fmt::format("{}: splits must be >= 1, got {}", op, splits); });
  require(m % (static_cast<long>(world) * splits) == 0, [&] {
    return fmt::format("{}: m = {} must be a multiple of world x splits = {} x {}", op, m, world, splits);
  });
}

// Checks a call's arguments before it takes an epoch (see overlap.h).
void require_call(const GpuTeam& team, const char* op, int rank, int lanes) {
  const int world = team.world();
  require(rank >= 0 && rank < world,
          [&] { return fmt::format("{}::run: rank {} outside 0..{}", op, rank, world - 1); });
  require(team.drives(rank), [&] { return fmt::format("{}::run: rank {} is driven by another process", op, rank); });
  require(lanes == 1 || lanes == 2, [&] { return fmt::format("{}::run: lanes must be 1 or 2, got {}", op, lanes); });
}

// The flag words of an operation: `groups` arrays of `count` 64-bit flags per rank.
struct FlagArrays {
  std::uint64_t* base;
  long count;
  std::uint64_t* at(int group, long index) const { return base + group * count + index; }
};

void wait_flag(hipStream_t stream, std::uint64_t* flag, std::uint64_t epoch) {
  CARAVAN_HIP_CHECK(hipStreamWaitValue64(stream, flag, epoch, hipStreamWaitValueGte));
}
void write_flag(hipStream_t stream, std::uint64_t* flag, std::uint64_t epoch) {
  CARAVAN_HIP_CHECK(hipStreamWriteValue64(stream, flag, epoch, 0));
}

// The compute streams of one call: lane 0 is the caller's stream, lane 1 the team's second
// stream, which starts after `start` and is joined back into lane 0 by finish().
class Lanes {
 public:
  Lanes(GpuTeam& team, int rank, RankSync& sync, hipStream_t stream, int lanes);
  hipStream_t stream(int chunk) const { return streams_[chunk % count_]; }
  Blas& blas(int chunk) const { return *blas_[chunk % count_]; }
  void finish();

 private:
  RankSync& sync_;
  int count_;
  hipStream_t streams_[2];
  Blas* blas_[2];
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Owns its streams and handles, so a constructor that fails half-way leaks nothing.
struct GpuTeam::Rank {
  int device = 0;
  int sm_count = 0;
  hipStream_t comm = nullptr, lane = nullptr;
  std::unique_ptr<Blas> blas, lane_blas;
  PaceGroup pace_group;

  ~Rank() {
    (void)hipSetDevice(device);
    blas.reset();
    lane_blas.reset();
    if (comm) (void)hipStreamDestroy(comm);
    if (lane) (void)hipStreamDestroy(lane);
  }
};

GpuTeam::GpuTeam(std::vector<int> devices, std::uint64_t heap_bytes_per_rank, DeviceSharing sharing)
    : heap_(std::make_unique<GpuSymmetricHeap>(std::move(devices), heap_bytes_per_rank, sharing)) {
  ranks_.resize(static_cast<std::size_t>(heap_->world()));
  for (int r = 0; r < heap_->world(); ++r) add_rank(r);
}

GpuTeam::GpuTeam(std::unique_ptr<GpuSymmetricHeap> cross_process_heap) : heap_(std::move(cross_process_heap)) {
  if (!heap_ || heap_->own_rank() < 0)
    throw Error(Errc::invalid_argument,
                "GpuTeam: the cross-process form needs a heap from GpuSymmetricHeap::join_node");
  ranks_.resize(static_cast<std::size_t>(heap_->world()));
  add_rank(heap_->own_rank());
}

bool GpuTeam::drives(int rank) const {
  return rank >= 0 && rank < world() && ranks_[static_cast<std::size_t>(rank)] != nullptr;
}

std::vector<int> GpuTeam::driven_ranks() const {
  std::vector<int> out;
  for (int r = 0; r < world(); ++r)
    if (drives(r)) out.push_back(r);
  return out;
}

void GpuTeam::construction_done(const std::string& signature) {
  if (heap_->own_rank() < 0 || !Runtime::is_running()) return;
  net::Network* network = RuntimeImpl::current()->network();
  if (!network) return;  // one rank alone: nobody to disagree with
  const std::string mine = fmt::format("{} (heap at {} bytes)", signature, heap_->used());
  const auto parts =
      network->allgather(std::as_bytes(std::span<const char>(mine.data(), mine.size())),
                         std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::duration<double>(settings::get_double("CARAVAN_OVERLAP_TIMEOUT_S"))),
                         "an overlap operation's construction");
  for (std::size_t r = 0; r < parts.size(); ++r) {
    const std::string theirs(reinterpret_cast<const char*>(parts[r].data()), parts[r].size());
    if (theirs != mine)
      throw Error(Errc::invalid_argument,
                  fmt::format("rank {} built {}, but rank {} built {}: every rank must build the same operations, "
                              "with the same shapes, in the same order",
                              heap_->own_rank(), mine, r, theirs));
  }
}

void GpuTeam::leave() { heap_->leave(); }

void GpuTeam::add_rank(int r) {
  {
    auto rank = std::make_unique<Rank>();
    rank->device = heap_->device(r);
    CARAVAN_HIP_CHECK(hipSetDevice(rank->device));
    hipDeviceProp_t properties;
    CARAVAN_HIP_CHECK(hipGetDeviceProperties(&properties, rank->device));
    rank->sm_count = properties.multiProcessorCount;
    // The communication stream gets the highest priority: its work is tiny (copy-engine
    // launches and flag operations) and others wait on it.
    int least = 0, greatest = 0;
    CARAVAN_HIP_CHECK(hipDeviceGetStreamPriorityRange(&least, &greatest));
    CARAVAN_HIP_CHECK(hipStreamCreateWithPriority(&rank->comm, hipStreamNonBlocking, greatest));
    CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&rank->lane, hipStreamNonBlocking));
    rank->blas = std::make_unique<Blas>();
    rank->lane_blas = std::make_unique<Blas>(rank->lane);  // lane 1's GEMMs run on its own stream
    ranks_[static_cast<std::size_t>(r)] = std::move(rank);
  }
}

GpuTeam::~GpuTeam() = default;

namespace {
void require_driven(const GpuTeam& team, int rank) {
  if (!team.drives(rank))
    throw Error(Errc::invalid_argument,
                fmt::format("GpuTeam: rank {} is {}", rank,
                            rank >= 0 && rank < team.world() ? "driven by another process" : "outside the team"));
}
}  // namespace

hipStream_t GpuTeam::comm_stream(int rank) const {
  require_driven(*this, rank);
  return ranks_[static_cast<std::size_t>(rank)]->comm;
}
int GpuTeam::sm_count(int rank) const {
  require_driven(*this, rank);
  return ranks_[static_cast<std::size_t>(rank)]->sm_count;
}
hipStream_t GpuTeam::lane_stream(int rank) const {
  require_driven(*this, rank);
  return ranks_[static_cast<std::size_t>(rank)]->lane;
}
Blas& GpuTeam::blas(int rank, int lane) {
  require_driven(*this, rank);
  auto& r = *ranks_[static_cast<std::size_t>(rank)];
  return lane == 0 ? *r.blas : *r.lane_blas;
}
PaceGroup& GpuTeam::pace_group(int rank) {
  require_driven(*this, rank);
  return ranks_[static_cast<std::size_t>(rank)]->pace_group;
}
void GpuTeam::use(int rank) const { CARAVAN_HIP_CHECK(hipSetDevice(device(rank))); }

RankSync::RankSync(int chunk_events, bool pace, bool pulls_only, PaceGroup* group)
    : pace_(pace), pulls_only_(pulls_only), group_(pace ? group : nullptr) {
  chunk.resize(static_cast<std::size_t>(chunk_events));
  try {
    for (hipEvent_t* e : {&start, &comm_done, &lane_done, &call_done_, &call_end_})
      CARAVAN_HIP_CHECK(hipEventCreateWithFlags(e, hipEventDisableTiming));
    for (auto& e : chunk) CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&e, hipEventDisableTiming));
  } catch (...) {
    for (hipEvent_t e : {start, comm_done, lane_done, call_done_, call_end_})
      if (e) (void)hipEventDestroy(e);
    for (hipEvent_t e : chunk)
      if (e) (void)hipEventDestroy(e);
    throw;
  }
  if (group_) {
    std::lock_guard lock(group_->mutex_);
    group_->members_.push_back(this);
  }
}

std::uint64_t RankSync::enter(hipStream_t stream, PaceAs how) {
  // Pulls queued behind other copies that wait on flags hang (docs/overlap.md, "Run-ahead"): a
  // pull waits for the calls before it, and the call after a pull waits for the pull; on this
  // GPU, whatever operation made those calls.
  std::vector<hipEvent_t> waits;
  if (pace_ && epoch > 0 && (!pulls_only_ || how != PaceAs::run_ahead || last_paced_)) waits.push_back(call_end_);
  if (group_) {
    std::lock_guard lock(group_->mutex_);
    if (how == PaceAs::copy_engine_pull) {
      for (const RankSync* other : group_->members_)
        if (other != this && other->epoch > 0) waits.push_back(other->call_end_);
    } else if (group_->last_pull_ && group_->last_pull_ != this) {
      waits.push_back(group_->last_pull_->call_end_);
    }
  }
  if (!waits.empty()) {
    // Each call recorded call_end_ when it was queued (leave()): only queries here, so a caller
    // that waits between calls anyway pays one event query per wait.
    const auto limit = std::chrono::duration<double>(settings::get_double("CARAVAN_OVERLAP_TIMEOUT_S"));
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (hipEvent_t event : waits) {
      for (;;) {
        const hipError_t status = hipEventQuery(event);
        if (status == hipSuccess) break;
        if (status != hipErrorNotReady) CARAVAN_HIP_CHECK(status);
        if (std::chrono::steady_clock::now() > deadline)
          throw Error(Errc::timeout,
                      fmt::format("overlapped GPU operation: call {} of this rank waited more than {} s for {} "
                                  "(CARAVAN_OVERLAP_TIMEOUT_S; a peer missing or behind?)",
                                  epoch + 1, limit.count(),
                                  event == call_end_ ? "its operation's previous call"
                                                     : "another operation's call on this GPU (do all ranks "
                                                       "call the team's operations in the same order?)"));
        std::this_thread::sleep_for(std::chrono::microseconds(10));
      }
    }
  }
  order_after_last_call(stream);
  last_stream_ = stream;
  last_paced_ = how != PaceAs::run_ahead;
  if (group_) {
    // Every call waits for the last pull (above), so from here only this call can be one.
    std::lock_guard lock(group_->mutex_);
    group_->last_pull_ = how == PaceAs::copy_engine_pull ? this : nullptr;
  }
  return ++epoch;
}

// Nothing is recorded per call: a call on the stream of the last one is ordered by the stream
// itself, and only a switch of streams records where the last stream stands (which includes the
// last call) and makes the new stream wait for it.
void RankSync::order_after_last_call(hipStream_t stream) {
  if (epoch == 0 || stream == last_stream_) return;
  CARAVAN_HIP_CHECK(hipEventRecord(call_done_, last_stream_));
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, call_done_, 0));
}

void RankSync::leave(hipStream_t stream) {
  if (pace_) CARAVAN_HIP_CHECK(hipEventRecord(call_end_, stream));
}

RankSync::~RankSync() {
  if (group_) {
    std::lock_guard lock(group_->mutex_);
    std::erase(group_->members_, this);
    if (group_->last_pull_ == this) group_->last_pull_ = nullptr;
  }
  (void)hipEventDestroy(call_done_);
  (void)hipEventDestroy(call_end_);
  (void)hipEventDestroy(start);
  (void)hipEventDestroy(comm_done);
  (void)hipEventDestroy(lane_done);
  for (auto e : chunk) (void)hipEventDestroy(e);
}

namespace {
// Calls RankSync::leave when a call's enqueueing ends, on every return path (not when it throws:
// then the call is broken anyway and pacing must not wait on a half-queued call).
class CallScope {
 public:
  CallScope(RankSync& sync, hipStream_t stream)
      : sync_(sync), stream_(stream), exceptions_(std::uncaught_exceptions()) {}
  ~CallScope() {
    if (std::uncaught_exceptions() == exceptions_) {
      try {
        sync_.leave(stream_);
      } catch (...) {
        // a failed record only weakens pacing; the next call's enter() reports device errors
      }
    }
  }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

 private:
  RankSync& sync_;
  hipStream_t stream_;
  int exceptions_;
};

Lanes::Lanes(GpuTeam& team, int rank, RankSync& sync, hipStream_t stream, int lanes)
    : sync_(sync),
      count_(lanes),
      streams_{stream, team.lane_stream(rank)},
      blas_{&team.blas(rank, 0), &team.blas(rank, 1)} {
  // Lane 1 starts with everything enqueued on the caller's stream so far (the caller records
  // sync.start first).
  if (count_ == 2) CARAVAN_HIP_CHECK(hipStreamWaitEvent(streams_[1], sync_.start, 0));
}

void Lanes::finish() {
  if (count_ == 2) {
    CARAVAN_HIP_CHECK(hipEventRecord(sync_.lane_done, streams_[1]));
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(streams_[0], sync_.lane_done, 0));
  }
}

// The checks of set_trace and set_ring_trace: null, or a start event and world x splits events
// in each list.
void require_trace(const char* where, const ChunkTrace* trace, int world, int splits) {
  const auto chunks = static_cast<std::size_t>(world) * static_cast<std::size_t>(splits);
  require(trace == nullptr || (trace->start != nullptr && trace->ready.size() == chunks &&
                               trace->gemm_done.size() == chunks && trace->pushed.size() == chunks),
          [&] {
            return fmt::format("{}: a trace needs a start event and world x splits ({}) events in each of ready, "
                               "gemm_done and pushed",
                               where, chunks);
          });
}

// Runs every GEMM shape an operation will use once on every rank, with nothing else in flight,
// and waits. Why: the CUDA runtime loads a kernel's module on its first launch (lazy loading,
// the default), and loading waits for the whole device to go idle. Inside an operation a device
// can hold a stream wait on a peer's flag that the peer raises only after its own host thread
// gets past the same kind of first launch: both would wait forever. So no first launch may
// happen inside an operation. `shapes` are {rows, cols, depth, ldc}; reduce_elements > 0 also
// loads the ReduceScatter reduction.
struct GemmShape {
  long m, n, k, ldc;
  float beta = 0.0f;  // 1: adds to C (the vendor BLAS may pick another kernel for it)
  bool add_elsewhere = false;  // Blas::gemm_add: D = A B + C, C and D distinct (cuBLASLt)
};
void warm_up(GpuTeam& team, const std::vector<GemmShape>& shapes, std::size_t reduce_elements = 0) {
  // Every shape runs twice, on buffers aligned as hipMalloc's and 16 bytes past that, the
  // loosest alignment rows of a multiple of 8 bf16 can have: gemm_add plans per pointer alignment
  // (blas.h), and that plan serves any pointers in an operation; cuBLAS's own choice for gemm
  // may depend on the alignment too.
  constexpr long kShift = 8;  // elements: 16 bytes
  long a_elems = 1, b_elems = 1, c_elems = 1, d_elems = 1;
  for (const auto& g : shapes) {
    a_elems = std::max(a_elems, g.m * g.k);
    b_elems = std::max(b_elems, g.k * g.n);
    c_elems = std::max(c_elems, g.m * g.ldc);
    if (g.add_elsewhere) d_elems = std::max(d_elems, g.m * g.ldc);
  }
  c_elems = std::max<long>(c_elems, static_cast<long>(reduce_elements));
  const auto bytes = [](long elems) { return static_cast<std::size_t>(elems + kShift) * sizeof(bf16); };
  for (int r : team.driven_ranks()) {
    team.use(r);
    preload_kernels();
    preload_sm_copy();
    void *a = nullptr, *b = nullptr, *c = nullptr, *d = nullptr;
    const auto free_all = [&] {
      for (void* p : {a, b, c, d})
        if (p) (void)hipFree(p);
    };
    try {
      CARAVAN_HIP_CHECK(hipMalloc(&a, bytes(a_elems)));
      CARAVAN_HIP_CHECK(hipMalloc(&b, bytes(b_elems)));
      CARAVAN_HIP_CHECK(hipMalloc(&c, bytes(c_elems)));
      CARAVAN_HIP_CHECK(hipMalloc(&d, bytes(d_elems)));
      hipStream_t streams[2] = {team.lane_stream(r), team.comm_stream(r)};
      // The fastest algorithm of each shape, timed once per GPU (CARAVAN_GPU_GEMM_TUNE): both
      // lanes' Blas and the calls below then run it.
      for (const auto& g : shapes) team.blas(r, 0).tune(g.m, g.n, g.k, g.k, g.n, g.ldc, g.beta, g.add_elsewhere);
      CARAVAN_HIP_CHECK(hipMemsetAsync(a, 0, bytes(a_elems), streams[0]));
      CARAVAN_HIP_CHECK(hipMemsetAsync(b, 0, bytes(b_elems), streams[0]));
      for (int lane = 0; lane < 2; ++lane)
        for (const auto& g : shapes) {
          bf16 *in = static_cast<bf16*>(a), *w = static_cast<bf16*>(b), *acc = static_cast<bf16*>(c);
          if (!g.add_elsewhere) {
            // Aligned as hipMalloc's (a tuned shape's plan) and 16 bytes past: cuBLAS may pick
            // another kernel for pointers of a row offset less aligned, and its first launch must
            // happen here too.
            for (long shift : {0L, kShift})
              team.blas(r, lane).gemm(streams[0], g.m, g.n, g.k, in + shift, g.k, w + shift, g.n, acc + shift, g.ldc,
                                      g.beta);
            continue;
          }
          bf16* sum = static_cast<bf16*>(d);
          for (long shift : {0L, kShift})
            team.blas(r, lane).gemm_add(streams[0], g.m, g.n, g.k, in + shift, g.k, w + shift, g.n, acc + shift, g.ldc,
                                        sum + shift, g.ldc);
        }
      if (reduce_elements > 0) {
        ReduceInputs in;
        in.count = 1;
        in.in[0] = static_cast<bf16*>(c);
        reduce_sum(static_cast<bf16*>(c), in, reduce_elements, streams[0]);
      }
      CARAVAN_HIP_CHECK(hipStreamSynchronize(streams[0]));
    } catch (...) {
      free_all();
      throw;
    }
    for (void* p : {a, b, c, d}) CARAVAN_HIP_CHECK(hipFree(p));
  }
}

}  // namespace

FlagReport::FlagReport(GpuTeam& team, SymmetricRegion flags, std::vector<std::string> groups, long per_group)
    : team_(team), flags_(flags), groups_(std::move(groups)), per_group_(per_group) {
  const int world = team.world();
  const std::size_t words = static_cast<std::size_t>(world) * groups_.size() * static_cast<std::size_t>(per_group);
  try {
    CARAVAN_HIP_CHECK(
        hipHostMalloc(reinterpret_cast<void**>(&words_), words * sizeof(std::uint64_t), hipHostMallocPortable));
    // One copy stream per rank of the team (a stuck copy then blocks only its own rank's report),
    // on the rank's GPU where this process drives it, else on the first GPU it drives.
    const int first_driven = team.driven_ranks().front();
    for (int r = 0; r < world; ++r) {
      const int on = team.drives(r) ? r : first_driven;
      team.use(on);
      devices_.push_back(team.device(on));
      streams_.push_back(nullptr);
      done_.push_back(nullptr);
      CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&streams_.back(), hipStreamNonBlocking));
      CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&done_.back(), hipEventDisableTiming));
    }
  } catch (...) {
    release();
    throw;
  }
}

FlagReport::~FlagReport() { release(); }

void FlagReport::release() noexcept {
  for (std::size_t r = 0; r < streams_.size(); ++r) {
    (void)hipSetDevice(devices_[r]);
    if (streams_[r]) (void)hipStreamDestroy(streams_[r]);
    if (done_[r]) (void)hipEventDestroy(done_[r]);
  }
  if (words_) (void)hipHostFree(words_);
}

std::string FlagReport::describe(const std::vector<std::unique_ptr<RankSync>>& sync) const {
  const int world = team_.world();
  const std::size_t per_rank = groups_.size() * static_cast<std::size_t>(per_group_);
  std::string out;
  int current = 0;
  (void)hipGetDevice(&current);
  for (int r = 0; r < world; ++r) {
    std::uint64_t* words = words_ + static_cast<std::size_t>(r) * per_rank;
    const auto* rank_sync = sync[static_cast<std::size_t>(r)].get();
    out += rank_sync ? fmt::format("rank {}: {} calls;", r, rank_sync->epoch)
                     : fmt::format("rank {} (another process):", r);
    const std::size_t d = static_cast<std::size_t>(r);
    hipError_t status = hipSetDevice(devices_[d]);
    if (status == hipSuccess)
      status = hipMemcpyAsync(words, team_.heap().at<std::uint64_t>(flags_, r), per_rank * sizeof(std::uint64_t),
                              hipMemcpyDefault, streams_[d]);
    if (status == hipSuccess) status = hipEventRecord(done_[d], streams_[d]);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (status == hipSuccess) {
      status = hipEventQuery(done_[d]);
      if (status != hipErrorNotReady) break;
      if (std::chrono::steady_clock::now() > deadline) break;
      status = hipSuccess;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (status != hipSuccess) {
      out += fmt::format(" flags unreadable ({})\n",
                         status == hipErrorNotReady ? "the copy did not finish in 2 s" : hipGetErrorName(status));
      continue;
    }
    for (std::size_t g = 0; g < groups_.size(); ++g)
      out += fmt::format(" {} [{}]", groups_[g], fmt::join(words + g * per_group_, words + (g + 1) * per_group_, " "));
    out += "\n";
  }
  (void)hipSetDevice(current);
  return out;
}

namespace {
// Events live on the device that was current when they were made: make one set per rank there.
std::vector<std::unique_ptr<RankSync>> make_sync(GpuTeam& team, int chunk_events, bool pace = true) {
  // Read only where pacing applies (the LL AllGather is never paced).
  const std::string mode = pace ? settings::get_string("CARAVAN_OVERLAP_GPU_PACE") : "none";
  const bool paced = mode != "none";
  std::vector<std::unique_ptr<RankSync>> sync(static_cast<std::size_t>(team.world()));
  for (int r : team.driven_ranks()) {
    team.use(r);
    sync[static_cast<std::size_t>(r)] =
        std::make_unique<RankSync>(chunk_events, paced, mode == "pulls", &team.pace_group(r));
  }
  return sync;
}
}  // namespace

// ---------------------------------------------------------------------------------------------
std::string_view to_string(AgGemmVariant v) {
  switch (v) {
    case AgGemmVariant::ce_pull: return "ce-pull";
    case AgGemmVariant::ce_push: return "ce-push";
    case AgGemmVariant::ce_pull_runs: return "ce-pull runs";
    case AgGemmVariant::ce_push_runs: return "ce-push runs";
    case AgGemmVariant::ll_bulk: return "ll-bulk";
    case AgGemmVariant::tile_pull: return "tile-pull";
    case AgGemmVariant::tile_push: return "tile-push";
    case AgGemmVariant::sm_push: return "sm-push";
    case AgGemmVariant::sm_bulk: return "sm-bulk";
    default: return "ce-bulk";
  }
}

// Flags of AllGatherGemm, per rank: ready[p] (p's shard is in its slot for this epoch),
// done[p] (p finished pulling my slot), landed[chunk] (that chunk of A is in my gathered
// buffer), freed[p] (p entered this epoch: its gathered buffer may receive this epoch's pushes).
enum AgFlags { ag_ready, ag_done, ag_landed, ag_freed, ag_groups };

// Pinned host memory and a stream per rank for describe_flags(), made at construction: an
// allocation or a blocking copy while a GPU waits on a flag can hang (docs/overlap.md).
AllGatherGemm::AllGatherGemm(GpuTeam& team, long m, long k, long n, int splits)
    : team_(team), m_(m), k_(k), n_(n), splits_(splits) {
  const int world = team.world();
  require_shape("AllGatherGemm", m, k, n, world, splits, /*n_optional=*/true);
  traces_.assign(static_cast<std::size_t>(world), nullptr);
  gathered_ = team.heap().allocate(static_cast<std::uint64_t>(m) * k * sizeof(bf16));
  flags_ = team.heap().allocate(ag_groups * static_cast<std::uint64_t>(world) * splits * kFlagBytes);
  const std::size_t shard_bytes = static_cast<std::size_t>(m / world) * k * sizeof(bf16);
  if (shard_bytes <= kLlMaxBytes && shard_bytes % 8 == 0) {
    ll_lines_ = team.heap().allocate(ll_buffer_bytes(world, shard_bytes));
    ll_state_ = team.heap().allocate(sizeof(LlState));
    ll_format_ = ll_format(shard_bytes);
  }
  sm_counters_ = team.heap().allocate(sm_push_counter_bytes(world, splits));  // zero, as sm_push needs
  sm_blocks_ = static_cast<int>(settings::get_int("CARAVAN_OVERLAP_GPU_COMM_BLOCKS"));
  sync_ = make_sync(team, 0);
  flag_report_ = std::make_unique<FlagReport>(
      team, flags_, std::vector<std::string>{"ready", "done", "landed", "freed"}, static_cast<long>(world) * splits);
  const long shard_rows = m / world;
  std::vector<GemmShape> shapes;
  if (n > 0) {
    shapes = {{m, n, k, n}, {shard_rows, n, k, n}, {shard_rows / splits, n, k, n}};
    for (int r = 2; r < world; ++r) shapes.push_back({r * shard_rows, n, k, n});  // the runs variants' peer runs
  }
  warm_up(team, shapes);  // with no shapes it still loads the exchange kernels
  // The tile variants launch row tiles in arrival order: own shard first, then pulls from
  // rank+1, rank+2, ... or pushes from rank-1, rank-2, ...
  const long tiles = flag_gemm_row_tiles(m);
  tile_orders_.assign(static_cast<std::size_t>(world), nullptr);
  try {
    build_tile_orders(tiles, shard_rows);
    team.construction_done(fmt::format("AllGatherGemm m={} k={} n={} splits={}", m, k, n, splits));
  } catch (...) {
    free_tile_orders();  // the destructor does not run for a constructor that throws
    throw;
  }
}

void AllGatherGemm::build_tile_orders(long tiles, long shard_rows) {
  GpuTeam& team = team_;
  const int world = team.world();
  const long m = m_;
  for (int r : team.driven_ranks()) {
    team.use(r);
    preload_flag_gemm();
    preload_sm_copy();
    std::vector<int> orders;
    for (bool push : {false, true}) {
      std::vector<int> order(static_cast<std::size_t>(tiles));
      for (long t = 0; t < tiles; ++t) order[static_cast<std::size_t>(t)] = static_cast<int>(t);
      // A tile can span shards: it is ready when the last of them arrives.
      const auto arrival = [&](long tile) {
        const long first = tile * flag_gemm_tile_rows(), last = std::min(first + flag_gemm_tile_rows(), m) - 1;
        int latest = 0;
        for (long src = first / shard_rows; src <= last / shard_rows; ++src) {
          const int q = static_cast<int>(src);
          latest = std::max(latest, push ? (r - q + world) % world : (q - r + world) % world);
        }
        return latest;
      };
      std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return arrival(x) < arrival(y); });
      orders.insert(orders.end(), order.begin(), order.end());
    }
    void* device_orders = nullptr;
    CARAVAN_HIP_CHECK(hipMalloc(&device_orders, orders.size() * sizeof(int)));
    tile_orders_[static_cast<std::size_t>(r)] = static_cast<int*>(device_orders);
    CARAVAN_HIP_CHECK(hipMemcpy(device_orders, orders.data(), orders.size() * sizeof(int), hipMemcpyDefault));
  }
}

void AllGatherGemm::free_tile_orders() noexcept {
  for (std::size_t r = 0; r < tile_orders_.size(); ++r)
    if (tile_orders_[r]) {
      (void)hipSetDevice(team_.device(static_cast<int>(r)));
      (void)hipFree(tile_orders_[r]);
      tile_orders_[r] = nullptr;
    }
}

AllGatherGemm::~AllGatherGemm() { free_tile_orders(); }

bf16* AllGatherGemm::shard(int rank) const {
  return team_.heap().at<bf16>(gathered_, rank) + static_cast<long>(rank) * (m_ / team_.world()) * k_;
}
const bf16* AllGatherGemm::gathered(int rank) const { return team_.heap().at<bf16>(gathered_, rank); }

void AllGatherGemm::wait_shard_free(int rank, hipStream_t stream) {
  require_call(team_, "AllGatherGemm", rank, 1);
  RankSync& s = *sync_[static_cast<std::size_t>(rank)];
  const std::uint64_t last = s.epoch;
  // This rank's own last call (its GEMM on the shard, its pushes of it) is done.
  s.order_after_last_call(stream);
  const FlagArrays my{team_.heap().at<std::uint64_t>(flags_, rank), static_cast<long>(team_.world()) * splits_};
  for (int step = 1; step < team_.world(); ++step)
    wait_flag(stream, my.at(ag_done, (rank + step) % team_.world()), last);
}

// The exchange of the copy-engine and sm_push variants, on the rank's communication stream
// (which starts at s.start, recorded by enqueue on the caller's stream): pushes (by copy engines, or by a
// few SM blocks with `sm`) or pulls, each chunk's landed flag raised as it lands. Records
// comm_done when this rank's part is queued.
void AllGatherGemm::enqueue_exchange(int rank, bool push, bool sm, std::uint64_t e) {
  const int world = team_.world();
  const long count = static_cast<long>(world) * splits_;
  const long shard_rows = m_ / world, chunk_rows = shard_rows / splits_;
  const std::size_t chunk_bytes = static_cast<std::size_t>(chunk_rows) * k_ * sizeof(bf16);
  RankSync& s = *sync_[static_cast<std::size_t>(rank)];
  hipStream_t comm = team_.comm_stream(rank);
  auto flags = [&](int r) { return FlagArrays{team_.heap().at<std::uint64_t>(flags_, r), count}; };
  auto rows_of = [&](int r, bf16* base) { return base + static_cast<long>(r) * shard_rows * k_; };
  bf16* mine = team_.heap().at<bf16>(gathered_, rank);
  const FlagArrays my = flags(rank);
  // The communication stream starts at s.start (the caller recorded it): the shard is written,
  // and this rank's earlier GEMMs no longer read the gathered buffer.
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(comm, s.start, 0));

  if (sm) {
    // As the copy-engine push, with the stores made by SMs: one kernel announces done (pushing
    // reads no peer's shard), waits for each peer's entry (freed) and raises the peer's landed
    // flags itself, on a few blocks: the GEMM runs beside it.
    SmPushFlags push_flags;
    push_flags.landed = my.at(ag_landed, 0);
    push_flags.freed = my.at(ag_freed, 0);
    push_flags.entry[0] = my.at(ag_done, rank);
    sm_push(team_.heap().view(rank), rows_of(rank, mine), rows_of(rank, mine), chunk_bytes, splits_, push_flags,
            team_.heap().at<std::uint32_t>(sm_counters_, rank), e, sm_blocks_, comm);
  } else if (push) {
    // Pushing reads nothing of the peers: they may reuse their shards (a later pull call waits
    // for this).
    for (int step = 1; step < world; ++step) write_flag(comm, flags((rank + step) % world).at(ag_done, rank), e);
    for (int step = 1; step < world; ++step) {
      const int peer = (rank + step) % world;
      wait_flag(comm, my.at(ag_freed, peer), e);  // the peer entered epoch e: its slot is free
      bf16* theirs = team_.heap().at<bf16>(gathered_, peer);
      for (int sp = 0; sp < splits_; ++sp) {
        const long offset = static_cast<long>(sp) * chunk_rows * k_;
        CARAVAN_HIP_CHECK(hipMemcpyAsync(rows_of(rank, theirs) + offset, rows_of(rank, mine) + offset, chunk_bytes,
                                         hipMemcpyDefault, comm));
        if (ChunkTrace* trace = traces_[static_cast<std::size_t>(rank)])
          CARAVAN_HIP_CHECK(hipEventRecord(trace->pushed[static_cast<std::size_t>((step - 1) * splits_ + sp)], comm));
        write_flag(comm, flags(peer).at(ag_landed, static_cast<long>(rank) * splits_ + sp), e);
      }
    }
  } else {
    for (int step = 1; step < world; ++step) wait_flag(comm, my.at(ag_done, (rank + step) % world), e - 1);
    for (int step = 1; step < world; ++step) write_flag(comm, flags((rank + step) % world).at(ag_ready, rank), e);
    for (int step = 1; step < world; ++step) {
      const int peer = (rank + step) % world;
      wait_flag(comm, my.at(ag_ready, peer), e);
      const bf16* theirs = team_.heap().at<bf16>(gathered_, peer);
      for (int sp = 0; sp < splits_; ++sp) {
        const long offset = static_cast<long>(sp) * chunk_rows * k_;
        CARAVAN_HIP_CHECK(hipMemcpyAsync(rows_of(peer, mine) + offset,
                                         rows_of(peer, const_cast<bf16*>(theirs)) + offset, chunk_bytes,
                                         hipMemcpyDefault, comm));
        write_flag(comm, my.at(ag_landed, static_cast<long>(peer) * splits_ + sp), e);
      }
      write_flag(comm, flags(peer).at(ag_done, rank), e);
    }
  }
  CARAVAN_HIP_CHECK(hipEventRecord(s.comm_done, comm));
}

void AllGatherGemm::set_trace(int rank, ChunkTrace* trace) {
  require_driven(team_, rank);
  require_trace("AllGatherGemm::set_trace", trace, team_.world(), splits_);
  traces_[static_cast<std::size_t>(rank)] = trace;
}

void AllGatherGemm::run(int rank, const bf16* b, bf16* c, AgGemmVariant variant, hipStream_t stream, int lanes) {
  require(n_ > 0, "AllGatherGemm::run: this object was built without a GEMM (n = 0): call gather()");
  enqueue(rank, b, c, variant, stream, lanes, /*with_gemm=*/true);
}

void AllGatherGemm::gather(int rank, AgGemmVariant variant, hipStream_t stream) {
  require(variant == AgGemmVariant::ce_push || variant == AgGemmVariant::ce_pull || variant == AgGemmVariant::sm_bulk ||
              variant == AgGemmVariant::ll_bulk,
          [&] {
            return fmt::format(
                "AllGatherGemm::gather: variant {} is a GEMM schedule; the AllGather alone runs ce-push, "
                "ce-pull, sm-bulk or ll-bulk",
                to_string(variant));
          });
  enqueue(rank, nullptr, nullptr, variant, stream, 1, /*with_gemm=*/false);
}

void AllGatherGemm::enqueue(int rank, const bf16* b, bf16* c, AgGemmVariant variant, hipStream_t stream, int lanes,
                            bool with_gemm) {
  const int world = team_.world();
  const long count = static_cast<long>(world) * splits_;
  const long shard_rows = m_ / world, chunk_rows = shard_rows / splits_;
  const std::size_t chunk_bytes = static_cast<std::size_t>(chunk_rows) * k_ * sizeof(bf16);
  require_call(team_, "AllGatherGemm", rank, lanes);
  // A null pointer would fault the device inside the GEMM: a sticky error that ends the process's
  // GPU context (and leaves the peers waiting), not a poisoned event.
  require(!with_gemm || (b != nullptr && c != nullptr), "AllGatherGemm: b and c must be non-null");
  require((variant != AgGemmVariant::tile_pull && variant != AgGemmVariant::tile_push) ||
              reinterpret_cast<std::uintptr_t>(b) % 16 == 0,
          "AllGatherGemm: the tile variants need b 16-byte aligned");
  require(variant != AgGemmVariant::ll_bulk || low_latency(), [&] {
    return fmt::format("AllGatherGemm: ll_bulk needs a shard of at most {} bytes, this one has {}", kLlMaxBytes,
                       static_cast<std::size_t>(shard_rows) * k_ * sizeof(bf16));
  });
  RankSync& s = *sync_[static_cast<std::size_t>(rank)];
  const bool copy_engine_pull = variant == AgGemmVariant::ce_pull || variant == AgGemmVariant::ce_pull_runs ||
                                variant == AgGemmVariant::ce_bulk || variant == AgGemmVariant::tile_pull;
  // tile_push has not been measured unpaced.
  const PaceAs pace = copy_engine_pull                      ? PaceAs::copy_engine_pull
                      : variant == AgGemmVariant::tile_push ? PaceAs::unmeasured
                                                            : PaceAs::run_ahead;
  const std::uint64_t e = s.enter(stream, pace);
  CallScope scope(s, stream);
  Blas& blas = team_.blas(rank);
  auto flags = [&](int r) { return FlagArrays{team_.heap().at<std::uint64_t>(flags_, r), count}; };
  auto rows_of = [&](int r, bf16* base) { return base + static_cast<long>(r) * shard_rows * k_; };
  bf16* mine = team_.heap().at<bf16>(gathered_, rank);
  const FlagArrays my = flags(rank);
  if (ChunkTrace* trace = traces_[static_cast<std::size_t>(rank)]) CARAVAN_HIP_CHECK(hipEventRecord(trace->start, stream));

  if (variant == AgGemmVariant::sm_bulk) {
    // One kernel on the caller's stream does it all: it announces the entry (freed: the caller's
    // earlier work on the gathered buffer is done; done: pushing reads no peer's shard), pushes
    // on every SM, and ends when every peer's shard has landed here; then one GEMM. No stream
    // memory operations and no second stream: at small shards their latency is the cost.
    SmPushFlags sm;
    sm.landed = my.at(ag_landed, 0);
    sm.freed = my.at(ag_freed, 0);
    sm.entry[0] = my.at(ag_freed, rank);
    sm.entry[1] = my.at(ag_done, rank);
    sm.wait_landed = true;
    sm.all_peers_at_once = true;  // everything waits for the whole exchange anyway
    sm_push(team_.heap().view(rank), rows_of(rank, mine), rows_of(rank, mine), chunk_bytes, splits_, sm,
            team_.heap().at<std::uint32_t>(sm_counters_, rank), e, team_.sm_count(rank), stream);
    if (with_gemm) blas.gemm(stream, m_, n_, k_, mine, k_, b, n_, c, n_);
    return;
  }
  // Entering epoch e: everything the caller enqueued before (its use of the gathered buffer,
  // this rank's earlier GEMMs) is done, so peers may push this epoch's shards into it.
  for (int step = 1; step < world; ++step) write_flag(stream, flags((rank + step) % world).at(ag_freed, rank), e);

  if (variant == AgGemmVariant::ll_bulk) {
    // The lines land in the peers' line buffers and each rank unpacks into its own gathered
    // buffer: no peer's slot is read, so the peers may rewrite their shards at once.
    for (int step = 1; step < world; ++step) write_flag(stream, flags((rank + step) % world).at(ag_done, rank), e);
    ll_allgather(team_.heap().view(rank), rows_of(rank, mine), static_cast<std::size_t>(shard_rows) * k_ * sizeof(bf16),
                 team_.heap().at(ll_lines_, rank), mine, team_.heap().at<LlState>(ll_state_, rank), stream,
                 /*early_launch=*/false, ll_format_);
    if (with_gemm) blas.gemm(stream, m_, n_, k_, mine, k_, b, n_, c, n_);
    return;
  }
  const bool sm = variant == AgGemmVariant::sm_push;
  const bool push = variant == AgGemmVariant::ce_push || variant == AgGemmVariant::ce_push_runs ||
                    variant == AgGemmVariant::tile_push || sm;
  // Everything enqueued on `stream` so far: the exchange and lane 1 start here.
  CARAVAN_HIP_CHECK(hipEventRecord(s.start, stream));
  // The copy-engine GEMM schedules enqueue their own shard's GEMM before the exchange (below).
  // sm_push does not: its kernel launched behind a GEMM would wait for SMs to free up.
  const bool own_first = with_gemm && !sm && variant != AgGemmVariant::ce_bulk &&
                         variant != AgGemmVariant::tile_pull && variant != AgGemmVariant::tile_push;
  if (!own_first) enqueue_exchange(rank, push, sm, e);
  if (!with_gemm) {
    // The AllGather alone: the caller's stream goes on once every peer's chunks landed here
    // and this rank's own copies are done.
    for (int step = 1; step < world; ++step)
      for (int sp = 0; sp < splits_; ++sp)
        wait_flag(stream, my.at(ag_landed, static_cast<long>((rank + step) % world) * splits_ + sp), e);
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, s.comm_done, 0));
    return;
  }

  if (variant == AgGemmVariant::tile_pull || variant == AgGemmVariant::tile_push) {
    // This rank's own rows need no wait: mark them landed for this epoch, in stream order after
    // the shard was written; then one GEMM whose blocks wait for their own rows' flags.
    for (int sp = 0; sp < splits_; ++sp)
      write_flag(stream, my.at(ag_landed, static_cast<long>(rank) * splits_ + sp), e);
    const long tiles = flag_gemm_row_tiles(m_);
    const int* order = tile_orders_[static_cast<std::size_t>(rank)] + (push ? tiles : 0);
    flag_gemm(mine, k_, b, n_, c, n_, m_, n_, k_, my.at(ag_landed, 0), chunk_rows, e, order, nullptr, 0, stream);
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, s.comm_done, 0));
    return;
  }
  Lanes lane(team_, rank, s, stream, variant == AgGemmVariant::ce_bulk ? 1 : lanes);
  ChunkTrace* trace = traces_[static_cast<std::size_t>(rank)];
  // This rank's own shard needs no wait: one GEMM (the runs variants) or one per split (chunks
  // 0 .. splits-1).
  const auto own_shard_gemms = [&] {
    const bool runs = variant == AgGemmVariant::ce_pull_runs || variant == AgGemmVariant::ce_push_runs;
    for (int sp = 0; sp < (runs ? 1 : splits_); ++sp) {
      const long rows = runs ? shard_rows : chunk_rows;
      const long row0 = static_cast<long>(rank) * shard_rows + static_cast<long>(sp) * chunk_rows;
      hipStream_t on = lane.stream(sp);
      if (trace) CARAVAN_HIP_CHECK(hipEventRecord(trace->ready[static_cast<std::size_t>(sp)], on));
      lane.blas(sp).gemm(on, rows, n_, k_, mine + row0 * k_, k_, b, n_, c + row0 * n_, n_);
      if (trace) CARAVAN_HIP_CHECK(hipEventRecord(trace->gemm_done[static_cast<std::size_t>(sp)], on));
    }
  };
  if (own_first) {
    // Enqueued before the exchange: enqueueing the copies and flag operations takes the host
    // tens of microseconds, which the GPU would otherwise spend idle.
    own_shard_gemms();
    enqueue_exchange(rank, push, sm, e);
  }
  if (variant == AgGemmVariant::ce_bulk) {
    for (int step = 1; step < world; ++step)
      for (int sp = 0; sp < splits_; ++sp)
        wait_flag(stream, my.at(ag_landed, static_cast<long>((rank + step) % world) * splits_ + sp), e);
    blas.gemm(stream, m_, n_, k_, mine, k_, b, n_, c, n_);
  } else if (variant == AgGemmVariant::ce_pull_runs || variant == AgGemmVariant::ce_push_runs) {
    // Own shard first (above); then the peers' shards as at most two GEMMs over contiguous rows
    // (shards below this rank's, and above it), each once all of its shards landed: fewer,
    // larger GEMMs lose less to partly filled last waves. Pushes land from rank-1 downwards
    // first (the shards below), pulls from rank+1 upwards.
    const std::pair<int, int> below{0, rank}, above{rank + 1, world};
    int chunk = 1;
    for (const auto& [first, end] : push ? std::array{below, above} : std::array{above, below}) {
      if (first >= end) continue;
      hipStream_t on = lane.stream(chunk);
      for (int src = first; src < end; ++src)
        for (int sp = 0; sp < splits_; ++sp) wait_flag(on, my.at(ag_landed, static_cast<long>(src) * splits_ + sp), e);
      const long row0 = static_cast<long>(first) * shard_rows;
      lane.blas(chunk).gemm(on, (end - first) * shard_rows, n_, k_, mine + row0 * k_, k_, b, n_, c + row0 * n_, n_);
      ++chunk;
    }
  } else {
    // Own shard first (above); then peers in the order they arrive: pulls go rank+1, rank+2,
    // ...; pushes reach this rank from rank-1 first, then rank-2, ...
    if (!own_first) own_shard_gemms();
    int chunk = splits_;
    for (int step = 1; step < world; ++step) {
      const int src = push ? (rank - step + world) % world : (rank + step) % world;
      for (int sp = 0; sp < splits_; ++sp, ++chunk) {
        const long row0 = static_cast<long>(src) * shard_rows + static_cast<long>(sp) * chunk_rows;
        hipStream_t on = lane.stream(chunk);
        wait_flag(on, my.at(ag_landed, static_cast<long>(src) * splits_ + sp), e);
        if (trace) CARAVAN_HIP_CHECK(hipEventRecord(trace->ready[static_cast<std::size_t>(chunk)], on));
        lane.blas(chunk).gemm(on, chunk_rows, n_, k_, mine + row0 * k_, k_, b, n_, c + row0 * n_, n_);
        if (trace) CARAVAN_HIP_CHECK(hipEventRecord(trace->gemm_done[static_cast<std::size_t>(chunk)], on));
      }
    }
  }
  lane.finish();
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, s.comm_done, 0));
}

std::string AllGatherGemm::describe_flags() const { return flag_report_->describe(sync_); }

// ---------------------------------------------------------------------------------------------
std::string_view to_string(AllGatherVariant v) {
  switch (v) {
    case AllGatherVariant::ce_push: return "ce-push";
    case AllGatherVariant::ce_pull: return "ce-pull";
    case AllGatherVariant::sm: return "sm";
    default: return "ll";
  }
}

namespace {
// AllGather's shape in its own terms (AllGatherGemm's checks would name m and k).
long checked_rows(long rows_per_rank, long cols, int splits, int world) {
  require(rows_per_rank > 0 && cols > 0, [&] {
    return fmt::format("AllGather: rows per rank and cols must be positive, got {} and {}", rows_per_rank, cols);
  });
  require(cols % 8 == 0,
          [&] { return fmt::format("AllGather: cols = {} must be a multiple of 8 (16-byte rows)", cols); });
  require(splits >= 1 && rows_per_rank % splits == 0, [&] {
    return fmt::format("AllGather: rows per rank = {} must be a multiple of splits = {} (splits >= 1)", rows_per_rank,
                       splits);
  });
  return rows_per_rank * world;
}
}  // namespace

AllGather::AllGather(GpuTeam& team, long rows_per_rank, long cols, int splits)
    : gathered_bytes_(static_cast<std::uint64_t>(rows_per_rank) * static_cast<std::uint64_t>(cols) *
                      static_cast<std::uint64_t>(team.world()) * sizeof(bf16)),
      impl_(team, checked_rows(rows_per_rank, cols, splits, team.world()), cols, 0, splits) {}

AllGatherVariant AllGather::automatic() const {
  if (low_latency()) return AllGatherVariant::ll;
  return gathered_bytes_ <= kSmMaxBytes ? AllGatherVariant::sm : AllGatherVariant::ce_push;
}

const bf16* AllGather::run(int rank, AllGatherVariant variant, hipStream_t stream) {
  AgGemmVariant as = AgGemmVariant::ll_bulk;
  switch (variant) {
    case AllGatherVariant::ce_push: as = AgGemmVariant::ce_push; break;
    case AllGatherVariant::ce_pull: as = AgGemmVariant::ce_pull; break;
    case AllGatherVariant::sm: as = AgGemmVariant::sm_bulk; break;
    case AllGatherVariant::ll: as = AgGemmVariant::ll_bulk; break;
  }
  impl_.gather(rank, as, stream);
  return impl_.gathered(rank);
}

// ---------------------------------------------------------------------------------------------
std::string_view to_string(GemmRsVariant v) {
  switch (v) {
    case GemmRsVariant::ce_push: return "ce-push";
    case GemmRsVariant::ll_bulk: return "ll-bulk";
    case GemmRsVariant::sm_pull: return "sm-pull";
    case GemmRsVariant::sm_push: return "sm-push";
    case GemmRsVariant::tile_push: return "tile-push";
    case GemmRsVariant::tile_scatter: return "tile-scatter";
    case GemmRsVariant::blas_scatter: return "blas-scatter";
    case GemmRsVariant::ce_ring: return "ce-ring";
    default: return "ce-bulk";
  }
}

// Flags of GemmReduceScatter, per rank: arrived[p] (p's partial for my rows is in my slot p),
// freed[p] (p finished reducing the slot I pushed to it), ready[p] (p's sm_pull partial is
// complete), ring[p] (ce_ring: the parts p, my left neighbour, pushed here, over its ring calls).
enum RsFlags { rs_arrived, rs_freed, rs_ready, rs_ring, rs_groups };

std::uint64_t GemmReduceScatter::pull_max_bytes() { return settings::get_bytes("CARAVAN_OVERLAP_GPU_SM_RS_MAX_BYTES"); }

GemmReduceScatter::GemmReduceScatter(GpuTeam& team, long m, long k, long n, int splits)
    : team_(team),
      m_(m),
      k_(k),
      n_(n),
      splits_(splits),
      early_launch_(settings::get_bool("CARAVAN_OVERLAP_GPU_EARLY_LAUNCH")),
      ring_push_bytes_(static_cast<std::size_t>(team.world()),
                       settings::get_bytes("CARAVAN_OVERLAP_GPU_RING_PUSH_BYTES")) {
  const int world = team.world();
  // k = 0: the ReduceScatter alone, which checks its shape in its own terms (ReduceScatter).
  const bool gemm = k != 0;
  require_shape("GemmReduceScatter", m, gemm ? k : 8, n, world, splits);
  require((m / world) * n % 8 == 0, "GemmReduceScatter: (m / world) x n must be a multiple of 8 (16-byte vectors)");
  received_ = team.heap().allocate(static_cast<std::uint64_t>(m) * n * sizeof(bf16));
  flags_ = team.heap().allocate(rs_groups * static_cast<std::uint64_t>(world) * kFlagBytes);
  const std::size_t out_bytes = static_cast<std::size_t>(m / world) * n * sizeof(bf16);
  if (out_bytes <= kLlMaxBytes) {
    ll_lines_ = team.heap().allocate(ll_buffer_bytes(world, out_bytes));
    ll_state_ = team.heap().allocate(sizeof(LlState));
    ll_format_ = ll_format(out_bytes);
  }
  const std::uint64_t partial_bytes = static_cast<std::uint64_t>(m) * n * sizeof(bf16);
  // Every rank makes the same decision (same heap size, same allocations before this one).
  // The ReduceScatter alone (no GEMM) takes them at any size: its sm beat ce-push at every size
  // measured, 0.8-128 MiB (1.05-1.14x NCCL at 64-128 MiB, where ce-push ran 0.84-0.96x; 29th
  // session), while after a large GEMM sm-pull and sm-push ran no faster than the bulk baseline.
  pull_limit_ = gemm ? pull_max_bytes() : std::numeric_limits<std::uint64_t>::max();
  if (partial_bytes <= pull_limit_ && team.heap().capacity() - team.heap().used() >= 2 * partial_bytes + (1u << 20))
    pull_partials_ = team.heap().allocate(2 * partial_bytes);
  probes_.assign(static_cast<std::size_t>(world), Probe{});
  ring_traces_.assign(static_cast<std::size_t>(world), nullptr);
  // As many blocks as give each of at least 128 threads a 16-byte vector (push_reduce_scatter_
  // threads then sizes the blocks), so that a small exchange's stores leave from many SMs, up to
  // kPushMaxBlocks. A function of the shape alone: every rank, in every process, must run the same
  // grid (block b sums what the peers' blocks b stored) and allocate the same flag array (the
  // symmetric allocations after it keep their offsets). 128 blocks of at most 512 threads are all
  // resident at once on a GPU of 32 SMs or more, so a block waiting for its partners never keeps
  // another block from starting.
  push_blocks_ = static_cast<int>(std::min<std::uint64_t>(
      std::max<std::uint64_t>((static_cast<std::uint64_t>(m / world) * n / 8 + 127) / 128, 1), kPushMaxBlocks));
  // Rounds of CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES per peer, at most kPushMaxRounds, each whole
  // passes of the grid (so every block works in every round), and none left empty: a function of
  // the shape and the setting, the same on every rank (GpuSymmetricHeap::join_node checks the
  // setting agrees).
  const std::uint64_t round_bytes = settings::get_bytes("CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES");
  if (round_bytes > 0) {
    const std::uint64_t vectors = out_bytes / 16,
                        pass = static_cast<std::uint64_t>(push_blocks_) *
                               push_reduce_scatter_threads(out_bytes / sizeof(bf16), push_blocks_),
                        passes = (vectors + pass - 1) / pass;
    const std::uint64_t asked = std::min(std::clamp<std::uint64_t>(out_bytes / round_bytes, 1, kPushMaxRounds), passes);
    const std::uint64_t per_round = (passes + asked - 1) / asked;  // passes a round
    push_rounds_ = static_cast<int>((passes + per_round - 1) / per_round);
  }
  // Zero, as the flags start.
  push_arrived_ = team.heap().allocate(static_cast<std::uint64_t>(world) * static_cast<std::uint64_t>(push_blocks_) *
                                       sizeof(std::uint64_t));
  // tile_scatter's inboxes last, where they fit (the same decision on every rank, as above).
  const std::uint64_t scatter_words = static_cast<std::uint64_t>(world) * splits * sizeof(std::uint64_t);
  if (gemm && world <= FlagGemmParts::kMaxParts &&
      team.heap().capacity() - team.heap().used() >= 2 * partial_bytes + scatter_words + (1u << 20)) {
    scatter_inboxes_ = team.heap().allocate(2 * partial_bytes);
    scatter_done_ = team.heap().allocate(scatter_words);  // zero, as the heap starts
  }
  try {
    partial_.resize(static_cast<std::size_t>(world), nullptr);
    if (gemm) {
      for (int r : team.driven_ranks()) {
        team.use(r);
        void* p = nullptr;
        CARAVAN_HIP_CHECK(hipMalloc(&p, static_cast<std::size_t>(m) * n * sizeof(bf16)));
        partial_[static_cast<std::size_t>(r)] = static_cast<bf16*>(p);
      }
      build_tile_orders();
    }
    ring_calls_.assign(static_cast<std::size_t>(world), 0);
    sync_ = make_sync(team, world * splits);
    flag_report_ =
        std::make_unique<FlagReport>(team, flags_, std::vector<std::string>{"arrived", "freed", "ready", "ring"}, world);
    std::vector<GemmShape> shapes;
    // ce_ring adds each part's product to the running sum (beta = 1), the last into out (gemm_add).
    if (gemm)
      shapes = {{m, n, k, n},
                {m / world, n, k, n},
                {m / world / splits, n, k, n},
                {m / world / splits, n, k, n, 1.0f},
                {m / world / splits, n, k, n, 1.0f, true}};
    warm_up(team, shapes, static_cast<std::size_t>(m / world) * n);
    team.construction_done(fmt::format("GemmReduceScatter m={} k={} n={} splits={}", m, k, n, splits));
  } catch (...) {
    free_partials();
    throw;
  }
}

// tile_push computes the rows of rank+1 first, then rank+2, ..., its own last, as ce_push does;
// a row tile serving two destinations runs with the earlier one. Allocated here, not in run():
// no allocation while peers may be spinning.
void GemmReduceScatter::build_tile_orders() {
  const int world = team_.world();
  const long rows = m_ / world, tiles = flag_gemm_row_tiles(m_);
  tile_orders_.assign(static_cast<std::size_t>(world), nullptr);
  parts_done_.assign(static_cast<std::size_t>(world), nullptr);
  tile_calls_.assign(static_cast<std::size_t>(world), 0);
  scatter_orders_.assign(static_cast<std::size_t>(world), nullptr);
  scatter_calls_.assign(static_cast<std::size_t>(world), 0);
  const long range_rows = rows / splits_;
  for (int r : team_.driven_ranks()) {
    team_.use(r);
    preload_flag_gemm();
    std::vector<int> order(static_cast<std::size_t>(tiles));
    for (long t = 0; t < tiles; ++t) order[static_cast<std::size_t>(t)] = static_cast<int>(t);
    const auto first_step = [&](long tile) {
      const long first = tile * flag_gemm_tile_rows(), last = std::min(first + flag_gemm_tile_rows(), m_) - 1;
      int step = world;
      for (long dst = first / rows; dst <= last / rows; ++dst) {
        const int s = static_cast<int>((dst - r + world) % world);
        step = std::min(step, s == 0 ? world : s);  // its own rows last
      }
      return step;
    };
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return first_step(x) < first_step(y); });
    void* p = nullptr;
    CARAVAN_HIP_CHECK(hipMalloc(&p, order.size() * sizeof(int)));
    tile_orders_[static_cast<std::size_t>(r)] = static_cast<int*>(p);
    CARAVAN_HIP_CHECK(hipMemcpy(p, order.data(), order.size() * sizeof(int), hipMemcpyDefault));
    // tile_scatter: range 0 of every destination (rank+1, rank+2, ..., its own last), then range
    // 1, ...: every rank finishes range j of every destination at about the same time, so each
    // destination sums range j while the GEMMs compute range j+1. A tile over two ranges runs
    // with the earlier.
    const auto first_turn = [&](long tile) {
      const long first = tile * flag_gemm_tile_rows(), last = std::min(first + flag_gemm_tile_rows(), m_) - 1;
      long turn = std::numeric_limits<long>::max();
      for (long row = first; row <= last;) {
        const long dst = row / rows, range = (row - dst * rows) / range_rows;
        const long step = (dst - r + world) % world;
        turn = std::min(turn, range * world + (step == 0 ? world - 1 : step - 1));
        row = dst * rows + (range + 1) * range_rows;  // the next range's first row
      }
      return turn;
    };
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return first_turn(x) < first_turn(y); });
    CARAVAN_HIP_CHECK(hipMalloc(&p, order.size() * sizeof(int)));
    scatter_orders_[static_cast<std::size_t>(r)] = static_cast<int*>(p);
    CARAVAN_HIP_CHECK(hipMemcpy(p, order.data(), order.size() * sizeof(int), hipMemcpyDefault));
    const std::size_t parts = static_cast<std::size_t>(world) * static_cast<std::size_t>(splits_);
    CARAVAN_HIP_CHECK(hipMalloc(&p, parts * sizeof(std::uint64_t)));
    parts_done_[static_cast<std::size_t>(r)] = static_cast<std::uint64_t*>(p);
    CARAVAN_HIP_CHECK(hipMemset(p, 0, parts * sizeof(std::uint64_t)));
    CARAVAN_HIP_CHECK(hipDeviceSynchronize());  // the zeros are in before any stream reads them
  }
}

void GemmReduceScatter::free_partials() {
  const auto release = [&](auto& buffers) {
    for (std::size_t r = 0; r < buffers.size(); ++r) {
      if (!buffers[r]) continue;
      (void)hipSetDevice(team_.device(static_cast<int>(r)));
      (void)hipFree(buffers[r]);
    }
    buffers.clear();
  };
  release(partial_);
  release(tile_orders_);
  release(parts_done_);
  release(scatter_orders_);
}

GemmReduceScatter::~GemmReduceScatter() { free_partials(); }

void GemmReduceScatter::set_probe(int rank, std::uint64_t* after_gemm, std::uint64_t* stamps) {
  require_driven(team_, rank);
  probes_[static_cast<std::size_t>(rank)] = Probe{after_gemm, stamps};
}

void GemmReduceScatter::set_ring_trace(int rank, ChunkTrace* trace) {
  require_driven(team_, rank);
  require_trace("GemmReduceScatter::set_ring_trace", trace, team_.world(), splits_);
  ring_traces_[static_cast<std::size_t>(rank)] = trace;
}

void GemmReduceScatter::run(int rank, const bf16* a, const bf16* b, bf16* out, GemmRsVariant variant,
                            hipStream_t stream, int lanes) {
  require(k_ > 0, "GemmReduceScatter::run: this object was built without a GEMM (k = 0): call reduce_scatter()");
  enqueue(rank, a, b, nullptr, out, variant, stream, lanes);
}

void GemmReduceScatter::reduce_scatter(int rank, const bf16* in, bf16* out, GemmRsVariant variant, hipStream_t stream) {
  require(variant == GemmRsVariant::ce_bulk || variant == GemmRsVariant::sm_push || variant == GemmRsVariant::ll_bulk,
          [&] {
            return fmt::format(
                "GemmReduceScatter::reduce_scatter: variant {} is a GEMM schedule; the ReduceScatter alone runs "
                "ce-bulk, sm-push or ll-bulk",
                to_string(variant));
          });
  require(in != nullptr && reinterpret_cast<std::uintptr_t>(in) % 16 == 0,
          "GemmReduceScatter::reduce_scatter: in must be non-null and 16-byte aligned");
  enqueue(rank, nullptr, nullptr, in, out, variant, stream, 1);
}

int GemmReduceScatter::ring_push_group(int rank) const {
  require(rank >= 0 && rank < team_.world(), "GemmReduceScatter::ring_push_group: rank out of range");
  const std::uint64_t part_bytes = static_cast<std::uint64_t>(m_ / team_.world() / splits_) *
                                   static_cast<std::uint64_t>(n_) * sizeof(bf16);
  const std::uint64_t wanted = ring_push_bytes_[static_cast<std::size_t>(rank)];
  int group = 1;
  while (group < splits_ && (splits_ % group != 0 || group * part_bytes < wanted)) ++group;
  return group;
}

void GemmReduceScatter::set_ring_push_bytes(int rank, std::uint64_t bytes) {
  require(rank >= 0 && rank < team_.world(), [&] {
    return fmt::format("GemmReduceScatter::set_ring_push_bytes: rank {} is outside 0..{}", rank, team_.world() - 1);
  });
  ring_push_bytes_[static_cast<std::size_t>(rank)] = bytes;
}

void GemmReduceScatter::enqueue(int rank, const bf16* a, const bf16* b, const bf16* in, bf16* out,
                                GemmRsVariant variant, hipStream_t stream, int lanes) {
  require(out != nullptr && reinterpret_cast<std::uintptr_t>(out) % 16 == 0,
          "GemmReduceScatter::run: out must be non-null and 16-byte aligned");
  require(in != nullptr || (a != nullptr && b != nullptr), "GemmReduceScatter::run: a and b must be non-null");
  const int world = team_.world();
  const long rows = m_ / world, part_rows = rows / splits_;
  const std::size_t chunk_elems = static_cast<std::size_t>(rows) * n_;
  const std::size_t part_elems = static_cast<std::size_t>(part_rows) * n_;
  require_call(team_, "GemmReduceScatter", rank, lanes);
  require(variant != GemmRsVariant::ll_bulk || low_latency(), [&] {
    return fmt::format("GemmReduceScatter: ll_bulk needs an output of at most {} bytes per rank, this one has {}",
                       kLlMaxBytes, chunk_elems * sizeof(bf16));
  });
  // tile_push's GEMM (flag_gemm) loads A and B 16 bytes at a time; refused here, before the call
  // takes its epoch, so that a refusal leaves nothing half done.
  require((variant != GemmRsVariant::tile_push && variant != GemmRsVariant::tile_scatter) ||
              (k_ % 8 == 0 && n_ % 8 == 0 && reinterpret_cast<std::uintptr_t>(a) % 16 == 0 &&
               reinterpret_cast<std::uintptr_t>(b) % 16 == 0),
          [&] {
            return fmt::format(
                "GemmReduceScatter: {} needs k and n multiples of 8 and a, b 16-byte aligned; "
                "got k {}, n {}",
                to_string(variant), k_, n_);
          });
  const bool scatters = variant == GemmRsVariant::tile_scatter || variant == GemmRsVariant::blas_scatter;
  require(!scatters || scatter(), [&] {
    return fmt::format(
        "GemmReduceScatter: {} needs at most {} ranks and room in the symmetric heap for two "
        "inboxes of m x n ({} bytes) after the operation's other buffers",
        to_string(variant), FlagGemmParts::kMaxParts, 2 * static_cast<std::uint64_t>(m_) * n_ * sizeof(bf16));
  });
  const bool one_kernel = variant == GemmRsVariant::sm_pull || variant == GemmRsVariant::sm_push;
  require(!one_kernel || (variant == GemmRsVariant::sm_pull ? pull() : push()), [&] {
    return fmt::format("GemmReduceScatter: {} needs a partial of at most {} bytes "
                       "(CARAVAN_OVERLAP_GPU_SM_RS_MAX_BYTES) and twice that free in the heap; this one has {}",
                       to_string(variant), pull_limit_, static_cast<std::uint64_t>(m_) * n_ * sizeof(bf16));
  });
  RankSync& s = *sync_[static_cast<std::size_t>(rank)];
  // The one-kernel exchanges run ahead unpaced (their buffers alternate by epoch parity, and each
  // kernel waits for words the peers raise only once their previous call has ended), which takes
  // the host's event query out of the time before their GEMM; the copy-engine variants and
  // ll_bulk have not been measured unpaced.
  const std::uint64_t e = s.enter(stream, one_kernel ? PaceAs::run_ahead : PaceAs::unmeasured);
  CallScope scope(s, stream);
  hipStream_t comm = team_.comm_stream(rank);
  // The GEMM writes `computed`; the exchange reads `partial`: the same buffer, or the caller's
  // input when there is no GEMM.
  bf16* computed = partial_[static_cast<std::size_t>(rank)];
  const bf16* partial = in ? in : computed;
  const bool gemm = in == nullptr;
  auto flags = [&](int r) { return FlagArrays{team_.heap().at<std::uint64_t>(flags_, r), world}; };
  auto slot = [&](int owner, int from) { return team_.heap().at<bf16>(received_, owner) + from * chunk_elems; };
  const FlagArrays my = flags(rank);
  const Probe& probe = probes_[static_cast<std::size_t>(rank)];

  if (variant == GemmRsVariant::sm_pull) {
    // Partials alternate by epoch parity: the one written now was last read by the peers in
    // call e-2, and every variant's call e-1 on this rank waited for something each peer did
    // after its call e-2 ended (here: its ready flag of e-1), so those reads are over.
    bf16* shared = team_.heap().at<bf16>(pull_partials_, rank) + (e & 1) * static_cast<std::size_t>(m_) * n_;
    team_.blas(rank).gemm(stream, m_, n_, k_, a, k_, b, n_, shared, n_);
    if (probe.after_gemm) stamp_time(probe.after_gemm, stream);
    pull_reduce_scatter(team_.heap().view(rank), shared + rank * chunk_elems, chunk_elems, out, my.at(rs_ready, 0),
                        my.at(rs_freed, 0), e, stream, early_launch_ && !probe.after_gemm, probe.stamps);
    return;
  }
  if (variant == GemmRsVariant::sm_push) {
    // Inboxes alternate by epoch parity, as sm_pull's partials: the slot a peer fills now was last
    // read here in call e-2, and every variant's call e-1 on that peer waited for something this
    // rank did after its call e-2 ended.
    if (gemm) team_.blas(rank).gemm(stream, m_, n_, k_, a, k_, b, n_, computed, n_);
    if (probe.after_gemm) stamp_time(probe.after_gemm, stream);
    bf16* inbox = team_.heap().at<bf16>(pull_partials_, rank) + (e & 1) * static_cast<std::size_t>(m_) * n_;
    push_reduce_scatter(team_.heap().view(rank), partial, inbox, chunk_elems, out,
                        team_.heap().at<std::uint64_t>(push_arrived_, rank), push_blocks_, push_rounds_, my.at(rs_freed, 0), e,
                        stream, early_launch_ && !probe.after_gemm, probe.stamps);
    return;
  }
  if (variant == GemmRsVariant::ll_bulk) {
    // The partials travel as lines into the peers' line buffers: no slot of received_ is used,
    // so this rank's slots stay free for the peers' next copy-engine call at once.
    if (gemm) team_.blas(rank).gemm(stream, m_, n_, k_, a, k_, b, n_, computed, n_);
    ll_reduce_scatter(team_.heap().view(rank), partial, chunk_elems * sizeof(bf16), team_.heap().at(ll_lines_, rank),
                      out, team_.heap().at<LlState>(ll_state_, rank), stream, early_launch_, ll_format_);
    for (int step = 1; step < world; ++step) write_flag(stream, flags((rank + step) % world).at(rs_freed, rank), e);
    return;
  }

  CARAVAN_HIP_CHECK(hipEventRecord(s.start, stream));
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(comm, s.start, 0));
  if (scatters) {
    // The GEMM stores this rank's share of destination d's rows into d's inbox slot `rank` and
    // counts it into d's words [rank][range]: a word per source, so that one source's next call
    // can never make up for another's missing tiles. blas_scatter sets a word to the count the
    // tile GEMM's blocks would have reached, so the two variants share the words. Inboxes
    // alternate by epoch parity: the one written now was last summed by its owner in call e-2,
    // and this rank's call e-1 waited for every peer's contribution of e-1, which that peer's
    // GEMM made after its call e-2 had ended. Sums run on the communication stream, beside the
    // GEMM, a range at a time.
    const std::uint64_t calls = scatter_calls_[static_cast<std::size_t>(rank)] + 1;
    const long range_rows = rows / splits_;
    const std::size_t inbox_elems = static_cast<std::size_t>(m_) * n_;
    auto inbox = [&](int owner) { return team_.heap().at<bf16>(scatter_inboxes_, owner) + (e & 1) * inbox_elems; };
    auto words = [&](int owner, int from) {
      return team_.heap().at<std::uint64_t>(scatter_done_, owner) + from * splits_;
    };
    FlagGemmParts parts;
    parts.count = world;
    parts.rows = rows;
    for (int d = 0; d < world; ++d) {
      parts.c[d] = inbox(d) + rank * chunk_elems;
      parts.done[d] = words(d, rank);
    }
    if (variant == GemmRsVariant::tile_scatter) {
      // Persistent: the rows travel to the destinations while the next tile is computed.
      flag_gemm_parts(a, k_, b, n_, parts, n_, m_, n_, k_, nullptr, 0, 0,
                      scatter_orders_[static_cast<std::size_t>(rank)], range_rows, stream, FlagGemmKernel::persistent);
    } else {
      Lanes lane(team_, rank, s, stream, lanes);
      int chunk = 0;
      for (int j = 0; j < splits_; ++j)
        for (int step = 1; step <= world; ++step, ++chunk) {
          const int d = (rank + step) % world;
          const long row0 = d * rows + j * range_rows;
          hipStream_t on = lane.stream(chunk);
          lane.blas(chunk).gemm(on, range_rows, n_, k_, a + row0 * k_, k_, b, n_, parts.c[d] + j * range_rows * n_, n_);
          const auto columns = static_cast<std::uint64_t>(n_ * flag_gemm_tiles_over(m_, row0, range_rows));
          write_flag(on, parts.done[d] + j, calls * columns);
        }
      lane.finish();
    }
    scatter_calls_[static_cast<std::size_t>(rank)] = calls;  // counted once its GEMM is launched
    for (int j = 0; j < splits_; ++j) {
      const long row0 = j * range_rows;  // within this rank's rows
      const auto columns = static_cast<std::uint64_t>(n_ * flag_gemm_tiles_over(m_, rank * rows + row0, range_rows));
      ReduceInputs inputs;
      inputs.count = world;
      for (int q = 0; q < world; ++q) {
        wait_flag(comm, words(rank, q) + j, calls * columns);
        inputs.in[q] = inbox(rank) + q * chunk_elems + row0 * n_;
      }
      reduce_sum(out + row0 * n_, inputs, static_cast<std::size_t>(range_rows) * n_, comm);
    }
    // For the copy-engine variants' next call, which waits for it before pushing here.
    for (int step = 1; step < world; ++step) write_flag(comm, flags((rank + step) % world).at(rs_freed, rank), e);
    CARAVAN_HIP_CHECK(hipEventRecord(s.comm_done, comm));
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, s.comm_done, 0));
    return;
  }
  if (variant == GemmRsVariant::ce_ring) {
    // Destination d's rows go around the ring d+1, d+2, ..., d: at step t a rank works on the
    // rows of rank - t - 1, so it receives from its left neighbour and pushes to its right one
    // only, and its own rows come last. Step 0 computes the product into the local partial; each
    // later step waits for the neighbour's part in this rank's slot for d and adds its product to
    // it in place (beta = 1); all but the last push the slot on. The last step writes out as its
    // own product plus the others' sum in the slot, in one cuBLASLt call (C != D): no part-sized
    // copy into out in front of the last GEMMs. The neighbour's word counts
    // parts over the ring calls: (calls x (world - 1) + t) x splits + part + 1, written once a
    // push (a group of parts) has landed, with its last part's count (the values of the group's
    // other parts are skipped: a wait is for at least its part's count).
    const int left = (rank + world - 1) % world, right = (rank + 1) % world;
    const std::uint64_t base = ring_calls_[static_cast<std::size_t>(rank)] * static_cast<std::uint64_t>(world - 1) *
                               static_cast<std::uint64_t>(splits_);
    ChunkTrace* trace = ring_traces_[static_cast<std::size_t>(rank)];
    if (trace) CARAVAN_HIP_CHECK(hipEventRecord(trace->start, stream));
    // A push carries `group` consecutive parts of a step (CARAVAN_OVERLAP_GPU_RING_PUSH_BYTES):
    // the fewest that divide the parts and reach the setting. Consecutive copies on one stream
    // lose microseconds between them (each waits for the last to land and its flag to be
    // written), so fewer, larger pushes move the bytes faster; the GEMMs keep their parts. The
    // neighbour's word counts parts, so it reads a group's parts as soon as the group lands,
    // whatever group the neighbour's ranks chose.
    const int group = ring_push_group(rank);
    Lanes lane(team_, rank, s, stream, lanes);
    int chunk = 0;
    for (int t = 0; t < world; ++t) {
      const int d = (rank - t - 1 + 2 * world) % world;
      const bool first = t == 0, last = t == world - 1;
      for (int part = 0; part < splits_; ++part, ++chunk) {
        hipStream_t on = lane.stream(chunk);
        const long row0 = d * rows + part * part_rows;
        const std::size_t offset = static_cast<std::size_t>(part) * part_elems;
        // Step 0 writes the partial (with one rank, that is out), the others add to the slot.
        bf16* c = first ? (last ? out + offset : computed + row0 * n_) : slot(rank, d) + offset;
        if (!first)
          wait_flag(on, my.at(rs_ring, left), base + static_cast<std::uint64_t>((t - 1) * splits_ + part + 1));
        const auto c_index = static_cast<std::size_t>(chunk);
        if (trace) CARAVAN_HIP_CHECK(hipEventRecord(trace->ready[c_index], on));
        if (last && !first) {
          // out = own product + the others' sum, read from the slot (no copy into out first).
          lane.blas(chunk).gemm_add(on, part_rows, n_, k_, a + row0 * k_, k_, b, n_, c, n_, out + offset, n_);
          if (trace) CARAVAN_HIP_CHECK(hipEventRecord(trace->gemm_done[c_index], on));
          continue;
        }
        lane.blas(chunk).gemm(on, part_rows, n_, k_, a + row0 * k_, k_, b, n_, c, n_, first ? 0.0f : 1.0f);
        if (trace) CARAVAN_HIP_CHECK(hipEventRecord(trace->gemm_done[c_index], on));
        if (last) continue;
        hipEvent_t done = s.chunk[c_index];  // chunk counts the parts pushed before this one
        CARAVAN_HIP_CHECK(hipEventRecord(done, on));
        CARAVAN_HIP_CHECK(hipStreamWaitEvent(comm, done, 0));
        if ((part + 1) % group != 0) continue;  // pushed with the group's last part
        const int first_part = part + 1 - group;
        if (chunk + 1 == group) wait_flag(comm, my.at(rs_freed, right), e - 1);  // its slots are free
        const std::size_t back = static_cast<std::size_t>(group - 1) * part_elems;
        CARAVAN_HIP_CHECK(hipMemcpyAsync(slot(right, d) + offset - back, c - back,
                                         static_cast<std::size_t>(group) * part_elems * sizeof(bf16), hipMemcpyDefault,
                                         comm));
        if (trace)
          for (int p = first_part; p <= part; ++p)
            CARAVAN_HIP_CHECK(hipEventRecord(trace->pushed[c_index - static_cast<std::size_t>(part - p)], comm));
        write_flag(comm, flags(right).at(rs_ring, rank), base + static_cast<std::uint64_t>(chunk + 1));
      }
    }
    lane.finish();
    ring_calls_[static_cast<std::size_t>(rank)] += 1;  // counted once its calls are enqueued
    CARAVAN_HIP_CHECK(hipEventRecord(s.comm_done, comm));
    // The slots were read by this rank's own GEMMs and pushes: freed once both are done.
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, s.comm_done, 0));
    for (int step = 1; step < world; ++step) write_flag(stream, flags((rank + step) % world).at(rs_freed, rank), e);
    return;
  }
  // A source's arrived flag counts its parts over the calls: call e's part j raises it to
  // (e-1) x splits + j + 1, so a destination may sum part j before the later parts land.
  auto parts_landed = [&](int parts) { return (e - 1) * static_cast<std::uint64_t>(splits_) + parts; };
  // Sums parts [first, end) of this rank's rows on `on` once every peer's have landed.
  auto reduce_parts = [&](int first, int end, hipStream_t on) {
    const std::size_t offset = static_cast<std::size_t>(first) * part_elems;
    ReduceInputs inputs;
    inputs.count = world;
    for (int q = 0; q < world; ++q) {
      if (q != rank) wait_flag(on, my.at(rs_arrived, q), parts_landed(end));
      inputs.in[q] = (q == rank ? partial + rank * chunk_elems : slot(rank, q)) + offset;
    }
    reduce_sum(out + offset, inputs, static_cast<std::size_t>(end - first) * part_elems, on);
  };
  // With one lane, a part's sum would wait for the peers in front of the next part's GEMM.
  const bool sum_per_part = variant == GemmRsVariant::ce_push && splits_ > 1 && lanes == 2;
  // Pushes parts [first, end) of the rows destined to rank+step once `ready` has happened,
  // raising the destination's arrived flag to count them.
  auto push = [&](int step, int first, int end, hipEvent_t ready) {
    const int dst = (rank + step) % world;
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(comm, ready, 0));
    if (first == 0) wait_flag(comm, my.at(rs_freed, dst), e - 1);
    CARAVAN_HIP_CHECK(hipMemcpyAsync(slot(dst, rank) + first * part_elems,
                                     partial + dst * chunk_elems + first * part_elems,
                                     (end - first) * part_elems * sizeof(bf16), hipMemcpyDefault, comm));
    write_flag(comm, flags(dst).at(rs_arrived, rank), parts_landed(end));
  };
  if (variant == GemmRsVariant::ce_bulk) {
    if (gemm) team_.blas(rank).gemm(stream, m_, n_, k_, a, k_, b, n_, computed, n_);
    CARAVAN_HIP_CHECK(hipEventRecord(s.chunk[0], stream));
    for (int step = 1; step < world; ++step) push(step, 0, splits_, s.chunk[0]);
  } else if (variant == GemmRsVariant::tile_push) {
    // One GEMM, row tiles in destination order, counting its blocks' columns into a word per
    // part; a part leaves once its word holds n columns for every row tile over it, for every
    // call so far: one wait-value per part.
    const std::uint64_t calls = tile_calls_[static_cast<std::size_t>(rank)] + 1;
    std::uint64_t* done = parts_done_[static_cast<std::size_t>(rank)];
    flag_gemm(a, k_, b, n_, computed, n_, m_, n_, k_, nullptr, 0, 0, tile_orders_[static_cast<std::size_t>(rank)], done,
              part_rows, stream);
    tile_calls_[static_cast<std::size_t>(rank)] = calls;  // counted once its GEMM is launched
    for (int step = 1; step < world; ++step) {
      const int dst = (rank + step) % world;
      for (int part = 0; part < splits_; ++part) {
        const long row0 = dst * rows + part * part_rows;
        const auto columns = static_cast<std::uint64_t>(n_ * flag_gemm_tiles_over(m_, row0, part_rows));
        wait_flag(comm, done + row0 / part_rows, calls * columns);
        if (part == 0) wait_flag(comm, my.at(rs_freed, dst), e - 1);
        CARAVAN_HIP_CHECK(hipMemcpyAsync(slot(dst, rank) + part * part_elems, partial + row0 * n_,
                                         part_elems * sizeof(bf16), hipMemcpyDefault, comm));
        write_flag(comm, flags(dst).at(rs_arrived, rank), parts_landed(part + 1));
      }
    }
  } else {
    // Destination order rank+1, rank+2, ...: the rows this rank keeps are computed last, so the
    // pushes of the others overlap the remaining GEMMs; each destination's rows in `splits`
    // parts, each pushed when done, so the first push starts early and the last one is short.
    Lanes lane(team_, rank, s, stream, lanes);
    int chunk = 0;
    for (int step = 1; step <= world; ++step) {
      const int dst = (rank + step) % world;
      for (int part = 0; part < splits_; ++part, ++chunk) {
        hipStream_t on = lane.stream(chunk);
        const long row0 = dst * rows + part * part_rows;
        lane.blas(chunk).gemm(on, part_rows, n_, k_, a + row0 * k_, k_, b, n_, computed + row0 * n_, n_);
        if (step < world) {
          hipEvent_t done = s.chunk[static_cast<std::size_t>(chunk)];
          CARAVAN_HIP_CHECK(hipEventRecord(done, on));
          push(step, part, part + 1, done);
        } else if (sum_per_part) {
          // This rank's own rows come last: each part is summed as soon as it is computed (and
          // the peers' have landed), beside the GEMM of the next part on the other lane, so
          // only the last part's sum follows the GEMMs.
          reduce_parts(part, part + 1, on);
        }
      }
    }
    lane.finish();
  }
  CARAVAN_HIP_CHECK(hipEventRecord(s.comm_done, comm));
  if (!sum_per_part) reduce_parts(0, splits_, stream);
  for (int step = 1; step < world; ++step) write_flag(stream, flags((rank + step) % world).at(rs_freed, rank), e);
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, s.comm_done, 0));
}

std::string GemmReduceScatter::describe_flags() const { return flag_report_->describe(sync_); }

// ---------------------------------------------------------------------------------------------
std::string_view to_string(GemmAsVariant v) {
  switch (v) {
    case GemmAsVariant::ce_push: return "ce-push";
    case GemmAsVariant::ce_bulk: return "ce-bulk";
    case GemmAsVariant::tile_fused: return "tile-fused";
    case GemmAsVariant::tile_specialized: return "tile-specialized";
    case GemmAsVariant::sm_bulk: return "sm-bulk";
  }
  return "unknown";
}

// Flags of GemmAllScatter, per rank: arrived[p * chunks + c] (p's chunk c of its column block
// is in my C), released[p] (p entered this epoch: its caller is done with p's C).
GemmAllScatter::GemmAllScatter(GpuTeam& team, long m, long k, long n, int chunks)
    : team_(team), m_(m), k_(k), n_(n), chunks_(chunks) {
  const int world = team.world();
  // k = 0: the All-Scatter alone (AllScatter checks its shape in its own terms).
  require(m > 0 && k >= 0 && n > 0, [&] {
    return fmt::format("GemmAllScatter: m, n must be positive and k positive (or 0: no GEMM), got {}, {}, {}", m, k, n);
  });
  require(n % world == 0,
          [&] { return fmt::format("GemmAllScatter: n = {} must be a multiple of world = {}", n, world); });
  require(k % 8 == 0 && (n / world) % 8 == 0, [&] {
    return fmt::format("GemmAllScatter: k = {} and n / world = {} must be multiples of 8 (16-byte rows)", k, n / world);
  });
  require(chunks >= 1 && m % chunks == 0,
          [&] { return fmt::format("GemmAllScatter: chunks = {} must be >= 1 and divide m = {}", chunks, m); });
  c_ = team.heap().allocate(static_cast<std::uint64_t>(m) * n * sizeof(bf16));
  flags_ = team.heap().allocate((static_cast<std::uint64_t>(world) * chunks + world) * kFlagBytes);
  fused_done_ = team.heap().allocate(static_cast<std::uint64_t>(world) * kFlagBytes);
  fused_calls_.assign(static_cast<std::size_t>(world), 0);
  sm_counters_ = team.heap().allocate(sm_push_counter_bytes(world, chunks));  // zero, as sm_push needs
  for (int r : team.driven_ranks()) {
    team.use(r);
    preload_flag_gemm();  // the tile variants' GEMM: loaded now, not while peers wait
  }
  sync_ = make_sync(team, chunks);
  std::vector<GemmShape> shapes;
  if (k > 0) shapes = {{m, n / world, k, n}, {m / chunks, n / world, k, n}};
  warm_up(team, shapes);
  team.construction_done(fmt::format("GemmAllScatter m={} k={} n={} chunks={}", m, k, n, chunks));
}

GemmAllScatter::~GemmAllScatter() = default;

bf16* GemmAllScatter::output(int rank) const { return team_.heap().at<bf16>(c_, rank); }

void GemmAllScatter::run(int rank, const bf16* a, const bf16* b_shard, GemmAsVariant variant, hipStream_t stream,
                         int lanes) {
  require(k_ > 0, "GemmAllScatter::run: this object was built without a GEMM (k = 0): call scatter()");
  enqueue(rank, a, b_shard, variant, stream, lanes, /*with_gemm=*/true);
}

void GemmAllScatter::scatter(int rank, GemmAsVariant variant, hipStream_t stream) {
  require(variant == GemmAsVariant::ce_bulk || variant == GemmAsVariant::sm_bulk, [&] {
    return fmt::format(
        "GemmAllScatter::scatter: variant {} is a GEMM schedule; the All-Scatter alone runs ce-bulk or sm-bulk",
        to_string(variant));
  });
  enqueue(rank, nullptr, nullptr, variant, stream, 1, /*with_gemm=*/false);
}

void GemmAllScatter::enqueue(int rank, const bf16* a, const bf16* b_shard, GemmAsVariant variant, hipStream_t stream,
                             int lanes, bool with_gemm) {
  const int world = team_.world();
  const long block = n_ / world, rows = m_ / chunks_;
  require_call(team_, "GemmAllScatter", rank, lanes);
  require(!with_gemm || (a != nullptr && b_shard != nullptr), "GemmAllScatter: a and b_shard must be non-null");
  const bool fused = variant == GemmAsVariant::tile_fused || variant == GemmAsVariant::tile_specialized;
  require(!fused || (world <= FlagGemmParts::kMaxParts && reinterpret_cast<std::uintptr_t>(a) % 16 == 0 &&
                     reinterpret_cast<std::uintptr_t>(b_shard) % 16 == 0),
          [&] {
            return fmt::format("GemmAllScatter: {} needs at most {} ranks (got {}) and a, b_shard 16-byte aligned",
                               to_string(variant), FlagGemmParts::kMaxParts, world);
          });
  RankSync& s = *sync_[static_cast<std::size_t>(rank)];
  const std::uint64_t e = s.enter(stream);
  CallScope scope(s, stream);
  hipStream_t comm = team_.comm_stream(rank);
  auto arrived = [&](int owner, int from, int chunk) {
    return team_.heap().at<std::uint64_t>(flags_, owner) + static_cast<long>(from) * chunks_ + chunk;
  };
  auto released = [&](int owner, int from) {
    return team_.heap().at<std::uint64_t>(flags_, owner) + static_cast<long>(world) * chunks_ + from;
  };
  bf16* mine = output(rank);

  if (variant == GemmAsVariant::sm_bulk) {
    // This rank's block into its own C (no peer writes there), then one kernel on the caller's
    // stream: it announces the entry (released: the caller's earlier work on C is done), stores
    // the block into every peer's C once that peer has entered, raises the peer's arrived flags,
    // and ends once every peer's block has landed here.
    if (with_gemm) team_.blas(rank).gemm(stream, m_, block, k_, a, k_, b_shard, block, mine + rank * block, n_);
    SmPushFlags sm;
    sm.landed = arrived(rank, 0, 0);
    sm.freed = released(rank, 0);
    sm.entry[0] = released(rank, rank);  // this rank's own copy elects the announcing block
    sm.wait_landed = true;
    sm.all_peers_at_once = true;
    const std::size_t row_bytes = static_cast<std::size_t>(block) * sizeof(bf16);
    sm_push(team_.heap().view(rank), mine + rank * block, mine + rank * block,
            static_cast<std::size_t>(rows) * row_bytes, chunks_, sm, team_.heap().at<std::uint32_t>(sm_counters_, rank),
            e, team_.sm_count(rank), stream, row_bytes, static_cast<std::size_t>(n_) * sizeof(bf16));
    return;
  }
  // Everything the caller enqueued before this call (its use of the previous C, or anything it
  // wrote into C) is done on this rank: tell the peers they may write this epoch's blocks. The
  // flag carries this epoch, so even the first call waits for every peer to get here.
  for (int step = 1; step < world; ++step) write_flag(stream, released((rank + step) % world, rank), e);
  if (fused) {
    // The GEMM stores into every peer's C: it starts once every peer's caller is done with it.
    // Each tile is counted into the word [rank] of every rank (its own included), and this
    // rank's C is complete once every source's word holds calls x its columns.
    for (int step = 1; step < world; ++step) wait_flag(stream, released(rank, (rank + step) % world), e);
    const std::uint64_t calls = fused_calls_[static_cast<std::size_t>(rank)] + 1;
    FlagGemmParts copies;
    copies.count = 1;
    copies.copies = world;
    copies.rows = m_;
    for (int d = 0; d < world; ++d) {
      copies.c[d] = output(d) + rank * block;
      copies.done[d] = team_.heap().at<std::uint64_t>(fused_done_, d) + rank;
    }
    flag_gemm_parts(a, k_, b_shard, block, copies, n_, m_, block, k_, nullptr, 0, 0, nullptr, m_, stream,
                    variant == GemmAsVariant::tile_specialized ? FlagGemmKernel::persistent : FlagGemmKernel::best);
    fused_calls_[static_cast<std::size_t>(rank)] = calls;  // counted once its GEMM is launched
    const auto columns = static_cast<std::uint64_t>(block * flag_gemm_row_tiles(m_));
    for (int step = 1; step < world; ++step)
      wait_flag(stream, team_.heap().at<std::uint64_t>(fused_done_, rank) + (rank + step) % world, calls * columns);
    return;
  }
  CARAVAN_HIP_CHECK(hipEventRecord(s.start, stream));
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(comm, s.start, 0));
  for (int step = 1; step < world; ++step) wait_flag(comm, released(rank, (rank + step) % world), e);

  const int gemms = variant == GemmAsVariant::ce_push ? chunks_ : 1;
  const long gemm_rows = m_ / gemms;
  Lanes lane(team_, rank, s, stream, variant == GemmAsVariant::ce_push ? lanes : 1);
  for (int g = 0; g < gemms; ++g) {
    bf16* c0 = mine + static_cast<long>(g) * gemm_rows * n_ + rank * block;
    hipStream_t on = lane.stream(g);
    if (with_gemm)
      lane.blas(g).gemm(on, gemm_rows, block, k_, a + static_cast<long>(g) * gemm_rows * k_, k_, b_shard, block, c0,
                        n_);
    CARAVAN_HIP_CHECK(hipEventRecord(s.chunk[static_cast<std::size_t>(g)], on));
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(comm, s.chunk[static_cast<std::size_t>(g)], 0));
    const int first = variant == GemmAsVariant::ce_push ? g : 0,
              last = variant == GemmAsVariant::ce_push ? g + 1 : chunks_;
    for (int c = first; c < last; ++c) {
      for (int step = 1; step < world; ++step) {
        const int dst = (rank + step) % world;
        const long offset = static_cast<long>(c) * rows * n_ + rank * block;
        CARAVAN_HIP_CHECK(hipMemcpy2DAsync(output(dst) + offset, n_ * sizeof(bf16), mine + offset, n_ * sizeof(bf16),
                                           block * sizeof(bf16), rows, hipMemcpyDefault, comm));
        write_flag(comm, arrived(dst, rank, c), e);
      }
    }
  }
  CARAVAN_HIP_CHECK(hipEventRecord(s.comm_done, comm));
  lane.finish();
  for (int step = 1; step < world; ++step)
    for (int c = 0; c < chunks_; ++c) wait_flag(stream, arrived(rank, (rank + world - step) % world, c), e);
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, s.comm_done, 0));
}

// ---------------------------------------------------------------------------------------------
std::string_view to_string(ReduceScatterVariant v) {
  switch (v) {
    case ReduceScatterVariant::ce_push: return "ce-push";
    case ReduceScatterVariant::sm: return "sm";
    default: return "ll";
  }
}

namespace {
// ReduceScatter's shape in its own terms (GemmReduceScatter's checks would name m and k).
long checked_reduce_rows(long rows_per_rank, long cols, int world) {
  require(rows_per_rank > 0 && cols > 0, [&] {
    return fmt::format("ReduceScatter: rows per rank and cols must be positive, got {} and {}", rows_per_rank, cols);
  });
  require(cols % 8 == 0,
          [&] { return fmt::format("ReduceScatter: cols = {} must be a multiple of 8 (16-byte rows)", cols); });
  return rows_per_rank * world;
}

long checked_scatter_cols(long rows, long cols_per_rank, int chunks, int world) {
  require(rows > 0 && cols_per_rank > 0, [&] {
    return fmt::format("AllScatter: rows and cols per rank must be positive, got {} and {}", rows, cols_per_rank);
  });
  require(cols_per_rank % 8 == 0, [&] {
    return fmt::format("AllScatter: cols per rank = {} must be a multiple of 8 (16-byte rows)", cols_per_rank);
  });
  require(chunks >= 1 && rows % chunks == 0,
          [&] { return fmt::format("AllScatter: chunks = {} must be >= 1 and divide rows = {}", chunks, rows); });
  return cols_per_rank * world;
}
}  // namespace

ReduceScatter::ReduceScatter(GpuTeam& team, long rows_per_rank, long cols)
    : out_bytes_(static_cast<std::uint64_t>(rows_per_rank) * static_cast<std::uint64_t>(cols) * sizeof(bf16)),
      in_bytes_(out_bytes_ * static_cast<std::uint64_t>(team.world())),
      impl_(team, checked_reduce_rows(rows_per_rank, cols, team.world()), 0, cols) {}

void ReduceScatter::run(int rank, const bf16* in, bf16* out, ReduceScatterVariant variant, hipStream_t stream) {
  require(variant != ReduceScatterVariant::sm || sm(), [&] {
    return fmt::format(
        "ReduceScatter: sm needs twice its input ({} bytes a rank), and 1 MiB, free in the symmetric heap when the "
        "operation is constructed (CARAVAN_SYMMETRIC_HEAP_BYTES)",
        in_bytes_);
  });
  require(variant != ReduceScatterVariant::ll || low_latency(), [&] {
    return fmt::format("ReduceScatter: ll needs an output of at most {} bytes per rank, this one has {}", kLlMaxBytes,
                       out_bytes_);
  });
  GemmRsVariant as = GemmRsVariant::ll_bulk;
  switch (variant) {
    case ReduceScatterVariant::ce_push: as = GemmRsVariant::ce_bulk; break;
    case ReduceScatterVariant::sm: as = GemmRsVariant::sm_push; break;
    case ReduceScatterVariant::ll: as = GemmRsVariant::ll_bulk; break;
  }
  impl_.reduce_scatter(rank, in, out, as, stream);
}

AllScatter::AllScatter(GpuTeam& team, long rows, long cols_per_rank, int chunks)
    : cols_per_rank_(cols_per_rank),
      output_bytes_(static_cast<std::uint64_t>(rows) * static_cast<std::uint64_t>(cols_per_rank) *
                    static_cast<std::uint64_t>(team.world()) * sizeof(bf16)),
      impl_(team, rows, 0, checked_scatter_cols(rows, cols_per_rank, chunks, team.world()), chunks) {}

bf16* AllScatter::block(int rank) const { return impl_.output(rank) + rank * cols_per_rank_; }

std::string_view to_string(AllScatterVariant v) { return v == AllScatterVariant::sm ? "sm" : "ce-push"; }

AllScatterVariant AllScatter::automatic() const {
  return output_bytes_ <= AllGather::kSmMaxBytes ? AllScatterVariant::sm : AllScatterVariant::ce_push;
}

const bf16* AllScatter::run(int rank, AllScatterVariant variant, hipStream_t stream) {
  impl_.scatter(rank, variant == AllScatterVariant::sm ? GemmAsVariant::sm_bulk : GemmAsVariant::ce_bulk, stream);
  return impl_.output(rank);
}

// ---------------------------------------------------------------------------------------------
LowLatencyAllGather::LowLatencyAllGather(GpuTeam& team, std::size_t bytes_per_rank)
    : team_(team), bytes_(bytes_per_rank), early_launch_(settings::get_bool("CARAVAN_OVERLAP_GPU_EARLY_LAUNCH")),
      format_(ll_format(bytes_per_rank)) {
  require(bytes_per_rank > 0 && bytes_per_rank % 8 == 0 && bytes_per_rank <= kLlMaxBytes, [&] {
    return fmt::format("LowLatencyAllGather: bytes per rank must be a positive multiple of 8 up to {}, got {}",
                       kLlMaxBytes, bytes_per_rank);
  });
  lines_ = team.heap().allocate(ll_buffer_bytes(team.world(), bytes_per_rank));
  state_ = team.heap().allocate(sizeof(LlState));  // zero: epoch 0
  for (int r : team.driven_ranks()) {
    team.use(r);
    preload_kernels();
  }
  sync_ = make_sync(team, 0, /*pace=*/false);
  team.construction_done(fmt::format("LowLatencyAllGather bytes_per_rank={}", bytes_per_rank));
}

LowLatencyAllGather::~LowLatencyAllGather() = default;

LlFormat LowLatencyAllGather::format() const { return format_; }

void LowLatencyAllGather::run(int rank, const void* in, void* out, hipStream_t stream) {
  require_call(team_, "LowLatencyAllGather", rank, 1);
  require(reinterpret_cast<std::uintptr_t>(in) % 8 == 0 && reinterpret_cast<std::uintptr_t>(out) % 8 == 0,
          "LowLatencyAllGather::run: in and out must be 8-byte aligned");
  // The device-side epoch and block counter are shared by the rank's calls: keep them in order.
  RankSync& s = *sync_[static_cast<std::size_t>(rank)];
  s.enter(stream);
  ll_allgather(team_.heap().view(rank), in, bytes_, team_.heap().at(lines_, rank), out,
               team_.heap().at<LlState>(state_, rank), stream, early_launch_, format_);
}

}  // namespace caravan::gpu
