// A worker daemon against a real coordinator over loopback gRPC.
#include "worker/daemon/worker_daemon.h"

#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "client/coordinator_client.h"
#include "common/atomic_file.h"
#include "common/host_memory.h"
#include "common/proto_time.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "server/coordinator.h"
#include "spec/job_validation.h"
#include "tests/testing/grpc_probe.h"
#include "tests/testing/job_specs.h"
#include "tests/testing/prometheus_text.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"
#include "worker/tensor/npy.h"

namespace colod {
namespace {

using ::colod::testing::ServingStatus;

std::unique_ptr<Coordinator> StartCoordinator(const std::string& listen, const std::string& dir) {
  Coordinator::Options o;
  o.listen = listen;
  o.data_dir = testing::TempPath(dir);
  o.heartbeat_interval = absl::Milliseconds(50);
  o.lease_duration = absl::Seconds(30);
  o.store_any_scope = true;  // tests assign ranks to the worker themselves: no generation is placed
  auto c = Coordinator::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// A CPU worker for `coordinator` that retries registration quickly.
WorkerDaemon::Options FastRetryOptions(const std::string& coordinator) {
  WorkerDaemon::Options o;
  o.coordinator = coordinator;
  o.device = "cpu";
  o.initial_backoff = absl::Milliseconds(20);
  o.max_backoff = absl::Milliseconds(100);
  return o;
}

TEST(WorkerDaemon, RegistersHeartbeatsAndBecomesServing) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c1");
  ASSERT_NE(coordinator, nullptr);
  WorkerDaemon::Options o;
  o.coordinator = coordinator->address();
  o.device = "cpu";
  auto worker = WorkerDaemon::Start(o);
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE((*worker)->WaitRegistered(absl::Seconds(20)));
  const absl::Time start = absl::Now();
  while ((*worker)->heartbeats_acked() < 3 && absl::Now() - start < absl::Seconds(20)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_GE((*worker)->heartbeats_acked(), 3);
  EXPECT_EQ(*testing::HealthCheck((*worker)->address(), "colod.v1.WorkerService"),
            ServingStatus::kServing);

  auto workers = coordinator->workers().List(false);
  ASSERT_EQ(workers.size(), 1u);
  EXPECT_EQ(workers[0].info().worker_id(), (*worker)->worker_id());
  EXPECT_EQ(workers[0].info().address(), (*worker)->address());
  EXPECT_EQ(workers[0].info().device_kind(), v1::DEVICE_KIND_CPU);
  // Without --memory-limit: the host's (or cgroup's) less a tenth, at least 1 GiB.
  EXPECT_EQ(workers[0].info().memory_bytes(), WorkerDaemon::DefaultRankMemory(HostMemoryBytes()));
  constexpr int64_t kGiB = int64_t{1} << 30;
  EXPECT_EQ(WorkerDaemon::DefaultRankMemory(80 * kGiB), 72 * kGiB);
  EXPECT_EQ(WorkerDaemon::DefaultRankMemory(4 * kGiB), 3 * kGiB);
  EXPECT_EQ(WorkerDaemon::DefaultRankMemory(2 * kGiB), kGiB);
  EXPECT_EQ(WorkerDaemon::DefaultRankMemory(kGiB), kGiB / 2);

  auto services = testing::ListServicesByReflection((*worker)->address());
  ASSERT_TRUE(services.ok()) << services.status();
  EXPECT_NE(std::find(services->begin(), services->end(), "colod.v1.WorkerService"), services->end());

  auto body = testing::HttpGet((*worker)->metrics_address(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  auto families = testing::ParsePrometheusText(*body);
  ASSERT_TRUE(families.ok()) << families.status();
  EXPECT_EQ(families->at("colod_build_info").samples.at(0).labels.at("component"), "worker");
}

TEST(WorkerDaemon, ReRegistersWhenTheCoordinatorForgetsIt) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c2");
  ASSERT_NE(coordinator, nullptr);
  const std::string address = coordinator->address();
  auto worker = WorkerDaemon::Start(FastRetryOptions(address));
  ASSERT_TRUE(worker.ok());
  ASSERT_TRUE((*worker)->WaitRegistered(absl::Seconds(20)));

  // A restarted coordinator (same address, empty registry) answers the next
  // heartbeat with NOT_FOUND; the worker registers again.
  coordinator->Shutdown();
  coordinator.reset();
  coordinator = StartCoordinator(address, "c2b");
  ASSERT_NE(coordinator, nullptr);
  const absl::Time start = absl::Now();
  while (coordinator->workers().List(false).empty() && absl::Now() - start < absl::Seconds(30)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  auto workers = coordinator->workers().List(false);
  ASSERT_EQ(workers.size(), 1u);
  EXPECT_EQ(workers[0].info().address(), (*worker)->address());
}

// Forgotten, a worker is not ready for work until the coordinator takes it
// again: here one whose registry is full (--max-workers 1) of another.
TEST(WorkerDaemon, IsNotServingWhileItRegistersAgain) {
  Coordinator::Options o;
  o.listen = "127.0.0.1:0";
  o.data_dir = testing::TempPath("c-again");
  // Heartbeats a second apart: the other worker below registers well
  // before this one's next heartbeat finds itself forgotten.
  o.heartbeat_interval = absl::Seconds(1);
  auto coordinator = Coordinator::Start(o);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  const std::string address = (*coordinator)->address();
  auto worker = WorkerDaemon::Start(FastRetryOptions(address));
  ASSERT_TRUE(worker.ok());
  ASSERT_TRUE((*worker)->WaitRegistered(absl::Seconds(20)));
  EXPECT_EQ(*testing::HealthCheck((*worker)->address(), "colod.v1.WorkerService"), ServingStatus::kServing);

  (*coordinator)->Shutdown();
  coordinator->reset();
  o.listen = address;
  o.data_dir = testing::TempPath("c-again-b");
  o.max_workers = 1;
  auto restarted = Coordinator::Start(o);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  // Another worker takes the one place before our worker's next heartbeat.
  v1::WorkerInfo info;
  info.set_address("127.0.0.1:1");
  info.set_device_kind(v1::DEVICE_KIND_CPU);
  auto other = (*restarted)->workers().Register(info);
  ASSERT_TRUE(other.ok()) << other.status();
  // Forgotten (NOT_FOUND), refused (RESOURCE_EXHAUSTED): NOT_SERVING.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  absl::StatusOr<ServingStatus> health;
  do {
    health = testing::HealthCheck((*worker)->address(), "colod.v1.WorkerService");
    if (health.ok() && *health == ServingStatus::kNotServing) break;
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < deadline);
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, ServingStatus::kNotServing);
  EXPECT_EQ((*worker)->worker_id(), "");
  // The place freed, it registers and serves again.
  ASSERT_TRUE((*restarted)->workers().Deregister(other->worker_id, "test").ok());
  ASSERT_TRUE((*worker)->WaitRegistered(absl::Seconds(30)));
  EXPECT_EQ(*testing::HealthCheck((*worker)->address(), "colod.v1.WorkerService"), ServingStatus::kServing);
}

TEST(WorkerDaemon, WaitsNotServingUntilACoordinatorAppears) {
  // Reserve a port by starting and stopping a coordinator, then point the
  // worker at it before anything listens there.
  auto probe = StartCoordinator("127.0.0.1:0", "c3");
  ASSERT_NE(probe, nullptr);
  const std::string address = probe->address();
  probe->Shutdown();
  probe.reset();

  auto worker = WorkerDaemon::Start(FastRetryOptions(address));
  ASSERT_TRUE(worker.ok());
  EXPECT_FALSE((*worker)->WaitRegistered(absl::Milliseconds(300)));
  EXPECT_EQ(*testing::HealthCheck((*worker)->address(), "colod.v1.WorkerService"),
            ServingStatus::kNotServing);
  EXPECT_EQ(*testing::HealthCheck((*worker)->address(), ""), ServingStatus::kServing);

  auto coordinator = StartCoordinator(address, "c3b");
  ASSERT_NE(coordinator, nullptr);
  ASSERT_TRUE((*worker)->WaitRegistered(absl::Seconds(30)));
  EXPECT_EQ(*testing::HealthCheck((*worker)->address(), "colod.v1.WorkerService"),
            ServingStatus::kServing);
}

TEST(WorkerDaemon, GetStatusAndUnsupportedCallsSayWhat) {
  WorkerDaemon::Options o;
  o.device = "cpu";
  auto worker = WorkerDaemon::Start(o);
  ASSERT_TRUE(worker.ok());
  auto stub = v1::WorkerService::NewStub(
      grpc::CreateChannel((*worker)->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::GetStatusResponse status;
  ASSERT_TRUE(stub->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok());
  EXPECT_EQ(status.status().state(), v1::WORKER_STATE_IDLE);
  EXPECT_EQ(status.info().address(), (*worker)->address());
  EXPECT_EQ(status.info().device_kind(), v1::DEVICE_KIND_CPU);

  grpc::ClientContext ctx2;
  v1::AbortJobRequest abort;
  abort.set_job_id("job-000001");
  v1::AbortJobResponse ar;
  EXPECT_EQ(stub->AbortJob(&ctx2, abort, &ar).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx3;
  v1::AssignJobRequest assign;
  v1::AssignJobResponse asr;
  EXPECT_EQ(stub->AssignJob(&ctx3, assign, &asr).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // A standalone worker has no rendezvous store to build communicators with.
  grpc::ClientContext ctx4;
  assign.set_job_id("job-000001");
  EXPECT_EQ(stub->AssignJob(&ctx4, assign, &asr).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST(WorkerDaemon, RejectsBadOptions) {
  WorkerDaemon::Options o;
  o.device = "tpu";
  EXPECT_EQ(WorkerDaemon::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.device = "cpu";
  o.device_ordinal = -1;
  EXPECT_EQ(WorkerDaemon::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  // An ordinal past the machine's GPUs (the emulation's 4) is a mistake,
  // not a CPU worker. (Without GPUs, --device=auto is a CPU worker.)
  if (kernels::CudaDeviceCount() > 0) {
    o.device = "auto";
    o.device_ordinal = kernels::CudaDeviceCount();
    const absl::Status past = WorkerDaemon::Start(o).status();
    EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument) << past;
    EXPECT_NE(past.message().find("--device-ordinal"), std::string::npos) << past;
  }
  o.device = "cpu";
  o.device_ordinal = 0;
  o.coordinator = "nowhere";
  EXPECT_EQ(WorkerDaemon::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.coordinator = "";
  for (absl::Duration bad : {absl::ZeroDuration(), absl::Milliseconds(999), absl::Hours(25), absl::InfiniteDuration()}) {
    o.comm_timeout = bad;
    const absl::Status comm = WorkerDaemon::Start(o).status();
    EXPECT_EQ(comm.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(comm.message().find("--comm-timeout"), std::string::npos) << comm;
  }
  o.comm_timeout = absl::Minutes(2);
  for (absl::Duration bad : {absl::Seconds(-1), absl::Hours(25), absl::InfiniteDuration()}) {
    o.metrics_linger = bad;
    const absl::Status linger = WorkerDaemon::Start(o).status();
    EXPECT_EQ(linger.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(linger.message().find("--metrics-linger"), std::string::npos) << linger;
  }
  o.metrics_linger = absl::Minutes(1);
  for (absl::Duration bad : {absl::Seconds(-1), absl::Hours(25), absl::InfiniteDuration()}) {
    o.drain_timeout = bad;
    const absl::Status drain = WorkerDaemon::Start(o).status();
    EXPECT_EQ(drain.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(drain.message().find("--drain-timeout"), std::string::npos) << drain;
  }
  o.drain_timeout = absl::ZeroDuration();  // no drain: allowed
  {
    auto started = WorkerDaemon::Start(o);
    EXPECT_TRUE(started.ok()) << started.status();
  }
  o.drain_timeout = absl::Minutes(1);
  o.advertise_host = std::string(600, 'h');
  EXPECT_EQ(WorkerDaemon::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.advertise_host = "";
  for (int bad : {0, 1}) {
    o.max_server_threads = bad;
    const absl::Status threads = WorkerDaemon::Start(o).status();
    EXPECT_EQ(threads.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(threads.message().find("--max-server-threads"), std::string::npos) << threads;
  }
}

// A work directory is one worker's: a second worker given it is refused (its
// cache's leftovers would be the first's downloads in progress). A start
// that fails leaves no work directory of its own behind.
TEST(WorkerDaemon, AWorkDirectoryIsOneWorkersAndAFailedStartLeavesNone) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-work-dir");
  ASSERT_NE(coordinator, nullptr);
  WorkerDaemon::Options o = FastRetryOptions(coordinator->address());
  o.work_dir = testing::TempPath("shared-work-dir");
  auto first = WorkerDaemon::Start(o);
  ASSERT_TRUE(first.ok()) << first.status();
  const absl::Status second = WorkerDaemon::Start(o).status();
  EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition) << second;
  EXPECT_NE(second.message().find("--work-dir: '" + o.work_dir + "' is in use by another worker"), std::string::npos)
      << second;
  first->reset();  // stopped: the directory is free again
  auto third = WorkerDaemon::Start(o);
  EXPECT_TRUE(third.ok()) << third.status();
  third->reset();

  // Its port taken: the start fails after it made a work directory under
  // TMPDIR, which goes with it.
  const std::string tmp = testing::TempPath("own-work-dirs");
  std::filesystem::create_directories(tmp);
  struct RestoreTmpdir {  // whatever way the test ends
    std::optional<std::string> was;
    ~RestoreTmpdir() { was.has_value() ? ::setenv("TMPDIR", was->c_str(), 1) : ::unsetenv("TMPDIR"); }
  } restore{std::getenv("TMPDIR") != nullptr ? std::optional<std::string>(std::getenv("TMPDIR")) : std::nullopt};
  ASSERT_EQ(::setenv("TMPDIR", tmp.c_str(), 1), 0);
  auto holder = WorkerDaemon::Start(FastRetryOptions(coordinator->address()));
  ASSERT_TRUE(holder.ok()) << holder.status();
  WorkerDaemon::Options taken = FastRetryOptions(coordinator->address());
  taken.listen = (*holder)->address();
  const absl::Status refused = WorkerDaemon::Start(taken).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;  // after it made its work directory
  EXPECT_NE(refused.message().find("cannot listen on"), std::string::npos) << refused;
  // A --work-dir it made goes too; one that was there stays, as it was.
  taken.work_dir = testing::TempPath("made-work-dir/a/b");
  EXPECT_EQ(WorkerDaemon::Start(taken).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(std::filesystem::exists(testing::TempPath("made-work-dir")));
  taken.work_dir = testing::TempPath("kept-work-dir");
  std::filesystem::create_directories(taken.work_dir + "/cache");
  EXPECT_EQ(WorkerDaemon::Start(taken).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(std::filesystem::exists(taken.work_dir + "/cache"));
  holder->reset();
  EXPECT_TRUE(std::filesystem::is_empty(tmp));
}

// A GPT-2 with 9,799,168 parameters: 149.5 MiB a rank with AdamW at tp 1.
v1::JobSpec MidSizeTrainSpec() {
  v1::JobSpec spec = testing::TinyTrainSpec(
      1, 1, R"({"model_type": "gpt2", "vocab_size": 1000, "n_embd": 256, "n_layer": 12, "n_head": 4, "n_positions": 256})");
  spec.mutable_model()->set_weights_path("/nonexistent/model.safetensors");
  return spec;
}

// Rank 0 of a one-rank job `job_id` running `spec`, as the coordinator
// assigns it.
v1::AssignJobRequest RankZero(const std::string& job_id, const v1::JobSpec& spec) {
  v1::AssignJobRequest assign;
  assign.set_job_id(job_id);
  assign.set_generation(1);
  assign.set_rank(0);
  assign.set_rendezvous_scope(job_id + "/gen-1");
  *assign.mutable_mesh() = DeviceMesh::FromShardConfig(spec.shard())->ToProto();
  *assign.mutable_spec() = spec;
  return assign;
}

// A TENSOR job's spec at tp `tp`, dp 1.
v1::JobSpec TensorSpec(int tp) {
  v1::JobSpec tensor;
  tensor.set_kind(v1::JOB_KIND_TENSOR);
  tensor.mutable_shard()->set_tensor_parallel_size(tp);
  tensor.mutable_shard()->set_data_parallel_size(1);
  return tensor;
}

// A JobRunner's options against `coordinator`, working in TEST_TMPDIR/`name`.
JobRunner::Options RunnerOptions(const Coordinator& coordinator, const std::string& name) {
  JobRunner::Options ro;
  ro.work_dir = testing::TempPath(name);
  ro.coordinator = v1::CoordinatorService::NewStub(
      grpc::CreateChannel(coordinator.address(), grpc::InsecureChannelCredentials()));
  return ro;
}

// A FORWARD job of a tiny GPT-2 written under TEST_TMPDIR/`name`-model on
// `batch` sequences of 16 ids (the input in `name`-ids.npy) at tp 1 and
// `dp`; its model's config in `config`.
absl::StatusOr<v1::JobSpec> TinyForwardSpec(const std::string& name, int64_t batch, int dp, ModelConfig* config) {
  auto model = shardformer::testing::WriteTinyGpt2(testing::TempPath(name + "-model"));
  if (!model.ok()) return model.status();
  *config = model->config;
  std::ifstream config_file(model->dir + "/config.json");
  const std::string json((std::istreambuf_iterator<char>(config_file)), std::istreambuf_iterator<char>());
  auto ids = Tensor::FromInt64s({batch, 16}, std::vector<int64_t>(batch * 16, 1));
  if (!ids.ok()) return ids.status();
  const std::string input = testing::TempPath(name + "-ids.npy");
  if (absl::Status s = WriteNpy(input, *ids); !s.ok()) return s;
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_FORWARD);
  spec.mutable_model()->set_config_json(json);
  spec.mutable_model()->set_weights_path(model->dir);
  spec.mutable_shard()->set_tensor_parallel_size(1);
  spec.mutable_shard()->set_data_parallel_size(dp);
  spec.mutable_forward()->set_input_path(input);
  return spec;
}

// A forward's logits are gathered whole on every rank: an input whose
// logits do not fit the worker's memory is refused once it is read, naming
// the sizes, before any of it is computed (a CPU worker would otherwise be
// killed by the kernel for it).
TEST(WorkerDaemon, AForwardWhoseLogitsDoNotFitIsRefusedBeforeItRuns) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-forward-memory");
  ASSERT_NE(coordinator, nullptr);
  ModelConfig config;
  absl::StatusOr<v1::JobSpec> made = TinyForwardSpec("forward-memory", 2048, 1, &config);
  ASSERT_TRUE(made.ok()) << made.status();
  const v1::JobSpec& spec = *made;
  const int64_t vocab = config.vocab_size;
  JobRunner::Options ro = RunnerOptions(*coordinator, "runner-forward-memory");
  const int64_t logits = 2048 * 16 * vocab * 4;
  ro.memory_bytes = logits;  // room for one copy, not two
  JobRunner runner(ro);
  ASSERT_TRUE(runner.Assign(RankZero("job-525252", spec)).ok());
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(60)));
  const std::string error = runner.Status().last_error();
  EXPECT_TRUE(absl::StrContains(error, absl::StrCat("RESOURCE_EXHAUSTED: the forward's logits [2048, 16, ", vocab,
                                                    "] take")))
      << error;
  EXPECT_TRUE(absl::StrContains(error, "split the input into smaller batches")) << error;
  // The status says which rank ended and how, after its report was tried
  // (the coordinator's word where the report is lost).
  v1::WorkerStatus ended = runner.Status();
  EXPECT_EQ(ended.ended_job_id(), "job-525252");
  EXPECT_EQ(ended.ended_rank(), 0);
  EXPECT_EQ(ended.ended_code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  // With room for both copies and the model, it runs.
  ro.memory_bytes = 3 * logits + (int64_t{64} << 20);
  ro.work_dir = testing::TempPath("runner-forward-memory-2");
  JobRunner roomy(ro);
  ASSERT_TRUE(roomy.Assign(RankZero("job-525253", spec)).ok());
  ASSERT_TRUE(roomy.WaitIdle(absl::Seconds(60)));
  EXPECT_EQ(roomy.Status().last_error(), "");
  ended = roomy.Status();
  EXPECT_EQ(ended.ended_job_id(), "job-525253");
  EXPECT_EQ(ended.ended_code(), 0);
}

// Without a logits_path nothing is gathered: a rank holds its replica's
// rows only, so at dp=2 a worker with room for half the logits twice runs
// the pass that it refuses when the logits are to be written.
TEST(WorkerDaemon, AForwardWithoutLogitsPathHoldsOnlyItsReplicasLogits) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-forward-dp");
  ASSERT_NE(coordinator, nullptr);
  ModelConfig config;
  absl::StatusOr<v1::JobSpec> made = TinyForwardSpec("forward-dp", 512, 2, &config);
  ASSERT_TRUE(made.ok()) << made.status();
  v1::JobSpec spec = *made;
  const int64_t logits = int64_t{512} * 16 * config.vocab_size * 4;
  // Two copies of half the logits, and the model: not two whole copies.
  const int64_t memory = logits + RankMemoryFloorBytes(spec);
  // Both ranks of job `id` on runners of `memory` bytes; rank 0's error.
  const auto run = [&](const std::string& id, const v1::JobSpec& job) {
    std::vector<std::unique_ptr<JobRunner>> runners;
    for (int rank = 0; rank < 2; ++rank) {
      JobRunner::Options ro = RunnerOptions(*coordinator, absl::StrCat("runner-forward-dp-", id, "-", rank));
      ro.memory_bytes = memory;
      runners.push_back(std::make_unique<JobRunner>(ro));
      v1::AssignJobRequest assign = RankZero(id, job);
      assign.set_rank(rank);
      EXPECT_TRUE(runners.back()->Assign(assign).ok());
    }
    for (auto& r : runners) EXPECT_TRUE(r->WaitIdle(absl::Seconds(60)));
    return runners[0]->Status().last_error();
  };
  EXPECT_EQ(run("job-626261", spec), "");
  spec.mutable_forward()->set_logits_path(testing::TempPath("forward-dp-logits.npy"));
  const std::string refused = run("job-626262", spec);
  EXPECT_TRUE(absl::StrContains(refused, absl::StrCat("RESOURCE_EXHAUSTED: the forward's logits [512, 16, ",
                                                      config.vocab_size, "] take")))
      << refused;
  EXPECT_TRUE(absl::StrContains(refused, "gathered on every rank")) << refused;
}

TEST(WorkerDaemon, AMemoryLimitIsReportedAndNoRankNeedingMoreRuns) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-memory");
  ASSERT_NE(coordinator, nullptr);
  WorkerDaemon::Options o = FastRetryOptions(coordinator->address());
  o.memory_limit_bytes = int64_t{64} << 20;
  auto worker = WorkerDaemon::Start(o);
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE((*worker)->WaitRegistered(absl::Seconds(20)));
  auto workers = coordinator->workers().List(false);
  ASSERT_EQ(workers.size(), 1u);
  EXPECT_EQ(workers[0].info().memory_bytes(), int64_t{64} << 20);

  // The coordinator refuses the job: its one worker is too small.
  auto client = CoordinatorClient::Create(coordinator->address());
  ASSERT_TRUE(client.ok()) << client.status();
  auto refused = (*client)->SubmitJob(MidSizeTrainSpec());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "the largest of the 1 registered workers has 0.06 GiB"))
      << refused.status();

  // A rank sent anyway (an older coordinator) refuses before it allocates.
  JobRunner::Options ro = RunnerOptions(*coordinator, "runner-memory");
  ro.memory_bytes = int64_t{64} << 20;
  JobRunner runner(ro);
  // A job uid that is not lowercase hex (it joins the job id in the
  // checkpoints' writer) is refused at once.
  for (const std::string& uid : std::vector<std::string>{"0123_abc", "ABCDEF", "../x", std::string(33, 'a')}) {
    v1::AssignJobRequest bad = RankZero("job-424241", MidSizeTrainSpec());
    bad.set_job_uid(uid);
    EXPECT_EQ(runner.Assign(bad).code(), absl::StatusCode::kInvalidArgument) << uid;
  }
  // A job id names the rank's directory, which is removed whole: a path,
  // or a NUL that would cut the path short, is refused, and nothing outside
  // the work directory is touched.
  const std::string outside = testing::TempPath("outside-the-work-dir");
  std::filesystem::create_directories(outside);
  for (const std::string& id : std::vector<std::string>{std::string("../outside-the-work-dir\0", 24), "job/1",
                                                        "../x", "job.1", std::string(129, 'a')}) {
    EXPECT_EQ(runner.Assign(RankZero(id, MidSizeTrainSpec())).code(), absl::StatusCode::kInvalidArgument)
        << absl::CHexEscape(id);
  }
  EXPECT_TRUE(std::filesystem::exists(outside));
  ASSERT_TRUE(runner.Assign(RankZero("job-424242", MidSizeTrainSpec())).ok());
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(30)));
  const std::string error = runner.Status().last_error();
  EXPECT_TRUE(absl::StrContains(error, "RESOURCE_EXHAUSTED: the model needs at least 0.15 GiB per rank (9799168 "
                                       "parameters"))
      << error;
  EXPECT_TRUE(absl::StrContains(error, "this worker has 0.06 GiB")) << error;
}

// A rank's error may quote a file's bytes: here a token .npy whose dtype
// is not UTF-8. The worker sends its last error in every heartbeat; sent
// as it was, no heartbeat would parse at the coordinator again and the
// worker would be lost for good. It is sent valid and bounded, and the
// worker heartbeats on.
TEST(WorkerDaemon, ARankErrorQuotingBytesThatAreNotUtf8KeepsTheWorkerHeartbeating) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-bad-bytes");
  ASSERT_NE(coordinator, nullptr);
  auto worker = WorkerDaemon::Start(FastRetryOptions(coordinator->address()));
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE((*worker)->WaitRegistered(absl::Seconds(20)));
  auto model = shardformer::testing::WriteTinyGpt2(testing::TempPath("bad-bytes-model"));
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string header = "{'descr': '<\xff\xfe', 'fortran_order': False, 'shape': (64,), }";
  std::string npy = std::string("\x93NUMPY\x01\x00", 8) + std::string(1, static_cast<char>(header.size())) +
                    std::string(1, '\0') + header;
  npy += std::string(64 * 2, '\0');
  const std::string data = testing::TempPath("bad-bytes.npy");
  std::ofstream(data, std::ios::binary) << npy;
  std::ifstream config_file(model->dir + "/config.json");
  const std::string config((std::istreambuf_iterator<char>(config_file)), std::istreambuf_iterator<char>());
  v1::JobSpec spec = testing::TinyTrainSpec(1, 1, config);
  spec.mutable_model()->set_weights_path(model->dir);
  spec.mutable_train()->set_data_path(data);
  spec.mutable_train()->set_data_format("npy");
  spec.mutable_restart()->set_max_restarts(0);
  auto client = CoordinatorClient::Create(coordinator->address());
  ASSERT_TRUE(client.ok());
  auto job = (*client)->SubmitJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string fffd = "\xEF\xBF\xBD";
  std::string last_error;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline && !absl::StrContains(last_error, "token arrays must hold integers")) {
    absl::SleepFor(absl::Milliseconds(20));
    const std::vector<v1::Worker> listed = coordinator->workers().List(false);
    if (listed.size() == 1) last_error = listed[0].status().last_error();
  }
  // As the coordinator received it, in a heartbeat, and in the rank's
  // result: the job failed with it.
  EXPECT_TRUE(absl::StrContains(last_error, "not '<" + fffd + fffd + "'")) << absl::CHexEscape(last_error);
  auto ended = (*client)->GetJob(job->job_id());
  while (absl::Now() < deadline && ended.ok() && ended->state() != v1::JOB_STATE_FAILED) {
    absl::SleepFor(absl::Milliseconds(20));
    ended = (*client)->GetJob(job->job_id());
  }
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(ended->reason(), "not '<" + fffd + fffd + "'")) << absl::CHexEscape(ended->reason());
  const int64_t acked = (*worker)->heartbeats_acked();
  while (absl::Now() < deadline && (*worker)->heartbeats_acked() < acked + 3) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_GE((*worker)->heartbeats_acked(), acked + 3);
  EXPECT_EQ(coordinator->workers().List(false).size(), 1u);
}

// A worker that shuts down closes its runner before its server drains: the
// running rank (here a TENSOR job's, which serves until stopped) is aborted
// at once, and no assignment is taken after it.
TEST(WorkerDaemon, AClosedRunnerAbortsItsRankAndTakesNoOther) {
  Coordinator::Options o;
  o.data_dir = testing::TempPath("close-coordinator");
  o.store_any_scope = true;  // the test assigns the ranks itself
  auto coordinator = Coordinator::Start(o);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  JobRunner runner(RunnerOptions(**coordinator, "runner-close"));
  const v1::JobSpec tensor = TensorSpec(1);
  ASSERT_TRUE(runner.Assign(RankZero("job-000001", tensor)).ok());
  EXPECT_FALSE(runner.WaitIdle(absl::Milliseconds(500)));  // it serves
  const absl::Time start = absl::Now();
  runner.Close("");  // the default reason
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(30)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_TRUE(absl::StrContains(runner.Status().last_error(), "the worker is shutting down"))
      << runner.Status().last_error();
  const absl::Status again = runner.Assign(RankZero("job-000002", tensor));
  EXPECT_EQ(again.code(), absl::StatusCode::kUnavailable) << again;
}

// The coordinator sends a stopping placement's aborts while its
// assignments may still be on their way: an abort that arrives first is
// remembered (by job id, uid and generation), and the assignment after it
// refused (ABORTED), not run until its first report. So is an assignment
// of a generation older than one that runs or ran here; a job without a
// uid (an older coordinator, whose numbering may start again) is not held
// to it.
TEST(WorkerDaemon, AnAssignmentOfAnAbortedOrOlderGenerationIsRefused) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "generations-coordinator");
  ASSERT_NE(coordinator, nullptr);
  JobRunner runner(RunnerOptions(*coordinator, "runner-generations"));
  const v1::JobSpec tensor = TensorSpec(1);
  const auto generation = [&](int64_t g, const std::string& uid = "00c0ffee") {
    v1::AssignJobRequest a = RankZero("job-000003", tensor);
    a.set_generation(g);
    a.set_job_uid(uid);
    a.set_rendezvous_scope(absl::StrCat("job-000003/gen-", g));
    return a;
  };
  const auto abort = [&](int64_t g, const std::string& uid = "00c0ffee") {
    v1::AbortJobRequest a;
    a.set_job_id("job-000003");
    a.set_job_uid(uid);
    a.set_generation(g);
    return runner.Abort(a);
  };
  EXPECT_EQ(abort(1).code(), absl::StatusCode::kNotFound);  // it does not run here (yet)
  absl::Status s = runner.Assign(generation(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "was told to abort its generation 1 before this assignment arrived")) << s;
  // The same job id under another uid is another job.
  ASSERT_TRUE(runner.Assign(generation(1, "0badcafe")).ok());
  ASSERT_TRUE(abort(1, "0badcafe").ok());
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(30)));
  // The next generation runs; the older one is refused while it runs, and
  // after it ended.
  ASSERT_TRUE(runner.Assign(generation(2)).ok());
  EXPECT_FALSE(runner.WaitIdle(absl::Milliseconds(200)));  // it serves
  s = runner.Assign(generation(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "this worker runs its generation 2")) << s;
  EXPECT_TRUE(runner.Assign(generation(2)).ok());  // a duplicate delivery of the running one
  ASSERT_TRUE(abort(2).ok());
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(30)));
  EXPECT_TRUE(runner.Assign(generation(2)).ok());  // a duplicate of the one that ended: nothing starts
  EXPECT_TRUE(runner.WaitIdle(absl::Milliseconds(1)));
  s = runner.Assign(generation(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "this worker ran its generation 2")) << s;
  // An abort of the same job id under another uid (a coordinator that
  // numbers its jobs from 1 again) is not this job's: it stops nothing.
  ASSERT_TRUE(runner.Assign(generation(3)).ok());
  EXPECT_EQ(abort(3, "0badcafe").code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(runner.WaitIdle(absl::Seconds(2))) << "another job's abort stopped the rank";
  ASSERT_TRUE(abort(3).ok());
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(30)));
  // A rank that ended is not started again by a very late repeat of its
  // assignment, once another rank ended after it.
  ASSERT_TRUE(runner.Assign(generation(4, "0badcafe")).ok());
  ASSERT_TRUE(abort(4, "0badcafe").ok());
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(30)));
  s = runner.Assign(generation(3));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "this worker ran its generation 3")) << s;
  // Without a uid, neither the abort nor the generations hold.
  EXPECT_EQ(abort(5, "").code(), absl::StatusCode::kNotFound);
  v1::AssignJobRequest keyless = generation(1, "");
  ASSERT_TRUE(runner.Assign(keyless).ok());
  EXPECT_FALSE(runner.WaitIdle(absl::Milliseconds(200)));
  runner.Close("");
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(30)));
}

