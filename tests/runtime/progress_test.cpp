// The progress hooks of waiting threads (runtime/progress.h): a thread in Event::wait() or
// Event::query() runs them, one thread at a time, never from inside a hook, and a hook being
// removed is not run again once remove_progress_hook has returned.
#include "runtime/progress.h"
#include "tests/runtime/test_util.h"

#include <caravan/settings.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace caravan {
namespace {

using namespace std::chrono_literals;

// Triggers `event` from inside help() once `armed`, as a GPU queue's hook finishes a copy; counts
// its calls and the threads in it at once.
class TriggeringHook final : public detail::ProgressHook {
 public:
  void arm(UserEvent e) {
    event_ = e;
    armed_.store(true);
  }
  void help() noexcept override {
    const int inside = inside_.fetch_add(1) + 1;
    int most = most_inside_.load();
    while (inside > most && !most_inside_.compare_exchange_weak(most, inside)) {
    }
    calls_.fetch_add(1);
    helper_.store(std::this_thread::get_id());
    // A hook that waits itself (its completion's callbacks may): no nested help from here.
    detail::help_progress();
    if (armed_.exchange(false)) event_.trigger();
    inside_.fetch_sub(1);
  }
  int calls() const { return calls_.load(); }
  int most_inside() const { return most_inside_.load(); }
  std::thread::id helper() const { return helper_.load(); }

 private:
  UserEvent event_;
  std::atomic<bool> armed_{false};
  std::atomic<int> calls_{0}, inside_{0}, most_inside_{0};
  std::atomic<std::thread::id> helper_{};
};

// Removes itself from the table when it goes, as CopyQueue does.
struct Registered {
  explicit Registered(detail::ProgressHook& h) : hook(h) { EXPECT_TRUE(detail::add_progress_hook(&hook)); }
  ~Registered() { detail::remove_progress_hook(&hook); }
  detail::ProgressHook& hook;
};

TEST(ProgressHooks, AWaitingThreadRunsTheHookThatTriggersItsEvent) {
  settings::ScopedOverride spin("CARAVAN_WAIT_SPIN_US", "1000000");  // polls (and helps) up to 1 s
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  TriggeringHook hook;
  Registered registered(hook);
  UserEvent e = UserEvent::create();
  hook.arm(e);
  // Nothing else triggers it: only the waiting thread's help can.
  ASSERT_TRUE(e.wait_for(20s)) << "the waiting thread did not run the hook";
  EXPECT_EQ(hook.helper(), std::this_thread::get_id());
  EXPECT_EQ(hook.most_inside(), 1) << "a hook ran inside itself";
}

TEST(ProgressHooks, APollingThreadRunsTheHook) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  TriggeringHook hook;
  Registered registered(hook);
  UserEvent e = UserEvent::create();
  hook.arm(e);
  const auto give_up = std::chrono::steady_clock::now() + 20s;
  while (!e.has_triggered() && std::chrono::steady_clock::now() < give_up) {
  }
  EXPECT_TRUE(e.has_triggered()) << "Event::query() did not run the hook";
  EXPECT_GE(hook.calls(), 1);
}

// Many threads polling at once: the hook never runs on two of them together, and removing it
// while they poll returns only once none is inside it (afterwards its calls stay put).
TEST(ProgressHooks, OneHelperAtATimeAndRemovalWaitsForIt) {
  Runtime rt(RuntimeOptions{.cpu_workers = 1});
  UserEvent never = UserEvent::create();  // pending throughout: every query helps
  TriggeringHook hook;
  ASSERT_TRUE(detail::add_progress_hook(&hook));
  std::atomic<bool> stop{false};
  std::vector<std::thread> pollers;
  for (int t = 0; t < 4; ++t)
    pollers.emplace_back([&] {
      while (!stop.load()) (void)never.query();
    });
  const auto give_up = std::chrono::steady_clock::now() + 20s;
  while (hook.calls() < 1000 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  EXPECT_GE(hook.calls(), 1000);
  detail::remove_progress_hook(&hook);
  const int after_removal = hook.calls();
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(hook.calls(), after_removal) << "the hook ran after remove_progress_hook returned";
  stop.store(true);
  for (auto& t : pollers) t.join();
  EXPECT_EQ(hook.most_inside(), 1);
  never.trigger();
}

TEST(ProgressHooks, AFullTableRefusesMoreHooks) {
  std::vector<TriggeringHook> hooks(300);
  std::size_t added = 0;
  for (auto& h : hooks) added += detail::add_progress_hook(&h) ? 1 : 0;
  EXPECT_GT(added, 0u);
  EXPECT_LT(added, hooks.size());
  for (auto& h : hooks) detail::remove_progress_hook(&h);  // the refused ones are not there: no-op
  TriggeringHook again;
  EXPECT_TRUE(detail::add_progress_hook(&again)) << "removed hooks left their slots taken";
  detail::remove_progress_hook(&again);
}

TEST(ProgressHooks, TheSettingIsRead) {
  EXPECT_TRUE(detail::waiting_threads_help());
  settings::ScopedOverride off("CARAVAN_WAIT_HELPS", "false");
  EXPECT_FALSE(detail::waiting_threads_help());
}

}  // namespace
}  // namespace caravan
