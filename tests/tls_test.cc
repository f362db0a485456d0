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
                                   "--ready-file", ready, "--tls-cert", TempPath("daemons/node.pem"),
                                   "--tls-key", TempPath("daemons/node.key"), "--tls-ca", TempPath("daemons/ca.pem"),
                                   "--tls-refresh-interval=1s"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto p = std::make_unique<Subprocess>(argv, "", TempPath(name + ".log"));
  *grpc = testing::ReadyValue(ready, "grpc", absl::Seconds(30)).value_or("");
  return p;
}

// A CA: PREFIX-ca.pem, its key PREFIX-ca.key.
void MakeCa(const std::string& prefix) {
  Openssl({"req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", TempPath(prefix + "-ca.key"), "-out",
           TempPath(prefix + "-ca.pem"), "-days", "1", "-subj", "/CN=colod-test-ca-" + prefix});
}

// A certificate NAME.pem (key NAME.key) that CA's signs for `names` (a
// subjectAltName), as server and as client.
void MakeNode(const std::string& ca, const std::string& name, const std::string& names) {
  const std::string node = TempPath(name);
  Openssl({"req", "-newkey", "rsa:2048", "-nodes", "-keyout", node + ".key", "-out", node + ".csr", "-subj",
           "/CN=colod-test-node"});
  std::ofstream(node + ".ext") << "subjectAltName=" << names << "\nextendedKeyUsage=serverAuth,clientAuth\n";
  Openssl({"x509", "-req", "-in", node + ".csr", "-CA", TempPath(ca + "-ca.pem"), "-CAkey", TempPath(ca + "-ca.key"),
           "-CAcreateserial", "-out", node + ".pem", "-days", "1", "-extfile", node + ".ext"});
}

// A CA and a node certificate of it for 127.0.0.1 and localhost:
// PREFIX-ca.pem, PREFIX-node.pem, PREFIX-node.key.
void MakeCertificates(const std::string& prefix) {
  MakeCa(prefix);
  MakeNode(prefix, prefix + "-node", "IP:127.0.0.1,DNS:localhost");
}

// `from`'s CA, certificate and key (FROM-ca.pem, FROM-node.pem,
// FROM-node.key) put where `to` reads its own (TO/ca.pem, TO/node.pem,
// TO/node.key), all three at once: a new directory swapped in behind the
// symbolic link TO, as the kubelet updates a mounted Secret.
void Install(const std::string& from, const std::string& to) {
  static int version = 0;
  const std::string dir = TempPath(absl::StrCat(to, ".v", ++version));
  std::filesystem::create_directories(dir);
  for (const char* f : {"ca.pem", "node.pem", "node.key"}) {
    std::filesystem::copy_file(TempPath(from + "-" + f), dir + "/" + f);
  }
  const std::string link = TempPath(to + ".link");
  std::filesystem::remove(link);
  std::filesystem::create_directory_symlink(dir, link);
  std::filesystem::rename(link, TempPath(to));
}

// TLS files read where Install puts them.
TlsFiles Files(const std::string& where, absl::Duration refresh) {
  TlsFiles t{TempPath(where + "/node.pem"), TempPath(where + "/node.key"), TempPath(where + "/ca.pem")};
  t.refresh = refresh;
  return t;
}

// A gRPC server on loopback with `files`' credentials (serving no service:
// a handshake is what is tested).
struct TlsServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};
TlsServer ServeTls(const TlsFiles& files) {
  TlsServer out;
  auto credentials = MakeServerCredentials(files);
  EXPECT_TRUE(credentials.ok()) << credentials.status();
  if (!credentials.ok()) return out;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", *credentials, &out.port);
  out.server = builder.BuildAndStart();
  return out;
}

