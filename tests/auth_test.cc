// Bearer-token authentication across real processes: a coordinator and a
// worker started with --auth-token-file; coloctl with the token works, without
// it or with another one the call is UNAUTHENTICATED; health checks and
// reflection stay open; a worker holding the wrong token never registers.
// With --worker-token-file, the clients' token no longer admits the calls
// only workers make, nor the worker token the clients'.
#include "common/auth.h"

#include <csignal>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "colod/v1/coordinator.grpc.pb.h"
#include "colod/v1/tensor.grpc.pb.h"
#include "colod/v1/worker.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/subprocess.h"
#include "tests/testing/grpc_probe.h"
#include "tests/testing/temp_dir.h"

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
  EXPECT_NE(same.err.find("--worker-token-file holds a token of --auth-token-file"), std::string::npos) << same.err;
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
  // A call carrying another key is refused too, the reads' included: the
  // key of a worker that listened here before is not this daemon's.
  const std::string other_key = NewWorkerKey();
  auto with_key = [&](auto&& rpc, const std::string& key) {
    grpc::ClientContext ctx;
    AddAuthToken(ctx, "worker-token");
    AddWorkerKey(ctx, key);
    return rpc(&ctx);
  };
  for (const grpc::Status& s :
       {with_key([&](grpc::ClientContext* c) { return stub->GetStatus(c, v1::GetStatusRequest(), &status); },
                 other_key),
        with_key([&](grpc::ClientContext* c) { return stub->AbortJob(c, abort, &abort_resp); }, other_key)}) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_message().find("carries another worker process's key"), std::string::npos) << s.error_message();
  }
  // A read carrying no key is answered, not saying the daemon holds one (a
  // registration is proven only by a daemon that says so).
  const grpc::Status read =
      with_key([&](grpc::ClientContext* c) { return stub->GetStatus(c, v1::GetStatusRequest(), &status); }, "");
  EXPECT_TRUE(read.ok()) << read.error_message();
  EXPECT_FALSE(status.worker_key_held());
  // Nor take its place: a registration at its address with another key is
  // PERMISSION_DENIED (the coordinator calls the address with that key, and
  // the daemon there refuses it), one with none ALREADY_EXISTS while it
  // lives, and it keeps its id (replaced, its job would fail and the
  // coordinator send the newcomer's key to it).
  reg.set_worker_key(other_key);
  const grpc::Status usurp =
      status_of([&](grpc::ClientContext* c) { return coord->RegisterWorker(c, reg, &reg_resp); }, "worker-token");
  EXPECT_EQ(usurp.error_code(), grpc::StatusCode::PERMISSION_DENIED) << usurp.error_message();
  EXPECT_NE(usurp.error_message().find("the daemon at " + worker.grpc + " does not hold the key"), std::string::npos)
      << usurp.error_message();
  reg.set_worker_key("");
  const grpc::Status keyless_usurp =
      status_of([&](grpc::ClientContext* c) { return coord->RegisterWorker(c, reg, &reg_resp); }, "worker-token");
  EXPECT_EQ(keyless_usurp.error_code(), grpc::StatusCode::ALREADY_EXISTS) << keyless_usurp.error_message();
  EXPECT_NE(keyless_usurp.error_message().find(id + " is registered at " + worker.grpc + " with another key"),
            std::string::npos)
      << keyless_usurp.error_message();
  // Nor register where no daemon answers with its key: nothing listens at
  // this port (a dead worker's address; a registration is its daemon's).
  v1::RegisterWorkerRequest nowhere = reg;
  nowhere.mutable_worker()->set_address("127.0.0.1:1");
  nowhere.set_worker_key(other_key);
  const grpc::Status squat =
      status_of([&](grpc::ClientContext* c) { return coord->RegisterWorker(c, nowhere, &reg_resp); }, "worker-token");
  EXPECT_EQ(squat.error_code(), grpc::StatusCode::UNAVAILABLE) << squat.error_message();
  EXPECT_NE(squat.error_message().find("the coordinator cannot reach 127.0.0.1:1"), std::string::npos)
      << squat.error_message();
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
  // The worker downloaded the job's upload with its key; once no placed
  // job uses it, a call with the workers' token is refused it, carrying no
  // key or another (a placed job's is CoordinatorTest's).
  auto trained = (*listed)->ListJobs({v1::JOB_STATE_SUCCEEDED});
  ASSERT_TRUE(trained.ok() && trained->size() == 1u) << trained.status();
  const std::string upload = trained->front().spec().model().upload_id();
  ASSERT_FALSE(upload.empty());
  v1::DownloadModelRequest fetch;
  fetch.set_upload_id(upload);
  for (const std::string& key : {std::string(), other_key}) {
    grpc::ClientContext ctx;
    AddAuthToken(ctx, "worker-token");
    AddWorkerKey(ctx, key);
    auto reader = coord->DownloadModel(&ctx, fetch);
    v1::ModelChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk)) << "a chunk of " << chunk.file();
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_message().find("no job placed now uses upload '" + upload + "'"), std::string::npos)
        << s.error_message();
  }
  // coloctl with the workers' token is refused, saying why.
  r = RunCommand({coloctl, "--coordinator", coordinator.grpc, "--auth-token-file", TempPath("roles-workers"), "jobs"},
                 std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("PERMISSION_DENIED"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("this call is a client's"), std::string::npos) << r.err;
}

