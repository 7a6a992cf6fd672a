// The GPU backend of `caravan bench llm` (bench_llm.h): the tensor-parallel layer of
// kernels/gpu/tp_layer.h on GPUs 0..W-1 of this machine, one host thread per GPU, with its four
// communications bulk-synchronous through NCCL (the baseline: what PyTorch+NCCL runs) or
// overlapped by Caravan, measured in one run on the same weights and inputs.
//
// Correctness, per variant: against the float32 reference layer (the CPU backend's) at a small
// shape with grouped-query attention and several attention blocks, outputs poisoned first; at
// the measured shape, the output's relative difference from the NCCL baseline's.
#include "apps/caravan/bench_gpu_ranks.h"
#include "apps/caravan/bench_llm.h"
#include "kernels/gpu/kernels.h"
#include "kernels/gpu/tp_layer.h"

#include <caravan/error.h>
#include <caravan/platform.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>

namespace caravan::app {
namespace {

using gpu::bf16;
using gpu::LayerCommunication;

class NcclCollectives final : public gpu::BulkCollectives {
 public:
  explicit NcclCollectives(const std::vector<ncclComm_t>& comms) : comms_(comms) {}
  void all_gather(int rank, const bf16* in, bf16* out, std::size_t count, hipStream_t stream) override {
    CARAVAN_NCCL_CHECK(ncclAllGather(in, out, count, ncclBfloat16, comms_[static_cast<std::size_t>(rank)], stream));
  }
  void reduce_scatter(int rank, const bf16* in, bf16* out, std::size_t count, hipStream_t stream) override {
    CARAVAN_NCCL_CHECK(
        ncclReduceScatter(in, out, count, ncclBfloat16, ncclSum, comms_[static_cast<std::size_t>(rank)], stream));
  }