// A worker whose drain has no time (--drain-timeout 0) still takes no rank
// once it begins to shut down: the coordinator's assignment until Shutdown
// deregisters it is refused as the worker's own state, not run.
TEST(WorkerDaemon, AWorkerThatShutsDownWithoutADrainTakesNoRank) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-no-drain");
  ASSERT_NE(coordinator, nullptr);
  WorkerDaemon::Options o = FastRetryOptions(coordinator->address());
  o.drain_timeout = absl::ZeroDuration();
  auto worker = WorkerDaemon::Start(o);
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE((*worker)->WaitRegistered(absl::Seconds(20)));
  (*worker)->Drain();
  auto client = CoordinatorClient::Create(coordinator->address());
  ASSERT_TRUE(client.ok()) << client.status();
  const v1::JobSpec tensor = TensorSpec(1);
  auto job = (*client)->SubmitJob(tensor);
  ASSERT_TRUE(job.ok()) << job.status();
  // The job goes back to PENDING for the refusal (and waits out the
  // worker's cool-off); it never ran.
  std::string refusal;
  bool ran = false;
  const absl::Status watched = (*client)->WatchJob(job->job_id(), 1, absl::Seconds(30), [&](const v1::JobEvent& e) {
    if (!e.has_state_change()) return true;
    ran |= e.state_change().state() == v1::JOB_STATE_RUNNING;
    if (absl::StrContains(e.state_change().reason(), "refused the assignment")) refusal = e.state_change().reason();
    return refusal.empty();
  });
  EXPECT_EQ(watched.code(), absl::StatusCode::kCancelled) << watched;
  EXPECT_TRUE(absl::StrContains(refusal, "UNAVAILABLE: this worker takes no rank: the worker is shutting down"))
      << refusal;
  EXPECT_FALSE(ran);
  const std::vector<v1::Worker> listed = coordinator->workers().List(false);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].status().state(), v1::WORKER_STATE_IDLE);
}

