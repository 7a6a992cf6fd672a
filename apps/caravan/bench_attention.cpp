// `caravan bench attention`: the fused causal attention kernel (kernels/gpu/attention.cu) against
// the unfused path the GPU layer ran before it (per block of 1024 queries: the scores by cuBLAS,
// the causal softmax kernel, probabilities x V by cuBLAS), on GPU 0, alternating the two in one
// run. Shapes: the heads one GPU holds in `bench llm` (Llama-3 70B: 64 query / 8 key-value heads,
// 8B: 32 / 8, head width 128) at tensor-parallel degree 1, 2 and 4, prefill of 4k to 16k tokens.
//
// Checks: the fused output against the float32 reference at 2048 tokens per shape (fresh random
// inputs, output poisoned), and at every measured size its relative difference from the unfused
// output. Without a GPU, or in a build without the GPU kernels, it says why and skips.
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"

#include <caravan/error.h>
#include <caravan/platform.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#ifdef CARAVAN_HAVE_OVERLAP_GPU
#include "apps/caravan/bench_gpu_ranks.h"
#include "kernels/gpu/blas.h"
#include "kernels/gpu/kernels.h"
#include "kernels/gpu/tp_layer.h"
#endif

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace caravan::app {
namespace {

struct AttentionBenchOptions {
  std::vector<std::string> models{"llama3-70b", "llama3-8b"};
  std::vector<long> tokens{4096, 8192, 16384};
  std::vector<int> tensor_parallel{4, 2, 1};
  int repetitions = 10;
  int block_rows = 0;
  bool check = true;
};
AttentionBenchOptions g_attention;

struct HeadShape {
  long q_heads, kv_heads, head_dim;
};

HeadShape model_heads(const std::string& model) {
  if (model == "llama3-70b") return {64, 8, 128};
  if (model == "llama3-8b") return {32, 8, 128};
  throw Error(Errc::invalid_argument, "bench attention: --model '" + model + "' is not llama3-8b or llama3-70b");
}

// Every option, checked before the run, so that a machine without a GPU (the benchmark skips
// there) refuses nonsense as one with a GPU does.
void validate_options(const AttentionBenchOptions& o) {
  if (o.repetitions < 1)
    throw Error(Errc::invalid_argument, fmt::format("bench attention: --reps {}: must be at least 1", o.repetitions));
  for (long t : o.tokens)
    if (t < 1) throw Error(Errc::invalid_argument, fmt::format("bench attention: --tokens {}: must be at least 1", t));
  for (int tp : o.tensor_parallel)
    if (tp < 1) throw Error(Errc::invalid_argument, fmt::format("bench attention: --tp {}: must be at least 1", tp));
  for (const auto& model : o.models) {
    const HeadShape h = model_heads(model);
    for (int tp : o.tensor_parallel)
      if (h.q_heads % tp != 0 || h.kv_heads % tp != 0)
        throw Error(Errc::invalid_argument, fmt::format("bench attention: --tp {} does not divide {}'s {} query and {} "
                                                        "key/value heads",
                                                        tp, model, h.q_heads, h.kv_heads));
  }
  if (o.block_rows != 0 && o.block_rows != 64 && o.block_rows != 128)
    throw Error(Errc::invalid_argument,
                fmt::format("bench attention: --block-rows {}: must be 64, 128 or 0 (the default)", o.block_rows));
}

#ifdef CARAVAN_HAVE_OVERLAP_GPU
using gpu::bf16;

double error_of(const gpu::ErrorSums& s) { return s.ref2 > 0 ? std::sqrt(s.diff2 / s.ref2) : 1.0; }

BenchReport run_on_gpu() {
  BenchReport out;
  const AttentionBenchOptions& o = g_attention;  // validate_options() has checked them
  constexpr long kQueryBlock = 1024;

  CARAVAN_HIP_CHECK(hipSetDevice(0));
  gpu::preload_attention();
  gpu::preload_layer_kernels();
  gpu::preload_kernels();
  hipStream_t stream = nullptr;
  CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&stream, hipStreamNonBlocking));

  // Every buffer at its largest size, allocated once.
  long max_tokens = 0, max_cols = 0, max_heads = 0;
  for (const auto& model : o.models) {
    const HeadShape h = model_heads(model);
    for (int tp : o.tensor_parallel) {
      max_cols = std::max(max_cols, (h.q_heads + 2 * h.kv_heads) / tp * h.head_dim);
      max_heads = std::max(max_heads, h.q_heads / tp);
    }
  }
  for (long t : o.tokens) max_tokens = std::max(max_tokens, t);
  const long check_tokens = std::min(2048L, max_tokens);
  const auto count = [](long a, long b) { return static_cast<std::size_t>(a) * static_cast<std::size_t>(b); };
  auto qkv = make_buffer<bf16>(count(max_tokens, max_cols));
  auto fused_out = make_buffer<bf16>(count(max_tokens, max_heads * 128));
  auto unfused_out = make_buffer<bf16>(count(max_tokens, max_heads * 128));
  auto probs = make_buffer<bf16>(count(max_heads * kQueryBlock, max_tokens));
  auto scores = make_buffer<float>(count(max_heads * kQueryBlock, max_tokens));
  auto unfused_f = make_buffer<float>(count(max_tokens, max_heads * 128));
  auto qkv_f = make_buffer<float>(o.check ? count(check_tokens, max_cols) : 1);
  auto ref = make_buffer<float>(o.check ? count(check_tokens, max_heads * 128) : 1);
  auto sums = make_buffer<gpu::ErrorSums>(1);
  gpu::Blas blas(stream);
  hipEvent_t start, stop;
  CARAVAN_HIP_CHECK(hipEventCreate(&start));
  CARAVAN_HIP_CHECK(hipEventCreate(&stop));
  std::mt19937_64 seeds(std::random_device{}());

  BenchTable table{"causal attention on GPU 0, ms per call (median, p10..p90)",
                   {"model", "TP", "heads q/kv", "tokens", "unfused (cuBLAS)", "fused", "speedup", "fused TFLOP/s",
                    "check"}};
  nlohmann::json results = nlohmann::json::array();
  std::string failures;
  double worst_error = 0;
  for (const auto& model : o.models) {
    const HeadShape h = model_heads(model);
    for (int tp : o.tensor_parallel) {
      const long q_heads = h.q_heads / tp, kv_heads = h.kv_heads / tp, d = h.head_dim;
      const long ld = (q_heads + 2 * kv_heads) * d, ld_out = q_heads * d;
      auto arguments = [&](long tokens, bf16* out_buffer) {
        return gpu::packed_qkv_attention(qkv.get(), ld, tokens, q_heads, kv_heads, d, out_buffer, ld_out);
      };
      double reference_error = -1;
      if (o.check) {  // fused vs float32 at check_tokens, fresh inputs, output poisoned
        const std::uint64_t seed = seeds();
        gpu::fill_random(qkv.get(), check_tokens, ld, ld, seed, 0, 0, 1.0f, stream);
        gpu::fill_random(qkv_f.get(), check_tokens, ld, ld, seed, 0, 0, 1.0f, stream);
        CARAVAN_HIP_CHECK(hipMemsetAsync(fused_out.get(), 0xff, count(check_tokens, ld_out) * sizeof(bf16), stream));
        const gpu::AttentionArguments a = arguments(check_tokens, fused_out.get());
        gpu::fused_causal_attention(a, stream, o.block_rows);
        gpu::attention_reference(qkv_f.get(), qkv_f.get() + q_heads * d, qkv_f.get() + (q_heads + kv_heads) * d, a, ref.get(),
                                 stream);
        gpu::compare(fused_out.get(), check_tokens, ld_out, ld_out, ref.get(), ld_out, sums.get(), stream);
        gpu::ErrorSums host;
        CARAVAN_HIP_CHECK(hipMemcpyAsync(&host, sums.get(), sizeof(host), hipMemcpyDefault, stream));
        CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
        reference_error = host.nonfinite > 0 ? 1.0 : error_of(host);
      }
      for (long tokens : o.tokens) {
        gpu::fill_random(qkv.get(), tokens, ld, ld, seeds(), 0, 0, 1.0f, stream);
        CARAVAN_HIP_CHECK(hipMemsetAsync(fused_out.get(), 0xff, count(tokens, ld_out) * sizeof(bf16), stream));
        CARAVAN_HIP_CHECK(hipMemsetAsync(unfused_out.get(), 0xff, count(tokens, ld_out) * sizeof(bf16), stream));
        const gpu::AttentionArguments fused_args = arguments(tokens, fused_out.get());
        const gpu::AttentionArguments unfused_args = arguments(tokens, unfused_out.get());
        std::vector<double> fused_s, unfused_s;
        auto timed = [&](auto&& call) {
          CARAVAN_HIP_CHECK(hipEventRecord(start, stream));
          call();
          CARAVAN_HIP_CHECK(hipEventRecord(stop, stream));
          CARAVAN_HIP_CHECK(hipEventSynchronize(stop));
          float ms = 0;
          CARAVAN_HIP_CHECK(hipEventElapsedTime(&ms, start, stop));
          return ms * 1e-3;
        };
        for (int rep = -1; rep < o.repetitions; ++rep) {  // rep -1: warm-up
          const double u = timed([&] { gpu::unfused_causal_attention(blas, unfused_args, kQueryBlock, scores.get(), probs.get(), stream); });
          const double f = timed([&] { gpu::fused_causal_attention(fused_args, stream, o.block_rows); });
          if (rep >= 0) {
            unfused_s.push_back(u);
            fused_s.push_back(f);
          }
        }
        // The fused output against the unfused one (both bf16; the unfused widened to float).
        gpu::to_float(unfused_out.get(), unfused_f.get(), count(tokens, ld_out), stream);
        gpu::compare(fused_out.get(), tokens, ld_out, ld_out, unfused_f.get(), ld_out, sums.get(), stream);
        gpu::ErrorSums host;
        CARAVAN_HIP_CHECK(hipMemcpyAsync(&host, sums.get(), sizeof(host), hipMemcpyDefault, stream));
        CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
        const double difference = host.nonfinite > 0 ? 1.0 : error_of(host);
        const Summary fs = summarize(fused_s), us = summarize(unfused_s);
        const double flops = 4.0 * static_cast<double>(d) * static_cast<double>(q_heads) * static_cast<double>(tokens) *
                             static_cast<double>(tokens + 1) / 2.0;
        const bool ok = difference < 1e-2 && (reference_error < 0 || reference_error < 1e-2);
        worst_error = std::max({worst_error, difference, reference_error});
        if (!ok)
          failures += fmt::format("{}{} TP {} {} tokens: fused vs float32 {:.2e}, vs unfused {:.2e}", failures.empty() ? "" : "; ",
                                  model, tp, tokens, reference_error, difference);
        table.rows.push_back({model, std::to_string(tp), fmt::format("{}/{}", q_heads, kv_heads), std::to_string(tokens),
                              fmt::format("{:.3f} ({:.3f}..{:.3f})", us.median * 1e3, us.p10 * 1e3, us.p90 * 1e3),
                              fmt::format("{:.3f} ({:.3f}..{:.3f})", fs.median * 1e3, fs.p10 * 1e3, fs.p90 * 1e3),
                              fmt::format("{:.2f}x", us.median / fs.median), fmt::format("{:.0f}", flops / fs.median / 1e12),
                              fmt::format("{} (f32 {}, unfused {:.1e})", ok ? "ok" : "FAIL",
                                          reference_error < 0 ? std::string("-") : fmt::format("{:.1e}", reference_error),
                                          difference)});
        results.push_back({{"model", model},
                           {"tp", tp},
                           {"q_heads", q_heads},
                           {"kv_heads", kv_heads},
                           {"head_dim", d},
                           {"tokens", tokens},
                           {"unfused_s", unfused_s},
                           {"fused_s", fused_s},
                           {"speedup", us.median / fs.median},
                           {"fused_tflops", flops / fs.median / 1e12},
                           {"error_vs_float32", reference_error},
                           {"difference_vs_unfused", difference}});
        fmt::print(stderr, "bench attention: {} TP {} {} tokens: {:.2f}x\n", model, tp, tokens, us.median / fs.median);
      }
    }
  }
  CARAVAN_HIP_CHECK(hipEventDestroy(start));
  CARAVAN_HIP_CHECK(hipEventDestroy(stop));
  CARAVAN_HIP_CHECK(hipStreamDestroy(stream));
  out.tables.push_back(std::move(table));
  out.notes.push_back(fmt::format("{} timed calls of each after one warm-up, alternating; speedup = unfused median / fused "
                                  "median; TFLOP/s counts the causal half (4 d heads T (T + 1) / 2)",
                                  o.repetitions));
  out.notes.push_back("check: fused vs float32 reference at " + std::to_string(check_tokens) +
                      " tokens and fused vs unfused at the measured size, relative error below 1e-2");
  out.headlines.push_back(fmt::format("worst relative error {:.1e}", worst_error));
  out.figures = {{"results", results}, {"block_rows", o.block_rows}};
  out.failure = failures;
  return out;
}
#endif

