// Machine descriptions: JSON machine files, built-in examples, the cluster generator and
// resolve_machine(). The format is documented in docs/machine-file.md.
#include <caravan/error.h>
#include <caravan/planner/machine_file.h>
#include <caravan/settings.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <sstream>
#include <tuple>

namespace caravan::planner {
namespace detail {
// Defined in the generated builtin_machines.cpp (planner/CMakeLists.txt embeds planner/machines/).
std::string_view builtin_machine_text(std::string_view name);
std::vector<std::string> builtin_machine_list();
}  // namespace detail

namespace {

using nlohmann::json;
constexpr const char* kFormat = "caravan-machine-1";

struct Context {
  std::string origin;
  [[noreturn]] void fail(const std::string& where, const std::string& rule) const {
    throw Error(Errc::invalid_argument, fmt::format("machine file {}: {}: {}", origin, where, rule));
  }
};

// The keys an object of the format may hold. Any other is an error: a misspelt "shares" or
// "capacity" would otherwise drop a channel's resource or a memory's bound without a word.
void check_keys(const json& object, std::initializer_list<const char*> allowed, const Context& ctx,
                const std::string& where) {
  if (!object.is_object()) ctx.fail(where, fmt::format("expected a JSON object, got {}", object.type_name()));
  for (const auto& item : object.items()) {
    const std::string& key = item.key();
    if (std::any_of(allowed.begin(), allowed.end(), [&](const char* a) { return key == a; })) continue;
    std::string expected;
    for (const char* a : allowed) expected += (expected.empty() ? "" : ", ") + std::string(a);
    ctx.fail(where, fmt::format("unknown key \"{}\" (expected {})", key, expected));
  }
}

// A byte count held in a double, checked before it becomes a whole number: a cast of a
// non-finite value or of one at or above 2^64 is undefined, and a fraction of a byte would read
// as 0 (unbounded for a capacity).
std::uint64_t whole_bytes(double bytes, const std::string& shown, const Context& ctx, const std::string& where) {
  constexpr double kTwoTo64 = 18446744073709551616.0;
  if (!std::isfinite(bytes)) ctx.fail(where, fmt::format("{} is not a byte count (a size must be finite)", shown));
  if (bytes < 0) ctx.fail(where, fmt::format("{}: a size cannot be negative", shown));
  if (bytes >= kTwoTo64) ctx.fail(where, fmt::format("{} is too large (a size is at most 2^64 - 1 bytes)", shown));
  if (bytes > 0 && bytes < 1)
    ctx.fail(where, fmt::format("{} is a fraction of a byte (it would be read as 0; sizes are whole bytes)", shown));
  return static_cast<std::uint64_t>(bytes);
}

// A byte count: a JSON number, or a string like "4096", "64K", "16MiB", "1.5G" (powers of 1024).
std::uint64_t parse_size(const json& value, const Context& ctx, const std::string& where) {
  if (value.is_number_integer()) {
    if (!value.is_number_unsigned() && value.get<std::int64_t>() < 0)
      ctx.fail(where, fmt::format("{}: a size cannot be negative", value.dump()));
    return value.get<std::uint64_t>();
  }
  if (value.is_number()) return whole_bytes(value.get<double>(), value.dump(), ctx, where);
  if (!value.is_string()) ctx.fail(where, "expected a byte count (a number or a string like \"64K\")");
  std::string text = value.get<std::string>();
  double number = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (ec != std::errc() || ptr == text.data() || number < 0) ctx.fail(where, fmt::format("'{}' is not a byte count", text));
  std::string suffix(ptr, static_cast<std::size_t>(text.data() + text.size() - ptr));
  for (auto& c : suffix) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (!suffix.empty() && suffix.back() == 'b') suffix.pop_back();
  if (!suffix.empty() && suffix.back() == 'i') suffix.pop_back();
  double scale = 1;
  if (suffix == "k") scale = 1024.0;
  else if (suffix == "m") scale = 1024.0 * 1024;
  else if (suffix == "g") scale = 1024.0 * 1024 * 1024;
  else if (suffix == "t") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (!suffix.empty()) ctx.fail(where, fmt::format("'{}': unknown size suffix (use K, M, G or T)", text));
  return whole_bytes(number * scale, fmt::format("'{}'", text), ctx, where);
}

// [bytes, GB/s] points, checked as a throughput table here so that an error names the table
// (or the channel) that holds them rather than the first channel that uses them.
std::vector<ThroughputFunction::Sample> parse_points(const json& value, const Context& ctx, const std::string& where) {
  if (!value.is_array() || value.empty()) ctx.fail(where, "expected a non-empty array of [bytes, GB/s] points");
  std::vector<ThroughputFunction::Sample> points;
  for (std::size_t i = 0; i < value.size(); ++i) {
    const auto& p = value[i];
    std::string at = fmt::format("{}[{}]", where, i);
    if (!p.is_array() || p.size() != 2 || !p[1].is_number()) ctx.fail(at, "expected [bytes, GB/s]");
    const std::uint64_t bytes = parse_size(p[0], ctx, at + "[0]");
    if (bytes == 0) ctx.fail(at + "[0]", "a request size must be at least 1 byte");
    points.push_back({bytes, p[1].get<double>()});
  }
  try {
    ThroughputFunction check(points);
  } catch (const Error& e) {
    ctx.fail(where, e.what());
  }
  return points;
}

const json& member(const json& object, const char* key, const Context& ctx, const std::string& where) {
  if (!object.is_object() || !object.contains(key)) ctx.fail(where, fmt::format("missing \"{}\"", key));
  return object.at(key);
}

// A node, rank or memory index: a whole number from 0 to `max` (nlohmann would wrap -1 and
// truncate 1.7 without a word; MemoryId::key() keeps 20 bits of node, 24 of rank and 16 of index,
// so a larger one would be taken for another memory).
std::uint32_t parse_index(const json& value, std::uint32_t max, const Context& ctx, const std::string& where) {
  if (!value.is_number_unsigned() || value.get<std::uint64_t>() > max)
    ctx.fail(where, fmt::format("expected a whole number from 0 to {} (the most a memory name holds), got {}", max,
                                value.dump()));
  return value.get<std::uint32_t>();
}

// An optional string member.
std::string optional_string(const json& object, const char* key, std::string fallback, const Context& ctx,
                            const std::string& where) {
  if (!object.contains(key)) return fallback;
  const json& value = object.at(key);
  if (!value.is_string()) ctx.fail(where + "." + key, fmt::format("expected a string, got {}", value.dump()));
  return value.get<std::string>();
}

// A channel's src or dst: one memory name or a list of them, each declared under "nodes" (keyed
// by MemoryId::key()) and none listed twice.
std::vector<MemoryId> parse_memory_list(const json& value, const std::map<std::uint64_t, std::string>& declared,
                                        const Context& ctx, const std::string& where) {
  std::vector<MemoryId> ids;
  std::vector<std::string> places;
  auto one = [&](const json& v, const std::string& at) {
    if (!v.is_string()) ctx.fail(at, "expected a memory name such as \"node0/rank0/sys\"");
    MemoryId id;
    try {
      id = MemoryId::parse(v.get<std::string>());
    } catch (const Error& e) {
      ctx.fail(at, e.what());
    }
    if (!declared.contains(id.key()))
      ctx.fail(at, fmt::format("memory {} is not declared (no entry of \"nodes\" has it)", id.to_string()));
    for (std::size_t j = 0; j < ids.size(); ++j)
      if (ids[j] == id) ctx.fail(at, fmt::format("memory {} is listed twice (also {})", id.to_string(), places[j]));
    ids.push_back(id);
    places.push_back(at);
  };
  if (value.is_array()) {
    if (value.empty()) ctx.fail(where, "empty list of memories");
    for (std::size_t i = 0; i < value.size(); ++i) one(value[i], fmt::format("{}[{}]", where, i));
  } else {
    one(value, where);
  }
  return ids;
}

MachineDescription parse_document(const json& doc, const Context& ctx) {
  check_keys(doc, {"format", "name", "description", "shapes", "tables", "nodes", "resources", "channels"}, ctx,
             "top level");
  if (doc.contains("format") && doc["format"] != kFormat)
    ctx.fail("format", fmt::format("unsupported format {} (this build reads \"{}\")", doc["format"].dump(), kFormat));
  MachineDescription m;
  m.name = optional_string(doc, "name", ctx.origin, ctx, "top level");
  m.description = optional_string(doc, "description", std::string(), ctx, "top level");

  std::map<std::string, std::vector<ThroughputFunction::Sample>> shapes, tables;
  for (const char* group : {"shapes", "tables"}) {
    if (!doc.contains(group)) continue;
    if (!doc[group].is_object()) ctx.fail(group, "expected an object of NAME: [[bytes, GB/s]...]");
    auto& into = std::string_view(group) == "shapes" ? shapes : tables;
    for (const auto& item : doc[group].items())
      into[item.key()] = parse_points(item.value(), ctx, fmt::format("{}.{}", group, item.key()));
  }

  std::map<std::uint64_t, std::string> declared;  // MemoryId::key() -> the entry declaring it
  const json& nodes = member(doc, "nodes", ctx, "top level");
  if (!nodes.is_array()) ctx.fail("nodes", "expected an array");
  for (std::size_t n = 0; n < nodes.size(); ++n) {
    std::string at = fmt::format("nodes[{}]", n);
    const json& node = nodes[n];
    check_keys(node, {"node", "ranks"}, ctx, at);
    const std::uint32_t node_id = parse_index(member(node, "node", ctx, at), MemoryId::max_node, ctx, at + ".node");
    const json& ranks = member(node, "ranks", ctx, at);
    if (!ranks.is_array()) ctx.fail(at + ".ranks", "expected an array");
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      std::string rat = fmt::format("{}.ranks[{}]", at, r);
      check_keys(ranks[r], {"rank", "memories"}, ctx, rat);
      const std::uint32_t rank_id =
          parse_index(member(ranks[r], "rank", ctx, rat), MemoryId::max_rank, ctx, rat + ".rank");
      const json& memories = member(ranks[r], "memories", ctx, rat);
      if (!memories.is_array()) ctx.fail(rat + ".memories", "expected an array");
      for (std::size_t k = 0; k < memories.size(); ++k) {
        std::string mat = fmt::format("{}.memories[{}]", rat, k);
        const json& mem = memories[k];
        check_keys(mem, {"kind", "index", "capacity"}, ctx, mat);
        MemoryDecl decl;
        decl.id.node = node_id;
        decl.id.rank = rank_id;
        const json& kind = member(mem, "kind", ctx, mat);
        try {
          decl.id.kind = parse_memory_kind(kind.is_string() ? kind.get<std::string>() : kind.dump());
        } catch (const Error& e) {
          ctx.fail(mat + ".kind", e.what());
        }
        decl.id.index =
            mem.contains("index") ? parse_index(mem["index"], MemoryId::max_index, ctx, mat + ".index") : 0u;
        if (mem.contains("capacity")) decl.capacity = parse_size(mem["capacity"], ctx, mat + ".capacity");
        auto [it, fresh] = declared.emplace(decl.id.key(), mat);
        if (!fresh)
          ctx.fail(mat, fmt::format("memory {} is declared twice (also {})", decl.id.to_string(), it->second));
        m.memories.push_back(decl);
      }
    }
  }