// A worker's default work directory left by a worker that was killed (its
// LOCK unlocked: the lock ended with its process) is removed; a live
// worker's (locked), one being made (no LOCK yet, or written just now) and
// other names are left alone.
TEST(WorkerDaemon, AbandonedDefaultWorkDirsAreRemoved) {
  const std::string root = ::colod::testing::TempPath("abandoned-roots");
  std::filesystem::remove_all(root);
  const auto make = [&](const std::string& name, bool lock_file) {
    std::filesystem::create_directories(root + "/" + name + "/uploads/u");
    std::ofstream(root + "/" + name + "/uploads/u/model.safetensors") << "weights";
    if (lock_file) std::ofstream(root + "/" + name + "/LOCK") << "12345\n";
  };
  make("colod-worker.dead01", true);
  make("colod-worker.fresh1", true);  // LOCK written just now: a worker taking it
  make("colod-worker.nolock", false);
  make("other.dead02", true);
  absl::StatusOr<int> live = LockDirectory(root + "/colod-worker.live01", "--work-dir", "worker");
  ASSERT_TRUE(live.ok()) << live.status();
  const auto old = std::filesystem::file_time_type::clock::now() - std::chrono::minutes(5);
  for (const char* name : {"colod-worker.dead01", "colod-worker.live01", "other.dead02"}) {
    std::filesystem::last_write_time(root + "/" + name + "/LOCK", old);
  }
  EXPECT_EQ(WorkerDaemon::RemoveAbandonedWorkDirs(root), 1);
  EXPECT_FALSE(std::filesystem::exists(root + "/colod-worker.dead01"));
  for (const char* kept : {"colod-worker.fresh1", "colod-worker.nolock", "colod-worker.live01", "other.dead02"}) {
    EXPECT_TRUE(std::filesystem::exists(root + "/" + kept)) << kept;
  }
  ::close(*live);
  EXPECT_EQ(WorkerDaemon::RemoveAbandonedWorkDirs(root), 1);  // its worker ended
  EXPECT_FALSE(std::filesystem::exists(root + "/colod-worker.live01"));
}

