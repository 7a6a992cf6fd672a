// The public Instance and copy API (include/caravan/copy.h) on top of the engine.
#include "runtime/checks.h"
#include "runtime/dma/engine.h"
#include "runtime/dma/instance_impl.h"

#include <caravan/runtime.h>

#include <fmt/format.h>

namespace caravan {
namespace {

const InstanceImpl& checked(const std::shared_ptr<InstanceImpl>& impl) {
  if (!impl) throw Error(Errc::invalid_argument, "the instance is empty (use Instance::create)");
  return *impl;
}

// For the calls that touch an instance's bytes, which only its owner can.
const InstanceImpl& checked_local(const std::shared_ptr<InstanceImpl>& impl, const char* what) {
  const InstanceImpl& i = checked(impl);
  if (i.remote)
    throw Error(Errc::invalid_argument, fmt::format("{}: the instance is in {}, memory of rank {}; only that rank reaches "
                                                    "its bytes (copy it here first)", what, i.memory.to_string(), i.memory.rank));
  return i;
}

}  // namespace

Instance Instance::create(MemoryId memory, IndexSpace space, FieldSpace fields, Layout layout) {
  dma::Engine& engine = dma::Engine::current();
  engine.graph().require(memory, "instance memory");
  if (memory.rank != engine.rank())
    throw Error(Errc::invalid_argument, fmt::format("Instance::create: {} belongs to rank {}, not this rank ({})",
                                                    memory.to_string(), memory.rank, engine.rank()));
  if (fields.count() == 0)
    throw Error(Errc::invalid_argument, "Instance::create: fields is the empty field space (name at least one field)");
  layout.validate(space.dims(), "instance layout");
  auto impl = std::make_shared<InstanceImpl>(memory, std::move(space), std::move(fields), layout);
  impl->storage = engine.allocate_instance_storage(memory, impl->lin.total_bytes());
  Instance out;
  out.impl_ = std::move(impl);
  return out;
}

Instance Instance::attach(MemoryId memory, IndexSpace space, FieldSpace fields, Layout layout, void* data,
                          std::size_t bytes) {
  if (!is_host(memory.kind))
    throw Error(Errc::invalid_argument, fmt::format("Instance::attach: {} is not host memory (sys, zcm or reg)", memory.to_string()));
  if (!data) throw Error(Errc::invalid_argument, "Instance::attach: data is null");
  dma::Engine& engine = dma::Engine::current();
  engine.graph().require(memory, "instance memory");
  if (memory.rank != engine.rank())
    throw Error(Errc::invalid_argument, fmt::format("Instance::attach: {} belongs to rank {}, not this rank ({})",
                                                    memory.to_string(), memory.rank, engine.rank()));
  if (fields.count() == 0)
    throw Error(Errc::invalid_argument, "Instance::attach: fields is the empty field space (name at least one field)");
  layout.validate(space.dims(), "instance layout");
  auto impl = std::make_shared<InstanceImpl>(memory, std::move(space), std::move(fields), layout);
  if (bytes < impl->lin.total_bytes())
    throw Error(Errc::invalid_argument, fmt::format("Instance::attach: {} bytes given, the layout needs {}", bytes,
                                                    impl->lin.total_bytes()));
  impl->storage = engine.allocate_instance_storage(memory, bytes, data);
  Instance out;
  out.impl_ = std::move(impl);
  return out;
}

MemoryId Instance::memory() const { return checked(impl_).memory; }
const IndexSpace& Instance::space() const { return checked(impl_).space; }
const FieldSpace& Instance::fields() const { return checked(impl_).fields; }
const Layout& Instance::layout() const { return checked(impl_).layout; }
std::uint64_t Instance::footprint_bytes() const { return checked(impl_).lin.total_bytes(); }
std::uint64_t Instance::offset(const Point& point, std::size_t field) const {
  const InstanceImpl& impl = checked(impl_);
  if (!impl.space.contains(point)) throw Error(Errc::invalid_argument, "Instance::offset: the point is outside the index space");
  if (field >= impl.fields.count())
    throw Error(Errc::invalid_argument, fmt::format("Instance::offset: field {} of {}", field, impl.fields.count()));
  return impl.lin.offset(point, field);
}

std::byte* Instance::data() const {
  const InstanceImpl& impl = checked_local(impl_, "Instance::data");
  if (impl.storage->is_file())
    throw Error(Errc::invalid_argument, fmt::format("Instance::data: {} is file-backed; use read_bytes/write_bytes",
                                                    impl.memory.to_string()));
  if (impl.storage->device() >= 0)
    throw Error(Errc::invalid_argument, fmt::format("Instance::data: {} is GPU memory; use read_bytes/write_bytes",
                                                    impl.memory.to_string()));
  return impl.storage->host();
}

void* Instance::gpu_data() const {
  const InstanceImpl& impl = checked_local(impl_, "Instance::gpu_data");
  if (impl.storage->device() < 0 && impl.memory.kind != MemoryKind::zcm)
    throw Error(Errc::invalid_argument,
                fmt::format("Instance::gpu_data: {} is not memory a GPU addresses (only fbm<i> and zcm are; copy the "
                            "instance into one of them first)", impl.memory.to_string()));
  return impl.storage->gpu_address();
}

void Instance::read_bytes(std::uint64_t offset, std::span<std::byte> out) const {
  checked_local(impl_, "Instance::read_bytes").storage->read(offset, out);
}
void Instance::write_bytes(std::uint64_t offset, std::span<const std::byte> in) const {
  checked_local(impl_, "Instance::write_bytes").storage->write(offset, in);
}

std::vector<std::byte> Instance::descriptor() const {
  checked(impl_);
  return dma::Engine::current().export_instance(impl_);
}

Instance Instance::from_descriptor(std::span<const std::byte> descriptor) {
  Instance out;
  out.impl_ = dma::Engine::current().import_instance(descriptor);
  return out;
}

bool Instance::is_remote() const { return checked(impl_).remote; }

Event copy(const Instance& src, const Instance& dst, const CopyOptions& options) {
  return dma::Engine::current().copy(src, dst, options);
}

Event fill(const Instance& dst, std::span<const std::byte> point_value, const CopyOptions& options) {
  return dma::Engine::current().fill(dst, point_value, options);
}

bool cancel(Event copy_event) { return dma::Engine::current().cancel(copy_event); }

std::shared_ptr<const planner::Plan> plan_copy(const Instance& src, const Instance& dst, PlannerChoice planner,
                                               const std::optional<Rect>& region) {
  return dma::Engine::current().plan(src, dst, planner, region);
}

std::shared_ptr<const planner::MultiPlan> plan_copy_multipath(const Instance& src, const Instance& dst,
                                                              const std::optional<Rect>& region) {
  return dma::Engine::current().plan_multipath(src, dst, region);
}

CopyTiling copy_tiling(const Instance& src, const Instance& dst, PlannerChoice planner,
                       const std::optional<Rect>& region) {
  return dma::Engine::current().tiling(src, dst, planner, region);
}

MemoryId local_memory(MemoryKind kind, std::uint32_t index) {
  dma::Engine& engine = dma::Engine::current();  // Error(shut_down) without a runtime
  const Runtime& rt = Runtime::current();
  const MemoryId id{static_cast<std::uint32_t>(rt.node()), static_cast<std::uint32_t>(rt.rank()), kind, index};
  engine.graph().require(id, "local_memory");
  return id;
}

TaskGraph::NodeId add_copy(TaskGraph& graph, const Instance& src, const Instance& dst,
                           std::span<const TaskGraph::NodeId> dependencies, int priority) {
  return add_copy(graph, src, dst, priority, dependencies);
}

TaskGraph::NodeId add_copy(TaskGraph& graph, const Instance& src, const Instance& dst, int priority,
                           std::span<const TaskGraph::NodeId> dependencies) {
  return add_copy(graph, src, dst, CopyOptions{.priority = priority}, dependencies);
}

TaskGraph::NodeId add_copy(TaskGraph& graph, const Instance& src, const Instance& dst, const CopyOptions& options,
                           std::span<const TaskGraph::NodeId> dependencies) {
  if (!src.valid() || !dst.valid()) throw Error(Errc::invalid_argument, "add_copy: an instance is empty");
  detail::check_priority(options.priority, "add_copy");
  const bool signal = options.signal.flags || options.signal.value || options.signal.tiles;
  if (!options.precondition.is_none() || options.report || signal)
    throw Error(Errc::invalid_argument,
                fmt::format("add_copy: CopyOptions::{} is not for a graph node (each launch gives the precondition, "
                            "and would overwrite a report or landing flags); take them from copy() instead",
                            !options.precondition.is_none() ? "precondition"
                            : options.report                ? "report"
                                                            : "signal"));
  // The checks and the plan a copy() makes, now: a bad copy fails here, not at a launch that has
  // already started the nodes before it. (The plan is cached; each launch plans again as copy()
  // does, so a later change of route or calibration still applies.)
  try {
    dma::Engine::current().check_copy(src, dst, options);
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("add_copy: {}", e.what()));
  }
  std::string label = fmt::format("copy {} -> {}", src.memory().to_string(), dst.memory().to_string());
  if (options.region) label += " " + options.region->to_string();
  return graph.add_node(
      std::move(label),
      [src, dst, options](Event precondition) {
        CopyOptions launch = options;
        launch.precondition = precondition;
        return copy(src, dst, launch);
      },
      dependencies);
}

}  // namespace caravan
