#include "runtime/checks.h"
#include "runtime/runtime_impl.h"

#include <caravan/runtime.h>
#include <caravan/task_graph.h>

#include <fmt/format.h>

#include <atomic>
#include <memory>
#include <mutex>

namespace caravan {

TaskGraph::NodeId TaskGraph::add(Node node) {
  NodeId id = nodes_.size();
  for (NodeId dep : node.dependencies) {
    if (dep >= id)
      throw Error(Errc::invalid_argument,
                  fmt::format("TaskGraph: node {} ('{}') depends on node {}, which does not exist yet "
                              "(dependencies must be added first; the graph has {} nodes)",
                              id, node.label, dep, id));
  }
  nodes_.push_back(std::move(node));
  return id;
}

TaskGraph::NodeId TaskGraph::add_task(TaskId task, std::span<const std::byte> args,
                                      std::span<const NodeId> dependencies, int priority, Processor processor) {
  std::string name(task_name(task));  // throws for an unknown task
  detail::check_priority(priority, fmt::format("TaskGraph: task '{}'", name));
  // A processor that does not exist fails here, not at every launch (when a runtime is
  // running: a graph may be built before one starts).
  if (RuntimeImpl* rt = RuntimeImpl::current()) (void)rt->check_processor("TaskGraph::add_task", name, processor);
  std::vector<std::byte> bytes(args.begin(), args.end());
  Starter start = [task, bytes = std::move(bytes), priority, processor](Event precondition) {
    return Runtime::current().spawn(task, bytes, SpawnOptions{precondition, priority, processor});
  };
  return add(Node{std::move(name), std::move(start), {dependencies.begin(), dependencies.end()}});
}

TaskGraph::NodeId TaskGraph::add_task(std::string_view name, std::span<const std::byte> args,
                                      std::span<const NodeId> dependencies, int priority, Processor processor) {
  return add_task(find_task(name), args, dependencies, priority, processor);
}

TaskGraph::NodeId TaskGraph::add_node(std::string label, Starter start, std::span<const NodeId> dependencies) {
  if (!start) throw Error(Errc::invalid_argument, fmt::format("TaskGraph: node '{}' has an empty starter", label));
  return add(Node{std::move(label), std::move(start), {dependencies.begin(), dependencies.end()}});
}

const std::string& TaskGraph::label(NodeId id) const {
  if (id >= nodes_.size())
    throw Error(Errc::invalid_argument, fmt::format("TaskGraph: no node {} (the graph has {})", id, nodes_.size()));
  return nodes_[id].label;
}

namespace {

// The launch's event: triggers once every node of the launch has settled, poisoned with the first
// failure if any failed. (merge_events fails fast instead, which would report the launch over
// while other branches still run.)
class LaunchSettled {
 public:
  LaunchSettled(detail::EventTable& table, std::size_t nodes) : table_(table), event_(table.create()), left_(nodes) {}
  Event event() const { return event_; }
  void settled(const FailureCause& failure) {
    if (failure) {
      std::lock_guard lock(mutex_);
      if (!first_failure_) first_failure_ = failure;
    }
    if (left_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    FailureCause first;
    {
      std::lock_guard lock(mutex_);
      first = first_failure_;
    }
    table_.trigger(event_, std::move(first));  // false if shutdown poisoned it first
  }

 private:
  detail::EventTable& table_;
  Event event_;
  std::atomic<std::size_t> left_;
  std::mutex mutex_;
  FailureCause first_failure_;
};

}  // namespace

Event TaskGraph::launch(Event precondition) const {
  RuntimeImpl* rt = RuntimeImpl::current();
  if (!rt) throw Error(Errc::shut_down, "TaskGraph::launch: no Caravan runtime is running");
  if (nodes_.empty()) return precondition;
  std::vector<Event> done(nodes_.size());
  std::vector<Event> inputs;
  auto settled = std::make_shared<LaunchSettled>(rt->events(), nodes_.size());
  for (NodeId id = 0; id < nodes_.size(); ++id) {
    const Node& node = nodes_[id];
    // Nodes before this one have started, so the launch does not throw from here on: a node that
    // cannot start fails as if it had run and failed, its dependents do not run, and the launch's
    // event says why.
    const auto fail_node = [&](Errc code, const std::string& why) {
      FailureCause cause =
          make_failure(code, fmt::format("TaskGraph::launch: node {} ('{}') failed to start: {}", id, node.label, why));
      done[id] = rt->events().create();
      rt->events().trigger(done[id], cause);
      settled->settled(cause);
    };
    try {
      Event pre = precondition;
      if (!node.dependencies.empty()) {
        inputs.clear();
        for (NodeId dep : node.dependencies) inputs.push_back(done[dep]);
        pre = merge_events(inputs);
      }
      done[id] = node.start(pre);
      done[id].on_trigger([settled](const FailureCause& failure) { settled->settled(failure); });
      continue;
    } catch (const Error& e) {
      fail_node(e.code(), e.what());
    } catch (const std::exception& e) {
      fail_node(Errc::task_failed, e.what());
    } catch (...) {
      fail_node(Errc::task_failed, "an exception that is not a std::exception");
    }
  }
  return settled->event();
}

}  // namespace caravan