// The heartbeat interval a registration's answer asks for is kept within
// sense: an answer without one (or a malformed one) does not make the
// worker heartbeat at every wake, nor a huge one let its lease expire.
TEST(WorkerDaemon, TheHeartbeatIntervalIsBoundedByTheLease) {
  const auto interval = [](absl::Duration asked, absl::Duration lease) {
    v1::RegisterWorkerResponse r;
    if (asked != absl::ZeroDuration()) *r.mutable_heartbeat_interval() = ToProtoDuration(asked);
    if (lease != absl::ZeroDuration()) *r.mutable_lease_duration() = ToProtoDuration(lease);
    return WorkerDaemon::HeartbeatInterval(r);
  };
  EXPECT_EQ(interval(absl::Milliseconds(500), absl::Seconds(10)), absl::Milliseconds(500));
  EXPECT_EQ(interval(absl::ZeroDuration(), absl::Seconds(10)), absl::Seconds(2));
  EXPECT_EQ(interval(absl::Hours(1), absl::Seconds(9)), absl::Seconds(3));
  EXPECT_EQ(interval(absl::Hours(1), absl::ZeroDuration()), absl::Minutes(1));
  EXPECT_EQ(interval(absl::Microseconds(1), absl::Seconds(10)), absl::Milliseconds(10));
  EXPECT_EQ(interval(-absl::Seconds(5), absl::Seconds(10)), absl::Seconds(2));
  v1::RegisterWorkerResponse malformed;
  malformed.mutable_heartbeat_interval()->set_seconds(1);
  malformed.mutable_heartbeat_interval()->set_nanos(-5);  // signs disagree
  EXPECT_EQ(WorkerDaemon::HeartbeatInterval(malformed), absl::Seconds(2));
}

