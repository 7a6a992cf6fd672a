// The GPU backend of `caravan bench overlap` (see bench_overlap.h): one process drives the GPUs
// of the node, one host thread per GPU ("rank"), as one process per GPU would. Every case
// measures, in the same run and on the same buffers:
//   - the baseline PyTorch+NCCL users run: NCCL collective and cuBLAS GEMM on one stream (bulk),
//     and each alone (their max is the ideal an overlapped version can reach);
//   - for AllGather+GEMM and GEMM+ReduceScatter, the GEMM beside the collective's bytes pushed by
//     plain copies (RawPushes): what those bytes arriving cost the GEMM on this machine;
//   - Caravan's variants (kernels/gpu/overlap.h), each first checked against a float32 cuBLAS
//     reference on fresh random inputs with its output poisoned (NaN) before the run.
// Times are per call, the slowest rank's, median and p10/p90 over the iterations.
#include "apps/caravan/bench_gpu_ranks.h"
#include "apps/caravan/bench_overlap.h"
#include "apps/caravan/bench_report.h"
#include "kernels/gpu/overlap.h"

#include <caravan/error.h>
#include <caravan/platform.h>
#include <caravan/settings.h>

#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>

namespace caravan::app {
namespace {

using gpu::bf16;

// What one rank thread has: its device, stream, NCCL communicator and timing events.
struct RankContext {
  int rank = 0;
  int world = 0;
  hipStream_t stream = nullptr;
  ncclComm_t nccl = nullptr;
  hipEvent_t begin = nullptr, end = nullptr;
  gpu::ErrorSums* sums = nullptr;
};

struct VariantResult {
  std::vector<double> ms;  // per iteration, the slowest rank
  std::vector<double> host_ms;  // per iteration, the slowest rank's host time to enqueue the call
  double rel_error = 0;
  bool checked = false;
  bool ok = true;
  std::string failure;
};

struct CaseRecord {
  std::string op, name;
  long m = 0, k = 0, n = 0;
  std::vector<std::pair<std::string, VariantResult>> variants;  // in registering order (measured in rounds)
  std::vector<std::string> notes;  // diagnostics printed under the table
  std::string baseline = "nccl-bulk";  // the row every ratio is against: NCCL + cuBLAS in bulk, or
                                       // for a collective alone NCCL's collective alone
  std::string automatic;               // the collectives alone: the variant their automatic() picks
};

// Everything the rank threads share while running one case.
class CaseRunner {
 public:
  CaseRunner(int world, const BenchOverlapArgs& args, RankBarrier& barrier)
      : world_(world), args_(args), barrier_(barrier), pending_(static_cast<std::size_t>(world)),
        per_rank_(static_cast<std::size_t>(world)), host_per_rank_(static_cast<std::size_t>(world)) {}

  ~CaseRunner() {
    for (auto& rank : pending_)
      for (Pending& p : rank)
        if (p.exec) (void)hipGraphExecDestroy(p.exec);
  }

  // Registers `body` as a variant of the case on this rank; run_rounds() times them. `check`
  // (optional) runs now, after `poison`, and returns the relative error on this rank.
  // With `graph`, the `repeat` calls of a sample are captured once into a graph per rank and
  // each sample replays it: launch costs leave the measurement (what a decode loop run as a
  // graph sees), for Caravan and the baseline alike. The checked run is then a replay too, so
  // what is timed is what is checked. `body` is called later: what it refers to must outlive
  // run_rounds().
  void measure(RankContext& ctx, const std::string& variant, const std::function<void()>& body,
               const std::function<void()>& poison, const std::function<double()>& check, int repeat = 1,
               bool graph = false) {
    hipGraphExec_t exec = nullptr;
    struct ExecGuard {
      hipGraphExec_t& exec;
      ~ExecGuard() {
        if (exec) (void)hipGraphExecDestroy(exec);
      }
    } exec_guard{exec};
    if (graph) {
      hipGraph_t captured = nullptr;
      CARAVAN_HIP_CHECK(hipStreamBeginCapture(ctx.stream, hipStreamCaptureModeThreadLocal));
      for (int r = 0; r < repeat; ++r) body();
      CARAVAN_HIP_CHECK(hipStreamEndCapture(ctx.stream, &captured));
      hipError_t status = hipGraphInstantiate(&exec, captured, nullptr, nullptr, 0);
      (void)hipGraphDestroy(captured);
      CARAVAN_HIP_CHECK(status);
    }
    double error = 0;
    bool checked = false;
    if (check && args_.check) {
      if (poison) poison();
      barrier_.arrive_and_wait();  // every rank's graph instantiated and output poisoned first
      if (exec) CARAVAN_HIP_CHECK(hipGraphLaunch(exec, ctx.stream));
      else body();
      CARAVAN_HIP_CHECK(hipEventRecord(ctx.end, ctx.stream));
      wait_event(ctx.end, fmt::format("rank {}: {} (checked run)", ctx.rank, variant));
      error = check();
      checked = true;
    }
    {
      std::lock_guard lock(mutex_);
      errors_[variant] = std::max(errors_[variant], error);
      if (checked) checked_[variant] = true;
    }
    pending_[static_cast<std::size_t>(ctx.rank)].push_back(Pending{variant, body, repeat, exec});
    exec = nullptr;  // the pending entry owns it now
  }

  // Times every registered variant, in rounds: each round runs each variant once, in the order
  // registered but starting one variant later than the round before, each call bracketed by a
  // barrier and device events; per call the slowest rank's time. Rounds rather than one variant after another: under
  // this sustained load the GPUs run at their power limit (2 x H200: 700 W, SM clocks near 1500 MHz instead of 1980,
  // warming from 36 to 61 C within the run), and measured one after another the variants measured last ran slower for
  // that alone (the tile GEMM, last: 1.12-1.24x cuBLAS's time; in rounds, 0.99-1.05x, as in bench gemm, which
  // alternates the two). Every rank registers the same variants in the same order.
  void run_rounds(RankContext& ctx) {
    auto& mine = pending_[static_cast<std::size_t>(ctx.rank)];
    auto& ms = per_rank_[static_cast<std::size_t>(ctx.rank)];
    auto& host = host_per_rank_[static_cast<std::size_t>(ctx.rank)];
    ms.assign(mine.size(), {});
    host.assign(mine.size(), {});
    for (int i = 0; i < args_.warmup + args_.iterations; ++i)
      for (std::size_t j = 0; j < mine.size(); ++j) {
        const std::size_t v = (static_cast<std::size_t>(i) + j) % mine.size();  // each round starts one later
        const Pending& p = mine[v];
        barrier_.arrive_and_wait();
        CARAVAN_HIP_CHECK(hipEventRecord(ctx.begin, ctx.stream));
        const auto enqueue_start = std::chrono::steady_clock::now();
        if (p.exec) CARAVAN_HIP_CHECK(hipGraphLaunch(p.exec, ctx.stream));
        else
          for (int r = 0; r < p.repeat; ++r) p.body();
        const double enqueue_ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - enqueue_start).count();
        CARAVAN_HIP_CHECK(hipEventRecord(ctx.end, ctx.stream));
        wait_event(ctx.end, fmt::format("rank {}: {}", ctx.rank, p.variant));
        float elapsed = 0;
        CARAVAN_HIP_CHECK(hipEventElapsedTime(&elapsed, ctx.begin, ctx.end));
        if (i >= args_.warmup) {
          ms[v].push_back(static_cast<double>(elapsed) / p.repeat);
          host[v].push_back(enqueue_ms / p.repeat);
        }
      }
    barrier_.arrive_and_wait();
    if (ctx.rank == 0) {
      for (std::size_t v = 0; v < mine.size(); ++v) {
        VariantResult result;
        for (int i = 0; i < args_.iterations; ++i) {
          double slowest = 0, enqueue = 0;
          for (std::size_t q = 0; q < per_rank_.size(); ++q) {
            slowest = std::max(slowest, per_rank_[q][v][static_cast<std::size_t>(i)]);
            enqueue = std::max(enqueue, host_per_rank_[q][v][static_cast<std::size_t>(i)]);
          }
          result.ms.push_back(slowest);
          result.host_ms.push_back(enqueue);
        }
        const std::string& variant = mine[v].variant;
        std::lock_guard lock(mutex_);
        result.rel_error = errors_[variant];
        result.checked = checked_[variant];
        result.ok = !result.checked || result.rel_error < kTolerance;
        if (!result.ok) result.failure = fmt::format("relative error {:.3g} >= {:.0e}", result.rel_error, kTolerance);
        record_.variants.emplace_back(variant, std::move(result));
      }
    }
    barrier_.arrive_and_wait();
    for (Pending& p : mine)
      if (p.exec) (void)hipGraphExecDestroy(p.exec);
    mine.clear();
  }

  CaseRecord& record() { return record_; }
  RankBarrier& barrier() { return barrier_; }
  static constexpr double kTolerance = 1e-2;

