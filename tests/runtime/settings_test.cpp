#include "tests/runtime/test_util.h"

#include <cstdlib>

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
