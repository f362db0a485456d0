// `coloctl local`: an embedded cluster of a coordinator and N CPU workers as
// child processes, announced once every worker registered, stopped by
// SIGTERM, and gone with coloctl even when coloctl is killed.
#include <signal.h>

#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "client/local_cluster.h"
#include "nlohmann/json.hpp"
#include "tests/subprocess.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/grpc_probe.h"

namespace colod {
namespace {

using ::colod::testing::Runfile;
using ::colod::testing::TempPath;
using ::colod::testing::RunCommand;
using ::colod::testing::Subprocess;

bool Reachable(const std::string& address) {
  return testing::HealthCheck(address, "").ok();
}

TEST(Local, AnnouncesServesAndStopsItsCluster) {
  Subprocess local({Runfile("client/coloctl"), "local", "--workers", "3", "--listen", "127.0.0.1:0"},
                   TempPath("local.out"), TempPath("local.err"));
  const std::string address = testing::LocalClusterAddress(TempPath("local.out"));
  ASSERT_FALSE(address.empty()) << testing::ReadFile(TempPath("local.err"));
  const auto r = RunCommand({Runfile("client/coloctl"), "--coordinator", address, "workers", "--output", "json"},
                            std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto listed = nlohmann::json::parse(r.out);
  ASSERT_EQ(listed["workers"].size(), 3u) << r.out;
  std::vector<std::string> workers;
  for (const auto& w : listed["workers"]) {
    EXPECT_EQ(w["state"], "WORKER_STATE_IDLE");
    workers.push_back(w["info"]["address"]);
    EXPECT_TRUE(Reachable(workers.back()));
  }
  local.Signal(SIGTERM);
  const auto code = local.Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << testing::ReadFile(TempPath("local.err"));
  EXPECT_FALSE(Reachable(address));
  for (const std::string& w : workers) EXPECT_FALSE(Reachable(w)) << w;
}

// A worker that exits before it registers (no such device, a build without
// CUDA) fails the cluster at once, naming it and its log, instead of at the
// registration deadline (60 s) with "did not register".
TEST(Local, AWorkerThatExitsAtStartFailsTheClusterAtOnce) {
  LocalCluster::Options o;
  o.workers = 2;
  o.coordinator_binary = Runfile("server/colod-coordinator");
  o.worker_binary = "/bin/false";
  o.data_dir = TempPath("dead-worker");
  const absl::Time start = absl::Now();
  const absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "exited with status 1 before it registered")) << c.status();
  // Both workers exit: whichever is seen first is named, with its own log.
  const bool first = absl::StrContains(c.status().message(), "local worker 0 exited");
  const bool second = absl::StrContains(c.status().message(), "local worker 1 exited");
  EXPECT_TRUE(first || second) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), first ? "worker-0.log" : "worker-1.log")) << c.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

TEST(Local, ItsDaemonsDieWithAKilledColoctl) {
  Subprocess local({Runfile("client/coloctl"), "local", "--workers", "2", "--listen", "127.0.0.1:0"},
                   TempPath("killed.out"), TempPath("killed.err"));
  const std::string address = testing::LocalClusterAddress(TempPath("killed.out"));
  ASSERT_FALSE(address.empty()) << testing::ReadFile(TempPath("killed.err"));
  local.Signal(SIGKILL);
  ASSERT_TRUE(local.Wait(absl::Seconds(10)).has_value());
  bool gone = false;
  for (int i = 0; i < 100 && !gone; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    gone = !Reachable(address);
  }
  EXPECT_TRUE(gone) << "the coordinator outlived coloctl";
  EXPECT_EQ(RunCommand({Runfile("client/coloctl"), "local", "--workers", "0"}, std::getenv("TEST_TMPDIR")).code, 2);
}

// An empty --coordinator (a script's unset "$COORD") is a usage error: no
// embedded cluster starts, and no call goes to the default address.
TEST(Local, AnEmptyCoordinatorIsAUsageErrorNotTheEmbeddedCluster) {
  for (const std::vector<std::string>& flag :
       std::vector<std::vector<std::string>>{{"--coordinator", ""}, {"--coordinator="}}) {
    std::vector<std::string> argv = {Runfile("client/coloctl")};
    argv.insert(argv.end(), flag.begin(), flag.end());
    for (const char* a : {"train", "--model", "/nonexistent", "--data", "/nonexistent"}) argv.push_back(a);
    const auto r = RunCommand(argv, std::getenv("TEST_TMPDIR"), absl::Seconds(30));
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_NE(r.err.find("--coordinator is empty"), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;  // no cluster announced, nothing trained
  }
}

// tensor create checks its --shape before any call: a missing or
// overflowing one is a usage error (2) even where no coordinator answers.
TEST(Local, TensorCreateChecksItsShapeBeforeAnyCall) {
  for (const std::string& shape : {"", "--shape=4611686018427387904,4", "--shape=2,0"}) {
    std::vector<std::string> argv = {Runfile("client/coloctl"), "--coordinator", "127.0.0.1:1", "--timeout", "2s",
                                     "tensor", "create", "job-000001", "t"};
    if (!shape.empty()) argv.push_back(shape);
    const auto r = RunCommand(argv, std::getenv("TEST_TMPDIR"), absl::Seconds(30));
    EXPECT_EQ(r.code, 2) << shape << ": " << r.err;
    EXPECT_NE(r.err.find("--shape"), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace colod