// Whether a new channel with `credentials` (a subchannel of its own, so it
// connects anew) completes its handshake with `port`, verifying the server
// as `name` where given.
bool Connects(const std::shared_ptr<grpc::ChannelCredentials>& credentials, int port, const std::string& name = "") {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (!name.empty()) args.SetSslTargetNameOverride(name);
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), credentials, args);
  return channel->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
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
  const std::vector<std::string> tls = {"--tls-ca", TempPath("daemons/ca.pem"), "--tls-cert",
                                        TempPath("daemons/node.pem"), "--tls-key", TempPath("daemons/node.key")};
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
  // Plaintext to a TLS daemon: no handshake, unreachable.
  EXPECT_EQ(RunCommand({coloctl, "health", worker, "--timeout", "3s"}, std::getenv("TEST_TMPDIR")).code, 69);
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
  EXPECT_EQ(plain.code, 69);
  EXPECT_NE(plain.err.find("UNAVAILABLE"), std::string::npos) << plain.err;
  auto no_cert = RunCommand({coloctl, "--coordinator", coordinator, "--timeout", "3s", "--tls-ca",
                             TempPath("daemons/ca.pem"), "workers"},
                            std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(no_cert.code, 69) << no_cert.out;
  // A certificate without its key is a usage error.
  EXPECT_EQ(RunCommand({coloctl, "--coordinator", coordinator, "--tls-cert", TempPath("daemons/node.pem"), "workers"},
                       std::getenv("TEST_TMPDIR"))
                .code,
            2);

  // The files renewed in place under a new CA (--tls-refresh-interval=1s):
  // without a restart, the coordinator serves the new certificate and
  // trusts the new CA only (a client with the second CA's files gets in,
  // one with the first's no longer does), and a job still runs between the
  // daemons (over connections they may have made before: the client side
  // of a renewal is the next test's).
  MakeCertificates("second");
  Install("second", "daemons");
  std::vector<std::string> listed_now = {coloctl, "--coordinator", coordinator, "--timeout", "3s", "workers"};
  listed_now.insert(listed_now.end(), tls.begin(), tls.end());  // the same paths, the second CA's files now
  bool renewed = false;
  for (int i = 0; i < 100 && !renewed; ++i) {
    renewed = RunCommand(listed_now, std::getenv("TEST_TMPDIR")).code == 0;
    if (!renewed) absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_TRUE(renewed) << "the coordinator does not serve the renewed certificate 20 s after its renewal";
  std::vector<std::string> first = {coloctl, "--coordinator", coordinator, "--timeout", "3s", "workers", "--tls-ca",
                                    TempPath("first-ca.pem"), "--tls-cert", TempPath("first-node.pem"), "--tls-key",
                                    TempPath("first-node.key")};
  EXPECT_NE(RunCommand(first, std::getenv("TEST_TMPDIR")).code, 0);
  const auto again = RunCommand(submit, std::getenv("TEST_TMPDIR"), absl::Seconds(120));
  EXPECT_EQ(again.code, 0) << again.err << again.out << testing::ReadFile(TempPath("worker.log"));
  EXPECT_NE(again.out.find("succeeded"), std::string::npos) << again.out;
}

// The client side of TLS with files read again, in one process. Channel
// credentials made once, as a daemon makes them, verify the server's chain
// and name as SslCredentials do, and after a renewal present the new
// certificate and trust the new CA on the next connection; credentials that
// read the files once (--tls-refresh-interval=0) cannot connect any more
// once the server moved to the new CA.
TEST(Tls, ChannelCredentialsMadeOnceTakeRenewedFilesOnTheNextConnection) {
  MakeCertificates("a");
  MakeCertificates("b");
  Install("a", "server");
  Install("a", "client");
  Install("b", "probe");
  TlsServer server = ServeTls(Files("server", absl::Seconds(1)));
  ASSERT_NE(server.server, nullptr);
  auto watched = MakeChannelCredentials(Files("client", absl::Seconds(1)));
  auto once = MakeChannelCredentials(Files("client", absl::ZeroDuration()));
  // The second CA's, read once: refused by a server of the first; they
  // tell when the server has moved.
  auto probe = MakeChannelCredentials(Files("probe", absl::ZeroDuration()));
  ASSERT_TRUE(watched.ok() && once.ok() && probe.ok());
  EXPECT_TRUE(Connects(*watched, server.port));
  EXPECT_TRUE(Connects(*once, server.port));
  EXPECT_FALSE(Connects(*probe, server.port));

  // Refusals only the client can make, the server taking its certificate:
  // a server of the second CA that trusts both, and a server of the first
  // CA whose certificate names another host (taken when that name is the
  // one verified).
  {
    std::ofstream(TempPath("both-ca.pem")) << testing::ReadFile(TempPath("a-ca.pem"))
                                           << testing::ReadFile(TempPath("b-ca.pem"));
    std::filesystem::copy_file(TempPath("b-node.pem"), TempPath("both-node.pem"));
    std::filesystem::copy_file(TempPath("b-node.key"), TempPath("both-node.key"));
    Install("both", "other-ca");
    TlsServer other_ca = ServeTls(Files("other-ca", absl::Seconds(1)));
    ASSERT_NE(other_ca.server, nullptr);
    EXPECT_TRUE(Connects(*probe, other_ca.port));  // it serves
    EXPECT_FALSE(Connects(*watched, other_ca.port));
    EXPECT_FALSE(Connects(*once, other_ca.port));
    other_ca.server->Shutdown();
    MakeNode("a", "elsewhere-node", "DNS:elsewhere.example");
    std::filesystem::copy_file(TempPath("a-ca.pem"), TempPath("elsewhere-ca.pem"));
    Install("elsewhere", "other-name");
    TlsServer other_name = ServeTls(Files("other-name", absl::Seconds(1)));
    ASSERT_NE(other_name.server, nullptr);
    EXPECT_FALSE(Connects(*watched, other_name.port));
    EXPECT_FALSE(Connects(*once, other_name.port));
    EXPECT_TRUE(Connects(*watched, other_name.port, "elsewhere.example"));
    EXPECT_TRUE(Connects(*once, other_name.port, "elsewhere.example"));
    other_name.server->Shutdown();
  }

  Install("b", "server");
  bool moved = false;
  for (int i = 0; i < 40 && !moved; ++i) {
    moved = Connects(*probe, server.port);
    if (!moved) absl::SleepFor(absl::Milliseconds(500));
  }
  ASSERT_TRUE(moved) << "the server did not take its renewed files";
  EXPECT_FALSE(Connects(*watched, server.port));  // the client's files are still the first CA's
  EXPECT_FALSE(Connects(*once, server.port));
  Install("b", "client");
  bool renewed = false;
  for (int i = 0; i < 40 && !renewed; ++i) {
    renewed = Connects(*watched, server.port);
    if (!renewed) absl::SleepFor(absl::Milliseconds(500));
  }
  EXPECT_TRUE(renewed) << "credentials made before the renewal still use the first CA's files";
  EXPECT_FALSE(Connects(*once, server.port));  // read once: the first CA's, for good
  server.server->Shutdown();
}

}  // namespace
}  // namespace colod