#ifdef CARAVAN_HAVE_OVERLAP_GPU
BenchReport (*const kOnGpu)() = run_on_gpu;
#else
BenchReport (*const kOnGpu)() = nullptr;
#endif
BenchReport run_attention_bench() {
  validate_options(g_attention);
  return run_on_gpu_or_skip(kOnGpu);
}

}  // namespace

void add_bench_attention(CLI::App& bench) {
  CLI::App& c = add_bench_case(bench, "attention",
                               "fused causal attention (flash attention) vs the unfused cuBLAS path, on GPU 0", run_attention_bench);
  c.add_option("--model", g_attention.models, "llama3-70b and/or llama3-8b (their query/key-value heads, width 128)")
      ->capture_default_str();
  c.add_option("--tokens", g_attention.tokens, "Sequence lengths")->capture_default_str();
  c.add_option("--tp", g_attention.tensor_parallel, "Tensor-parallel degrees: each GPU holds heads / TP")->capture_default_str();
  c.add_option("--reps", g_attention.repetitions, "Timed calls of each")->capture_default_str();
  c.add_option("--block-rows", g_attention.block_rows, "Query rows per block of the fused kernel: 64, 128 or 0 (default)")
      ->capture_default_str();
  c.add_flag("!--no-check", g_attention.check, "Skip the float32 reference check");
}

}  // namespace caravan::app
