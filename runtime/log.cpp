#include "runtime/log.h"

#include <caravan/settings.h>

#include <spdlog/sinks/stdout_color_sinks.h>

#include <mutex>
#include <string>

namespace caravan::log {
namespace {

std::mutex g_mutex;

spdlog::level::level_enum configured_level() {
  return spdlog::level::from_str(settings::get_string("CARAVAN_LOG_LEVEL"));
}

}  // namespace

std::shared_ptr<spdlog::logger> get(std::string_view subsystem) {
  std::string name = "caravan." + std::string(subsystem);
  if (auto existing = spdlog::get(name)) return existing;
  std::lock_guard lock(g_mutex);
  if (auto existing = spdlog::get(name)) return existing;
  auto logger = spdlog::stderr_color_mt(name);
  logger->set_pattern("[%H:%M:%S.%f] [%n] [%^%l%$] %v");
  logger->set_level(configured_level());
  return logger;
}

void apply_level_setting() {
  auto level = configured_level();
  spdlog::apply_all([level](const std::shared_ptr<spdlog::logger>& logger) {
    if (logger->name().rfind("caravan.", 0) == 0) logger->set_level(level);
  });
}

}  // namespace caravan::log
