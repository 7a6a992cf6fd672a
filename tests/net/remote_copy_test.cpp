// Multi-process: copies between ranks through the nic channel (runtime/dma/remote_copy.cpp,
// channels/nic_channel.*). Every rank runs the same tests in the same order under
// `caravan run -n N [--nodes K]`; instances are named across ranks by their descriptors.
//
// Data: each source holds a pattern derived from a seed that rank 0 draws fresh for every run
// (so a stale destination cannot pass), destinations are poisoned first, and every
// (point, field) is checked after the copy.
#include "channels/nic_channel.h"
#include "runtime/dma/engine.h"
#include "runtime/net/rma.h"
#include "tests/dma/dma_test_util.h"
#include "tests/net/net_test_util.h"
#include "tests/net/remote_copy_util.h"

#include <caravan/settings.h>

#include <fmt/format.h>

#include <signal.h>

#include <mutex>
#include <optional>
#include <thread>

namespace caravan {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::engine_active_copies;
using test::engine_drains;
using test::fresh_seed;
using test::JobTest;
using test::share;

MemoryId memory_of(Runtime& rt, int rank, MemoryKind kind) {
  return MemoryId{static_cast<std::uint32_t>(rt.rank_info(rank).node), static_cast<std::uint32_t>(rank), kind, 0};
}

// The event fails with `code` (and a cause that mentions `text`) within 30 s.
void expect_poisoned(const Event& e, Errc code, std::string_view text = "") {
  try {
    e.wait_for(std::chrono::seconds(30));
    ADD_FAILURE() << "the event triggered without an error";
  } catch (const EventPoisoned& p) {
    EXPECT_EQ(p.cause()->code(), code) << p.cause()->what();
    EXPECT_NE(std::string(p.cause()->what()).find(text), std::string::npos) << p.cause()->what();
  }
}


std::uint64_t bytes_in(const std::map<MemoryId, std::uint64_t>& by_memory, MemoryId memory) {
  auto it = by_memory.find(memory);
  return it == by_memory.end() ? 0 : it->second;
}

// Waits (bounded) until `ok` holds for this rank's engine statistics.
template <class Ok>
bool engine_reaches(std::chrono::seconds limit, Ok ok) {
  auto until = Clock::now() + limit;
  while (!ok(dma::Engine::current().stats())) {
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// A nic channel whose requests after the first `pass` are held until open(): then they run as
// put (late, into whatever the far rank did with the buffer meanwhile).
class GatedChannel final : public dma::Channel {
 public:
  GatedChannel(std::unique_ptr<dma::Channel> real, std::size_t pass) : real_(std::move(real)), pass_(pass) {}
  ChannelKind kind() const noexcept override { return real_->kind(); }
  bool serves(MemoryId src, MemoryId dst) const noexcept override { return real_->serves(src, dst); }
  int window() const noexcept override { return real_->window(); }
  void submit(const dma::Request& request, Completion done) override {
    {
      std::lock_guard lock(mutex_);
      if (!open_ && passed_ >= pass_) {
        held_.emplace_back(request, std::move(done));
        return;
      }
      ++passed_;
    }
    real_->submit(request, std::move(done));
  }
  std::size_t held() {
    std::lock_guard lock(mutex_);
    return held_.size();
  }
  void open() {
    std::vector<std::pair<dma::Request, Completion>> held;
    {
      std::lock_guard lock(mutex_);
      open_ = true;
      held.swap(held_);
    }
    for (auto& [request, done] : held) real_->submit(request, std::move(done));
  }

 private:
  std::unique_ptr<dma::Channel> real_;
  std::size_t pass_;
  std::mutex mutex_;
  std::size_t passed_ = 0;
  bool open_ = false;
  std::vector<std::pair<dma::Request, Completion>> held_;
};

// Three ranks: rank 2 (the initiator, owning neither end) copies rank 1's instance to rank 0's,
// SYS -> REG -> REG* -> SYS*, and leaves (`kill`: dies; else shuts down) while rank 1's nic hop
// still has puts on their way into rank 0's REG buffer (held by a GatedChannel). Rank 0's part
// ends without every part being done: its buffer must stay out of the pool (quarantined) until
// rank 1 has stopped putting into it, and go back to the pool then.
void initiator_leaves_while_a_peer_puts(Runtime& rt, bool kill) {
  constexpr int kReader = 0, kWriter = 1, kInitiator = 2;
  settings::ScopedOverride threshold("CARAVAN_PLANNER_BUFFER_THRESHOLD", "256K");
  const int me = rt.rank();
  FieldSpace fields({{"v", 16}});
  auto space = Rect::from_extents({1 << 16});  // 1 MiB: many tiles through 256 KiB buffers
  auto src = Instance::create(memory_of(rt, me, MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto dst = Instance::create(memory_of(rt, me, MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto srcs = share(rt, src), dsts = share(rt, dst);
  const MemoryId reader_reg = memory_of(rt, kReader, MemoryKind::reg), writer_reg = memory_of(rt, kWriter, MemoryKind::reg);
  GatedChannel* gate = nullptr;
  if (me == kWriter) {
    auto channel = std::make_unique<GatedChannel>(
        std::make_unique<channels::NicChannel>(test::network(rt).rma(), writer_reg, reader_reg, 4), 1);
    gate = channel.get();
    dma::Engine::current().replace_channel_for_testing(fmt::format("nic {}->{}", writer_reg.to_string(), reader_reg.to_string()),
                                                       std::move(channel));
  }
  UserEvent held_made, checked_made;
  Event mine_held, mine_checked;
  if (me == kWriter) mine_held = held_made = UserEvent::create();
  if (me == kReader) mine_checked = checked_made = UserEvent::create();
  const Event held = test::all_gather(rt, mine_held)[kWriter];
  const Event checked = test::all_gather(rt, mine_checked)[kReader];
  rt.barrier(30s);

  if (me == kInitiator) {
    Event running = copy(srcs[kWriter], dsts[kReader]);
    ASSERT_TRUE(held.wait_for(30s));  // the writer's nic hop has a request held: puts still to come
    EXPECT_FALSE(running.has_triggered());
    if (kill) raise(SIGKILL);
    rt.shutdown();  // stops the copy without waiting for its participants (they are not done)
    return;
  }
  if (me == kWriter) {
    auto until = Clock::now() + 30s;
    while (gate->held() == 0 && Clock::now() < until) std::this_thread::sleep_for(1ms);
    ASSERT_GT(gate->held(), 0u) << "the nic hop never issued a second request";
    held_made.trigger();
    EXPECT_TRUE(checked.wait_for(30s));  // the reader has looked at its buffers
    gate->open();                        // the late puts go out, into the reader's REG buffer
    EXPECT_TRUE(engine_drains(10s)) << engine_active_copies() << " copies still active";
    return;
  }
  if (me == kReader) {
    // The reader's part ends (aborted or finished by the initiator, or orphaned by its loss)
    // while the writer still holds puts for its buffer.
    ASSERT_TRUE(held.wait_for(30s));  // the copy runs here too by then (every part got `go`)
    EXPECT_TRUE(engine_drains(10s)) << engine_active_copies() << " copies still active";
    // The part's buffers are given back (or held) just after it leaves the active copies.
    EXPECT_TRUE(engine_reaches(10s, [&](const dma::EngineStats& s) {
      return bytes_in(s.quarantined_buffers, reader_reg) > 0 || bytes_in(s.idle_buffers, reader_reg) > 0;
    }));
    auto stats = dma::Engine::current().stats();
    EXPECT_GT(bytes_in(stats.quarantined_buffers, reader_reg), 0u) << "the REG buffer the writer still puts into was not held";
    EXPECT_EQ(bytes_in(stats.idle_buffers, reader_reg), 0u) << "the REG buffer the writer still puts into went back to the pool";
    checked_made.trigger();
    // Once the writer's puts are over (its part retired and flushed), the buffer is reusable.
    EXPECT_TRUE(engine_reaches(20s, [&](const dma::EngineStats& s) {
      return s.quarantined_buffers.empty() && bytes_in(s.idle_buffers, reader_reg) > 0;
    })) << "the quarantine was not lifted after the writer finished";
  }
}

TEST_F(JobTest, RemoteCopiesInEveryDirectionWithLayoutChanges) {
  const int me = rank(), n = world();
  const std::uint64_t seed = fresh_seed(rt());
  FieldSpace fields({{"a", 4}, {"b", 8}, {"c", 2}});
  auto space = Rect::from_extents({96, 40});
  // Sources in AOS; destinations in other layouts, so that a memcpy hop on one side converts.
  auto src = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("F,x,y"));
  auto pushed = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("y,x,F"));
  auto pulled = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("x_in=16,F,x_out,y"));
  auto reg_src = Instance::create(memory_of(rt(), me, MemoryKind::reg), space, fields, Layout::parse("F,x,y"));
  auto reg_dst = Instance::create(memory_of(rt(), me, MemoryKind::reg), space, fields, Layout::parse("F,x,y"));
  auto third = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("x,y,F"));
  test::write_pattern(src, test::rank_seed(seed, me));
  test::write_pattern(reg_src, test::rank_seed(seed, me) + 1);
  for (const Instance* d : {&pushed, &pulled, &reg_dst, &third}) test::poison(*d);
  auto srcs = share(rt(), src), pusheds = share(rt(), pushed), reg_srcs = share(rt(), reg_src), reg_dsts = share(rt(), reg_dst),
       thirds = share(rt(), third);
  EXPECT_FALSE(srcs[static_cast<std::size_t>(me)].is_remote());
  rt().barrier(30s);

  const auto next = static_cast<std::size_t>((me + 1) % n), prev = static_cast<std::size_t>((me + n - 1) % n);
  CopyReport push_report, pull_report, reg_report;
  // Push (this rank to the next), pull (the previous rank to this one), and a one-hop copy
  // between registered instances; with 3 or more ranks also a copy between two other ranks.
  Event push = copy(src, pusheds[next], {.report = &push_report});
  Event pull = copy(srcs[prev], pulled, {.report = &pull_report});
  Event reg = copy(reg_src, reg_dsts[next], {.report = &reg_report});
  Event between;
  if (n >= 3) between = copy(srcs[(static_cast<std::size_t>(me) + 1) % static_cast<std::size_t>(n)], thirds[(static_cast<std::size_t>(me) + 2) % static_cast<std::size_t>(n)]);
  for (Event e : {push, pull, reg, between}) e.wait_for(60s);
  EXPECT_NE(push_report.route.find("-[nic]->"), std::string::npos) << push_report.route;
  EXPECT_NE(pull_report.route.find("-[nic]->"), std::string::npos) << pull_report.route;
  EXPECT_EQ(reg_report.route, fmt::format("{} -[nic]-> {}", memory_of(rt(), me, MemoryKind::reg).to_string(),
                                          memory_of(rt(), static_cast<int>(next), MemoryKind::reg).to_string()));
  rt().barrier(30s);

  EXPECT_EQ(test::count_mismatches(pushed, test::rank_seed(seed, static_cast<int>(prev))), 0u);
  EXPECT_EQ(test::count_mismatches(pulled, test::rank_seed(seed, static_cast<int>(prev))), 0u);
  EXPECT_EQ(test::count_mismatches(reg_dst, test::rank_seed(seed, static_cast<int>(prev)) + 1), 0u);
  if (n >= 3) {
    EXPECT_EQ(test::count_mismatches(third, test::rank_seed(seed, (me + n - 1) % n)), 0u);
  }
  EXPECT_TRUE(engine_drains(10s)) << engine_active_copies() << " copies still active";
  rt().barrier(30s);
}

// CopyOptions::region across ranks: a block of this rank's large instance pushed into the next
// rank's small one (which holds only the block's points), and the previous rank's block pulled
// into a large instance here, whose other points must stay as they were.
TEST_F(JobTest, RegionCopiesBetweenRanks) {
  const int me = rank(), n = world();
  const std::uint64_t seed = fresh_seed(rt());
  FieldSpace fields({{"a", 4}, {"b", 8}, {"c", 2}});
  const Rect space = Rect::from_extents({96, 40});
  const Rect block(2, Point{20, 5}, Point{75, 31});
  auto src = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("F,x,y"));
  auto small = Instance::create(memory_of(rt(), me, MemoryKind::sys), block, fields, Layout::parse("y,x,F"));
  auto pulled = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("x,y,F"));
  test::write_pattern(src, test::rank_seed(seed, me));
  test::poison(small);
  test::poison(pulled);
  auto srcs = share(rt(), src), smalls = share(rt(), small);
  rt().barrier(30s);
  const auto next = static_cast<std::size_t>((me + 1) % n), prev = static_cast<std::size_t>((me + n - 1) % n);
  Event push = copy(src, smalls[next], {.region = block});
  Event pull = copy(srcs[prev], pulled, {.region = block});
  EXPECT_TRUE(push.wait_for(60s));
  EXPECT_TRUE(pull.wait_for(60s));
  rt().barrier(30s);
  EXPECT_EQ(test::count_mismatches(small, test::rank_seed(seed, static_cast<int>(prev))), 0u);
  const test::RegionCheck check = test::check_region(pulled, test::rank_seed(seed, static_cast<int>(prev)), block);
  EXPECT_EQ(check.wrong_inside, 0u);
  EXPECT_EQ(check.changed_outside, 0u);
  EXPECT_TRUE(engine_drains(10s)) << engine_active_copies() << " copies still active";
  rt().barrier(30s);
}

TEST_F(JobTest, PipelinedCrossNodeCopyThroughSmallBuffers) {
  // Buffers far smaller than the instance: the copy must stream tile by tile through
  // SYS -> REG -> REG* -> SYS* with every hop running at once.
  settings::ScopedOverride threshold("CARAVAN_PLANNER_BUFFER_THRESHOLD", "192K");
  const int me = rank(), n = world();
  const std::uint64_t seed = fresh_seed(rt());
  FieldSpace fields({{"x", 8}, {"y", 4}, {"z", 4}});
  auto space = Rect::from_extents({1 << 19});  // 8 MiB
  auto src = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto dst = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("x,F"));
  test::write_pattern(src, test::rank_seed(seed, me));
  test::poison(dst);
  auto dsts = share(rt(), dst);
  const int target = (me + n / 2) % n;  // with --nodes 2: a rank on the other node
  CopyReport report;
  if (target != me) {
    copy(src, dsts[static_cast<std::size_t>(target)], {.report = &report}).wait_for(60s);
    EXPECT_EQ(report.route, fmt::format("{} -[memcpy]-> {} -[nic]-> {} -[memcpy]-> {}", memory_of(rt(), me, MemoryKind::sys).to_string(),
                                        memory_of(rt(), me, MemoryKind::reg).to_string(),
                                        memory_of(rt(), target, MemoryKind::reg).to_string(),
                                        memory_of(rt(), target, MemoryKind::sys).to_string()));
    ASSERT_EQ(report.buffer_bytes.size(), 2u);
    for (std::uint64_t bytes : report.buffer_bytes) EXPECT_LE(bytes, 192u << 10);
    EXPECT_GE(report.tiles, 32u) << "the copy was not cut into tiles";
    // Every hop ran; the first and last on their own ranks.
    ASSERT_EQ(report.hop_requests.size(), 3u);
    EXPECT_GT(report.hop_requests[0], 0u);
    EXPECT_GT(report.hop_requests[1], 0u);
  }
  rt().barrier(30s);
  const int writer = (me + n - n / 2) % n;
  if (writer != me) {
    EXPECT_EQ(test::count_mismatches(dst, test::rank_seed(seed, writer)), 0u);
  }
  EXPECT_TRUE(engine_drains(10s));
  rt().barrier(30s);
}

