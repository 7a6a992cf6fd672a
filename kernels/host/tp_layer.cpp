// The tensor-parallel transformer layer of include/caravan/kernels/tp_layer.h.
#include <caravan/error.h>
#include <caravan/kernels/tp_layer.h>
#include <caravan/runtime.h>

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <random>

namespace caravan::kernels {
namespace {

using Clock = std::chrono::steady_clock;

void rmsnorm_rows(const Bf16* x, std::int64_t rows, std::int64_t h, const float* weight, Bf16* out) {
  for (std::int64_t i = 0; i < rows; ++i) {
    const Bf16* row = x + i * h;
    double sum = 0;
    for (std::int64_t j = 0; j < h; ++j) {
      const float v = row[j].to_float();
      sum += static_cast<double>(v) * v;
    }
    const float inverse = 1.0f / std::sqrt(static_cast<float>(sum / static_cast<double>(h)) + 1e-6f);
    for (std::int64_t j = 0; j < h; ++j) out[i * h + j] = Bf16::from_float(row[j].to_float() * inverse * weight[j]);
  }
}

// Causal attention of `heads` query heads of width d over `kv_heads` key/value heads (query head
// h reads key/value head h / (heads / kv_heads)). Row i of `qkv` (ld elements per row) holds
// query head h at columns [q0 + h d, ...), key head g at [k0 + g d, ...) and value head g at
// [v0 + g d, ...); out row i (ld_out) gets head h at columns [h d, (h + 1) d). Loops are ordered
// so that the inner ones run over contiguous floats (vectorisable): K is transposed per head.
void causal_attention(const Bf16* qkv, std::int64_t ld, std::int64_t m, std::int64_t heads, std::int64_t kv_heads,
                      std::int64_t d, std::int64_t q0, std::int64_t k0, std::int64_t v0, Bf16* out, std::int64_t ld_out) {
  std::vector<float> kt(static_cast<std::size_t>(d * m)), v(static_cast<std::size_t>(m * d)), q(static_cast<std::size_t>(d));
  std::vector<float> scores(static_cast<std::size_t>(m)), acc(static_cast<std::size_t>(d));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const std::int64_t group = heads / kv_heads;
  for (std::int64_t h = 0; h < heads; ++h) {
    const std::int64_t g = h / group;
    if (h % group == 0)
      for (std::int64_t j = 0; j < m; ++j)
        for (std::int64_t c = 0; c < d; ++c) {
          kt[static_cast<std::size_t>(c * m + j)] = qkv[j * ld + k0 + g * d + c].to_float();
          v[static_cast<std::size_t>(j * d + c)] = qkv[j * ld + v0 + g * d + c].to_float();
        }
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t c = 0; c < d; ++c) q[static_cast<std::size_t>(c)] = qkv[i * ld + q0 + h * d + c].to_float() * scale;
      const std::int64_t n = i + 1;  // causal: keys 0..i
      std::fill_n(scores.begin(), n, 0.0f);
      for (std::int64_t c = 0; c < d; ++c) {
        const float qc = q[static_cast<std::size_t>(c)];
        const float* krow = kt.data() + c * m;
        for (std::int64_t j = 0; j < n; ++j) scores[static_cast<std::size_t>(j)] += qc * krow[j];
      }
      float top = scores[0];
      for (std::int64_t j = 1; j < n; ++j) top = std::max(top, scores[static_cast<std::size_t>(j)]);
      float total = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        scores[static_cast<std::size_t>(j)] = std::exp(scores[static_cast<std::size_t>(j)] - top);
        total += scores[static_cast<std::size_t>(j)];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::int64_t j = 0; j < n; ++j) {
        const float p = scores[static_cast<std::size_t>(j)] / total;
        const float* vrow = v.data() + j * d;
        for (std::int64_t c = 0; c < d; ++c) acc[static_cast<std::size_t>(c)] += p * vrow[c];
      }
      for (std::int64_t c = 0; c < d; ++c) out[i * ld_out + h * d + c] = Bf16::from_float(acc[static_cast<std::size_t>(c)]);
    }
  }
}

float silu(float x) { return x / (1.0f + std::exp(-x)); }

// out[i, j] = silu(gate[i, j]) * up[i, j]; `ug` rows are [up (f) | gate (f)].
void swiglu_rows(const Bf16* ug, std::int64_t rows, std::int64_t f, Bf16* out) {
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < f; ++j)
      out[i * f + j] = Bf16::from_float(silu(ug[i * 2 * f + f + j].to_float()) * ug[i * 2 * f + j].to_float());
}

