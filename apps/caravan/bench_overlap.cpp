// `caravan bench overlap`, CPU backend: the overlapped collectives + GEMMs of kernels/ on W
// ranks of this host, every variant against the bulk-synchronous baseline measured in the same
// run, interleaved launch by launch (so that drift in the machine's load hits all alike).
//
// Operations (docs/overlap.md): ag_gemm (AllGather + GEMM), gemm_rs (GEMM + ReduceScatter),
// gemm_as (GEMM + All-Scatter), ll_allgather (the LL AllGather against the push and pull
// AllGathers). A shape is a token count M with K = N = --hidden.
//
// Outside a job, the command starts its ranks itself: it re-executes this program through the
// launcher of `caravan run` as `bench overlap-rank`, and rank 0 hands its figures back in a
// file. Under `caravan run -n W caravan bench overlap` the ranks measure directly and rank 0
// prints. The GPU backend (kernels/gpu) is reached through run_bench_overlap_gpu().
#include "apps/caravan/bench_overlap.h"
#include "apps/caravan/bench_ranks.h"
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"

#include <caravan/caravan.h>
#include <caravan/kernels/overlap.h>
#include <caravan/platform.h>
#include <caravan/settings.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <thread>

namespace caravan::app {
namespace {

using Clock = std::chrono::steady_clock;
using namespace kernels;

const std::vector<std::string> kOperations = {"ag_gemm", "gemm_rs", "gemm_as", "ll_allgather"};

// CPU-backend options beyond the shared BenchOverlapArgs.
struct CpuOptions {
  int nodes = 1;      // logical nodes (2: the peers of other nodes are reached through UCX)
  long hidden = 1024;  // K = N of the GEMMs, and the row width of the LL messages
  std::string out;    // overlap-rank: where rank 0 writes its figures
  bool hidden_given = false, nodes_given = false;  // on the command line (the GPU backend refuses them)
};

BenchOverlapArgs g_args;
CpuOptions g_cpu;
BenchOverlapArgs g_rank_args;  // the hidden `bench overlap-rank`
CpuOptions g_rank_cpu;

// Token counts per operation on a 2-core machine: a decode size, a small and a larger prefill
// chunk for the GEMMs (about 10 ms of GEMM per rank at the largest); 8 and 64 KiB per rank
// (W = 2) for the LL AllGather.
std::vector<long> default_tokens(const std::string& op) {
  if (op == "ll_allgather") return {8, 64};
  return {16, 128, 512};
}

std::vector<Bf16> random_bf16(std::int64_t count, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 99);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<Bf16> v(static_cast<std::size_t>(count));
  for (auto& x : v) x = Bf16::from_float(dist(rng));
  return v;
}
std::uint64_t seed_of(int rank, int what) { return static_cast<std::uint64_t>(rank) * 7919 + static_cast<std::uint64_t>(what); }
constexpr Bf16 kPoison{0x7FC0};

// One variant of one shape: run() is one launch; check() runs one launch on fresh inputs with
// the output poisoned and returns this rank's relative error against the float32 reference.
struct Candidate {
  std::string variant;
  bool baseline = false;
  std::function<void()> run;
  std::function<double()> check;
};

struct ShapeInfo {
  std::int64_t m, n, k;
  std::string text;
};

ShapeInfo shape_of(const std::string& op, long tokens, long hidden, int world) {
  if (op == "ll_allgather") {
    const std::int64_t bytes = tokens * hidden * 2 / world;
    return {tokens, hidden, 0, fmt::format("{} B per rank ({} tokens x {} bf16 / {} ranks)", bytes, tokens, hidden, world)};
  }
  return {tokens, hidden, hidden, fmt::format("M={} N={} K={}", tokens, hidden, hidden)};
}

void validate(const BenchOverlapArgs& args, const CpuOptions& cpu, int world) {
  if (args.stamps) throw Error(Errc::invalid_argument, "--stamps: GPU backend only (it times phases on the GPU clock)");
  if (!args.shapes.empty()) {
    (void)parse_overlap_shapes(args.shapes);  // a malformed value is named first
    throw Error(Errc::invalid_argument,
                fmt::format("--shape {}: GPU backend only (the CPU backend's GEMMs are --hidden square)", args.shapes[0]));
  }
  for (const auto& op : args.operations) {
    if (op == "allgather" || op == "reduce_scatter" || op == "all_scatter")
      throw Error(Errc::invalid_argument,
                  fmt::format("--op {}: GPU backend only (on the CPU backend, ll_allgather also times the push and "
                              "pull AllGather)",
                              op));
    if (std::find(kOperations.begin(), kOperations.end(), op) == kOperations.end())
      throw Error(Errc::invalid_argument, fmt::format("--op {}: expected ag_gemm, gemm_rs, gemm_as or ll_allgather", op));
  }
  if (args.iterations < 1) throw Error(Errc::invalid_argument, fmt::format("--iterations {}: must be at least 1", args.iterations));
  if (args.warmup < 0) throw Error(Errc::invalid_argument, fmt::format("--warmup {}: must be at least 0", args.warmup));
  if (cpu.hidden < 32 || cpu.hidden % 32 != 0)
    throw Error(Errc::invalid_argument, fmt::format("--hidden {}: must be a positive multiple of 32", cpu.hidden));
  if (cpu.nodes < 1 || cpu.nodes > world)
    throw Error(Errc::invalid_argument, fmt::format("--nodes {}: must be in [1, --world {}]", cpu.nodes, world));
  for (long t : args.tokens) {
    if (t < 1) throw Error(Errc::invalid_argument, fmt::format("--tokens {}: must be at least 1", t));
    if (t % world != 0)
      throw Error(Errc::invalid_argument,
                  fmt::format("--tokens {}: must be divisible by the world size {} (every rank holds M / W rows)", t, world));
  }
  if (cpu.hidden % world != 0 || (cpu.hidden / world) % 32 != 0)
    throw Error(Errc::invalid_argument, fmt::format("--hidden {}: N / W and K / W must be multiples of 32 for --world {}",
                                                    cpu.hidden, world));
}

}  // namespace

