// `caravan bench gpu-tasks`: what running work as tasks on a GPU processor costs, beside the
// same work issued with raw HIP calls in the same run:
//   - a chain of dependent tasks (each a 4-byte memset, ordered by events) against a loop of
//     memset + stream synchronize on one stream;
//   - independent tasks against the same memsets issued back to back on one stream;
//   - a high-priority task behind a backlog of large low-priority ones, against its time alone,
//     beside raw streams of the same priorities.
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"

#include <caravan/caravan.h>
#include <caravan/platform.h>

#if CARAVAN_HAVE_GPU
#include "runtime/gpu/devices.h"
#include "runtime/gpu/platform.h"
#endif

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

namespace caravan::app {
namespace {

struct GpuTasksOptions {
  int tasks = 2000;
  int repetitions = 7;
  int device = 0;
  std::string backlog_size = "1G";
  int backlog = 16;
  std::string urgent_size = "64M";
};
GpuTasksOptions g_options;

// Every option that needs no GPU to check, checked before the run, so that a machine without a
// GPU (the benchmark skips there) refuses nonsense as one with a GPU does. Returns the two sizes.
std::pair<std::uint64_t, std::uint64_t> validate_options(const GpuTasksOptions& o) {
  if (o.tasks <= 0) throw Error(Errc::invalid_argument, fmt::format("--tasks {}: must be at least 1", o.tasks));
  if (o.repetitions <= 0)
    throw Error(Errc::invalid_argument, fmt::format("--reps {}: must be at least 1", o.repetitions));
  if (o.backlog <= 0) throw Error(Errc::invalid_argument, fmt::format("--backlog {}: must be at least 1", o.backlog));
  if (o.device < 0) throw Error(Errc::invalid_argument, fmt::format("--gpu {}: must be at least 0", o.device));
  return {parse_size(o.backlog_size, "--backlog-size"), parse_size(o.urgent_size, "--urgent-size")};
}

#if CARAVAN_HAVE_GPU

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

struct Memset {
  void* ptr;
  std::uint64_t bytes;
  int value;
  // When set, the body stores when it started (steady clock, ns): splits an urgent task's time
  // into waiting to be launched and the rest (its GPU work and the report of its completion).
  std::int64_t* body_started = nullptr;
};

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

TaskId memset_task() {
  static TaskId id = [] {
    try {
      return register_task("caravan.bench.gpu_memset", [](TaskContext& ctx) {
        auto m = ctx.args_as<Memset>();
        if (m.body_started) *m.body_started = now_ns();
        CARAVAN_HIP_CHECK(hipMemsetAsync(m.ptr, m.value, m.bytes, static_cast<hipStream_t>(ctx.gpu_stream)));
      });
    } catch (const Error&) {
      return find_task("caravan.bench.gpu_memset");
    }
  }();
  return id;
}

// A raw stream of the device's lowest (high = false) or highest stream priority.
struct RawStream {
  hipStream_t stream = nullptr;
  RawStream(int device, bool high) {
    CARAVAN_HIP_CHECK(hipSetDevice(device));
    int least = 0, greatest = 0;
    CARAVAN_HIP_CHECK(hipDeviceGetStreamPriorityRange(&least, &greatest));
    CARAVAN_HIP_CHECK(hipStreamCreateWithPriority(&stream, hipStreamNonBlocking, high ? greatest : least));
  }
  ~RawStream() { (void)hipStreamDestroy(stream); }
  RawStream(const RawStream&) = delete;
  RawStream& operator=(const RawStream&) = delete;
};

std::vector<std::string> us_row(const std::string& name, const Summary& s, double scale = 1e6) {
  return {name, fmt::format("{:.2f}", s.median * scale), fmt::format("{:.2f}", s.p10 * scale),
          fmt::format("{:.2f}", s.p90 * scale)};
}

nlohmann::json summary_json(const Summary& s) {
  return {{"median", s.median}, {"p10", s.p10}, {"p90", s.p90}, {"min", s.min}, {"max", s.max}, {"count", s.count}};
}

BenchReport run_gpu_tasks_bench() {
  BenchReport out;
  const GpuTasksOptions& o = g_options;
  const std::pair<std::uint64_t, std::uint64_t> sizes = validate_options(o);
  const std::uint64_t backlog_bytes = sizes.first, urgent_bytes = sizes.second;
  GpuProbe probe = probe_gpus();
  if (probe.device_count == 0) {
    out.headlines.push_back("skipped: " + no_gpu_reason(probe));
    out.figures = {{"skipped", true}, {"reason", no_gpu_reason(probe)}};
    return out;
  }
  if (o.device < 0 || o.device >= probe.device_count)
    throw Error(Errc::invalid_argument, fmt::format("--gpu {}: this machine has GPUs 0..{}", o.device, probe.device_count - 1));

  Runtime rt;
  const Processor where{ProcessorKind::gpu, Processor::kThisRank, static_cast<std::uint16_t>(o.device)};
  const TaskId task = memset_task();
  void* word = gpu::allocate_device(o.device, 256);
  void* backlog_buffer = gpu::allocate_device(o.device, backlog_bytes);
  void* urgent_buffer = gpu::allocate_device(o.device, urgent_bytes);
  RawStream low(o.device, false), high(o.device, true);
  const Memset small{word, 4, 1};

  // Warm-up: starts the processor and its streams, the memset kernels, the event pool.
  {
    std::vector<Event> warm;
    for (int i = 0; i < 64; ++i) warm.push_back(rt.spawn(task, task_args(small), SpawnOptions{.processor = where}));
    merge_events(warm).wait();
    CARAVAN_HIP_CHECK(hipMemsetAsync(word, 1, 4, low.stream));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(low.stream));
  }