 private:
  int world_;
  const BenchOverlapArgs& args_;
  RankBarrier& barrier_;
  struct Pending {
    std::string variant;
    std::function<void()> body;
    int repeat = 1;
    hipGraphExec_t exec = nullptr;  // with `graph`: the captured calls, replayed per sample
  };
  std::vector<std::vector<Pending>> pending_;                  // [rank][variant]
  std::vector<std::vector<std::vector<double>>> per_rank_;       // [rank][variant][iteration], ms
  std::vector<std::vector<std::vector<double>>> host_per_rank_;  // the same, host ms to enqueue
  std::mutex mutex_;
  std::map<std::string, double> errors_;
  std::map<std::string, bool> checked_;
  CaseRecord record_;
};

// ||out - ref|| / ||ref|| on this rank; infinite when an element is not finite (never written).
double relative_error(RankContext& ctx, const bf16* out, long rows, long cols, long ld, const float* ref, long ref_ld) {
  return app::relative_error(out, rows, cols, ld, ref, ref_ld, ctx.sums, ctx.stream);
}

// Gathering and scattering move bytes unchanged: any difference at all is a failure (an error
// of at least 1, above every tolerance).
double exact_error(double relative) { return relative == 0 ? 0.0 : std::max(relative, 1.0); }

void poison(bf16* p, std::size_t count, hipStream_t stream) {
  CARAVAN_HIP_CHECK(hipMemsetAsync(p, 0xFF, count * sizeof(bf16), stream));  // 0xFFFF: a bf16 NaN
}

struct Shape {
  std::string name;
  long m, k, n;
};

// The tensor-parallel shapes of the measured reference (per rank; M = tokens), or the --shape
// values (the whole weights, split the same way).
std::vector<Shape> custom_shapes(const std::vector<OverlapShape>& custom, long tokens, long k_div, long n_div) {
  std::vector<Shape> out;
  for (const auto& c : custom) out.push_back({c.name, tokens, c.k / k_div, c.n / n_div});
  return out;
}
std::vector<Shape> ag_shapes(long tokens, int world, const std::vector<OverlapShape>& custom) {
  if (!custom.empty()) return custom_shapes(custom, tokens, 1, world);
  return {{"llama3-70B mlp-up", tokens, 8192, 2L * 28672 / world},
          {"llama3-8B mlp-up", tokens, 4096, 2L * 14336 / world},
          {"llama3-70B qkv", tokens, 8192, (8192L + 2 * 1024) / world}};
}
std::vector<Shape> rs_shapes(long tokens, int world, const std::vector<OverlapShape>& custom) {
  if (!custom.empty()) return custom_shapes(custom, tokens, world, 1);
  return {{"llama3-70B mlp-down", tokens, 28672L / world, 8192},
          {"llama3-8B mlp-down", tokens, 14336L / world, 4096},
          {"llama3-70B o-proj", tokens, 8192L / world, 8192}};
}
// GEMM + All-Scatter: n is the full output width, each rank computes n / world columns.
std::vector<Shape> as_shapes(long tokens, int, const std::vector<OverlapShape>& custom) {
  if (!custom.empty()) return custom_shapes(custom, tokens, 1, 1);
  return {{"llama3-70B qkv", tokens, 8192, 8192L + 2 * 1024}, {"llama3-8B mlp-up", tokens, 4096, 2L * 14336}};
}

// The row "gemm beside raw pushes": the GEMM on the rank's stream while a stream of its own
// pushes the collective's bytes to the peers with plain copy-engine copies (no flags, no
// reduction, nothing waiting on anything), joined back before the call ends. Its time is what
// the GEMM and those bytes take beside each other on this machine, which max(GEMM alone,
// collective alone) leaves out: an overlapped variant slower than this row loses time to its
// own schedule (waits, cut GEMMs), not to the traffic (docs/overlap.md, "What the bytes cost the
// GEMM"). Each rank lands the peers' bytes in a buffer of its own (`landing`, shared by the rank
// threads through `pointers`).
class RawPushes {
 public:
  RawPushes(RankContext& ctx, CaseRunner& runner, std::vector<bf16*>& pointers, std::size_t landing_elems)
      : landing_(make_buffer<bf16>(landing_elems)), pointers_(pointers), rank_(ctx.rank) {
    CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&side_, hipStreamNonBlocking));
    CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&fork_, hipEventDisableTiming));
    CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&join_, hipEventDisableTiming));
    pointers_[static_cast<std::size_t>(rank_)] = landing_.get();
    runner.barrier().arrive_and_wait();  // every rank's landing buffer known before any push
  }
  ~RawPushes() {
    (void)hipStreamDestroy(side_);
    (void)hipEventDestroy(fork_);
    (void)hipEventDestroy(join_);
  }
  RawPushes(const RawPushes&) = delete;
  RawPushes& operator=(const RawPushes&) = delete;

  // Enqueues `gemm` on `stream` beside, for each step 1..world-1, a copy of `bytes` from
  // source(peer) into peer's landing buffer at offset(peer) elements.
  template <typename Gemm, typename Source, typename Offset>
  void run(hipStream_t stream, int world, std::size_t bytes, const Gemm& gemm, const Source& source,
           const Offset& offset) {
    CARAVAN_HIP_CHECK(hipEventRecord(fork_, stream));
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(side_, fork_, 0));
    gemm();
    for (int step = 1; step < world; ++step) {
      const int peer = (rank_ + step) % world;
      CARAVAN_HIP_CHECK(hipMemcpyAsync(pointers_[static_cast<std::size_t>(peer)] + offset(peer), source(peer), bytes,
                                       hipMemcpyDefault, side_));
    }
    CARAVAN_HIP_CHECK(hipEventRecord(join_, side_));
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, join_, 0));
  }

 private:
  DeviceBuffer<bf16> landing_;
  std::vector<bf16*>& pointers_;
  int rank_;
  hipStream_t side_ = nullptr;
  hipEvent_t fork_ = nullptr, join_ = nullptr;
};
constexpr const char* kBesideRawPushes = "gemm beside raw pushes";

class OverlapBench {
 public:
  OverlapBench(const BenchOverlapArgs& args, int world) : args_(args), world_(world), barrier_(world) {
    std::vector<int> devices(static_cast<std::size_t>(world));
    for (int d = 0; d < world; ++d) devices[static_cast<std::size_t>(d)] = d;
    team_ = std::make_unique<gpu::GpuTeam>(devices, kHeapBytes);
    comms_.resize(static_cast<std::size_t>(world));
    CARAVAN_NCCL_CHECK(ncclCommInitAll(comms_.data(), world, devices.data()));
    seed_ = std::random_device{}() | (static_cast<std::uint64_t>(std::random_device{}()) << 32);
  }
  ~OverlapBench() {
    for (auto c : comms_) (void)ncclCommDestroy(c);
  }

  std::uint64_t seed() const { return seed_; }

  // Runs `body(ctx, runner)` on one thread per rank; returns the case's record.
  CaseRecord run_case(const std::string& op, const Shape& shape,
                      const std::function<void(RankContext&, CaseRunner&)>& body) {
    CaseRunner runner(world_, args_, barrier_);
    runner.record().op = op;
    runner.record().name = shape.name;
    runner.record().m = shape.m;
    runner.record().k = shape.k;
    runner.record().n = shape.n;
    std::vector<std::thread> threads;
    std::mutex failure_mutex;
    std::string failure;
    for (int r = 0; r < world_; ++r) {
      threads.emplace_back([&, r] {
        RankContext ctx;
        ctx.rank = r;
        ctx.world = world_;
        ctx.nccl = comms_[static_cast<std::size_t>(r)];
        try {
          team_->use(r);
          CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&ctx.stream, hipStreamNonBlocking));
          CARAVAN_HIP_CHECK(hipEventCreate(&ctx.begin));
          CARAVAN_HIP_CHECK(hipEventCreate(&ctx.end));
          auto sums = make_buffer<gpu::ErrorSums>(1);
          ctx.sums = sums.get();
          body(ctx, runner);
          CARAVAN_HIP_CHECK(hipStreamSynchronize(ctx.stream));
        } catch (const std::exception& e) {
          barrier_.break_all();
          std::lock_guard lock(failure_mutex);
          if (failure.empty() || failure.find("another rank failed") != std::string::npos)
            failure = fmt::format("rank {}: {}", r, e.what());
        }
        if (ctx.stream) (void)hipStreamDestroy(ctx.stream);
        if (ctx.begin) (void)hipEventDestroy(ctx.begin);
        if (ctx.end) (void)hipEventDestroy(ctx.end);
      });
    }
    for (auto& t : threads) t.join();
    if (!failure.empty())
      throw Error(Errc::device, fmt::format("{} {} (M={} K={} N={}): {}", op, shape.name, shape.m, shape.k, shape.n, failure));
    return std::move(runner.record());
  }

  gpu::GpuTeam& team() { return *team_; }
  const BenchOverlapArgs& args() const { return args_; }
  int world() const { return world_; }

 private:
  static constexpr std::uint64_t kHeapBytes = 4ull << 30;
  const BenchOverlapArgs& args_;
  int world_;
  RankBarrier barrier_;
  std::unique_ptr<gpu::GpuTeam> team_;
  std::vector<ncclComm_t> comms_;
  std::uint64_t seed_ = 0;
};

// `--stamps`: calls traced by device events (gpu::ChunkTrace: GemmReduceScatter::set_ring_trace,
// AllGatherGemm::set_trace), in microseconds after each call's start on its rank's GPU: per rank
// and call, for each chunk c ready[c], gemm_done[c] and pushed[c] (negative: no such copy), then
// the call's end.
struct ChunkTimeline {
  std::string variant;
  int splits = 1;
  bool ring = false;  // chunks of a ring (steps round the ranks), else AllGatherGemm's chunk GEMMs
  std::vector<std::vector<std::vector<double>>> per_rank;  // [rank][call][3 x chunks + 1]
};

// Runs `call` warm-up + iterations times on this rank, each between barriers and waited for,
// with a trace set through set(&trace) (and unset after), and keeps the times of the timed calls.
template <typename Set, typename Call>
void trace_calls(RankContext& ctx, CaseRunner& runner, const BenchOverlapArgs& args, ChunkTimeline& timeline,
                 const Set& set, const Call& call) {
  const std::size_t chunks = static_cast<std::size_t>(ctx.world) * static_cast<std::size_t>(timeline.splits);
  const std::size_t copies = chunks - static_cast<std::size_t>(timeline.splits);  // either way, world - 1 x splits
  gpu::ChunkTrace trace;
  trace.ready.resize(chunks), trace.gemm_done.resize(chunks), trace.pushed.resize(chunks);
  std::vector<hipEvent_t*> all{&trace.start};
  for (auto* events : {&trace.ready, &trace.gemm_done, &trace.pushed})
    for (hipEvent_t& e : *events) all.push_back(&e);
  struct Owned {
    std::vector<hipEvent_t*>& all;
    ~Owned() {
      for (hipEvent_t* e : all)
        if (*e) (void)hipEventDestroy(*e);
    }
  } owned{all};
  for (hipEvent_t* e : all) CARAVAN_HIP_CHECK(hipEventCreate(e));
  set(&trace);
  auto& mine = timeline.per_rank[static_cast<std::size_t>(ctx.rank)];
  auto since_start = [&](hipEvent_t e) {
    float ms = 0;
    CARAVAN_HIP_CHECK(hipEventElapsedTime(&ms, trace.start, e));
    return static_cast<double>(ms) * 1e3;
  };
  for (int i = 0; i < args.warmup + args.iterations; ++i) {
    runner.barrier().arrive_and_wait();
    call();
    CARAVAN_HIP_CHECK(hipEventRecord(ctx.end, ctx.stream));
    wait_event(ctx.end, fmt::format("rank {}: traced {}", ctx.rank, timeline.variant));
    if (i < args.warmup) continue;
    std::vector<double> times(3 * chunks + 1, -1.0);
    for (std::size_t c = 0; c < chunks; ++c) {
      times[c] = since_start(trace.ready[c]);
      times[chunks + c] = since_start(trace.gemm_done[c]);
      if (c < copies) times[2 * chunks + c] = since_start(trace.pushed[c]);
    }
    times[3 * chunks] = since_start(ctx.end);
    mine.push_back(std::move(times));
  }
  set(nullptr);
}