TEST_F(JobTest, CancelStopsACrossRankCopyOnBothSides) {
  settings::ScopedOverride threshold("CARAVAN_PLANNER_BUFFER_THRESHOLD", "128K");
  const int me = rank(), n = world();
  FieldSpace fields({{"v", 16}});
  auto space = Rect::from_extents({1 << 20});  // 16 MiB: hundreds of tiles
  auto src = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto dst = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto dsts = share(rt(), dst);
  UserEvent gate = UserEvent::create();
  // Cancelled before its precondition: no rank hears of it.
  Event early = copy(src, dsts[static_cast<std::size_t>((me + 1) % n)], {.precondition = gate});
  EXPECT_TRUE(cancel(early));
  // Cancelled while it runs: every participant stops and frees its part.
  Event running = copy(src, dsts[static_cast<std::size_t>((me + 1) % n)]);
  std::this_thread::sleep_for(2ms);
  const bool stopped = cancel(running);
  gate.trigger();
  expect_poisoned(early, Errc::cancelled);
  if (stopped) {
    expect_poisoned(running, Errc::cancelled);
  } else {
    running.wait_for(30s);  // it had finished already
  }
  rt().barrier(30s);
  EXPECT_TRUE(engine_drains(10s)) << engine_active_copies() << " copies still active";
  auto stats = dma::Engine::current().stats();
  for (const auto& [memory, bytes] : stats.pool_in_use) EXPECT_EQ(bytes, 0u) << memory.to_string();
  // The pools are whole again: the same copy now runs to the end.
  test::write_pattern(src, 77 + static_cast<std::uint64_t>(me));
  rt().barrier(30s);
  copy(src, dsts[static_cast<std::size_t>((me + 1) % n)]).wait_for(60s);
  rt().barrier(30s);
  EXPECT_EQ(test::count_mismatches(dst, 77 + static_cast<std::uint64_t>((me + n - 1) % n)), 0u);
  rt().barrier(30s);
}