  // Per task, seconds; the two implementations alternate so that drift hits both alike.
  std::vector<double> chain_caravan, chain_gpu_ordered, chain_raw, many_caravan, many_raw;
  for (int r = 0; r < o.repetitions; ++r) {
    auto start = Clock::now();
    Event previous;
    for (int i = 0; i < o.tasks; ++i)
      previous = rt.spawn(task, task_args(small), SpawnOptions{.precondition = previous, .processor = where});
    previous.wait();
    chain_caravan.push_back(seconds_since(start) / o.tasks);

    start = Clock::now();
    previous = Event{};
    for (int i = 0; i < o.tasks; ++i)
      previous = rt.spawn(task, task_args(small), SpawnOptions{.precondition = previous, .processor = where, .order_on_gpu = true});
    previous.wait();
    chain_gpu_ordered.push_back(seconds_since(start) / o.tasks);

    start = Clock::now();
    for (int i = 0; i < o.tasks; ++i) {
      CARAVAN_HIP_CHECK(hipMemsetAsync(word, 1, 4, low.stream));
      CARAVAN_HIP_CHECK(hipStreamSynchronize(low.stream));
    }
    chain_raw.push_back(seconds_since(start) / o.tasks);

    start = Clock::now();
    std::vector<Event> all;
    all.reserve(static_cast<std::size_t>(o.tasks));
    for (int i = 0; i < o.tasks; ++i) all.push_back(rt.spawn(task, task_args(small), SpawnOptions{.processor = where}));
    merge_events(all).wait();
    many_caravan.push_back(seconds_since(start) / o.tasks);

    start = Clock::now();
    for (int i = 0; i < o.tasks; ++i) CARAVAN_HIP_CHECK(hipMemsetAsync(word, 1, 4, low.stream));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(low.stream));
    many_raw.push_back(seconds_since(start) / o.tasks);
  }

  // Priority: the urgent memset spawned right after `backlog` large ones, with priorities
  // (10 over -10) and without (all 0), beside raw streams of the highest and lowest priority.
  std::vector<double> urgent_caravan, urgent_launch, urgent_caravan_flat, urgent_alone_raw, urgent_loaded_raw;
  std::int64_t urgent_body_started = 0;
  const Memset urgent{urgent_buffer, urgent_bytes, 2, &urgent_body_started}, big{backlog_buffer, backlog_bytes, 3};
  auto caravan_urgent = [&](int urgent_priority, int backlog_priority, double* launch_seconds) {
    std::vector<Event> backlog;
    for (int i = 0; i < o.backlog; ++i)
      backlog.push_back(rt.spawn(task, task_args(big), SpawnOptions{.priority = backlog_priority, .processor = where}));
    const std::int64_t start_ns = now_ns();
    auto start = Clock::now();
    rt.spawn(task, task_args(urgent), SpawnOptions{.priority = urgent_priority, .processor = where}).wait();
    double seconds = seconds_since(start);
    // Written by the body before the completion triggered, which wait() synchronizes with.
    if (launch_seconds) *launch_seconds = static_cast<double>(urgent_body_started - start_ns) * 1e-9;
    merge_events(backlog).wait();
    return seconds;
  };
  for (int r = 0; r < o.repetitions; ++r) {
    double launch_seconds = 0;
    urgent_caravan.push_back(caravan_urgent(10, -10, &launch_seconds));
    urgent_launch.push_back(launch_seconds);
    urgent_caravan_flat.push_back(caravan_urgent(0, 0, nullptr));

    auto start = Clock::now();
    CARAVAN_HIP_CHECK(hipMemsetAsync(urgent_buffer, 2, urgent_bytes, high.stream));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(high.stream));
    urgent_alone_raw.push_back(seconds_since(start));