// One line per rank and chunk, medians over the calls: when its lane got past the wait for its
// data, when its GEMM finished, and (a ring) when its push landed; an AllGather's copies on a
// line of their own; and the call's end. A chunk whose `ready` is well after the previous
// chunk's `GEMM done` on its lane (chunks alternate over 2 lanes) waited for data.
std::vector<std::string> describe_timeline(const ChunkTimeline& t) {
  std::vector<std::string> lines;
  const std::size_t world = t.per_rank.size(), splits = static_cast<std::size_t>(t.splits);
  const std::size_t chunks = world * splits;
  auto med = [&](std::size_t r, std::size_t index) {
    std::vector<double> v;
    for (const auto& call : t.per_rank[r]) v.push_back(call[index]);
    return summarize(v).median;
  };
  for (std::size_t r = 0; r < world; ++r) {
    if (t.per_rank[r].empty()) continue;
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t step = c / splits, part = c % splits;
      // A ring's step t works on the rows of rank r - t - 1; AllGatherGemm's pushed shards reach
      // this rank from rank - 1 first (step 0 is its own).
      const std::size_t rows_of = t.ring ? (r + 2 * world - step - 1) % world : (r + world - step) % world;
      const double pushed = t.ring ? med(r, 2 * chunks + c) : -1;
      lines.push_back(fmt::format("{} timeline, rank {} {} {} (rows of rank {}) part {}: ready {:.1f}, GEMM done {:.1f}{} us",
                                  t.variant, r, t.ring ? "step" : "chunk", t.ring ? step : c, rows_of, part, med(r, c),
                                  med(r, chunks + c), pushed < 0 ? "" : fmt::format(", pushed {:.1f}", pushed)));
    }
    if (!t.ring && med(r, 2 * chunks) >= 0) {
      std::string copies;
      for (std::size_t j = 0; j < chunks - splits; ++j)
        copies += fmt::format("{}{:.1f}", j ? ", " : "", med(r, 2 * chunks + j));
      lines.push_back(fmt::format("{} timeline, rank {}: its copies to rank+1, rank+2, ... done at {} us", t.variant, r, copies));
    }
    lines.push_back(fmt::format("{} timeline, rank {}: call done {:.1f} us after its start (median of {} calls)", t.variant, r,
                                med(r, 3 * chunks), t.per_rank[r].size()));
  }
  return lines;
}

// ---- AllGather + GEMM -------------------------------------------------------------------------
CaseRecord run_ag_gemm(OverlapBench& bench, const Shape& s) {
  const int world = bench.world();
  const std::uint64_t seed_a = bench.seed() ^ 0xA11A, seed_b = bench.seed() ^ 0xB22B;
  HeapScope heap_scope(bench.team().heap(), "bench overlap");
  gpu::AllGatherGemm pulled(bench.team(), s.m, s.k, s.n, 1);
  gpu::AllGatherGemm split(bench.team(), s.m, s.k, s.n, 2);
  std::vector<bf16*> landing(static_cast<std::size_t>(world));
  ChunkTimeline traced{"ce-push 2 lanes", 1, false, {}};
  traced.per_rank.resize(static_cast<std::size_t>(world));
  CaseRecord record = bench.run_case("AG+GEMM", s, [&](RankContext& ctx, CaseRunner& runner) {
    const int r = ctx.rank;
    const long shard_rows = s.m / world;
    gpu::Blas& blas = bench.team().blas(r);
    auto a_full = make_buffer<bf16>(static_cast<std::size_t>(s.m) * s.k);  // NCCL's gather target
    auto b = make_buffer<bf16>(static_cast<std::size_t>(s.k) * s.n);
    auto c = make_buffer<bf16>(static_cast<std::size_t>(s.m) * s.n);
    gpu::fill_random(b.get(), s.k, s.n, s.n, seed_b + r, 0, 0, 1.0f, ctx.stream);
    bf16* nccl_shard = a_full.get() + r * shard_rows * s.k;
    gpu::fill_random(nccl_shard, shard_rows, s.k, s.k, seed_a, r * shard_rows, 0, 1.0f, ctx.stream);
    for (auto* op : {&pulled, &split})
      gpu::fill_random(op->shard(r), shard_rows, s.k, s.k, seed_a, r * shard_rows, 0, 1.0f, ctx.stream);
    // The float32 reference: all of A (any rank can regenerate it) times this rank's B.
    DeviceBuffer<float> ref;
    if (bench.args().check) {
      auto a32 = make_buffer<float>(static_cast<std::size_t>(s.m) * s.k);
      auto b32 = make_buffer<float>(static_cast<std::size_t>(s.k) * s.n);
      ref = make_buffer<float>(static_cast<std::size_t>(s.m) * s.n);
      gpu::fill_random(a32.get(), s.m, s.k, s.k, seed_a, 0, 0, 1.0f, ctx.stream);
      gpu::fill_random(b32.get(), s.k, s.n, s.n, seed_b + r, 0, 0, 1.0f, ctx.stream);
      blas.gemm_reference(ctx.stream, s.m, s.n, s.k, a32.get(), s.k, b32.get(), s.n, ref.get(), s.n);
      CARAVAN_HIP_CHECK(hipStreamSynchronize(ctx.stream));
    }
    const std::size_t c_count = static_cast<std::size_t>(s.m) * s.n;
    auto poison_c = [&] { poison(c.get(), c_count, ctx.stream); };
    auto check_c = [&] { return relative_error(ctx, c.get(), s.m, s.n, s.n, ref.get(), s.n); };
    auto nccl_gather = [&] {
      CARAVAN_NCCL_CHECK(ncclAllGather(nccl_shard, a_full.get(), static_cast<std::size_t>(shard_rows) * s.k, ncclBfloat16,
                                       ctx.nccl, ctx.stream));
    };
    blas.tune(s.m, s.n, s.k, s.k, s.n,
              s.n);  // as the operation's warm-up did (a no-op then): baseline and variants alike
    auto gemm_full = [&] { blas.gemm(ctx.stream, s.m, s.n, s.k, a_full.get(), s.k, b.get(), s.n, c.get(), s.n); };
    runner.measure(ctx, "nccl-bulk", [&] { nccl_gather(); gemm_full(); }, poison_c, check_c);
    runner.measure(ctx, "gemm-alone", gemm_full, {}, {});
    runner.measure(ctx, "nccl-allgather-alone", nccl_gather, {}, {});
    // This rank's shard pushed into every peer's landing buffer at its rows, beside the GEMM.
    RawPushes raw(ctx, runner, landing, static_cast<std::size_t>(s.m) * s.k);
    const std::size_t shard_elems = static_cast<std::size_t>(shard_rows) * s.k;
    runner.measure(ctx, kBesideRawPushes, [&] {
      raw.run(ctx.stream, world, shard_elems * sizeof(bf16), gemm_full, [&](int) { return nccl_shard; },
              [&](int) { return static_cast<std::size_t>(r) * shard_elems; });
    }, {}, {});
    for (auto variant : {gpu::AgGemmVariant::ce_bulk, gpu::AgGemmVariant::ce_pull, gpu::AgGemmVariant::ce_push})
      runner.measure(ctx, std::string(gpu::to_string(variant)),
                     [&, variant] { pulled.run(r, b.get(), c.get(), variant, ctx.stream); }, poison_c, check_c);
    runner.measure(ctx, "ce-pull x2 chunks", [&] { split.run(r, b.get(), c.get(), gpu::AgGemmVariant::ce_pull, ctx.stream); },
                   poison_c, check_c);
    for (auto variant : {gpu::AgGemmVariant::ce_pull, gpu::AgGemmVariant::ce_push})
      runner.measure(ctx, std::string(gpu::to_string(variant)) + " 2 lanes",
                     [&, variant] { pulled.run(r, b.get(), c.get(), variant, ctx.stream, 2); }, poison_c, check_c);
    runner.measure(ctx, "ce-push x2 chunks 2 lanes",
                   [&] { split.run(r, b.get(), c.get(), gpu::AgGemmVariant::ce_push, ctx.stream, 2); }, poison_c, check_c);
    if (pulled.low_latency())
      runner.measure(ctx, "ll-bulk", [&] { pulled.run(r, b.get(), c.get(), gpu::AgGemmVariant::ll_bulk, ctx.stream); },
                     poison_c, check_c);
    for (int lanes : {1, 2})
      for (auto variant : {gpu::AgGemmVariant::ce_pull_runs, gpu::AgGemmVariant::ce_push_runs})
        runner.measure(ctx, std::string(gpu::to_string(variant)) + (lanes == 2 ? " 2 lanes" : ""),
                       [&, variant, lanes] { pulled.run(r, b.get(), c.get(), variant, ctx.stream, lanes); }, poison_c, check_c);
    for (auto variant : {gpu::AgGemmVariant::tile_pull, gpu::AgGemmVariant::tile_push, gpu::AgGemmVariant::sm_bulk,
                         gpu::AgGemmVariant::sm_push})
      runner.measure(ctx, std::string(gpu::to_string(variant)),
                     [&, variant] { pulled.run(r, b.get(), c.get(), variant, ctx.stream); }, poison_c, check_c);
    runner.measure(ctx, "sm-push 2 lanes",
                   [&] { pulled.run(r, b.get(), c.get(), gpu::AgGemmVariant::sm_push, ctx.stream, 2); }, poison_c, check_c);
    runner.measure(ctx, "sm-push x2 chunks 2 lanes",
                   [&] { split.run(r, b.get(), c.get(), gpu::AgGemmVariant::sm_push, ctx.stream, 2); }, poison_c, check_c);
    // Diagnostic: the tile-level GEMM by itself (no flags, no communication), to compare with cuBLAS
    // ("gemm-alone"; not named "alone": those rows make the ideal).
    runner.measure(ctx, "flag-gemm only, no comm", [&] {
      gpu::flag_gemm(a_full.get(), s.k, b.get(), s.n, c.get(), s.n, s.m, s.n, s.k, nullptr, 0, 0, nullptr, nullptr, 0,
                     ctx.stream);
    }, {}, {});
    // Diagnostic: what cutting the GEMM into per-shard chunks costs without any communication.
    runner.measure(ctx, fmt::format("gemm in {} chunks, no comm", world), [&] {
      for (int q = 0; q < world; ++q)
        blas.gemm(ctx.stream, shard_rows, s.n, s.k, a_full.get() + q * shard_rows * s.k, s.k, b.get(), s.n,
                  c.get() + q * shard_rows * s.n, s.n);
    }, {}, {});
    if (bench.args().stamps)  // outside the timed rounds, in the same order on every rank
      trace_calls(ctx, runner, bench.args(), traced, [&](gpu::ChunkTrace* t) { pulled.set_trace(r, t); },
                  [&] { pulled.run(r, b.get(), c.get(), gpu::AgGemmVariant::ce_push, ctx.stream, 2); });
    runner.run_rounds(ctx);
  });
  if (bench.args().stamps)
    for (std::string& line : describe_timeline(traced)) record.notes.push_back(std::move(line));
  return record;
}

