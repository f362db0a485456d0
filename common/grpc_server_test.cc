#include "common/grpc_server.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

// gRPC would share a port between two servers (SO_REUSEPORT) and split
// the connections between them: a second daemon on a taken --listen must
// fail to start instead.
TEST(GrpcServer, APortInUseIsRefusedNotShared) {
  auto first = StartGrpcServer("127.0.0.1:0", {});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = StartGrpcServer(first->address, {});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << first->address;
  EXPECT_NE(second.status().message().find("cannot listen on " + first->address), std::string::npos)
      << second.status();
  StopGrpcServer(*first->server, absl::Seconds(1));
  first->server.reset();
  // Free again once the first has stopped.
  auto third = StartGrpcServer(first->address, {});
  ASSERT_TRUE(third.ok()) << third.status();
  StopGrpcServer(*third->server, absl::Seconds(1));
}

// A shutdown signal that comes while no thread waits for one is kept for
// the next wait, and each is taken once: it does not end the process where
// a thread started before BlockShutdownSignals does not block it (as
// OpenBLAS starts its pool at load, before main), the one thread the
// kernel can give it to. In a child process (a death test), since the
// handler stays installed.
TEST(GrpcServerDeathTest, AShutdownSignalWhileNoThreadWaitsIsKeptForTheWait) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        std::atomic<bool> done{false};
        std::thread early([&done] {
          while (!done) absl::SleepFor(absl::Milliseconds(5));
        });
        BlockShutdownSignals();
        ::kill(::getpid(), SIGTERM);
        absl::SleepFor(absl::Milliseconds(200));  // delivered meanwhile, on `early`
        ::kill(::getpid(), SIGINT);
        absl::SleepFor(absl::Milliseconds(200));
        const int first = WaitForShutdownSignalFor(absl::Seconds(5));
        const int second = WaitForShutdownSignalFor(absl::Seconds(5));
        const int none = WaitForShutdownSignalFor(absl::Milliseconds(50));
        ::kill(::getpid(), SIGHUP);  // and one sent while this thread waits
        const int waited = WaitForShutdownSignal();
        done = true;
        early.join();
        // A child (fork, then exec) does not run the handler before its exec.
        const pid_t child = ::fork();
        if (child == 0) {
          DefaultShutdownSignalsInChild();
          sigset_t none;
          sigemptyset(&none);
          ::sigprocmask(SIG_SETMASK, &none, nullptr);
          ::raise(SIGTERM);  // the default action: it ends the child
          ::_exit(3);
        }
        int child_status = 0;
        ::waitpid(child, &child_status, 0);
        const bool child_killed = WIFSIGNALED(child_status) && WTERMSIG(child_status) == SIGTERM;
        const int leaked = WaitForShutdownSignalFor(absl::Milliseconds(50));
        std::fprintf(stderr, "took %d %d %d %d; child killed %d, leaked %d\n", first, second, none, waited,
                     child_killed, leaked);
        std::_Exit(first == SIGTERM && second == SIGINT && none == 0 && waited == SIGHUP && child_killed && leaked == 0
                       ? 0
                       : 1);
      },
      ::testing::ExitedWithCode(0), "took 15 2 0 1; child killed 1, leaked 0");
}

}  // namespace
}  // namespace colod