std::vector<OverlapShape> parse_overlap_shapes(const std::vector<std::string>& values) {
  // Past this the GEMM's sides no longer fit the vendor BLAS's int dimensions with any M.
  constexpr long kMaxShapeSide = 1L << 20;
  std::vector<OverlapShape> shapes;
  for (const std::string& value : values) {
    const auto first = value.find(':'), second = first == std::string::npos ? first : value.find(':', first + 1);
    const auto bad = [&](const std::string& rule) {
      return Error(Errc::invalid_argument, fmt::format("--shape {}: {}", value, rule));
    };
    if (first == 0 || second == std::string::npos || value.find(':', second + 1) != std::string::npos)
      throw bad("expected NAME:K:N (a name, then the whole weight's K and N), e.g. my-down:14336:4096");
    OverlapShape shape{value.substr(0, first), 0, 0};
    const auto number = [&](const std::string& text, const char* what) {
      long v = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec != std::errc() || end != text.data() + text.size() || v < 8 || v % 8 != 0 || v > kMaxShapeSide)
        throw bad(fmt::format("{} '{}' must be a positive multiple of 8 (16-byte rows), at most {}", what, text,
                              kMaxShapeSide));
      return v;
    };
    shape.k = number(value.substr(first + 1, second - first - 1), "K");
    shape.n = number(value.substr(second + 1), "N");
    shapes.push_back(std::move(shape));
  }
  return shapes;
}