// ---- GEMM + ReduceScatter ---------------------------------------------------------------------
// `--stamps`: GEMM+RS calls timed phase by phase on each GPU's %globaltimer. Per call and rank,
// the words are: the call's start (a stamp kernel before it), the GEMM's end (a stamp kernel after
// it), the exchange kernel's own stamps (kernels.h: stamp_word; zero for NCCL), and the end.
struct StampedCalls {
  static constexpr int kStart = 0, kAfterGemm = 1, kExchange = 2, kEnd = kExchange + gpu::stamp_word::count, kWords = kEnd + 1;
  using Words = std::array<std::uint64_t, kWords>;
  std::vector<std::vector<Words>> per_rank;  // [rank][iteration]
};

// Medians over the calls, in microseconds, of where each variant's time went, each the slowest
// rank's. Every figure is a difference of two stamps of one GPU: the GPUs' timers disagree (by
// 50-200 us on 4 x H200), which the last figure shows ("waited" on a rank minus the latest
// "signalled" of its peers cannot be negative on one clock).
std::vector<std::string> describe_stamps(const std::string& variant, const StampedCalls& calls) {
  using W = StampedCalls;
  namespace sw = gpu::stamp_word;
  const std::size_t world = calls.per_rank.size(), n = calls.per_rank.front().size();
  // Subtracted as integers: the timer counts nanoseconds since 1970, where a double's step is 256 ns.
  auto us = [](std::uint64_t later, std::uint64_t earlier) {
    return static_cast<double>(static_cast<std::int64_t>(later - earlier)) / 1e3;
  };
  auto med = [](std::vector<double> v) { return summarize(v).median; };
  const bool exchange = calls.per_rank.front().front()[W::kExchange + sw::entry_last] != 0;
  std::vector<double> gemm, in_situ, total, launch, started, stored, signalled, waited, reduce, timer_check;
  for (std::size_t i = 0; i < n; ++i) {
    double gemm_i = 0, situ_i = 0, total_i = 0, launch_i = 0, started_i = 0, stored_i = 0, sig_i = 0, wait_i = 0, reduce_i = 0;
    double check_i = 1e300;
    for (std::size_t r = 0; r < world; ++r) {
      const W::Words& w = calls.per_rank[r][i];
      gemm_i = std::max(gemm_i, us(w[W::kAfterGemm], w[W::kStart]));
      situ_i = std::max(situ_i, us(w[W::kEnd], w[W::kAfterGemm]));
      total_i = std::max(total_i, us(w[W::kEnd], w[W::kStart]));
      if (!exchange) continue;
      const std::uint64_t first = ~w[W::kExchange + sw::entry_first];
      launch_i = std::max(launch_i, us(first, w[W::kAfterGemm]));
      started_i = std::max(started_i, us(w[W::kExchange + sw::entry_last], first));
      if (w[W::kExchange + sw::stored]) stored_i = std::max(stored_i, us(w[W::kExchange + sw::stored], first));
      sig_i = std::max(sig_i, us(w[W::kExchange + sw::signalled], first));
      wait_i = std::max(wait_i, us(w[W::kExchange + sw::waited], first));
      reduce_i = std::max(reduce_i, us(w[W::kExchange + sw::done], w[W::kExchange + sw::waited]));
      std::uint64_t peers_signalled = 0;
      for (std::size_t q = 0; q < world; ++q)
        if (q != r) peers_signalled = std::max(peers_signalled, calls.per_rank[q][i][W::kExchange + sw::signalled]);
      check_i = std::min(check_i, us(w[W::kExchange + sw::waited], peers_signalled));
    }
    gemm.push_back(gemm_i);
    in_situ.push_back(situ_i);
    total.push_back(total_i);
    if (exchange) {
      launch.push_back(launch_i);
      started.push_back(started_i);
      stored.push_back(stored_i);
      signalled.push_back(sig_i);
      waited.push_back(wait_i);
      reduce.push_back(reduce_i);
      timer_check.push_back(check_i);
    }
  }
  std::vector<std::string> out;
  out.push_back(fmt::format("stamps {}: total {:.1f} us = GEMM {:.1f} + after the GEMM {:.1f} (slowest rank each; medians of {} "
                            "calls)",
                            variant, med(total), med(gemm), med(in_situ), n));
  if (exchange)
    out.push_back(fmt::format("stamps {} exchange kernel: first block {:.1f} us after the GEMM mark; from it: last block started "
                              "{:.1f}, {}signalled {:.1f} (stores landed, peers told), waited {:.1f} (the peers included), then "
                              "sums {:.1f}; timer check {:.1f} (negative: the GPUs' timers disagree, so no figure compares two "
                              "GPUs)",
                              variant, med(launch), med(started),
                              med(stored) > 0 ? fmt::format("stores issued {:.1f}, ", med(stored)) : std::string(),
                              med(signalled), med(waited), med(reduce), med(timer_check)));
  return out;
}

// The push size of the grouped ring row (see run_gemm_rs).
constexpr std::uint64_t kRingGroupBytes = std::uint64_t{16} << 20;