TEST_F(JobTest, BadRemoteCopiesAreRejectedClearly) {
  const int me = rank(), n = world();
  FieldSpace fields({{"v", 8}});
  auto space = Rect::from_extents({1000});
  auto mine = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto other_shape = Instance::create(memory_of(rt(), me, MemoryKind::sys), Rect::from_extents({999}), fields, Layout::parse("F,x"));
  std::optional<Instance> doomed;
  doomed = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto all = share(rt(), mine);
  auto doomed_all = share(rt(), *doomed);
  Instance remote = all[static_cast<std::size_t>((me + 1) % n)];
  Instance remote_doomed = doomed_all[static_cast<std::size_t>((me + 1) % n)];
  doomed_all.clear();  // this rank's own entry is its instance itself, which must go too
  ASSERT_TRUE(remote.is_remote());

  std::vector<std::byte> junk(40, std::byte{7});
  CARAVAN_EXPECT_ERROR(Instance::from_descriptor(junk), Errc::invalid_argument, "not an instance descriptor");
  std::vector<std::byte> cut = mine.descriptor();
  cut.resize(cut.size() - 3);
  CARAVAN_EXPECT_ERROR(Instance::from_descriptor(cut), Errc::invalid_argument, "Instance::from_descriptor");
  CARAVAN_EXPECT_ERROR(remote.data(), Errc::invalid_argument, fmt::format("memory of rank {}", (me + 1) % n));
  std::vector<std::byte> out(8);
  CARAVAN_EXPECT_ERROR(remote.read_bytes(0, out), Errc::invalid_argument, "only that rank");
  CARAVAN_EXPECT_ERROR(fill(remote, out), Errc::invalid_argument, "fill it on that rank");
  CARAVAN_EXPECT_ERROR(copy(other_shape, remote), Errc::invalid_argument, "index space");
  CARAVAN_EXPECT_ERROR(copy(mine, remote, {.priority = 5000}), Errc::invalid_argument, "priority");
  rt().barrier(30s);
  // An instance its owner has dropped: the copy is poisoned, naming it, not a crash.
  doomed.reset();
  rt().barrier(30s);
  expect_poisoned(copy(mine, remote_doomed), Errc::invalid_argument, "no longer exists");
  rt().barrier(30s);
  EXPECT_TRUE(engine_drains(10s));
  rt().barrier(30s);
}

