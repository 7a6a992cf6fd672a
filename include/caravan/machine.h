// Names of the machine's memories and channels, as the planner and the DMA engine see them.
//
// A memory is named node/rank/kind[index], e.g. "node1/rank4/fbm" or "node0/rank0/fbm1":
//   node   the host (a group of ranks sharing host memory)
//   rank   the process that owns the memory (ranks are numbered across the whole job)
//   kind   sys, zcm, reg, fbm or dsk (see MemoryKind)
//   index  which memory of that kind the rank owns; 0 is not printed ("fbm" is "fbm0")
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace caravan {

// The memories of Isometry's Table 1.
enum class MemoryKind : std::uint8_t {
  sys,  // plain (pageable) host memory
  zcm,  // pinned host memory mapped into a GPU ("zero-copy memory")
  reg,  // host memory registered with the NIC
  fbm,  // GPU memory ("frame buffer memory")
  dsk,  // file-backed storage (the paper's disk)
};

std::string_view to_string(MemoryKind kind) noexcept;
// Throws Error(invalid_argument) for an unknown name.
MemoryKind parse_memory_kind(std::string_view text);
// sys, zcm and reg: memories a CPU reads and writes directly.
constexpr bool is_host(MemoryKind kind) noexcept {
  return kind == MemoryKind::sys || kind == MemoryKind::zcm || kind == MemoryKind::reg;
}

struct MemoryId {
  std::uint32_t node = 0;
  std::uint32_t rank = 0;
  MemoryKind kind = MemoryKind::sys;
  std::uint32_t index = 0;

  // The largest node, rank and index key() keeps apart (parse() and machine files accept no more).
  static constexpr std::uint32_t max_node = (1u << 20) - 1;
  static constexpr std::uint32_t max_rank = (1u << 24) - 1;
  static constexpr std::uint32_t max_index = 0xffff;

  // Parses "node1/rank4/fbm" or "node0/rank0/fbm1"; throws Error(invalid_argument) naming the
  // part that does not parse.
  static MemoryId parse(std::string_view text);
  std::string to_string() const;
  // A dense 64-bit key (node 20 bits, rank 24, kind 4, index 16), for hashing.
  std::uint64_t key() const noexcept {
    return (static_cast<std::uint64_t>(node) << 44) | (static_cast<std::uint64_t>(rank) << 20) |
           (static_cast<std::uint64_t>(kind) << 16) | (index & 0xffffu);
  }
  bool operator==(const MemoryId&) const = default;
  auto operator<=>(const MemoryId&) const = default;
};

// The channels (Isometry's Table 2, named as in Caravan's architecture).
enum class ChannelKind : std::uint8_t {
  memcpy,       // CPU copies between host memories of one node; converts layouts well
  sdma,         // GPU copy engine: host <-> GPU, or within one GPU (the paper's GPURead/Write/Copy)
  xgmi,         // GPU <-> peer GPU of one node (NVLink on NVIDIA)
  nic,          // registered host memory <-> host memory of another node (UCX)
  file,         // host memory <-> file-backed storage (the paper's DiskRead/DiskWrite)
  gpu_convert,  // a GPU kernel that converts layouts within or between GPU memories
};

std::string_view to_string(ChannelKind kind) noexcept;
ChannelKind parse_channel_kind(std::string_view text);

}  // namespace caravan

template <>
struct std::hash<caravan::MemoryId> {
  std::size_t operator()(const caravan::MemoryId& id) const noexcept { return std::hash<std::uint64_t>{}(id.key()); }
};
