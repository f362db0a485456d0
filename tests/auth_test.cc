// Bearer-token authentication across real processes: a coordinator and a
// worker started with --auth-token-file; coloctl with the token works, without
// it or with another one the call is UNAUTHENTICATED; health checks and
// reflection stay open; a worker holding the wrong token never registers.
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "colod/v1/worker.grpc.pb.h"
#include "common/auth.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/subprocess.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/grpc_probe.h"

namespace colod {
namespace {

using ::colod::testing::Runfile;
using ::colod::testing::TempPath;
using ::colod::testing::RunCommand;
using ::colod::testing::Subprocess;

absl::StatusOr<size_t> Workers(const std::string& address, const std::string& token) {
  CoordinatorClient::Options o;
  o.auth_token = token;
  auto c = CoordinatorClient::Create(address, o);
  if (!c.ok()) return c.status();
  auto list = (*c)->ListWorkers(false);
  if (!list.ok()) return list.status();
  return list->size();
}

TEST(Auth, EveryColodCallNeedsTheTokenAndHealthStaysOpen) {
  std::ofstream(TempPath("token")) << "s3cret-token\n";
  std::ofstream(TempPath("other")) << "not-the-token";
  testing::Daemon coordinator = testing::StartDaemon("server/colod-coordinator", "coordinator",
                             {"--data-dir", TempPath("data"), "--auth-token-file", TempPath("token")});
  ASSERT_FALSE(coordinator.grpc.empty());
  testing::Daemon good = testing::StartDaemon("worker/daemon/colod-worker", "good",
                      {"--coordinator", coordinator.grpc, "--device", "cpu", "--auth-token-file", TempPath("token")});
  testing::Daemon bad = testing::StartDaemon("worker/daemon/colod-worker", "bad",
                     {"--coordinator", coordinator.grpc, "--device", "cpu", "--device-ordinal", "1",
                      "--auth-token-file", TempPath("other")});
  ASSERT_FALSE(good.grpc.empty());
  // The worker with the token registers; the other one never does.
  size_t n = 0;
  for (int i = 0; i < 200 && n < 1; ++i) {
    absl::SleepFor(absl::Milliseconds(25));
    n = Workers(coordinator.grpc, "s3cret-token").value_or(0);
  }
  EXPECT_EQ(n, 1u);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ(Workers(coordinator.grpc, "s3cret-token").value_or(0), 1u);
  EXPECT_EQ(Workers(coordinator.grpc, "").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Workers(coordinator.grpc, "guess").status().code(), absl::StatusCode::kUnauthenticated);
  // Health and reflection answer without it.
  EXPECT_EQ(*testing::HealthCheck(coordinator.grpc, "colod.v1.CoordinatorService"), testing::ServingStatus::kServing);
  EXPECT_TRUE(testing::ListServicesByReflection(coordinator.grpc).ok());
  // The worker's own service wants the token too.
  auto stub = v1::WorkerService::NewStub(grpc::CreateChannel(good.grpc, grpc::InsecureChannelCredentials()));
  v1::GetStatusResponse resp;
  grpc::ClientContext bare;
  EXPECT_EQ(stub->GetStatus(&bare, v1::GetStatusRequest(), &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  grpc::ClientContext with;
  AddAuthToken(with, "s3cret-token");
  EXPECT_TRUE(stub->GetStatus(&with, v1::GetStatusRequest(), &resp).ok());
  const std::string coloctl = Runfile("client/coloctl");
  // coloctl health needs no token and never reads $COLOD_AUTH_TOKEN_FILE.
  auto health = RunCommand({"/usr/bin/env", "COLOD_AUTH_TOKEN_FILE=" + TempPath("nope"), coloctl, "health",
                            coordinator.grpc, "--service", "colod.v1.CoordinatorService"},
                           std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(health.code, 0) << health.err;
  // coloctl: the flag or $COLOD_AUTH_TOKEN_FILE.
  auto r = RunCommand({coloctl, "--coordinator", coordinator.grpc, "--auth-token-file", TempPath("token"), "workers"},
                      std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(r.code, 0) << r.err;
  r = RunCommand({coloctl, "--coordinator", coordinator.grpc, "workers"}, std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("UNAUTHENTICATED"), std::string::npos) << r.err;
  r = RunCommand({"/usr/bin/env", "COLOD_AUTH_TOKEN_FILE=" + TempPath("token"), coloctl, "--coordinator",
                  coordinator.grpc, "workers"},
                 std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(r.code, 0) << r.err;
  // A job runs through every authenticated path: the upload and its
  // download, AssignJob, the rendezvous store, progress reports.
  r = RunCommand({coloctl, "init-model", "--out", TempPath("tiny"), "--positions", "32"}, std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(r.code, 0) << r.err;
  r = RunCommand({coloctl, "--coordinator", coordinator.grpc, "--auth-token-file", TempPath("token"), "submit",
                  "--model", TempPath("tiny"), "--data", "/usr/share/common-licenses/GPL-3", "--steps", "2",
                  "--batch-size", "2", "--seq-len", "16", "--watch"},
                 std::getenv("TEST_TMPDIR"), absl::Seconds(120));
  EXPECT_EQ(r.code, 0) << r.err << r.out << testing::ReadFile(good.log) << testing::ReadFile(coordinator.log);
  EXPECT_NE(r.out.find("succeeded"), std::string::npos) << r.out;
  // A token file that does not exist is a usage error.
  r = RunCommand({coloctl, "--coordinator", coordinator.grpc, "--auth-token-file", TempPath("nope"), "workers"},
                 std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(r.code, 2);
}

}  // namespace
}  // namespace colod