// A TENSOR job's rank whose group broke (here its peer went away in a
// gather) ends with the group's error, so that the job fails (and its
// restart policy may start it again), rather than serving a group whose
// every collective call would fail.
TEST(WorkerDaemon, ATensorRankWhoseGroupBrokeFailsInsteadOfServing) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-tensor-broken");
  ASSERT_NE(coordinator, nullptr);
  const v1::JobSpec tensor = TensorSpec(2);
  std::vector<std::unique_ptr<JobRunner>> runners;
  for (int rank = 0; rank < 2; ++rank) {
    JobRunner::Options ro = RunnerOptions(*coordinator, absl::StrCat("runner-tensor-broken-", rank));
    ro.comm_timeout = absl::Seconds(5);
    runners.push_back(std::make_unique<JobRunner>(ro));
    v1::AssignJobRequest assign = RankZero("job-000007", tensor);
    assign.set_job_uid("00c0ffee");
    assign.set_rank(rank);
    ASSERT_TRUE(runners.back()->Assign(assign).ok());
  }
  std::vector<std::shared_ptr<TensorHost>> hosts(2);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (int rank = 0; rank < 2; ++rank) {
    absl::StatusOr<std::shared_ptr<TensorHost>> host;
    while (!(host = runners[rank]->Tensors("job-000007")).ok() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_TRUE(host.ok()) << "rank " << rank << ": " << host.status();
    hosts[rank] = *host;
  }
  // A call meant for another generation of the job (sent as the job was
  // placed again) finds no tensors here; one meant for this one does.
  const absl::Status other = runners[0]->Tensors("job-000007", CallGeneration{2, ""}).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kAborted) << other;
  EXPECT_TRUE(absl::StrContains(other.message(), "generation 2")) << other;
  EXPECT_TRUE(runners[0]->Tensors("job-000007", CallGeneration{1, ""}).ok());
  EXPECT_TRUE(runners[0]->Tensors("job-000007", CallGeneration{1, "00c0ffee"}).ok());
  // Another job of that id (a coordinator that lost its data dir numbers
  // jobs from 1 again).
  EXPECT_EQ(runners[0]->Tensors("job-000007", CallGeneration{1, "0badf00d"}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  v1::CreateTensorRequest create;
  create.set_name("x");
  create.mutable_value()->set_dtype(v1::DTYPE_F32);
  create.mutable_value()->add_shape(2);
  create.mutable_value()->add_shape(4);
  const std::vector<float> values = {1, 2, 3, 4, 5, 6, 7, 8};
  create.mutable_value()->set_data(values.data(), values.size() * sizeof(float));
  auto* placement = create.mutable_dist_spec()->add_placements();
  placement->set_axis("tp");
  placement->mutable_placement()->mutable_shard()->add_dims(1);
  placement->mutable_placement()->mutable_shard()->add_num_partitions(2);
  for (auto& host : hosts) ASSERT_TRUE(host->Create(create).ok());
  {
    // Both ranks gather: the group works.
    std::thread peer([&] { EXPECT_TRUE(hosts[1]->GetGlobal("x").ok()); });
    auto global = hosts[0]->GetGlobal("x");
    peer.join();
    ASSERT_TRUE(global.ok()) << global.status();
  }
  // Rank 1's worker goes away; rank 0's next gather cannot complete.
  hosts[1].reset();
  runners[1]->Close("the worker is shutting down");
  ASSERT_TRUE(runners[1]->WaitIdle(absl::Seconds(30)));
  EXPECT_FALSE(hosts[0]->GetGlobal("x").ok());
  hosts[0].reset();
  ASSERT_TRUE(runners[0]->WaitIdle(absl::Seconds(30))) << "rank 0 still serves a broken group";
  const std::string error = runners[0]->Status().last_error();
  EXPECT_TRUE(absl::StrContains(error, "the rank's process group failed")) << error;
  EXPECT_EQ(runners[0]->Tensors("job-000007").status().code(), absl::StatusCode::kNotFound);
  // The coordinator's call for the generation that ran here: its rank ended.
  EXPECT_EQ(runners[0]->Tensors("job-000007", CallGeneration{1, "00c0ffee"}).status().code(),
            absl::StatusCode::kAborted);
}

// The worker admits a rank by the memory floor the coordinator sends (computed
// once, at submit), not by recomputing it: a floor above the worker's memory
// refuses a model that would fit, naming the floor sent.
TEST(WorkerDaemon, ARankIsAdmittedByTheMemoryFloorItIsSent) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-floor");
  ASSERT_NE(coordinator, nullptr);
  JobRunner::Options ro = RunnerOptions(*coordinator, "runner-floor");
  ro.memory_bytes = int64_t{1} << 30;
  JobRunner runner(ro);
  v1::AssignJobRequest assign = RankZero("job-434343", MidSizeTrainSpec());  // 0.15 GiB a rank: it fits
  ASSERT_LT(RankMemoryFloorBytes(assign.spec()), ro.memory_bytes);
  assign.mutable_memory_floor()->set_total_bytes(int64_t{2} << 30);
  assign.mutable_memory_floor()->set_parameters(123);
  ASSERT_TRUE(runner.Assign(assign).ok());
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(30)));
  const std::string error = runner.Status().last_error();
  EXPECT_TRUE(absl::StrContains(error, "RESOURCE_EXHAUSTED: the model needs at least 2.00 GiB per rank (123 "
                                       "parameters"))
      << error;
  EXPECT_TRUE(absl::StrContains(error, "this worker has 1.00 GiB")) << error;
}