namespace {

std::vector<std::string> operations_of(const BenchOverlapArgs& args) {
  return args.operations.empty() ? kOperations : args.operations;
}
std::vector<long> tokens_of(const BenchOverlapArgs& args, const std::string& op) {
  return args.tokens.empty() ? default_tokens(op) : args.tokens;
}

// Symmetric heap bytes per rank the whole run allocates (the heap never reuses memory).
std::uint64_t heap_bytes_needed(const BenchOverlapArgs& args, const CpuOptions& cpu, int world) {
  std::uint64_t total = 1 << 20;
  for (const auto& op : operations_of(args))
    for (long m : tokens_of(args, op)) {
      const std::uint64_t mh2 = static_cast<std::uint64_t>(m) * static_cast<std::uint64_t>(cpu.hidden) * 2;
      if (op == "ll_allgather") total += mh2 * 2 + 4 * mh2 + 64 * 1024;   // push + pull, LL (2 launches, 8-byte words)
      else total += 4 * (mh2 + 256 * 1024);                             // four variants, each one M x hidden exchange
      (void)world;
    }
  return total + total / 4;
}

// --- the ranks' side ---

std::vector<Candidate> make_candidates(const std::string& op, const ShapeInfo& s, Runtime& rt) {
  SymmetricHeap heap = SymmetricHeap::current();
  const int w = rt.world_size(), r = rt.rank();
  std::vector<Candidate> out;
  if (op == "ll_allgather") {
    const std::int64_t rows = s.m / w, cols = s.n;
    const std::size_t bytes = static_cast<std::size_t>(rows * cols) * sizeof(Bf16);
    auto mine = std::make_shared<std::vector<Bf16>>(random_bf16(rows * cols, seed_of(r, 1)));
    auto result = std::make_shared<std::vector<Bf16>>(static_cast<std::size_t>(rows * cols * w));
    auto check_gathered = [=](const Bf16* got) {
      for (int src = 0; src < w; ++src) {
        auto expected = random_bf16(rows * cols, seed_of(src, 1));
        if (std::memcmp(got + src * rows * cols, expected.data(), bytes) != 0) return static_cast<double>(INFINITY);
      }
      return 0.0;
    };
    auto push = std::make_shared<AllGather>(heap, rows, cols, GatherMode::push);
    auto pull = std::make_shared<AllGather>(heap, rows, cols, GatherMode::pull);
    auto ll = std::make_shared<LowLatencyAllGather>(heap, bytes);
    out.push_back({"push allgather", true, [=] { push->run(mine->data()); }, [=] { return check_gathered(push->run(mine->data())); }});
    out.push_back({"pull allgather", false, [=] { pull->run(mine->data()); }, [=] { return check_gathered(pull->run(mine->data())); }});
    out.push_back({"ll allgather", false, [=] { ll->run(mine->data(), result->data()); }, [=] {
                     std::fill(result->begin(), result->end(), kPoison);
                     ll->run(mine->data(), result->data());
                     return check_gathered(result->data());
                   }});
    return out;
  }
  for (OverlapVariant v : kAllVariants) {
    Candidate c;
    c.variant = std::string(to_string(v));
    c.baseline = v == OverlapVariant::bulk_synchronous;
    if (op == "ag_gemm") {
      const std::int64_t rows = s.m / w, n_local = s.n / w;
      auto gemm = std::make_shared<AllGatherGemm>(heap, s.m, s.n, s.k, v);
      auto a = std::make_shared<std::vector<Bf16>>(random_bf16(rows * s.k, seed_of(r, 2)));
      auto b = random_bf16(s.k * n_local, seed_of(r, 3));
      gemm->set_weights(b.data());
      auto result = std::make_shared<std::vector<Bf16>>(static_cast<std::size_t>(s.m * n_local));
      c.run = [=] { gemm->run(a->data(), result->data()); };
      c.check = [=] {
        std::fill(result->begin(), result->end(), kPoison);
        gemm->run(a->data(), result->data());
        std::vector<Bf16> a_full;
        for (int src = 0; src < w; ++src) {
          auto shard = random_bf16(rows * s.k, seed_of(src, 2));
          a_full.insert(a_full.end(), shard.begin(), shard.end());
        }
        auto ref = reference_gemm(a_full.data(), s.k, b.data(), n_local, s.m, n_local, s.k);
        return relative_error(result->data(), n_local, ref.data(), n_local, s.m, n_local);
      };
    } else if (op == "gemm_rs") {
      const std::int64_t rows = s.m / w, k_local = s.k / w;
      auto gemm = std::make_shared<GemmReduceScatter>(heap, s.m, s.n, s.k, v);
      auto a = std::make_shared<std::vector<Bf16>>(random_bf16(s.m * k_local, seed_of(r, 4)));
      gemm->set_weights(random_bf16(k_local * s.n, seed_of(r, 5)).data());
      auto result = std::make_shared<std::vector<Bf16>>(static_cast<std::size_t>(rows * s.n));
      c.run = [=] { gemm->run(a->data(), result->data()); };
      c.check = [=] {
        std::fill(result->begin(), result->end(), kPoison);
        gemm->run(a->data(), result->data());
        std::vector<float> ref(static_cast<std::size_t>(rows * s.n), 0.0f);
        for (int src = 0; src < w; ++src) {
          auto a_src = random_bf16(s.m * k_local, seed_of(src, 4));
          auto b_src = random_bf16(k_local * s.n, seed_of(src, 5));
          auto part = reference_gemm(a_src.data() + r * rows * k_local, k_local, b_src.data(), s.n, rows, s.n, k_local);
          for (std::size_t i = 0; i < ref.size(); ++i) ref[i] += part[i];
        }
        return relative_error(result->data(), s.n, ref.data(), s.n, rows, s.n);
      };
    } else {  // gemm_as
      const std::int64_t n_local = s.n / w;
      auto gemm = std::make_shared<GemmAllScatter>(heap, s.m, s.n, s.k, v);
      auto a = std::make_shared<std::vector<Bf16>>(random_bf16(s.m * s.k, seed_of(0, 6)));
      gemm->set_weights(random_bf16(s.k * n_local, seed_of(r, 7)).data());
      auto result = std::make_shared<std::vector<Bf16>>(static_cast<std::size_t>(s.m * s.n));
      c.run = [=] { gemm->run(a->data(), result->data()); };
      c.check = [=] {
        std::fill(result->begin(), result->end(), kPoison);
        gemm->run(a->data(), result->data());
        std::vector<Bf16> b_full(static_cast<std::size_t>(s.k * s.n));
        for (int src = 0; src < w; ++src) {
          auto b_src = random_bf16(s.k * n_local, seed_of(src, 7));
          for (std::int64_t row = 0; row < s.k; ++row)
            std::copy_n(b_src.begin() + row * n_local, n_local, b_full.begin() + row * s.n + src * n_local);
        }
        auto ref = reference_gemm(a->data(), s.k, b_full.data(), s.n, s.m, s.n, s.k);
        return relative_error(result->data(), s.n, ref.data(), s.n, s.m, s.n);
      };
    }
    out.push_back(std::move(c));
  }
  return out;
}

// Runs every operation and shape on this rank; rank 0 returns the figures (others: null).
nlohmann::json run_ranks_side(const BenchOverlapArgs& args, const CpuOptions& cpu) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  const int w = rt.world_size();
  validate(args, cpu, w);
  StartLine start_line(rt);  // see bench_ranks.h
  nlohmann::json results = nlohmann::json::array();
  const double load_before = load_average();
  for (const auto& op : operations_of(args)) {
    for (long tokens : tokens_of(args, op)) {
      const ShapeInfo shape = shape_of(op, tokens, cpu.hidden, w);
      std::vector<Candidate> candidates = make_candidates(op, shape, rt);
      std::vector<double> errors(candidates.size(), -1);
      if (args.check)
        for (std::size_t c = 0; c < candidates.size(); ++c) errors[c] = candidates[c].check();
      // Interleaved: launch i of every variant, then launch i + 1; a barrier before each launch
      // so that every rank starts it together. A launch's time is the slowest rank's.
      std::vector<std::vector<double>> seconds(candidates.size());
      for (int it = 0; it < args.warmup + args.iterations; ++it)
        for (std::size_t c = 0; c < candidates.size(); ++c) {
          start_line.wait();
          const auto start = Clock::now();
          candidates[c].run();
          const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
          if (it >= args.warmup) seconds[c].push_back(elapsed);
        }
      std::vector<double> flat(errors);
      for (const auto& s : seconds) flat.insert(flat.end(), s.begin(), s.end());
      auto all = gather_doubles(rt, flat);
      if (rt.rank() != 0) continue;
      nlohmann::json variants = nlohmann::json::array();
      for (std::size_t c = 0; c < candidates.size(); ++c) {
        double error = -1;
        std::vector<double> slowest(static_cast<std::size_t>(args.iterations), 0.0);
        for (const auto& part : all) {
          error = std::max(error, part[c]);
          for (int i = 0; i < args.iterations; ++i)
            slowest[static_cast<std::size_t>(i)] =
                std::max(slowest[static_cast<std::size_t>(i)],
                         part[candidates.size() + c * static_cast<std::size_t>(args.iterations) + static_cast<std::size_t>(i)]);
        }
        variants.push_back({{"variant", candidates[c].variant}, {"baseline", candidates[c].baseline},
                            {"seconds", slowest}, {"error", error}});
      }
      results.push_back({{"op", op}, {"tokens", tokens}, {"m", shape.m}, {"n", shape.n}, {"k", shape.k},
                         {"shape", shape.text}, {"variants", variants}});
    }
  }
  if (rt.rank() != 0) return nullptr;
  const int threads = default_compute_threads();
  return {{"world", w}, {"nodes", rt.node_count()}, {"threads", threads}, {"load_before", load_before},
          {"load_after", load_average()}, {"results", results}};
}