 private:
  const std::vector<ncclComm_t>& comms_;
};

constexpr const char* kBaseline = "nccl-bulk";
constexpr const char* kBound = "no-communication (bound)";

// The variants, the baseline first. `bulk` is filled in by the caller (the NCCL collectives).
std::vector<LayerCommunication> all_variants() {
  using gpu::AgGemmVariant;
  using gpu::GemmRsVariant;
  return {{.name = kBaseline},
          {.name = "caravan-bulk", .all_gather = AgGemmVariant::ce_bulk, .reduce_scatter = GemmRsVariant::ce_bulk},
          {.name = "ce-push", .all_gather = AgGemmVariant::ce_push, .reduce_scatter = GemmRsVariant::ce_push},
          {.name = "ce-push 2 lanes",
           .all_gather = AgGemmVariant::ce_push,
           .all_gather_lanes = 2,
           .reduce_scatter = GemmRsVariant::ce_push,
           .reduce_scatter_lanes = 2},
          {.name = "ce-push 2 lanes, x2 parts",
           .all_gather = AgGemmVariant::ce_push,
           .all_gather_lanes = 2,
           .reduce_scatter = GemmRsVariant::ce_push,
           .reduce_scatter_lanes = 2,
           .reduce_scatter_splits = 2},
          {.name = "ce-push 2 lanes, ce-ring x2 2 lanes",
           .all_gather = AgGemmVariant::ce_push,
           .all_gather_lanes = 2,
           .reduce_scatter = GemmRsVariant::ce_ring,
           .reduce_scatter_lanes = 2,
           .reduce_scatter_splits = 2},
          {.name = "ce-push 2 lanes, ce-ring x4/x2 2 lanes",  // o-proj in 4 parts, mlp-down in 2
           .all_gather = AgGemmVariant::ce_push,
           .all_gather_lanes = 2,
           .reduce_scatter = GemmRsVariant::ce_ring,
           .reduce_scatter_lanes = 2,
           .reduce_scatter_splits = 2,
           .out_proj_splits = 4},
          {.name = "ce-push 2 lanes, tile-scatter x4",
           .all_gather = AgGemmVariant::ce_push,
           .all_gather_lanes = 2,
           .reduce_scatter = GemmRsVariant::tile_scatter,
           .reduce_scatter_splits = 4},
          {.name = "ce-push 2 lanes, blas-scatter x2 2 lanes",
           .all_gather = AgGemmVariant::ce_push,
           .all_gather_lanes = 2,
           .reduce_scatter = GemmRsVariant::blas_scatter,
           .reduce_scatter_lanes = 2,
           .reduce_scatter_splits = 2},
          {.name = kBound, .skip_communication = true}};
}

// The float32 check's shape: grouped-query attention, several query blocks, every width a
// multiple of 8 for any world size.
kernels::TpLayerShape check_shape(int world) {
  return {.tokens = 64L * world, .hidden = 64L * world, .heads = 2L * world, .ffn = 128L * world, .kv_heads = world};
}
constexpr long kCheckQueryBlock = 48;

class LayerBench {
 public:
  LayerBench(const LlmGpuRequest& request, std::size_t variant_count)
      : request_(request), world_(request.world), barrier_(request.world) {
    std::vector<int> devices(static_cast<std::size_t>(world_));
    for (int d = 0; d < world_; ++d) devices[static_cast<std::size_t>(d)] = d;
    // Every variant's layer lives at once (they are measured in rounds), plus the check's.
    const std::uint64_t heap = gpu::GpuTpLayer::heap_bytes(request.shape, world_) * variant_count +
                               gpu::GpuTpLayer::heap_bytes(check_shape(world_), world_) + (64u << 20);
    team_ = std::make_unique<gpu::GpuTeam>(devices, heap);
    comms_.resize(static_cast<std::size_t>(world_));
    CARAVAN_NCCL_CHECK(ncclCommInitAll(comms_.data(), world_, devices.data()));
    nccl_ = std::make_unique<NcclCollectives>(comms_);
    for (int r = 0; r < world_; ++r) {
      team_->use(r);
      auto& rank = ranks_.emplace_back();
      CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&rank.stream, hipStreamNonBlocking));
      CARAVAN_HIP_CHECK(hipEventCreate(&rank.begin));
      CARAVAN_HIP_CHECK(hipEventCreate(&rank.end));
      rank.sums = make_buffer<gpu::ErrorSums>(1);
    }
    seed_ = std::random_device{}() | (static_cast<std::uint64_t>(std::random_device{}()) << 32);
  }
  ~LayerBench() {
    for (int r = 0; r < world_; ++r) {
      (void)hipSetDevice(r);
      auto& rank = ranks_[static_cast<std::size_t>(r)];
      rank.sums.reset();
      rank.x.reset(), rank.y.reset(), rank.baseline.reset(), rank.ref.reset();
      if (rank.stream) (void)hipStreamDestroy(rank.stream);
      if (rank.begin) (void)hipEventDestroy(rank.begin);
      if (rank.end) (void)hipEventDestroy(rank.end);
    }
    for (auto c : comms_) (void)ncclCommDestroy(c);
  }

  std::uint64_t seed() const { return seed_; }