void add_rows(const Bf16* a, const Bf16* b, std::int64_t count, Bf16* out) {
  for (std::int64_t i = 0; i < count; ++i) out[i] = Bf16::from_float(a[i].to_float() + b[i].to_float());
}

std::vector<Bf16> random_scaled(std::int64_t count, double scale, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<Bf16> out(static_cast<std::size_t>(count));
  for (auto& v : out) v = Bf16::from_float(static_cast<float>(dist(rng) * scale));
  return out;
}

std::vector<Bf16> to_bf16_vector(const std::vector<float>& v) {
  std::vector<Bf16> out(v.size());
  to_bf16(v, out);
  return out;
}

}  // namespace

std::string_view to_string(LayerStep step) {
  switch (step) {
    case LayerStep::norm1: return "rmsnorm 1";
    case LayerStep::qkv: return "qkv (allgather+gemm)";
    case LayerStep::attention: return "attention";
    case LayerStep::out_proj: return "out proj (gemm+reducescatter) + residual";
    case LayerStep::norm2: return "rmsnorm 2";
    case LayerStep::up_gate: return "up/gate (allgather+gemm)";
    case LayerStep::swiglu: return "swiglu";
    case LayerStep::down_proj: return "down proj (gemm+reducescatter) + residual";
    case LayerStep::count: break;
  }
  return "?";
}

TpLayerWeights random_layer_weights(const TpLayerShape& s, std::uint64_t seed) {
  if (s.hidden < 1 || s.ffn < 1 || s.heads < 1 || s.kv_heads < 0)
    throw Error(
        Errc::invalid_argument,
        fmt::format("random_layer_weights: hidden = {}, ffn = {} and heads = {} must be at least 1, kv_heads = {} "
                    "at least 0",
                    s.hidden, s.ffn, s.heads, s.kv_heads));
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 17);
  TpLayerWeights w;
  std::uniform_real_distribution<float> near_one(0.8f, 1.2f);
  for (std::int64_t i = 0; i < s.hidden; ++i) w.norm1.push_back(near_one(rng)), w.norm2.push_back(near_one(rng));
  const double h_scale = 1.0 / std::sqrt(static_cast<double>(s.hidden)), f_scale = 1.0 / std::sqrt(static_cast<double>(s.ffn));
  w.qkv = random_scaled(s.hidden * s.qkv_width(), h_scale, rng);
  w.out = random_scaled(s.hidden * s.hidden, h_scale, rng);
  w.up = random_scaled(s.hidden * s.ffn, h_scale, rng);
  w.gate = random_scaled(s.hidden * s.ffn, h_scale, rng);
  w.down = random_scaled(s.ffn * s.hidden, f_scale, rng);
  return w;
}

struct TensorParallelLayer::State {
  State(SymmetricHeap heap, const TpLayerShape& s, OverlapVariant variant, const OverlapOptions& options)
      : shape(s),
        world(Runtime::current().world_size()),
        rank(Runtime::current().rank()),
        rows(s.tokens / world),
        h_local(s.hidden / world),
        kv_local(s.kv() / world * s.head_dim()),
        f_local(s.ffn / world),
        qkv_op(heap, s.tokens, s.qkv_width(), s.hidden, variant, options),
        out_op(heap, s.tokens, s.hidden, s.hidden, variant, options),
        up_gate_op(heap, s.tokens, 2 * s.ffn, s.hidden, variant, options),
        down_op(heap, s.tokens, s.hidden, s.ffn, variant, options) {
    const auto size = [](std::int64_t n) { return static_cast<std::size_t>(n); };
    h.resize(size(rows * s.hidden));
    qkv.resize(size(s.tokens * (h_local + 2 * kv_local)));
    attn.resize(size(s.tokens * h_local));
    proj.resize(size(rows * s.hidden));
    x2.resize(size(rows * s.hidden));
    ug.resize(size(s.tokens * 2 * f_local));
    act.resize(size(s.tokens * f_local));
  }
  static const TpLayerShape& check(const TpLayerShape& s) {
    const int w = Runtime::current().world_size();
    const auto rule = [](bool ok, const std::string& what) {
      if (!ok) throw Error(Errc::invalid_argument, "TensorParallelLayer: " + what);
    };
    rule(s.tokens >= 1 && s.hidden >= 1 && s.heads >= 1 && s.ffn >= 1, "tokens, hidden, heads and ffn must be at least 1");
    rule(s.hidden % s.heads == 0, fmt::format("hidden = {} must be a multiple of heads = {}", s.hidden, s.heads));
    rule(s.heads % w == 0, fmt::format("heads = {} must be a multiple of the world size {}", s.heads, w));
    rule(s.ffn % w == 0, fmt::format("ffn = {} must be a multiple of the world size {}", s.ffn, w));
    rule(s.tokens % w == 0, fmt::format("tokens = {} must be a multiple of the world size {}", s.tokens, w));
    rule(s.kv() >= 1 && s.heads % s.kv() == 0 && s.kv() % w == 0,
         fmt::format("kv_heads = {} must divide heads = {} and be a multiple of the world size {}", s.kv(), s.heads, w));
    return s;
  }

