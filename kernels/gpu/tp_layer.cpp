#include "kernels/gpu/tp_layer.h"

#include <caravan/error.h>

#include <fmt/format.h>

#include <chrono>
#include <algorithm>
#include <cmath>
#include <random>
#include <thread>

namespace caravan::gpu {
namespace {

using kernels::LayerStep;

void require(bool ok, const std::string& what) {
  if (!ok) throw Error(Errc::invalid_argument, "GpuTpLayer: " + what);
}

std::size_t step_index(LayerStep s) { return static_cast<std::size_t>(s); }

}  // namespace

// One rank's weights, activations and step events, on its device.
struct GpuTpLayer::Rank {
  int device = 0;
  std::vector<void*> allocations;
  float *norm1 = nullptr, *norm2 = nullptr, *scores = nullptr;
  bf16 *w_qkv = nullptr, *w_out = nullptr, *w_up_gate = nullptr, *w_down = nullptr;
  bf16 *shard = nullptr, *gathered = nullptr, *partial = nullptr;  // bulk-synchronous only
  bf16 *qkv = nullptr, *attn = nullptr, *probs = nullptr, *proj = nullptr, *x2 = nullptr, *up_gate = nullptr,
       *act = nullptr;
  hipEvent_t events[static_cast<std::size_t>(LayerStep::count) + 1] = {};

  template <class T>
  T* allocate(long count) {
    void* p = nullptr;
    CARAVAN_HIP_CHECK(hipMalloc(&p, static_cast<std::size_t>(std::max(count, 1L)) * sizeof(T)));
    allocations.push_back(p);
    // Waited for: a memset of device memory returns before it has run, on the default stream,
    // which non-blocking streams do not wait for, and the buffers are filled on the caller's
    // stream afterwards (see gpu::allocate_device).
    CARAVAN_HIP_CHECK(hipMemsetAsync(p, 0, static_cast<std::size_t>(std::max(count, 1L)) * sizeof(T), nullptr));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(nullptr));
    return static_cast<T*>(p);
  }
  ~Rank() {
    (void)hipSetDevice(device);
    for (void* p : allocations) (void)hipFree(p);
    for (hipEvent_t e : events)
      if (e) (void)hipEventDestroy(e);
  }
};

std::uint64_t GpuTpLayer::heap_bytes(const kernels::TpLayerShape& s, int world) {
  const std::uint64_t m = static_cast<std::uint64_t>(s.tokens), h = static_cast<std::uint64_t>(s.hidden);
  const std::uint64_t shard = m / static_cast<std::uint64_t>(world) * h * sizeof(bf16);
  // Every operation's low-latency lines where its shard (or output) is small: four operations.
  const std::uint64_t lines = shard <= kLlMaxBytes ? ll_buffer_bytes(world, shard) + 4096 : 0;
  // A GEMM+ReduceScatter also takes two partials for sm-pull and sm-push where one of M x H is at
  // most pull_max_bytes() (small shapes), before its tile-scatter inboxes: without them here, the
  // inboxes found no room and blas-scatter and tile-scatter were refused (Llama-3 8B at TP 2 and
  // 4096 tokens in `bench llm --sweep`).
  const std::uint64_t partial = m * h * sizeof(bf16);
  const std::uint64_t pull = partial <= GemmReduceScatter::pull_max_bytes() ? 2 * partial : 0;
  // Two gathered A (AllGather+GEMM) and two received partials (GEMM+ReduceScatter) of M x H,
  // the two GEMM+ReduceScatters' tile-scatter inboxes (two of M x H each) and sm-pull partials,
  // flags and alignment.
  return 8 * partial + 2 * pull + 4 * lines + (8u << 20);
}