  // The float32 check at the small shape: the largest relative error over ranks and two calls.
  double check(const LayerCommunication& variant) {
    const kernels::TpLayerShape shape = check_shape(world_);
    const long rows = shape.tokens / world_;
    const std::size_t mine = static_cast<std::size_t>(rows * shape.hidden);
    const kernels::TpLayerWeights weights = kernels::random_layer_weights(shape, seed_);
    std::vector<std::vector<kernels::Bf16>> inputs;
    std::vector<std::vector<float>> refs;
    for (int call = 0; call < 2; ++call) {
      std::mt19937_64 rng(seed_ + 1 + static_cast<std::uint64_t>(call));
      std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
      inputs.emplace_back(static_cast<std::size_t>(shape.tokens * shape.hidden));
      for (auto& v : inputs.back()) v = kernels::Bf16::from_float(dist(rng));
      refs.push_back(kernels::reference_layer(shape, weights, inputs.back(), world_));
    }
    HeapScope scope(team_->heap(), "bench llm");
    gpu::GpuTpLayer layer(*team_, shape, with_collectives(variant), kCheckQueryBlock, attention_kind());
    layer.set_weights(weights);
    std::vector<double> errors(static_cast<std::size_t>(world_), 0.0);
    on_ranks([&](int r, RankState& rank) {
      auto x = make_buffer<bf16>(mine), y = make_buffer<bf16>(mine);
      auto ref = make_buffer<float>(mine);
      for (int call = 0; call < 2; ++call) {
        CARAVAN_HIP_CHECK(hipMemcpy(x.get(), inputs[static_cast<std::size_t>(call)].data() + r * mine,
                                    mine * sizeof(bf16), hipMemcpyDefault));
        CARAVAN_HIP_CHECK(hipMemcpy(ref.get(), refs[static_cast<std::size_t>(call)].data() + r * mine,
                                    mine * sizeof(float), hipMemcpyDefault));
        CARAVAN_HIP_CHECK(hipMemsetAsync(y.get(), 0xFF, mine * sizeof(bf16), rank.stream));  // bf16 NaN
        barrier_.arrive_and_wait();
        layer.run(r, x.get(), y.get(), rank.stream);
        finish(r, rank, variant.name + " (float32 check)");
        auto& e = errors[static_cast<std::size_t>(r)];
        e = std::max(e, relative_error(rank, y.get(), rows, shape.hidden, ref.get()));
      }
      barrier_.arrive_and_wait();  // every rank checked before the layer goes
    });
    return *std::max_element(errors.begin(), errors.end());
  }

  // --attention fused|unfused (validated by the CLI).
  gpu::AttentionKind attention_kind() const {
    return request_.attention == "unfused" ? gpu::AttentionKind::unfused : gpu::AttentionKind::fused;
  }