CaseRecord run_gemm_rs(OverlapBench& bench, const Shape& s) {
  const int world = bench.world();
  const std::uint64_t seed_a = bench.seed() ^ 0xC33C, seed_b = bench.seed() ^ 0xD44D;
  HeapScope heap_scope(bench.team().heap(), "bench overlap");
  gpu::GemmReduceScatter op(bench.team(), s.m, s.k, s.n);
  gpu::GemmReduceScatter split(bench.team(), s.m, s.k, s.n, 2);
  // tile-scatter sums its rows in `splits` ranges as they land: 4 where the rows divide so.
  std::unique_ptr<gpu::GemmReduceScatter> split4;
  if (s.m % (4L * world) == 0) split4 = std::make_unique<gpu::GemmReduceScatter>(bench.team(), s.m, s.k, s.n, 4);
  // Diagnostics of sm-pull's two halves (where op.pull()): its GEMM into symmetric memory, and
  // its exchange alone (partials left as they are, flags and epochs of their own).
  SymmetricRegion diag_partial, diag_flags;
  if (op.pull()) {
    diag_partial = bench.team().heap().allocate(static_cast<std::uint64_t>(s.m) * s.n * sizeof(bf16));
    diag_flags = bench.team().heap().allocate(static_cast<std::uint64_t>(world) * sizeof(std::uint64_t));
  }
  // Diagnostic of tile-scatter's GEMM: the same tile GEMM storing each destination's rows into
  // that destination's memory (a region of its own), against the same GEMM storing locally.
  std::vector<bf16*> landing(static_cast<std::size_t>(world));
  SymmetricRegion diag_scatter;
  const std::uint64_t scatter_bytes = static_cast<std::uint64_t>(s.m) * s.n * sizeof(bf16);
  if (op.scatter() && world <= gpu::FlagGemmParts::kMaxParts &&
      bench.team().heap().capacity() - bench.team().heap().used() >= scatter_bytes + (1u << 20))
    diag_scatter = bench.team().heap().allocate(scatter_bytes);
  StampedCalls stamped_nccl, stamped_push, stamped_pull;
  for (StampedCalls* c : {&stamped_nccl, &stamped_push, &stamped_pull}) c->per_rank.resize(static_cast<std::size_t>(world));
  ChunkTimeline ring_x2{"ce-ring x2 parts 2 lanes", 2, true, {}}, ring_x4{"ce-ring x4 parts 2 lanes", 4, true, {}};
  for (ChunkTimeline* t : {&ring_x2, &ring_x4}) t->per_rank.resize(static_cast<std::size_t>(world));
  CaseRecord record = bench.run_case("GEMM+RS", s, [&](RankContext& ctx, CaseRunner& runner) {
    const int r = ctx.rank;
    const long rows = s.m / world;
    gpu::Blas& blas = bench.team().blas(r);
    auto a = make_buffer<bf16>(static_cast<std::size_t>(s.m) * s.k);
    auto b = make_buffer<bf16>(static_cast<std::size_t>(s.k) * s.n);
    auto partial = make_buffer<bf16>(static_cast<std::size_t>(s.m) * s.n);
    auto out = make_buffer<bf16>(static_cast<std::size_t>(rows) * s.n);
    gpu::fill_random(a.get(), s.m, s.k, s.k, seed_a + r, 0, 0, 1.0f, ctx.stream);
    gpu::fill_random(b.get(), s.k, s.n, s.n, seed_b + r, 0, 0, 1.0f, ctx.stream);
    DeviceBuffer<float> ref;
    if (bench.args().check) {
      // out_r = [A_0 | A_1 | ...](rows of r) x [B_0; B_1; ...]: one float32 GEMM over K x world.
      const long kk = s.k * world;
      auto a32 = make_buffer<float>(static_cast<std::size_t>(rows) * kk);
      auto b32 = make_buffer<float>(static_cast<std::size_t>(kk) * s.n);
      ref = make_buffer<float>(static_cast<std::size_t>(rows) * s.n);
      for (int q = 0; q < world; ++q) {
        gpu::fill_random(a32.get() + q * s.k, rows, s.k, kk, seed_a + q, r * rows, 0, 1.0f, ctx.stream);
        gpu::fill_random(b32.get() + q * s.k * s.n, s.k, s.n, s.n, seed_b + q, 0, 0, 1.0f, ctx.stream);
      }
      blas.gemm_reference(ctx.stream, rows, s.n, kk, a32.get(), kk, b32.get(), s.n, ref.get(), s.n);
      CARAVAN_HIP_CHECK(hipStreamSynchronize(ctx.stream));
    }
    const std::size_t out_count = static_cast<std::size_t>(rows) * s.n;
    auto poison_out = [&] { poison(out.get(), out_count, ctx.stream); };
    auto check_out = [&] { return relative_error(ctx, out.get(), rows, s.n, s.n, ref.get(), s.n); };
    blas.tune(s.m, s.n, s.k, s.k, s.n,
              s.n);  // as the operation's warm-up did (a no-op then): baseline and variants alike
    auto gemm_full = [&] { blas.gemm(ctx.stream, s.m, s.n, s.k, a.get(), s.k, b.get(), s.n, partial.get(), s.n); };
    auto nccl_rs = [&] {
      CARAVAN_NCCL_CHECK(ncclReduceScatter(partial.get(), out.get(), out_count, ncclBfloat16, ncclSum, ctx.nccl, ctx.stream));
    };
    runner.measure(ctx, "nccl-bulk", [&] { gemm_full(); nccl_rs(); }, poison_out, check_out);
    runner.measure(ctx, "gemm-alone", gemm_full, {}, {});
    runner.measure(ctx, "nccl-reducescatter-alone", nccl_rs, {}, {});
    // Each peer's rows of the partial pushed into that peer's landing buffer (slot r), beside
    // the GEMM writing them (the bytes are not used: only their traffic is timed).
    RawPushes raw(ctx, runner, landing, static_cast<std::size_t>(s.m) * s.n);
    runner.measure(ctx, kBesideRawPushes, [&] {
      raw.run(ctx.stream, world, out_count * sizeof(bf16), gemm_full,
              [&](int peer) { return partial.get() + static_cast<std::size_t>(peer) * out_count; },
              [&](int) { return static_cast<std::size_t>(r) * out_count; });
    }, {}, {});
    for (auto variant : {gpu::GemmRsVariant::ce_bulk, gpu::GemmRsVariant::ce_push})
      runner.measure(ctx, std::string(gpu::to_string(variant)),
                     [&, variant] { op.run(r, a.get(), b.get(), out.get(), variant, ctx.stream); }, poison_out, check_out);
    runner.measure(ctx, "ce-push 2 lanes",
                   [&] { op.run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::ce_push, ctx.stream, 2); }, poison_out,
                   check_out);
    for (int lanes : {1, 2})
      runner.measure(ctx, std::string("ce-push x2 parts") + (lanes == 2 ? " 2 lanes" : ""),
                     [&, lanes] { split.run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::ce_push, ctx.stream, lanes); },
                     poison_out, check_out);
    if (split4)  // with 2 lanes, each part of this rank's rows is summed beside the next part's GEMM
      runner.measure(
          ctx, "ce-push x4 parts 2 lanes",
          [&] { split4->run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::ce_push, ctx.stream, 2); }, poison_out,
          check_out);
    // The ring: each destination's rows summed inside the GEMMs on their way round, nothing after
    // the last GEMM. Parts keep a push ahead of the neighbour's GEMM that adds to it.
    const std::pair<const char*, gpu::GemmReduceScatter*> rings[] = {
        {"ce-ring x2 parts", &split}, {"ce-ring x4 parts", split4.get()}};
    for (const auto& [name, ring_op] : rings)
      for (int lanes : {1, 2})
        if (ring_op)
          runner.measure(ctx, std::string(name) + (lanes == 2 ? " 2 lanes" : ""),
                         [&, ring_op, lanes] {
                           ring_op->run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::ce_ring, ctx.stream, lanes);
                         },
                         poison_out, check_out);
    // The x4 ring pushing 16 MiB at a time where its parts are smaller (o-proj at TP 4 has 8 MiB
    // parts): the flag after each push costs about 4 us beside the GEMM (thirty-third session,
    // docs/overlap-sessions.md), so fewer, larger pushes may keep the ring nearer its GEMMs. The
    // same on every rank (the parts are), so every rank measures it or none.
    if (split4) {
      const int configured_group = split4->ring_push_group(r);
      split4->set_ring_push_bytes(r, kRingGroupBytes);
      if (split4->ring_push_group(r) != configured_group)
        runner.measure(
            ctx, "ce-ring x4 parts 2 lanes 16M pushes",
            [&] { split4->run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::ce_ring, ctx.stream, 2); },
            poison_out, check_out);
      split4->set_ring_push_bytes(r, settings::get_bytes("CARAVAN_OVERLAP_GPU_RING_PUSH_BYTES"));
    }
    runner.measure(ctx, "tile-push",
                   [&] { op.run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::tile_push, ctx.stream); }, poison_out,
                   check_out);
    runner.measure(ctx, "tile-push x2 parts",
                   [&] { split.run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::tile_push, ctx.stream); },
                   poison_out, check_out);
    const std::pair<const char*, gpu::GemmReduceScatter*> scatters[] = {
        {"tile-scatter", &op}, {"tile-scatter x2 parts", &split}, {"tile-scatter x4 parts", split4.get()}};
    for (const auto& [name, scatter_op] : scatters)
      if (scatter_op != nullptr && scatter_op->scatter())
        runner.measure(
            ctx, name,
            [&, scatter_op] {
              scatter_op->run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::tile_scatter, ctx.stream);
            },
            poison_out, check_out);
    const std::tuple<const char*, gpu::GemmReduceScatter*, int> blas_scatters[] = {
        {"blas-scatter", &op, 1},
        {"blas-scatter 2 lanes", &op, 2},
        {"blas-scatter x2 parts 2 lanes", &split, 2},
        {"blas-scatter x4 parts 2 lanes", split4.get(), 2}};
    for (const auto& [name, scatter_op, lanes] : blas_scatters)
      if (scatter_op != nullptr && scatter_op->scatter())
        runner.measure(
            ctx, name,
            [&, scatter_op, lanes] {
              scatter_op->run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::blas_scatter, ctx.stream, lanes);
            },
            poison_out, check_out);
    if (diag_scatter.bytes > 0) {
      gpu::FlagGemmParts parts;
      parts.count = world;
      parts.rows = rows;
      for (int d = 0; d < world; ++d) parts.c[d] = bench.team().heap().at<bf16>(diag_scatter, d) + r * rows * s.n;
      // cuBLAS, one GEMM per destination's rows, storing locally and to the destinations: whether
      // the vendor GEMM's epilogue hides remote stores better than the tile GEMM's.
      for (const bool remote : {false, true})
        runner.measure(ctx, fmt::format("diag: cuBLAS per destination, stored {}", remote ? "to destinations" : "here"),
                       [&, parts, remote] {
                         for (int step = 1; step <= world; ++step) {
                           const int d = (r + step) % world;
                           bf16* c = remote ? parts.c[d] : partial.get() + d * rows * s.n;
                           blas.gemm(ctx.stream, rows, s.n, s.k, a.get() + d * rows * s.k, s.k, b.get(), s.n, c, s.n);
                         }
                       },
                       {}, {});
      // The tile GEMM alone, storing locally and to the destinations, with either epilogue.
      for (const auto& [kernel, label] :
           {std::pair{gpu::FlagGemmKernel::best, ""}, std::pair{gpu::FlagGemmKernel::persistent, " persistent"}}) {
        runner.measure(ctx, fmt::format("diag: tile GEMM{}, stored here", label),
                       [&, kernel] {
                         gpu::flag_gemm(a.get(), s.k, b.get(), s.n, partial.get(), s.n, s.m, s.n, s.k, nullptr, 0, 0,
                                        nullptr, nullptr, 0, ctx.stream, kernel);
                       },
                       {}, {});
        runner.measure(ctx, fmt::format("diag: tile GEMM{}, stored to destinations", label),
                       [&, parts, kernel] {
                         gpu::flag_gemm_parts(a.get(), s.k, b.get(), s.n, parts, s.n, s.m, s.n, s.k, nullptr, 0, 0,
                                              nullptr, 0, ctx.stream, kernel);
                       },
                       {}, {});
      }
    }
    if (op.low_latency())
      runner.measure(ctx, "ll-bulk", [&] { op.run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::ll_bulk, ctx.stream); },
                     poison_out, check_out);
    if (op.push())
      runner.measure(ctx, "sm-push", [&] { op.run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::sm_push, ctx.stream); },
                     poison_out, check_out);
    if (bench.args().stamps && op.pull()) {
      // Each call with its marks, in the same order on every rank; the marks' kernels and the
      // probe's stop of the early launch make these calls a little slower than the timed ones.
      auto words = make_buffer<std::uint64_t>(StampedCalls::kWords);
      std::uint64_t* w = words.get();
      auto stamped = [&](StampedCalls& calls, const std::function<void()>& body) {
        auto& mine = calls.per_rank[static_cast<std::size_t>(r)];
        for (int i = 0; i < bench.args().warmup + bench.args().iterations; ++i) {
          CARAVAN_HIP_CHECK(hipMemsetAsync(w, 0, StampedCalls::kWords * sizeof(std::uint64_t), ctx.stream));
          CARAVAN_HIP_CHECK(hipStreamSynchronize(ctx.stream));
          runner.barrier().arrive_and_wait();
          gpu::stamp_time(w + StampedCalls::kStart, ctx.stream);
          body();
          gpu::stamp_time(w + StampedCalls::kEnd, ctx.stream);
          StampedCalls::Words host{};
          CARAVAN_HIP_CHECK(hipMemcpyAsync(host.data(), w, sizeof host, hipMemcpyDeviceToHost, ctx.stream));
          CARAVAN_HIP_CHECK(hipEventRecord(ctx.end, ctx.stream));
          wait_event(ctx.end, fmt::format("rank {}: stamped call", r));
          if (i >= bench.args().warmup) mine.push_back(host);
        }
      };
      stamped(stamped_nccl, [&] {
        gemm_full();
        gpu::stamp_time(w + StampedCalls::kAfterGemm, ctx.stream);
        nccl_rs();
      });
      op.set_probe(r, w + StampedCalls::kAfterGemm, w + StampedCalls::kExchange);
      stamped(stamped_push, [&] { op.run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::sm_push, ctx.stream); });
      stamped(stamped_pull, [&] { op.run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::sm_pull, ctx.stream); });
      op.set_probe(r, nullptr, nullptr);
    }
    if (bench.args().stamps) {
      // The rings' calls traced by events, in the same order on every rank, outside the timed rounds.
      for (const auto& [timeline, ring_op] :
           {std::pair{&ring_x2, &split}, std::pair{&ring_x4, split4.get()}})
        if (ring_op != nullptr)
          trace_calls(ctx, runner, bench.args(), *timeline,
                      [&, ring_op](gpu::ChunkTrace* t) { ring_op->set_ring_trace(r, t); },
                      [&, ring_op] { ring_op->run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::ce_ring, ctx.stream, 2); });
    }
    if (op.pull()) {
      runner.measure(ctx, "sm-pull", [&] { op.run(r, a.get(), b.get(), out.get(), gpu::GemmRsVariant::sm_pull, ctx.stream); },
                     poison_out, check_out);
      bf16* heap_partial = bench.team().heap().at<bf16>(diag_partial, r);
      runner.measure(ctx, "diag: sm-pull's GEMM only", [&, heap_partial] {
        blas.gemm(ctx.stream, s.m, s.n, s.k, a.get(), s.k, b.get(), s.n, heap_partial, s.n);
      }, {}, {});
      // The epoch lives in the registered copy of the lambda (called later, by run_rounds); this
      // rank's, and every rank makes the same calls.
      runner.measure(ctx, "diag: sm-pull's exchange only", [&, heap_partial, epoch = std::uint64_t{0}]() mutable {
        gpu::pull_reduce_scatter(bench.team().heap().view(r), heap_partial + r * rows * s.n, out_count, out.get(),
                                 bench.team().heap().at<std::uint64_t>(diag_flags, r), nullptr, ++epoch, ctx.stream);
      }, {}, {});
    }
    runner.run_rounds(ctx);
  });
  if (bench.args().stamps && op.pull()) {
    for (auto [name, calls] : {std::pair{"nccl-bulk", &stamped_nccl}, {"sm-push", &stamped_push}, {"sm-pull", &stamped_pull}})
      for (std::string& line : describe_stamps(name, *calls)) record.notes.push_back(std::move(line));
  }
  if (bench.args().stamps)
    for (const ChunkTimeline* t : {&ring_x2, &ring_x4})
      for (std::string& line : describe_timeline(*t)) record.notes.push_back(std::move(line));
  return record;
}