GpuTpLayer::GpuTpLayer(GpuTeam& team, const kernels::TpLayerShape& s, LayerCommunication communication, long query_block,
                       AttentionKind attention_kind)
    : team_(team), shape_(s), communication_(std::move(communication)), world_(team.world()) {
  const long w = world_;
  require(s.tokens > 0 && s.hidden > 0 && s.heads > 0 && s.kv() > 0 && s.ffn > 0,
          "tokens, hidden, heads, kv_heads and ffn must be positive");
  require(s.hidden % s.heads == 0, fmt::format("hidden = {} must be a multiple of heads = {}", s.hidden, s.heads));
  require(s.heads % s.kv() == 0, fmt::format("kv_heads = {} must divide heads = {}", s.kv(), s.heads));
  require(s.tokens % w == 0 && s.heads % w == 0 && s.kv() % w == 0 && s.ffn % w == 0,
          fmt::format("tokens = {}, heads = {}, kv_heads = {} and ffn = {} must be multiples of the world size {}", s.tokens,
                      s.heads, s.kv(), s.ffn, w));
  require(s.head_dim() % 8 == 0 && (s.ffn / w) % 8 == 0,
          fmt::format("head width {} and ffn / world = {} must be multiples of 8 (16-byte rows)", s.head_dim(), s.ffn / w));
  require(communication_.all_gather_lanes >= 1 && communication_.all_gather_lanes <= 2 &&
              communication_.reduce_scatter_lanes >= 1 && communication_.reduce_scatter_lanes <= 2,
          "lanes must be 1 or 2");
  rows_ = s.tokens / w;
  q_heads_ = s.heads / w;
  kv_heads_ = s.kv() / w;
  head_dim_ = s.head_dim();
  qkv_cols_ = (q_heads_ + 2 * kv_heads_) * head_dim_;
  h_local_ = q_heads_ * head_dim_;
  f_local_ = s.ffn / w;
  require(query_block > 0, fmt::format("query_block = {} must be positive", query_block));
  query_block_ = std::min(query_block, s.tokens);
  fused_attention_ = attention_kind != AttentionKind::unfused && fused_attention_supports(head_dim_);
  require(attention_kind != AttentionKind::fused || fused_attention_,
          fmt::format("fused attention needs a head width of 32, 64 or 128 (hidden / heads = {})", head_dim_));
  const long m = s.tokens, h = s.hidden;

  const bool own_buffers = communication_.bulk || communication_.skip_communication;
  if (!own_buffers) {
    const int splits = communication_.reduce_scatter_splits;
    require(communication_.out_proj_splits >= 0,
            fmt::format("LayerCommunication::out_proj_splits = {}: must be 0 (as reduce_scatter_splits) or more",
                        communication_.out_proj_splits));
    const int out_splits = communication_.out_proj_splits > 0 ? communication_.out_proj_splits : splits;
    qkv_op_ = std::make_unique<AllGatherGemm>(team, m, h, qkv_cols_);
    out_op_ = std::make_unique<GemmReduceScatter>(team, m, h_local_, h, out_splits);
    up_gate_op_ = std::make_unique<AllGatherGemm>(team, m, h, 2 * f_local_);
    down_op_ = std::make_unique<GemmReduceScatter>(team, m, f_local_, h, splits);
  }
  ranks_.resize(static_cast<std::size_t>(world_));
  for (int rank : team.driven_ranks()) {
    team.use(rank);
    preload_layer_kernels();
    preload_attention();
    auto r = std::make_unique<Rank>();
    r->device = team.device(rank);
    for (auto& e : r->events) CARAVAN_HIP_CHECK(hipEventCreate(&e));
    r->norm1 = r->allocate<float>(h);
    r->norm2 = r->allocate<float>(h);
    r->w_qkv = r->allocate<bf16>(h * qkv_cols_);
    r->w_out = r->allocate<bf16>(h_local_ * h);
    r->w_up_gate = r->allocate<bf16>(h * 2 * f_local_);
    r->w_down = r->allocate<bf16>(f_local_ * h);
    if (own_buffers) {
      r->shard = r->allocate<bf16>(rows_ * h);
      r->gathered = r->allocate<bf16>(m * h);
      r->partial = r->allocate<bf16>(m * h);
    }
    r->qkv = r->allocate<bf16>(m * qkv_cols_);
    r->attn = r->allocate<bf16>(m * h_local_);
    if (!fused_attention_) {
      r->scores = r->allocate<float>(q_heads_ * query_block_ * m);
      r->probs = r->allocate<bf16>(q_heads_ * query_block_ * m);
    }
    r->proj = r->allocate<bf16>(rows_ * h);
    r->x2 = r->allocate<bf16>(rows_ * h);
    r->up_gate = r->allocate<bf16>(m * 2 * f_local_);
    r->act = r->allocate<bf16>(m * f_local_);
    ranks_[static_cast<std::size_t>(rank)] = std::move(r);
  }
  // Every GEMM shape and kernel once, with nothing in flight (the operations warmed up theirs).
  for (int rank : team.driven_ranks()) {
    team.use(rank);
    Rank& r = *ranks_[static_cast<std::size_t>(rank)];
    hipStream_t stream = team.lane_stream(rank);
    attention(rank, stream);
    Blas& blas = team.blas(rank);
    if (own_buffers) {
      // The bulk GEMMs' shapes are the overlapped operations' whole ones, tuned alike (blas.h).
      blas.tune(m, qkv_cols_, h, h, qkv_cols_, qkv_cols_);
      blas.tune(m, h, h_local_, h_local_, h, h);
      blas.tune(m, 2 * f_local_, h, h, 2 * f_local_, 2 * f_local_);
      blas.tune(m, h, f_local_, f_local_, h, h);
      blas.gemm(stream, m, qkv_cols_, h, r.gathered, h, r.w_qkv, qkv_cols_, r.qkv, qkv_cols_);
      blas.gemm(stream, m, h, h_local_, r.attn, h_local_, r.w_out, h, r.partial, h);
      blas.gemm(stream, m, 2 * f_local_, h, r.gathered, h, r.w_up_gate, 2 * f_local_, r.up_gate, 2 * f_local_);
      blas.gemm(stream, m, h, f_local_, r.act, f_local_, r.w_down, h, r.partial, h);
    }
    if (communication_.skip_communication) {
      // The bound's GEMMs read the gathered buffer that no collective fills: give it values like
      // real activations. On zeros the tensor cores draw less power and clock higher, which made
      // the bound (and its attention, on the zero QKV that followed) faster than any real layer.
      fill_random(r.gathered, m, h, h, 0x57a1e + static_cast<std::uint64_t>(rank), 0, 0, 1.0f, stream);
      fill_random(r.proj, rows_, h, h, 0x9a27 + static_cast<std::uint64_t>(rank), 0, 0, 1.0f, stream);
    }
    rmsnorm(r.proj, rows_, h, r.norm1, r.x2, stream);
    add(r.proj, r.x2, r.x2, static_cast<std::size_t>(rows_ * h), stream);
    swiglu(r.up_gate, m, f_local_, r.act, stream);
    CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
  }
  team.construction_done(fmt::format("GpuTpLayer tokens={} hidden={} heads={} kv_heads={} ffn={} query_block={}",
                                     s.tokens, s.hidden, s.heads, s.kv(), s.ffn, query_block));
}

