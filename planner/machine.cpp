// Names of memories and channels: parsing and printing.
#include <caravan/error.h>
#include <caravan/machine.h>

#include <fmt/format.h>

#include <charconv>

namespace caravan {
namespace {

// Reads "<word><number>" (e.g. "node12") from the front of `part`.
std::uint32_t numbered(std::string_view text, std::string_view part, std::string_view word) {
  if (part.rfind(word, 0) != 0)
    throw Error(Errc::invalid_argument,
                fmt::format("memory '{}': expected '{}N' in '{}' (memories are named like node1/rank4/fbm or node0/rank0/fbm1)", text, word, part));
  std::string_view digits = part.substr(word.size());
  std::uint32_t value = 0;
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || ec != std::errc() || ptr != digits.data() + digits.size())
    throw Error(Errc::invalid_argument, fmt::format("memory '{}': '{}' needs a number after '{}'", text, part, word));
  return value;
}

}  // namespace

std::string_view to_string(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::sys: return "sys";
    case MemoryKind::zcm: return "zcm";
    case MemoryKind::reg: return "reg";
    case MemoryKind::fbm: return "fbm";
    case MemoryKind::dsk: return "dsk";
  }
  return "?";
}

MemoryKind parse_memory_kind(std::string_view text) {
  for (auto kind : {MemoryKind::sys, MemoryKind::zcm, MemoryKind::reg, MemoryKind::fbm, MemoryKind::dsk})
    if (text == to_string(kind)) return kind;
  throw Error(Errc::invalid_argument, fmt::format("unknown memory kind '{}' (one of sys, zcm, reg, fbm, dsk)", text));
}

MemoryId MemoryId::parse(std::string_view text) {
  auto first = text.find('/');
  auto second = first == std::string_view::npos ? first : text.find('/', first + 1);
  if (second == std::string_view::npos || text.find('/', second + 1) != std::string_view::npos)
    throw Error(Errc::invalid_argument,
                fmt::format("memory '{}': expected three parts node/rank/kind, as in node1/rank4/fbm or node0/rank0/fbm1", text));
  MemoryId id;
  id.node = numbered(text, text.substr(0, first), "node");
  id.rank = numbered(text, text.substr(first + 1, second - first - 1), "rank");
  std::string_view kind = text.substr(second + 1);
  std::size_t digits = kind.size();
  while (digits > 0 && kind[digits - 1] >= '0' && kind[digits - 1] <= '9') --digits;
  id.kind = parse_memory_kind(kind.substr(0, digits));
  if (digits < kind.size()) {
    std::string_view number = kind.substr(digits);
    auto [ptr, ec] = std::from_chars(number.data(), number.data() + number.size(), id.index);
    if (ec != std::errc() || id.index > max_index)
      throw Error(Errc::invalid_argument, fmt::format("memory '{}': index '{}' out of range (0..65535)", text, number));
  }
  if (id.node > max_node || id.rank > max_rank)
    throw Error(Errc::invalid_argument, fmt::format("memory '{}': node must be < 2^20 and rank < 2^24", text));
  return id;
}

std::string MemoryId::to_string() const {
  if (index == 0) return fmt::format("node{}/rank{}/{}", node, rank, caravan::to_string(kind));
  return fmt::format("node{}/rank{}/{}{}", node, rank, caravan::to_string(kind), index);
}

std::string_view to_string(ChannelKind kind) noexcept {
  switch (kind) {
    case ChannelKind::memcpy: return "memcpy";
    case ChannelKind::sdma: return "sdma";
    case ChannelKind::xgmi: return "xgmi";
    case ChannelKind::nic: return "nic";
    case ChannelKind::file: return "file";
    case ChannelKind::gpu_convert: return "gpu_convert";
  }
  return "?";
}

ChannelKind parse_channel_kind(std::string_view text) {
  for (auto kind : {ChannelKind::memcpy, ChannelKind::sdma, ChannelKind::xgmi, ChannelKind::nic, ChannelKind::file,
                    ChannelKind::gpu_convert})
    if (text == to_string(kind)) return kind;
  throw Error(Errc::invalid_argument,
              fmt::format("unknown channel kind '{}' (one of memcpy, sdma, xgmi, nic, file, gpu_convert)", text));
}

}  // namespace caravan
