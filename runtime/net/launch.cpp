#include "runtime/net/launch.h"

#include <caravan/error.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include <unistd.h>

#include <charconv>
#include <climits>
#include <cstdlib>

namespace caravan::net {
namespace {

constexpr int kMaxWorldSize = 65535;  // Event stores its owner rank in 16 bits

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  if (!value) return std::nullopt;
  return std::string(value);
}

int parse_env_int(const char* name, const std::string& text) {
  int value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty())
    throw Error(Errc::invalid_argument, fmt::format("{}='{}': expected an integer", name, text));
  return value;
}

}  // namespace

std::string host_name() {
  char buffer[HOST_NAME_MAX + 1] = {};
  if (gethostname(buffer, sizeof(buffer) - 1) != 0) return "localhost";
  return buffer;
}

std::optional<LaunchOptions> launch_from_environment() {
  auto world = env("WORLD_SIZE");
  if (!world) return std::nullopt;
  LaunchOptions launch;
  launch.world_size = parse_env_int("WORLD_SIZE", *world);
  auto rank = env("RANK");
  if (!rank && launch.world_size > 1)
    throw Error(Errc::invalid_argument,
                fmt::format("WORLD_SIZE={} is set but RANK is not: a launcher sets both", launch.world_size));
  launch.rank = rank ? parse_env_int("RANK", *rank) : 0;
  if (auto addr = env("MASTER_ADDR")) launch.master_addr = *addr;
  if (auto port = env("MASTER_PORT")) launch.master_port = parse_env_int("MASTER_PORT", *port);
  std::string key = host_name();
  if (auto node = env("CARAVAN_NODE")) key += "#node" + *node;
  else if (auto group = env("GROUP_RANK")) key += "#group" + *group;
  launch.node_key = key;
  if (auto id = env("CARAVAN_JOB_ID")) launch.job_id = *id;
  return validated(std::move(launch), true);
}

LaunchOptions validated(LaunchOptions launch, bool from_environment) {
  const char* world_name = from_environment ? "WORLD_SIZE" : "LaunchOptions::world_size";
  const char* rank_name = from_environment ? "RANK" : "LaunchOptions::rank";
  const char* port_name = from_environment ? "MASTER_PORT" : "LaunchOptions::master_port";
  const char* addr_name = from_environment ? "MASTER_ADDR" : "LaunchOptions::master_addr";
  if (launch.world_size < 1 || launch.world_size > kMaxWorldSize)
    throw Error(Errc::invalid_argument,
                fmt::format("{}={}: must be in [1, {}]", world_name, launch.world_size, kMaxWorldSize));
  if (launch.rank < 0 || launch.rank >= launch.world_size)
    throw Error(Errc::invalid_argument, fmt::format("{}={}: must be in [0, {}={})", rank_name, launch.rank,
                                                    world_name, launch.world_size));
  if (launch.world_size > 1) {
    if (launch.master_port < 1 || launch.master_port > 65535)
      throw Error(Errc::invalid_argument,
                  fmt::format("{}={}: must be a TCP port in [1, 65535] when {} > 1 (rank 0 listens on it)", port_name,
                              launch.master_port, world_name));
    if (launch.master_addr.empty())
      throw Error(Errc::invalid_argument, fmt::format("{} is empty: it names the host of rank 0", addr_name));
  }
  if (launch.node_key.empty()) launch.node_key = host_name();
  const bool id_ok = launch.job_id.size() <= 64 && std::all_of(launch.job_id.begin(), launch.job_id.end(), [](char c) {
                       return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
                     });
  if (!id_ok)
    throw Error(Errc::invalid_argument,
                fmt::format("{}='{}': a job id is at most 64 letters, digits, '_' and '-'",
                            from_environment ? "CARAVAN_JOB_ID" : "LaunchOptions::job_id", launch.job_id));
  return launch;
}

}  // namespace caravan::net
