// Named loggers, one per subsystem ("runtime", "event", "task", "planner", "dma", "chan.nic",
// "gpu"...). Their level is CARAVAN_LOG_LEVEL; they write to stderr.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string_view>

namespace caravan::log {

// The logger of `subsystem`, created on first use. Cheap to call; cache it in hot code.
std::shared_ptr<spdlog::logger> get(std::string_view subsystem);

// Re-reads CARAVAN_LOG_LEVEL and applies it to every logger.
void apply_level_setting();

}  // namespace caravan::log