int64_t RssBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// The process' peak RSS since the last reset (VmHWM).
int64_t PeakRssBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // kB
  }
  return 0;
}

// The issue's probe: a job that fails after building a large model leaves
// the worker's memory where it was (the freed memory goes back to the
// system, not only to the allocator).
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

TEST(WorkerDaemon, AFailedRankGivesItsMemoryBack) {
  if (kAddressSanitizer) {
    // ASan's allocator holds freed memory in quarantine and malloc_trim does
    // not reach it: resident memory measures the sanitizer, not the worker.
    // Every other pass runs this test.
    GTEST_SKIP() << "resident memory is not the worker's under AddressSanitizer";
  }
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-rss");
  ASSERT_NE(coordinator, nullptr);
  const std::string dir = testing::TempPath("rss-model");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/model.safetensors") << std::string("\x02\0\0\0\0\0\0\0{}", 10);  // holds no tensor
  JobRunner runner(RunnerOptions(*coordinator, "runner-rss"));
  v1::AssignJobRequest assign = RankZero("job-454545", MidSizeTrainSpec());
  v1::JobSpec& spec = *assign.mutable_spec();
  // As deep as a config may be: its module tree is many small allocations
  // (vocab_size 257: the byte-level text of MidSizeTrainSpec fits it, so
  // the rank gets as far as reading the weights that are not there).
  spec.mutable_model()->set_config_json(
      R"({"model_type": "gpt2", "vocab_size": 257, "n_embd": 16, "n_layer": 4096, "n_head": 4, "n_positions": 64})");
  spec.mutable_model()->set_weights_path(dir + "/model.safetensors");
  // Memory earlier tests freed goes back to the system first: else the
  // rank's allocations could reuse it and leave no peak to measure.
  ::malloc_trim(0);
  // The peak is the kernel's high-water mark, reset here ("5" to
  // clear_refs), so that no sampling can miss it.
  std::ofstream("/proc/self/clear_refs") << "5";
  const int64_t before = RssBytes();
  ASSERT_TRUE(runner.Assign(assign).ok());
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(60)));
  const int64_t after = RssBytes();
  const int64_t peak = PeakRssBytes();
  const std::string error = runner.Status().last_error();
  EXPECT_FALSE(error.empty());
  std::printf("failed rank: RSS %.1f MiB before, %.1f MiB at its peak, %.1f MiB after (%s)\n", before / 1048576.0,
              peak / 1048576.0, after / 1048576.0, error.c_str());
  ASSERT_GT(peak - before, int64_t{16} << 20) << "the rank allocated too little to tell";
  EXPECT_LT(after - before, (peak - before) / 4 + (int64_t{8} << 20)) << "the failed rank kept its memory";
}

