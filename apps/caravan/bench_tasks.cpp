// `caravan bench tasks`: empty-task throughput and event wake-up latency, each beside a plain
// std::thread + condition-variable implementation of the same work measured in the same run.
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"

#include <caravan/caravan.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace caravan::app {
namespace {

using Clock = std::chrono::steady_clock;

struct TasksOptions {
  int tasks = 1'000'000;
  int repetitions = 5;
  int workers = 0;  // 0: CARAVAN_CPU_WORKERS
  int wakeups = 2000;
};
TasksOptions g_options;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The baseline: what one writes with the standard library alone. A locked deque of
// std::function, one notify per submitted task, a counter for completion.
class PlainPool {
 public:
  explicit PlainPool(int workers) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~PlainPool() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void submit(std::function<void()> fn) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(fn));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

double plain_pool_tasks_per_second(int workers, int tasks) {
  PlainPool pool(workers);
  std::mutex done_mutex;
  std::condition_variable done_cv;
  std::atomic<int> done{0};
  auto start = Clock::now();
  for (int i = 0; i < tasks; ++i) {
    pool.submit([&] {
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == tasks) {
        std::lock_guard lock(done_mutex);
        done_cv.notify_all();
      }
    });
  }
  std::unique_lock lock(done_mutex);
  done_cv.wait(lock, [&] { return done.load() == tasks; });
  return tasks / seconds_since(start);
}

double caravan_tasks_per_second(Runtime& rt, TaskId empty, int tasks) {
  std::vector<Event> events(static_cast<std::size_t>(tasks));
  auto start = Clock::now();
  for (int i = 0; i < tasks; ++i) events[static_cast<std::size_t>(i)] = rt.spawn(empty);
  for (const Event& e : events) e.wait();
  return tasks / seconds_since(start);
}

// Trigger-to-wake latency, in microseconds. One long-lived waiter thread; per sample it
// announces that it is about to wait, the main thread waits `delay` more, notes the time and
// triggers; the waiter notes the time when its wait returns. Thread start-up is outside the
// measurement, and the trigger never comes before the wait has begun.
template <class Round>
std::vector<double> measure_wakeups(int count, std::chrono::microseconds delay, Round& round) {
  std::vector<double> samples;
  samples.reserve(static_cast<std::size_t>(count));
  std::atomic<int> phase{0};  // per sample: 1 = armed, 2 = waiter about to wait, 3 = woke
  std::atomic<std::int64_t> woke_at{0};
  std::atomic<bool> quit{false};
  std::thread waiter([&] {
    for (;;) {
      while (phase.load(std::memory_order_acquire) != 1) {
        if (quit.load()) return;
        std::this_thread::yield();
      }
      phase.store(2, std::memory_order_release);
      round.wait();
      woke_at.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
      phase.store(3, std::memory_order_release);
    }
  });
  for (int i = 0; i < count; ++i) {
    round.arm();
    phase.store(1, std::memory_order_release);
    while (phase.load(std::memory_order_acquire) != 2) std::this_thread::yield();
    auto until = Clock::now() + delay;
    while (Clock::now() < until) {
      if (delay > std::chrono::microseconds(50)) std::this_thread::sleep_until(until);
    }
    std::int64_t triggered_at = Clock::now().time_since_epoch().count();
    round.fire();
    while (phase.load(std::memory_order_acquire) != 3) std::this_thread::yield();
    samples.push_back(static_cast<double>(woke_at.load() - triggered_at) / 1000.0);
    phase.store(0, std::memory_order_release);
  }
  quit = true;
  waiter.join();
  return samples;
}

struct CaravanRound {
  UserEvent event;
  void arm() { event = UserEvent::create(); }
  void wait() { event.wait(); }
  void fire() { event.trigger(); }
};

struct PlainRound {
  std::mutex mutex;
  std::condition_variable cv;
  bool ready = false;
  void arm() {
    std::lock_guard lock(mutex);
    ready = false;
  }
  void wait() {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return ready; });
  }
  void fire() {
    {
      std::lock_guard lock(mutex);
      ready = true;
    }
    cv.notify_one();
  }
};

std::vector<double> caravan_wakeups(int count, std::chrono::microseconds delay) {
  CaravanRound round;
  return measure_wakeups(count, delay, round);
}

std::vector<double> plain_wakeups(int count, std::chrono::microseconds delay) {
  PlainRound round;
  return measure_wakeups(count, delay, round);
}

std::string fmt_us(double us) { return fmt::format("{:.2f}", us); }