// --- the report (rank 0 or the driver) ---

BenchReport make_report(const nlohmann::json& run, const BenchOverlapArgs& args) {
  BenchReport report;
  nlohmann::json figures = nlohmann::json::array(), best_all = nlohmann::json::array();
  bool all_correct = true;
  std::map<std::string, BenchTable> tables;
  for (const auto& shape : run["results"]) {
    const std::string op = shape["op"];
    auto& table = tables[op];
    if (table.columns.empty()) {
      table.title = fmt::format("{}: time per launch, ms (slowest rank; median of {} launches after {} warm-up)", op,
                                args.iterations, args.warmup);
      table.columns = {"shape", "variant", "median", "p10..p90", "speedup vs baseline", "check"};
    }
    double baseline = 0;
    for (const auto& v : shape["variants"])
      if (v["baseline"].get<bool>()) baseline = summarize(v["seconds"].get<std::vector<double>>()).median;
    std::string best;
    double best_median = INFINITY;
    nlohmann::json variants = nlohmann::json::array();
    for (const auto& v : shape["variants"]) {
      Summary s = summarize(v["seconds"].get<std::vector<double>>());
      const double error = v["error"].get<double>();
      const bool checked = error >= 0;
      const bool correct = !checked || error < 1e-2;
      all_correct = all_correct && correct;
      const double speedup = baseline / s.median;
      std::string variant = v["variant"];
      if (correct && s.median < best_median) best_median = s.median, best = variant;
      table.rows.push_back({shape["shape"].get<std::string>(), variant + (v["baseline"].get<bool>() ? " (baseline)" : ""),
                            fmt::format("{:.3f}", s.median * 1e3), fmt::format("{:.3f}..{:.3f}", s.p10 * 1e3, s.p90 * 1e3),
                            fmt::format("{:.2f}x", speedup),
                            !checked ? "off" : correct ? fmt::format("ok ({:.1e})", error) : fmt::format("FAIL ({:.1e})", error)});
      variants.push_back({{"variant", variant}, {"baseline", v["baseline"]}, {"median_ms", s.median * 1e3},
                          {"p10_ms", s.p10 * 1e3}, {"p90_ms", s.p90 * 1e3}, {"speedup", speedup},
                          {"relative_error", checked ? nlohmann::json(error) : nlohmann::json(nullptr)},
                          {"correct", checked ? nlohmann::json(correct) : nlohmann::json(nullptr)},
                          {"samples_ms", [&] {
                             std::vector<double> ms;
                             for (double x : v["seconds"]) ms.push_back(x * 1e3);
                             return ms;
                           }()}});
    }
    const double best_speedup = baseline / best_median;
    report.headlines.push_back(fmt::format("{} {}: best {} {:.2f}x over bulk ({:.3f} ms vs {:.3f} ms)", op,
                                           shape["shape"].get<std::string>(), best, best_speedup, best_median * 1e3,
                                           baseline * 1e3));
    figures.push_back({{"op", op}, {"tokens", shape["tokens"]}, {"m", shape["m"]}, {"n", shape["n"]}, {"k", shape["k"]},
                       {"variants", variants}, {"best", best}, {"best_speedup", best_speedup}});
    best_all.push_back({{"op", op}, {"tokens", shape["tokens"]}, {"variant", best}, {"speedup", best_speedup}});
  }
  for (const auto& op : kOperations)
    if (tables.count(op)) report.tables.push_back(tables[op]);
  report.headlines.push_back(args.check ? (all_correct ? "check: every variant matches the float32 reference (bf16 relative error < 1e-2)"
                                                       : "check: FAILED (see the check column)")
                                        : "check: off (--no-check)");
  report.notes.push_back(fmt::format(
      "CPU backend: {} ranks in {} logical node(s) on this host, {} compute thread(s) per rank (CARAVAN_OVERLAP_THREADS), "
      "host symmetric heap ({}); bf16 in, fp32 accumulate",
      run["world"].get<int>(), run["nodes"].get<int>(), run["threads"].get<int>(),
      run["nodes"].get<int>() > 1 ? "UCX between logical nodes" : "shared memory"));
  report.notes.push_back(fmt::format(
      "load average {:.2f} before, {:.2f} after, on {} cores: other work on the machine moves CPU timings; compare "
      "ratios within one run",
      run["load_before"].get<double>(), run["load_after"].get<double>(), std::thread::hardware_concurrency()));
  report.notes.push_back("baseline: bulk_synchronous (the collective, then the GEMM, or the GEMM, then the collective, as "
                         "PyTorch + NCCL on one stream); ll_allgather: the push AllGather");
  report.figures = {{"backend", "cpu"},          {"world", run["world"]},         {"nodes", run["nodes"]},
                    {"threads", run["threads"]}, {"iterations", args.iterations}, {"warmup", args.warmup},
                    {"load_before", run["load_before"]}, {"load_after", run["load_after"]},
                    {"correct", all_correct},    {"shapes", figures},             {"best", best_all}};
  if (args.check && !all_correct) report.failure = "bench overlap: a variant does not match the float32 reference";
  return report;
}