  std::map<std::string, std::string> resource_entries;  // name -> the entry declaring it
  if (doc.contains("resources")) {
    const json& resources = doc["resources"];
    if (!resources.is_array()) ctx.fail("resources", "expected an array");
    for (std::size_t i = 0; i < resources.size(); ++i) {
      std::string at = fmt::format("resources[{}]", i);
      check_keys(resources[i], {"name", "gbps"}, ctx, at);
      const json& name = member(resources[i], "name", ctx, at);
      const json& gbps = member(resources[i], "gbps", ctx, at);
      if (!name.is_string()) ctx.fail(at + ".name", "expected a string");
      if (!gbps.is_number() || !(gbps.get<double>() > 0))
        ctx.fail(at + ".gbps", fmt::format("expected a positive number (GB/s), got {}", gbps.dump()));
      auto [it, fresh] = resource_entries.emplace(name.get<std::string>(), at);
      if (!fresh)
        ctx.fail(at + ".name", fmt::format("resource '{}' is declared twice (also {})", it->first, it->second));
      m.resources.push_back({name.get<std::string>(), gbps.get<double>()});
    }
  }

  // (kind, src, dst) -> the channels[] entry that made it: a repeat would be a second edge, and
  // max-flow and multi-path planning would count its bandwidth twice.
  std::map<std::tuple<ChannelKind, std::uint64_t, std::uint64_t>, std::size_t> made;
  const json& channels = member(doc, "channels", ctx, "top level");
  if (!channels.is_array()) ctx.fail("channels", "expected an array");
  for (std::size_t i = 0; i < channels.size(); ++i) {
    std::string at = fmt::format("channels[{}]", i);
    const json& c = channels[i];
    check_keys(c, {"kind", "src", "dst", "pairs", "throughput", "shares"}, ctx, at);
    ChannelKind kind{};
    const json& kind_value = member(c, "kind", ctx, at);
    try {
      kind = parse_channel_kind(kind_value.is_string() ? kind_value.get<std::string>() : kind_value.dump());
    } catch (const Error& e) {
      ctx.fail(at + ".kind", e.what());
    }
    auto srcs = parse_memory_list(member(c, "src", ctx, at), declared, ctx, at + ".src");
    auto dsts = parse_memory_list(member(c, "dst", ctx, at), declared, ctx, at + ".dst");
    std::string pairs = optional_string(c, "pairs", "all", ctx, at);
    if (pairs != "all" && pairs != "distinct") ctx.fail(at + ".pairs", "expected \"all\" or \"distinct\"");
    const json& tp = member(c, "throughput", ctx, at);
    ThroughputFunction function;
    try {
      if (tp.is_number()) {
        function = ThroughputFunction::flat(tp.get<double>());
      } else if (tp.is_array()) {
        function = ThroughputFunction(parse_points(tp, ctx, at + ".throughput"));
      } else if (tp.is_string()) {
        auto it = tables.find(tp.get<std::string>());
        if (it == tables.end()) ctx.fail(at + ".throughput", fmt::format("no table named '{}' in \"tables\"", tp.get<std::string>()));
        function = ThroughputFunction(it->second);
      } else if (tp.is_object()) {
        check_keys(tp, {"shape", "gbps"}, ctx, at + ".throughput");
        const json& shape = member(tp, "shape", ctx, at + ".throughput");
        const json& gbps = member(tp, "gbps", ctx, at + ".throughput");
        if (!shape.is_string() || !gbps.is_number()) ctx.fail(at + ".throughput", "expected {\"shape\": name, \"gbps\": peak}");
        auto it = shapes.find(shape.get<std::string>());
        if (it == shapes.end()) ctx.fail(at + ".throughput", fmt::format("no shape named '{}' in \"shapes\"", shape.get<std::string>()));
        function = ThroughputFunction::scaled(it->second, gbps.get<double>());
      } else {
        ctx.fail(at + ".throughput", "expected GB/s, [[bytes, GB/s]...], a table name or {\"shape\", \"gbps\"}");
      }
    } catch (const Error& e) {
      if (std::string_view(e.what()).rfind("machine file", 0) == 0) throw;
      ctx.fail(at + ".throughput", e.what());
    }
    std::vector<std::string> shares;
    if (c.contains("shares")) {
      if (!c["shares"].is_array()) ctx.fail(at + ".shares", "expected an array of resource names");
      for (std::size_t k = 0; k < c["shares"].size(); ++k) {
        const json& s = c["shares"][k];
        std::string sat = fmt::format("{}.shares[{}]", at, k);
        if (!s.is_string()) ctx.fail(sat, fmt::format("expected a resource name, got {}", s.dump()));
        if (!resource_entries.contains(s.get<std::string>()))
          ctx.fail(sat, fmt::format("resource '{}' is not declared in \"resources\"", s.get<std::string>()));
        shares.push_back(s.get<std::string>());
      }
    }
    for (const auto& s : srcs)
      for (const auto& d : dsts) {
        if (pairs == "distinct" && s == d) continue;
        auto [it, fresh] = made.emplace(std::tuple{kind, s.key(), d.key()}, i);
        if (!fresh)
          ctx.fail(at,
                   fmt::format("channel {} {} -> {} is also made by channels[{}] (one channel per kind, src and dst: "
                               "a repeat would count its bandwidth twice)",
                               to_string(kind), s.to_string(), d.to_string(), it->second));
        m.channels.push_back({kind, s, d, function, shares});
      }
  }
  return m;
}

}  // namespace

