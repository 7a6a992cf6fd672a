// Task graphs: describe tasks and copies (add_copy, copy.h) with their dependencies once, then
// launch the whole graph many times. Each launch returns one event that triggers when every node
// of that launch has finished. An iterative application describes one iteration as a graph,
// builds it once, and launches it once per iteration.
#pragma once

#include <caravan/event.h>
#include <caravan/task.h>

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace caravan {

class TaskGraph {
 public:
  using NodeId = std::size_t;

  // A task node. `dependencies` must name nodes already added, so a graph is acyclic by
  // construction; anything else throws Error(invalid_argument) naming the bad id.
  NodeId add_task(TaskId task, std::span<const std::byte> args = {},
                  std::span<const NodeId> dependencies = {}, int priority = 0,
                  Processor processor = {});
  NodeId add_task(std::string_view task_name, std::span<const std::byte> args = {},
                  std::span<const NodeId> dependencies = {}, int priority = 0,
                  Processor processor = {});

  // A generic node: `start` is called at launch with the node's precondition and returns the
  // event of the work it started (copies and other operations become nodes this way). Check
  // what can be checked when adding the node: see launch() for a starter that throws.
  using Starter = std::function<Event(Event precondition)>;
  NodeId add_node(std::string label, Starter start, std::span<const NodeId> dependencies = {});

  // Starts one execution of the graph after `precondition`. Nodes with no dependencies wait on
  // `precondition`; a task or copy node whose dependency failed does not run and fails with the
  // same cause (an add_node starter is called all the same, with the poisoned precondition).
  // The result triggers once every node of this launch has finished or failed (never while a
  // node still runs), poisoned with the first failure if any failed. It does not throw once
  // nodes have started: a starter that throws fails its node (cause: its message, and its
  // Errc when it threw caravan::Error). An empty graph returns `precondition`. Throws
  // Error(shut_down) when no runtime is running.
  Event launch(Event precondition = {}) const;

  std::size_t size() const { return nodes_.size(); }
  const std::string& label(NodeId id) const;

 private:
  struct Node {
    std::string label;
    Starter start;
    std::vector<NodeId> dependencies;
  };
  NodeId add(Node node);
  std::vector<Node> nodes_;
};

}  // namespace caravan
