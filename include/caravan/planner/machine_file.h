// Machine descriptions: the JSON machine file (docs/machine-file.md), the built-in examples, a
// generator for clusters of N nodes x G GPUs, and the live machine.
#pragma once

#include <caravan/planner/transfer_graph.h>

#include <string>
#include <string_view>
#include <vector>

namespace caravan::planner {

// Parses a machine file's text; `origin` (a path or a name) prefixes every error message.
// Throws Error(invalid_argument) naming the entry and the rule broken: among them an unknown key
// in any object, a (kind, src, dst) made by two channel entries, a size that is not finite, not
// below 2^64 or a fraction of a byte, and a node, rank or index beyond what a MemoryId holds.
MachineDescription parse_machine_json(std::string_view text, std::string_view origin);
// Reads a file; throws Error(not_found) when it cannot be opened.
MachineDescription load_machine_file(const std::string& path);
// The JSON form of a description (tables written out; loads back to an equal description).
std::string to_machine_json(const MachineDescription& machine);

// The built-in machines shipped in planner/machines/:
//   "isometry-two-node": the paper's Figure 4 cluster with Table 5's bandwidths
//   "h200x4":            one node of 4 H200 GPUs, from measured reference figures
MachineDescription builtin_machine(std::string_view name);
std::vector<std::string> builtin_machine_names();

// N nodes of G GPUs each, one rank per GPU, modelled on H200 nodes joined by one 400 Gb/s NIC
// per node: node n holds ranks n*G .. n*G+G-1; host memories (sys, zcm, reg) belong to the
// node's first rank; each rank has one fbm. See docs/machine-file.md for every figure used.
struct ClusterSpec {
  int nodes = 2;
  int gpus_per_node = 8;
};
MachineDescription generate_cluster(const ClusterSpec& spec);

// The memories and channels of this process's host: a sys memory with a memcpy self-loop whose
// throughput table is measured now (a few milliseconds). GPU and NIC memories are added by the
// channel implementations when they exist.
MachineDescription describe_local_machine();

// One string naming a machine, as `caravan plan --machine` takes it:
//   "local"              the live machine
//   "generate:NxG"       generate_cluster({N, G}), e.g. generate:64x8
//   a built-in name      "isometry-two-node", "h200x4"
//   anything else        a path to a machine file
MachineDescription resolve_machine(std::string_view spec);
// resolve_machine(CARAVAN_PLANNER_MACHINE): the machine `caravan plan` and `caravan machine
// show` use when not given one (copies always plan on the live machine).
MachineDescription machine_from_settings();

}  // namespace caravan::planner