// ---- GEMM + All-Scatter -----------------------------------------------------------------------
CaseRecord run_gemm_as(OverlapBench& bench, const Shape& s) {
  const int world = bench.world();
  const std::uint64_t seed_a = bench.seed() ^ 0xE55E, seed_b = bench.seed() ^ 0xF66F;
  const long block = s.n / world;
  HeapScope heap_scope(bench.team().heap(), "bench overlap");
  gpu::GemmAllScatter op(bench.team(), s.m, s.k, s.n, world);
  return bench.run_case("GEMM+AS", s, [&](RankContext& ctx, CaseRunner& runner) {
    const int r = ctx.rank;
    gpu::Blas& blas = bench.team().blas(r);
    auto a = make_buffer<bf16>(static_cast<std::size_t>(s.m) * s.k);
    auto b = make_buffer<bf16>(static_cast<std::size_t>(s.k) * block);
    auto part = make_buffer<bf16>(static_cast<std::size_t>(s.m) * block);
    auto gathered = make_buffer<bf16>(static_cast<std::size_t>(s.m) * s.n);
    gpu::fill_random(a.get(), s.m, s.k, s.k, seed_a, 0, 0, 1.0f, ctx.stream);
    gpu::fill_random(b.get(), s.k, block, block, seed_b + r, 0, 0, 1.0f, ctx.stream);
    DeviceBuffer<float> ref;
    if (bench.args().check) {
      auto a32 = make_buffer<float>(static_cast<std::size_t>(s.m) * s.k);
      auto b32 = make_buffer<float>(static_cast<std::size_t>(s.k) * s.n);
      ref = make_buffer<float>(static_cast<std::size_t>(s.m) * s.n);
      gpu::fill_random(a32.get(), s.m, s.k, s.k, seed_a, 0, 0, 1.0f, ctx.stream);
      for (int q = 0; q < world; ++q)
        gpu::fill_random(b32.get() + q * block, s.k, block, s.n, seed_b + q, 0, 0, 1.0f, ctx.stream);
      blas.gemm_reference(ctx.stream, s.m, s.n, s.k, a32.get(), s.k, b32.get(), s.n, ref.get(), s.n);
      CARAVAN_HIP_CHECK(hipStreamSynchronize(ctx.stream));
    }
    bf16* c = op.output(r);
    auto poison_c = [&] { poison(c, static_cast<std::size_t>(s.m) * s.n, ctx.stream); };
    auto check_c = [&] { return relative_error(ctx, c, s.m, s.n, s.n, ref.get(), s.n); };
    blas.tune(s.m, block, s.k, s.k, block, block);  // the baseline's GEMM, tuned as the operation's are
    auto gemm_part = [&] { blas.gemm(ctx.stream, s.m, block, s.k, a.get(), s.k, b.get(), block, part.get(), block); };
    // NCCL's AllGather leaves C as world column blocks one after another (not row-major); the
    // bulk baseline is timed without the layout conversion a user would add, in its favour.
    auto nccl_gather = [&] {
      CARAVAN_NCCL_CHECK(ncclAllGather(part.get(), gathered.get(), static_cast<std::size_t>(s.m) * block, ncclBfloat16,
                                       ctx.nccl, ctx.stream));
    };
    runner.measure(ctx, "nccl-bulk", [&] { gemm_part(); nccl_gather(); }, {}, {});
    runner.measure(ctx, "gemm-alone", gemm_part, {}, {});
    runner.measure(ctx, "nccl-allgather-alone", nccl_gather, {}, {});
    for (auto variant : {gpu::GemmAsVariant::ce_bulk, gpu::GemmAsVariant::ce_push, gpu::GemmAsVariant::tile_fused,
                         gpu::GemmAsVariant::tile_specialized, gpu::GemmAsVariant::sm_bulk})
      runner.measure(ctx, std::string(gpu::to_string(variant)),
                     [&, variant] { op.run(r, a.get(), b.get(), variant, ctx.stream); }, poison_c, check_c);
    runner.measure(ctx, "ce-push 2 lanes",
                   [&] { op.run(r, a.get(), b.get(), gpu::GemmAsVariant::ce_push, ctx.stream, 2); }, poison_c, check_c);
    runner.run_rounds(ctx);
  });
}

// ---- AllGather alone --------------------------------------------------------------------------
// Caravan's AllGather of a rows x hidden shard per rank (the activations an AllGather+GEMM
// gathers) against NCCL's all_gather of the same bytes, each call checked exact.
CaseRecord run_allgather(OverlapBench& bench, long tokens, long hidden, const std::string& model) {
  const int world = bench.world();
  const std::uint64_t seed = bench.seed() ^ 0xA66A;
  const long rows = tokens / world;
  HeapScope heap_scope(bench.team().heap(), "bench overlap");
  gpu::AllGather op(bench.team(), rows, hidden);
  Shape s{fmt::format("{} hidden {}", model, hidden), tokens, hidden, 0};
  CaseRecord record = bench.run_case("AllGather", s, [&](RankContext& ctx, CaseRunner& runner) {
    const int r = ctx.rank;
    const std::size_t shard = static_cast<std::size_t>(rows * hidden), all = shard * static_cast<std::size_t>(world);
    auto in = make_buffer<bf16>(shard);
    auto out = make_buffer<bf16>(all);
    auto ref = make_buffer<float>(all);
    gpu::fill_random(in.get(), rows, hidden, hidden, seed, r * rows, 0, 1.0f, ctx.stream);
    gpu::fill_random(op.shard(r), rows, hidden, hidden, seed, r * rows, 0, 1.0f, ctx.stream);
    gpu::fill_random(ref.get(), tokens, hidden, hidden, seed, 0, 0, 1.0f, ctx.stream);
    bf16* gathered = op.shard(r) - r * static_cast<long>(shard);
    auto exact = [&](const bf16* got) {
      return exact_error(relative_error(ctx, got, tokens, hidden, hidden, ref.get(), hidden));
    };
    auto nccl = [&] {
      CARAVAN_NCCL_CHECK(ncclAllGather(in.get(), out.get(), shard, ncclBfloat16, ctx.nccl, ctx.stream));
    };
    runner.measure(
        ctx, "nccl-allgather", nccl, [&] { poison(out.get(), all, ctx.stream); }, [&] { return exact(out.get()); });
    // Caravan's rows land in its symmetric buffer: poison every row but this rank's own shard.
    auto poison_gathered = [&] {
      poison(gathered, static_cast<std::size_t>(r) * shard, ctx.stream);
      poison(op.shard(r) + shard, static_cast<std::size_t>(world - 1 - r) * shard, ctx.stream);
    };
    std::vector<gpu::AllGatherVariant> variants = {gpu::AllGatherVariant::ce_push, gpu::AllGatherVariant::ce_pull,
                                                   gpu::AllGatherVariant::sm};
    if (op.low_latency()) variants.push_back(gpu::AllGatherVariant::ll);
    for (auto v : variants)
      runner.measure(
          ctx, "caravan " + std::string(gpu::to_string(v)), [&, v] { op.run(r, v, ctx.stream); }, poison_gathered,
          [&] { return exact(gathered); });
    runner.run_rounds(ctx);
  });
  record.baseline = "nccl-allgather";
  record.automatic = "caravan " + std::string(gpu::to_string(op.automatic()));
  return record;
}

