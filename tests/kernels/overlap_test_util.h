// Inputs and references shared by the overlap tests: every rank can regenerate any rank's
// inputs from (seed, rank), so each checks its own output against a float32 reference.
#pragma once

#include <caravan/kernels/tile_gemm.h>

#include <cstdint>
#include <random>
#include <vector>

namespace caravan::kernels::test {

inline std::vector<Bf16> random_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 12345);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<Bf16> m(static_cast<std::size_t>(rows * cols));
  for (auto& v : m) v = Bf16::from_float(dist(rng));
  return m;
}

inline std::uint64_t seed_of(int iteration, int rank, int what) {
  return static_cast<std::uint64_t>(iteration) * 1000003 + static_cast<std::uint64_t>(rank) * 101 + static_cast<std::uint64_t>(what);
}

inline constexpr Bf16 kPoison{0x7FC0};  // NaN: an output element nobody wrote fails every check

// Row block [row0, row0 + rows) of a row-major matrix with `cols` columns.
inline std::vector<Bf16> rows_of(const std::vector<Bf16>& m, std::int64_t cols, std::int64_t row0, std::int64_t rows) {
  return {m.begin() + row0 * cols, m.begin() + (row0 + rows) * cols};
}

}  // namespace caravan::kernels::test

#include <caravan/kernels/overlap.h>
#include <caravan/kernels/tp_layer.h>
#include <caravan/runtime.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

