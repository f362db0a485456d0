// `coloctl health` as a container HEALTHCHECK runs it: real daemons on
// loopback, the exit code (0 only when SERVING) and the one status word, no
// coordinator needed, and never longer than the deadline.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/subprocess.h"
#include "tests/testing/temp_dir.h"

namespace colod {
namespace {

using ::colod::testing::Daemon;
using ::colod::testing::Runfile;
using ::colod::testing::StartDaemon;
using ::colod::testing::TempPath;

const std::string kCoordinator = "server/colod-coordinator";
const std::string kWorker = "worker/daemon/colod-worker";

// `coloctl health ARGS...` with $COLOD_COORDINATOR pointing where nothing
// listens: health must neither need nor use it.
testing::CommandResult Health(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"/usr/bin/env", "COLOD_COORDINATOR=127.0.0.1:1", Runfile("client/coloctl"),
                                   "health"};
  argv.insert(argv.end(), args.begin(), args.end());
  return testing::RunCommand(argv, TempPath(""), absl::Seconds(30));
}

TEST(Health, CoordinatorAndWorkerReadiness) {
  Daemon coordinator = StartDaemon(kCoordinator, "coordinator", {"--data-dir", TempPath("data")});
  ASSERT_FALSE(coordinator.grpc.empty()) << testing::ReadFile(coordinator.log);
  auto whole = Health({coordinator.grpc});
  EXPECT_EQ(whole.code, 0) << whole.err;
  EXPECT_EQ(whole.out, "SERVING\n");
  auto ready = Health({coordinator.grpc, "--service", "colod.v1.CoordinatorService"});
  EXPECT_EQ(ready.code, 0) << ready.err;
  EXPECT_EQ(ready.out, "SERVING\n");
  auto json = Health({coordinator.grpc, "--service", "colod.v1.CoordinatorService", "--output", "json"});
  EXPECT_EQ(json.code, 0) << json.err;
  EXPECT_EQ(nlohmann::json::parse(json.out, nullptr, false),
            (nlohmann::json{{"address", coordinator.grpc},
                            {"service", "colod.v1.CoordinatorService"},
                            {"status", "SERVING"}}))
      << json.out;
  auto unknown = Health({coordinator.grpc, "--service", "no.such.Service"});
  EXPECT_EQ(unknown.code, 1) << unknown.err;
  EXPECT_EQ(unknown.out, "SERVICE_UNKNOWN\n");

  // A worker whose coordinator is not there runs (the server answers) but is
  // not ready for work. Port 1 is privileged: nothing of ours listens there.
  Daemon orphan = StartDaemon(kWorker, "orphan", {"--coordinator", "127.0.0.1:1", "--device", "cpu"});
  ASSERT_FALSE(orphan.grpc.empty()) << testing::ReadFile(orphan.log);
  auto not_ready = Health({orphan.grpc, "--service", "colod.v1.WorkerService"});
  EXPECT_EQ(not_ready.code, 1) << not_ready.err;
  EXPECT_EQ(not_ready.out, "NOT_SERVING\n");
  EXPECT_EQ(Health({orphan.grpc}).code, 0);

  // A worker of the running coordinator: SERVING once it registered.
  Daemon worker = StartDaemon(kWorker, "worker", {"--coordinator", coordinator.grpc, "--device", "cpu"});
  ASSERT_FALSE(worker.grpc.empty()) << testing::ReadFile(worker.log);
  testing::CommandResult registered;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  do {
    registered = Health({worker.grpc, "--service", "colod.v1.WorkerService"});
    if (registered.code == 0) break;
    absl::SleepFor(absl::Milliseconds(100));
  } while (absl::Now() < deadline);
  EXPECT_EQ(registered.code, 0) << registered.out << registered.err << testing::ReadFile(worker.log);
  EXPECT_EQ(registered.out, "SERVING\n");
}

TEST(Health, FailsWithinTheDeadline) {
  // Refused: nothing listens on port 1.
  auto refused = Health({"127.0.0.1:1", "--timeout", "1s"});
  EXPECT_EQ(refused.code, 69);  // unreachable, not NOT_SERVING (1)
  EXPECT_TRUE(absl::StrContains(refused.err, "UNAVAILABLE")) << refused.err;
  EXPECT_TRUE(absl::StrContains(refused.err, "127.0.0.1:1")) << refused.err;

  // Silent: a socket that listens but never accepts. The kernel completes the
  // TCP handshake, no HTTP/2 ever follows, and only the deadline ends the probe.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 16), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string silent_address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  const absl::Time start = absl::Now();
  auto silent = Health({silent_address, "--timeout", "1s"});
  const absl::Duration took = absl::Now() - start;
  ::close(fd);
  EXPECT_EQ(silent.code, 69) << silent.out << silent.err;
  EXPECT_TRUE(absl::StrContains(silent.err, "DEADLINE_EXCEEDED")) << silent.err;
  EXPECT_TRUE(absl::StrContains(silent.err, silent_address)) << silent.err;
  EXPECT_GE(took, absl::Seconds(1));
  EXPECT_LT(took, absl::Seconds(10));
}

TEST(Health, UsageErrors) {
  auto missing = Health({});
  EXPECT_EQ(missing.code, 2);
  EXPECT_TRUE(absl::StrContains(missing.err, "health: missing ADDR")) << missing.err;
  auto stray = Health({"127.0.0.1:1", "extra"});
  EXPECT_EQ(stray.code, 2);
  EXPECT_TRUE(absl::StrContains(stray.err, "unexpected argument 'extra'")) << stray.err;
  auto malformed = Health({"nowhere"});
  EXPECT_EQ(malformed.code, 2);
  EXPECT_TRUE(absl::StrContains(malformed.err, "nowhere")) << malformed.err;
  EXPECT_EQ(Health({"127.0.0.1:1", "--tls-cert", TempPath("missing.pem")}).code, 2);
}

}  // namespace
}  // namespace colod
