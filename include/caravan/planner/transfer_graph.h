// The transfer graph (Isometry section 4.1): memories are vertices, channels are directed edges
// carrying a throughput function, and a self-loop is a channel that converts layouts within one
// memory. Channels that use the same piece of hardware (one GPU's NVLink egress, a node's NIC, a
// PCIe link) name a shared resource, so that two hops of one plan, or two paths of a multi-path
// plan, are not planned as if each had the hardware alone.
//
// Built from a MachineDescription: a machine file (docs/machine-file.md), a built-in example, a
// generated cluster, or the live machine (describe_local_machine()).
#pragma once

#include <caravan/machine.h>
#include <caravan/planner/throughput.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace caravan::planner {

// ------------------------------------------------------------ machine descriptions (plain data)

struct MemoryDecl {
  MemoryId id;
  std::uint64_t capacity = 0;  // bytes; 0 = unbounded (intermediate buffers are bounded by TH only)
};

struct ResourceDecl {
  std::string name;   // e.g. "node0/gpu1.nvlink.out"
  double gbps = 0;    // what all channels sharing it can carry together
};

struct ChannelDecl {
  ChannelKind kind = ChannelKind::memcpy;
  MemoryId src, dst;  // src == dst: a self-loop
  ThroughputFunction tp;
  std::vector<std::string> shares;  // resource names
};

struct MachineDescription {
  std::string name;
  std::string description;
  std::vector<MemoryDecl> memories;
  std::vector<ResourceDecl> resources;
  std::vector<ChannelDecl> channels;
};

// ------------------------------------------------------------ the graph

struct Memory {
  MemoryId id;
  std::uint64_t capacity = 0;
};

struct Resource {
  std::string name;
  double gbps = 0;
};

struct Channel {
  ChannelKind kind = ChannelKind::memcpy;
  std::uint32_t src = 0, dst = 0;  // vertex indices
  ThroughputFunction tp;
  std::vector<std::uint32_t> resources;  // indices into resources()
  double peak_gbps = 0;  // min(tp's peak, every resource's capacity): what the channel alone can reach
  bool self_loop() const noexcept { return src == dst; }
};

class TransferGraph {
 public:
  // Validates the description: memories named once, channel ends and shared resources declared,
  // capacities positive. Throws Error(invalid_argument) naming the machine and the entry.
  explicit TransferGraph(const MachineDescription& machine);
  ~TransferGraph();
  TransferGraph(TransferGraph&&) noexcept;
  TransferGraph& operator=(TransferGraph&&) noexcept;

  const std::string& name() const noexcept;
  const MachineDescription& description() const noexcept;

  std::size_t memory_count() const noexcept;
  const Memory& memory(std::uint32_t vertex) const;
  std::optional<std::uint32_t> find(MemoryId id) const noexcept;
  // The vertex of `id`; throws Error(not_found) saying `what` ("src memory") and listing the
  // machine's memories of that node.
  std::uint32_t require(MemoryId id, std::string_view what) const;

  std::size_t channel_count() const noexcept;
  const Channel& channel(std::uint32_t index) const;
  std::span<const std::uint32_t> out_channels(std::uint32_t vertex) const;
  std::span<const std::uint32_t> in_channels(std::uint32_t vertex) const;

  std::size_t resource_count() const noexcept;
  const Resource& resource(std::uint32_t index) const;

  // The Boost.Graph representation (planner/graph_impl.h); for the planner's own algorithms.
  struct Impl;
  const Impl& impl() const noexcept { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace caravan::planner
