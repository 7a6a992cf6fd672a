// Settings: every knob a user can tune is one CARAVAN_* setting, declared once in one table
// (runtime/settings.cpp) with its type, default, allowed range and a one-line doc.
// A value comes from, in order: an override set in the program, the environment, the default.
// `caravan config` prints the whole table.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace caravan::settings {

enum class Source { default_value, environment, override_value };

struct SettingView {
  std::string name;
  std::string type;  // "int", "bytes", "double" with their range ("int in [0, 64]"), "bool", "string", "one of a|b|c"
  std::string default_value;
  std::string current_value;  // as it will be read now (validated; see error)
  Source source = Source::default_value;
  std::string doc;
  std::string error;          // non-empty if the current value is invalid
};

// All settings, in table order; a value that breaks a rule between settings (see
// peer_timeout_error) carries that error too.
std::vector<SettingView> list();

// The rule between CARAVAN_PEER_TIMEOUT_S and CARAVAN_HEARTBEAT_MS (a peer is judged by its
// heartbeats: the timeout must cover three), as an error message naming both; empty when kept.
std::string peer_timeout_error();

// A CARAVAN_* variable of the environment that is no setting: most likely a typo, which would
// otherwise be ignored without a word. `suggestion` is the closest setting name, if one is close.
struct UnknownVariable {
  std::string name;
  std::string suggestion;  // empty when nothing is close
};
// Those of this process's environment, in environment order. CARAVAN_NODE (set by `caravan run`
// for each rank) and CARAVAN_TEST_* (read by test programs) are not settings and not reported.
// The `caravan` tool refuses to run with one; a Runtime logs a warning for each.
std::vector<UnknownVariable> unknown_environment_variables();

// Typed reads. Each throws caravan::Error(invalid_argument) naming the variable, its value and
// the rule when the value does not parse or is out of range, and Error(not_found) for a name
// that is not in the table.
std::int64_t get_int(std::string_view name);
std::uint64_t get_bytes(std::string_view name);  // accepts suffixes K, M, G, T (powers of 1024)
double get_double(std::string_view name);
bool get_bool(std::string_view name);              // 1/0, true/false, yes/no, on/off
std::string get_string(std::string_view name);     // for enums: one of the allowed choices

// The one grammar of byte counts, for settings and command-line options alike: a whole number
// with an optional suffix K, M, G or T (powers of 1024; any case, optionally followed by i and
// B: 64K, 64k, 64KiB, 64KB). Throws Error(invalid_argument) naming `what`, the text and the rule;
// negative numbers, fractions and counts past 2^64 are refused.
std::uint64_t parse_byte_count(std::string_view text, std::string_view what);

// Overrides take precedence over the environment (for command-line flags and tests).
// The value is validated at once; a bad one throws and leaves the previous state unchanged.
void set_override(std::string_view name, std::string value);
void clear_override(std::string_view name);

// Restores an override (or its absence) when it leaves scope.
class ScopedOverride {
 public:
  ScopedOverride(std::string_view name, std::string value);
  ~ScopedOverride();
  ScopedOverride(const ScopedOverride&) = delete;
  ScopedOverride& operator=(const ScopedOverride&) = delete;

 private:
  std::string name_;
  bool had_previous_ = false;
  std::string previous_;
};

}  // namespace caravan::settings
