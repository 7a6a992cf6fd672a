// `caravan bench llm`, CPU backend: one tensor-parallel transformer layer (kernels/tp_layer.h:
// RMSNorm, QKV projection, causal attention, output projection, RMSNorm, up/gate, SwiGLU, down
// projection; sequence-parallel, so each projection is an AllGather+GEMM or a
// GEMM+ReduceScatter) on W ranks of this host, with every communication bulk-synchronous (the
// baseline) or overlapped, launches interleaved in one run. It prints per-step and total times
// (slowest rank), the speedup over the baseline and the best variant, and writes JSON and an
// SVG plot on request. On the CPU backend a small configuration by default, sized for a 2-core
// machine; on the GPU backend (bench_llm_gpu.cpp; chosen by default where GPUs are) the Llama-3
// 70B layer at TP 4 with 8192 tokens, against NCCL + cuBLAS.
#include "apps/caravan/bench_llm.h"
#include "apps/caravan/bench_ranks.h"
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"

#include <caravan/caravan.h>
#include <caravan/kernels/tp_layer.h>
#include <caravan/platform.h>
#include <caravan/settings.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>
#include <thread>

namespace caravan::app {
namespace {

using Clock = std::chrono::steady_clock;
using namespace kernels;

struct LlmOptions {
  std::string backend = "auto";
  std::string model;  // llama3-8b, llama3-70b: sets hidden, heads, kv_heads, ffn (explicit options win)
  long tokens = 0, hidden = 0, heads = 0, kv_heads = 0, ffn = 0;  // 0: the backend's default
  int world = 0, nodes = 1, iterations = 10, warmup = 2;
  std::vector<std::string> variants;  // empty: all four
  bool check = true;
  std::string plot_path, out;
  bool sweep = false;  // GPU backend: the matrix of models, token counts and TP degrees
  std::string attention = "fused";  // GPU backend: fused or unfused (every variant alike)
  // Set by with_defaults: the shape options it filled from a model, and which model, so that an
  // error names where a value the user did not give came from.
  struct {
    bool hidden = false, heads = false, kv_heads = false, ffn = false;
  } filled;
  std::string filled_from;
};
LlmOptions g_llm, g_llm_rank;

constexpr std::size_t kSteps = static_cast<std::size_t>(LayerStep::count);

std::vector<OverlapVariant> variants_of(const LlmOptions& o) {
  std::vector<OverlapVariant> out;
  for (const auto& name : o.variants) {
    try {
      out.push_back(parse_variant(name));
    } catch (const Error& e) {
      throw Error(e.code(), fmt::format("--variant: {}", e.what()));
    }
  }
  if (out.empty()) out.assign(std::begin(kAllVariants), std::end(kAllVariants));
  if (std::find(out.begin(), out.end(), OverlapVariant::bulk_synchronous) == out.end())
    out.insert(out.begin(), OverlapVariant::bulk_synchronous);  // the baseline is always measured
  return out;
}

TpLayerShape shape_of(const LlmOptions& o) { return {o.tokens, o.hidden, o.heads, o.ffn, o.kv_heads}; }

// Fills the shape options left at 0: from --model, else the backend's default (CPU: a small
// layer for a 2-core machine; GPU: Llama-3 70B with 8192 tokens).
LlmOptions with_defaults(LlmOptions o, bool gpu) {
  struct Model {
    const char* name;
    long hidden, heads, kv_heads, ffn;
  };
  static constexpr Model kModels[] = {{"llama3-8b", 4096, 32, 8, 14336}, {"llama3-70b", 8192, 64, 8, 28672}};
  std::string model = o.model.empty() && gpu ? "llama3-70b" : o.model;
  if (!model.empty()) {
    const Model* found = nullptr;
    for (const auto& m : kModels)
      if (model == m.name) found = &m;
    if (!found) throw Error(Errc::invalid_argument, fmt::format("--model {}: expected llama3-8b or llama3-70b", model));
    o.filled = {o.hidden == 0, o.heads == 0, o.kv_heads == 0, o.ffn == 0};
    o.filled_from = o.model.empty() ? model + ", the GPU backend's default --model" : "--model " + model;
    if (o.hidden == 0) o.hidden = found->hidden;
    if (o.heads == 0) o.heads = found->heads;
    if (o.kv_heads == 0) o.kv_heads = found->kv_heads;
    if (o.ffn == 0) o.ffn = found->ffn;
    if (o.tokens == 0) o.tokens = 8192;
  }
  if (o.tokens == 0) o.tokens = 256;
  if (o.hidden == 0) o.hidden = 1024;
  if (o.heads == 0) o.heads = 8;
  if (o.ffn == 0) o.ffn = 2816;
  return o;
}

void validate(const LlmOptions& o, int world, bool gpu = false) {
  // " (from --model M)" after a value that the user did not give.
  const auto from = [&](bool filled) { return filled ? fmt::format(" (from {})", o.filled_from) : std::string(); };
  if (o.iterations < 1) throw Error(Errc::invalid_argument, fmt::format("--iterations {}: must be at least 1", o.iterations));
  if (o.warmup < 0) throw Error(Errc::invalid_argument, fmt::format("--warmup {}: must be at least 0", o.warmup));
  if (o.nodes < 1 || o.nodes > world)
    throw Error(Errc::invalid_argument, fmt::format("--nodes {}: must be in [1, --world {}]", o.nodes, world));
  if (o.tokens < 1 || o.tokens % world != 0)
    throw Error(Errc::invalid_argument, fmt::format("--tokens {}: must be a positive multiple of the world size {}", o.tokens, world));
  if (o.hidden < 1)
    throw Error(Errc::invalid_argument,
                fmt::format("--hidden {}{}: must be positive", o.hidden, from(o.filled.hidden)));
  if (o.heads < 1 || o.heads % world != 0 || o.hidden % o.heads != 0)
    throw Error(Errc::invalid_argument,
                fmt::format("--heads {}{}: must divide --hidden {}{} and be a multiple of the world size {}", o.heads,
                            from(o.filled.heads), o.hidden, from(o.filled.hidden), world));
  if (o.kv_heads < 0 || (o.kv_heads > 0 && (o.heads % o.kv_heads != 0 || o.kv_heads % world != 0)))
    throw Error(Errc::invalid_argument,
                fmt::format("--kv-heads {}{}: must divide --heads {}{} and be a multiple of the world size {}",
                            o.kv_heads, from(o.filled.kv_heads), o.heads, from(o.filled.heads), world));
  if (o.ffn < 1 || o.ffn % world != 0)
    throw Error(Errc::invalid_argument, fmt::format("--ffn {}{}: must be a positive multiple of the world size {}",
                                                    o.ffn, from(o.filled.ffn), world));
  if (!gpu) {
    variants_of(o);  // names (the GPU backend checks its own)
    if (o.attention != "fused")
      throw Error(Errc::invalid_argument,
                  fmt::format("--attention {}: applies to the GPU backend only (the CPU backend has one attention)",
                              o.attention));
  }
}

// --- the ranks' side ---

nlohmann::json run_layer_ranks(const LlmOptions& given) {
  const LlmOptions o = with_defaults(given, false);
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  const int w = rt.world_size(), r = rt.rank();
  validate(o, w);
  const TpLayerShape shape = shape_of(o);
  const auto variants = variants_of(o);
  const double load_before = load_average();
  const TpLayerWeights weights = random_layer_weights(shape, 1);
  const std::int64_t rows = shape.tokens / w;
  std::vector<Bf16> x(static_cast<std::size_t>(shape.tokens * shape.hidden));
  {
    std::mt19937_64 rng(3);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (auto& v : x) v = Bf16::from_float(dist(rng));
  }
  const Bf16* mine = x.data() + r * rows * shape.hidden;
  std::vector<std::unique_ptr<TensorParallelLayer>> layers;
  for (OverlapVariant v : variants) {
    layers.push_back(std::make_unique<TensorParallelLayer>(SymmetricHeap::current(), shape, v));
    layers.back()->set_weights(weights);
  }
  std::vector<Bf16> y(static_cast<std::size_t>(rows * shape.hidden));
  std::vector<double> errors(variants.size(), -1);
  if (o.check) {
    auto ref = reference_layer(shape, weights, x, w);
    for (std::size_t v = 0; v < variants.size(); ++v) {
      std::fill(y.begin(), y.end(), Bf16{0x7FC0});
      layers[v]->run(mine, y.data());
      errors[v] = relative_error(y.data(), shape.hidden, ref.data() + r * rows * shape.hidden, shape.hidden, rows, shape.hidden);
    }
  }
  // Per variant and timed launch: the total, then each step (this rank's times).
  StartLine start_line(rt);
  std::vector<std::vector<double>> samples(variants.size());
  for (int it = 0; it < o.warmup + o.iterations; ++it)
    for (std::size_t v = 0; v < variants.size(); ++v) {
      LayerTimes times{};
      start_line.wait();
      const auto start = Clock::now();
      layers[v]->run(mine, y.data(), &times);
      const double total = std::chrono::duration<double>(Clock::now() - start).count();
      if (it < o.warmup) continue;
      samples[v].push_back(total);
      samples[v].insert(samples[v].end(), times.begin(), times.end());
    }
  std::vector<double> flat(errors);
  for (const auto& s : samples) flat.insert(flat.end(), s.begin(), s.end());
  auto all = gather_doubles(rt, flat);
  if (r != 0) return nullptr;
  nlohmann::json results = nlohmann::json::array();
  const std::size_t per_launch = 1 + kSteps, per_variant = per_launch * static_cast<std::size_t>(o.iterations);
  for (std::size_t v = 0; v < variants.size(); ++v) {
    double error = -1;
    std::vector<double> total(static_cast<std::size_t>(o.iterations), 0.0);
    std::vector<std::vector<double>> steps(kSteps, std::vector<double>(static_cast<std::size_t>(o.iterations), 0.0));
    for (const auto& part : all) {
      error = std::max(error, part[v]);
      const double* base = part.data() + variants.size() + v * per_variant;
      for (std::size_t i = 0; i < static_cast<std::size_t>(o.iterations); ++i) {
        total[i] = std::max(total[i], base[i * per_launch]);
        for (std::size_t s = 0; s < kSteps; ++s) steps[s][i] = std::max(steps[s][i], base[i * per_launch + 1 + s]);
      }
    }
    results.push_back({{"variant", std::string(to_string(variants[v]))}, {"error", error}, {"total", total}, {"steps", steps}});
  }
  const int threads = default_compute_threads();
  return {{"world", w}, {"nodes", rt.node_count()}, {"threads", threads}, {"load_before", load_before},
          {"load_after", load_average()}, {"results", results}};
}

// --- the report ---

void write_plot(const std::string& path, const std::vector<std::string>& steps, const std::vector<double>& bulk_ms,
                const std::vector<double>& best_ms, const std::string& baseline, const std::string& best,
                const std::string& title) {
  // Grouped horizontal bars: each step's median, baseline above the best variant.
  const double top = std::max(*std::max_element(bulk_ms.begin(), bulk_ms.end()), *std::max_element(best_ms.begin(), best_ms.end()));
  const int width = 900, label = 330, bar = 14, row = 2 * bar + 12, height = 60 + row * static_cast<int>(steps.size()) + 40;
  std::string svg = fmt::format(
      "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' font-size='12'>\n"
      "<text x='10' y='20' font-size='14'>{}</text>\n"
      "<rect x='{}' y='32' width='12' height='10' fill='#888'/><text x='{}' y='42'>{}</text>\n"
      "<rect x='{}' y='32' width='12' height='10' fill='#2a7'/><text x='{}' y='42'>{}</text>\n",
      width, height, title, label, label + 16, baseline, label + 160, label + 176, best);
  for (std::size_t s = 0; s < steps.size(); ++s) {
    const int y = 60 + row * static_cast<int>(s);
    const double scale = (width - label - 90) / std::max(top, 1e-9);
    svg += fmt::format("<text x='10' y='{}'>{}</text>\n", y + bar + 4, steps[s]);
    svg += fmt::format("<rect x='{}' y='{}' width='{:.1f}' height='{}' fill='#888'/><text x='{:.1f}' y='{}'>{:.3f} ms</text>\n",
                       label, y, bulk_ms[s] * scale, bar, label + bulk_ms[s] * scale + 4, y + bar - 3, bulk_ms[s]);
    svg += fmt::format("<rect x='{}' y='{}' width='{:.1f}' height='{}' fill='#2a7'/><text x='{:.1f}' y='{}'>{:.3f} ms</text>\n",
                       label, y + bar, best_ms[s] * scale, bar, label + best_ms[s] * scale + 4, y + 2 * bar - 3, best_ms[s]);
  }
  svg += "</svg>\n";
  std::ofstream out(path);
  out << svg;
  if (!out) throw Error(Errc::io, fmt::format("bench llm --plot: cannot write '{}'", path));
}

BenchReport make_report(const nlohmann::json& run, const LlmOptions& o) {
  BenchReport report;
  const auto& results = run["results"];
  const bool gpu = run.value("backend", "cpu") == "gpu";
  const std::string baseline_name = run.value("baseline", "bulk_synchronous");
  double baseline = 0;
  for (const auto& v : results)
    if (v["variant"] == baseline_name) baseline = summarize(v["total"].get<std::vector<double>>()).median;
  BenchTable totals{
      fmt::format("layer M={} H={} heads={}{} F={}, TP {}: time per layer, ms (slowest rank; median of {} "
                  "rounds after {} warm-up; a round runs each variant once)",
                  o.tokens, o.hidden, o.heads, o.kv_heads > 0 ? fmt::format(" kv_heads={}", o.kv_heads) : "", o.ffn,
                  run["world"].get<int>(), o.iterations, o.warmup),
      {"variant", "median", "p10..p90", "speedup vs bulk", "check"},
      {}};
  if (gpu) totals.columns.push_back("diff vs baseline");
  std::string best;
  double best_median = INFINITY, bound_median = 0;
  bool all_correct = true;
  nlohmann::json variants = nlohmann::json::array();
  for (const auto& v : results) {
    Summary s = summarize(v["total"].get<std::vector<double>>());
    const double error = v["error"].get<double>();
    const bool checked = error >= 0;
    bool correct = !checked || error < 1e-2;
    all_correct = all_correct && correct;
    const std::string name = v["variant"];
    const bool bound = v.value("bound", false);  // compute alone: a bound, not a variant
    if (bound) bound_median = s.median;
    if (correct && !bound && name != baseline_name && s.median < best_median) best_median = s.median, best = name;
    totals.rows.push_back({name + (name == baseline_name ? " (baseline)" : ""), fmt::format("{:.2f}", s.median * 1e3),
                           fmt::format("{:.2f}..{:.2f}", s.p10 * 1e3, s.p90 * 1e3), fmt::format("{:.2f}x", baseline / s.median),
                           !checked ? "off" : correct ? fmt::format("ok ({:.1e})", error) : fmt::format("FAIL ({:.1e})", error)});
    if (gpu && bound) {
      totals.rows.back()[4] = "n/a (no communication)";
      totals.rows.back().push_back("-");
    } else if (gpu) {
      // At the measured shape: agreement with the baseline's output (same weights and input).
      const double diff = v.value("diff_vs_baseline", 0.0);
      correct = correct && diff < 1e-2;
      all_correct = all_correct && diff < 1e-2;
      totals.rows.back().push_back(name == baseline_name ? "-" : fmt::format("{}{:.1e}", diff < 1e-2 ? "" : "FAIL ", diff));
    }
    nlohmann::json steps = nlohmann::json::object();
    for (std::size_t st = 0; st < kSteps; ++st)
      steps[std::string(to_string(static_cast<LayerStep>(st)))] = summarize(v["steps"][st].get<std::vector<double>>()).median * 1e3;
    variants.push_back({{"variant", name}, {"median_ms", s.median * 1e3}, {"p10_ms", s.p10 * 1e3}, {"p90_ms", s.p90 * 1e3},
                        {"speedup", baseline / s.median}, {"relative_error", checked ? nlohmann::json(error) : nlohmann::json()},
                        {"steps_median_ms", steps}});
  }
  report.tables.push_back(totals);
  if (best.empty()) best = baseline_name, best_median = baseline;  // no other variant passed its check
  BenchTable steps{fmt::format("per step, ms (median of the slowest rank): {} vs {}", baseline_name, best),
                   {"step", "bulk", best, "speedup"},
                   {}};
  std::vector<std::string> step_names;
  std::vector<double> bulk_ms, best_ms;
  for (std::size_t st = 0; st < kSteps; ++st) {
    const std::string name(to_string(static_cast<LayerStep>(st)));
    double b = 0, o_ms = 0;
    for (const auto& v : variants) {
      if (v["variant"] == baseline_name) b = v["steps_median_ms"][name];
      if (v["variant"] == best) o_ms = v["steps_median_ms"][name];
    }
    step_names.push_back(name);
    bulk_ms.push_back(b);
    best_ms.push_back(o_ms);
    steps.rows.push_back({name, fmt::format("{:.3f}", b), fmt::format("{:.3f}", o_ms), fmt::format("{:.2f}x", b / o_ms)});
  }
  report.tables.push_back(steps);
  report.headlines.push_back(fmt::format("layer M={} H={} TP {}: best {} {:.2f}x over bulk ({:.2f} ms vs {:.2f} ms)", o.tokens,
                                         o.hidden, run["world"].get<int>(), best, baseline / best_median, best_median * 1e3,
                                         baseline * 1e3));
  if (bound_median > 0)
    report.headlines.push_back(fmt::format("no-communication bound {:.2f} ms: no overlap can beat {:.2f}x over bulk here; the best "
                                           "reaches {:.0f}% of the way from bulk to the bound",
                                           bound_median * 1e3, baseline / bound_median,
                                           100.0 * (baseline - best_median) / std::max(baseline - bound_median, 1e-12)));
  report.headlines.push_back(o.check ? (all_correct ? (gpu ? "check: every variant matches the float32 reference layer (relative "
                                                           "error < 1e-2) and the baseline's output at the measured shape"
                                                         : "check: every variant matches the float32 reference layer (relative error < 1e-2)")
                                                    : "check: FAILED (see the check column)")
                                     : "check: off (--no-check)");
  if (gpu) {
    const auto& c = run["check_shape"];
    report.notes.push_back(fmt::format(
        "GPU backend: {} GPUs in one process, one thread each ({}); seed {:#x}; baseline {} = NCCL all_gather / "
        "reduce_scatter + cuBLAS GEMM on one stream, as PyTorch+NCCL runs the layer; attention {} (the same in every "
        "variant)",
        run["world"].get<int>(), run.value("toolchain", ""), run["seed"].get<std::uint64_t>(), baseline_name,
        run.value("attention", "fused") == "fused"
            ? fmt::format("fused (flash-attention kernel, {})", run.value("attention_kernel", std::string("?")))
            : std::string("unfused (cuBLAS batched GEMMs + causal softmax)")));
    report.notes.push_back(fmt::format(
        "check: each variant against the float32 reference layer at M={} H={} heads={} kv_heads={} F={} (grouped-query "
        "attention, several query blocks, outputs poisoned first); 'diff vs baseline': relative difference of the output "
        "from the baseline's at the measured shape, same weights and input",
        c["tokens"].get<long>(), c["hidden"].get<long>(), c["heads"].get<long>(), c["kv_heads"].get<long>(),
        c["ffn"].get<long>()));
  } else {
    report.notes.push_back(fmt::format("CPU backend: {} ranks in {} logical node(s), {} compute thread(s) per rank; weights and "
                                       "activations bf16, fp32 arithmetic; attention, norms and SwiGLU on one thread per rank",
                                       run["world"].get<int>(), run["nodes"].get<int>(), run["threads"].get<int>()));
    report.notes.push_back(fmt::format(
        "load average {:.2f} before, {:.2f} after, on {} cores: other work on the "
        "machine moves CPU timings; compare ratios within one run",
        run["load_before"].get<double>(), run["load_after"].get<double>(), std::thread::hardware_concurrency()));
  }
  report.figures = {{"backend", gpu ? "gpu" : "cpu"}, {"world", run["world"]}, {"nodes", run["nodes"]}, {"threads", run["threads"]},
                    {"shape", {{"tokens", o.tokens}, {"hidden", o.hidden}, {"heads", o.heads}, {"kv_heads", o.kv_heads},
                               {"ffn", o.ffn}}},
                    {"iterations", o.iterations}, {"warmup", o.warmup}, {"load_before", run.value("load_before", 0.0)},
                    {"load_after", run.value("load_after", 0.0)}, {"variants", variants}, {"baseline", baseline_name},
                    {"best", best}, {"best_speedup", baseline / best_median}, {"correct", all_correct},
                    {"bound_ms", bound_median * 1e3}};
  if (!o.plot_path.empty())
    write_plot(o.plot_path, step_names, bulk_ms, best_ms, baseline_name, best,
               fmt::format("caravan bench llm ({}): layer M={} H={} TP {}, median ms per step", gpu ? "GPU" : "CPU", o.tokens,
                           o.hidden, run["world"].get<int>()));
  if (o.check && !all_correct) report.failure = "bench llm: a variant does not match the float32 reference layer";
  return report;
}

std::uint64_t heap_bytes_needed(const LlmOptions& o) {
  // Per layer: two AllGather exchanges (M x H) and two ReduceScatter exchanges (M x H), bf16.
  const std::uint64_t per_layer = 4 * static_cast<std::uint64_t>(o.tokens) * static_cast<std::uint64_t>(o.hidden) * 2 + (1 << 20);
  return (per_layer * variants_of(o).size() + (4 << 20)) * 5 / 4;
}

#ifdef CARAVAN_HAVE_OVERLAP_GPU
constexpr bool kGpuBackendBuilt = true;
#else
constexpr bool kGpuBackendBuilt = false;
#endif

// The GPU backend (--backend gpu, or auto with 2+ GPUs). Where this build has no GPU backend or
// the machine no GPU, says that first: the shape checks below would otherwise judge the GPU
// backend's defaults against GPUs that are not there.
BenchReport run_llm_bench_gpu(const LlmOptions& given) {
  if (!kGpuBackendBuilt)
    throw Error(Errc::invalid_argument,
                fmt::format("--backend gpu: this build has no GPU backend for bench llm: {}; use --backend cpu",
                            no_gpu_kernels_reason()));
  const GpuProbe probe = probe_gpus();
  if (probe.device_count == 0)
    throw Error(Errc::invalid_argument,
                fmt::format("--backend gpu: no GPU is present ({}); use --backend cpu", probe.reason));
  const LlmOptions o = with_defaults(given, true);
  const int world = o.world != 0 ? o.world : std::min(probe.device_count, 4);
  if (world < 1 || world > probe.device_count)
    throw Error(Errc::invalid_argument,
                fmt::format("--world {}: the GPU backend runs one rank per GPU, and this machine has {} GPU(s)", world,
                            probe.device_count));
  validate(o, world, true);
  if (o.nodes != 1)
    throw Error(Errc::invalid_argument, "--nodes: the GPU backend runs the GPUs of one node (one process); use 1");
#ifdef CARAVAN_HAVE_OVERLAP_GPU
  LlmGpuRequest request{.shape = shape_of(o), .world = world, .iterations = o.iterations, .warmup = o.warmup,
                        .variants = o.variants, .check = o.check, .attention = o.attention};
  return make_report(run_llm_gpu(request), o);
#else
  throw Error(Errc::internal, "bench llm: no GPU backend in this build");  // refused above
#endif
}

// The matrix on the GPU backend: Llama-3 70B and 8B, prefill of 4096, 8192 and 16384
// tokens, TP 2 and 4 (those the GPUs allow), every variant each; one summary table, and each
// configuration's full figures in the JSON. The float32 check runs in the first configuration
// of each TP degree (its shape depends only on the TP degree); every configuration compares its
// outputs with the baseline's.
BenchReport run_llm_sweep_gpu(const LlmOptions& given) {
  if (given.tokens != 0 || given.world != 0 || !given.model.empty() || given.hidden != 0 || given.heads != 0 ||
      given.kv_heads != 0 || given.ffn != 0 || !given.plot_path.empty())
    throw Error(Errc::invalid_argument,
                "bench llm --sweep: runs its own matrix of models, tokens and TP degrees; drop --model, --tokens, --world, "
                "--hidden, --heads, --kv-heads, --ffn and --plot");
  const int gpus = probe_gpus().device_count;
  BenchReport summary;
  BenchTable table{"Llama-3 layers, ms per layer (slowest rank; median)",
                   {"model", "TP", "tokens", "NCCL bulk", "best Caravan", "best", "speedup", "no-comm bound", "bound speedup",
                    "share of possible gain", "check"},
                   {}};
  nlohmann::json all = nlohmann::json::array();
  bool all_correct = true;
  for (int world : {4, 2}) {
    if (world > gpus) continue;
    bool first = true;
    for (const char* model : {"llama3-70b", "llama3-8b"})
      for (long tokens : {4096L, 8192L, 16384L}) {
        LlmOptions o = given;
        o.model = model;
        o.tokens = tokens;
        o.world = world;
        o.check = given.check && first;
        first = false;
        fmt::print(stderr, "bench llm --sweep: {} TP {} tokens {}\n", model, world, tokens);
        const BenchReport r = run_llm_bench_gpu(o);
        const nlohmann::json& f = r.figures;
        double bulk = 0, bound = f.value("bound_ms", 0.0), best = 0;
        for (const auto& v : f["variants"]) {
          if (v["variant"] == f["baseline"]) bulk = v["median_ms"].get<double>();
          if (v["variant"] == f["best"]) best = v["median_ms"].get<double>();
        }
        const bool correct = f.value("correct", false);
        all_correct = all_correct && correct;
        table.rows.push_back({model, std::to_string(world), std::to_string(tokens), fmt::format("{:.2f}", bulk),
                              fmt::format("{:.2f}", best), f["best"].get<std::string>(), fmt::format("{:.2f}x", bulk / best),
                              fmt::format("{:.2f}", bound), fmt::format("{:.2f}x", bound > 0 ? bulk / bound : 0.0),
                              bound > 0 && bulk > bound ? fmt::format("{:.0f}%", 100.0 * (bulk - best) / (bulk - bound)) : "-",
                              correct ? "ok" : "FAIL"});
        nlohmann::json entry = f;
        entry["model"] = model;
        all.push_back(std::move(entry));
      }
  }
  if (all.empty())
    throw Error(Errc::invalid_argument, fmt::format("bench llm --sweep: needs at least 2 GPUs; this machine has {}", gpus));
  summary.tables.push_back(std::move(table));
  summary.notes.push_back("each row is one `caravan bench llm` configuration (its variants, checks and per-step times are in "
                          "the JSON); baseline NCCL all_gather / reduce_scatter + cuBLAS on one stream");
  summary.headlines.push_back(all_correct ? "check: every configuration's variants match the reference and the baseline"
                                          : "check: FAILED in a configuration (see the check column)");
  summary.figures = {{"backend", "gpu"}, {"sweep", true}, {"configurations", all}};
  if (!all_correct) summary.failure = "bench llm --sweep: a variant does not match";
  return summary;
}

BenchReport run_llm_bench(const LlmOptions& given) {
  if (given.sweep) {
    const GpuProbe probe = probe_gpus();
    std::string missing;
    if (given.backend == "cpu")
      missing = "--backend cpu";
    else if (!kGpuBackendBuilt)
      missing = no_gpu_kernels_reason();
    else if (probe.device_count == 0)
      missing = no_gpu_reason(probe);
    else if (probe.device_count == 1)
      missing = "this machine has 1 GPU";
    if (!missing.empty())
      throw Error(Errc::invalid_argument,
                  fmt::format("--sweep: the matrix of Llama-3 layers needs the GPU backend and 2+ GPUs ({})", missing));
    return run_llm_sweep_gpu(given);
  }
  if (given.backend != "auto" && given.backend != "cpu" && given.backend != "gpu")
    throw Error(Errc::invalid_argument, fmt::format("--backend {}: expected auto, cpu or gpu", given.backend));
  const bool launched_as_ranks = std::getenv("WORLD_SIZE") != nullptr;
  if (given.backend == "gpu" ||
      (given.backend == "auto" && kGpuBackendBuilt && !launched_as_ranks && probe_gpus().device_count >= 2))
    return run_llm_bench_gpu(given);
  const LlmOptions o = with_defaults(given, false);
  if (const char* world_size = std::getenv("WORLD_SIZE")) {
    if (o.world != 0 && std::to_string(o.world) != world_size)
      throw Error(Errc::invalid_argument, fmt::format("--world {}: this job has WORLD_SIZE={}", o.world, world_size));
    nlohmann::json run = run_layer_ranks(o);
    if (run.is_null()) {
      BenchReport silent;
      silent.printed = true;  // rank 0 prints the job's report
      return silent;
    }
    return make_report(run, o);
  }
  const int world = o.world != 0 ? o.world : 2;
  if (world < 1 || world > 64) throw Error(Errc::invalid_argument, fmt::format("--world {}: must be in [1, 64]", world));
  validate(o, world);
  kernels::check_overlap_settings();  // once here, as a usage error, not in every rank
  std::vector<std::string> args = {"bench", "llm-rank", "--tokens", std::to_string(o.tokens), "--hidden", std::to_string(o.hidden),
                                   "--heads", std::to_string(o.heads), "--ffn", std::to_string(o.ffn), "--iterations",
                                   std::to_string(o.iterations), "--warmup", std::to_string(o.warmup)};
  if (o.kv_heads != 0) args.insert(args.end(), {"--kv-heads", std::to_string(o.kv_heads)});
  for (const auto& v : o.variants) args.insert(args.end(), {"--variant", v});
  if (!o.check) args.push_back("--no-check");
  std::vector<std::pair<std::string, std::string>> environment;
  if (settings::get_bytes("CARAVAN_SYMMETRIC_HEAP_BYTES") < heap_bytes_needed(o))
    environment.push_back({"CARAVAN_SYMMETRIC_HEAP_BYTES", std::to_string(heap_bytes_needed(o))});
  return make_report(run_self_as_ranks(world, o.nodes, args, environment, "bench-llm"), o);
}

void add_shape_options(CLI::App& sub, LlmOptions& o) {
  sub.add_option("--model", o.model, "llama3-8b or llama3-70b: sets --hidden, --heads, --kv-heads, --ffn (default on the GPU "
                 "backend: llama3-70b with 8192 tokens)");
  sub.add_option("--tokens", o.tokens, "Tokens M of the prefill (all ranks together); 0: the backend's default (CPU 256)")
      ->capture_default_str();
  sub.add_option("--hidden", o.hidden, "Hidden size H; 0: from --model or 1024")->capture_default_str();
  sub.add_option("--heads", o.heads, "Attention (query) heads, split over the ranks; 0: from --model or 8")->capture_default_str();
  sub.add_option("--kv-heads", o.kv_heads, "Key/value heads (grouped-query attention); 0: as --heads")
      ->capture_default_str();
  sub.add_option("--ffn", o.ffn, "MLP width F; 0: from --model or 2816")->capture_default_str();
  sub.add_option("--variant", o.variants, "Overlap variants to measure (default: all; the bulk baseline always)");
  sub.add_option("--iterations", o.iterations, "Timed layers per variant")->capture_default_str();
  sub.add_option("--warmup", o.warmup, "Untimed layers per variant first")->capture_default_str();
  sub.add_flag("--no-check", [&o](std::int64_t) { o.check = false; }, "Skip the float32 reference check");
  sub.add_option("--attention", o.attention, "GPU backend: fused (a flash-attention kernel) or unfused (cuBLAS + softmax), "
                 "the same in every variant")
      ->check(CLI::IsMember({"fused", "unfused"}))
      ->capture_default_str();
}

}  // namespace

void add_bench_llm(CLI::App& bench) {
  CLI::App& sub = add_bench_case(bench, "llm",
                                 "A tensor-parallel transformer layer with bulk vs overlapped communication",
                                 [] { return run_llm_bench(g_llm); });
  sub.add_option("--backend", g_llm.backend, "auto (gpu where this build has it and 2+ GPUs are present), cpu or gpu")
      ->capture_default_str();
  sub.add_option("--world", g_llm.world, "Ranks (tensor-parallel degree); 0: 2 on the CPU, up to 4 GPUs")->capture_default_str();
  sub.add_option("--nodes", g_llm.nodes, "Logical nodes the ranks are split into (2+: UCX between them)")->capture_default_str();
  sub.add_option("--plot", g_llm.plot_path, "Also write an SVG plot of the per-step times to this file");
  sub.add_flag("--sweep", g_llm.sweep,
               "GPU backend: Llama-3 70B and 8B x 4096/8192/16384 tokens x TP 4 and 2, one summary table (several "
               "minutes on 4 x H200; use --iterations/--warmup to shorten)");
  add_shape_options(sub, g_llm);
  CLI::App* rank = bench.add_subcommand("llm-rank", "One rank of `bench llm` (internal)");
  rank->group("");
  add_shape_options(*rank, g_llm_rank);
  rank->add_option("--out", g_llm_rank.out)->required();
  rank->callback([] {
    nlohmann::json run = run_layer_ranks(g_llm_rank);
    if (!run.is_null()) std::ofstream(g_llm_rank.out) << run.dump();
  });
}

}  // namespace caravan::app
