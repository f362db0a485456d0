// Mutual TLS across real processes: a CA and a node certificate made with
// openssl; a coordinator and a worker that require client certificates; the
// worker registers over TLS; coloctl with the CA and a certificate lists it
// (and its health probe passes), coloctl in plaintext or without a
// certificate cannot.
#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/subprocess.h"
#include "tests/testing/temp_dir.h"

namespace colod {
namespace {

using ::colod::testing::Runfile;
using ::colod::testing::TempPath;
using ::colod::testing::RunCommand;
using ::colod::testing::Subprocess;

void Openssl(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"/usr/bin/openssl"};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r = RunCommand(argv, std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(r.code, 0) << r.err;
}

std::unique_ptr<Subprocess> Start(const std::string& binary, const std::string& name,
                                  std::vector<std::string> flags, std::string* grpc) {
  const std::string ready = TempPath(name + ".ready");
  std::vector<std::string> argv = {Runfile(binary), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                                   "--ready-file", ready, "--tls-cert", TempPath("daemons-node.pem"),
                                   "--tls-key", TempPath("daemons-node.key"), "--tls-ca", TempPath("daemons-ca.pem"),
                                   "--tls-refresh-interval=1s"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto p = std::make_unique<Subprocess>(argv, "", TempPath(name + ".log"));
  *grpc = testing::ReadyValue(ready, "grpc", absl::Seconds(30)).value_or("");
  return p;
}

// A CA (PREFIX-ca.pem, its key PREFIX-ca.key) and a node certificate it
// signs (PREFIX-node.pem, PREFIX-node.key) for 127.0.0.1 and localhost, as
// server and as client.
void MakeCertificates(const std::string& prefix) {
  const std::string ca = TempPath(prefix + "-ca"), node = TempPath(prefix + "-node");
  Openssl({"req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca + ".key", "-out", ca + ".pem", "-days", "1",
           "-subj", "/CN=colod-test-ca-" + prefix});
  Openssl({"req", "-newkey", "rsa:2048", "-nodes", "-keyout", node + ".key", "-out", node + ".csr", "-subj",
           "/CN=localhost"});
  std::ofstream(node + ".ext") << "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                               << "extendedKeyUsage=serverAuth,clientAuth\n";
  Openssl({"x509", "-req", "-in", node + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key", "-CAcreateserial", "-out",
           node + ".pem", "-days", "1", "-extfile", node + ".ext"});
}

// `from`'s certificates put where `to` reads its own (TO-ca.pem,
// TO-node.key, TO-node.pem), each by a rename, as a Secret's update swaps
// them.
void Install(const std::string& from, const std::string& to) {
  for (const char* f : {"-ca.pem", "-node.key", "-node.pem"}) {
    const std::string next = TempPath(to + f + std::string(".next"));
    std::filesystem::copy_file(TempPath(from + f), next, std::filesystem::copy_options::overwrite_existing);
    std::filesystem::rename(next, TempPath(to + f));
  }
}

TEST(Tls, MutualTlsBetweenCoordinatorWorkerAndColoctl) {
  MakeCertificates("first");
  Install("first", "daemons");
  std::string coordinator, worker;
  auto c = Start("server/colod-coordinator", "coordinator", {"--data-dir", TempPath("data")}, &coordinator);
  ASSERT_FALSE(coordinator.empty()) << testing::ReadFile(TempPath("coordinator.log"));
  auto w = Start("worker/daemon/colod-worker", "worker", {"--coordinator", coordinator, "--device", "cpu"}, &worker);
  ASSERT_FALSE(worker.empty()) << testing::ReadFile(TempPath("worker.log"));
  const std::string coloctl = Runfile("client/coloctl");
  const std::vector<std::string> tls = {"--tls-ca", TempPath("daemons-ca.pem"), "--tls-cert",
                                        TempPath("daemons-node.pem"), "--tls-key", TempPath("daemons-node.key")};
  size_t listed = 0;
  for (int i = 0; i < 100 && listed == 0; ++i) {
    std::vector<std::string> argv = {coloctl, "--coordinator", coordinator, "--output", "json", "workers"};
    argv.insert(argv.end(), tls.begin(), tls.end());
    const auto r = RunCommand(argv, std::getenv("TEST_TMPDIR"));
    ASSERT_EQ(r.code, 0) << r.err;
    listed = nlohmann::json::parse(r.out).value("workers", nlohmann::json::array()).size();
    if (listed == 0) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(listed, 1u) << testing::ReadFile(TempPath("worker.log"));
  // The probe a TLS container's HEALTHCHECK runs: TLS with the client
  // certificate the coordinator requires; a plaintext probe fails.
  std::vector<std::string> health = {coloctl, "health", coordinator, "--service", "colod.v1.CoordinatorService"};
  health.insert(health.end(), tls.begin(), tls.end());
  const auto healthy = RunCommand(health, std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(healthy.code, 0) << healthy.err;
  EXPECT_EQ(healthy.out, "SERVING\n");
  EXPECT_EQ(RunCommand({coloctl, "health", worker, "--timeout", "3s"}, std::getenv("TEST_TMPDIR")).code, 1);
  // A job over mutual TLS: the coordinator calls the worker as a client with
  // the same certificate, the worker reaches the rendezvous store and reports.
  auto init = RunCommand({coloctl, "init-model", "--out", TempPath("tiny"), "--positions", "32"},
                         std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(init.code, 0) << init.err;
  std::vector<std::string> submit = {coloctl, "--coordinator", coordinator, "submit", "--model", TempPath("tiny"),
                                     "--data", "/usr/share/common-licenses/GPL-3", "--steps", "2", "--batch-size", "2",
                                     "--seq-len", "16", "--watch"};
  submit.insert(submit.end(), tls.begin(), tls.end());
  const auto job = RunCommand(submit, std::getenv("TEST_TMPDIR"), absl::Seconds(120));
  EXPECT_EQ(job.code, 0) << job.err << job.out << testing::ReadFile(TempPath("worker.log"));
  EXPECT_NE(job.out.find("succeeded"), std::string::npos) << job.out;
  // Plaintext, or TLS without a client certificate, does not get in.
  auto plain = RunCommand({coloctl, "--coordinator", coordinator, "--timeout", "3s", "workers"},
                          std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(plain.code, 1);
  EXPECT_NE(plain.err.find("UNAVAILABLE"), std::string::npos) << plain.err;
  auto no_cert = RunCommand({coloctl, "--coordinator", coordinator, "--timeout", "3s", "--tls-ca",
                             TempPath("daemons-ca.pem"), "workers"},
                            std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(no_cert.code, 1) << no_cert.out;
  // A certificate without its key is a usage error.
  EXPECT_EQ(RunCommand({coloctl, "--coordinator", coordinator, "--tls-cert", TempPath("daemons-node.pem"), "workers"},
                       std::getenv("TEST_TMPDIR"))
                .code,
            2);

  // The files renewed in place under a new CA (--tls-refresh-interval=1s):
  // without a restart, the coordinator serves the new certificate and
  // trusts the new CA only (a client with the first CA's files fails, one
  // with the second's gets in), and a job still runs between the daemons.
  MakeCertificates("second");
  Install("second", "daemons");
  const std::vector<std::string> first = {"--tls-ca", TempPath("first-ca.pem"), "--tls-cert",
                                          TempPath("first-node.pem"), "--tls-key", TempPath("first-node.key")};
  bool renewed = false;
  for (int i = 0; i < 100 && !renewed; ++i) {
    std::vector<std::string> argv = {coloctl, "--coordinator", coordinator, "--timeout", "3s", "workers"};
    argv.insert(argv.end(), first.begin(), first.end());
    renewed = RunCommand(argv, std::getenv("TEST_TMPDIR")).code != 0;  // the first CA no longer does
    if (!renewed) absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_TRUE(renewed) << "the coordinator still serves the first certificate 20 s after its renewal";
  std::vector<std::string> listed_now = {coloctl, "--coordinator", coordinator, "--timeout", "3s", "workers"};
  listed_now.insert(listed_now.end(), tls.begin(), tls.end());  // the same paths, the second CA's files now
  const auto now = RunCommand(listed_now, std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(now.code, 0) << now.err;
  const auto again = RunCommand(submit, std::getenv("TEST_TMPDIR"), absl::Seconds(120));
  EXPECT_EQ(again.code, 0) << again.err << again.out << testing::ReadFile(TempPath("worker.log"));
  EXPECT_NE(again.out.find("succeeded"), std::string::npos) << again.out;
}

// The client side of a renewal, in one process: channel credentials made
// once, as a daemon makes them, present the renewed certificate and trust
// the new CA on the next connection; credentials that read the files once
// (--tls-refresh-interval=0) cannot connect any more once the server moved
// to the new CA. (Each channel has a subchannel of its own, so that each
// connects anew.)
TEST(Tls, ChannelCredentialsMadeOnceTakeRenewedFilesOnTheNextConnection) {
  MakeCertificates("a");
  MakeCertificates("b");
  // The server's files and the client's, in places of their own.
  Install("a", "server");
  Install("a", "client");
  auto files = [](const std::string& side, absl::Duration refresh) {
    TlsFiles t{TempPath(side + "-node.pem"), TempPath(side + "-node.key"), TempPath(side + "-ca.pem")};
    t.refresh = refresh;
    return t;
  };
  auto server_credentials = MakeServerCredentials(files("server", absl::Seconds(1)));
  ASSERT_TRUE(server_credentials.ok()) << server_credentials.status();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", *server_credentials, &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);
  auto watched = MakeChannelCredentials(files("client", absl::Seconds(1)));
  auto once = MakeChannelCredentials(files("client", absl::ZeroDuration()));
  ASSERT_TRUE(watched.ok() && once.ok());
  auto connects = [&](const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), credentials, args);
    return channel->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
  };
  EXPECT_TRUE(connects(*watched));
  EXPECT_TRUE(connects(*once));
  // Credentials of the second CA, read once: they cannot connect to a
  // server of the first, and they tell when the server has moved.
  Install("b", "probe");
  auto probe = MakeChannelCredentials(files("probe", absl::ZeroDuration()));
  ASSERT_TRUE(probe.ok());
  EXPECT_FALSE(connects(*probe));
  Install("b", "server");
  bool moved = false;
  for (int i = 0; i < 40 && !moved; ++i) {
    moved = connects(*probe);
    if (!moved) absl::SleepFor(absl::Milliseconds(500));
  }
  ASSERT_TRUE(moved) << "the server did not take its renewed files";
  EXPECT_FALSE(connects(*watched));  // the client's files are still the first CA's
  EXPECT_FALSE(connects(*once));
  Install("b", "client");
  bool renewed = false;
  for (int i = 0; i < 40 && !renewed; ++i) {
    renewed = connects(*watched);
    if (!renewed) absl::SleepFor(absl::Milliseconds(500));
  }
  EXPECT_TRUE(renewed) << "credentials made before the renewal still use the first CA's files";
  EXPECT_FALSE(connects(*once));  // read once: the first CA's, for good
  server->Shutdown();
}

}  // namespace
}  // namespace colod