// The issue's probe: a client names /etc/shadow as training data. A worker
// with --allow-path refuses the rank before it opens anything.
TEST(WorkerDaemon, ARankNamingAPathOutsideTheAllowedOnesIsRefused) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-paths");
  ASSERT_NE(coordinator, nullptr);
  const std::string allowed = testing::TempPath("allowed");
  std::filesystem::create_directories(allowed);
  WorkerDaemon::Options bad = FastRetryOptions(coordinator->address());
  bad.allow_paths = {"relative"};
  EXPECT_EQ(WorkerDaemon::Start(bad).status().code(), absl::StatusCode::kInvalidArgument);

  JobRunner::Options ro = RunnerOptions(*coordinator, "runner-paths");
  auto policy = PathPolicy::Create({allowed});
  ASSERT_TRUE(policy.ok()) << policy.status();
  ro.paths = *policy;
  JobRunner runner(ro);
  v1::AssignJobRequest assign = RankZero("job-434343", MidSizeTrainSpec());
  assign.mutable_spec()->mutable_model()->set_weights_path(allowed + "/model.safetensors");
  assign.mutable_spec()->mutable_train()->set_data_path("/etc/shadow");
  ASSERT_TRUE(runner.Assign(assign).ok());
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(30)));
  const std::string error = runner.Status().last_error();
  EXPECT_TRUE(absl::StrContains(error, "PERMISSION_DENIED: spec.train.data_path: '/etc/shadow' is outside the paths "
                                       "this worker allows (--allow-path "))
      << error;
}

