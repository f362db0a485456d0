#include "common/serve.h"

#include <pthread.h>
#include <sys/wait.h>

#include <exception>
#include <stdexcept>
#include <thread>

#include "common/exit_codes.h"
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

TEST(ExitCodes, OnlyADeviceLostAndAnUncaughtExceptionAskForARestart) {
  EXPECT_TRUE(AsksForRestart(kExitDeviceLost));
  EXPECT_TRUE(AsksForRestart(kExitUncaughtException));
  for (int code : {0, 1, 2, 69, 72, 134, 137}) EXPECT_FALSE(AsksForRestart(code)) << code;
}

}  // namespace
}  // namespace colod