  // Every variant at the measured shape, in rounds: each variant's layer is built first (same
  // weights), run once for its difference from the baseline's output (the baseline, first,
  // records it), then every round runs every layer once, each call between a barrier and device
  // events, the round's first variant rotating. Rounds rather than one variant after another for
  // the reason bench overlap gives (bench_overlap_gpu.cpp, run_rounds): under sustained load the
  // H200s sit at their power limit and clock down as they warm, so what is measured later runs
  // slower for that alone. One entry per variant, in order.
  nlohmann::json measure(const std::vector<LayerCommunication>& variants, const std::vector<double>& errors) {
    const kernels::TpLayerShape& shape = request_.shape;
    const long rows = shape.tokens / world_;
    const std::size_t mine = static_cast<std::size_t>(rows * shape.hidden);
    const std::size_t n_variants = variants.size();
    HeapScope scope(team_->heap(), "bench llm");
    std::vector<std::unique_ptr<gpu::GpuTpLayer>> layers;
    for (const auto& v : variants) {
      fmt::print(stderr, "bench llm: {}: building the layer\n", v.name);
      layers.push_back(std::make_unique<gpu::GpuTpLayer>(*team_, shape, with_collectives(v), 1024, attention_kind()));
      layers.back()->set_random_weights(seed_);
    }
    const int total_runs = request_.warmup + request_.iterations;
    fmt::print(stderr, "bench llm: {} rounds of {} layers\n", total_runs, n_variants);
    // [variant][rank]: seconds per timed run, and the step times of each run, run after run.
    using PerRank = std::vector<std::vector<double>>;
    std::vector<PerRank> totals(n_variants, PerRank(static_cast<std::size_t>(world_)));
    std::vector<PerRank> steps(n_variants, PerRank(static_cast<std::size_t>(world_)));
    std::vector<std::vector<double>> diffs(n_variants, std::vector<double>(static_cast<std::size_t>(world_), 0.0));
    on_ranks([&](int r, RankState& rank) {
      if (!rank.x) {
        rank.x = make_buffer<bf16>(mine);
        rank.y = make_buffer<bf16>(mine);
        rank.baseline = make_buffer<float>(mine);
        gpu::fill_random(rank.x.get(), rows, shape.hidden, shape.hidden, seed_ ^ 0x5eed, r * rows, 0, 1.0f,
                         rank.stream);
      }
      for (std::size_t v = 0; v < n_variants; ++v) {
        const LayerCommunication& variant = variants[v];
        CARAVAN_HIP_CHECK(hipMemsetAsync(rank.y.get(), 0xFF, mine * sizeof(bf16), rank.stream));
        barrier_.arrive_and_wait();
        layers[v]->run(r, rank.x.get(), rank.y.get(), rank.stream);
        finish(r, rank, variant.name);
        if (variant.name == kBaseline)
          gpu::to_float(rank.y.get(), rank.baseline.get(), mine, rank.stream);
        else if (!variant.skip_communication)
          diffs[v][static_cast<std::size_t>(r)] =
              relative_error(rank, rank.y.get(), rows, shape.hidden, rank.baseline.get());
      }
      for (int it = 0; it < total_runs; ++it)
        for (std::size_t j = 0; j < n_variants; ++j) {
          const std::size_t v = (static_cast<std::size_t>(it) + j) % n_variants;
          barrier_.arrive_and_wait();
          CARAVAN_HIP_CHECK(hipEventRecord(rank.begin, rank.stream));
          layers[v]->run(r, rank.x.get(), rank.y.get(), rank.stream);
          CARAVAN_HIP_CHECK(hipEventRecord(rank.end, rank.stream));
          finish(r, rank, variants[v].name);
          float ms = 0;
          CARAVAN_HIP_CHECK(hipEventElapsedTime(&ms, rank.begin, rank.end));
          if (it < request_.warmup) continue;
          totals[v][static_cast<std::size_t>(r)].push_back(static_cast<double>(ms) * 1e-3);
          const kernels::LayerTimes t = layers[v]->step_times(r);
          auto& s = steps[v][static_cast<std::size_t>(r)];
          s.insert(s.end(), t.begin(), t.end());
        }
      barrier_.arrive_and_wait();
    });
    // Per iteration, the slowest rank (the layer is done when its last rank is).
    const std::size_t n_steps = static_cast<std::size_t>(kernels::LayerStep::count);
    nlohmann::json results = nlohmann::json::array();
    for (std::size_t v = 0; v < n_variants; ++v) {
      std::vector<double> total(static_cast<std::size_t>(request_.iterations), 0.0);
      std::vector<std::vector<double>> step(n_steps, std::vector<double>(total.size(), 0.0));
      for (std::size_t r = 0; r < static_cast<std::size_t>(world_); ++r)
        for (std::size_t i = 0; i < total.size(); ++i) {
          total[i] = std::max(total[i], totals[v][r][i]);
          for (std::size_t s = 0; s < n_steps; ++s) step[s][i] = std::max(step[s][i], steps[v][r][i * n_steps + s]);
        }
      const bool baseline = variants[v].name == kBaseline;
      results.push_back({{"variant", variants[v].name},
                         {"bound", variants[v].skip_communication},
                         {"error", errors[v]},
                         {"diff_vs_baseline", baseline ? 0.0 : *std::max_element(diffs[v].begin(), diffs[v].end())},
                         {"total", total},
                         {"steps", step}});
    }
    return results;
  }

 private:
  struct RankState {
    hipStream_t stream = nullptr;
    hipEvent_t begin = nullptr, end = nullptr;
    DeviceBuffer<gpu::ErrorSums> sums;
    DeviceBuffer<bf16> x, y;
    DeviceBuffer<float> baseline, ref;
  };

  LayerCommunication with_collectives(LayerCommunication variant) const {
    if (variant.name == kBaseline) variant.bulk = nccl_.get();
    return variant;
  }

  void finish(int r, RankState& rank, const std::string& what) {
    CARAVAN_HIP_CHECK(hipEventRecord(rank.end, rank.stream));
    wait_event(rank.end, fmt::format("rank {}: layer {}", r, what));
  }

