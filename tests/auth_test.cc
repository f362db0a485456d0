// Bearer-token authentication across real processes: a coordinator and a
// worker started with --auth-token-file; coloctl with the token works, without
// it or with another one the call is UNAUTHENTICATED; health checks and
// reflection stay open; a worker holding the wrong token never registers.
// With --worker-token-file, the clients' token no longer admits the calls
// only workers make, nor the worker token the clients'.
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "colod/v1/coordinator.grpc.pb.h"
#include "colod/v1/tensor.grpc.pb.h"
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

// Trains a tiny model (written to the temp dir's `model`) on `worker`
// through coloctl with the token in `token_file`: the upload and its
// download, AssignJob, the rendezvous store, progress reports.
void TrainATinyModel(const testing::Daemon& coordinator, const testing::Daemon& worker,
                     const std::string& token_file, const std::string& model) {
  const std::string coloctl = Runfile("client/coloctl");
  auto r = RunCommand({coloctl, "init-model", "--out", TempPath(model), "--positions", "32"},
                      std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(r.code, 0) << r.err;
  r = RunCommand({coloctl, "--coordinator", coordinator.grpc, "--auth-token-file", token_file, "submit", "--model",
                  TempPath(model), "--data", "/usr/share/common-licenses/GPL-3", "--steps", "2", "--batch-size", "2",
                  "--seq-len", "16", "--watch"},
                 std::getenv("TEST_TMPDIR"), absl::Seconds(120));
  EXPECT_EQ(r.code, 0) << r.err << r.out << testing::ReadFile(worker.log) << testing::ReadFile(coordinator.log);
  EXPECT_NE(r.out.find("succeeded"), std::string::npos) << r.out;
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
  TrainATinyModel(coordinator, good, TempPath("token"), "tiny");
  // A token file that does not exist is a usage error.
  r = RunCommand({coloctl, "--coordinator", coordinator.grpc, "--auth-token-file", TempPath("nope"), "workers"},
                 std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(r.code, 2);
}

TEST(Auth, WorkersHoldATokenOfTheirOwnThatClientsCannotPoseWith) {
  std::ofstream(TempPath("roles-clients")) << "client-token\n";
  std::ofstream(TempPath("roles-workers")) << "worker-token\n";
  const std::string coloctl = Runfile("client/coloctl");
  // The same token in both roles would separate nothing: refused at start.
  auto same = RunCommand({Runfile("server/colod-coordinator"), "--listen", "127.0.0.1:0", "--metrics-listen",
                          "127.0.0.1:0", "--data-dir", TempPath("roles-same"), "--auth-token-file",
                          TempPath("roles-clients"), "--worker-token-file", TempPath("roles-clients")},
                         std::getenv("TEST_TMPDIR"), absl::Seconds(30));
  EXPECT_NE(same.code, 0);
  EXPECT_NE(same.err.find("--worker-token-file holds the same token as --auth-token-file"), std::string::npos)
      << same.err;
  auto missing = RunCommand({Runfile("server/colod-coordinator"), "--data-dir", TempPath("roles-missing"),
                             "--worker-token-file", TempPath("roles-nope")},
                            std::getenv("TEST_TMPDIR"), absl::Seconds(30));
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.err.find("--worker-token-file: "), std::string::npos) << missing.err;
  // Without a clients' token anyone could call what clients may.
  auto alone = RunCommand({Runfile("server/colod-coordinator"), "--listen", "127.0.0.1:0", "--metrics-listen",
                           "127.0.0.1:0", "--data-dir", TempPath("roles-alone"), "--worker-token-file",
                           TempPath("roles-workers")},
                          std::getenv("TEST_TMPDIR"), absl::Seconds(30));
  EXPECT_NE(alone.code, 0);
  EXPECT_NE(alone.err.find("--worker-token-file needs --auth-token-file"), std::string::npos) << alone.err;

  testing::Daemon coordinator = testing::StartDaemon(
      "server/colod-coordinator", "roles-coordinator",
      {"--data-dir", TempPath("roles-data"), "--auth-token-file", TempPath("roles-clients"), "--worker-token-file",
       TempPath("roles-workers")});
  ASSERT_FALSE(coordinator.grpc.empty());
  testing::Daemon worker = testing::StartDaemon(
      "worker/daemon/colod-worker", "roles-worker",
      {"--coordinator", coordinator.grpc, "--device", "cpu", "--work-dir", TempPath("roles-work0"),
       "--auth-token-file", TempPath("roles-workers")});
  // A worker given the clients' token is refused as one.
  testing::Daemon poser = testing::StartDaemon(
      "worker/daemon/colod-worker", "roles-poser",
      {"--coordinator", coordinator.grpc, "--device", "cpu", "--device-ordinal", "1", "--work-dir",
       TempPath("roles-work1"), "--auth-token-file", TempPath("roles-clients")});
  ASSERT_FALSE(worker.grpc.empty());
  size_t n = 0;
  for (int i = 0; i < 200 && n < 1; ++i) {
    absl::SleepFor(absl::Milliseconds(25));
    n = Workers(coordinator.grpc, "client-token").value_or(0);
  }
  EXPECT_EQ(n, 1u);
  // Listing is a client's call: the worker token does not admit it.
  EXPECT_EQ(Workers(coordinator.grpc, "worker-token").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Workers(coordinator.grpc, "guess").status().code(), absl::StatusCode::kUnauthenticated);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline && testing::ReadFile(poser.log).find("PERMISSION_DENIED") == std::string::npos) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_NE(testing::ReadFile(poser.log).find("this call is a worker's"), std::string::npos)
      << testing::ReadFile(poser.log);
  // The coordinator says so too (at most a line every 10 s).
  EXPECT_NE(testing::ReadFile(coordinator.log).find("refused RegisterWorker from "), std::string::npos)
      << testing::ReadFile(coordinator.log);
  EXPECT_EQ(Workers(coordinator.grpc, "client-token").value_or(0), 1u);

  // What only workers call, with the clients' token: PERMISSION_DENIED, and
  // nothing changes (a live worker's registration is not replaced).
  auto channel = grpc::CreateChannel(coordinator.grpc, grpc::InsecureChannelCredentials());
  auto coord = v1::CoordinatorService::NewStub(channel);
  auto status_of = [](auto&& rpc, const std::string& token) {
    grpc::ClientContext ctx;
    AddAuthToken(ctx, token);
    return rpc(&ctx);
  };
  auto call = [&](auto&& rpc, const std::string& token) { return status_of(rpc, token).error_code(); };
  v1::RegisterWorkerRequest reg;
  reg.mutable_worker()->set_address(worker.grpc);
  v1::RegisterWorkerResponse reg_resp;
  EXPECT_EQ(call([&](grpc::ClientContext* c) { return coord->RegisterWorker(c, reg, &reg_resp); }, "client-token"),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::ReportProgressRequest progress;
  progress.set_job_id("job-x");
  v1::ReportProgressResponse progress_resp;
  EXPECT_EQ(
      call([&](grpc::ClientContext* c) { return coord->ReportProgress(c, progress, &progress_resp); }, "client-token"),
      grpc::StatusCode::PERMISSION_DENIED);
  v1::KvSetRequest kv;
  kv.set_scope("s");
  kv.set_key("k");
  v1::KvSetResponse kv_resp;
  EXPECT_EQ(call([&](grpc::ClientContext* c) { return coord->KvSet(c, kv, &kv_resp); }, "client-token"),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::DeregisterWorkerRequest dereg;
  dereg.set_worker_id("w");
  v1::DeregisterWorkerResponse dereg_resp;
  EXPECT_EQ(
      call([&](grpc::ClientContext* c) { return coord->DeregisterWorker(c, dereg, &dereg_resp); }, "client-token"),
      grpc::StatusCode::PERMISSION_DENIED);
  // And the other way round: the coordinator's tensor calls are a client's.
  auto tensors = v1::TensorService::NewStub(channel);
  v1::ListTensorsRequest list;
  list.set_job_id("job-x");
  v1::ListTensorsResponse list_resp;
  EXPECT_EQ(call([&](grpc::ClientContext* c) { return tensors->ListTensors(c, list, &list_resp); }, "worker-token"),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(call([&](grpc::ClientContext* c) { return tensors->ListTensors(c, list, &list_resp); }, "client-token"),
            grpc::StatusCode::NOT_FOUND);  // past the check: no such job
  // The worker answers the workers' token only: the clients' cannot drive it.
  auto stub = v1::WorkerService::NewStub(grpc::CreateChannel(worker.grpc, grpc::InsecureChannelCredentials()));
  v1::GetStatusResponse status;
  EXPECT_EQ(call([&](grpc::ClientContext* c) { return stub->GetStatus(c, v1::GetStatusRequest(), &status); },
                 "client-token"),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::AbortJobRequest abort;
  abort.set_job_id("job-x");
  v1::AbortJobResponse abort_resp;
  EXPECT_EQ(call([&](grpc::ClientContext* c) { return stub->AbortJob(c, abort, &abort_resp); }, "client-token"),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call([&](grpc::ClientContext* c) { return stub->GetStatus(c, v1::GetStatusRequest(), &status); },
                 "worker-token"),
            grpc::StatusCode::OK);  // a read needs the token only
  // Every worker holds the workers' token; each also holds a key of its
  // own, which the coordinator took when it registered. Without it, the
  // workers' token drives no worker and speaks for none.
  const grpc::Status keyless =
      status_of([&](grpc::ClientContext* c) { return stub->AbortJob(c, abort, &abort_resp); }, "worker-token");
  EXPECT_EQ(keyless.error_code(), grpc::StatusCode::PERMISSION_DENIED) << keyless.error_message();
  EXPECT_NE(keyless.error_message().find("does not carry the worker's key"), std::string::npos)
      << keyless.error_message();
  auto worker_tensors =
      v1::TensorService::NewStub(grpc::CreateChannel(worker.grpc, grpc::InsecureChannelCredentials()));
  EXPECT_EQ(call([&](grpc::ClientContext* c) { return worker_tensors->ListTensors(c, list, &list_resp); },
                 "worker-token"),
            grpc::StatusCode::PERMISSION_DENIED);
  auto listed = CoordinatorClient::Create(coordinator.grpc, [] {
    CoordinatorClient::Options o;
    o.auth_token = "client-token";
    return o;
  }());
  ASSERT_TRUE(listed.ok());
  auto workers = (*listed)->ListWorkers(false);
  ASSERT_TRUE(workers.ok() && workers->size() == 1u) << workers.status();
  const std::string id = (*workers)[0].info().worker_id();
  v1::HeartbeatRequest beat;
  beat.set_worker_id(id);
  v1::HeartbeatResponse beat_resp;
  const grpc::Status forged =
      status_of([&](grpc::ClientContext* c) { return coord->Heartbeat(c, beat, &beat_resp); }, "worker-token");
  EXPECT_EQ(forged.error_code(), grpc::StatusCode::PERMISSION_DENIED) << forged.error_message();
  EXPECT_NE(forged.error_message().find("without the key it registered with"), std::string::npos)
      << forged.error_message();
  dereg.set_worker_id(id);
  EXPECT_EQ(
      call([&](grpc::ClientContext* c) { return coord->DeregisterWorker(c, dereg, &dereg_resp); }, "worker-token"),
      grpc::StatusCode::PERMISSION_DENIED);
  progress.set_worker_id(id);
  EXPECT_EQ(
      call([&](grpc::ClientContext* c) { return coord->ReportProgress(c, progress, &progress_resp); }, "worker-token"),
      grpc::StatusCode::PERMISSION_DENIED);
  // Nor take its place: a registration at its address with another key, or
  // none, is ALREADY_EXISTS while it lives, and it keeps its id (replaced,
  // its job would fail and the coordinator send it the newcomer's key).
  for (const std::string& key : {NewWorkerKey(), std::string()}) {
    reg.set_worker_key(key);
    const grpc::Status usurp =
        status_of([&](grpc::ClientContext* c) { return coord->RegisterWorker(c, reg, &reg_resp); }, "worker-token");
    EXPECT_EQ(usurp.error_code(), grpc::StatusCode::ALREADY_EXISTS) << usurp.error_message();
    EXPECT_NE(usurp.error_message().find(id + " is registered at " + worker.grpc + " with another key"),
              std::string::npos)
        << usurp.error_message();
  }
  workers = (*listed)->ListWorkers(false);
  ASSERT_TRUE(workers.ok() && workers->size() == 1u) << workers.status();
  EXPECT_EQ((*workers)[0].info().worker_id(), id);
  EXPECT_EQ(Workers(coordinator.grpc, "client-token").value_or(0), 1u);

  // Jobs run with each token in its role: the coordinator's calls to the
  // worker (AssignJob, the tensor calls it passes on) carry the workers'
  // token, the worker's to the coordinator (the model's download, the
  // store, progress) too; coloctl carries the clients'.
  auto r = RunCommand({coloctl, "--coordinator", coordinator.grpc, "--auth-token-file", TempPath("roles-clients"),
                       "--tp", "1", "--dp", "1", "tensor", "demo"},
                      std::getenv("TEST_TMPDIR"), absl::Seconds(120));
  EXPECT_EQ(r.code, 0) << r.err << r.out << testing::ReadFile(worker.log) << testing::ReadFile(coordinator.log);
  EXPECT_NE(r.out.find("rank 0: shape [2, 3, 2]"), std::string::npos) << r.out;
  TrainATinyModel(coordinator, worker, TempPath("roles-clients"), "roles-tiny");
  // coloctl with the workers' token is refused, saying why.
  r = RunCommand({coloctl, "--coordinator", coordinator.grpc, "--auth-token-file", TempPath("roles-workers"), "jobs"},
                 std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("PERMISSION_DENIED"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("this call is a client's"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace colod
