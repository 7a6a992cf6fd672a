// Unit: how a rank learns its job from RuntimeOptions or the launcher's environment, and what a
// runtime alone (no job) reports.
#include "runtime/net/launch.h"
#include "tests/runtime/test_util.h"

#include <cstdlib>
#include <map>
#include <optional>

namespace caravan::net {
namespace {

// Sets job variables for one test and restores them after.
class Environment {
 public:
  explicit Environment(std::map<std::string, std::optional<std::string>> values) {
    for (auto& [name, value] : values) {
      const char* old = std::getenv(name.c_str());
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      if (value) setenv(name.c_str(), value->c_str(), 1);
      else unsetenv(name.c_str());
    }
  }
  ~Environment() {
    for (auto& [name, value] : saved_) {
      if (value) setenv(name.c_str(), value->c_str(), 1);
      else unsetenv(name.c_str());
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

const std::map<std::string, std::optional<std::string>> kNoJob = {
    {"RANK", std::nullopt},          {"WORLD_SIZE", std::nullopt},   {"MASTER_ADDR", std::nullopt},
    {"MASTER_PORT", std::nullopt},   {"CARAVAN_NODE", std::nullopt}, {"GROUP_RANK", std::nullopt},
    {"CARAVAN_JOB_ID", std::nullopt}};

TEST(Launch, NoWorldSizeMeansNoJob) {
  Environment env(kNoJob);
  EXPECT_FALSE(launch_from_environment().has_value());
}

TEST(Launch, TorchrunVariablesDescribeTheJob) {
  auto values = kNoJob;
  values["RANK"] = "3";
  values["WORLD_SIZE"] = "4";
  values["MASTER_ADDR"] = "10.0.0.7";
  values["MASTER_PORT"] = "29500";
  values["GROUP_RANK"] = "1";
  Environment env(values);
  auto launch = launch_from_environment();
  ASSERT_TRUE(launch.has_value());
  EXPECT_EQ(launch->rank, 3);
  EXPECT_EQ(launch->world_size, 4);
  EXPECT_EQ(launch->master_addr, "10.0.0.7");
  EXPECT_EQ(launch->master_port, 29500);
  EXPECT_EQ(launch->node_key, host_name() + "#group1");
}

TEST(Launch, CaravanNodeSplitsOneHost) {
  auto values = kNoJob;
  values["RANK"] = "0";
  values["WORLD_SIZE"] = "2";
  values["MASTER_PORT"] = "29500";
  values["CARAVAN_NODE"] = "1";
  Environment env(values);
  auto launch = launch_from_environment();
  ASSERT_TRUE(launch.has_value());
  EXPECT_EQ(launch->master_addr, "127.0.0.1");  // the default when MASTER_ADDR is unset
  EXPECT_EQ(launch->node_key, host_name() + "#node1");
}

TEST(Launch, BadValuesNameTheVariableAndTheRule) {
  {
    auto values = kNoJob;
    values["WORLD_SIZE"] = "4";
    values["RANK"] = "4";
    values["MASTER_PORT"] = "1";
    Environment env(values);
    CARAVAN_EXPECT_ERROR(launch_from_environment(), Errc::invalid_argument, "RANK=4: must be in [0, WORLD_SIZE=4)");
  }
  {
    auto values = kNoJob;
    values["WORLD_SIZE"] = "two";
    Environment env(values);
    CARAVAN_EXPECT_ERROR(launch_from_environment(), Errc::invalid_argument, "WORLD_SIZE='two': expected an integer");
  }
  {
    auto values = kNoJob;
    values["WORLD_SIZE"] = "2";
    Environment env(values);
    CARAVAN_EXPECT_ERROR(launch_from_environment(), Errc::invalid_argument, "RANK is not");
  }
  {
    auto values = kNoJob;
    values["WORLD_SIZE"] = "2";
    values["RANK"] = "1";
    Environment env(values);
    CARAVAN_EXPECT_ERROR(launch_from_environment(), Errc::invalid_argument, "MASTER_PORT=0: must be a TCP port");
  }
  CARAVAN_EXPECT_ERROR(validated(LaunchOptions{.rank = 0, .world_size = 70000}, false), Errc::invalid_argument,
                       "LaunchOptions::world_size=70000: must be in [1, 65535]");
  {
    // The job id names files in /dev/shm: no '/', nothing long.
    auto values = kNoJob;
    values["WORLD_SIZE"] = "1";
    values["CARAVAN_JOB_ID"] = "../x";
    Environment env(values);
    CARAVAN_EXPECT_ERROR(launch_from_environment(), Errc::invalid_argument,
                         "CARAVAN_JOB_ID='../x': a job id is at most 64 letters, digits, '_' and '-'");
  }
  {
    auto values = kNoJob;
    values["WORLD_SIZE"] = "1";
    values["CARAVAN_JOB_ID"] = "job-7_a";
    Environment env(values);
    EXPECT_EQ(launch_from_environment()->job_id, "job-7_a");
  }
}

TEST(Launch, RuntimeAloneIsRankZeroOfOne) {
  Environment env(kNoJob);
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  EXPECT_EQ(rt.rank(), 0);
  EXPECT_EQ(rt.world_size(), 1);
  EXPECT_EQ(rt.node(), 0);
  EXPECT_EQ(rt.node_count(), 1);
  EXPECT_EQ(rt.rank_info(0).pid, static_cast<int>(getpid()));
  EXPECT_EQ(rt.ranks_on_node(0), std::vector<int>{0});
  EXPECT_NO_THROW(rt.barrier());
  // The default processor is this rank's; rank 1 does not exist in a job of one.
  test::task("launch.noop", [](TaskContext& ctx) {
    if (ctx.processor.rank != 0) throw Error(Errc::internal, "wrong processor");
  });
  EXPECT_NO_THROW(rt.spawn("launch.noop").wait());
  CARAVAN_EXPECT_ERROR(rt.spawn("launch.noop", {}, {.processor = Processor{ProcessorKind::cpu, 1, 0}}),
                       Errc::invalid_argument, "this job has 1 rank(s)");
  CARAVAN_EXPECT_ERROR(Event::from_parts(0, 1, 1, 1).wait(), Errc::invalid_argument, "this job has 1 rank(s)");
}

TEST(Launch, BadLaunchOptionsAreRejectedBeforeAnythingStarts) {
  CARAVAN_EXPECT_ERROR(Runtime(RuntimeOptions{.launch = LaunchOptions{.rank = 2, .world_size = 2}}),
                       Errc::invalid_argument, "LaunchOptions::rank=2");
  CARAVAN_EXPECT_ERROR(Runtime(RuntimeOptions{.launch = LaunchOptions{.rank = 1, .world_size = 2, .master_port = 0}}),
                       Errc::invalid_argument, "LaunchOptions::master_port=0");
  EXPECT_FALSE(Runtime::is_running());
}

TEST(Launch, AJoinerThatFindsNoRankZeroTimesOut) {
  settings::ScopedOverride timeout("CARAVAN_BOOTSTRAP_TIMEOUT_S", "0.5");
  auto start = std::chrono::steady_clock::now();
  // Nobody listens on this port: the joiner retries, then gives up with the reason.
  CARAVAN_EXPECT_ERROR(Runtime(RuntimeOptions{.cpu_workers = 1,
                                              .launch = LaunchOptions{.rank = 1, .world_size = 2, .master_port = 9}}),
                       Errc::timeout, "no welcome from rank 0 at 127.0.0.1:9");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_FALSE(Runtime::is_running());
}

TEST(Launch, RankZeroAloneTimesOutNamingTheMissingRanks) {
  settings::ScopedOverride timeout("CARAVAN_BOOTSTRAP_TIMEOUT_S", "0.3");
  CARAVAN_EXPECT_ERROR(Runtime(RuntimeOptions{.cpu_workers = 1,
                                              .launch = LaunchOptions{.rank = 0, .world_size = 3, .master_port = 0}}),
                       Errc::invalid_argument, "master_port=0");
  // A real port, that nobody else joins.
  CARAVAN_EXPECT_ERROR(Runtime(RuntimeOptions{.cpu_workers = 1,
                                              .launch = LaunchOptions{.rank = 0, .world_size = 3, .master_port = 29517}}),
                       Errc::timeout, "rank(s) 1, 2 did not join");
  EXPECT_FALSE(Runtime::is_running());
}

}  // namespace
}  // namespace caravan::net