GpuTpLayer::~GpuTpLayer() = default;

void GpuTpLayer::set_weights(const kernels::TpLayerWeights& wt) {
  const long h = shape_.hidden, f = shape_.ffn, d = head_dim_, width = shape_.qkv_width();
  require(wt.norm1.size() == static_cast<std::size_t>(h) && wt.norm2.size() == static_cast<std::size_t>(h) &&
              wt.qkv.size() == static_cast<std::size_t>(h * width) && wt.out.size() == static_cast<std::size_t>(h * h) &&
              wt.up.size() == static_cast<std::size_t>(h * f) && wt.gate.size() == static_cast<std::size_t>(h * f) &&
              wt.down.size() == static_cast<std::size_t>(f * h),
          "set_weights: the weights do not match the layer's shape");
  static_assert(sizeof(kernels::Bf16) == sizeof(bf16));
  for (int rank : team_.driven_ranks()) {
    team_.use(rank);
    Rank& r = *ranks_[static_cast<std::size_t>(rank)];
    // This rank's query heads, then its key heads, then its value heads: [H, qkv_cols].
    std::vector<kernels::Bf16> qkv(static_cast<std::size_t>(h * qkv_cols_));
    const long q_from = rank * q_heads_ * d, k_from = shape_.heads * d + rank * kv_heads_ * d,
               v_from = (shape_.heads + shape_.kv()) * d + rank * kv_heads_ * d;
    for (long k = 0; k < h; ++k) {
      auto row = wt.qkv.begin() + k * width;
      auto out = qkv.begin() + k * qkv_cols_;
      std::copy_n(row + q_from, q_heads_ * d, out);
      std::copy_n(row + k_from, kv_heads_ * d, out + q_heads_ * d);
      std::copy_n(row + v_from, kv_heads_ * d, out + (q_heads_ + kv_heads_) * d);
    }
    std::vector<kernels::Bf16> up_gate(static_cast<std::size_t>(h * 2 * f_local_));
    for (long k = 0; k < h; ++k) {
      std::copy_n(wt.up.begin() + k * f + rank * f_local_, f_local_, up_gate.begin() + k * 2 * f_local_);
      std::copy_n(wt.gate.begin() + k * f + rank * f_local_, f_local_, up_gate.begin() + k * 2 * f_local_ + f_local_);
    }
    const auto upload = [](void* dst, const void* src, std::size_t bytes) {
      CARAVAN_HIP_CHECK(hipMemcpy(dst, src, bytes, hipMemcpyDefault));
    };
    upload(r.norm1, wt.norm1.data(), static_cast<std::size_t>(h) * sizeof(float));
    upload(r.norm2, wt.norm2.data(), static_cast<std::size_t>(h) * sizeof(float));
    upload(r.w_qkv, qkv.data(), qkv.size() * sizeof(bf16));
    upload(r.w_out, wt.out.data() + rank * h_local_ * h, static_cast<std::size_t>(h_local_ * h) * sizeof(bf16));
    upload(r.w_up_gate, up_gate.data(), up_gate.size() * sizeof(bf16));
    upload(r.w_down, wt.down.data() + rank * f_local_ * h, static_cast<std::size_t>(f_local_ * h) * sizeof(bf16));
  }
}

