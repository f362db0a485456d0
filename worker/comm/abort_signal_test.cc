#include "worker/comm/abort_signal.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

TEST(AbortSignal, TheFirstReasonWinsAndCallbacksRunOnce) {
  AbortSignal signal;
  int ran = 0;
  auto reg = signal.OnAbort([&] { ++ran; });
  EXPECT_TRUE(signal.Check().ok());
  EXPECT_EQ(ran, 0);
  signal.Abort(absl::CancelledError("first"));
  signal.Abort(absl::AbortedError("second"));
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(signal.Check(), absl::CancelledError("first"));
  // Registered after the abort: runs at once.
  int late = 0;
  auto reg2 = signal.OnAbort([&] { ++late; });
  EXPECT_EQ(late, 1);
}

TEST(AbortSignal, AnUnregisteredCallbackNeverRuns) {
  AbortSignal signal;
  int ran = 0;
  signal.OnAbort([&] { ++ran; }).reset();
  signal.Abort(absl::AbortedError("x"));
  EXPECT_EQ(ran, 0);
}

TEST(AbortSignal, UnregisteringWaitsForACallbackInProgress) {
  AbortSignal signal;
  absl::Notification entered;
  std::atomic<bool> done{false};
  auto reg = signal.OnAbort([&] {
    entered.Notify();
    absl::SleepFor(absl::Milliseconds(200));
    done = true;
  });
  std::thread aborter([&] { signal.Abort(absl::AbortedError("x")); });
  entered.WaitForNotification();
  reg.reset();  // must not return while the callback runs
  EXPECT_TRUE(done.load());
  aborter.join();
}

TEST(AbortSignal, EveryCallbackRegisteredAroundAnAbortRunsExactlyOnce) {
  for (int round = 0; round < 50; ++round) {
    AbortSignal signal;
    constexpr int kThreads = 8;
    std::vector<std::atomic<int>> runs(kThreads);
    std::vector<std::unique_ptr<AbortSignal::Registration>> regs(kThreads);
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] { regs[i] = signal.OnAbort([&runs, i] { ++runs[i]; }); });
    }
    signal.Abort(absl::AbortedError("x"));
    for (auto& t : threads) t.join();
    for (int i = 0; i < kThreads; ++i) EXPECT_EQ(runs[i].load(), 1) << "callback " << i << " round " << round;
  }
}

}  // namespace
}  // namespace colod