BenchReport run_tasks_bench() {
  const TasksOptions& o = g_options;
  if (o.tasks <= 0) throw Error(Errc::invalid_argument, fmt::format("--tasks {}: must be at least 1", o.tasks));
  if (o.repetitions <= 0) throw Error(Errc::invalid_argument, fmt::format("--reps {}: must be at least 1", o.repetitions));
  if (o.workers < 0 || o.workers > 4096)
    throw Error(Errc::invalid_argument, fmt::format("--workers {}: must be in [0, 4096] (0: the setting)", o.workers));
  if (o.wakeups <= 0) throw Error(Errc::invalid_argument, fmt::format("--wakeups {}: must be at least 1", o.wakeups));

  static TaskId empty = [] {
    try {
      return register_task("caravan.bench.empty", [](TaskContext&) {});
    } catch (const Error&) {
      return find_task("caravan.bench.empty");
    }
  }();
  RuntimeOptions runtime_options;
  if (o.workers > 0) runtime_options.cpu_workers = o.workers;
  Runtime rt(runtime_options);
  int workers = rt.cpu_worker_count();

  // Interleave the two implementations so that drift in machine load hits both alike.
  std::vector<double> caravan_rates, plain_rates;
  caravan_tasks_per_second(rt, empty, std::min(o.tasks, 10000));  // warm-up: grow the event table
  for (int r = 0; r < o.repetitions; ++r) {
    caravan_rates.push_back(caravan_tasks_per_second(rt, empty, o.tasks));
    plain_rates.push_back(plain_pool_tasks_per_second(workers, o.tasks));
    // Progress on standard error (a default run takes seconds; the report goes to stdout).
    fmt::print(stderr, "bench tasks: run {} of {}: caravan {:.2f} M tasks/s, plain pool {:.2f}\n", r + 1, o.repetitions,
               caravan_rates.back() / 1e6, plain_rates.back() / 1e6);
  }
  fmt::print(stderr, "bench tasks: wake-up latency, {} waits of each kind\n", o.wakeups);
  Summary caravan_rate = summarize(caravan_rates), plain_rate = summarize(plain_rates);

  // Parked: the waiter has long since gone to sleep in the kernel (worst case).
  // Active: the trigger comes 5 us after the wait starts, inside the wait's polling window.
  auto parked_delay = std::chrono::microseconds(300);
  auto active_delay = std::chrono::microseconds(5);
  Summary caravan_parked = summarize(caravan_wakeups(o.wakeups, parked_delay));
  Summary plain_parked = summarize(plain_wakeups(o.wakeups, parked_delay));
  Summary caravan_active = summarize(caravan_wakeups(o.wakeups, active_delay));
  Summary plain_active = summarize(plain_wakeups(o.wakeups, active_delay));

  BenchReport report;
  BenchTable throughput{fmt::format("Empty tasks, spawn to completion ({} tasks x {} runs, {} workers)", o.tasks,
                                    o.repetitions, workers),
                        {"implementation", "median M tasks/s", "p10", "p90", "min", "max"},
                        {}};
  auto rate_row = [](const std::string& name, const Summary& s) {
    return std::vector<std::string>{name, fmt::format("{:.3f}", s.median / 1e6), fmt::format("{:.3f}", s.p10 / 1e6),
                                    fmt::format("{:.3f}", s.p90 / 1e6), fmt::format("{:.3f}", s.min / 1e6),
                                    fmt::format("{:.3f}", s.max / 1e6)};
  };
  throughput.rows.push_back(rate_row("caravan (events, priorities)", caravan_rate));
  throughput.rows.push_back(rate_row("plain std::thread + cv pool", plain_rate));
  report.tables.push_back(throughput);

  BenchTable wake{fmt::format("Trigger-to-wake latency, microseconds ({} samples each)", o.wakeups),
                  {"case", "median", "p10", "p90", "max"},
                  {}};
  auto wake_row = [](const std::string& name, const Summary& s) {
    return std::vector<std::string>{name, fmt_us(s.median), fmt_us(s.p10), fmt_us(s.p90), fmt_us(s.max)};
  };
  wake.rows.push_back(wake_row("caravan, waiter parked", caravan_parked));
  wake.rows.push_back(wake_row("plain cv, waiter parked", plain_parked));
  wake.rows.push_back(wake_row("caravan, waiter active", caravan_active));
  wake.rows.push_back(wake_row("plain cv, waiter active", plain_active));
  report.tables.push_back(wake);

  report.notes.push_back("parked: the trigger comes 300 us after the wait began (the waiter sleeps in the kernel); "
                         "active: 5 us after (inside CARAVAN_WAIT_SPIN_US)");
  report.headlines.push_back(fmt::format("caravan: {:.2f} M tasks/s", caravan_rate.median / 1e6));
  report.headlines.push_back(fmt::format("plain pool: {:.2f} M tasks/s", plain_rate.median / 1e6));
  report.headlines.push_back(fmt::format("throughput ratio caravan/plain: {:.2f}x", caravan_rate.median / plain_rate.median));
  report.headlines.push_back(fmt::format("median wake-up: caravan {} us parked, {} us active; plain cv {} us parked, {} us active",
                                         fmt_us(caravan_parked.median), fmt_us(caravan_active.median),
                                         fmt_us(plain_parked.median), fmt_us(plain_active.median)));
  auto summary_json = [](const Summary& s) {
    return nlohmann::json{{"median", s.median}, {"p10", s.p10}, {"p90", s.p90}, {"min", s.min}, {"max", s.max}, {"count", s.count}};
  };
  report.figures = {{"workers", workers},
                    {"tasks", o.tasks},
                    {"tasks_per_second", {{"caravan", summary_json(caravan_rate)}, {"plain", summary_json(plain_rate)}}},
                    {"throughput_ratio", caravan_rate.median / plain_rate.median},
                    {"wakeup_us",
                     {{"caravan_parked", summary_json(caravan_parked)}, {"plain_parked", summary_json(plain_parked)},
                      {"caravan_active", summary_json(caravan_active)}, {"plain_active", summary_json(plain_active)}}}};
  return report;
}

}  // namespace

void add_bench_tasks(CLI::App& bench) {
  CLI::App& sub = add_bench_case(bench, "tasks", "Empty-task throughput and event wake-up latency vs a plain thread pool",
                                 run_tasks_bench);
  sub.add_option("--tasks", g_options.tasks, "Tasks per run")->capture_default_str();
  sub.add_option("--reps", g_options.repetitions, "Runs of each implementation")->capture_default_str();
  sub.add_option("--workers", g_options.workers, "CPU workers (0: CARAVAN_CPU_WORKERS)")->capture_default_str();
  sub.add_option("--wakeups", g_options.wakeups, "Wake-up samples per case")->capture_default_str();
}

}  // namespace caravan::app
