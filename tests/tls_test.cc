// Mutual TLS across real processes: a CA and a node certificate made with
// openssl; a coordinator and a worker that require client certificates; the
// worker registers over TLS; coloctl with the CA and a certificate lists it
// (and its health probe passes), coloctl in plaintext or without a
// certificate cannot.
#include <fstream>

#include "absl/strings/str_cat.h"
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
                                   "--ready-file", ready, "--tls-cert", TempPath("node.pem"), "--tls-key",
                                   TempPath("node.key"), "--tls-ca", TempPath("ca.pem")};
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto p = std::make_unique<Subprocess>(argv, "", TempPath(name + ".log"));
  *grpc = testing::ReadyValue(ready, "grpc", absl::Seconds(30)).value_or("");
  return p;
}

TEST(Tls, MutualTlsBetweenCoordinatorWorkerAndColoctl) {
  Openssl({"req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", TempPath("ca.key"), "-out", TempPath("ca.pem"), "-days",
           "1", "-subj", "/CN=colod-test-ca"});
  Openssl({"req", "-newkey", "rsa:2048", "-nodes", "-keyout", TempPath("node.key"), "-out", TempPath("node.csr"), "-subj",
           "/CN=localhost"});
  std::ofstream(TempPath("node.ext")) << "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                 << "extendedKeyUsage=serverAuth,clientAuth\n";
  Openssl({"x509", "-req", "-in", TempPath("node.csr"), "-CA", TempPath("ca.pem"), "-CAkey", TempPath("ca.key"), "-CAcreateserial",
           "-out", TempPath("node.pem"), "-days", "1", "-extfile", TempPath("node.ext")});
  std::string coordinator, worker;
  auto c = Start("server/colod-coordinator", "coordinator", {"--data-dir", TempPath("data")}, &coordinator);
  ASSERT_FALSE(coordinator.empty()) << testing::ReadFile(TempPath("coordinator.log"));
  auto w = Start("worker/daemon/colod-worker", "worker", {"--coordinator", coordinator, "--device", "cpu"}, &worker);
  ASSERT_FALSE(worker.empty()) << testing::ReadFile(TempPath("worker.log"));
  const std::string coloctl = Runfile("client/coloctl");
  const std::vector<std::string> tls = {"--tls-ca", TempPath("ca.pem"), "--tls-cert", TempPath("node.pem"), "--tls-key",
                                        TempPath("node.key")};
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
  auto no_cert = RunCommand({coloctl, "--coordinator", coordinator, "--timeout", "3s", "--tls-ca", TempPath("ca.pem"),
                             "workers"},
                            std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(no_cert.code, 1) << no_cert.out;
  // A certificate without its key is a usage error.
  EXPECT_EQ(RunCommand({coloctl, "--coordinator", coordinator, "--tls-cert", TempPath("node.pem"), "workers"},
                       std::getenv("TEST_TMPDIR"))
                .code,
            2);
}

}  // namespace
}  // namespace colod