std::vector<std::string> rank_arguments(const BenchOverlapArgs& args, const CpuOptions& cpu) {
  std::vector<std::string> out = {"--iterations", std::to_string(args.iterations), "--warmup", std::to_string(args.warmup),
                                  "--hidden", std::to_string(cpu.hidden)};
  for (const auto& op : args.operations) out.insert(out.end(), {"--op", op});
  for (long t : args.tokens) out.insert(out.end(), {"--tokens", std::to_string(t)});
  if (!args.check) out.push_back("--no-check");
  return out;
}

BenchReport run_cpu(const BenchOverlapArgs& args, const CpuOptions& cpu) {
  if (std::getenv("WORLD_SIZE")) {
    // Already a rank of a job (`caravan run -n W caravan bench overlap`): measure here.
    if (args.world != 0 && std::to_string(args.world) != std::getenv("WORLD_SIZE"))
      throw Error(Errc::invalid_argument, fmt::format("--world {}: this job has WORLD_SIZE={}", args.world, std::getenv("WORLD_SIZE")));
    nlohmann::json run = run_ranks_side(args, cpu);
    if (run.is_null()) {
      BenchReport silent;
      silent.printed = true;  // rank 0 prints the job's report
      return silent;
    }
    return make_report(run, args);
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int world = args.world != 0 ? args.world : std::clamp(cores, 2, 4);
  if (world < 1 || world > 64) throw Error(Errc::invalid_argument, fmt::format("--world {}: must be in [1, 64]", world));
  validate(args, cpu, world);
  kernels::check_overlap_settings();  // once here, as a usage error, not in every rank
  // The heap is allocated once per rank at start-up: size it for the whole run.
  std::vector<std::pair<std::string, std::string>> environment;
  const std::uint64_t need = heap_bytes_needed(args, cpu, world);
  if (settings::get_bytes("CARAVAN_SYMMETRIC_HEAP_BYTES") < need)
    environment.push_back({"CARAVAN_SYMMETRIC_HEAP_BYTES", std::to_string(need)});
  std::vector<std::string> rank_args = {"bench", "overlap-rank"};
  for (auto& a : rank_arguments(args, cpu)) rank_args.push_back(a);
  nlohmann::json run = run_self_as_ranks(world, cpu.nodes, rank_args, environment, "bench-overlap");
  return make_report(run, args);
}

BenchReport run_overlap_bench(const BenchOverlapArgs& args, const CpuOptions& cpu) {
  if (args.backend != "auto" && args.backend != "cpu" && args.backend != "gpu")
    throw Error(Errc::invalid_argument, fmt::format("--backend {}: expected auto, cpu or gpu", args.backend));
  // The GPU backend needs at least two GPUs (it measures collectives between them).
  const bool gpu_present = args.backend != "cpu" && probe_gpus().device_count > 1;
#ifdef CARAVAN_HAVE_OVERLAP_GPU
  if (args.backend == "gpu" || (args.backend == "auto" && gpu_present)) {
    // Checked before the first operation runs (minutes), not when the loop reaches the name.
    static constexpr std::array kGpuOperations = {"ag_gemm",   "gemm_rs",        "gemm_as",    "ll_allgather",
                                                  "allgather", "reduce_scatter", "all_scatter"};
    for (const auto& op : args.operations)
      if (std::find(kGpuOperations.begin(), kGpuOperations.end(), op) == kGpuOperations.end())
        throw Error(Errc::invalid_argument,
                    fmt::format("--op {}: expected ag_gemm, gemm_rs, gemm_as, ll_allgather, allgather, "
                                "reduce_scatter or all_scatter",
                                op));
    if (cpu.hidden_given || cpu.nodes_given)
      throw Error(Errc::invalid_argument,
                  fmt::format("{}: CPU backend only (the GPU backend's GEMMs are the Llama shapes or --shape)",
                              cpu.hidden_given ? "--hidden" : "--nodes"));
    const int status = run_bench_overlap_gpu(args);
    if (status != 0) throw Error(Errc::device, fmt::format("bench overlap: the GPU backend failed (status {})", status));
    BenchReport printed;
    printed.printed = true;  // the GPU backend printed (and wrote) its own report
    return printed;
  }
#else
  if (args.backend == "gpu")
    throw Error(Errc::invalid_argument,
                fmt::format("--backend gpu: this build has no GPU backend for bench overlap: {}; use --backend cpu",
                            no_gpu_kernels_reason()));
#endif
  BenchReport report = run_cpu(args, cpu);
#ifndef CARAVAN_HAVE_OVERLAP_GPU
  if (gpu_present && !report.printed)
    report.notes.push_back("a GPU is present but this build has no GPU backend for bench overlap (" +
                           no_gpu_kernels_reason() + "): ran on the CPU");
#endif
  return report;
}

void add_options(CLI::App& sub, BenchOverlapArgs& args, CpuOptions& cpu) {
  sub.add_option("--shape", args.shapes,
                 "GPU backend: GEMMs NAME:K:N (the whole weight, K x N; split over the ranks as Llama's are) measured by "
                 "ag_gemm, gemm_rs and gemm_as instead of the Llama shapes; repeatable");
  sub.add_option("--op", args.operations,
                 "Operations: ag_gemm, gemm_rs, gemm_as, ll_allgather, and on the GPU backend the collectives "
                 "alone against NCCL's: allgather, reduce_scatter, all_scatter (default: all)");
  sub.add_option("--tokens", args.tokens, "Token counts M (default per backend; CPU: 16 128 512, LL: 8 64)");
  sub.add_option("--iterations", args.iterations, "Timed launches per variant")->capture_default_str();
  sub.add_option("--warmup", args.warmup, "Untimed launches per variant first")->capture_default_str();
  sub.add_flag("--no-check", [&args](std::int64_t) { args.check = false; }, "Skip the float32 reference check");
  sub.add_flag("--stamps", args.stamps,
               "GPU backend, gemm_rs: also time nccl-bulk, sm-pull and sm-push phase by phase on the GPU clock "
               "(%globaltimer; a diagnostic: its marks add kernels of their own); gemm_rs and ag_gemm: print the "
               "timelines of the ce-ring variants and of AllGather+GEMM ce-push 2 lanes (device events: when each "
               "chunk's wait, GEMM and push ended)");
  sub.add_option("--hidden", cpu.hidden, "CPU backend: K = N of the GEMMs (and the LL row width)")
      ->capture_default_str()
      ->each([&cpu](const std::string&) { cpu.hidden_given = true; });
}

}  // namespace