namespace caravan::kernels::test {

// Small tiles so that a small shape still has several chunks and tiles, with remainders.
inline OverlapOptions test_options() {
  OverlapOptions o;
  o.threads = 2;
  o.comm_threads = 1;
  o.chunk_rows = 16;
  o.tile_cols = 32;
  o.timeout = std::chrono::seconds(20);
  return o;
}

// Each check: `iterations` launches of one operation object, fresh inputs each time, the output
// poisoned before each launch, compared with a float32 reference. Returns nothing; records
// failures with the launch and variant.

inline void check_all_gather_gemm(OverlapVariant variant, int iterations) {
  Runtime& rt = Runtime::current();
  const int w = rt.world_size(), r = rt.rank();
  const std::int64_t m = 40 * w, n = 80 * w, k = 72, n_local = n / w, rows = m / w;
  AllGatherGemm op(SymmetricHeap::current(), m, n, k, variant, test_options());
  std::vector<Bf16> out(static_cast<std::size_t>(m * n_local));
  for (int it = 0; it < iterations; ++it) {
    auto b = random_matrix(k, n_local, seed_of(it, r, 2));
    op.set_weights(b.data());
    std::vector<Bf16> a_full;
    for (int s = 0; s < w; ++s) {
      auto shard = random_matrix(rows, k, seed_of(it, s, 1));
      a_full.insert(a_full.end(), shard.begin(), shard.end());
    }
    std::fill(out.begin(), out.end(), kPoison);
    op.run(a_full.data() + r * rows * k, out.data());
    auto ref = reference_gemm(a_full.data(), k, b.data(), n_local, m, n_local, k);
    EXPECT_LT(relative_error(out.data(), n_local, ref.data(), n_local, m, n_local), 1e-2)
        << "AllGatherGemm " << to_string(variant) << " launch " << it << " rank " << r;
  }
}

inline void check_gemm_reduce_scatter(OverlapVariant variant, int iterations) {
  Runtime& rt = Runtime::current();
  const int w = rt.world_size(), r = rt.rank();
  const std::int64_t m = 40 * w, n = 80, k = 24 * w, k_local = k / w, rows = m / w;
  GemmReduceScatter op(SymmetricHeap::current(), m, n, k, variant, test_options());
  std::vector<Bf16> out(static_cast<std::size_t>(rows * n));
  for (int it = 0; it < iterations; ++it) {
    std::vector<float> ref(static_cast<std::size_t>(rows * n), 0.0f);
    std::vector<Bf16> a_mine, b_mine;
    for (int s = 0; s < w; ++s) {
      auto a = random_matrix(m, k_local, seed_of(it, s, 3));
      auto b = random_matrix(k_local, n, seed_of(it, s, 4));
      auto part = reference_gemm(a.data() + r * rows * k_local, k_local, b.data(), n, rows, n, k_local);
      for (std::size_t i = 0; i < ref.size(); ++i) ref[i] += part[i];
      if (s == r) a_mine = a, b_mine = b;
    }
    op.set_weights(b_mine.data());
    std::fill(out.begin(), out.end(), kPoison);
    op.run(a_mine.data(), out.data());
    EXPECT_LT(relative_error(out.data(), n, ref.data(), n, rows, n), 1e-2)
        << "GemmReduceScatter " << to_string(variant) << " launch " << it << " rank " << r;
  }
}

inline void check_gemm_all_scatter(OverlapVariant variant, int iterations) {
  Runtime& rt = Runtime::current();
  const int w = rt.world_size(), r = rt.rank();
  const std::int64_t m = 40, n = 80 * w, k = 72, n_local = n / w;
  GemmAllScatter op(SymmetricHeap::current(), m, n, k, variant, test_options());
  std::vector<Bf16> out(static_cast<std::size_t>(m * n));
  for (int it = 0; it < iterations; ++it) {
    auto a = random_matrix(m, k, seed_of(it, 0, 5));  // the same A on every rank
    std::vector<Bf16> b_full(static_cast<std::size_t>(k * n)), b_mine;
    for (int s = 0; s < w; ++s) {
      auto b = random_matrix(k, n_local, seed_of(it, s, 6));
      for (std::int64_t row = 0; row < k; ++row)
        std::copy_n(b.begin() + row * n_local, n_local, b_full.begin() + row * n + s * n_local);
      if (s == r) b_mine = b;
    }
    op.set_weights(b_mine.data());
    std::fill(out.begin(), out.end(), kPoison);
    op.run(a.data(), out.data());
    auto ref = reference_gemm(a.data(), k, b_full.data(), n, m, n, k);
    EXPECT_LT(relative_error(out.data(), n, ref.data(), n, m, n), 1e-2)
        << "GemmAllScatter " << to_string(variant) << " launch " << it << " rank " << r;
  }
}

// The plain collectives move bf16 values unchanged (ReduceScatter: summed in fp32).
inline void check_collectives(int iterations) {
  Runtime& rt = Runtime::current();
  const int w = rt.world_size(), r = rt.rank();
  const std::int64_t rows = 40, cols = 24;
  SymmetricHeap heap = SymmetricHeap::current();
  AllGather push(heap, rows, cols, GatherMode::push, test_options());
  AllGather pull(heap, rows, cols, GatherMode::pull, test_options());
  ReduceScatter rs(heap, rows * w, cols, test_options());
  AllScatter as(heap, rows, cols, test_options());
  const std::size_t ll_bytes = 1001;  // not a multiple of the 4 data bytes of an LL word
  LowLatencyAllGather ll(heap, ll_bytes, test_options());
  Bf16* previous_push = nullptr;
  Bf16* previous_pull = nullptr;
  for (int it = 0; it < iterations; ++it) {
    std::vector<std::vector<Bf16>> shards;
    for (int s = 0; s < w; ++s) shards.push_back(random_matrix(rows, cols, seed_of(it, s, 7)));
    // The gathered matrix lives in symmetric memory until the next run(): poison the previous
    // one (no peer writes into it before this rank enters the next launch). Not this rank's own
    // shard in pull mode: peers may still be pulling it.
    for (Bf16* previous : {previous_push, previous_pull})
      for (int s = 0; s < w && previous; ++s)
        if (s != r || previous == previous_push) std::fill_n(previous + s * rows * cols, rows * cols, kPoison);
    const Bf16* pushed = push.run(shards[static_cast<std::size_t>(r)].data());
    const Bf16* pulled = pull.run(shards[static_cast<std::size_t>(r)].data());
    previous_push = const_cast<Bf16*>(pushed);
    previous_pull = const_cast<Bf16*>(pulled);
    for (int s = 0; s < w; ++s) {
      EXPECT_EQ(std::memcmp(pushed + s * rows * cols, shards[static_cast<std::size_t>(s)].data(), rows * cols * sizeof(Bf16)), 0)
          << "AllGather push: shard " << s << " launch " << it;
      EXPECT_EQ(std::memcmp(pulled + s * rows * cols, shards[static_cast<std::size_t>(s)].data(), rows * cols * sizeof(Bf16)), 0)
          << "AllGather pull: shard " << s << " launch " << it;
    }
    // ReduceScatter of [rows * w, cols] per rank.
    std::vector<std::vector<Bf16>> inputs;
    for (int s = 0; s < w; ++s) inputs.push_back(random_matrix(rows * w, cols, seed_of(it, s, 8)));
    std::vector<Bf16> reduced(static_cast<std::size_t>(rows * cols), kPoison);
    rs.run(inputs[static_cast<std::size_t>(r)].data(), reduced.data());
    std::vector<float> sum(static_cast<std::size_t>(rows * cols), 0.0f);
    for (int s = 0; s < w; ++s)
      for (std::int64_t i = 0; i < rows * cols; ++i) sum[static_cast<std::size_t>(i)] += inputs[static_cast<std::size_t>(s)][static_cast<std::size_t>(r * rows * cols + i)].to_float();
    EXPECT_LT(relative_error(reduced.data(), cols, sum.data(), cols, rows, cols), 1e-2) << "ReduceScatter launch " << it;
    // All-Scatter: shard s lands at columns [s * cols, (s + 1) * cols).
    std::vector<Bf16> scattered(static_cast<std::size_t>(rows * cols * w), kPoison);
    as.run(shards[static_cast<std::size_t>(r)].data(), scattered.data());
    for (int s = 0; s < w; ++s)
      for (std::int64_t row = 0; row < rows; ++row)
        ASSERT_EQ(std::memcmp(scattered.data() + row * cols * w + s * cols, shards[static_cast<std::size_t>(s)].data() + row * cols,
                              cols * sizeof(Bf16)), 0)
            << "AllScatter: shard " << s << " row " << row << " launch " << it;
    // LL AllGather of raw bytes.
    std::vector<unsigned char> ll_out(ll_bytes * static_cast<std::size_t>(w), 0xEE);
    auto bytes_of = [&](int s) {
      std::vector<unsigned char> v(ll_bytes);
      for (std::size_t i = 0; i < ll_bytes; ++i) v[i] = static_cast<unsigned char>((i * 31 + static_cast<std::size_t>(s) * 7 + static_cast<std::size_t>(it) * 13) & 0xFF);
      return v;
    };
    ll.run(bytes_of(r).data(), ll_out.data());
    for (int s = 0; s < w; ++s)
      EXPECT_EQ(std::memcmp(ll_out.data() + static_cast<std::size_t>(s) * ll_bytes, bytes_of(s).data(), ll_bytes), 0)
          << "LowLatencyAllGather: rank " << s << " launch " << it;
  }
}

// The tensor-parallel layer against the single-process reference (bf16 at the same points).
// `grouped`: grouped-query attention (8 query heads over 4 key/value heads).
inline void check_tp_layer(OverlapVariant variant, int iterations, bool grouped = false) {
  Runtime& rt = Runtime::current();
  const int w = rt.world_size(), r = rt.rank();
  TpLayerShape shape{.tokens = 24 * w, .hidden = 128, .heads = 4, .ffn = 192};
  if (grouped) shape.heads = 8, shape.kv_heads = 4;
  TensorParallelLayer layer(SymmetricHeap::current(), shape, variant, test_options());
  const std::int64_t rows = shape.tokens / w;
  std::vector<Bf16> y(static_cast<std::size_t>(rows * shape.hidden));
  for (int it = 0; it < iterations; ++it) {
    auto weights = random_layer_weights(shape, seed_of(it, 0, 9));
    auto x = random_matrix(shape.tokens, shape.hidden, seed_of(it, 0, 10));  // all ranks' rows
    layer.set_weights(weights);
    std::fill(y.begin(), y.end(), kPoison);
    LayerTimes times{};
    layer.run(x.data() + r * rows * shape.hidden, y.data(), &times);
    auto ref = reference_layer(shape, weights, x, w);
    EXPECT_LT(relative_error(y.data(), shape.hidden, ref.data() + r * rows * shape.hidden, shape.hidden, rows, shape.hidden),
              1e-2)
        << "TensorParallelLayer " << to_string(variant) << " launch " << it << " rank " << r;
    for (double t : times) EXPECT_GE(t, 0.0);
  }
}

}  // namespace caravan::kernels::test
