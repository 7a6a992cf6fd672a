// `caravan bench attention`: the fused causal attention kernels (kernels/gpu/attention.cu: the
// portable mma.sync one; attention_sm90.cu: the Hopper wgmma one, where the GPU runs it) against
// the unfused path the GPU layer ran before them (per block of 1024 queries: the scores by cuBLAS,
// the causal softmax kernel, probabilities x V by cuBLAS), on GPU 0, alternating them in one run. Shapes: the heads one
// GPU holds in `bench llm` (Llama-3 70B: 64 query / 8 key-value heads, 8B: 32 / 8, head width 128) at tensor-parallel
// degree 1, 2 and 4, prefill of 4k to 16k tokens.
//
// Checks: each fused kernel's output against the float32 reference at 2100 tokens per shape (fresh
// random inputs, output poisoned), and at every measured size its relative difference from the
// unfused output. Without a GPU, or in a build without the GPU kernels, it says why and skips.
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
  // Before each timed call, an untimed GEMM of this size (0: none) on the same stream, as the
  // layer's GEMMs run before its attention: the call then starts at the clocks they leave.
  long after_gemm = 0;
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
  if (o.after_gemm < 0 || o.after_gemm > 16384)
    throw Error(Errc::invalid_argument,
                fmt::format("bench attention: --after-gemm {}: must be 0 (none) to 16384", o.after_gemm));
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
  // Not a multiple of the kernels' 128-row blocks (2100 = 16 x 128 + 52): the last block's tail is
  // checked too, which the measured sizes (multiples of 128 by default) would not reach.
  const long check_tokens = std::min(2100L, max_tokens);
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
  const long g = o.after_gemm;
  auto gemm_a = make_buffer<bf16>(std::max<std::size_t>(count(g, g), 1));
  auto gemm_b = make_buffer<bf16>(std::max<std::size_t>(count(g, g), 1));
  auto gemm_c = make_buffer<bf16>(std::max<std::size_t>(count(g, g), 1));
  gpu::Blas blas(stream);
  if (g > 0) {  // random operands: zeros would draw less power than a layer's GEMMs
    gpu::fill_random(gemm_a.get(), g, g, g, 1, 0, 0, 1.0f, stream);
    gpu::fill_random(gemm_b.get(), g, g, g, 2, 0, 0, 1.0f, stream);
  }
  hipEvent_t start, stop;
  CARAVAN_HIP_CHECK(hipEventCreate(&start));
  CARAVAN_HIP_CHECK(hipEventCreate(&stop));
  std::mt19937_64 seeds(std::random_device{}());

  BenchTable table{"causal attention on GPU 0, ms per call (median, p10..p90)",
                   {"model", "TP", "heads q/kv", "tokens", "unfused (cuBLAS)", "fused mma.sync", "fused wgmma",
                    "speedup", "wgmma / mma.sync", "TFLOP/s", "check"}};
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
      // The portable kernel always; the Hopper one where this GPU runs it.
      std::vector<gpu::AttentionKernel> kernels{gpu::AttentionKernel::portable};
      if (gpu::attention_kernel_runs(gpu::AttentionKernel::hopper, d)) kernels.push_back(gpu::AttentionKernel::hopper);
      // --block-rows is the portable kernel's; the Hopper one has 128 rows per block.
      const auto block_rows = [&](std::size_t i) {
        return kernels[i] == gpu::AttentionKernel::hopper ? 0 : o.block_rows;
      };
      const auto error_against = [&](const float* expected, long tokens) {
        gpu::compare(fused_out.get(), tokens, ld_out, ld_out, expected, ld_out, sums.get(), stream);
        gpu::ErrorSums host;
        CARAVAN_HIP_CHECK(hipMemcpyAsync(&host, sums.get(), sizeof(host), hipMemcpyDefault, stream));
        CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
        return host.nonfinite > 0 ? 1.0 : error_of(host);
      };
      std::vector<double> reference_error(kernels.size(), -1.0);
      if (o.check) {  // each fused kernel vs float32 at check_tokens, fresh inputs, output poisoned
        const std::uint64_t seed = seeds();
        gpu::fill_random(qkv.get(), check_tokens, ld, ld, seed, 0, 0, 1.0f, stream);
        gpu::fill_random(qkv_f.get(), check_tokens, ld, ld, seed, 0, 0, 1.0f, stream);
        const gpu::AttentionArguments a = arguments(check_tokens, fused_out.get());
        gpu::attention_reference(qkv_f.get(), qkv_f.get() + q_heads * d, qkv_f.get() + (q_heads + kv_heads) * d, a, ref.get(),
                                 stream);
        for (std::size_t i = 0; i < kernels.size(); ++i) {
          CARAVAN_HIP_CHECK(hipMemsetAsync(fused_out.get(), 0xff, count(check_tokens, ld_out) * sizeof(bf16), stream));
          gpu::fused_causal_attention(a, stream, block_rows(i), kernels[i]);
          reference_error[i] = error_against(ref.get(), check_tokens);
        }
      }
      for (long tokens : o.tokens) {
        gpu::fill_random(qkv.get(), tokens, ld, ld, seeds(), 0, 0, 1.0f, stream);
        CARAVAN_HIP_CHECK(hipMemsetAsync(unfused_out.get(), 0xff, count(tokens, ld_out) * sizeof(bf16), stream));
        const gpu::AttentionArguments fused_args = arguments(tokens, fused_out.get());
        const gpu::AttentionArguments unfused_args = arguments(tokens, unfused_out.get());
        std::vector<double> unfused_s;
        std::vector<std::vector<double>> fused_s(kernels.size());
        auto timed = [&](auto&& call) {
          if (g > 0) blas.gemm(stream, g, g, g, gemm_a.get(), g, gemm_b.get(), g, gemm_c.get(), g);
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
          if (rep >= 0) unfused_s.push_back(u);
          for (std::size_t i = 0; i < kernels.size(); ++i) {
            const double f = timed([&] { gpu::fused_causal_attention(fused_args, stream, block_rows(i), kernels[i]); });
            if (rep >= 0) fused_s[i].push_back(f);
          }
        }
        // Each fused output against the unfused one (both bf16; the unfused widened to float),
        // from one more call on a poisoned output.
        gpu::to_float(unfused_out.get(), unfused_f.get(), count(tokens, ld_out), stream);
        std::vector<double> difference(kernels.size());
        for (std::size_t i = 0; i < kernels.size(); ++i) {
          CARAVAN_HIP_CHECK(hipMemsetAsync(fused_out.get(), 0xff, count(tokens, ld_out) * sizeof(bf16), stream));
          gpu::fused_causal_attention(fused_args, stream, block_rows(i), kernels[i]);
          difference[i] = error_against(unfused_f.get(), tokens);
        }
        const Summary us = summarize(unfused_s);
        const double flops = 4.0 * static_cast<double>(d) * static_cast<double>(q_heads) * static_cast<double>(tokens) *
                             static_cast<double>(tokens + 1) / 2.0;
        const auto cell = [](const Summary& x) {
          return fmt::format("{:.3f} ({:.3f}..{:.3f})", x.median * 1e3, x.p10 * 1e3, x.p90 * 1e3);
        };
        // The last kernel is the one `automatic` runs here: the Hopper one where it runs.
        const Summary best = summarize(fused_s.back()), portable = summarize(fused_s.front());
        std::string check;
        nlohmann::json per_kernel = nlohmann::json::array();
        for (std::size_t i = 0; i < kernels.size(); ++i) {
          const bool kernel_ok = difference[i] < 1e-2 && reference_error[i] < 1e-2;
          worst_error = std::max({worst_error, difference[i], reference_error[i]});
          const std::string name = gpu::attention_kernel_name(kernels[i], d, block_rows(i));
          check += fmt::format(
              "{}{} {} (f32 {}, unfused {:.1e})", check.empty() ? "" : "; ", name, kernel_ok ? "ok" : "FAIL",
              reference_error[i] < 0 ? std::string("-") : fmt::format("{:.1e}", reference_error[i]), difference[i]);
          if (!kernel_ok)
            failures +=
                fmt::format("{}{} TP {} {} tokens, {}: fused vs float32 {:.2e}, vs unfused {:.2e}",
                            failures.empty() ? "" : "; ", model, tp, tokens, name, reference_error[i], difference[i]);
          const Summary fs = summarize(fused_s[i]);
          per_kernel.push_back({{"kernel", name},
                                {"fused_s", fused_s[i]},
                                {"speedup", us.median / fs.median},
                                {"fused_tflops", flops / fs.median / 1e12},
                                {"error_vs_float32", reference_error[i]},
                                {"difference_vs_unfused", difference[i]}});
        }
        table.rows.push_back(
            {model, std::to_string(tp), fmt::format("{}/{}", q_heads, kv_heads), std::to_string(tokens), cell(us),
             cell(portable), kernels.size() > 1 ? cell(best) : std::string("-"),
             fmt::format("{:.2f}x", us.median / best.median),
             kernels.size() > 1 ? fmt::format("{:.2f}x", portable.median / best.median) : std::string("-"),
             fmt::format("{:.0f}", flops / best.median / 1e12), check});
        results.push_back({{"model", model},
                           {"tp", tp},
                           {"q_heads", q_heads},
                           {"kv_heads", kv_heads},
                           {"head_dim", d},
                           {"tokens", tokens},
                           {"unfused_s", unfused_s},
                           {"kernels", per_kernel},
                           {"speedup", us.median / best.median},
                           {"fused_tflops", flops / best.median / 1e12}});
        fmt::print(
            stderr, "bench attention: {} TP {} {} tokens: {:.2f}x over unfused{}\n", model, tp, tokens,
            us.median / best.median,
            kernels.size() > 1 ? fmt::format(", wgmma {:.2f}x over mma.sync", portable.median / best.median) : "");
      }
    }
  }
  CARAVAN_HIP_CHECK(hipEventDestroy(start));
  CARAVAN_HIP_CHECK(hipEventDestroy(stop));
  CARAVAN_HIP_CHECK(hipStreamDestroy(stream));
  out.tables.push_back(std::move(table));
  out.notes.push_back(
      fmt::format("{} timed calls of each after one warm-up, alternating; speedup = unfused median / the "
                  "fastest fused kernel's median (wgmma where it runs); TFLOP/s: that kernel's, counting "
                  "the causal half (4 d heads T (T + 1) / 2)",
                  o.repetitions));
  if (g > 0)
    out.notes.push_back(
        fmt::format("--after-gemm {0}: each timed call follows an untimed {0} x {0} x {0} cuBLAS GEMM on "
                    "the same stream (random bf16), and starts at the clocks it leaves",
                    g));
  if (!gpu::attention_kernel_runs(gpu::AttentionKernel::hopper, 128))
    out.notes.push_back(
        "fused wgmma: '-', this GPU (or build) does not run the Hopper kernel (compute capability 9.0 and "
        "the sm_90a kernels)");
  out.notes.push_back("check: each fused kernel vs float32 reference at " + std::to_string(check_tokens) +
                      " tokens and vs unfused at the measured size, relative error below 1e-2");
  out.headlines.push_back(fmt::format("worst relative error {:.1e}", worst_error));
  out.figures = {{"results", results}, {"block_rows", o.block_rows}, {"after_gemm", o.after_gemm}};
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
  c.add_option("--block-rows", g_attention.block_rows,
               "Query rows per block of the portable (mma.sync) fused kernel: 64, 128 or 0 (default)")
      ->capture_default_str();
  c.add_option("--after-gemm", g_attention.after_gemm,
               "Before each timed call, an untimed N x N x N cuBLAS GEMM on the same stream (0: none), so "
               "that the call runs at the clocks a layer's GEMMs leave (power-capped), as in bench llm")
      ->capture_default_str();
  c.add_flag("!--no-check", g_attention.check, "Skip the float32 reference check");
}

}  // namespace caravan::app
