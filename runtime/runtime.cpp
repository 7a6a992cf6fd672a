#include "runtime/checks.h"
#include "runtime/runtime_impl.h"

#include "runtime/log.h"
#include "runtime/net/launch.h"
#include "runtime/net/network.h"
#include "runtime/net/remote_events.h"

#include <caravan/platform.h>
#include <caravan/settings.h>

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <limits>
#include <thread>

namespace caravan {

std::atomic<RuntimeImpl*> RuntimeImpl::g_current{nullptr};

namespace {

// Runtimes created in this process, plus one: a runtime's instance is the low 16 bits (0 skipped).
std::atomic<std::uint64_t> g_next_instance{1};

// Whether a runtime of this process was ever given `instance`: false for a handle that no
// runtime here issued (made up, corrupted, or from another process). Exact until 65535 runtimes
// have been created; after that instances repeat and every one counts as issued.
bool instance_was_issued(std::uint16_t instance) {
  const std::uint64_t next = g_next_instance.load(std::memory_order_relaxed);
  return instance != 0 && (next > 0xFFFF || instance < next);
}

int resolve_worker_count(const RuntimeOptions& options) {
  if (options.cpu_workers) {
    if (*options.cpu_workers <= 0 || *options.cpu_workers > 4096)
      throw Error(Errc::invalid_argument,
                  fmt::format("RuntimeOptions::cpu_workers = {}: must be in [1, 4096] (as CARAVAN_CPU_WORKERS)",
                              *options.cpu_workers));
    return *options.cpu_workers;
  }
  auto configured = settings::get_int("CARAVAN_CPU_WORKERS");
  if (configured > 0) return static_cast<int>(configured);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

RuntimeImpl::RuntimeImpl(Runtime* owner, const RuntimeOptions& options) : owner_(owner) {
  log::apply_level_setting();
  // A misspelt setting would otherwise be ignored without a word.
  for (const auto& unknown : settings::unknown_environment_variables())
    log::get("settings")
        ->warn("{} is not a Caravan setting and is ignored{} (`caravan config` lists them)", unknown.name,
               unknown.suggestion.empty() ? "" : fmt::format("; did you mean {}?", unknown.suggestion));
  int workers = resolve_worker_count(options);
  // The job: from the options, else from the launcher's environment, else one rank alone.
  std::optional<LaunchOptions> launch =
      options.launch ? std::optional(net::validated(*options.launch, false)) : net::launch_from_environment();
  if (launch) {
    rank_ = launch->rank;
    world_size_ = launch->world_size;
  }
  ranks_ = {RankInfo{rank_, 0, 0, net::host_name(), static_cast<int>(getpid())}};
  wait_spin_setting_ = settings::get_int("CARAVAN_WAIT_SPIN_US");
  const int wait_spin = detail::wait_spin_us_for(wait_spin_setting_, false);
  int worker_spin = static_cast<int>(settings::get_int("CARAVAN_WORKER_SPIN_US"));
  // Instance 0 is never used, so that no live runtime matches a zeroed handle.
  auto instance = static_cast<std::uint16_t>(g_next_instance.fetch_add(1));
  if (instance == 0) instance = static_cast<std::uint16_t>(g_next_instance.fetch_add(1));
  events_ = std::make_unique<detail::EventTable>(static_cast<std::uint16_t>(rank()), instance, wait_spin);
  RuntimeImpl* expected = nullptr;
  if (!g_current.compare_exchange_strong(expected, this))
    throw Error(Errc::already_done, "a Caravan runtime is already running in this process (one per process; shut it down first)");
  try {
    cpu_ = std::make_unique<detail::CpuProcessor>(
        *events_, Processor{ProcessorKind::cpu, static_cast<std::uint16_t>(rank()), 0}, workers, worker_spin);
  } catch (...) {
    mark_failed();
    RuntimeImpl* self = this;
    g_current.compare_exchange_strong(self, nullptr);  // so that a later Runtime may start
    throw;
  }
  if (world_size_ > 1) {
    try {
      net_ = std::make_unique<net::Network>(*this, *launch);
      net_->start();
    } catch (...) {
      auto failure = make_failure(Errc::shut_down, "the runtime failed to start");
      mark_failed();  // before the workers are joined: a task may wait for the owner in Runtime::current()
      net_.reset();
      cpu_->stop(failure);
      events_->poison_all_pending(failure);
      RuntimeImpl* self = this;
      g_current.compare_exchange_strong(self, nullptr);
      throw;
    }
    ranks_ = net_->ranks();
    node_count_ = net_->node_count();
  }
  log::get("runtime")->info("runtime started: rank {}/{}, {} CPU workers", rank(), world_size(), workers);
}

RuntimeImpl::~RuntimeImpl() {
  try {
    shutdown();
  } catch (const Error& e) {
    log::get("runtime")->error("runtime destroyed on a worker thread: {}", e.what());
  }
}

void RuntimeImpl::shutdown() {
  // Once shut down, every thread of the runtime has been joined: a later call (from anywhere,
  // a callback on the application's thread included) has nothing to do.
  if (stopped_.load(std::memory_order_acquire)) return;
  // A thread cannot wait for itself to return (nor a callback for the thread that runs it).
  // Checked before anything else, also while another thread is shutting down: that shutdown
  // would join this thread.
  if (detail::t_event_callback_depth > 0)
    throw Error(Errc::invalid_argument,
                "Runtime::shutdown called from an Event::on_trigger callback; callbacks must not block: call it "
                "from outside the callback");
  if (detail::t_blocked_wait_count)
    throw Error(
        Errc::invalid_argument,
        "Runtime::shutdown called from a task (a CPU worker or a GPU launcher thread); call it from outside the "
        "runtime's tasks");
  if (detail::t_runtime_thread_role)
    throw Error(Errc::invalid_argument,
                fmt::format("Runtime::shutdown called on one of the runtime's own threads ({}); call it from outside "
                            "the runtime's threads",
                            detail::t_runtime_thread_role));
  // One shutdown at a time: a second caller (another application thread, ~Runtime) waits here
  // until the first has finished, instead of returning while it still runs (and then, say,
  // destroying the runtime under it).
  std::lock_guard serial(shutdown_mutex_);
  if (stopped_.load(std::memory_order_relaxed)) return;
  stopping_.store(true, std::memory_order_release);
  // A task or thread waiting in a collective (a barrier, a heap allocation) would hold the
  // shutdown up for ever: it ends with Error(shut_down) now.
  if (net_) net_->wake_collectives();
  auto failure = make_failure(Errc::shut_down, "the runtime shut down before this work ran");
  // Each stage runs even if one before it threw (its error is logged): stopping half the
  // runtime would leave threads that later stages join, or events nobody fails.
  const auto stage = [](const char* what, const auto& run) {
    try {
      run();
    } catch (const std::exception& e) {
      log::get("runtime")->error("shutdown: {} failed: {}", what, e.what());
    }
  };
  {
    // Services (the DMA engine...) stop their own work first, newest first; later stages may
    // still need the CPU processor and the event table.
    std::vector<RuntimeService*> services;
    {
      std::lock_guard lock(services_mutex_);
      for (auto& s : services_) services.push_back(s.get());
    }
    for (auto it = services.rbegin(); it != services.rend(); ++it) stage("a service", [&] { (*it)->shutdown(); });
  }
  if (cpu_) stage("stopping the CPU processor", [&] { stop_cpu(failure); });
  // After the CPU: a CPU task that waits for a GPU task still sees it finish.
  stage("unblocking GPU task bodies", [&] { unblock_gpu_bodies(failure); });
  for (detail::GpuProcessor* g : started_gpus()) stage("stopping a GPU processor", [&] { g->stop(failure); });
  // Everything still pending (tasks waiting on preconditions, user events) fails now, so that
  // no thread waits forever on work that can no longer happen.
  events_->poison_all_pending(failure);
  if (net_) {
    // Peers may still need this rank (its events, tasks, memory) until they shut down too;
    // then whatever still waits on them (proxies of their events) fails as well.
    stage("leaving the job", [&] { net_->shutdown(); });
    events_->poison_all_pending(failure);
  }
  RuntimeImpl* self = this;
  g_current.compare_exchange_strong(self, nullptr);
  stopped_.store(true, std::memory_order_release);
  log::get("runtime")->info("runtime shut down");
}

void RuntimeImpl::unblock_when_quiet(const std::function<bool()>& finished, const std::function<bool()>& all_blocked,
                                     const std::function<void(int step)>& step) {
  using Clock = std::chrono::steady_clock;
  // With several ranks a peer may still trigger this rank's events: the quiet spell must last
  // CARAVAN_SHUTDOWN_TIMEOUT_S there.
  const auto quiet_needed = world_size_ > 1
                                ? std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(settings::get_double("CARAVAN_SHUTDOWN_TIMEOUT_S")))
                                : std::chrono::duration_cast<Clock::duration>(std::chrono::milliseconds(20));
  int steps_taken = 0;
  std::uint64_t triggers = events_->trigger_count();
  auto quiet_since = Clock::now();
  while (!finished()) {
    const std::uint64_t now_triggers = events_->trigger_count();
    if (!all_blocked() || now_triggers != triggers) {
      triggers = now_triggers;
      quiet_since = Clock::now();
      continue;
    }
    if (Clock::now() - quiet_since < quiet_needed) continue;
    step(steps_taken++);
    triggers = events_->trigger_count();
    quiet_since = Clock::now();
  }
}

std::vector<detail::GpuProcessor*> RuntimeImpl::started_gpus() {
  std::vector<detail::GpuProcessor*> gpus;
  std::lock_guard lock(gpus_mutex_);  // once stopping_ is set, no processor starts after this
  for (auto& g : gpus_)
    if (g) gpus.push_back(g.get());
  return gpus;
}

bool RuntimeImpl::gpus_busy() {
  const auto gpus = started_gpus();
  return std::any_of(gpus.begin(), gpus.end(), [](const detail::GpuProcessor* g) { return g->busy(); });
}

void RuntimeImpl::stop_cpu(const FailureCause& failure) {
  // No task starts from here on; queued ones fail now, so a running task waiting on one returns.
  cpu_->request_stop(failure);
  // The tasks running now return first. One that waits on an event nothing will trigger any more
  // (a user event the application will not trigger now) would hold shutdown forever. So when
  // nothing has moved for a while (every worker still running blocked in Event::wait, no GPU
  // work queued or in flight, no event triggered), pending user events fail; if that is not
  // enough, the GPUs stop and every pending event fails. Anything that moves restarts the
  // wait, so a task that computes, or waits on work that is progressing, is never cut short.
  unblock_when_quiet([&] { return cpu_->wait_for_workers(std::chrono::milliseconds(5)); },
                     [&] {
                       const int live = cpu_->live_workers();
                       return live > 0 && cpu_->blocked_workers() == live && !gpus_busy();
                     },
                     [&](int step) {
                       const int live = cpu_->live_workers();
                       if (step == 0) {
                         const std::size_t poisoned = events_->poison_pending_user_events(failure);
                         log::get("runtime")->warn(
                             "shutdown: {} CPU task(s) blocked in Event::wait with nothing else running; "
                             "poisoned {} pending user event(s) so that they return",
                             live, poisoned);
                       } else if (step == 1) {
                         log::get("runtime")->warn(
                             "shutdown: {} CPU task(s) still blocked in Event::wait with nothing else running; "
                             "stopping the GPUs' queues and poisoning every pending event",
                             live);
                         // Not joining the GPUs here: a GPU body may be blocked too, until the poisoning below.
                         request_stop_gpus(failure);
                         events_->poison_all_pending(failure);
                       } else {
                         events_->poison_all_pending(failure);  // events made since by the blocked tasks' dependents
                       }
                     });
  cpu_->stop(failure);  // joins
}

void RuntimeImpl::request_stop_gpus(const FailureCause& failure) {
  // Outside gpus_mutex_: failing a queued task runs its dependents' callbacks.
  for (detail::GpuProcessor* g : started_gpus()) g->request_stop(failure);
}

void RuntimeImpl::unblock_gpu_bodies(const FailureCause& failure) {
  // The CPU workers have returned. No GPU task is launched from here on (queued ones fail), and a
  // body running on a launcher is waited for as the CPU tasks were: one blocked in Event::wait
  // with nothing else moving is freed by poisoning, so that joining its launcher cannot hang.
  request_stop_gpus(failure);
  const auto each_gpu = [&](const auto& predicate) {
    const auto gpus = started_gpus();
    return std::all_of(gpus.begin(), gpus.end(), [&](const detail::GpuProcessor* g) { return predicate(*g); });
  };
  unblock_when_quiet(
      [&] {
        if (each_gpu([](const detail::GpuProcessor& g) { return !g.launching(); })) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return false;
      },
      [&] {
        return each_gpu([](const detail::GpuProcessor& g) { return !g.launching() || g.body_blocked(); }) &&
               !gpus_busy();
      },
      [&](int step) {
        if (step == 0) {
          const std::size_t poisoned = events_->poison_pending_user_events(failure);
          log::get("runtime")->warn(
              "shutdown: a GPU task's body is blocked in Event::wait with nothing else running; "
              "poisoned {} pending user event(s) so that it returns",
              poisoned);
        } else {
          log::get("runtime")->warn(
              "shutdown: a GPU task's body is still blocked in Event::wait; poisoning every "
              "pending event");
          events_->poison_all_pending(failure);
        }
      });
}

RuntimeService& RuntimeImpl::service(const std::string& name,
                                     const std::function<std::unique_ptr<RuntimeService>()>& make) {
  std::lock_guard lock(services_mutex_);
  if (!accepting_work()) throw Error(Errc::shut_down, fmt::format("the runtime is shutting down ({} unavailable)", name));
  auto it = services_by_name_.find(name);
  if (it != services_by_name_.end()) return *it->second;
  services_.push_back(make());
  services_by_name_[name] = services_.back().get();
  return *services_.back();
}

detail::EventTable& RuntimeImpl::table_for(const Event& e) {
  RuntimeImpl* rt = current();
  if (!rt || rt->events_->instance() != e.runtime_instance()) {
    if (!instance_was_issued(e.runtime_instance()))
      throw Error(Errc::invalid_argument,
                  fmt::format("{} was never issued: no Caravan runtime of this process had instance {} (a made-up or "
                              "corrupted handle, or one from another process)",
                              e.to_string(), e.runtime_instance()));
    throw Error(Errc::shut_down,
                fmt::format("{} belongs to a Caravan runtime that has been shut down{}", e.to_string(),
                            rt ? " (another runtime is running now)" : ""));
  }
  if (e.owner_rank() != rt->rank())
    throw Error(Errc::invalid_argument,
                fmt::format("{} is owned by rank {}, not this rank ({}); {}", e.to_string(), e.owner_rank(), rt->rank(),
                            e.owner_rank() < rt->world_size() ? "only its owner's table holds it (wait on it instead)"
                                                              : fmt::format("this job has {} rank(s)", rt->world_size())));
  return *rt->events_;
}

RuntimeImpl::LocalEvent RuntimeImpl::local_view(const Event& e) {
  RuntimeImpl* rt = current();
  // One comparison on the single-rank path; events of other ranks go through their proxies.
  if (rt && e.owner_rank() != rt->rank_ && rt->net_ && e.owner_rank() < rt->world_size_)
    return {rt->events_.get(), rt->net_->events().proxy(e)};
  return {&table_for(e), e};
}

int RuntimeImpl::gpu_count() {
  std::lock_guard lock(gpus_mutex_);
  if (gpu_count_ < 0) {
    GpuProbe probe = probe_gpus();
    gpu_count_ = probe.device_count;
    no_gpu_reason_ = probe.reason;  // without GPU support: why (CARAVAN_GPU=OFF, or no compiler found)
    gpus_.resize(static_cast<std::size_t>(gpu_count_));
  }
  return gpu_count_;
}

std::string RuntimeImpl::no_gpu_reason() {
  gpu_count();
  std::lock_guard lock(gpus_mutex_);
  return no_gpu_reason_;
}

void RuntimeImpl::use_gpu_streams(int count, GpuStreamsFactory make) {
  if (count < 0 || count > 1024)
    throw Error(Errc::invalid_argument, fmt::format("use_gpu_streams(count = {}): count must be in [0, 1024]", count));
  if (count > 0 && !make)
    throw Error(Errc::invalid_argument, fmt::format("use_gpu_streams(count = {}): the streams factory is empty", count));
  std::lock_guard lock(gpus_mutex_);
  for (auto& g : gpus_)
    if (g) throw Error(Errc::already_done, "use_gpu_streams: a GPU processor has already started");
  gpu_count_ = count;
  no_gpu_reason_ = count > 0 ? "" : "use_gpu_streams(0)";
  make_gpu_streams_ = std::move(make);
  gpus_.clear();
  gpus_.resize(static_cast<std::size_t>(count));
}

detail::GpuProcessor& RuntimeImpl::gpu(int index) {
  gpu_count();
  std::lock_guard lock(gpus_mutex_);
  if (index < 0 || index >= gpu_count_)
    throw Error(Errc::internal, fmt::format("gpu({}): this rank has {} GPU(s)", index, gpu_count_));
  auto& slot = gpus_[static_cast<std::size_t>(index)];
  if (!slot) {
    if (!accepting_work()) throw Error(Errc::shut_down, "the runtime is shutting down (no GPU processor starts now)");
    const int per_class = static_cast<int>(settings::get_int("CARAVAN_GPU_TASK_STREAMS"));
    std::unique_ptr<detail::GpuStreams> streams;
    if (make_gpu_streams_) {
      streams = make_gpu_streams_(index);
      if (!streams) throw Error(Errc::internal, fmt::format("gpu({}): the streams factory returned nothing", index));
    } else {
#if defined(CARAVAN_HAVE_GPU)
      streams = detail::make_device_streams(index, per_class);
      note_uses_gpu();
#else
      throw Error(Errc::internal, "gpu(): this build has no GPU support");
#endif
    }
    slot = std::make_unique<detail::GpuProcessor>(
        *events_, gpu_follows_, Processor{ProcessorKind::gpu, static_cast<std::uint16_t>(rank_), static_cast<std::uint16_t>(index)},
        std::move(streams), static_cast<int>(settings::get_int("CARAVAN_WORKER_SPIN_US")));
    log::get("runtime")->info("GPU processor {} started ({} streams)", slot->id().to_string(), 2 * per_class);
  }
  return *slot;
}

void RuntimeImpl::note_uses_gpu() { events_->set_wait_spin_us(detail::wait_spin_us_for(wait_spin_setting_, true)); }

Processor RuntimeImpl::check_processor(std::string_view call, std::string_view task, Processor processor) {
  // The message's subject, built only when there is an error (spawn is a hot path).
  const auto who = [&] { return fmt::format("{}('{}')", call, task); };
  if (processor.rank == Processor::kThisRank) processor.rank = static_cast<std::uint16_t>(rank_);
  if (processor.rank >= world_size_)
    throw Error(Errc::invalid_argument, fmt::format("{}: processor {} does not exist (this job has {} rank(s))", who(),
                                                    processor.to_string(), world_size_));
  if (processor.rank != rank_) {
    // Every rank has one CPU processor, checked here before anything is sent. How many GPUs a
    // rank sees is its own business: the target checks a GPU processor, and a missing one
    // poisons the completion with its error.
    if (processor.kind == ProcessorKind::cpu && processor.index != 0)
      throw Error(Errc::invalid_argument,
                  fmt::format("{}: processor {} does not exist (each rank has one CPU processor, cpu0)", who(),
                              processor.to_string()));
    return processor;
  }
  if (processor == cpu_->id() || (processor.kind == ProcessorKind::gpu && processor.index < gpu_count()))
    return processor;
  const int gpus = gpu_count();
  throw Error(Errc::invalid_argument,
              fmt::format("{}: processor {} does not exist on this rank (it has {}{})", who(), processor.to_string(),
                          cpu_->id().to_string(),
                          gpus == 0 ? fmt::format(" and no GPU processor: {}", no_gpu_reason())
                                    : fmt::format(" and GPU processors gpu0..gpu{}", gpus - 1)));
}

Event RuntimeImpl::spawn(TaskId task, std::span<const std::byte> args, const SpawnOptions& options) {
  const detail::TaskEntry* entry = detail::lookup_task(task);
  if (!entry) throw Error(Errc::not_found, fmt::format("spawn: no task has id {}", task.value));
  detail::check_priority(options.priority, fmt::format("spawn('{}')", entry->name));
  const Processor processor = check_processor("spawn", entry->name, options.processor);
  if (processor.rank != rank_) {
    if (!accepting_work())
      throw Error(Errc::shut_down, fmt::format("spawn('{}'): the runtime is shutting down", entry->name));
    // The message carries the arguments' length in 32 bits.
    if (args.size() > std::numeric_limits<std::uint32_t>::max())
      throw Error(Errc::invalid_argument,
                  fmt::format("spawn('{}'): {} bytes of arguments for rank {}; a task on another rank takes at most "
                              "4 GiB - 1 (pass an Instance or a symmetric heap region instead)",
                              entry->name, args.size(), processor.rank));
    if (!options.precondition.is_none() && options.precondition.owner_rank() >= world_size_)
      throw Error(Errc::invalid_argument,
                  fmt::format("spawn('{}'): the precondition belongs to rank {}, outside the job's ranks 0..{}",
                              entry->name, options.precondition.owner_rank(), world_size_ - 1));
    if (!options.precondition.is_none() && options.precondition.owner_rank() == rank_) table_for(options.precondition);
    SpawnOptions remote = options;
    remote.processor = processor;
    return net_->events().spawn(processor.rank, entry->name, args, remote);
  }
  detail::TaskProcessor* target = nullptr;
  if (processor == cpu_->id()) {
    target = cpu_.get();
  } else {
    if (!accepting_work())
      throw Error(Errc::shut_down, fmt::format("spawn('{}'): the runtime is shutting down", entry->name));
    target = &gpu(processor.index);
  }
  if (!accepting_work())
    throw Error(Errc::shut_down, fmt::format("spawn('{}'): the runtime is shutting down", entry->name));
  // Validate the precondition before creating anything, so a bad one leaves nothing behind.
  LocalEvent pre = options.precondition.is_none() ? LocalEvent{nullptr, {}} : local_view(options.precondition);
  Event completion = events_->create();
  auto* record = new detail::TaskRecord(entry, task, completion, options.priority, target, args);
  if (processor.kind == ProcessorKind::gpu) {
    gpu_follows_.add(completion);
    if (options.order_on_gpu && pre.table) {
      switch (gpu_follows_.follow(pre.event, record)) {
        case detail::GpuFollowTable::Follow::ready: target->make_ready(record); return completion;
        case detail::GpuFollowTable::Follow::waiting: return completion;
        case detail::GpuFollowTable::Follow::not_followable: break;
      }
    }
  }
  if (pre.table) pre.table->add_waiter(pre.event, record);
  else target->make_ready(record);
  return completion;
}

// --- Runtime (the public handle) ---

Runtime::Runtime(RuntimeOptions options) : impl_(std::make_unique<RuntimeImpl>(this, options)) { impl_->mark_owned(); }

Runtime::~Runtime() {
  try {
    shutdown();
  } catch (const Error& e) {
    // Destroyed on a worker thread: nothing can be stopped from here, so the runtime is left
    // running (and leaked) rather than the process terminated.
    log::get("runtime")->error("~Runtime: {}", e.what());
    impl_->forget_owner();
    (void)impl_.release();
  }
}

Runtime& Runtime::current() {
  RuntimeImpl* rt = RuntimeImpl::current();
  if (!rt) throw Error(Errc::shut_down, "no Caravan runtime is running (create a caravan::Runtime first)");
  if (!rt->wait_until_owned())
    throw Error(Errc::shut_down, "the Caravan runtime failed to start (its constructor threw)");
  if (!rt->owner())
    throw Error(Errc::shut_down,
                "the running Caravan runtime's Runtime object was destroyed on one of its own threads");
  return *rt->owner();
}

bool Runtime::is_running() { return RuntimeImpl::current() != nullptr; }

int Runtime::rank() const { return impl_->rank(); }
int Runtime::world_size() const { return impl_->world_size(); }
int Runtime::node() const { return impl_->ranks()[static_cast<std::size_t>(impl_->rank())].node; }
int Runtime::node_count() const { return impl_->node_count(); }

const RankInfo& Runtime::rank_info(int rank) const {
  if (rank < 0 || rank >= impl_->world_size())
    throw Error(Errc::invalid_argument,
                fmt::format("rank_info({}): rank must be in [0, {})", rank, impl_->world_size()));
  return impl_->ranks()[static_cast<std::size_t>(rank)];
}

std::vector<int> Runtime::ranks_on_node(int node) const {
  if (node < 0 || node >= impl_->node_count())
    throw Error(Errc::invalid_argument, fmt::format("ranks_on_node({}): node must be in [0, {})", node, impl_->node_count()));
  std::vector<int> out;
  for (const RankInfo& info : impl_->ranks())
    if (info.node == node) out.push_back(info.rank);
  return out;
}

void Runtime::barrier(std::optional<std::chrono::nanoseconds> timeout) {
  if (net::Network* network = impl_->network()) network->barrier(timeout);
}
std::vector<Processor> Runtime::processors() const {
  std::vector<Processor> out{impl_->cpu().id()};
  for (int i = 0, n = impl_->gpu_count(); i < n; ++i)
    out.push_back(Processor{ProcessorKind::gpu, static_cast<std::uint16_t>(impl_->rank()), static_cast<std::uint16_t>(i)});
  return out;
}
int Runtime::cpu_worker_count() const { return impl_->cpu().worker_count(); }

Event Runtime::spawn(TaskId task, std::span<const std::byte> args, const SpawnOptions& options) {
  return impl_->spawn(task, args, options);
}

Event Runtime::spawn(std::string_view name, std::span<const std::byte> args, const SpawnOptions& options) {
  return impl_->spawn(find_task(name), args, options);
}

void Runtime::shutdown() { impl_->shutdown(); }

std::string Processor::to_string() const {
  if (rank == kThisRank) return fmt::format("this-rank/{}{}", kind == ProcessorKind::cpu ? "cpu" : "gpu", index);
  return fmt::format("rank{}/{}{}", rank, kind == ProcessorKind::cpu ? "cpu" : "gpu", index);
}

}  // namespace caravan