// ---- ReduceScatter alone ----------------------------------------------------------------------
// Caravan's ReduceScatter of a tokens x hidden partial per rank (what a row-parallel projection
// leaves) against NCCL's reduce_scatter of the same bytes, each checked against a float32 sum.
CaseRecord run_reduce_scatter(OverlapBench& bench, long tokens, long hidden, const std::string& model) {
  const int world = bench.world();
  const std::uint64_t seed = bench.seed() ^ 0x5C5C;
  const long rows = tokens / world;
  HeapScope heap_scope(bench.team().heap(), "bench overlap");
  gpu::ReduceScatter op(bench.team(), rows, hidden);
  Shape s{fmt::format("{} hidden {}", model, hidden), tokens, hidden, 0};
  CaseRecord record = bench.run_case("ReduceScatter", s, [&](RankContext& ctx, CaseRunner& runner) {
    const int r = ctx.rank;
    const std::size_t all = static_cast<std::size_t>(tokens * hidden), mine = static_cast<std::size_t>(rows * hidden);
    auto in = make_buffer<bf16>(all);
    auto out = make_buffer<bf16>(mine);
    gpu::fill_random(in.get(), tokens, hidden, hidden, seed + static_cast<std::uint64_t>(r), 0, 0, 1.0f, ctx.stream);
    DeviceBuffer<float> ref;
    if (bench.args().check) {
      // Every rank's values at this rank's rows, summed on the host in float32.
      auto part = make_buffer<float>(mine);
      std::vector<float> host_part(mine), host_sum(mine, 0.0f);
      for (int q = 0; q < world; ++q) {
        gpu::fill_random(part.get(), rows, hidden, hidden, seed + static_cast<std::uint64_t>(q), r * rows, 0, 1.0f,
                         ctx.stream);
        CARAVAN_HIP_CHECK(hipStreamSynchronize(ctx.stream));
        CARAVAN_HIP_CHECK(hipMemcpy(host_part.data(), part.get(), mine * sizeof(float), hipMemcpyDefault));
        for (std::size_t i = 0; i < mine; ++i) host_sum[i] += host_part[i];
      }
      ref = make_buffer<float>(mine);
      CARAVAN_HIP_CHECK(hipMemcpy(ref.get(), host_sum.data(), mine * sizeof(float), hipMemcpyDefault));
    }
    auto poison_out = [&] { poison(out.get(), mine, ctx.stream); };
    auto check_out = [&] { return relative_error(ctx, out.get(), rows, hidden, hidden, ref.get(), hidden); };
    runner.measure(
        ctx, "nccl-reducescatter",
        [&] {
          CARAVAN_NCCL_CHECK(ncclReduceScatter(in.get(), out.get(), mine, ncclBfloat16, ncclSum, ctx.nccl, ctx.stream));
        },
        poison_out, check_out);
    std::vector<gpu::ReduceScatterVariant> variants = {gpu::ReduceScatterVariant::ce_push};
    if (op.sm()) variants.push_back(gpu::ReduceScatterVariant::sm);
    if (op.low_latency()) variants.push_back(gpu::ReduceScatterVariant::ll);
    for (auto v : variants)
      runner.measure(
          ctx, "caravan " + std::string(gpu::to_string(v)), [&, v] { op.run(r, in.get(), out.get(), v, ctx.stream); },
          poison_out, check_out);
    runner.run_rounds(ctx);
  });
  record.baseline = "nccl-reducescatter";
  record.automatic = "caravan " + std::string(gpu::to_string(op.automatic()));
  return record;
}

// ---- All-Scatter alone ------------------------------------------------------------------------
// Caravan's All-Scatter of a tokens x (hidden / world) column block per rank into every rank's
// row-major tokens x hidden output, against NCCL's all_gather of the same bytes (which leaves
// the blocks one after another, not row-major: the baseline is timed without the conversion a
// user would add, in its favour).
CaseRecord run_all_scatter(OverlapBench& bench, long tokens, long hidden, const std::string& model) {
  const int world = bench.world();
  const std::uint64_t seed = bench.seed() ^ 0xA55A;
  const long block = hidden / world;
  HeapScope heap_scope(bench.team().heap(), "bench overlap");
  gpu::AllScatter op(bench.team(), tokens, block);
  Shape s{fmt::format("{} hidden {}", model, hidden), tokens, hidden, 0};
  CaseRecord record = bench.run_case("All-Scatter", s, [&](RankContext& ctx, CaseRunner& runner) {
    const int r = ctx.rank;
    const std::size_t all = static_cast<std::size_t>(tokens * hidden), mine = static_cast<std::size_t>(tokens * block);
    auto in = make_buffer<bf16>(mine);
    auto gathered = make_buffer<bf16>(all);
    auto ref = make_buffer<float>(all);
    gpu::fill_random(in.get(), tokens, block, block, seed, 0, r * block, 1.0f, ctx.stream);
    gpu::fill_random(op.block(r), tokens, block, hidden, seed, 0, r * block, 1.0f, ctx.stream);
    gpu::fill_random(ref.get(), tokens, hidden, hidden, seed, 0, 0, 1.0f, ctx.stream);
    bf16* output = op.block(r) - r * block;
    runner.measure(
        ctx, "nccl-allgather",
        [&] { CARAVAN_NCCL_CHECK(ncclAllGather(in.get(), gathered.get(), mine, ncclBfloat16, ctx.nccl, ctx.stream)); },
        [&] { poison(gathered.get(), all, ctx.stream); },
        [&] {
          // Block q of NCCL's output is rank q's tokens x block, row-major.
          double worst = 0;
          for (int q = 0; q < world; ++q)
            worst = std::max(worst, relative_error(ctx, gathered.get() + static_cast<std::size_t>(q) * mine, tokens,
                                                   block, block, ref.get() + q * block, hidden));
          return exact_error(worst);
        });
    // Poison the peers' columns of this rank's output, row by row (a 2-D memset).
    auto poison_peers = [&] {
      if (r > 0)
        CARAVAN_HIP_CHECK(
            hipMemset2DAsync(output, hidden * sizeof(bf16), 0xFF, r * block * sizeof(bf16), tokens, ctx.stream));
      if (r + 1 < world)
        CARAVAN_HIP_CHECK(hipMemset2DAsync(output + (r + 1) * block, hidden * sizeof(bf16), 0xFF,
                                           (world - 1 - r) * block * sizeof(bf16), tokens, ctx.stream));
    };
    for (auto v : {gpu::AllScatterVariant::ce_push, gpu::AllScatterVariant::sm})
      runner.measure(
          ctx, "caravan " + std::string(gpu::to_string(v)), [&, v] { op.run(r, v, ctx.stream); }, poison_peers,
          [&] { return exact_error(relative_error(ctx, output, tokens, hidden, hidden, ref.get(), hidden)); });
    runner.run_rounds(ctx);
  });
  record.baseline = "nccl-allgather";
  record.automatic = "caravan " + std::string(gpu::to_string(op.automatic()));
  return record;
}

// ---- Low-latency AllGather --------------------------------------------------------------------
CaseRecord run_ll_allgather(OverlapBench& bench, std::size_t bytes) {
  const int world = bench.world();
  const std::uint64_t seed = bench.seed() ^ 0x1717;
  const long elems = static_cast<long>(bytes / sizeof(bf16));
  HeapScope heap_scope(bench.team().heap(), "bench overlap");
  gpu::LowLatencyAllGather op(bench.team(), bytes);
  Shape s{fmt::format("{} KiB per rank", bytes >> 10), static_cast<long>(bytes), 0, 0};
  CaseRecord record = bench.run_case("LL AllGather", s, [&](RankContext& ctx, CaseRunner& runner) {
    const int r = ctx.rank;
    auto in = make_buffer<bf16>(static_cast<std::size_t>(elems));
    auto out = make_buffer<bf16>(static_cast<std::size_t>(elems) * world);
    gpu::fill_random(in.get(), 1, elems, elems, seed + r, 0, 0, 1.0f, ctx.stream);
    auto ref = make_buffer<float>(static_cast<std::size_t>(elems) * world);
    for (int q = 0; q < world; ++q)
      gpu::fill_random(ref.get() + q * elems, 1, elems, elems, seed + q, 0, 0, 1.0f, ctx.stream);
    auto poison_out = [&] { poison(out.get(), static_cast<std::size_t>(elems) * world, ctx.stream); };
    auto check_out = [&] { return exact_error(relative_error(ctx, out.get(), world, elems, elems, ref.get(), elems)); };
    constexpr int kRepeat = 100;  // back-to-back calls per timed sample: latency per call
    auto nccl = [&] {
      CARAVAN_NCCL_CHECK(
          ncclAllGather(in.get(), out.get(), static_cast<std::size_t>(elems), ncclBfloat16, ctx.nccl, ctx.stream));
    };
    auto ll = [&] { op.run(r, in.get(), out.get(), ctx.stream); };
    runner.measure(ctx, "nccl-allgather", nccl, poison_out, check_out, kRepeat);
    runner.measure(ctx, "caravan-ll", ll, poison_out, check_out, kRepeat);
    runner.measure(ctx, "nccl-allgather graph", nccl, poison_out, check_out, kRepeat, true);
    runner.measure(ctx, "caravan-ll graph", ll, poison_out, check_out, kRepeat, true);
    runner.run_rounds(ctx);
  });
  record.baseline = "nccl-allgather";
  record.notes.push_back(fmt::format("caravan-ll sends {} KiB per rank as {} (CARAVAN_LL128_MIN_BYTES)", bytes >> 10,
                                     gpu::to_string(op.format())));
  return record;
}

std::string fmt_ms(double ms) { return ms >= 1.0 ? fmt::format("{:.3f}", ms) : fmt::format("{:.4f}", ms); }

}  // namespace

