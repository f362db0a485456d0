// ProcessGroup's abort never waits for a communicator being made: a
// factory standing in for a slow rendezvous (it waits for the group's abort
// signal, as NCCL init does) and an Abort from another thread.
#include "worker/colo/process_group.h"

#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "worker/colo/testing.h"

namespace colod {
namespace {

using ::colod::testing::TpDpMesh;

TEST(ProcessGroup, AbortDoesNotWaitForACommunicatorBeingMade) {
  auto signal = std::make_shared<AbortSignal>();
  absl::Notification entered;
  ProcessGroup::CommFactory slow = [&](const ProcessGroup::GroupInfo&)
      -> absl::StatusOr<std::unique_ptr<Communicator>> {
    entered.Notify();
    // A rendezvous whose peers never come: it ends only when aborted.
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (!signal->fired() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
    return signal->Check().ok() ? absl::DeadlineExceededError("no peers") : signal->Check();
  };
  auto pg = ProcessGroup::Create(TpDpMesh(2, 1), 0, slow, absl::Seconds(60), signal);
  ASSERT_TRUE(pg.ok()) << pg.status();
  absl::Status init;
  std::thread rank([&] { init = (*pg)->InitAxes(); });
  entered.WaitForNotification();
  const absl::Time start = absl::Now();
  (*pg)->Abort(absl::CancelledError("job cancelled"));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));  // Abort returned without waiting for the factory
  rank.join();
  EXPECT_EQ(init.code(), absl::StatusCode::kCancelled) << init;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  // Later uses fail at once with the abort's reason.
  EXPECT_EQ((*pg)->Comm("tp").status().code(), absl::StatusCode::kCancelled);
}

// A communicator that could not be made is not made again: a second
// rendezvous under the first one's keys would read its peers' stale
// addresses and wait out the timeout once more. Every later use fails at
// once with the first error; another axis is still made.
TEST(ProcessGroup, ACommunicatorThatCouldNotBeMadeIsNotTriedAgain) {
  int tries = 0;
  ProcessGroup::CommFactory failing =
      [&](const ProcessGroup::GroupInfo& g) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    ++tries;
    return absl::DeadlineExceededError(absl::StrCat("rendezvous of ", g.axis, ": peers never came"));
  };
  auto pg = ProcessGroup::Create(TpDpMesh(2, 2), 0, failing, absl::Seconds(60), std::make_shared<AbortSignal>());
  ASSERT_TRUE(pg.ok()) << pg.status();
  // An axis the mesh lacks (a 2D layer's probe) is no failure of the group.
  EXPECT_FALSE((*pg)->Comm("tp_row").ok());
  EXPECT_EQ(tries, 0);
  EXPECT_TRUE((*pg)->AsyncError().ok()) << (*pg)->AsyncError();
  const absl::Status first = (*pg)->Comm("tp").status();
  EXPECT_EQ(first.code(), absl::StatusCode::kDeadlineExceeded) << first;
  EXPECT_EQ(first.message(),
            "rendezvous of tp: peers never came (the communicator of tp could not be made; it is not tried again)");
  EXPECT_EQ((*pg)->Comm("tp").status(), first);
  EXPECT_EQ(tries, 1);
  // The group is broken, as by a communicator that failed: a rank serving
  // calls ends (the job's restart policy decides).
  EXPECT_EQ((*pg)->AsyncError(), first);
  EXPECT_TRUE(absl::StartsWith((*pg)->Comm("dp").status().message(), "rendezvous of dp: peers never came"));
  EXPECT_EQ(tries, 2);
}

}  // namespace
}  // namespace colod