  TpLayerShape shape;
  int world, rank;
  std::int64_t rows, h_local, kv_local, f_local;  // kv_local: this rank's key (or value) columns
  AllGatherGemm qkv_op;
  GemmReduceScatter out_op;
  AllGatherGemm up_gate_op;
  GemmReduceScatter down_op;
  std::vector<float> norm1, norm2;
  std::vector<Bf16> h, qkv, attn, proj, x2, ug, act;
};

TensorParallelLayer::TensorParallelLayer(SymmetricHeap heap, const TpLayerShape& shape, OverlapVariant variant,
                                         const OverlapOptions& options)
    : state_(std::make_unique<State>(heap, State::check(shape), variant, options)) {}
TensorParallelLayer::~TensorParallelLayer() = default;

void TensorParallelLayer::set_weights(const TpLayerWeights& w) {
  State& s = *state_;
  const std::int64_t hd = s.shape.hidden, f = s.shape.ffn, hl = s.h_local, kvl = s.kv_local, fl = s.f_local, r = s.rank;
  const std::int64_t width = s.shape.qkv_width(), local = hl + 2 * kvl, d = s.shape.head_dim();
  // Every weight, by name: one too small would be read past its end below.
  const auto expect = [](const char* name, std::size_t size, std::int64_t wanted) {
    if (size != static_cast<std::size_t>(wanted))
      throw Error(Errc::invalid_argument,
                  fmt::format("TensorParallelLayer::set_weights: {} has {} values; the layer's shape needs {}", name,
                              size, wanted));
  };
  expect("norm1", w.norm1.size(), hd);
  expect("norm2", w.norm2.size(), hd);
  expect("qkv", w.qkv.size(), hd * width);
  expect("out", w.out.size(), hd * hd);
  expect("up", w.up.size(), hd * f);
  expect("gate", w.gate.size(), hd * f);
  expect("down", w.down.size(), f * hd);
  s.norm1 = w.norm1;
  s.norm2 = w.norm2;
  // This rank's columns of Q, K and V (its query heads and its key/value heads), side by side:
  // [H, H/W + 2 kv_local].
  std::vector<Bf16> qkv(static_cast<std::size_t>(hd * local));
  const std::int64_t k_from = s.shape.heads * d + r * kvl, v_from = (s.shape.heads + s.shape.kv()) * d + r * kvl;
  for (std::int64_t k = 0; k < hd; ++k) {
    std::copy_n(w.qkv.begin() + k * width + r * hl, hl, qkv.begin() + k * local);
    std::copy_n(w.qkv.begin() + k * width + k_from, kvl, qkv.begin() + k * local + hl);
    std::copy_n(w.qkv.begin() + k * width + v_from, kvl, qkv.begin() + k * local + hl + kvl);
  }
  s.qkv_op.set_weights(qkv.data());
  s.out_op.set_weights(w.out.data() + r * hl * hd);  // rows of this rank's heads
  std::vector<Bf16> ug(static_cast<std::size_t>(hd * 2 * fl));
  for (std::int64_t k = 0; k < hd; ++k) {
    std::copy_n(w.up.begin() + k * f + r * fl, fl, ug.begin() + k * 2 * fl);
    std::copy_n(w.gate.begin() + k * f + r * fl, fl, ug.begin() + k * 2 * fl + fl);
  }
  s.up_gate_op.set_weights(ug.data());
  s.down_op.set_weights(w.down.data() + r * fl * hd);
}

