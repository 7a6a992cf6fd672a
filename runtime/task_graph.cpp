#include <caravan/runtime.h>
#include <caravan/task_graph.h>

#include <fmt/format.h>

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
  for (NodeId dep : node.dependencies) has_dependents_[dep] = true;
  nodes_.push_back(std::move(node));
  has_dependents_.push_back(false);
  return id;
}

TaskGraph::NodeId TaskGraph::add_task(TaskId task, std::span<const std::byte> args,
                                      std::span<const NodeId> dependencies, int priority, Processor processor) {
  std::string name(task_name(task));  // throws for an unknown task
  if (priority < kMinPriority || priority > kMaxPriority)
    throw Error(Errc::invalid_argument, fmt::format("TaskGraph: task '{}' has priority {}, outside [{}, {}]", name,
                                                    priority, kMinPriority, kMaxPriority));
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

Event TaskGraph::launch(Event precondition) const {
  std::vector<Event> done(nodes_.size());
  std::vector<Event> inputs;
  std::vector<Event> sinks;
  for (NodeId id = 0; id < nodes_.size(); ++id) {
    const Node& node = nodes_[id];
    Event pre = precondition;
    if (!node.dependencies.empty()) {
      inputs.clear();
      for (NodeId dep : node.dependencies) inputs.push_back(done[dep]);
      pre = merge_events(inputs);
    }
    done[id] = node.start(pre);
    if (!has_dependents_[id]) sinks.push_back(done[id]);
  }
  return merge_events(sinks);
}

}  // namespace caravan