void GpuTpLayer::set_random_weights(std::uint64_t seed) {
  const long h = shape_.hidden;
  const float h_scale = 1.0f / std::sqrt(static_cast<float>(h)), f_scale = 1.0f / std::sqrt(static_cast<float>(shape_.ffn));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> near_one(0.8f, 1.2f);
  std::vector<float> norms(static_cast<std::size_t>(2 * h));
  for (auto& v : norms) v = near_one(rng);
  for (int rank : team_.driven_ranks()) {
    team_.use(rank);
    Rank& r = *ranks_[static_cast<std::size_t>(rank)];
    hipStream_t stream = team_.lane_stream(rank);
    const std::uint64_t base = seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(rank) * 16;
    fill_random(r.w_qkv, h, qkv_cols_, qkv_cols_, base + 1, 0, 0, h_scale, stream);
    fill_random(r.w_out, h_local_, h, h, base + 2, 0, 0, h_scale, stream);
    fill_random(r.w_up_gate, h, 2 * f_local_, 2 * f_local_, base + 3, 0, 0, h_scale, stream);
    fill_random(r.w_down, f_local_, h, h, base + 4, 0, 0, f_scale, stream);
    CARAVAN_HIP_CHECK(hipMemcpyAsync(r.norm1, norms.data(), static_cast<std::size_t>(h) * sizeof(float),
                                     hipMemcpyDefault, stream));
    CARAVAN_HIP_CHECK(hipMemcpyAsync(r.norm2, norms.data() + h, static_cast<std::size_t>(h) * sizeof(float),
                                     hipMemcpyDefault, stream));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
  }
}