void TensorParallelLayer::run(const Bf16* x, Bf16* y, LayerTimes* times) {
  State& s = *state_;
  if (s.norm1.empty()) throw Error(Errc::invalid_argument, "TensorParallelLayer::run: set_weights() first");
  const std::int64_t hd = s.shape.hidden, m = s.shape.tokens, d = hd / s.shape.heads;
  auto last = Clock::now();
  auto lap = [&](LayerStep step) {
    const auto now = Clock::now();
    if (times) (*times)[static_cast<std::size_t>(step)] = std::chrono::duration<double>(now - last).count();
    last = now;
  };
  rmsnorm_rows(x, s.rows, hd, s.norm1.data(), s.h.data());
  lap(LayerStep::norm1);
  s.qkv_op.run(s.h.data(), s.qkv.data());
  lap(LayerStep::qkv);
  causal_attention(s.qkv.data(), s.h_local + 2 * s.kv_local, m, s.shape.heads / s.world, s.shape.kv() / s.world, d, 0,
                   s.h_local, s.h_local + s.kv_local, s.attn.data(), s.h_local);
  lap(LayerStep::attention);
  s.out_op.run(s.attn.data(), s.proj.data());
  add_rows(x, s.proj.data(), s.rows * hd, s.x2.data());
  lap(LayerStep::out_proj);
  rmsnorm_rows(s.x2.data(), s.rows, hd, s.norm2.data(), s.h.data());
  lap(LayerStep::norm2);
  s.up_gate_op.run(s.h.data(), s.ug.data());
  lap(LayerStep::up_gate);
  swiglu_rows(s.ug.data(), m, s.f_local, s.act.data());
  lap(LayerStep::swiglu);
  s.down_op.run(s.act.data(), s.proj.data());
  add_rows(s.x2.data(), s.proj.data(), s.rows * hd, y);
  lap(LayerStep::down_proj);
}

std::vector<float> reference_layer(const TpLayerShape& s, const TpLayerWeights& w, const std::vector<Bf16>& x, int world) {
  const std::int64_t m = s.tokens, hd = s.hidden, f = s.ffn;
  if (s.heads < 1 || hd % s.heads != 0 || s.kv() < 1 || s.heads % s.kv() != 0)
    throw Error(Errc::invalid_argument, fmt::format("reference_layer: heads = {} must divide hidden = {}, and kv_heads = {} "
                                                    "must divide heads",
                                                    s.heads, hd, s.kv_heads));
  const auto size = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  // A row-parallel projection as the distributed layer computes it: each rank's partial product
  // over its slice of the inner dimension rounded to bf16, the partials summed in fp32, rounded.
  const auto row_parallel = [&](const std::vector<Bf16>& a, const std::vector<Bf16>& b, std::int64_t inner) {
    const std::int64_t slice = inner / world;
    std::vector<float> sum(size(m * hd), 0.0f);
    for (int r = 0; r < world; ++r) {
      auto part = reference_gemm(a.data() + r * slice, inner, b.data() + r * slice * hd, hd, m, hd, slice);
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += Bf16::from_float(part[i]).to_float();
    }
    return to_bf16_vector(sum);
  };
  std::vector<Bf16> h(size(m * hd));
  rmsnorm_rows(x.data(), m, hd, w.norm1.data(), h.data());
  const std::int64_t width = s.qkv_width(), d = s.head_dim();
  auto qkv = to_bf16_vector(reference_gemm(h.data(), hd, w.qkv.data(), width, m, width, hd));
  std::vector<Bf16> attn(size(m * hd));
  causal_attention(qkv.data(), width, m, s.heads, s.kv(), d, 0, hd, hd + s.kv() * d, attn.data(), hd);
  auto proj = row_parallel(attn, w.out, hd);
  std::vector<Bf16> x2(size(m * hd));
  add_rows(x.data(), proj.data(), m * hd, x2.data());
  rmsnorm_rows(x2.data(), m, hd, w.norm2.data(), h.data());
  auto up = to_bf16_vector(reference_gemm(h.data(), hd, w.up.data(), f, m, f, hd));
  auto gate = to_bf16_vector(reference_gemm(h.data(), hd, w.gate.data(), f, m, f, hd));
  std::vector<Bf16> act(size(m * f));
  for (std::int64_t i = 0; i < m * f; ++i)
    act[size(i)] = Bf16::from_float(silu(gate[size(i)].to_float()) * up[size(i)].to_float());
  auto down = row_parallel(act, w.down, f);
  std::vector<Bf16> y(size(m * hd));
  add_rows(x2.data(), down.data(), m * hd, y.data());
  std::vector<float> out(y.size());
  to_float(y, out);
  return out;
}

}  // namespace caravan::kernels