void add_bench_overlap(CLI::App& bench) {
  CLI::App& sub = add_bench_case(bench, "overlap",
                                 "Overlapped collectives + GEMMs (AllGather+GEMM, GEMM+ReduceScatter, GEMM+All-Scatter, LL "
                                 "AllGather) vs the bulk-synchronous baseline",
                                 [] { return run_overlap_bench(g_args, g_cpu); });
  sub.add_option("--backend", g_args.backend, "auto (gpu when 2+ GPUs and the GPU backend are there), cpu or gpu")
      ->capture_default_str();
  sub.add_option("--world", g_args.world, "Ranks (GPUs); 0: CPU: the cores, clamped to [2, 4]; GPU: all")
      ->capture_default_str();
  sub.add_option("--nodes", g_cpu.nodes, "CPU backend: logical nodes the ranks are split into (2+: UCX between them)")
      ->capture_default_str()
      ->each([](const std::string&) { g_cpu.nodes_given = true; });
  add_options(sub, g_args, g_cpu);
  // What each rank of the CPU backend runs; not meant for users (no group: hidden).
  CLI::App* rank = bench.add_subcommand("overlap-rank", "One rank of `bench overlap` (internal)");
  rank->group("");
  add_options(*rank, g_rank_args, g_rank_cpu);
  rank->add_option("--out", g_rank_cpu.out)->required();
  rank->callback([] {
    nlohmann::json run = run_ranks_side(g_rank_args, g_rank_cpu);
    if (!run.is_null()) std::ofstream(g_rank_cpu.out) << run.dump();
  });
}

}  // namespace caravan::app