void unfused_causal_attention(Blas& blas, const AttentionArguments& a, long query_block, float* scores, bf16* probs,
                              hipStream_t stream) {
  if (a.q_heads <= 0 || a.kv_heads <= 0 || a.q_heads % a.kv_heads != 0 || query_block <= 0)
    throw Error(Errc::invalid_argument,
                fmt::format("unfused_causal_attention: q_heads = {} must be a positive multiple of kv_heads = {} and "
                            "query_block = {} positive",
                            a.q_heads, a.kv_heads, query_block));
  // The scores of query block [q0, q0 + B) need keys [0, q0 + B) only. Query head j of key/value
  // group g is head g * group + j; a batched GEMM per group shares K (and V) across the group's
  // heads (stride 0).
  const long m = a.tokens, d = a.head_dim, group = a.q_heads / a.kv_heads;
  for (long q0 = 0; q0 < m; q0 += query_block) {
    const long b = std::min(query_block, m - q0), keys = q0 + b;
    for (long g = 0; g < a.kv_heads; ++g)
      blas.gemm_batched(stream, b, keys, d, a.scale, a.q + q0 * a.ld + g * group * d, a.ld, d, a.k + g * d, a.ld, 0,
                        true, scores + g * group * b * keys, true, keys, b * keys, static_cast<int>(group));
    causal_softmax(scores, a.q_heads * b, keys, b, q0, probs, stream);
    for (long g = 0; g < a.kv_heads; ++g)
      blas.gemm_batched(stream, b, d, keys, 1.0f, probs + g * group * b * keys, keys, b * keys, a.v + g * d, a.ld, 0,
                        false, a.out + q0 * a.ld_out + g * group * d, false, a.ld_out, d, static_cast<int>(group));
  }
}

// Causal attention of this rank's heads over the whole (gathered) sequence.
void GpuTpLayer::attention(int rank, hipStream_t stream) {
  Rank& r = *ranks_[static_cast<std::size_t>(rank)];
  const AttentionArguments a =
      packed_qkv_attention(r.qkv, qkv_cols_, shape_.tokens, q_heads_, kv_heads_, head_dim_, r.attn, h_local_);
  if (fused_attention_)
    fused_causal_attention(a, stream);
  else
    unfused_causal_attention(team_.blas(rank), a, query_block_, r.scores, r.probs, stream);
}

void GpuTpLayer::run(int rank, const bf16* x, bf16* y, hipStream_t stream) {
  require(team_.drives(rank), fmt::format("run: rank {} is outside 0..{} or driven by another process", rank, world_ - 1));
  Rank& r = *ranks_[static_cast<std::size_t>(rank)];
  const LayerCommunication& c = communication_;
  const long m = shape_.tokens, h = shape_.hidden;
  const std::size_t my_elements = static_cast<std::size_t>(rows_ * h);
  Blas& blas = team_.blas(rank);
  auto mark = [&](LayerStep done) { CARAVAN_HIP_CHECK(hipEventRecord(r.events[step_index(done) + 1], stream)); };
  CARAVAN_HIP_CHECK(hipEventRecord(r.events[0], stream));

  const bool own_buffers = c.bulk || c.skip_communication;
  // RMSNorm straight into the AllGather's input (the operation's shard in symmetric memory).
  const auto norm_into_shard = [&](const bf16* in, const float* weight, AllGatherGemm* op) {
    if (own_buffers) {
      rmsnorm(in, rows_, h, weight, r.shard, stream);
      return;
    }
    op->wait_shard_free(rank, stream);
    rmsnorm(in, rows_, h, weight, op->shard(rank), stream);
  };
  const auto all_gather_gemm = [&](AllGatherGemm* op, const bf16* weights, long n, bf16* out) {
    if (own_buffers) {
      if (c.bulk) c.bulk->all_gather(rank, r.shard, r.gathered, my_elements, stream);
      blas.gemm(stream, m, n, h, r.gathered, h, weights, n, out, n);
    } else {
      op->run(rank, weights, out, c.all_gather, stream, c.all_gather_lanes);
    }
  };
  const auto gemm_reduce_scatter = [&](GemmReduceScatter* op, const bf16* a, long k, const bf16* weights) {
    if (own_buffers) {
      blas.gemm(stream, m, h, k, a, k, weights, h, r.partial, h);
      if (c.bulk) c.bulk->reduce_scatter(rank, r.partial, r.proj, my_elements, stream);
    } else {
      op->run(rank, a, weights, r.proj, c.reduce_scatter, stream, c.reduce_scatter_lanes);
    }
  };

  norm_into_shard(x, r.norm1, qkv_op_.get());
  mark(LayerStep::norm1);
  all_gather_gemm(qkv_op_.get(), r.w_qkv, qkv_cols_, r.qkv);
  mark(LayerStep::qkv);
  attention(rank, stream);
  mark(LayerStep::attention);
  gemm_reduce_scatter(out_op_.get(), r.attn, h_local_, r.w_out);
  add(x, r.proj, r.x2, my_elements, stream);
  mark(LayerStep::out_proj);
  norm_into_shard(r.x2, r.norm2, up_gate_op_.get());
  mark(LayerStep::norm2);
  all_gather_gemm(up_gate_op_.get(), r.w_up_gate, 2 * f_local_, r.up_gate);
  mark(LayerStep::up_gate);
  swiglu(r.up_gate, m, f_local_, r.act, stream);
  mark(LayerStep::swiglu);
  gemm_reduce_scatter(down_op_.get(), r.act, f_local_, r.w_down);
  add(r.x2, r.proj, y, my_elements, stream);
  mark(LayerStep::down_proj);
}