MachineDescription parse_machine_json(std::string_view text, std::string_view origin) {
  Context ctx{std::string(origin)};
  MachineDescription m;
  // nlohmann's own errors (a syntax error, a number such as 1e400 that overflows a double) become
  // caravan errors with the origin.
  try {
    m = parse_document(json::parse(text.begin(), text.end()), ctx);
  } catch (const json::exception& e) {
    ctx.fail("JSON", e.what());
  }
  // Build once so that what the entries cannot show (the graph's own rules) fails here, with the origin.
  try {
    TransferGraph check(m);
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("machine file {}: {}", origin, e.what()));
  }
  return m;
}

MachineDescription load_machine_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(Errc::not_found, fmt::format("machine file '{}' cannot be opened", path));
  std::stringstream text;
  text << in.rdbuf();
  return parse_machine_json(text.str(), path);
}

std::string to_machine_json(const MachineDescription& machine) {
  json doc;
  doc["format"] = kFormat;
  doc["name"] = machine.name;
  doc["description"] = machine.description;
  // Nodes and ranks in order of first appearance.
  json nodes = json::array();
  std::map<std::uint32_t, std::map<std::uint32_t, json>> grouped;
  for (const auto& m : machine.memories) {
    json mem{{"kind", std::string(to_string(m.id.kind))}};
    if (m.id.index) mem["index"] = m.id.index;
    if (m.capacity) mem["capacity"] = m.capacity;
    grouped[m.id.node][m.id.rank].push_back(mem);
  }
  for (auto& [node, ranks] : grouped) {
    json rank_list = json::array();
    for (auto& [rank, memories] : ranks) rank_list.push_back({{"rank", rank}, {"memories", memories}});
    nodes.push_back({{"node", node}, {"ranks", rank_list}});
  }
  doc["nodes"] = nodes;
  json resources = json::array();
  for (const auto& r : machine.resources) resources.push_back({{"name", r.name}, {"gbps", r.gbps}});
  doc["resources"] = resources;
  // Identical throughput tables are written once and named.
  json tables = json::object();
  std::vector<const ThroughputFunction*> seen;
  json channels = json::array();
  for (const auto& c : machine.channels) {
    std::size_t id = 0;
    while (id < seen.size() && !(*seen[id] == c.tp)) ++id;
    if (id == seen.size()) {
      seen.push_back(&c.tp);
      json points = json::array();
      for (const auto& s : c.tp.samples()) points.push_back({s.bytes, s.gbps});
      tables[fmt::format("t{}", id)] = points;
    }
    json ch{{"kind", std::string(to_string(c.kind))}, {"src", c.src.to_string()}, {"dst", c.dst.to_string()},
            {"throughput", fmt::format("t{}", id)}};
    if (!c.shares.empty()) ch["shares"] = c.shares;
    channels.push_back(ch);
  }
  doc["tables"] = tables;
  doc["channels"] = channels;
  return doc.dump(1);
}