TEST_F(JobTest, InitiatorShutsDownWhileAPeerStillPuts) {
  if (world() != 3) GTEST_SKIP() << "a three-rank test (caravan run -n 3), run with " << world();
  initiator_leaves_while_a_peer_puts(rt(), false);
}

// Memory registered again at the same address (an instance attached to the same bytes) is a new
// registration: its descriptor differs, and a copy into it imports its key instead of reusing
// the cached key of the registration that is gone.
TEST_F(JobTest, ReRegisteredMemoryGetsItsOwnRemoteKey) {
  const int me = rank(), n = world();
  FieldSpace fields({{"v", 8}});
  auto space = Rect::from_extents({1 << 14});  // 128 KiB
  const std::size_t bytes = std::size_t{1} << 17;
  std::vector<std::byte> buffer(bytes);
  auto& rma = test::network(rt()).rma();
  {
    auto first = rma.register_memory(buffer.data(), bytes);
    const std::vector<std::byte> before = first->descriptor();
    const std::uint64_t serial = first->serial();
    first.reset();
    auto second = rma.register_memory(buffer.data(), bytes);
    EXPECT_NE(second->serial(), serial);
    EXPECT_NE(second->descriptor(), before) << "two registrations of the same bytes have one descriptor";
  }
  auto src = Instance::create(memory_of(rt(), me, MemoryKind::reg), space, fields, Layout::parse("F,x"));
  const std::uint64_t seed = fresh_seed(rt());
  const auto next = static_cast<std::size_t>((me + 1) % n);
  const int prev = (me + n - 1) % n;
  for (std::uint64_t round = 0; round < 3; ++round) {
    std::optional<Instance> dst =
        Instance::attach(memory_of(rt(), me, MemoryKind::reg), space, fields, Layout::parse("F,x"), buffer.data(), bytes);
    test::poison(*dst);
    test::write_pattern(src, test::rank_seed(seed, me) + round);
    auto dsts = share(rt(), *dst);
    rt().barrier(30s);
    const std::size_t keys = dma::Engine::current().stats().remote_keys;
    EXPECT_TRUE(copy(src, dsts[next]).wait_for(30s));
    EXPECT_EQ(dma::Engine::current().stats().remote_keys, keys + 1) << "round " << round << ": no key imported for the new registration";
    rt().barrier(30s);
    EXPECT_EQ(test::count_mismatches(*dst, test::rank_seed(seed, prev) + round), 0u) << "round " << round;
    rt().barrier(30s);
    dsts.clear();
    dst.reset();  // unregisters the bytes; the next round registers them again
  }
  EXPECT_TRUE(engine_drains(10s));
  rt().barrier(30s);
}

