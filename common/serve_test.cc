#include "common/serve.h"

#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/exit_codes.h"
#include "common/grpc_server.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

// What a supervisor sees of the death: exit 71, which asks for a restart.
bool AskedForARestart(int status) {
  return WIFEXITED(status) && WEXITSTATUS(status) == kExitUncaughtException && AsksForRestart(WEXITSTATUS(status));
}

// As Gloo's event loop does: an exception thrown on a library's own thread,
// where no code of the daemon's can catch it.
template <typename Throw>
void ThrowOnAThread(Throw thrower) {
  std::thread t([thrower] {
    pthread_setname_np(pthread_self(), "thrower");
    thrower();
  });
  t.join();
}

class ExitOnUncaughtExceptionsTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(ExitOnUncaughtExceptionsTest, AnExceptionOnAnotherThreadEndsTheProcessNamingIt) {
  EXPECT_EXIT(
      {
        ExitOnUncaughtExceptions("colod-test");
        ThrowOnAThread([] { throw std::runtime_error("peer reset\nsecond line"); });
      },
      AskedForARestart,
      R"(colod-test ends on thread [0-9]+ \('thrower'\): an exception of type std::runtime_error escaped every )"
      R"(handler: "peer reset\\nsecond line"; exiting 71 without a clean shutdown)");
}

TEST_F(ExitOnUncaughtExceptionsTest, AnExceptionThatIsNoStdExceptionIsNamedByItsType) {
  EXPECT_EXIT(
      {
        ExitOnUncaughtExceptions("colod-test");
        ThrowOnAThread([] { throw 42; });
      },
      AskedForARestart,
      R"re(an exception of type int escaped every handler: "\(not a std::exception: no message\)")re");
}

TEST_F(ExitOnUncaughtExceptionsTest, AHugeMessageIsCut) {
  EXPECT_EXIT(
      {
        ExitOnUncaughtExceptions("colod-test");
        ThrowOnAThread([] { throw std::length_error(std::string(1 << 20, 'x')); });
      },
      AskedForARestart, R"(std::length_error escaped every handler: "(x{100}){10}x{21}\.\.\."; exiting 71)");
}

TEST_F(ExitOnUncaughtExceptionsTest, TerminateWithoutAnExceptionSaysSo) {
  EXPECT_EXIT(
      {
        ExitOnUncaughtExceptions("colod-test");
        std::terminate();
      },
      AskedForARestart, "colod-test ends on thread [0-9]+ .*std::terminate was called with no exception in flight");
}

// Exceptions escaping on several threads at once end the process with one
// line, the first's: the others wait for its exit.
TEST_F(ExitOnUncaughtExceptionsTest, ExceptionsOnSeveralThreadsAtOnceWriteOneLine) {
  EXPECT_EXIT(
      {
        ExitOnUncaughtExceptions("colod-test");
        constexpr int kThreads = 8;
        std::atomic<int> ready{0};
        std::vector<std::thread> threads;
        for (int i = 0; i < kThreads; ++i) {
          threads.emplace_back([&ready] {
            ++ready;
            while (ready.load() < kThreads) std::this_thread::yield();
            throw std::runtime_error("at once");
          });
        }
        for (std::thread& t : threads) t.join();
      },
      AskedForARestart,
      // The whole of stderr: one line (POSIX regex: ^ and $ are its ends).
      "^[^\n]*colod-test ends on thread [0-9]+ [^\n]*\"at once\"; exiting 71 [^\n]*\n$");
}

TEST(ExitCodes, OnlyADeviceLostAndAnUncaughtExceptionAskForARestart) {
  EXPECT_TRUE(AsksForRestart(kExitDeviceLost));
  EXPECT_TRUE(AsksForRestart(kExitUncaughtException));
  for (int code : {0, 1, 2, 69, 72, 134, 137}) EXPECT_FALSE(AsksForRestart(code)) << code;
}

// A signal after the first ends a daemon whose shutdown hangs, at once and
// saying so (once the shutdown armed it: a worker's drain takes the second).
TEST(ExitOnNextShutdownSignalDeathTest, ASecondSignalEndsAShutdownThatHangs) {
  const std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        BlockShutdownSignals();
        static std::atomic<bool> armed{false};
        std::thread([] {
          ::kill(::getpid(), SIGTERM);
          while (!armed) absl::SleepFor(absl::Milliseconds(5));  // the shutdown has begun
          ::kill(::getpid(), SIGINT);
        }).detach();
        ServeUntilSignal("test daemon", "", "", "", [] {
          ExitOnNextShutdownSignal("test daemon");
          armed = true;
          absl::SleepFor(absl::Seconds(60));  // a shutdown that hangs
        });
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(128 + SIGINT), "received signal 2 during the shutdown: test daemon exits now");
  GTEST_FLAG_SET(death_test_style, style);
}

}  // namespace
}  // namespace colod