kernels::LayerTimes GpuTpLayer::step_times(int rank) {
  require(team_.drives(rank), fmt::format("step_times: rank {} is outside 0..{} or driven by another process", rank, world_ - 1));
  Rank& r = *ranks_[static_cast<std::size_t>(rank)];
  hipEvent_t last = r.events[step_index(LayerStep::count)];
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    const hipError_t status = hipEventQuery(last);
    if (status == hipSuccess) break;
    if (status != hipErrorNotReady) CARAVAN_HIP_CHECK(status);
    if (std::chrono::steady_clock::now() > deadline)
      throw Error(Errc::timeout, fmt::format("GpuTpLayer: rank {}'s layer did not finish within 60 s (a flag never "
                                             "raised?)\n{}",
                                             rank, describe_progress()));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  kernels::LayerTimes times{};
  for (std::size_t s = 0; s < times.size(); ++s) {
    float ms = 0;
    CARAVAN_HIP_CHECK(hipEventElapsedTime(&ms, r.events[s], r.events[s + 1]));
    times[s] = static_cast<double>(ms) * 1e-3;
  }
  return times;
}

std::string GpuTpLayer::describe_progress() const {
  std::lock_guard lock(describe_mutex_);
  int current = 0;
  (void)hipGetDevice(&current);
  std::string out;
  for (int r = 0; r < world_; ++r) {
    const Rank* rank = ranks_[static_cast<std::size_t>(r)].get();
    if (rank == nullptr) {
      out += fmt::format("rank {}: driven by another process\n", r);
      continue;
    }
    (void)hipSetDevice(rank->device);
    // events[s + 1] marks the end of step s; the first one still pending is where the run is.
    std::string where = "its last run is done (or it has not run)";
    for (std::size_t s = 0; s <= static_cast<std::size_t>(LayerStep::count); ++s) {
      const hipError_t status = hipEventQuery(rank->events[s]);
      if (status == hipSuccess) continue;
      where = s == 0 ? std::string("not started")
                     : fmt::format("in step {} ({})", to_string(static_cast<LayerStep>(s - 1)),
                                   status == hipErrorNotReady ? "pending" : hipGetErrorName(status));
      break;
    }
    out += fmt::format("rank {}: {}\n", r, where);
  }
  (void)hipSetDevice(current);
  for (const auto& [name, op] :
       {std::pair{"qkv AllGather+GEMM", qkv_op_.get()}, std::pair{"up/gate AllGather+GEMM", up_gate_op_.get()}})
    if (op != nullptr) out += fmt::format("{}:\n{}", name, op->describe_flags());
  for (const auto& [name, op] :
       {std::pair{"out GEMM+ReduceScatter", out_op_.get()}, std::pair{"down GEMM+ReduceScatter", down_op_.get()}})
    if (op != nullptr) out += fmt::format("{}:\n{}", name, op->describe_flags());
  return out;
}

}  // namespace caravan::gpu