MachineDescription builtin_machine(std::string_view name) {
  std::string_view text = detail::builtin_machine_text(name);
  if (text.empty()) {
    std::string names;
    for (const auto& n : builtin_machine_names()) names += (names.empty() ? "" : ", ") + n;
    throw Error(Errc::not_found, fmt::format("no built-in machine named '{}' (built-in: {})", name, names));
  }
  return parse_machine_json(text, fmt::format("{} (built-in)", name));
}

std::vector<std::string> builtin_machine_names() { return detail::builtin_machine_list(); }

MachineDescription generate_cluster(const ClusterSpec& spec) {
  // Node pairs each get NIC channels, so the description grows with nodes^2: 1024 x 8 took 3 GB
  // (217 MB as a file), and 4096 nodes ran out of memory.
  if (spec.nodes < 1 || spec.gpus_per_node < 1 || spec.nodes > 1024 || spec.gpus_per_node > 64 ||
      spec.nodes * spec.gpus_per_node > 16384)
    throw Error(Errc::invalid_argument,
                fmt::format("cluster {}x{}: nodes must be 1..1024, GPUs per node 1..64, and nodes x GPUs at most 16384 "
                            "(the description grows with the square of the nodes: 1024 x 8 takes 3 GB)",
                            spec.nodes, spec.gpus_per_node));
  using S = ThroughputFunction::Sample;
  constexpr std::uint64_t K = 1024, M = K * K, G = M * K;
  // Measured on one H200 node (shared/reference/measured-h200x4.md): pinned host <-> device and
  // peer copy-engine throughput per request size, one stream.
  const ThroughputFunction pinned({{4 * K, 1.62}, {64 * K, 16.97}, {M, 47.90}, {4 * M, 53.24}, {16 * M, 54.68}, {64 * M, 55.15}, {256 * M, 55.4}});
  const ThroughputFunction peer({{4 * K, 1.54}, {64 * K, 23.96}, {M, 198.4}, {4 * M, 314.4}, {16 * M, 364.9}, {256 * M, 394.0}});
  std::vector<S> peer_shape;
  for (const auto& s : peer.samples()) peer_shape.push_back({s.bytes, s.gbps / 394.0});
  std::vector<S> pinned_shape;
  for (const auto& s : pinned.samples()) pinned_shape.push_back({s.bytes, s.gbps / 55.4});
  // Assumed (not measured): host memcpy, a layout-converting GPU kernel, and the NIC.
  const auto memcpy_tp = ThroughputFunction::scaled({{8, 0.3}, {64, 0.7}, {4 * K, 1.0}}, 20.0);
  const auto convert_tp = ThroughputFunction::scaled({{4, 0.05}, {64, 0.3}, {4 * K, 0.8}, {64 * K, 1.0}}, 600.0);
  const auto local_tp = ThroughputFunction::scaled(peer_shape, 2077.0);
  const auto pageable_tp = ThroughputFunction::scaled(pinned_shape, 8.1);
  const auto nic_tp = ThroughputFunction::scaled({{4 * K, 0.1}, {64 * K, 0.5}, {M, 0.9}, {8 * M, 1.0}}, 48.0);

  MachineDescription m;
  m.name = fmt::format("cluster-{}x{}", spec.nodes, spec.gpus_per_node);
  m.description = fmt::format("{} nodes x {} GPUs, generated (caravan machine generate): H200-like GPUs (measured table), "
                              "one 48 GB/s NIC per node between registered host memories",
                              spec.nodes, spec.gpus_per_node);
  auto G_ = static_cast<std::uint32_t>(spec.gpus_per_node);
  for (std::uint32_t n = 0; n < static_cast<std::uint32_t>(spec.nodes); ++n) {
    std::uint32_t base = n * G_;
    MemoryId sys{n, base, MemoryKind::sys, 0}, zcm{n, base, MemoryKind::zcm, 0}, reg{n, base, MemoryKind::reg, 0};
    m.memories.push_back({sys, 1536 * G});
    m.memories.push_back({zcm, 64 * G});
    m.memories.push_back({reg, 64 * G});
    std::string node = fmt::format("node{}", n);
    m.resources.push_back({node + "/host.h2d", 44.9 * spec.gpus_per_node});
    if (spec.nodes > 1) {
      m.resources.push_back({node + "/nic.out", 48.0});
      m.resources.push_back({node + "/nic.in", 48.0});
    }
    for (auto a : {sys, zcm, reg})
      for (auto b : {sys, zcm, reg}) m.channels.push_back({ChannelKind::memcpy, a, b, memcpy_tp, {}});
    for (std::uint32_t g = 0; g < G_; ++g) {
      MemoryId fbm{n, base + g, MemoryKind::fbm, 0};
      m.memories.push_back({fbm, 141 * G});
      std::string gpu = fmt::format("{}/gpu{}", node, g);
      m.resources.push_back({gpu + ".pcie.h2d", 55.4});
      m.resources.push_back({gpu + ".pcie.d2h", 55.4});
      m.resources.push_back({gpu + ".nvlink.out", 394.0});
      m.resources.push_back({gpu + ".nvlink.in", 397.0});
      for (auto host : {zcm, reg}) {
        m.channels.push_back({ChannelKind::sdma, host, fbm, pinned, {gpu + ".pcie.h2d", node + "/host.h2d"}});
        m.channels.push_back({ChannelKind::sdma, fbm, host, pinned, {gpu + ".pcie.d2h"}});
      }
      m.channels.push_back({ChannelKind::sdma, sys, fbm, pageable_tp, {gpu + ".pcie.h2d", node + "/host.h2d"}});
      m.channels.push_back({ChannelKind::sdma, fbm, sys, pageable_tp, {gpu + ".pcie.d2h"}});
      m.channels.push_back({ChannelKind::sdma, fbm, fbm, local_tp, {}});
      m.channels.push_back({ChannelKind::gpu_convert, fbm, fbm, convert_tp, {}});
      for (std::uint32_t h = 0; h < G_; ++h) {
        if (h == g) continue;
        MemoryId peer_fbm{n, base + h, MemoryKind::fbm, 0};
        m.channels.push_back({ChannelKind::xgmi, fbm, peer_fbm, peer,
                              {gpu + ".nvlink.out", fmt::format("{}/gpu{}.nvlink.in", node, h)}});
      }
    }
  }
  for (std::uint32_t a = 0; a < static_cast<std::uint32_t>(spec.nodes); ++a)
    for (std::uint32_t b = 0; b < static_cast<std::uint32_t>(spec.nodes); ++b) {
      if (a == b) continue;
      m.channels.push_back({ChannelKind::nic, MemoryId{a, a * G_, MemoryKind::reg, 0}, MemoryId{b, b * G_, MemoryKind::reg, 0}, nic_tp,
                            {fmt::format("node{}/nic.out", a), fmt::format("node{}/nic.in", b)}});
    }
  return m;
}

