// `caravan bench gemm`: the tile GEMM that consumes rows as their flags flip
// (kernels/gpu/flag_gemm*.cu; here with no flags and no done words) against cuBLAS on the same
// buffers, on GPU 0, the two alternating in one run. With every flag already raised it is a plain GEMM, so this
// measures what the tile variants of `bench overlap` pay for working tile by tile. Shapes: the GEMM each rank runs in
// AllGather + GEMM (the gathered M rows x K, times this rank's N / TP columns) and in GEMM + ReduceScatter (M x K / TP,
// times N) for the shapes of the measured reference, at the given token counts and tensor-parallel degrees.
//
// Checks: the tile GEMM's first rows (up to 1024) against the float32 reference on fresh random
// inputs, output poisoned first; and its whole output against cuBLAS's. Without a GPU, or in a
// build without the GPU kernels, it says why and skips.
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"

#include <caravan/error.h>
#include <caravan/kernels/bf16.h>
#include <caravan/platform.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#ifdef CARAVAN_HAVE_OVERLAP_GPU
#include "apps/caravan/bench_gpu_ranks.h"
#include "kernels/gpu/blas.h"
#include "kernels/gpu/kernels.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace caravan::app {
namespace {

struct GemmBenchOptions {
  std::vector<long> tokens{8192, 4096};
  std::vector<int> tensor_parallel{4, 2};
  int repetitions = 20;
  bool portable = false;
  bool persistent = false;
  bool check = true;
  int ring_parts = 0;  // > 0: also time the GEMM+ReduceScatter ring's GEMMs in this many parts
  int tune_candidates = 8;  // cuBLASLt candidates Blas::tune times for the "cuBLAS tuned" column
};
GemmBenchOptions g_gemm;

struct GemmShape {
  std::string name;
  long k_full, n_full;
  bool split_n;  // AllGather + GEMM: a rank has n_full / TP columns; GEMM + ReduceScatter: k_full / TP
  long k(int tp) const { return split_n ? k_full : k_full / tp; }
  long n(int tp) const { return split_n ? n_full / tp : n_full; }
};

// The shapes of the measured reference: AllGather + GEMM (bench overlap's ag_gemm) and GEMM +
// ReduceScatter (gemm_rs, whose GEMM tile_push runs).
const std::vector<GemmShape> kShapes = {
    {"llama3-70B mlp-up", 8192, 2L * 28672, true},    {"llama3-8B mlp-up", 4096, 2L * 14336, true},
    {"llama3-70B qkv", 8192, 8192L + 2 * 1024, true}, {"llama3-70B mlp-down", 28672, 8192, false},
    {"llama3-8B mlp-down", 14336, 4096, false},       {"llama3-70B o-proj", 8192, 8192, false}};

// Every option, checked before the run, so that a machine without a GPU (the benchmark skips
// there) refuses nonsense as one with a GPU does.
void validate_options(const GemmBenchOptions& o) {
  if (o.repetitions < 1)
    throw Error(Errc::invalid_argument, fmt::format("bench gemm: --reps {}: must be at least 1", o.repetitions));
  for (long t : o.tokens)
    if (t < 1) throw Error(Errc::invalid_argument, fmt::format("bench gemm: --tokens {}: must be at least 1", t));
  for (int tp : o.tensor_parallel)
    if (tp < 1) throw Error(Errc::invalid_argument, fmt::format("bench gemm: --tp {}: must be at least 1", tp));
  if (o.tune_candidates < 0 || o.tune_candidates > 64)
    throw Error(Errc::invalid_argument,
                fmt::format("bench gemm: --tune {}: must be 0 (no tuned column's tuning) to 64", o.tune_candidates));
  if (o.ring_parts < 0 || o.ring_parts > 64)
    throw Error(Errc::invalid_argument,
                fmt::format("bench gemm: --ring-parts {}: must be 0 (off) to 64", o.ring_parts));
  for (long t : o.tokens)
    for (int tp : o.tensor_parallel)
      if (o.ring_parts > 0 && tp > 1 && t % (static_cast<long>(tp) * o.ring_parts) != 0)
        throw Error(Errc::invalid_argument,
                    fmt::format("bench gemm: --ring-parts {}: --tokens {} must split into TP {} x {} parts of whole rows",
                                o.ring_parts, t, tp, o.ring_parts));
  for (const GemmShape& s : kShapes)
    for (int tp : o.tensor_parallel)
      if ((s.split_n ? s.n_full : s.k_full) % (8L * tp) != 0)
        throw Error(Errc::invalid_argument,
                    fmt::format("bench gemm: --tp {} does not split {}'s {} {} into multiples of 8", tp, s.name,
                                s.split_n ? s.n_full : s.k_full, s.split_n ? "columns" : "inner dimension"));
}

#ifdef CARAVAN_HAVE_OVERLAP_GPU
using gpu::bf16;

double error_of(const gpu::ErrorSums& s) { return s.ref2 > 0 ? std::sqrt(s.diff2 / s.ref2) : 1.0; }

BenchReport run_on_gpu() {
  BenchReport out;
  const GemmBenchOptions& o = g_gemm;  // validate_options() has checked them

  CARAVAN_HIP_CHECK(hipSetDevice(0));
  gpu::preload_kernels();
  gpu::preload_flag_gemm();
  hipStream_t stream = nullptr;
  CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&stream, hipStreamNonBlocking));
  long max_m = 0, max_k = 0, max_n = 0;
  for (long t : o.tokens) max_m = std::max(max_m, t);
  for (const GemmShape& s : kShapes)
    for (int tp : o.tensor_parallel) {
      max_k = std::max(max_k, s.k(tp));
      max_n = std::max(max_n, s.n(tp));
    }
  const long check_rows = std::min(1024L, max_m);
  const auto count = [](long a, long b) { return static_cast<std::size_t>(a) * static_cast<std::size_t>(b); };
  auto a = make_buffer<bf16>(count(max_m, max_k));
  auto b = make_buffer<bf16>(count(max_k, max_n));
  auto c_tile = make_buffer<bf16>(count(max_m, max_n));
  auto c_blas = make_buffer<bf16>(count(max_m, max_n));
  auto c_blas_f = make_buffer<float>(count(max_m, max_n));
  auto c_tuned = make_buffer<bf16>(count(max_m, max_n));
  auto a_f = make_buffer<float>(o.check ? count(check_rows, max_k) : 1);
  auto b_f = make_buffer<float>(o.check ? count(max_k, max_n) : 1);
  auto ref = make_buffer<float>(o.check ? count(check_rows, max_n) : 1);
  auto sums = make_buffer<gpu::ErrorSums>(1);
  // "cuBLAS": cuBLAS's own choice of kernel, as PyTorch calls it; "cuBLAS tuned": the fastest of
  // the candidates Blas::tune times (--tune of them), which Caravan's operations run unless
  // CARAVAN_GPU_GEMM_TUNE=0.
  gpu::Blas blas(stream, gpu::GemmTuning::off);
  gpu::Blas tuned_blas(stream);
  // The ring's GEMMs (--ring-parts): its partial, its slots (one per destination's rows) and out,
  // on two lanes, each a stream with a Blas of its own, as GemmReduceScatter's lanes are.
  const bool ring = o.ring_parts > 0;
  auto ring_partial = make_buffer<bf16>(ring ? count(max_m, max_n) : 1);
  auto ring_slots = make_buffer<bf16>(ring ? count(max_m, max_n) : 1);
  auto ring_out = make_buffer<bf16>(ring ? count(max_m, max_n) : 1);
  hipStream_t second_lane = nullptr;
  hipEvent_t fork = nullptr, join = nullptr;
  std::unique_ptr<gpu::Blas> second_blas;
  if (ring) {
    CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&second_lane, hipStreamNonBlocking));
    CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&fork, hipEventDisableTiming));
    CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&join, hipEventDisableTiming));
    second_blas = std::make_unique<gpu::Blas>(second_lane);
  }
  hipEvent_t start, stop;
  CARAVAN_HIP_CHECK(hipEventCreate(&start));
  CARAVAN_HIP_CHECK(hipEventCreate(&stop));
  std::mt19937_64 seeds(std::random_device{}());
  const auto timed = [&](auto&& call) {
    CARAVAN_HIP_CHECK(hipEventRecord(start, stream));
    call();
    CARAVAN_HIP_CHECK(hipEventRecord(stop, stream));
    CARAVAN_HIP_CHECK(hipEventSynchronize(stop));
    float ms = 0;
    CARAVAN_HIP_CHECK(hipEventElapsedTime(&ms, start, stop));
    return ms * 1e-3;
  };
  const auto fetch_error = [&]() {
    gpu::ErrorSums host;
    CARAVAN_HIP_CHECK(hipMemcpyAsync(&host, sums.get(), sizeof(host), hipMemcpyDefault, stream));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
    return host.nonfinite > 0 ? 1.0 : error_of(host);
  };

  // Kernels timed beside the best one, each a column of its own after "kernel".
  struct OtherKernel {
    gpu::FlagGemmKernel kernel;
    std::string column, key;
  };
  std::vector<OtherKernel> others;
  if (o.portable) others.push_back({gpu::FlagGemmKernel::portable, "portable (wmma)", "portable"});
  if (o.persistent) others.push_back({gpu::FlagGemmKernel::persistent, "persistent", "persistent"});
  std::vector<std::string> columns = {"shape",         "TP",        "M x K x N", "cuBLAS",        "cuBLAS tuned",
                                      "tuned speedup", "tile GEMM", "kernel",    "tile / cuBLAS", "TFLOP/s",
                                      "check"};
  constexpr long kOthersAt = 8;  // the other kernels' columns go before "kernel"
  for (std::size_t i = 0; i < others.size(); ++i)
    columns.insert(columns.begin() + kOthersAt + static_cast<long>(i), others[i].column);
  if (ring)
    for (const std::string& c : {fmt::format("ring x{} 1 lane", o.ring_parts), fmt::format("ring x{} 2 lanes", o.ring_parts),
                                 std::string("ring / cuBLAS (1, 2 lanes)")})
      columns.insert(columns.end() - 1, c);
  BenchTable table{"tile GEMM fed by flags (all raised) vs cuBLAS on GPU 0, ms per call (median, p10..p90)", columns};
  nlohmann::json results = nlohmann::json::array();
  std::string failures;
  double worst_error = 0, worst_ratio = 0, least_tuned = 1e30, most_tuned = 0;
  for (long m : o.tokens)
    for (int tp : o.tensor_parallel)
      for (const GemmShape& s : kShapes) {
        const long k = s.k(tp), n = s.n(tp);
        const std::uint64_t seed = seeds();
        gpu::fill_random(a.get(), m, k, k, seed, 0, 0, 1.0f, stream);
        gpu::fill_random(b.get(), k, n, n, seed + 1, 0, 0, 1.0f, stream);
        CARAVAN_HIP_CHECK(hipMemsetAsync(c_tile.get(), 0xff, count(m, n) * sizeof(bf16), stream));  // NaN
        const auto tile = [&] {
          gpu::flag_gemm(a.get(), k, b.get(), n, c_tile.get(), n, m, n, k, nullptr, 0, 0, nullptr, nullptr, 0, stream);
        };
        const auto other = [&](gpu::FlagGemmKernel kernel) {
          gpu::flag_gemm(a.get(), k, b.get(), n, c_tile.get(), n, m, n, k, nullptr, 0, 0, nullptr, nullptr, 0, stream,
                         kernel);
        };
        const auto vendor = [&] { blas.gemm(stream, m, n, k, a.get(), k, b.get(), n, c_blas.get(), n); };
        const gpu::TuneOptions tune_options{o.tune_candidates};
        const int tuned_candidates = tuned_blas.tune(m, n, k, k, n, n, 0.0f, false, tune_options);
        const gpu::GemmChoice tuned_choice = tuned_blas.choice(m, n, k, k, n, n);
        const auto tuned = [&] { tuned_blas.gemm(stream, m, n, k, a.get(), k, b.get(), n, c_tuned.get(), n); };
        // GemmReduceScatter's ce_ring on rank 0 without its pushes and flag waits: step t computes
        // the rows of destination (-t - 1) mod TP in parts, step 0 into the partial (beta 0), the
        // middle steps added in place into that destination's slot (beta 1), the last step (its own
        // rows) written to out as product + slot (gemm_add); chunk c on lane c mod lanes.
        const bool ring_shape = ring && !s.split_n && tp > 1;
        const long ring_rows = m / tp, part_rows = ring_shape ? ring_rows / o.ring_parts : 0;
        const auto ring_gemms = [&](int lanes) {
          if (lanes == 2) {
            CARAVAN_HIP_CHECK(hipEventRecord(fork, stream));
            CARAVAN_HIP_CHECK(hipStreamWaitEvent(second_lane, fork, 0));
          }
          int chunk = 0;
          for (int t = 0; t < tp; ++t) {
            const long d = (2L * tp - t - 1) % tp;
            for (int part = 0; part < o.ring_parts; ++part, ++chunk) {
              const bool second = lanes == 2 && chunk % 2 == 1;
              gpu::Blas& on_blas = second ? *second_blas : tuned_blas;
              hipStream_t on = second ? second_lane : stream;
              const long row0 = d * ring_rows + part * part_rows;
              const bf16* a_rows = a.get() + row0 * k;
              bf16* slot = ring_slots.get() + row0 * n;
              if (t == 0)
                on_blas.gemm(on, part_rows, n, k, a_rows, k, b.get(), n, ring_partial.get() + row0 * n, n);
              else if (t < tp - 1)
                on_blas.gemm(on, part_rows, n, k, a_rows, k, b.get(), n, slot, n, 1.0f);
              else
                on_blas.gemm_add(on, part_rows, n, k, a_rows, k, b.get(), n, slot, n,
                                 ring_out.get() + part * part_rows * n, n);
            }
          }
          if (lanes == 2) {
            CARAVAN_HIP_CHECK(hipEventRecord(join, second_lane));
            CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, join, 0));
          }
        };
        if (ring_shape) {  // values the middle steps add to stay finite; the ring's shapes tuned as the operation's
          CARAVAN_HIP_CHECK(hipMemsetAsync(ring_slots.get(), 0, count(m, n) * sizeof(bf16), stream));
          tuned_blas.tune(part_rows, n, k, k, n, n, 0.0f, false, tune_options);
          tuned_blas.tune(part_rows, n, k, k, n, n, 1.0f, false, tune_options);
          tuned_blas.tune(part_rows, n, k, k, n, n, 1.0f, true, tune_options);
        }
        double reference_error = -1;
        if (o.check) {  // the first rows against float32, before any other call writes c_tile
          tile();
          const long rows = std::min(check_rows, m);
          gpu::fill_random(a_f.get(), rows, k, k, seed, 0, 0, 1.0f, stream);
          gpu::fill_random(b_f.get(), k, n, n, seed + 1, 0, 0, 1.0f, stream);
          blas.gemm_reference(stream, rows, n, k, a_f.get(), k, b_f.get(), n, ref.get(), n);
          gpu::compare(c_tile.get(), rows, n, n, ref.get(), n, sums.get(), stream);
          reference_error = fetch_error();
        }
        std::vector<double> tile_s, vendor_s, tuned_s, ring_s[2];
        std::vector<std::vector<double>> other_s(others.size());
        for (int rep = -1; rep < o.repetitions; ++rep) {  // rep -1: warm-up
          const double v = timed(vendor);
          const double u = timed(tuned);
          const double t = timed(tile);
          std::vector<double> ts;
          for (const OtherKernel& x : others) ts.push_back(timed([&] { other(x.kernel); }));
          double rs[2] = {0, 0};
          for (int lanes = 1; ring_shape && lanes <= 2; ++lanes) rs[lanes - 1] = timed([&] { ring_gemms(lanes); });
          if (rep < 0) continue;
          for (int i = 0; ring_shape && i < 2; ++i) ring_s[i].push_back(rs[i]);
          vendor_s.push_back(v);
          tuned_s.push_back(u);
          tile_s.push_back(t);
          for (std::size_t i = 0; i < others.size(); ++i) other_s[i].push_back(ts[i]);
        }
        // Each kernel's output, whole, against cuBLAS's.
        gpu::to_float(c_blas.get(), c_blas_f.get(), count(m, n), stream);
        std::vector<double> other_difference;
        double worst_other = 0;
        for (const OtherKernel& x : others) {
          other(x.kernel);
          gpu::compare(c_tile.get(), m, n, n, c_blas_f.get(), n, sums.get(), stream);
          other_difference.push_back(fetch_error());
          worst_other = std::max(worst_other, other_difference.back());
        }
        tile();
        gpu::compare(c_tile.get(), m, n, n, c_blas_f.get(), n, sums.get(), stream);
        const double difference = fetch_error();
        CARAVAN_HIP_CHECK(hipMemsetAsync(c_tuned.get(), 0xff, count(m, n) * sizeof(bf16), stream));  // NaN
        tuned();
        gpu::compare(c_tuned.get(), m, n, n, c_blas_f.get(), n, sums.get(), stream);
        const double tuned_difference = fetch_error();
        // The ring's out (poisoned first) against cuBLAS's own rows plus what the slot for them
        // holds (random values, standing in for the peers' sum): the last step's sums land in the
        // right rows and add the slot.
        double ring_difference = 0;
        if (ring_shape) {
          const std::size_t own = count(ring_rows, n);
          gpu::fill_random(ring_slots.get(), ring_rows, n, n, seeds(), 0, 0, 4.0f, stream);
          CARAVAN_HIP_CHECK(hipMemsetAsync(ring_out.get(), 0xff, own * sizeof(bf16), stream));
          ring_gemms(2);
          std::vector<std::uint16_t> got(own), slot(own);
          std::vector<float> product(own);
          CARAVAN_HIP_CHECK(hipMemcpyAsync(got.data(), ring_out.get(), own * 2, hipMemcpyDefault, stream));
          CARAVAN_HIP_CHECK(hipMemcpyAsync(slot.data(), ring_slots.get(), own * 2, hipMemcpyDefault, stream));
          CARAVAN_HIP_CHECK(hipMemcpyAsync(product.data(), c_blas_f.get(), own * 4, hipMemcpyDefault, stream));
          CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
          const auto to_float = [](std::uint16_t bits) { return kernels::Bf16{bits}.to_float(); };
          double diff2 = 0, ref2 = 0;
          bool finite = true;
          for (std::size_t i = 0; i < own; ++i) {
            const double want = static_cast<double>(product[i]) + to_float(slot[i]), have = to_float(got[i]);
            finite = finite && std::isfinite(have);
            diff2 += (have - want) * (have - want);
            ref2 += want * want;
          }
          ring_difference = !finite || ref2 == 0 ? 1.0 : std::sqrt(diff2 / ref2);
        }
        const Summary ts = summarize(tile_s), vs = summarize(vendor_s), us = summarize(tuned_s);
        const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
        const bool ok = difference < 1e-2 && reference_error < 1e-2 && worst_other < 1e-2 && ring_difference < 1e-2 &&
                        tuned_difference < 1e-2;
        worst_error =
            std::max({worst_error, difference, reference_error, worst_other, ring_difference, tuned_difference});
        std::string others_text = fmt::format(", tuned {:.1e}", tuned_difference);
        if (ring_shape) others_text += fmt::format(", ring {:.1e}", ring_difference);
        for (std::size_t i = 0; i < others.size(); ++i)
          others_text += fmt::format(", {} {:.1e}", others[i].key, other_difference[i]);
        worst_ratio = std::max(worst_ratio, ts.median / vs.median);
        least_tuned = std::min(least_tuned, vs.median / us.median);
        most_tuned = std::max(most_tuned, vs.median / us.median);
        const std::string kernel = gpu::flag_gemm_kernel_name(m, n, n);
        if (!ok)
          failures += fmt::format("{}{} TP {} M {}: vs float32 {:.2e}, vs cuBLAS {:.2e}{}", failures.empty() ? "" : "; ",
                                  s.name, tp, m, reference_error, difference, others_text);
        std::vector<std::string> row = {
            s.name,
            std::to_string(tp),
            fmt::format("{}x{}x{}", m, k, n),
            fmt::format("{:.3f} ({:.3f}..{:.3f})", vs.median * 1e3, vs.p10 * 1e3, vs.p90 * 1e3),
            fmt::format("{:.3f} ({:.3f}..{:.3f}){}", us.median * 1e3, us.p10 * 1e3, us.p90 * 1e3,
                        tuned_choice == gpu::GemmChoice::algorithm        ? ""
                        : tuned_choice == gpu::GemmChoice::vendor_default ? " (default kept)"
                                                                          : " (not tuned)"),
            fmt::format("{:.3f}x", vs.median / us.median),
            fmt::format("{:.3f} ({:.3f}..{:.3f})", ts.median * 1e3, ts.p10 * 1e3, ts.p90 * 1e3),
            kernel,
            fmt::format("{:.2f}x", ts.median / vs.median),
            fmt::format("{:.0f}", flops / ts.median / 1e12),
            fmt::format("{} (f32 {}, cuBLAS {:.1e}{})", ok ? "ok" : "FAIL",
                        reference_error < 0 ? std::string("-") : fmt::format("{:.1e}", reference_error), difference,
                        others_text)};
        nlohmann::json result = {{"shape", s.name},
                                 {"tp", tp},
                                 {"m", m},
                                 {"k", k},
                                 {"n", n},
                                 {"kernel", kernel},
                                 {"cublas_s", vendor_s},
                                 {"cublas_tuned_s", tuned_s},
                                 {"tuned_speedup", vs.median / us.median},
                                 {"tuned_candidates", tuned_candidates},
                                 {"tuned_choice", tuned_choice == gpu::GemmChoice::algorithm ? "cublaslt algorithm"
                                                  : tuned_choice == gpu::GemmChoice::vendor_default ? "cublas default"
                                                                                                    : "untuned"},
                                 {"difference_tuned_vs_cublas", tuned_difference},
                                 {"tile_s", tile_s},
                                 {"tile_over_cublas", ts.median / vs.median},
                                 {"tile_tflops", flops / ts.median / 1e12},
                                 {"error_vs_float32", reference_error},
                                 {"difference_vs_cublas", difference}};
        for (std::size_t i = 0; i < others.size(); ++i) {
          const Summary ps = summarize(other_s[i]);
          row.insert(row.begin() + kOthersAt + static_cast<long>(i),
                     fmt::format("{:.3f} ({:.3f}..{:.3f})", ps.median * 1e3, ps.p10 * 1e3, ps.p90 * 1e3));
          result[others[i].key + "_s"] = other_s[i];
          result[others[i].key + "_difference_vs_cublas"] = other_difference[i];
        }
        if (ring) {
          std::vector<std::string> cells = {"-", "-", "-"};
          if (ring_shape) {
            const Summary r1 = summarize(ring_s[0]), r2 = summarize(ring_s[1]);
            cells = {fmt::format("{:.3f} ({:.3f}..{:.3f})", r1.median * 1e3, r1.p10 * 1e3, r1.p90 * 1e3),
                     fmt::format("{:.3f} ({:.3f}..{:.3f})", r2.median * 1e3, r2.p10 * 1e3, r2.p90 * 1e3),
                     fmt::format("{:.2f}x, {:.2f}x", r1.median / us.median, r2.median / us.median)};
            result["ring_parts"] = o.ring_parts;
            result["ring_1_lane_s"] = ring_s[0];
            result["ring_2_lanes_s"] = ring_s[1];
            result["ring_difference_vs_cublas"] = ring_difference;
          }
          row.insert(row.end() - 1, cells.begin(), cells.end());
        }
        table.rows.push_back(std::move(row));
        results.push_back(std::move(result));
        fmt::print(stderr, "bench gemm: {} TP {} M {}: tile / cuBLAS {:.2f}x ({})\n", s.name, tp, m,
                   ts.median / vs.median, kernel);
      }
  CARAVAN_HIP_CHECK(hipEventDestroy(start));
  CARAVAN_HIP_CHECK(hipEventDestroy(stop));
  if (ring) {
    second_blas.reset();  // before its stream
    CARAVAN_HIP_CHECK(hipStreamDestroy(second_lane));
    CARAVAN_HIP_CHECK(hipEventDestroy(fork));
    CARAVAN_HIP_CHECK(hipEventDestroy(join));
  }
  CARAVAN_HIP_CHECK(hipStreamDestroy(stream));
  out.tables.push_back(std::move(table));
  if (ring)
    out.notes.push_back(fmt::format(
        "ring x{0}: GemmReduceScatter's ce_ring GEMMs on one GPU without its pushes: TP x {0} cuBLAS calls of "
        "M / TP / {0} rows (the first step's beta 0, the middle steps' beta 1 in place, the last step's own rows "
        "as product + slot through cuBLASLt), on 1 lane or alternating over 2, each shape tuned as the operation's; "
        "what chunking costs the GEMM before any communication (ring / cuBLAS: against the tuned whole GEMM; TP 1 "
        "has no ring); checked: the last step's rows against cuBLAS's plus the slot's (random) values",
        o.ring_parts));
  out.notes.push_back(fmt::format(
      "{} timed calls of each after one warm-up, alternating; M = tokens; mlp-up and qkv "
      "(AllGather + GEMM): N = the full width / TP; mlp-down and o-proj (GEMM + "
      "ReduceScatter): K = the full inner dimension / TP; tile / cuBLAS = median / median; cuBLAS tuned: "
      "the fastest of cuBLAS's default and cuBLASLt's first --tune = {} candidates, timed "
      "once per shape before these calls (default kept: none was 1% faster), tuned speedup = cuBLAS / cuBLAS "
      "tuned, medians",
      o.repetitions, o.tune_candidates));
  out.notes.push_back(
      o.check ? fmt::format("check: the tile GEMM's first {} rows vs the float32 reference (fresh random inputs, "
                            "output poisoned first), and each kernel's whole output vs cuBLAS's; relative error "
                            "below 1e-2",
                            check_rows)
              : std::string("check: each kernel's whole output vs cuBLAS's, relative error below 1e-2 (--no-check: "
                            "no float32 reference)"));
  out.headlines.push_back(fmt::format(
      "slowest tile GEMM {:.2f}x cuBLAS; tuned cuBLAS {:.3f}-{:.3f}x cuBLAS's default; worst relative error "
      "{:.1e}",
      worst_ratio, least_tuned, most_tuned, worst_error));
  out.figures = {{"results", results}};
  out.failure = failures;
  return out;
}
#endif

