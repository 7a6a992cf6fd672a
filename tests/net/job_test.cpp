// Multi-process: the rendezvous, the rank table, barriers, and the launcher's environment.
#include "tests/net/net_test_util.h"

#include <cstdlib>
#include <set>

namespace caravan {
namespace {

using test::JobTest;

TEST_F(JobTest, RanksMatchTheLaunchersEnvironment) {
  EXPECT_EQ(rank(), std::atoi(std::getenv("RANK")));
  EXPECT_EQ(world(), std::atoi(std::getenv("WORLD_SIZE")));
  const RankInfo& me = rt().rank_info(rank());
  EXPECT_EQ(me.rank, rank());
  EXPECT_EQ(me.pid, static_cast<int>(getpid()));
  // `caravan run` numbers logical nodes from 0 in rank order, as the runtime does.
  EXPECT_EQ(rt().node(), std::atoi(std::getenv("CARAVAN_NODE")));
  EXPECT_EQ(me.local_rank, std::atoi(std::getenv("LOCAL_RANK")));
  EXPECT_EQ(static_cast<int>(rt().ranks_on_node(rt().node()).size()), std::atoi(std::getenv("LOCAL_WORLD_SIZE")));
  // Every rank sees the same table.
  struct Row {
    int node, local_rank, pid;
  };
  for (int r = 0; r < world(); ++r) {
    const RankInfo& info = rt().rank_info(r);
    auto rows = test::all_gather(rt(), Row{info.node, info.local_rank, info.pid});
    for (const Row& row : rows) {
      EXPECT_EQ(row.node, info.node);
      EXPECT_EQ(row.local_rank, info.local_rank);
      EXPECT_EQ(row.pid, info.pid);
    }
  }
  std::set<int> all;
  for (int n = 0; n < rt().node_count(); ++n)
    for (int r : rt().ranks_on_node(n)) EXPECT_TRUE(all.insert(r).second) << "rank " << r << " on two nodes";
  EXPECT_EQ(static_cast<int>(all.size()), world());
  CARAVAN_EXPECT_ERROR(rt().rank_info(world()), Errc::invalid_argument, "must be in [0,");
  CARAVAN_EXPECT_ERROR(rt().ranks_on_node(rt().node_count()), Errc::invalid_argument, "node must be in");
}

TEST_F(JobTest, BarriersKeepRanksInStep) {
  // Each round, every rank bumps a shared counter on its own copy only after the barrier,
  // then checks that all ranks report the same round: a barrier that let one rank run ahead
  // would show a different round number in the gather.
  for (int round = 0; round < 20; ++round) {
    rt().barrier(std::chrono::seconds(30));
    auto rounds = test::all_gather(rt(), round);
    for (int r : rounds) EXPECT_EQ(r, round);
  }
}

TEST_F(JobTest, AllgatherCarriesEachRanksBytes) {
  std::vector<std::byte> mine(static_cast<std::size_t>(rank()) * 1000 + 3, std::byte(rank() + 1));
  auto parts = test::network(rt()).allgather(mine, std::chrono::seconds(30), "test");
  ASSERT_EQ(static_cast<int>(parts.size()), world());
  for (int r = 0; r < world(); ++r) {
    ASSERT_EQ(parts[r].size(), static_cast<std::size_t>(r) * 1000 + 3);
    for (std::byte b : parts[r]) ASSERT_EQ(b, std::byte(r + 1));
  }
}

}  // namespace
}  // namespace caravan
