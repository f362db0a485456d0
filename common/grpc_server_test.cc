#include "common/grpc_server.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
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

// The scenarios of GrpcServerDeathTest, in a child process of their own
// (the handler stays installed): prints what each took and returns 0 where
// every one held.
int ShutdownSignalScenarios() {
  sigset_t shutdown;
  sigemptyset(&shutdown);
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&shutdown, sig);
  BlockShutdownSignals();
  // A: sent while every thread blocks it: pending, taken by the next wait
  // (it unblocks them while it waits).
  ::kill(::getpid(), SIGTERM);
  const int pending = WaitForShutdownSignalFor(absl::ZeroDuration());
  const int pending_again = WaitForShutdownSignalFor(absl::ZeroDuration());
  // B: a thread that does not block them (as one a library started before
  // main does) is the one the kernel gives them to while no thread waits:
  // before the handler, that ended the process.
  std::atomic<bool> unblocked{false}, done{false};
  std::thread early([&] {
    pthread_sigmask(SIG_UNBLOCK, &shutdown, nullptr);
    unblocked = true;
    while (!done) absl::SleepFor(absl::Milliseconds(5));
  });
  while (!unblocked) absl::SleepFor(absl::Milliseconds(1));
  ::kill(::getpid(), SIGTERM);
  absl::SleepFor(absl::Milliseconds(200));
  const int on_early = WaitForShutdownSignalFor(absl::ZeroDuration());
  ::kill(::getpid(), SIGINT);
  absl::SleepFor(absl::Milliseconds(200));
  const int on_early_again = WaitForShutdownSignalFor(absl::ZeroDuration());
  ::kill(::getpid(), SIGTERM);
  ::kill(::getpid(), SIGINT);
  const int one = WaitForShutdownSignalFor(absl::Seconds(5)), other = WaitForShutdownSignalFor(absl::Seconds(5));
  const bool both = (one == SIGTERM && other == SIGINT) || (one == SIGINT && other == SIGTERM);
  const int none = WaitForShutdownSignalFor(absl::Milliseconds(50));
  // C: sent while this thread waits.
  std::thread sender([] {
    absl::SleepFor(absl::Milliseconds(100));
    ::kill(::getpid(), SIGTERM);
  });
  const absl::Time waiting = absl::Now();
  const int waited = WaitForShutdownSignal();
  const bool promptly = absl::Now() - waiting < absl::Seconds(5);
  sender.join();
  done = true;
  early.join();
  // D: a child (fork, then exec) gets the default action back before it
  // unblocks them: the signal ends it, and nothing reaches this process's wait.
  const pid_t child = ::fork();
  if (child == 0) {
    RestoreShutdownSignalActionsInChild();
    sigset_t none_blocked;
    sigemptyset(&none_blocked);
    ::sigprocmask(SIG_SETMASK, &none_blocked, nullptr);
    ::raise(SIGTERM);
    ::_exit(3);
  }
  int child_status = 0;
  ::waitpid(child, &child_status, 0);
  const bool child_killed = WIFSIGNALED(child_status) && WTERMSIG(child_status) == SIGTERM;
  const int leaked = WaitForShutdownSignalFor(absl::Milliseconds(50));
  std::fprintf(stderr, "pending %d %d; on early %d %d, both %d, none %d; waited %d promptly %d; child %d, leaked %d\n",
               pending, pending_again, on_early, on_early_again, both, none, waited, promptly, child_killed, leaked);
  const bool held = pending == SIGTERM && pending_again == 0 && on_early == SIGTERM && on_early_again == SIGINT &&
                    both && none == 0 && waited == SIGTERM && promptly && child_killed && leaked == 0;
  if (held) std::fprintf(stderr, "every scenario held\n");
  return held ? 0 : 1;
}

// A shutdown signal is taken once, by the next wait, whenever it comes: one
// pending while every thread blocks it, one the kernel gave a thread that
// does not block it (OpenBLAS starts its pool at load, before main, and the
// process died of it), one sent during the wait; a forked child does not
// run the handler before its exec.
TEST(GrpcServerDeathTest, AShutdownSignalWhileNoThreadWaitsIsKeptForTheWait) {
  const std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::_Exit(ShutdownSignalScenarios()), ::testing::ExitedWithCode(0), "every scenario held");
  GTEST_FLAG_SET(death_test_style, style);
}

}  // namespace
}  // namespace colod