    for (int i = 0; i < o.backlog; ++i) CARAVAN_HIP_CHECK(hipMemsetAsync(backlog_buffer, 3, backlog_bytes, low.stream));
    start = Clock::now();
    CARAVAN_HIP_CHECK(hipMemsetAsync(urgent_buffer, 2, urgent_bytes, high.stream));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(high.stream));
    urgent_loaded_raw.push_back(seconds_since(start));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(low.stream));
  }
  gpu::free_device(word);
  gpu::free_device(backlog_buffer);
  gpu::free_device(urgent_buffer);

  const Summary cc = summarize(chain_caravan), cg = summarize(chain_gpu_ordered), cr = summarize(chain_raw),
                mc = summarize(many_caravan), mr = summarize(many_raw), uc = summarize(urgent_caravan),
                ul = summarize(urgent_launch), uf = summarize(urgent_caravan_flat), uar = summarize(urgent_alone_raw), ulr = summarize(urgent_loaded_raw);
  BenchTable per_task{fmt::format("Per task on gpu{}, microseconds ({} tasks x {} runs, a 4-byte memset each)", o.device,
                                  o.tasks, o.repetitions),
                      {"case", "median", "p10", "p90"},
                      {}};
  per_task.rows.push_back(us_row("caravan: chain, each task after the one before", cc));
  per_task.rows.push_back(us_row("caravan: the same chain ordered on the GPU (order_on_gpu)", cg));
  per_task.rows.push_back(us_row("raw: memset + hipStreamSynchronize per step", cr));
  per_task.rows.push_back(us_row("caravan: independent tasks", mc));
  per_task.rows.push_back(us_row("raw: memsets back to back on one stream", mr));
  out.tables.push_back(per_task);
  BenchTable priority{fmt::format("A {} memset spawned right after {} x {}, milliseconds from spawn to completion",
                                  fmt_size(urgent_bytes), o.backlog, fmt_size(backlog_bytes)),
                      {"case", "median", "p10", "p90"},
                      {}};
  priority.rows.push_back(us_row("caravan: priority 10 after a backlog of -10", uc, 1e3));
  priority.rows.push_back(us_row("  of which spawn to the start of its body", ul, 1e3));
  priority.rows.push_back(us_row("caravan: every task of priority 0", uf, 1e3));
  priority.rows.push_back(us_row("raw: highest-priority stream after the backlog on the lowest", ulr, 1e3));
  priority.rows.push_back(us_row("raw: highest-priority stream, no backlog", uar, 1e3));
  out.tables.push_back(priority);

  out.headlines.push_back(fmt::format("dependent chain: caravan {:.1f} us per task ({:.1f} us ordered on the GPU) vs raw "
                                      "memset+sync {:.1f} us: {:.2f}x ({:.2f}x) the raw time",
                                      cc.median * 1e6, cg.median * 1e6, cr.median * 1e6, cc.median / cr.median,
                                      cg.median / cr.median));
  out.headlines.push_back(fmt::format("independent tasks: caravan {:.2f} us per task vs raw back-to-back memsets {:.2f} us: {:.2f}x",
                                      mc.median * 1e6, mr.median * 1e6, mc.median / mr.median));
  out.headlines.push_back(fmt::format("urgent task behind the backlog: caravan {:.3f} ms with priorities, {:.3f} ms without; "
                                      "raw prioritized streams {:.3f} ms ({:.2f}x raw)",
                                      uc.median * 1e3, uf.median * 1e3, ulr.median * 1e3, uc.median / ulr.median));
  out.notes.push_back("a ratio above 1 is slower than the raw HIP calls; per-task figures include the host's launch cost");
  out.figures = {{"device", o.device},
                 {"tasks", o.tasks},
                 {"chain_s", {{"caravan", summary_json(cc)}, {"caravan_order_on_gpu", summary_json(cg)}, {"raw", summary_json(cr)}}},
                 {"independent_s", {{"caravan", summary_json(mc)}, {"raw", summary_json(mr)}}},
                 {"urgent_s",
                  {{"caravan_prioritized", summary_json(uc)}, {"caravan_prioritized_spawn_to_body", summary_json(ul)},
                   {"caravan_flat", summary_json(uf)},
                   {"raw_loaded", summary_json(ulr)}, {"raw_alone", summary_json(uar)}}}};
  return out;
}

#else

BenchReport run_gpu_tasks_bench() {
  validate_options(g_options);
  BenchReport out;
  out.headlines.push_back("skipped: " + probe_gpus().reason);
  out.figures = {{"skipped", true}, {"reason", probe_gpus().reason}};
  return out;
}

#endif

}  // namespace

void add_bench_gpu_tasks(CLI::App& bench) {
  CLI::App& sub = add_bench_case(bench, "gpu-tasks",
                                 "Tasks on a GPU processor vs the same memsets issued with raw HIP calls",
                                 run_gpu_tasks_bench);
  sub.add_option("--tasks", g_options.tasks, "Tasks per run (chain and independent cases)")->capture_default_str();
  sub.add_option("--reps", g_options.repetitions, "Runs of each case")->capture_default_str();
  sub.add_option("--gpu", g_options.device, "The GPU whose processor runs the tasks")->capture_default_str();
  sub.add_option("--backlog", g_options.backlog, "Low-priority tasks queued before the urgent one")->capture_default_str();
  sub.add_option("--backlog-size", g_options.backlog_size, "Bytes each low-priority task sets")->capture_default_str();
  sub.add_option("--urgent-size", g_options.urgent_size, "Bytes the urgent task sets")->capture_default_str();
}

}  // namespace caravan::app