#ifdef CARAVAN_HAVE_OVERLAP_GPU
BenchReport (*const kOnGpu)() = run_on_gpu;
#else
BenchReport (*const kOnGpu)() = nullptr;
#endif
BenchReport run_gemm_bench() {
  validate_options(g_gemm);
  return run_on_gpu_or_skip(kOnGpu);
}

}  // namespace

void add_bench_gemm(CLI::App& bench) {
  CLI::App& c = add_bench_case(
      bench, "gemm", "the tile GEMM fed by flags vs cuBLAS on AllGather+GEMM and GEMM+ReduceScatter shapes, on GPU 0",
      run_gemm_bench);
  c.add_option("--tokens", g_gemm.tokens, "Token counts (M, the gathered rows)")->capture_default_str();
  c.add_option("--tp", g_gemm.tensor_parallel,
               "Tensor-parallel degrees: N (or K, for mlp-down and o-proj) = the full size / TP")
      ->capture_default_str();
  c.add_option("--reps", g_gemm.repetitions, "Timed calls of each")->capture_default_str();
  c.add_flag("--portable", g_gemm.portable, "Also time the portable WMMA kernel (slow: about 7x cuBLAS)");
  c.add_flag("--persistent", g_gemm.persistent,
             "Also time the persistent Hopper kernel (one block per SM, stores beside the next tile's products)");
  c.add_flag("!--no-check", g_gemm.check, "Skip the float32 reference check");
  c.add_option("--tune", g_gemm.tune_candidates,
               "cuBLASLt candidates timed per shape for the 'cuBLAS tuned' column (Blas::tune; the operations tune "
               "with CARAVAN_GPU_GEMM_TUNE); 0: none, the column repeats cuBLAS's default")
      ->capture_default_str();
  c.add_option("--ring-parts", g_gemm.ring_parts,
               "Also time the GEMM+ReduceScatter ring's cuBLAS calls (ce_ring, no pushes) in this many parts per "
               "destination, on 1 and 2 lanes, for mlp-down and o-proj (0: off)")
      ->capture_default_str();
}

}  // namespace caravan::app