// Copies admitted while others finish (small pools: each waits for the one before it), many of
// them cancelled at once or a moment later, so that cancels meet copies being admitted and
// allocating their buffers. Everything ends, the pools are whole, and a last copy is exact.
TEST_F(JobTest, CancelsDuringAdmissionLeaveNothingBehind) {
  settings::ScopedOverride threshold("CARAVAN_PLANNER_BUFFER_THRESHOLD", "128K");
  settings::ScopedOverride pool("CARAVAN_DMA_POOL_BYTES", "128K");
  const int me = rank(), n = world();
  FieldSpace fields({{"v", 16}});
  auto space = Rect::from_extents({1 << 14});  // 256 KiB
  auto src = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto dst = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto dsts = share(rt(), dst);
  const auto next = static_cast<std::size_t>((me + 1) % n);
  std::mt19937 random(static_cast<std::uint32_t>(me) + 11);
  rt().barrier(30s);
  for (int batch = 0; batch < 4; ++batch) {
    std::vector<Event> copies;
    std::vector<bool> cancelled;
    for (int i = 0; i < 12; ++i) {
      copies.push_back(copy(src, dsts[next]));
      cancelled.push_back(false);
      if (i % 3 == 1) cancelled.back() = cancel(copies.back());
    }
    std::this_thread::sleep_for(std::chrono::microseconds(random() % 2000));
    for (std::size_t i = 0; i < copies.size(); ++i)
      if (i % 3 == 2) cancelled[i] = cancel(copies[i]);
    for (std::size_t i = 0; i < copies.size(); ++i) {
      if (cancelled[i]) {
        expect_poisoned(copies[i], Errc::cancelled);
      } else {
        EXPECT_TRUE(copies[i].wait_for(30s)) << "copy " << i << " of batch " << batch;
      }
    }
  }
  rt().barrier(30s);
  EXPECT_TRUE(engine_drains(10s)) << engine_active_copies() << " copies still active";
  auto stats = dma::Engine::current().stats();
  for (const auto& [memory, bytes] : stats.pool_in_use) EXPECT_EQ(bytes, 0u) << memory.to_string();
  EXPECT_TRUE(stats.quarantined_buffers.empty()) << "copies that ended cleanly held buffers";
  test::write_pattern(src, 300 + static_cast<std::uint64_t>(me));
  test::poison(dst);
  rt().barrier(30s);
  EXPECT_TRUE(copy(src, dsts[next]).wait_for(30s));
  rt().barrier(30s);
  EXPECT_EQ(test::count_mismatches(dst, 300 + static_cast<std::uint64_t>((me + n - 1) % n)), 0u);
  rt().barrier(30s);
}

}  // namespace
}  // namespace caravan