  double relative_error(RankState& rank, const bf16* out, long rows, long cols, const float* ref) {
    return app::relative_error(out, rows, cols, cols, ref, cols, rank.sums.get(), rank.stream);
  }

  // fn(rank, state) on one thread per rank; the first failure breaks the barrier and is rethrown.
  void on_ranks(const std::function<void(int, RankState&)>& fn) {
    std::mutex mutex;
    std::string failure;
    std::vector<std::thread> threads;
    for (int r = 0; r < world_; ++r)
      threads.emplace_back([&, r] {
        try {
          team_->use(r);
          fn(r, ranks_[static_cast<std::size_t>(r)]);
        } catch (const std::exception& e) {
          barrier_.break_all();
          std::lock_guard lock(mutex);
          if (failure.empty() || failure.find("another rank failed") != std::string::npos)
            failure = fmt::format("rank {}: {}", r, e.what());
        }
      });
    for (auto& t : threads) t.join();
    if (!failure.empty()) throw Error(Errc::device, "bench llm: " + failure);
  }

  const LlmGpuRequest& request_;
  int world_;
  RankBarrier barrier_;
  std::unique_ptr<gpu::GpuTeam> team_;
  std::vector<ncclComm_t> comms_;
  std::unique_ptr<NcclCollectives> nccl_;
  std::vector<RankState> ranks_;
  std::uint64_t seed_ = 0;
};

}  // namespace

std::vector<std::string> llm_gpu_variant_names() {
  std::vector<std::string> names;
  for (const auto& v : all_variants()) names.push_back(v.name);
  return names;
}

nlohmann::json run_llm_gpu(const LlmGpuRequest& request) {
  const GpuProbe probe = probe_gpus();
  if (probe.device_count < request.world)
    throw Error(
        Errc::invalid_argument,
        fmt::format("bench llm --backend gpu: --world {} needs {} GPUs; this machine has {}{}", request.world,
                    request.world, probe.device_count, probe.device_count == 0 ? " (" + probe.reason + ")" : ""));
  std::vector<LayerCommunication> variants;
  for (const auto& v : all_variants()) {
    const bool wanted = request.variants.empty() || v.name == kBaseline || v.name == kBound ||
                        std::find(request.variants.begin(), request.variants.end(), v.name) != request.variants.end();
    if (wanted) variants.push_back(v);
  }
  for (const auto& name : request.variants) {
    const auto names = llm_gpu_variant_names();
    if (std::find(names.begin(), names.end(), name) == names.end())
      throw Error(Errc::invalid_argument, fmt::format("bench llm --variant {}: unknown on the GPU backend (one of: {})",
                                                      name, fmt::join(names, ", ")));
  }
  LayerBench bench(request, variants.size());
  std::vector<double> errors;
  for (const auto& v : variants) {
    errors.push_back(-1);
    if (request.check && !v.skip_communication) {
      fmt::print(stderr, "bench llm: {}: float32 check\n", v.name);
      errors.back() = bench.check(v);
    }
  }
  const nlohmann::json results = bench.measure(variants, errors);
  const auto c = check_shape(request.world);
  return {{"backend", "gpu"},
          {"world", request.world},
          {"nodes", 1},
          {"threads", 0},
          {"toolchain", probe.toolchain},
          {"seed", bench.seed()},
          {"baseline", kBaseline},
          {"attention", request.attention},
          // Which fused kernel the layer's attention ran (the same on every GPU of the machine).
          {"attention_kernel", request.attention == "unfused"
                                   ? std::string()
                                   : gpu::attention_kernel_name(gpu::AttentionKernel::automatic,
                                                                request.shape.hidden / request.shape.heads)},
          {"check_shape",
           {{"tokens", c.tokens}, {"hidden", c.hidden}, {"heads", c.heads}, {"kv_heads", c.kv_heads}, {"ffn", c.ffn}}},
          {"results", results}};
}

}  // namespace caravan::app