int run_bench_overlap_gpu(const BenchOverlapArgs& args) {
  // NVLink multicast (NVLS) stays off: on shared machines it can take the GPUs out of service.
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  const GpuProbe probe = probe_gpus();
  if (probe.device_count < 2)
    throw Error(Errc::invalid_argument,
                fmt::format("bench overlap --backend gpu: needs 2 or more GPUs; {}",
                            probe.device_count == 0 ? probe.reason
                                                    : fmt::format("this machine has {}", probe.device_count)));
  const int devices = probe.device_count;
  const int world = args.world > 0 ? args.world : std::min(devices, gpu::kMaxHeapRanks);
  if (world < 2 || world > devices || world > gpu::kMaxHeapRanks)
    throw Error(Errc::invalid_argument, fmt::format("bench overlap --world: needs 2 to {} GPUs of the {} present, got {}",
                                                    std::min(devices, gpu::kMaxHeapRanks), devices, world));
  if (args.iterations < 1 || args.warmup < 0)
    throw Error(Errc::invalid_argument, "bench overlap: --iterations must be >= 1 and --warmup >= 0");
  std::vector<std::string> ops = args.operations;
  if (ops.empty())
    ops = {"ag_gemm", "gemm_rs", "gemm_as", "ll_allgather", "allgather", "reduce_scatter", "all_scatter"};
  std::vector<long> tokens = args.tokens;
  if (tokens.empty()) tokens = {8192};
  for (long t : tokens)
    if (t <= 0 || t % (8L * world) != 0)
      throw Error(Errc::invalid_argument,
                  fmt::format("bench overlap --tokens: each must be a positive multiple of 8 x world = {}, got {}", 8 * world, t));
  // --shape: each operation splits a weight over the ranks into 16-byte rows.
  const std::vector<OverlapShape> custom = parse_overlap_shapes(args.shapes);
  if (!custom.empty() && std::none_of(ops.begin(), ops.end(), [](const std::string& op) {
        return op == "ag_gemm" || op == "gemm_rs" || op == "gemm_as";
      }))
    throw Error(Errc::invalid_argument,
                fmt::format("bench overlap --shape {}: only ag_gemm, gemm_rs and gemm_as measure shapes; add one of "
                            "them to --op",
                            args.shapes.front()));
  for (const auto& c : custom)
    for (const auto& op : ops) {
      const bool splits_k = op == "gemm_rs", splits_n = op == "ag_gemm" || op == "gemm_as";
      if ((splits_k && c.k % (8L * world) != 0) || (splits_n && c.n % (8L * world) != 0))
        throw Error(Errc::invalid_argument,
                    fmt::format("bench overlap --shape {}:{}:{}: {} splits {} over {} ranks: it must be a multiple of "
                                "8 x world = {}",
                                c.name, c.k, c.n, op, splits_k ? "K" : "N", world, 8 * world));
    }

  OverlapBench bench(args, world);
  BenchReport report;
  report.name = "overlap";
  report.machine = describe_machine();
  report.notes.push_back(fmt::format("backend gpu: {} GPUs in one process (one thread each), seed {:#x}; times per call, "
                                     "the slowest rank, {} iterations after {} warm-up; host us: the slowest rank's "
                                     "time to enqueue one call (median), part of the call's time when the GPU is idle",
                                     world, bench.seed(), args.iterations, args.warmup));
  std::vector<CaseRecord> records;
  for (const auto& op : ops) {
    if (op == "allgather" || op == "reduce_scatter" || op == "all_scatter") {
      for (long t : tokens)
        for (const auto& [model, hidden] : {std::pair<std::string, long>{"llama3-70B", 8192}, {"llama3-8B", 4096}}) {
          fmt::print(stderr, "bench overlap: {} M={} hidden {}\n", op, t, hidden);
          if (op == "allgather")
            records.push_back(run_allgather(bench, t, hidden, model));
          else if (op == "reduce_scatter")
            records.push_back(run_reduce_scatter(bench, t, hidden, model));
          else
            records.push_back(run_all_scatter(bench, t, hidden, model));
        }
      continue;
    }
    if (op == "ll_allgather") {
      for (std::size_t kib : {8, 16, 32, 64, 256}) {
        fmt::print(stderr, "bench overlap: {} {} KiB\n", op, kib);
        records.push_back(run_ll_allgather(bench, kib << 10));
      }
      continue;
    }
    for (long t : tokens) {
      std::vector<Shape> shapes;
      if (op == "ag_gemm") shapes = ag_shapes(t, world, custom);
      else if (op == "gemm_rs") shapes = rs_shapes(t, world, custom);
      else if (op == "gemm_as") shapes = as_shapes(t, world, custom);
      else
        throw Error(
            Errc::invalid_argument,
            fmt::format(
                "bench overlap --op: unknown operation '{}' (ag_gemm, gemm_rs, gemm_as, ll_allgather, allgather, "
                "reduce_scatter, all_scatter)",
                op));
      for (const auto& shape : shapes) {
        fmt::print(stderr, "bench overlap: {} {} M={} K={} N={}\n", op, shape.name, shape.m, shape.k, shape.n);
        if (op == "ag_gemm") records.push_back(run_ag_gemm(bench, shape));
        else if (op == "gemm_rs") records.push_back(run_gemm_rs(bench, shape));
        else records.push_back(run_gemm_as(bench, shape));
      }
    }
  }

  BenchTable table{"Overlapped operations vs the bulk-synchronous NCCL + cuBLAS baseline (ms per call)",
                   {"operation", "shape", "variant", "median", "p10", "p90", "bulk/this", "host us", "rel err"},
                   {}};
  nlohmann::json cases = nlohmann::json::array();
  bool all_ok = true;
  for (const auto& rec : records) {
    const std::string shape = rec.k > 0 ? fmt::format("{} {}x{}x{}", rec.name, rec.m, rec.k, rec.n) : rec.name;
    std::map<std::string, Summary> summary;
    for (const auto& [variant, result] : rec.variants) summary[variant] = summarize(result.ms);
    const bool ll = rec.op == "LL AllGather";
    const std::string& baseline = rec.baseline;
    const bool collective = baseline != "nccl-bulk";  // a collective alone, against NCCL's
    const bool reduces = baseline == "nccl-reducescatter";
    const double base = summary.at(baseline).median;
    nlohmann::json jcase = {{"operation", rec.op}, {"shape", rec.name}, {"m", rec.m}, {"k", rec.k}, {"n", rec.n}};
    std::string best, best_graph;
    const auto is_graph = [](const std::string& v) { return v.size() > 6 && v.compare(v.size() - 6, 6, " graph") == 0; };
    for (const auto& [variant, result] : rec.variants) {
      const Summary& st = summary.at(variant);
      const bool caravan = variant.rfind("ce-", 0) == 0 || variant.rfind("ll-", 0) == 0 ||
                           variant.rfind("tile-", 0) == 0 || variant.rfind("sm-", 0) == 0 ||
                           variant.rfind("caravan", 0) == 0;
      std::string& slot = is_graph(variant) ? best_graph : best;
      if (caravan && result.ok && (slot.empty() || st.median < summary.at(slot).median)) slot = variant;
      all_ok &= result.ok;
      // Graph-replayed rows compare with the graph-replayed baseline.
      const double row_base = is_graph(variant) ? summary.at(baseline + " graph").median : base;
      table.rows.push_back({rec.op, shape, variant, fmt_ms(st.median), fmt_ms(st.p10), fmt_ms(st.p90),
                            fmt::format("{:.2f}x", row_base / st.median),
                            fmt::format("{:.1f}", summarize(result.host_ms).median * 1e3),
                            result.checked ? (result.ok ? fmt::format("{:.1e}", result.rel_error) : "FAIL " + result.failure)
                                           : "-"});
      jcase["variants"][variant] = {{"median_ms", st.median}, {"p10_ms", st.p10}, {"p90_ms", st.p90},
                                    {"host_enqueue_ms", summarize(result.host_ms).median},
                                    {"checked", result.checked}, {"rel_error", result.checked ? result.rel_error : 0.0},
                                    {"ok", result.ok}};
    }
    if (!best.empty()) {
      const double t = summary.at(best).median;
      jcase["best"] = best;
      if (collective && !ll) {
        report.headlines.push_back(fmt::format("{} {} M={} ({} MiB {}): best {} {} ms vs NCCL {} {} ms: {:.2f}x",
                                               rec.op, rec.name, rec.m, rec.m * rec.k * 2 >> 20,
                                               reduces ? "in per rank" : "gathered", best, fmt_ms(t),
                                               reduces ? "reduce_scatter" : "all_gather", fmt_ms(base), base / t));
        if (!rec.automatic.empty())
          report.headlines.back() +=
              rec.automatic == best
                  ? "; automatic() picks it"
                  : fmt::format("; automatic() picks {} ({:.2f}x)", rec.automatic,
                                summary.count(rec.automatic) ? base / summary.at(rec.automatic).median : 0.0);
      } else if (ll) {
        report.headlines.push_back(fmt::format("{} {}: {} {:.1f} us vs NCCL {:.1f} us: {:.2f}x lower latency", rec.op, rec.name,
                                               best, t * 1e3, base * 1e3, base / t));
        if (!best_graph.empty()) {
          const double tg = summary.at(best_graph).median, bg = summary.at(baseline + " graph").median;
          jcase["best_graph"] = best_graph;
          report.headlines.push_back(fmt::format("{} {} (graph replay): {:.1f} us vs NCCL {:.1f} us: {:.2f}x lower latency",
                                                 rec.op, rec.name, tg * 1e3, bg * 1e3, bg / tg));
        }
      } else {
        double alone = 0;
        for (const auto& [variant, st] : summary)
          if (variant.find("alone") != std::string::npos) alone = std::max(alone, st.median);
        jcase["ideal_ms"] = alone;
        report.headlines.push_back(fmt::format("{} {} M={}: best {} {} ms, {:.2f}x vs NCCL bulk {} ms; ideal max(GEMM, "
                                               "collective) {} ms, best/ideal {:.2f}",
                                               rec.op, rec.name, rec.m, best, fmt_ms(t), base / t, fmt_ms(base), fmt_ms(alone),
                                               t / alone));
        if (const auto raw = summary.find(kBesideRawPushes); raw != summary.end()) {
          jcase["beside_raw_pushes_ms"] = raw->second.median;
          report.headlines.back() += fmt::format("; GEMM beside the bytes pushed raw {} ms, best/that {:.2f}",
                                                 fmt_ms(raw->second.median), t / raw->second.median);
        }
      }
    }
    for (const std::string& line : rec.notes) report.notes.push_back(fmt::format("{} {} M={}: {}", rec.op, rec.name, rec.m, line));
    if (!rec.notes.empty()) jcase["diagnostics"] = rec.notes;
    cases.push_back(std::move(jcase));
  }
  report.tables.push_back(std::move(table));
  report.figures["cases"] = cases;
  report.figures["world"] = world;
  report.figures["seed"] = bench.seed();
  emit_report(report);  // tables, or JSON as --json asks
  if (!all_ok) {
    fmt::print(stderr, "bench overlap: a variant failed its correctness check (see the table)\n");
    return 1;
  }
  return 0;
}

}  // namespace caravan::app