// Run by expect_rank_failure.sh: the last rank dies in the middle of copies to and from it.
namespace caravan {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::JobTest;

TEST_F(JobTest, KilledPeerPoisonsCrossRankCopiesWithin10Seconds) {
  settings::ScopedOverride threshold("CARAVAN_PLANNER_BUFFER_THRESHOLD", "256K");
  const int me = rank(), victim = world() - 1;
  FieldSpace fields({{"v", 16}});
  auto space = Rect::from_extents({1 << 20});  // 16 MiB per copy
  auto src = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto dst = Instance::create(memory_of(rt(), me, MemoryKind::sys), space, fields, Layout::parse("F,x"));
  auto srcs = share(rt(), src), dsts = share(rt(), dst);
  // The victim also starts copies into rank 0, whose part then loses its initiator.
  const char* tls = std::getenv("CARAVAN_UCX_TLS");
  const bool emulated_rma = tls && std::string_view(tls) == "tcp";  // see failure_test.cpp
  rt().barrier(30s);
  const auto killed_at = Clock::now() + 300ms;
  if (me == victim) {
    if (!emulated_rma) copy(src, dsts[0]);
    std::this_thread::sleep_until(killed_at);
    raise(SIGKILL);
  }
  // Copies in both directions between this rank and the victim, until one fails.
  std::string cause;
  Errc code = Errc::internal;
  while (cause.empty() && Clock::now() < killed_at + 30s) {
    Event push = copy(src, dsts[static_cast<std::size_t>(victim)]);
    Event pull = emulated_rma ? Event() : copy(srcs[static_cast<std::size_t>(victim)], dst);
    for (Event e : {push, pull}) {
      try {
        e.wait_for(30s);
      } catch (const EventPoisoned& p) {
        if (cause.empty()) {
          cause = p.cause()->what();
          code = p.cause()->code();
        }
      }
    }
  }
  const auto noticed = Clock::now() - killed_at;
  EXPECT_EQ(code, Errc::transport) << cause;
  EXPECT_NE(cause.find(fmt::format("rank {}", victim)), std::string::npos) << cause;
  EXPECT_LT(noticed, 10s) << "the failure took " << std::chrono::duration<double>(noticed).count() << " s to notice";
  // Nothing is left behind: the copies this rank started and the parts it ran for the victim.
  EXPECT_TRUE(engine_drains(10s)) << engine_active_copies() << " copies still active";
  // New copies to the lost rank are refused at once.
  CARAVAN_EXPECT_ERROR(copy(src, dsts[static_cast<std::size_t>(victim)]), Errc::transport, fmt::format("rank {}", victim));
}

// The initiator (rank 2 of 3) dies while rank 1 still puts into rank 0's buffer: rank 0's part
// is orphaned, and its buffer must stay out of the pool until rank 1's puts are over.
TEST_F(JobTest, InitiatorKilledWhileAPeerStillPuts) {
  if (world() != 3) GTEST_SKIP() << "a three-rank test (caravan run -n 3), run with " << world();
  initiator_leaves_while_a_peer_puts(rt(), true);
}

}  // namespace
}  // namespace caravan