MachineDescription resolve_machine(std::string_view spec) {
  if (spec == "local") return describe_local_machine();
  if (spec.rfind("generate:", 0) == 0) {
    std::string_view rest = spec.substr(9);
    auto x = rest.find('x');
    int nodes = 0, gpus = 0;
    bool ok = x != std::string_view::npos;
    if (ok) {
      auto [p1, e1] = std::from_chars(rest.data(), rest.data() + x, nodes);
      auto [p2, e2] = std::from_chars(rest.data() + x + 1, rest.data() + rest.size(), gpus);
      ok = e1 == std::errc() && e2 == std::errc() && p1 == rest.data() + x && p2 == rest.data() + rest.size();
    }
    if (!ok) throw Error(Errc::invalid_argument, fmt::format("machine '{}': expected generate:NODESxGPUS, e.g. generate:64x8", spec));
    return generate_cluster({nodes, gpus});
  }
  if (!detail::builtin_machine_text(spec).empty()) return builtin_machine(spec);
  std::error_code ignored;
  if (!std::filesystem::exists(std::filesystem::path(spec), ignored)) {
    // Most likely a misspelt name: say what the accepted forms are.
    std::string names;
    for (const auto& n : builtin_machine_names()) names += (names.empty() ? "" : ", ") + n;
    throw Error(Errc::not_found, fmt::format("machine '{}': no built-in machine has that name and no file is there; "
                                             "expected local, a built-in machine ({}), generate:NODESxGPUS or the "
                                             "path of a machine file",
                                             spec, names));
  }
  return load_machine_file(std::string(spec));
}

MachineDescription machine_from_settings() { return resolve_machine(settings::get_string("CARAVAN_PLANNER_MACHINE")); }

}  // namespace caravan::planner