// An error about the job's model names the model the spec named (its
// weights_path), not the rank's scratch copy of it under the work dir,
// which is gone once the rank ended: here a 50-token GPT-2 without a
// tokenizer asked to train on text.
TEST(WorkerDaemon, AnErrorAboutTheModelNamesTheSpecsModelNotTheScratchCopy) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-model-name");
  ASSERT_NE(coordinator, nullptr);
  auto model = shardformer::testing::WriteTinyGpt2(testing::TempPath("named-model"));
  ASSERT_TRUE(model.ok()) << model.status();
  std::ifstream config_file(model->dir + "/config.json");
  const std::string config((std::istreambuf_iterator<char>(config_file)), std::istreambuf_iterator<char>());
  v1::JobSpec spec = testing::TinyTrainSpec(1, 1, config);
  spec.mutable_model()->set_weights_path(model->dir);
  JobRunner::Options ro = RunnerOptions(*coordinator, "runner-model-name");
  JobRunner runner(ro);
  ASSERT_TRUE(runner.Assign(RankZero("job-535353", spec)).ok());
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(60)));
  const std::string error = runner.Status().last_error();
  EXPECT_TRUE(absl::StrContains(error, " is text and " + model->dir + " has no tokenizer")) << error;
  EXPECT_FALSE(absl::StrContains(error, ro.work_dir)) << error;
  // The same assignment again (a duplicate delivery) starts nothing: the
  // worker stays idle. The job's next generation runs, and so does the same
  // id's of another coordinator (another uid).
  EXPECT_TRUE(runner.Assign(RankZero("job-535353", spec)).ok());
  EXPECT_EQ(runner.Status().state(), v1::WORKER_STATE_IDLE);
  v1::AssignJobRequest next = RankZero("job-535353", spec);
  next.set_generation(next.generation() + 1);
  ASSERT_TRUE(runner.Assign(next).ok());
  EXPECT_EQ(runner.Status().state(), v1::WORKER_STATE_BUSY);
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(60)));
  v1::AssignJobRequest other = next;
  other.set_job_uid("00000000000000ab");
  ASSERT_TRUE(runner.Assign(other).ok());
  EXPECT_EQ(runner.Status().state(), v1::WORKER_STATE_BUSY);
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(60)));
}

// A worker whose --work-dir has less room than --min-free-work-dir refuses
// a rank that loads a model (RESOURCE_EXHAUSTED, which the coordinator
// takes as the cluster's refusal), and takes it once the bound is under
// the room the file system reports; a TENSOR rank writes nothing there and
// is not refused.
TEST(WorkerDaemon, AWorkDirWithTooLittleRoomRefusesRanksThatLoadAModel) {
  auto coordinator = StartCoordinator("127.0.0.1:0", "c-room");
  ASSERT_NE(coordinator, nullptr);
  JobRunner::Options ro = RunnerOptions(*coordinator, "runner-room");
  std::filesystem::create_directories(ro.work_dir);
  absl::StatusOr<DiskSpace> room = FreeDiskSpace(ro.work_dir);
  ASSERT_TRUE(room.ok()) << room.status();
  ASSERT_LT(room->free_bytes, std::numeric_limits<int64_t>::max() / 2);
  ro.min_free_work_dir_bytes = room->free_bytes * 2;  // more than there is
  // An upload no rank used for the TTL, and one used lately: the first goes
  // before the worker refuses for want of room (before, only a download
  // removed uploads, and a worker refusing every rank never made one).
  const std::filesystem::path uploads = std::filesystem::path(ro.work_dir) / "uploads";
  for (const char* id : {"stale", "recent"}) {
    std::filesystem::create_directories(uploads / id);
    std::ofstream(uploads / id / "model.safetensors") << id;
  }
  std::filesystem::last_write_time(uploads / "stale",
                                   std::filesystem::file_time_type::clock::now() - std::chrono::hours(2));
  {
    JobRunner runner(ro);
    const absl::Status refused = runner.Assign(RankZero("job-515151", MidSizeTrainSpec()));
    EXPECT_FALSE(std::filesystem::exists(uploads / "stale"));
    EXPECT_TRUE(std::filesystem::exists(uploads / "recent"));
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
    EXPECT_TRUE(absl::StrContains(refused.message(), "its --work-dir '" + ro.work_dir + "' has ")) << refused;
    EXPECT_TRUE(absl::StrContains(refused.message(), "of --min-free-work-dir")) << refused;
    EXPECT_EQ(runner.Status().state(), v1::WORKER_STATE_IDLE);
    v1::JobSpec tensor;
    tensor.set_kind(v1::JOB_KIND_TENSOR);
    tensor.mutable_shard()->set_tensor_parallel_size(1);
    tensor.mutable_shard()->set_data_parallel_size(1);
    EXPECT_TRUE(runner.Assign(RankZero("job-515152", tensor)).ok());
    runner.Close("");
    ASSERT_TRUE(runner.WaitIdle(absl::Seconds(30)));
  }
  ro.min_free_work_dir_bytes = 1 << 20;  // far less than there is
  JobRunner runner(ro);
  EXPECT_TRUE(runner.Assign(RankZero("job-515153", MidSizeTrainSpec())).ok());
  runner.Close("");
  ASSERT_TRUE(runner.WaitIdle(absl::Seconds(60)));
}

}  // namespace
}  // namespace colod
