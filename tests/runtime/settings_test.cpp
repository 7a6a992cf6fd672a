#include "tests/runtime/test_util.h"

#include <cstdlib>
#include <limits>
#include <map>
#include <string>

namespace caravan {
namespace {

TEST(Settings, EveryEntryIsDocumentedAndValidByDefault) {
  auto all = settings::list();
  ASSERT_FALSE(all.empty());
  for (const auto& s : all) {
    EXPECT_EQ(s.name.rfind("CARAVAN_", 0), 0u) << s.name;
    EXPECT_FALSE(s.doc.empty()) << s.name;
    if (s.source == settings::Source::default_value) {
      EXPECT_TRUE(s.error.empty()) << s.name << ": " << s.error;
    }
  }
}

TEST(Settings, OverrideBeatsEnvironmentBeatsDefault) {
  ::unsetenv("CARAVAN_WAIT_SPIN_US");
  EXPECT_EQ(settings::get_int("CARAVAN_WAIT_SPIN_US"), -1);  // automatic
  ::setenv("CARAVAN_WAIT_SPIN_US", "7", 1);
  EXPECT_EQ(settings::get_int("CARAVAN_WAIT_SPIN_US"), 7);
  {
    settings::ScopedOverride o("CARAVAN_WAIT_SPIN_US", "3");
    EXPECT_EQ(settings::get_int("CARAVAN_WAIT_SPIN_US"), 3);
  }
  EXPECT_EQ(settings::get_int("CARAVAN_WAIT_SPIN_US"), 7);
  ::unsetenv("CARAVAN_WAIT_SPIN_US");
}

TEST(Settings, BadValuesNameTheVariableAndTheRule) {
  ::setenv("CARAVAN_WAIT_SPIN_US", "12abc", 1);
  CARAVAN_EXPECT_ERROR(settings::get_int("CARAVAN_WAIT_SPIN_US"), Errc::invalid_argument,
                       "CARAVAN_WAIT_SPIN_US='12abc': expected an integer");
  ::setenv("CARAVAN_WAIT_SPIN_US", "-5", 1);
  CARAVAN_EXPECT_ERROR(settings::get_int("CARAVAN_WAIT_SPIN_US"), Errc::invalid_argument, "must be in [-1, 1000000]");
  ::unsetenv("CARAVAN_WAIT_SPIN_US");
  CARAVAN_EXPECT_ERROR(settings::set_override("CARAVAN_LOG_LEVEL", "loud"), Errc::invalid_argument,
                       "must be one of trace|debug|info|warn|error|critical|off");
  CARAVAN_EXPECT_ERROR(settings::get_int("CARAVAN_NO_SUCH"), Errc::not_found, "unknown setting 'CARAVAN_NO_SUCH'");
  CARAVAN_EXPECT_ERROR(settings::set_override("CARAVAN_NO_SUCH", "1"), Errc::not_found, "CARAVAN_NO_SUCH");
}

TEST(Settings, NotANumberIsRejectedEvenWhereTheRangeIsOpen) {
  // [0.01, inf]: NaN compares false against both ends, so the range alone would let it through.
  ::setenv("CARAVAN_DMA_STALL_S", "nan", 1);
  CARAVAN_EXPECT_ERROR(settings::get_double("CARAVAN_DMA_STALL_S"), Errc::invalid_argument,
                       "CARAVAN_DMA_STALL_S='nan': must be a number in [0.01, inf]");
  ::setenv("CARAVAN_DMA_STALL_S", "inf", 1);
  EXPECT_EQ(settings::get_double("CARAVAN_DMA_STALL_S"), std::numeric_limits<double>::infinity());
  ::unsetenv("CARAVAN_DMA_STALL_S");
}

TEST(Settings, MisspeltVariablesAreReportedWithTheClosestName) {
  ::setenv("CARAVAN_WAIT_SPIN", "5", 1);       // a prefix of CARAVAN_WAIT_SPIN_US
  ::setenv("CARAVAN_DMA_TILEBYTES", "1M", 1);  // one edit from CARAVAN_DMA_TILE_BYTES
  ::setenv("CARAVAN_SOMETHING_ELSE_ENTIRELY", "1", 1);
  ::setenv("CARAVAN_NODE", "1", 1);  // set by `caravan run`: not reported
  std::map<std::string, std::string> found;
  for (const auto& u : settings::unknown_environment_variables()) found[u.name] = u.suggestion;
  ::unsetenv("CARAVAN_WAIT_SPIN");
  ::unsetenv("CARAVAN_DMA_TILEBYTES");
  ::unsetenv("CARAVAN_SOMETHING_ELSE_ENTIRELY");
  ::unsetenv("CARAVAN_NODE");
  EXPECT_EQ(found["CARAVAN_WAIT_SPIN"], "CARAVAN_WAIT_SPIN_US");
  EXPECT_EQ(found["CARAVAN_DMA_TILEBYTES"], "CARAVAN_DMA_TILE_BYTES");
  ASSERT_TRUE(found.contains("CARAVAN_SOMETHING_ELSE_ENTIRELY"));
  EXPECT_EQ(found["CARAVAN_SOMETHING_ELSE_ENTIRELY"], "");
  EXPECT_FALSE(found.contains("CARAVAN_NODE"));
  EXPECT_FALSE(found.contains("CARAVAN_LOG_LEVEL"));  // a setting, set or not
}

TEST(Settings, ListReportsInvalidEnvironmentValues) {
  ::setenv("CARAVAN_LOG_LEVEL", "chatty", 1);
  bool found = false;
  for (const auto& s : settings::list()) {
    if (s.name != "CARAVAN_LOG_LEVEL") continue;
    found = true;
    EXPECT_EQ(s.source, settings::Source::environment);
    EXPECT_NE(s.error.find("chatty"), std::string::npos) << s.error;
  }
  EXPECT_TRUE(found);
  ::unsetenv("CARAVAN_LOG_LEVEL");
}

TEST(Settings, LogLevelIsCaseInsensitive) {
  settings::ScopedOverride o("CARAVAN_LOG_LEVEL", "DEBUG");
  EXPECT_EQ(settings::get_string("CARAVAN_LOG_LEVEL"), "debug");
}

}  // namespace
}  // namespace caravan