// A worker daemon killed and started again on its port registers at once,
// in the place of its dead self, rather than after the dead one's lease
// (two minutes here): the daemon at the address answers the coordinator's
// call carrying the new key. The coordinator's calls then reach the new
// process with its key, and a job runs there.
TEST(Auth, AWorkerRestartedOnItsPortReplacesItsDeadSelfAtOnce) {
  testing::Daemon coordinator =
      testing::StartDaemon("server/colod-coordinator", "restart-coordinator",
                           {"--data-dir", TempPath("restart-data"), "--heartbeat-interval", "1s", "--lease-duration",
                            "120s"});
  ASSERT_FALSE(coordinator.grpc.empty());
  auto client = CoordinatorClient::Create(coordinator.grpc, CoordinatorClient::Options());
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<testing::Daemon> first;
  first.push_back(testing::StartDaemon(
      "worker/daemon/colod-worker", "restart-first",
      {"--coordinator", coordinator.grpc, "--device", "cpu", "--work-dir", TempPath("restart-work0")}));
  ASSERT_FALSE(first[0].grpc.empty());
  ASSERT_TRUE(testing::WaitForWorkers(**client, 1).ok()) << testing::DaemonLogs(coordinator, first);
  auto listed = (*client)->ListWorkers(false);
  ASSERT_TRUE(listed.ok() && listed->size() == 1u) << listed.status();
  const std::string dead_id = (*listed)[0].info().worker_id();
  const std::string address = first[0].grpc;
  first[0].process->Signal(SIGKILL);  // no deregistration: its lease runs on
  ASSERT_TRUE(first[0].process->Wait(absl::Seconds(10)).has_value());

  const absl::Time restarted = absl::Now();
  testing::Daemon again = testing::StartDaemon(
      "worker/daemon/colod-worker", "restart-again",
      {"--coordinator", coordinator.grpc, "--device", "cpu", "--work-dir", TempPath("restart-work1"), "--listen",
       address});
  ASSERT_EQ(again.grpc, address) << testing::ReadFile(again.log);
  std::string new_id;
  for (int i = 0; i < 400 && new_id.empty(); ++i) {
    listed = (*client)->ListWorkers(false);
    if (listed.ok() && listed->size() == 1u && (*listed)[0].info().worker_id() != dead_id) {
      new_id = (*listed)[0].info().worker_id();
    } else {
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  ASSERT_FALSE(new_id.empty()) << testing::ReadFile(again.log) << testing::ReadFile(coordinator.log);
  EXPECT_LT(absl::Now() - restarted, absl::Seconds(30));  // the lease had 120 s to run
  EXPECT_EQ((*listed)[0].info().address(), address);
  const std::string log = testing::ReadFile(coordinator.log);
  EXPECT_NE(log.find("worker " + dead_id + " at " + address + " was replaced by " + new_id), std::string::npos) << log;
  auto r = testing::RunColoctl({"--coordinator", coordinator.grpc, "--tp", "1", "--dp", "1", "tensor", "demo"},
                               absl::Seconds(120));
  EXPECT_EQ(r.code, 0) << r.err << r.out << testing::ReadFile(again.log) << testing::ReadFile(coordinator.log);
  EXPECT_NE(r.out.find("rank 0: shape [2, 3, 2]"), std::string::npos) << r.out;
}

// Replaces `path` at once with `text`, as the kubelet swaps a mounted
// Secret's files.
void Replace(const std::string& path, const std::string& text) {
  std::ofstream(path + ".new") << text;
  ASSERT_EQ(std::rename((path + ".new").c_str(), path.c_str()), 0);
}

// Whether `log` says `text` `times` times within 10 s.
bool LogSays(const std::string& log, const std::string& text, int times) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (true) {
    const std::string said = testing::ReadFile(log);
    int n = 0;
    for (size_t at = said.find(text); at != std::string::npos; at = said.find(text, at + 1)) ++n;
    if (n >= times) return true;
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// Tokens rotated while the daemons run, as docs/SECURITY.md says (each
// daemon with a file of its own, as each pod mounts its Secret): the new
// token added as a second line, then moved first, then the old one dropped;
// the daemons read their files again every 100 ms. No call is refused on
// the way (the worker heartbeats every 200 ms; a job runs while the
// coordinator sends the new workers' token and the worker the old one),
// and afterwards the old tokens admit nothing, and a worker registers with
// the new one (the coordinator proves its key with it). A clients' file
// that would take the workers' token is refused as a bad read.
TEST(Auth, TokensRotatedWhileTheDaemonsRunRefuseNoCall) {
  const std::string clients = TempPath("rot-clients"), coordinators = TempPath("rot-coordinator-workers"),
                    workers = TempPath("rot-worker");
  std::ofstream(clients) << "client-old\n";
  std::ofstream(coordinators) << "worker-old\n";
  std::ofstream(workers) << "worker-old\n";
  testing::Daemon coordinator =
      testing::StartDaemon("server/colod-coordinator", "rot-coordinator",
                           {"--data-dir", TempPath("rot-data"), "--auth-token-file", clients, "--worker-token-file",
                            coordinators, "--auth-token-refresh-interval", "100ms", "--heartbeat-interval", "200ms"});
  ASSERT_FALSE(coordinator.grpc.empty());
  testing::Daemon worker =
      testing::StartDaemon("worker/daemon/colod-worker", "rot-worker",
                           {"--coordinator", coordinator.grpc, "--device", "cpu", "--work-dir", TempPath("rot-work"),
                            "--auth-token-file", workers, "--auth-token-refresh-interval", "100ms"});
  ASSERT_FALSE(worker.grpc.empty());
  size_t n = 0;
  for (int i = 0; i < 400 && n < 1; ++i) {
    absl::SleepFor(absl::Milliseconds(25));
    n = Workers(coordinator.grpc, "client-old").value_or(0);
  }
  ASSERT_EQ(n, 1u) << testing::ReadFile(coordinator.log);
  // The workers' token: added, moved first, the old one dropped; the
  // coordinator's file first each time.
  int step = 0;
  for (const char* tokens : {"worker-old\nworker-new\n", "worker-new\nworker-old\n", "worker-new\n"}) {
    ++step;
    Replace(coordinators, tokens);
    ASSERT_TRUE(LogSays(coordinator.log, "--worker-token-file: read again", step))
        << testing::ReadFile(coordinator.log);
    if (step == 2) TrainATinyModel(coordinator, worker, clients, "rot-tiny");  // the coordinator sends the new one
    Replace(workers, tokens);
    ASSERT_TRUE(LogSays(worker.log, "--auth-token-file: read again", step)) << testing::ReadFile(worker.log);
    absl::SleepFor(absl::Milliseconds(500));  // heartbeats
  }
  // The clients' token likewise (the coordinator's file alone).
  Replace(clients, "client-old\nclient-new\n");
  ASSERT_TRUE(LogSays(coordinator.log, "--auth-token-file: read again", 1));
  EXPECT_EQ(Workers(coordinator.grpc, "client-new").value_or(0), 1u);
  EXPECT_EQ(Workers(coordinator.grpc, "client-old").value_or(0), 1u);
  Replace(clients, "client-new\n");
  ASSERT_TRUE(LogSays(coordinator.log, "--auth-token-file: read again", 2));
  EXPECT_EQ(Workers(coordinator.grpc, "client-new").value_or(0), 1u);
  // Nothing was refused on the way, either way.
  EXPECT_EQ(testing::ReadFile(coordinator.log).find("refused "), std::string::npos)
      << testing::ReadFile(coordinator.log);
  EXPECT_EQ(testing::ReadFile(worker.log).find("heartbeat to"), std::string::npos) << testing::ReadFile(worker.log);
  EXPECT_EQ(Workers(coordinator.grpc, "client-old").status().code(), absl::StatusCode::kUnauthenticated);
  // The worker takes only the new workers' token now.
  auto stub = v1::WorkerService::NewStub(grpc::CreateChannel(worker.grpc, grpc::InsecureChannelCredentials()));
  v1::GetStatusResponse resp;
  grpc::ClientContext old_token, new_token;
  AddAuthToken(old_token, "worker-old");
  EXPECT_EQ(stub->GetStatus(&old_token, v1::GetStatusRequest(), &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  AddAuthToken(new_token, "worker-new");
  EXPECT_TRUE(stub->GetStatus(&new_token, v1::GetStatusRequest(), &resp).ok());
  // A worker registers with the new token: the coordinator calls it back with it.
  testing::Daemon second =
      testing::StartDaemon("worker/daemon/colod-worker", "rot-worker2",
                           {"--coordinator", coordinator.grpc, "--device", "cpu", "--device-ordinal", "1", "--work-dir",
                            TempPath("rot-work2"), "--auth-token-file", workers});
  ASSERT_FALSE(second.grpc.empty());
  for (int i = 0; i < 400 && n < 2; ++i) {
    absl::SleepFor(absl::Milliseconds(25));
    n = Workers(coordinator.grpc, "client-new").value_or(0);
  }
  EXPECT_EQ(n, 2u) << testing::ReadFile(coordinator.log) << testing::ReadFile(second.log);
  // The workers' token put in the clients' file too is refused as a read:
  // the clients' tokens stay, and the workers' token admits no client call.
  Replace(clients, "client-new\nworker-new\n");
  EXPECT_TRUE(LogSays(coordinator.log, "' holds a token of --worker-token-file", 1));
  EXPECT_EQ(Workers(coordinator.grpc, "worker-new").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Workers(coordinator.grpc, "client-new").value_or(0), 2u);
}

}  // namespace
}  // namespace colod
