// The coordinator over real gRPC on loopback: health, reflection, the worker
// registry, jobs, the rendezvous store and /metrics.
#include "server/coordinator.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <poll.h>
#include <unistd.h>

#include <cmath>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "server/key_proof_gate.h"
#include "server/worker_client.h"
#include "common/limits.h"
#include "common/rendezvous_store.h"
#include "client/coordinator_client.h"
#include "common/grpc_server.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/grpc_probe.h"
#include "tests/testing/job_specs.h"
#include "tests/testing/prometheus_text.h"

namespace colod {
namespace {

using ::colod::testing::ServingStatus;

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Coordinator::Options o;
    // A data dir of each test's own: no test sees another's jobs.
    o.data_dir = testing::TempPath(
        std::string("coord-") + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    o.heartbeat_interval = absl::Milliseconds(100);
    o.lease_duration = absl::Seconds(30);
    o.store_any_scope = store_any_scope_;
    o.key_proofs.deadline = key_proof_deadline_;
    auto c = Coordinator::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = std::move(*c);
    auto client = CoordinatorClient::Create(coordinator_->address());
    ASSERT_TRUE(client.ok());
    client_ = std::move(*client);
  }

  bool store_any_scope_ = false;
  absl::Duration key_proof_deadline_ = KeyProofGate::Options().deadline;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorClient> client_;
};

// The rendezvous store alone, with no job: it takes any scope.
class AnyScopeCoordinatorTest : public CoordinatorTest {
 protected:
  AnyScopeCoordinatorTest() { store_any_scope_ = true; }
};

TEST_F(CoordinatorTest, BindsPortZeroAndServesHealthAndReflection) {
  EXPECT_GT(coordinator_->port(), 0);
  EXPECT_GT(coordinator_->metrics_port(), 0);
  EXPECT_EQ(*testing::HealthCheck(coordinator_->address(), ""), ServingStatus::kServing);
  EXPECT_EQ(*testing::HealthCheck(coordinator_->address(), "colod.v1.CoordinatorService"),
            ServingStatus::kServing);
  EXPECT_EQ(testing::HealthCheck(coordinator_->address(), "no.such.Service").status().code(),
            absl::StatusCode::kNotFound);
  auto services = testing::ListServicesByReflection(coordinator_->address());
  ASSERT_TRUE(services.ok()) << services.status();
  EXPECT_NE(std::find(services->begin(), services->end(), "colod.v1.CoordinatorService"),
            services->end());
  EXPECT_NE(std::find(services->begin(), services->end(),
                      "grpc.reflection.v1alpha.ServerReflection"),
            services->end());
}

TEST_F(CoordinatorTest, RegistersHeartbeatsAndListsWorkers) {
  v1::WorkerInfo info;
  info.set_address("127.0.0.1:7071");
  info.set_device_kind(v1::DEVICE_KIND_CPU);
  auto reg = client_->RegisterWorker(info);
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_FALSE(reg->worker_id().empty());
  EXPECT_EQ(reg->heartbeat_interval().nanos(), 100000000);
  EXPECT_EQ(reg->lease_duration().seconds(), 30);
  ASSERT_TRUE(client_->Heartbeat(reg->worker_id(), v1::WorkerStatus()).ok());
  auto workers = client_->ListWorkers(false);
  ASSERT_TRUE(workers.ok());
  ASSERT_EQ(workers->size(), 1u);
  EXPECT_EQ((*workers)[0].info().worker_id(), reg->worker_id());
  EXPECT_EQ((*workers)[0].info().address(), "127.0.0.1:7071");
  EXPECT_EQ(client_->Heartbeat("worker-424242", v1::WorkerStatus()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Heartbeat("", v1::WorkerStatus()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ListWorkers pages by count (page_size, at most 1000) and by bytes (1 MiB):
// 80 workers with the largest labels a worker may have (64 of 1 KiB, about
// 66 KiB a worker; 5.2 MiB together, past gRPC's 4 MiB message, which an
// unpaged answer failed on) are listed whole by the client, each once, in
// order; a page holds at most page_size and ends past 1 MiB.
TEST_F(CoordinatorTest, ListWorkersPagesByCountAndBytes) {
  constexpr int kWorkers = 80;
  for (int i = 0; i < kWorkers; ++i) {
    v1::WorkerInfo info;
    info.set_address(absl::StrCat("127.0.0.1:", 20000 + i));
    info.set_device_kind(v1::DEVICE_KIND_CPU);
    for (int l = 0; l < kMaxLabels; ++l) {
      (*info.mutable_labels())[absl::StrCat("label-", l)] = std::string(kMaxLabelValueBytes, 'v');
    }
    ASSERT_TRUE(client_->RegisterWorker(info).ok());
  }
  auto all = client_->ListWorkers(false);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), static_cast<size_t>(kWorkers));
  for (size_t i = 1; i < all->size(); ++i) EXPECT_LT((*all)[i - 1].info().worker_id(), (*all)[i].info().worker_id());

  auto& stub = client_->stub();
  auto page = [&](int size, const std::string& token, v1::ListWorkersResponse* resp) {
    grpc::ClientContext ctx;
    v1::ListWorkersRequest req;
    req.set_page_size(size);
    req.set_page_token(token);
    return stub.ListWorkers(&ctx, req, resp);
  };
  std::vector<std::string> ids;
  std::string token;
  int pages = 0;
  do {
    v1::ListWorkersResponse resp;
    ASSERT_TRUE(page(0, token, &resp).ok());
    ASSERT_GT(resp.workers_size(), 0);
    const size_t worker_bytes = resp.workers(0).ByteSizeLong();
    EXPECT_LE(resp.ByteSizeLong(), (size_t{1} << 20) + 2 * worker_bytes);
    for (const v1::Worker& w : resp.workers()) ids.push_back(w.info().worker_id());
    token = resp.next_page_token();
    ++pages;
  } while (!token.empty() && pages < 100);
  size_t bytes = 0;
  for (const v1::Worker& w : *all) bytes += w.ByteSizeLong();
  EXPECT_GT(bytes, size_t{4} << 20);
  EXPECT_GE(pages, static_cast<int>(bytes >> 20));
  ASSERT_EQ(ids.size(), static_cast<size_t>(kWorkers));
  for (int i = 0; i < kWorkers; ++i) EXPECT_EQ(ids[i], (*all)[i].info().worker_id());

  v1::ListWorkersResponse resp;
  ASSERT_TRUE(page(7, "", &resp).ok());
  EXPECT_EQ(resp.workers_size(), 7);
  EXPECT_EQ(resp.next_page_token(), "after:" + (*all)[6].info().worker_id());
  EXPECT_EQ(page(-1, "", &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(page(0, "job-000001", &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(CoordinatorTest, MalformedRegisterWorkerIsInvalidArgument) {
  for (const char* address : {"", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:99999", "127.0.0.1:x"}) {
    v1::WorkerInfo info;
    info.set_address(address);
    auto reg = client_->RegisterWorker(info);
    EXPECT_EQ(reg.status().code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_NE(reg.status().message().find("worker.address"), absl::string_view::npos);
  }
  // A device peak (what jobs' MFU divides by) that is negative, NaN, tiny
  // or huge.
  for (double peak : {-1.0, std::nan(""), 1e-300, 1e300}) {
    v1::WorkerInfo info;
    info.set_address("127.0.0.1:7071");
    info.mutable_peak()->set_bf16(peak);
    auto reg = client_->RegisterWorker(info);
    EXPECT_EQ(reg.status().code(), absl::StatusCode::kInvalidArgument) << peak;
    EXPECT_NE(reg.status().message().find("worker.peak.bf16"), absl::string_view::npos) << reg.status();
  }
  // A request without the worker message at all.
  grpc::ClientContext ctx;
  v1::RegisterWorkerResponse resp;
  EXPECT_EQ(client_->stub().RegisterWorker(&ctx, v1::RegisterWorkerRequest(), &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(client_->ListWorkers(true)->empty());
}

TEST_F(CoordinatorTest, JobsAreValidatedAndWatchable) {
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_TRAIN);
  spec.mutable_model()->set_config_json(
      R"({"model_type": "gpt2", "vocab_size": 257, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64})");
  spec.mutable_model()->set_weights_path("/models/gpt2-tiny");
  spec.mutable_train()->set_steps(1);
  spec.mutable_train()->set_batch_size(2);
  spec.mutable_train()->set_seq_len(16);
  spec.mutable_train()->set_learning_rate(1e-3);
  spec.mutable_train()->set_data_path("/usr/share/common-licenses/GPL-3");
  spec.mutable_shard()->set_tensor_parallel_size(3);
  spec.mutable_shard()->set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
  spec.mutable_shard()->set_data_parallel_size(1);
  auto bad = client_->SubmitJob(spec);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("spec.shard.tensor_parallel_size"), absl::string_view::npos);

  spec.mutable_shard()->set_tensor_parallel_size(4);
  auto job = client_->SubmitJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);

  {  // No ranks yet: the mesh is not there to read.
    grpc::ClientContext ctx;
    v1::GetMeshRequest req;
    req.set_job_id(job->job_id());
    v1::GetMeshResponse resp;
    EXPECT_EQ(client_->stub().GetMesh(&ctx, req, &resp).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }

  std::thread canceller([&] {
    // Once the scheduler said why the job waits (no worker registered).
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      auto got = client_->GetJob(job->job_id());
      if (got.ok() && absl::StrContains(got->reason(), "needs 4 workers")) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    grpc::ClientContext ctx;
    v1::CancelJobRequest req;
    req.set_job_id(job->job_id());
    req.set_reason("test");
    v1::CancelJobResponse resp;
    EXPECT_TRUE(client_->stub().CancelJob(&ctx, req, &resp).ok());
  });
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  v1::WatchJobRequest req;
  req.set_job_id(job->job_id());
  auto reader = client_->stub().WatchJob(&ctx, req);
  std::vector<v1::JobEvent> events;
  v1::JobEvent ev;
  while (reader->Read(&ev)) events.push_back(ev);
  grpc::Status st = reader->Finish();
  canceller.join();
  EXPECT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(events.size(), 3u);  // the stream ends after the final state
  EXPECT_EQ(events[0].state_change().state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(events[1].state_change().state(), v1::JOB_STATE_PENDING);  // still, and why
  EXPECT_EQ(events[1].state_change().reason(),
            "waiting for workers: needs 4 workers of one device kind; 0 registered (0 cpu, 0 cuda), 0 idle; "
            "jobs behind it that fit run first");
  EXPECT_EQ(events[2].state_change().state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(events[2].sequence(), 3);

  grpc::ClientContext ctx2;
  req.set_job_id("job-999999");
  auto missing = client_->stub().WatchJob(&ctx2, req);
  while (missing->Read(&ev)) {
  }
  EXPECT_EQ(missing->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
}

// A long history is streamed in batches (the service copies at most
// kWatchBatch events at a time out of the job manager): every event comes,
// in order, and the stream ends after the last.
TEST_F(CoordinatorTest, ALongHistoryIsWatchedWholeInBatches) {
  v1::JobSpec spec = testing::TinyTrainSpec(1, 1);
  spec.mutable_train()->set_steps(2600);
  auto job = coordinator_->jobs().Submit(spec, "");
  ASSERT_TRUE(job.ok()) << job.status();
  for (int n = 1; n <= 2600; ++n) {
    v1::StepProgress step;
    step.set_step(n);
    step.set_loss(1.0 / n);
    step.mutable_step_duration()->set_nanos(1000);
    ASSERT_TRUE(coordinator_->jobs().AddStep(job->job_id(), step).ok());
  }
  ASSERT_TRUE(client_->CancelJob(job->job_id(), "test").ok());
  const int64_t last = static_cast<int64_t>(
      coordinator_->jobs().WaitForEvents(job->job_id(), 1, absl::ZeroDuration())->events.size());
  ASSERT_GT(last, 2600);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  v1::WatchJobRequest req;
  req.set_job_id(job->job_id());
  req.set_from_sequence(5);
  auto reader = client_->stub().WatchJob(&ctx, req);
  int64_t next = 5;
  int steps = 0;
  v1::JobEvent ev;
  while (reader->Read(&ev)) {
    ASSERT_EQ(ev.sequence(), next++);
    steps += ev.has_step();
  }
  const grpc::Status st = reader->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(next, last + 1);
  EXPECT_GE(steps, 2600 - 4);
}

// The issue's hostile configs: a billion layers is refused outright; a
// model no registered worker has the memory for is refused at submit with
// the need and the capacity, and accepted while no worker is registered.
TEST_F(CoordinatorTest, SubmitRefusesModelsNoWorkerCanHold) {
  v1::JobSpec spec = testing::TinyTrainSpec(2, 1);
  spec.mutable_model()->set_config_json(
      R"({"model_type": "gpt2", "vocab_size": 50, "n_embd": 16, "n_layer": 1000000000, "n_head": 4, "n_positions": 16})");
  auto deep = client_->SubmitJob(spec);
  EXPECT_EQ(deep.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(deep.status().message(), "at most 4096")) << deep.status();
  // One whose memory per rank passes int64 is refused, not admitted with no
  // floor (it was, on any worker).
  spec.mutable_model()->set_config_json(
      R"({"model_type": "gpt2", "vocab_size": 50, "n_embd": 8388608, "n_layer": 4096, "n_head": 4, "n_positions": 16})");
  auto huge = client_->SubmitJob(spec);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(huge.status().message(), "cannot be computed")) << huge.status();

  // GPT-2 XL's shape: 1,557,611,200 parameters, 16 bytes each with AdamW,
  // half of them per rank at tp 2: 11.60 GiB.
  spec.mutable_model()->set_config_json(
      R"({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 1600, "n_layer": 48, "n_head": 20, "n_positions": 1024})");
  auto accepted = client_->SubmitJob(spec);  // nobody to ask yet
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  ASSERT_TRUE(client_->CancelJob(accepted->job_id()).ok());

  for (int64_t gib : {4, 8}) {
    v1::WorkerInfo info;
    info.set_address(absl::StrCat("127.0.0.1:", 7080 + gib));
    info.set_device_kind(v1::DEVICE_KIND_CPU);
    info.set_memory_bytes(gib << 30);
    ASSERT_TRUE(client_->RegisterWorker(info).ok());
  }
  auto refused = client_->SubmitJob(spec);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                "spec.model: this job needs at least 11.68 GiB per rank (1557611200 parameters, 779894400 "
                                "on the fullest rank: 1.45 GiB of parameters, 1.45 GiB of gradients, 8.72 GiB of optimizer "
                                "state, 0.06 GiB of activations), and the largest of the 2 registered workers has 8.00 GiB"))
      << refused.status();
  spec.mutable_shard()->set_tensor_parallel_size(4);  // 5.90 GiB per rank: the 8 GiB worker will do
  ASSERT_TRUE(client_->SubmitJob(spec).ok());
}

// The issue's probe: two jobs with 2.5 MB names made ListJobs larger than a
// gRPC message for everyone. Names and labels are bounded, and ListJobs
// pages and sends summaries unless asked for whole jobs.
TEST_F(CoordinatorTest, ListJobsPagesSummariesAndNamesAreBounded) {
  v1::JobSpec tensor = testing::TensorJobSpec();
  v1::JobSpec huge = tensor;
  huge.set_name(std::string(2500000, 'n'));
  auto refused = client_->SubmitJob(huge);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "spec.name: 2500000 bytes; at most 256"))
      << refused.status();
  // A name is one line of printable text: a newline or a tab would break
  // `coloctl jobs`' table. Any other UTF-8 is a name.
  for (const std::string& bad : {std::string("a\nb"), std::string("a\tb"), std::string("\x1b[31mred"),
                                std::string("del\x7f")}) {
    huge = tensor;
    huge.set_name(bad);
    refused = client_->SubmitJob(huge);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "spec.name: holds the control character 0x"))
        << refused.status();
  }
  huge = tensor;
  huge.set_name("r\xC3\xA9sum\xC3\xA9 \xE2\x80\x94 run 2");
  auto unicode = client_->SubmitJob(huge);
  ASSERT_TRUE(unicode.ok()) << unicode.status();
  // A cancel's reason goes into the job's history, which ListJobs' full
  // view carries: two 3 MiB reasons made every listing too large to send.
  EXPECT_EQ(client_->CancelJob(unicode->job_id(), std::string(1025, 'r')).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(client_->CancelJob(unicode->job_id(), std::string(1024, 'r')).ok());
  ASSERT_TRUE(client_->DeleteJob(unicode->job_id()).ok());  // the pages below count the jobs
  huge = tensor;
  for (int i = 0; i < 65; ++i) (*huge.mutable_labels())[absl::StrCat("k", i)] = "v";
  EXPECT_EQ(client_->SubmitJob(huge).status().code(), absl::StatusCode::kInvalidArgument);
  huge = tensor;
  (*huge.mutable_labels())["k"] = std::string(1025, 'v');
  EXPECT_EQ(client_->SubmitJob(huge).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->SubmitJob(tensor, std::string(257, 'r')).status().code(), absl::StatusCode::kInvalidArgument);
  // So are paths (two 3 MB data paths did the same) and config.json.
  v1::JobSpec long_path = testing::TinyTrainSpec();
  long_path.mutable_train()->set_data_path("/" + std::string(3 << 20, 'p'));
  refused = client_->SubmitJob(long_path);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "spec.train.data_path: 3145729 bytes; a path takes at most 4096"))
      << refused.status();
  long_path = testing::TinyTrainSpec();
  long_path.mutable_forward()->set_logits_path(std::string(4097, 'p'));
  EXPECT_EQ(client_->SubmitJob(long_path).status().code(), absl::StatusCode::kInvalidArgument);
  v1::JobSpec big_config = testing::TinyTrainSpec();
  big_config.mutable_model()->set_config_json(std::string((1 << 20) + 1, ' '));
  refused = client_->SubmitJob(big_config);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "spec.model.config_json: 1048577 bytes; at most 1048576"))
      << refused.status();

  const v1::JobSpec train = testing::TinyTrainSpec();
  ASSERT_TRUE(client_->SubmitJob(train).ok());
  for (int i = 0; i < 249; ++i) {
    tensor.set_name(absl::StrCat("t", i));
    ASSERT_TRUE(client_->SubmitJob(tensor).ok());
  }
  auto page = [&](int size, const std::string& token, v1::JobView view) {
    grpc::ClientContext ctx;
    v1::ListJobsRequest req;
    req.set_page_size(size);
    req.set_page_token(token);
    req.set_view(view);
    v1::ListJobsResponse resp;
    const grpc::Status s = client_->stub().ListJobs(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  };
  // Default pages of 100, in submission order, each job once.
  std::vector<std::string> ids;
  std::string token;
  int pages = 0;
  do {
    v1::ListJobsResponse r = page(0, token, v1::JOB_VIEW_UNSPECIFIED);
    EXPECT_LE(r.jobs_size(), 100);
    for (const v1::Job& j : r.jobs()) ids.push_back(j.job_id());
    token = r.next_page_token();
    ++pages;
  } while (!token.empty() && pages < 10);
  EXPECT_EQ(pages, 3);
  ASSERT_EQ(ids.size(), 250u);
  EXPECT_TRUE(std::is_sorted(ids.begin(), ids.end()));
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()).size(), 250u);
  // Summaries leave the model's config out; FULL has it; page sizes cap at 1000.
  EXPECT_TRUE(page(1, "", v1::JOB_VIEW_SUMMARY).jobs(0).spec().model().config_json().empty());
  EXPECT_EQ(page(1, "", v1::JOB_VIEW_FULL).jobs(0).spec().model().config_json(), train.model().config_json());
  EXPECT_EQ(page(5000, "", v1::JOB_VIEW_SUMMARY).jobs_size(), 250);
  // The client follows every page.
  auto all = client_->ListJobs();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 250u);
  // Not a token (no "after:"), or one naming no job id (jobs go by their
  // ids' numbers, which another key has none of).
  for (const char* bad : {"job-000001", "after:x", "after:job-5", "after:job-00000a", "after:zzzzzzzzzzzz"}) {
    grpc::ClientContext ctx;
    v1::ListJobsRequest req;
    req.set_page_token(bad);
    v1::ListJobsResponse resp;
    EXPECT_EQ(client_->stub().ListJobs(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
  }
  // Values the enums do not have are refused, not taken as none (an empty
  // list) or as the summary.
  for (int bad : {0, 1}) {
    grpc::ClientContext ctx;
    v1::ListJobsRequest req;
    if (bad == 0) req.add_states(static_cast<v1::JobState>(99));
    if (bad == 1) req.set_view(static_cast<v1::JobView>(99));
    v1::ListJobsResponse resp;
    EXPECT_EQ(client_->stub().ListJobs(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
  }
  // DeleteJob forgets an ended job, and only an ended one.
  const std::string first = ids.front();
  EXPECT_EQ(client_->DeleteJob(first).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(client_->CancelJob(first).ok());
  ASSERT_TRUE(client_->DeleteJob(first).ok());
  EXPECT_EQ(client_->GetJob(first).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->DeleteJob(first).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ListJobs()->size(), 249u);
}

// Each WatchJob stream holds a server thread: past --max-watch-streams they
// are refused, and a stream that ends makes room.
TEST(CoordinatorStart, WatchStreamsAreBounded) {
  Coordinator::Options o;
  o.data_dir = testing::TempPath("coord-watches");
  o.max_watch_streams = 2;
  auto c = Coordinator::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto client = CoordinatorClient::Create((*c)->address());
  ASSERT_TRUE(client.ok());
  auto job = (*client)->SubmitJob(testing::TensorJobSpec());  // no worker: it stays PENDING and its watches open
  ASSERT_TRUE(job.ok()) << job.status();
  struct Watch {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderInterface<v1::JobEvent>> reader;
  };
  auto open = [&](Watch& w) {
    v1::WatchJobRequest req;
    req.set_job_id(job->job_id());
    w.reader = (*client)->stub().WatchJob(&w.ctx, req);
    v1::JobEvent ev;
    return w.reader->Read(&ev);  // the first event: the stream runs
  };
  Watch a, b, c3;
  ASSERT_TRUE(open(a));
  ASSERT_TRUE(open(b));
  EXPECT_FALSE(open(c3));
  EXPECT_EQ(c3.reader->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  a.ctx.TryCancel();
  (void)a.reader->Finish();
  // The server notices the cancel within its 250 ms poll.
  bool reopened = false;
  for (int i = 0; i < 50 && !reopened; ++i) {
    Watch d;
    reopened = open(d);
    d.ctx.TryCancel();
    (void)d.reader->Finish();
    if (!reopened) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(reopened);
  b.ctx.TryCancel();
  (void)b.reader->Finish();
  o.max_watch_streams = 0;
  o.data_dir = testing::TempPath("coord-watches-0");
  EXPECT_EQ(Coordinator::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// The server's threads are bounded: with every thread held by a rendezvous
// wait, the next call is refused RESOURCE_EXHAUSTED at once (no thread is
// started for it), and once the waits end, calls run again.
TEST(CoordinatorStart, ServerThreadsAreBounded) {
  Coordinator::Options o;
  o.data_dir = testing::TempPath("coord-threads");
  o.max_server_threads = 8;
  o.store_any_scope = true;  // waits with no job
  EXPECT_EQ(Coordinator::ServerThreadsFor(o), 8);
  auto c = Coordinator::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto client = CoordinatorClient::Create((*c)->address());
  ASSERT_TRUE(client.ok());
  auto& stub = (*client)->stub();
  // More waits than threads: some hold the threads, the rest are refused.
  constexpr int kWaits = 16;
  std::vector<grpc::Status> waits(kWaits);
  std::vector<std::thread> waiters;
  for (int i = 0; i < kWaits; ++i) {
    waiters.emplace_back([&, i] {
      grpc::ClientContext ctx;
      v1::KvWaitRequest req;
      req.set_scope("job-1/gen-1");
      req.add_keys("never-set");
      req.mutable_timeout()->set_seconds(3);
      v1::KvWaitResponse resp;
      waits[i] = stub.KvWait(&ctx, req, &resp);
    });
  }
  for (auto& t : waiters) t.join();
  int waited = 0, refused = 0;
  for (const grpc::Status& s : waits) {
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) ++waited;
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++refused;
      EXPECT_NE(s.error_message().find("Threadpool Exhausted"), std::string::npos) << s.error_message();
    }
  }
  EXPECT_EQ(waited + refused, kWaits);
  EXPECT_GE(waited, 1);
  EXPECT_LT(waited, 8) << "more calls ran at once than the server has threads";
  EXPECT_GE(refused, kWaits - 8);
  // The waits ended: a call runs.
  auto listed = (*client)->ListWorkers(false);
  EXPECT_TRUE(listed.ok()) << listed.status();

  // The default: every long call's bound and room for short calls.
  Coordinator::Options d;
  EXPECT_EQ(Coordinator::ServerThreadsFor(d), d.max_store_waits + d.max_watch_streams + d.max_concurrent_uploads +
                                                  d.max_concurrent_downloads + d.key_proofs.max +
                                                  Coordinator::kServerThreadsForShortCalls);
  d.max_store_waits = std::numeric_limits<int>::max();
  EXPECT_EQ(Coordinator::ServerThreadsFor(d), std::numeric_limits<int>::max());
  d.data_dir = testing::TempPath("coord-threads-bad");
  for (int bad : {-1, 1}) {
    d.max_server_threads = bad;
    EXPECT_EQ(Coordinator::Start(d).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  d.max_server_threads = 0;
  d.max_store_waits = 8192;
  d.max_concurrent_downloads = 0;
  EXPECT_EQ(Coordinator::Start(d).status().code(), absl::StatusCode::kInvalidArgument);
}

// A watch whose client reads nothing (its Write held by flow control) is
// cancelled after --stream-stall-timeout, freeing its thread and watch slot
// (before, it held them until the client went away); a watch that waits for
// events, its client reading, is never cut.
TEST(CoordinatorStart, AWatchWhoseClientReadsNothingIsCancelledAndAWaitingOneIsNot) {
  Coordinator::Options o;
  o.data_dir = testing::TempPath("coord-watch-stall");
  o.stream_stall_timeout = absl::Seconds(1);
  auto c = Coordinator::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  v1::JobSpec spec = testing::TinyTrainSpec(1, 1);
  spec.mutable_train()->set_steps(3000);
  auto busy = (*c)->jobs().Submit(spec, "");
  ASSERT_TRUE(busy.ok()) << busy.status();
  for (int n = 1; n <= 3000; ++n) {
    v1::StepProgress step;
    step.set_step(n);
    step.set_loss(1.0 / n);
    step.mutable_step_duration()->set_nanos(1000);
    ASSERT_TRUE((*c)->jobs().AddStep(busy->job_id(), step).ok());
  }
  auto quiet = (*c)->jobs().Submit(testing::TinyTrainSpec(1, 1), "");
  ASSERT_TRUE(quiet.ok()) << quiet.status();
  // A small stream window: a client that reads nothing holds the server's
  // Write after a few events.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  auto stub = v1::CoordinatorService::NewStub(
      grpc::CreateCustomChannel((*c)->address(), grpc::InsecureChannelCredentials(), args));
  (*c)->jobs().Flush();  // the steps written: watchers are sent them
  grpc::ClientContext idle_ctx;
  v1::WatchJobRequest req;
  req.set_job_id(busy->job_id());
  req.set_from_sequence(1);
  auto idle = stub->WatchJob(&idle_ctx, req);
  idle->WaitForInitialMetadata();
  // The waiting watch, of a job with nothing more to say for now.
  grpc::ClientContext waiting_ctx;
  waiting_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  req.set_job_id(quiet->job_id());
  auto waiting = stub->WatchJob(&waiting_ctx, req);
  v1::JobEvent ev;
  ASSERT_TRUE(waiting->Read(&ev));  // its PENDING
  for (int i = 0; i < 1000 && (*c)->stalled_streams() < 1; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ((*c)->stalled_streams(), 1);
  absl::SleepFor(absl::Seconds(2));  // twice the timeout, waiting
  EXPECT_EQ((*c)->stalled_streams(), 1) << "a watch waiting for events was cut";
  ASSERT_TRUE((*c)->jobs().Cancel(quiet->job_id(), "done").ok());
  bool cancelled = false;
  while (waiting->Read(&ev)) {
    cancelled |= ev.has_state_change() && ev.state_change().state() == v1::JOB_STATE_CANCELLED;
  }
  EXPECT_TRUE(cancelled);
  EXPECT_TRUE(waiting->Finish().ok());
  idle_ctx.TryCancel();
  (void)idle->Finish();
}

class KeyRecordingWorker final : public v1::WorkerService::Service {
 public:
  grpc::Status AssignJob(grpc::ServerContext* ctx, const v1::AssignJobRequest*, v1::AssignJobResponse*) override {
    return Record(*ctx, "assign");
  }
  grpc::Status AbortJob(grpc::ServerContext* ctx, const v1::AbortJobRequest*, v1::AbortJobResponse*) override {
    return Record(*ctx, "abort");
  }
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest*, v1::GetStatusResponse*) override {
    return Record(*ctx, "status");
  }
  std::vector<std::string> Seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  grpc::Status Record(const grpc::ServerContext& ctx, const char* method) {
    const auto& md = ctx.client_metadata();
    auto it = md.find("colod-worker-key");
    absl::MutexLock lock(&mu_);
    seen_.push_back(absl::StrCat(method, " ", it == md.end() ? "" : std::string(it->second.data(), it->second.size())));
    return grpc::Status::OK;
  }
  absl::Mutex mu_;
  std::vector<std::string> seen_ ABSL_GUARDED_BY(mu_);
};

// Registers the worker daemon served at `address` (`key`: its worker key;
// "" an older worker's, none), whose downloads carry its key or not, and
// places a one-rank TRAIN job of `upload_id`'s model on it: OK once its
// assignment arrived there.
absl::StatusOr<v1::Job> PlaceAJobOfTheUpload(CoordinatorClient& client, KeyRecordingWorker& daemon,
                                             const std::string& address, const std::string& key,
                                             bool downloads_carry_key, const std::string& upload_id) {
  v1::RegisterWorkerRequest reg;
  reg.mutable_worker()->set_address(address);
  reg.mutable_worker()->set_device_kind(v1::DEVICE_KIND_CPU);
  reg.mutable_worker()->set_downloads_carry_key(downloads_carry_key);
  reg.set_worker_key(key);
  v1::RegisterWorkerResponse reg_resp;
  grpc::ClientContext ctx;
  if (const grpc::Status s = client.stub().RegisterWorker(&ctx, reg, &reg_resp); !s.ok()) {
    return FromGrpcStatus(s);
  }
  v1::JobSpec spec = testing::TinyTrainSpec();
  spec.mutable_model()->clear_weights_path();
  spec.mutable_model()->set_upload_id(upload_id);
  ASSIGN_OR_RETURN(v1::Job job, client.SubmitJob(spec));
  for (int i = 0; i < 200; ++i) {
    for (const std::string& seen : daemon.Seen()) {
      if (seen == "assign " + key) return job;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError("the job's assignment never came");
}

// A transfer stream that stops moving (a client that reads nothing of its
// download, or sends nothing more of its upload) is cancelled after
// --stream-stall-timeout, and its place is free again; one that moves is
// never cut.
TEST(CoordinatorStart, StalledTransfersAreCancelledAndFreeTheirPlace) {
  Coordinator::Options o;
  o.data_dir = testing::TempPath("coord-stalls");
  o.stream_stall_timeout = absl::Seconds(1);
  o.max_concurrent_downloads = 1;
  o.max_concurrent_uploads = 1;
  o.lease_duration = absl::Minutes(1);  // the fake worker below never heartbeats
  auto c = Coordinator::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto client = CoordinatorClient::Create((*c)->address());
  ASSERT_TRUE(client.ok());
  // A model larger than the stream's flow-control windows: a reader that
  // reads nothing holds the server's Write.
  const std::string dir = testing::TempPath("stall-model");
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir + "/model.safetensors", std::ios::binary);
    const std::string mib(1 << 20, 'x');
    for (int i = 0; i < 48; ++i) out << mib;
  }
  auto uploaded = (*client)->UploadModel(dir, absl::Seconds(60));
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  // Downloaded for a job that uses it, placed on an older worker (its
  // downloads carry no key: any call with the token may make them).
  KeyRecordingWorker daemon;
  absl::StatusOr<StartedGrpcServer> server = StartGrpcServer("127.0.0.1:0", {&daemon});
  ASSERT_TRUE(server.ok()) << server.status();
  auto placed = PlaceAJobOfTheUpload(**client, daemon, server->address, "", false, uploaded->upload_id());
  ASSERT_TRUE(placed.ok()) << placed.status();
  auto& stub = (*client)->stub();
  v1::DownloadModelRequest req;
  req.set_upload_id(uploaded->upload_id());
  grpc::ClientContext stalled;
  std::unique_ptr<grpc::ClientReaderInterface<v1::ModelChunk>> idle = stub.DownloadModel(&stalled, req);
  idle->WaitForInitialMetadata();  // sent with its first chunk: the server runs it, and holds its place
  const absl::Time start = absl::Now();
  // Its place is taken until the watchdog cancels it: a whole download then gets it.
  int64_t got = -1;
  for (int attempt = 0; attempt < 100 && got < 0; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    auto reader = stub.DownloadModel(&ctx, req);
    v1::ModelChunk chunk;
    int64_t bytes = 0;
    while (reader->Read(&chunk)) bytes += static_cast<int64_t>(chunk.data().size());
    const grpc::Status s = reader->Finish();
    if (s.ok()) {
      got = bytes;
    } else {
      ASSERT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
      // Marked as a refusal to ask again after (what workers go by).
      EXPECT_EQ(RetryAfter(ctx), absl::Seconds(1));
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  EXPECT_EQ(got, int64_t{48} << 20) << "the stalled download's place never came free";
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(500)) << "cancelled before it stalled";
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  stalled.TryCancel();
  (void)idle->Finish();

  // An upload that sends one chunk and then only chunks without data
  // (which moved the watch before 2026-12-07, holding the place for ever).
  grpc::ClientContext upload_ctx;
  v1::UploadModelResponse upload_resp;
  auto writer = stub.UploadModel(&upload_ctx, &upload_resp);
  v1::UploadModelRequest chunk;
  chunk.mutable_chunk()->set_file("model.safetensors");
  chunk.mutable_chunk()->set_data("first");
  ASSERT_TRUE(writer->Write(chunk));
  // The server took its place (the watch starts once the place is held):
  // before, a busy machine could run the upload below first, and this one
  // was then refused, not stalled.
  for (int i = 0; i < 1000 && (*c)->watched_streams() < 1; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ((*c)->watched_streams(), 1);
  std::thread empty_chunks([&writer] {
    v1::UploadModelRequest empty;
    empty.mutable_chunk()->set_file("model.safetensors");
    empty.mutable_chunk()->set_offset(5);
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (absl::Now() < until && writer->Write(empty)) absl::SleepFor(absl::Milliseconds(100));
  });
  bool uploaded_again = false;
  for (int attempt = 0; attempt < 100 && !uploaded_again; ++attempt) {
    auto again = (*client)->UploadModel(dir, absl::Seconds(30));
    uploaded_again = again.ok();
    if (!uploaded_again) {
      ASSERT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted) << again.status();
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  EXPECT_TRUE(uploaded_again) << "the stalled upload's place never came free";
  empty_chunks.join();  // (its writes fail once the call is cancelled)
  const grpc::Status ended = writer->Finish();
  EXPECT_FALSE(ended.ok());
  EXPECT_GE((*c)->stalled_streams(), 2);

  o.data_dir = testing::TempPath("coord-stalls-bad");
  o.stream_stall_timeout = absl::Seconds(-1);
  EXPECT_EQ(Coordinator::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// A loopback port whose kernel completes connections and where nobody
// speaks (a SIGSTOPped daemon): its address, and the socket to close.
struct SilentPort {
  int fd = -1;
  std::string address;
  ~SilentPort() {
    if (fd >= 0) ::close(fd);
  }
};
void ListenSilently(SilentPort* port) {
  port->fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(port->fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(port->fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(port->fd, 16), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(port->fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  port->address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
}

// Whether a connection waits to be accepted on `port` (a check of a
// registration reached it), within `timeout`.
bool ConnectionPending(const SilentPort& port, absl::Duration timeout) {
  pollfd p{port.fd, POLLIN, 0};
  return ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) == 1;
}

// A registration with a key is checked at its address first, once the rest
// of it is valid: the daemon there must say it holds the key (a SIGSTOPped
// one, or a port where nobody speaks, holds the check until its deadline; a
// closed port fails it at once), UNAVAILABLE otherwise, and nothing is
// registered. Checks are bounded (KeyProofGate: 4 at once from one host,
// one per address and host, an address where a check ran out its time
// answered so for 15 s without a call), so
// that registrations at addresses that never answer hold a few server
// threads, not all of them, and refuse nobody else's for long.
class SlowProofCoordinatorTest : public CoordinatorTest {
 protected:
  // Long enough that the calls made while the checks run surely come
  // before their end, on a loaded machine too.
  SlowProofCoordinatorTest() { key_proof_deadline_ = absl::Seconds(6); }
};

TEST_F(SlowProofCoordinatorTest, RegistrationsWithKeysAreCheckedAtTheirAddressesAFewAtATime) {
  constexpr int kPerHost = 4;  // KeyProofGate::Options().max_per_peer
  ASSERT_EQ(KeyProofGate::Options().max_per_peer, kPerHost);
  std::vector<SilentPort> silent(kPerHost + 1);
  for (SilentPort& p : silent) ASSERT_NO_FATAL_FAILURE(ListenSilently(&p));
  auto register_at = [&](const std::string& address, std::string key = NewWorkerKey()) {
    v1::RegisterWorkerRequest req;
    req.mutable_worker()->set_address(address);
    req.set_worker_key(key);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::RegisterWorkerResponse resp;
    return FromGrpcStatus(client_->stub().RegisterWorker(&ctx, req, &resp));
  };
  // A registration whose rest is invalid is refused before any call.
  {
    v1::RegisterWorkerRequest bad;
    bad.mutable_worker()->set_address(silent[kPerHost].address);
    bad.mutable_worker()->set_worker_id("worker-000001");
    bad.set_worker_key(NewWorkerKey());
    grpc::ClientContext ctx;
    v1::RegisterWorkerResponse resp;
    EXPECT_EQ(client_->stub().RegisterWorker(&ctx, bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    // A key that could not travel as metadata neither.
    bad.mutable_worker()->clear_worker_id();
    bad.set_worker_key(std::string(32, '\n'));
    grpc::ClientContext ctx2;
    EXPECT_EQ(client_->stub().RegisterWorker(&ctx2, bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_FALSE(ConnectionPending(silent[kPerHost], absl::ZeroDuration()));
  }
  std::vector<absl::Status> held(kPerHost);
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int i = 0; i < kPerHost; ++i) threads.emplace_back([&, i] { held[i] = register_at(silent[i].address); });
  // Every check is under way once its connection reached its port.
  for (int i = 0; i < kPerHost; ++i) ASSERT_TRUE(ConnectionPending(silent[i], absl::Seconds(10))) << i;
  const absl::Time extra_start = absl::Now();
  const absl::Status extra = register_at(silent[kPerHost].address);
  EXPECT_EQ(extra.code(), absl::StatusCode::kUnavailable) << extra;
  EXPECT_TRUE(
      absl::StrContains(extra.message(), absl::StrCat("checking ", kPerHost, " other registrations from this host")))
      << extra;
  const absl::Status same = register_at(silent[0].address);
  EXPECT_EQ(same.code(), absl::StatusCode::kUnavailable) << same;
  EXPECT_TRUE(
      absl::StrContains(same.message(), "checking another registration at " + silent[0].address + " from this host"))
      << same;
  EXPECT_LT(absl::Now() - extra_start, absl::Seconds(3));
  EXPECT_FALSE(ConnectionPending(silent[kPerHost], absl::ZeroDuration()));
  for (std::thread& t : threads) t.join();
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Seconds(5.5));
  EXPECT_LT(took, absl::Seconds(20));
  for (const absl::Status& s : held) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "the coordinator cannot reach 127.0.0.1:")) << s;
  }
  // An address where a check ran out its time is answered so at once for
  // a while.
  const absl::Time again_start = absl::Now();
  const absl::Status again = register_at(silent[1].address);
  EXPECT_EQ(again.code(), absl::StatusCode::kUnavailable) << again;
  EXPECT_TRUE(absl::StrContains(again.message(), "could not reach " + silent[1].address)) << again;
  EXPECT_LT(absl::Now() - again_start, absl::Seconds(3));
  // Nothing listens at a closed port: refused at once, and not remembered
  // (a daemon starting there registers as soon as it listens).
  SilentPort closed;
  ASSERT_NO_FATAL_FAILURE(ListenSilently(&closed));
  ::close(std::exchange(closed.fd, -1));
  for (int i = 0; i < 2; ++i) {
    const absl::Time closed_start = absl::Now();
    const absl::Status refused = register_at(closed.address);
    EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
    EXPECT_TRUE(absl::StrContains(refused.message(), "cannot reach " + closed.address)) << refused;
    EXPECT_FALSE(absl::StrContains(refused.message(), "onnection refused")) << "gRPC's words stay in the log";
    EXPECT_LT(absl::Now() - closed_start, absl::Seconds(5));
  }
  EXPECT_TRUE(client_->ListWorkers(true)->empty());
}

// A check ends with its registration's call: a caller that gives up (a
// worker stopped while it registers, or a caller cancelling on purpose)
// frees the check's place at once, where it held it until the check's own
// deadline (6 s here) before.
TEST_F(SlowProofCoordinatorTest, ACheckEndsWhenItsCallerCancels) {
  SilentPort silent;
  ASSERT_NO_FATAL_FAILURE(ListenSilently(&silent));
  auto request = [&] {
    v1::RegisterWorkerRequest req;
    req.mutable_worker()->set_address(silent.address);
    req.set_worker_key(NewWorkerKey());
    return req;
  };
  grpc::ClientContext first_ctx;
  grpc::Status first;
  std::thread caller([&] {
    v1::RegisterWorkerResponse resp;
    first = client_->stub().RegisterWorker(&first_ctx, request(), &resp);
  });
  ASSERT_TRUE(ConnectionPending(silent, absl::Seconds(10)));
  const absl::Time cancelled = absl::Now();
  first_ctx.TryCancel();
  caller.join();
  EXPECT_EQ(first.error_code(), grpc::StatusCode::CANCELLED) << first.error_message();
  // The address is checked again (from this host, one check at a time)
  // as soon as the cancelled check has left: this one runs to its
  // caller's deadline, unanswered.
  absl::Status again;
  for (int i = 0; i < 200; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    v1::RegisterWorkerResponse resp;
    again = FromGrpcStatus(client_->stub().RegisterWorker(&ctx, request(), &resp));
    if (!absl::StrContains(again.message(), "checking another registration at")) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_LT(absl::Now() - cancelled, absl::Seconds(4)) << again;
  EXPECT_FALSE(absl::StrContains(again.message(), "checking another registration at")) << again;
  EXPECT_TRUE(absl::IsUnavailable(again) || absl::IsDeadlineExceeded(again)) << again;
  EXPECT_TRUE(client_->ListWorkers(true)->empty());
}

// A daemon at a registration's address that answers GetStatus, saying or
// not that the call carried its own key (GetStatusResponse.worker_key_held).
class KeyHoldingWorker final : public v1::WorkerService::Service {
 public:
  explicit KeyHoldingWorker(bool says_held) : says_held_(says_held) {}
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*, v1::GetStatusResponse* resp) override {
    resp->set_worker_key_held(says_held_);
    return grpc::Status::OK;
  }

 private:
  const bool says_held_;
};

// A daemon that records the worker key each call carries ("" none).
// The coordinator's calls to its workers carry the key each call names
// (WorkerClient::Call::key: the key of the worker it is meant for), none
// where it names none, whoever is registered at the address now.
TEST(GrpcWorkerClient, EachCallCarriesItsOwnKey) {
  KeyRecordingWorker daemon;
  absl::StatusOr<StartedGrpcServer> server = StartGrpcServer("127.0.0.1:0", {&daemon});
  ASSERT_TRUE(server.ok()) << server.status();
  GrpcWorkerClient client(nullptr, "");
  const std::string a = server->address;
  const std::string k1(32, '1'), k2(32, '2');
  std::vector<absl::Status> answers = client.Assign({{a, k1, {}}, {a, k2, {}}}, absl::Seconds(10));
  for (const absl::Status& s : answers) EXPECT_TRUE(s.ok()) << s;
  answers = client.Abort({{a, "", {}}}, absl::Seconds(10));
  EXPECT_TRUE(answers.at(0).ok()) << answers[0];
  answers = client.Probe({{a, k2, {}}}, absl::Seconds(10));
  EXPECT_TRUE(answers.at(0).ok()) << answers[0];
  std::vector<std::string> seen = daemon.Seen();
  std::sort(seen.begin(), seen.begin() + 2);  // the two assignments ran at once
  EXPECT_EQ(seen, (std::vector<std::string>{"assign " + k1, "assign " + k2, "abort ", "status " + k2}));
  server->server->Shutdown();
}

// Only a daemon that says it holds the key proves a registration: a worker
// older than worker_key_held answers GetStatus whatever key the call
// carries, so a registration at its address with another key keeps the
// older rule (ALREADY_EXISTS while it is live) instead of replacing it.
TEST_F(CoordinatorTest, OnlyADaemonSayingItHoldsTheKeyProvesARegistration) {
  for (const bool says_held : {false, true}) {
    KeyHoldingWorker daemon(says_held);
    absl::StatusOr<StartedGrpcServer> server = StartGrpcServer("127.0.0.1:0", {&daemon});
    ASSERT_TRUE(server.ok()) << server.status();
    auto register_with = [&](const std::string& key) -> absl::StatusOr<std::string> {
      v1::RegisterWorkerRequest req;
      req.mutable_worker()->set_address(server->address);
      req.set_worker_key(key);
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
      v1::RegisterWorkerResponse resp;
      RETURN_IF_ERROR(FromGrpcStatus(client_->stub().RegisterWorker(&ctx, req, &resp)));
      return resp.worker_id();
    };
    const absl::StatusOr<std::string> first = register_with(NewWorkerKey());
    ASSERT_TRUE(first.ok()) << first.status();
    const absl::StatusOr<std::string> second = register_with(NewWorkerKey());
    if (says_held) {
      ASSERT_TRUE(second.ok()) << second.status();  // proven: the first is gone
      auto listed = client_->ListWorkers(false);
      ASSERT_TRUE(listed.ok());
      std::set<std::string> at_address;
      for (const v1::Worker& w : *listed) {
        if (w.info().address() == server->address) at_address.insert(w.info().worker_id());
      }
      EXPECT_EQ(at_address, std::set<std::string>{*second});
    } else {
      EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists) << second.status();
      EXPECT_TRUE(absl::StrContains(second.status().message(), *first + " is registered at " + server->address))
          << second.status();
    }
    server->server->Shutdown();
  }
}

// A watch whose coordinator is gone for good gives up after the client's
// watch_reconnect_limit, UNAVAILABLE, not at its own (long) deadline.
TEST(CoordinatorClientWatch, AnUnreachableCoordinatorEndsTheWatchAfterTheReconnectLimit) {
  CoordinatorClient::Options o;
  o.watch_reconnect_limit = absl::Seconds(1);
  auto client = CoordinatorClient::Create("127.0.0.1:1", o);  // nothing listens there
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Time start = absl::Now();
  const absl::Status s = (*client)->WatchJob("job-000001", 1, absl::Hours(1), [](const v1::JobEvent&) { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("unreachable for"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("onnection refused"), absl::string_view::npos) << "the channel's own error: " << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  o.watch_reconnect_limit = absl::ZeroDuration();
  EXPECT_EQ(CoordinatorClient::Create("127.0.0.1:1", o).status().code(), absl::StatusCode::kInvalidArgument);
}

// Nor where the coordinator's host accepts the connection and its process
// answers nothing (SIGSTOPped): within the limit, not gRPC's 20 s connect
// timeout.
TEST(CoordinatorClientWatch, ACoordinatorThatAcceptsAndNeverAnswersEndsTheWatchAfterTheReconnectLimit) {
  SilentPort silent;
  ASSERT_NO_FATAL_FAILURE(ListenSilently(&silent));
  CoordinatorClient::Options o;
  o.watch_reconnect_limit = absl::Seconds(1);
  auto client = CoordinatorClient::Create(silent.address, o);
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Time start = absl::Now();
  const absl::Status s = (*client)->WatchJob("job-000001", 1, absl::Hours(1), [](const v1::JobEvent&) { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(IsUnreachable(s)) << s;
  EXPECT_NE(s.message().find("unreachable for"), absl::string_view::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  EXPECT_NE(s.message().find("nothing answers"), absl::string_view::npos) << s;
  // A watch whose own deadline comes first, the coordinator never reached:
  // unreachable all the same, not "the job did not end" (exit 69, not 1).
  const absl::Status short_watch =
      (*client)->WatchJob("job-000001", 1, absl::Milliseconds(300), [](const v1::JobEvent&) { return true; });
  EXPECT_EQ(short_watch.code(), absl::StatusCode::kUnavailable) << short_watch;
  EXPECT_TRUE(IsUnreachable(short_watch)) << short_watch;
}

// A coordinator that cancels a watch's stream (its stall watchdog, where
// the reader fell behind) is followed again from the next event: the watch
// sees every event once and ends with the job.
class CancellingCoordinator final : public v1::CoordinatorService::Service {
 public:
  grpc::Status WatchJob(grpc::ServerContext*, const v1::WatchJobRequest* req,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    froms.push_back(req->from_sequence());
    for (int64_t seq = req->from_sequence(); seq <= 5; ++seq) {
      v1::JobEvent ev;
      ev.set_sequence(seq);
      writer->Write(ev);
      if (froms.size() == 1 && seq == 3) return grpc::Status(grpc::StatusCode::CANCELLED, "stalled");
    }
    return grpc::Status::OK;
  }
  std::vector<int64_t> froms;  // one handler at a time here
};

TEST(CoordinatorClientWatch, AStreamTheCoordinatorCancelsIsFollowedFromTheNextEvent) {
  CancellingCoordinator fake;
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&fake);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto client = CoordinatorClient::Create(absl::StrCat("127.0.0.1:", port));
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<int64_t> seen;
  const absl::Status s = (*client)->WatchJob("job-000001", 1, absl::Seconds(30), [&](const v1::JobEvent& e) {
    seen.push_back(e.sequence());
    return true;
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(seen, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(fake.froms, (std::vector<int64_t>{1, 4}));
  server->Shutdown();
}

// An error echoing a huge input (a 100 KB job id) would not fit the call's
// trailers, and the client would get RESOURCE_EXHAUSTED instead of the
// error: it arrives as itself, its message cut.
TEST_F(CoordinatorTest, AnErrorEchoingAHugeInputArrivesAsItself) {
  const std::string id = "job-" + std::string(100000, '7');
  const absl::Status s = client_->GetJob(id).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s.message().substr(0, 200);
  EXPECT_NE(s.message().find("no job 'job-7777"), absl::string_view::npos) << s.message().substr(0, 200);
  EXPECT_LT(s.message().size(), 5000u);
}

// Tensor calls have their own deadline (tensor_timeout, 60 s by default):
// the coordinator runs each on every rank after the job's queued calls, so
// the control calls' short deadline would end calls that would be answered.
// Against a peer that accepts connections and never answers, each call ends
// at its own deadline.
TEST(CoordinatorClientDeadlines, TensorCallsTakeTheirOwnDeadline) {
  SilentPort silent;
  ASSERT_NO_FATAL_FAILURE(ListenSilently(&silent));
  const std::string& address = silent.address;
  CoordinatorClient::Options o;
  o.timeout = absl::Milliseconds(200);
  o.tensor_timeout = absl::Seconds(2);
  auto client = CoordinatorClient::Create(address, o);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::Time start = absl::Now();
  EXPECT_EQ((*client)->GetJob("job-000042").status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  start = absl::Now();
  EXPECT_EQ((*client)->ListTensors("job-000042").status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1900)) << "the tensor call had the control calls' deadline";
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  o.tensor_timeout = absl::ZeroDuration();
  EXPECT_EQ(CoordinatorClient::Create(address, o).status().code(), absl::StatusCode::kInvalidArgument);
}

// The daemon's store takes nothing for a scope no placed job generation
// has (a client's own, or a generation not placed): FAILED_PRECONDITION.
TEST_F(CoordinatorTest, TheStoreTakesOnlyAPlacedGenerationsScope) {
  auto& stub = client_->stub();
  grpc::ClientContext ctx;
  v1::KvSetRequest set;
  set.set_scope("job-000001/gen-1");
  set.set_key("k");
  set.set_value(std::string(1 << 20, 'x'));
  v1::KvSetResponse set_resp;
  const grpc::Status s = stub.KvSet(&ctx, set, &set_resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("no placed job generation"), std::string::npos) << s.error_message();
  grpc::ClientContext ctx2;
  v1::KvWaitRequest wait;
  wait.set_scope("mine");
  wait.add_keys("k");
  wait.mutable_timeout()->set_seconds(20);
  v1::KvWaitResponse wait_resp;
  const absl::Time start = absl::Now();
  EXPECT_EQ(stub.KvWait(&ctx2, wait, &wait_resp).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "a wait on a scope no job has holds a thread";
  // A Duration protobuf does not define (nanos of the other sign).
  grpc::ClientContext ctx3;
  wait.mutable_timeout()->set_nanos(-1);
  EXPECT_EQ(stub.KvWait(&ctx3, wait, &wait_resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

// Over gRPC, end to end: a job placed on a worker that registered with a
// key is assigned with that key, and its generation's rendezvous scope
// takes the store's calls only with it (the workers' token is every
// worker's; the scope is its placed workers').
TEST_F(CoordinatorTest, APlacedScopeTakesOnlyItsWorkersKeys) {
  KeyRecordingWorker daemon;
  absl::StatusOr<StartedGrpcServer> server = StartGrpcServer("127.0.0.1:0", {&daemon});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string key = NewWorkerKey();
  v1::RegisterWorkerRequest reg;
  reg.mutable_worker()->set_address(server->address);
  reg.mutable_worker()->set_device_kind(v1::DEVICE_KIND_CPU);
  reg.set_worker_key(key);
  v1::RegisterWorkerResponse reg_resp;
  {
    grpc::ClientContext ctx;
    const grpc::Status s = client_->stub().RegisterWorker(&ctx, reg, &reg_resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  absl::StatusOr<v1::Job> job = client_->SubmitJob(testing::TensorJobSpec());
  ASSERT_TRUE(job.ok()) << job.status();
  bool assigned = false;
  for (int i = 0; i < 200 && !assigned; ++i) {
    for (const std::string& seen : daemon.Seen()) assigned = assigned || seen == "assign " + key;
    if (!assigned) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(assigned) << "the assignment, with the worker's key";
  const std::string scope = job->job_id() + "/gen-1";
  auto set = [&](const std::string& carried) {
    grpc::ClientContext ctx;
    AddWorkerKey(ctx, carried);
    v1::KvSetRequest req;
    req.set_scope(scope);
    req.set_key("rank0");
    req.set_value("127.0.0.1:1");
    v1::KvSetResponse resp;
    return client_->stub().KvSet(&ctx, req, &resp);
  };
  for (const std::string& other : {std::string(), NewWorkerKey()}) {
    const grpc::Status refused = set(other);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED) << refused.error_message();
    EXPECT_NE(refused.error_message().find("carries the key of none of the workers placed in it"), std::string::npos)
        << refused.error_message();
  }
  const grpc::Status taken = set(key);
  EXPECT_TRUE(taken.ok()) << taken.error_message();
  server->server->Shutdown();
}

// Over gRPC: an uploaded model goes only to the workers placed in a job
// that uses it (their downloads carry their keys; the workers' token is
// every worker's): refused before any job uses it, served with the placed
// worker's key, refused with another worker's key or none.
TEST_F(CoordinatorTest, AnUploadGoesOnlyToTheWorkersPlacedInAJobThatUsesIt) {
  const std::string dir = testing::TempPath("placed-upload");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/model.safetensors", std::ios::binary) << std::string(3000, 'w');
  auto uploaded = client_->UploadModel(dir, absl::Seconds(60));
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  const auto download = [&](const std::string& key, int64_t* bytes) {
    grpc::ClientContext ctx;
    AddWorkerKey(ctx, key);
    v1::DownloadModelRequest req;
    req.set_upload_id(uploaded->upload_id());
    auto reader = client_->stub().DownloadModel(&ctx, req);
    v1::ModelChunk chunk;
    *bytes = 0;
    while (reader->Read(&chunk)) *bytes += static_cast<int64_t>(chunk.data().size());
    return reader->Finish();
  };
  const std::string key = NewWorkerKey();
  int64_t bytes = 0;
  const grpc::Status early = download(key, &bytes);
  EXPECT_EQ(early.error_code(), grpc::StatusCode::PERMISSION_DENIED) << early.error_message();
  EXPECT_NE(early.error_message().find("no job placed now uses upload"), std::string::npos) << early.error_message();
  EXPECT_EQ(bytes, 0);
  KeyRecordingWorker daemon;
  absl::StatusOr<StartedGrpcServer> server = StartGrpcServer("127.0.0.1:0", {&daemon});
  ASSERT_TRUE(server.ok()) << server.status();
  auto placed = PlaceAJobOfTheUpload(*client_, daemon, server->address, key, true, uploaded->upload_id());
  ASSERT_TRUE(placed.ok()) << placed.status();
  const grpc::Status served = download(key, &bytes);
  EXPECT_TRUE(served.ok()) << served.error_message();
  EXPECT_EQ(bytes, 3000);
  for (const std::string& other : {std::string(), NewWorkerKey()}) {
    const grpc::Status refused = download(other, &bytes);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED) << refused.error_message();
    EXPECT_NE(refused.error_message().find("carries the key of none of the workers placed in the jobs that use it"),
              std::string::npos)
        << refused.error_message();
    EXPECT_EQ(bytes, 0);
  }
  server->server->Shutdown();
}

// A DEADLINE_EXCEEDED (or UNAVAILABLE) the coordinator answers is its
// answer, marked in the trailers (MarkAnswered): a client tells it from a
// coordinator it never reached (coloctl: exit 1, not 69).
TEST_F(AnyScopeCoordinatorTest, ItsOwnTimeoutsAreAnswersNotAnUnreachableCoordinator) {
  grpc::ClientContext ctx;
  v1::KvWaitRequest wait;
  wait.set_scope("job-1/gen-1");
  wait.add_keys("never-set");
  wait.mutable_timeout()->set_nanos(50'000'000);
  v1::KvWaitResponse resp;
  const grpc::Status answered = client_->stub().KvWait(&ctx, wait, &resp);
  ASSERT_EQ(answered.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << answered.error_message();
  const absl::Status status = MarkUnreachableUnlessAnswered(FromGrpcStatus(answered), ctx);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(IsUnreachable(status)) << status;
  // Nothing listens on port 1: no answer, unreachable.
  auto nowhere = v1::CoordinatorService::NewStub(grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()));
  grpc::ClientContext refused_ctx;
  refused_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const grpc::Status refused = nowhere->KvWait(&refused_ctx, wait, &resp);
  ASSERT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(IsUnreachable(MarkUnreachableUnlessAnswered(FromGrpcStatus(refused), refused_ctx)));
}

TEST_F(AnyScopeCoordinatorTest, RendezvousStoreOverGrpc) {
  auto& stub = client_->stub();
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    grpc::ClientContext ctx;
    v1::KvSetRequest req;
    req.set_scope("job-1/gen-1");
    req.set_key("nccl_id");
    req.set_value(std::string("\x00\x01\x02", 3));
    v1::KvSetResponse resp;
    EXPECT_TRUE(stub.KvSet(&ctx, req, &resp).ok());
  });
  grpc::ClientContext ctx;
  v1::KvWaitRequest req;
  req.set_scope("job-1/gen-1");
  req.add_keys("nccl_id");
  req.mutable_timeout()->set_seconds(20);
  v1::KvWaitResponse resp;
  grpc::Status st = stub.KvWait(&ctx, req, &resp);
  setter.join();
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resp.values_size(), 1);
  EXPECT_EQ(resp.values(0), std::string("\x00\x01\x02", 3));

  grpc::ClientContext ctx2;
  req.set_scope("job-1/gen-2");
  req.mutable_timeout()->set_seconds(0);
  req.mutable_timeout()->set_nanos(50000000);
  EXPECT_EQ(stub.KvWait(&ctx2, req, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);

  grpc::ClientContext ctx3;
  v1::KvGetRequest get;
  get.set_scope("job-1/gen-2");
  get.set_key("nccl_id");
  v1::KvGetResponse got;
  EXPECT_EQ(stub.KvGet(&ctx3, get, &got).error_code(), grpc::StatusCode::NOT_FOUND);

  std::vector<grpc::Status> barrier(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      grpc::ClientContext c;
      v1::BarrierRequest b;
      b.set_scope("job-1/gen-1");
      b.set_name("init");
      b.set_rank(r);
      b.set_world_size(2);
      b.mutable_timeout()->set_seconds(20);
      v1::BarrierResponse br;
      barrier[r] = stub.Barrier(&c, b, &br);
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_TRUE(barrier[0].ok() && barrier[1].ok());

  // A value at the store's bound, under the longest scope and key, goes
  // through gRPC's default 4 MiB message both ways; one byte more is refused
  // by the store, saying so.
  const std::string scope(RendezvousStore::kMaxKeyBytes, 's'), key(RendezvousStore::kMaxKeyBytes, 'k');
  const std::string value(RendezvousStore::kMaxValueBytes, 'v');
  {
    grpc::ClientContext c;
    v1::KvSetRequest set;
    set.set_scope(scope);
    set.set_key(key);
    set.set_value(value);
    v1::KvSetResponse sr;
    const grpc::Status s = stub.KvSet(&c, set, &sr);
    EXPECT_TRUE(s.ok()) << s.error_message();
    grpc::ClientContext c2;
    set.mutable_value()->push_back('v');
    const grpc::Status over = stub.KvSet(&c2, set, &sr);
    EXPECT_EQ(over.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << over.error_message();
  }
  grpc::ClientContext c3;
  v1::KvWaitRequest wait;
  wait.set_scope(scope);
  wait.add_keys(key);
  wait.mutable_timeout()->set_seconds(5);
  v1::KvWaitResponse waited;
  const grpc::Status w = stub.KvWait(&c3, wait, &waited);
  ASSERT_TRUE(w.ok()) << w.error_message();
  ASSERT_EQ(waited.values_size(), 1);
  EXPECT_TRUE(waited.values(0) == value);
}

TEST_F(CoordinatorTest, ServesParseableMetrics) {
  v1::WorkerInfo info;
  info.set_address("127.0.0.1:7071");
  ASSERT_TRUE(client_->RegisterWorker(info).ok());
  // A worker that stopped cleanly: counted as left, not lost, and without a
  // heartbeat age (neither would page anyone for a rolling update).
  info.set_address("127.0.0.1:7072");
  auto leaving = client_->RegisterWorker(info);
  ASSERT_TRUE(leaving.ok());
  {
    grpc::ClientContext ctx;
    v1::DeregisterWorkerRequest req;
    req.set_worker_id(leaving->worker_id());
    req.set_reason("the worker is shutting down");
    v1::DeregisterWorkerResponse resp;
    ASSERT_TRUE(client_->stub().DeregisterWorker(&ctx, req, &resp).ok());
  }
  auto body = testing::HttpGet(coordinator_->metrics_address(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  auto families = testing::ParsePrometheusText(*body);
  ASSERT_TRUE(families.ok()) << families.status() << "\n" << *body;
  const auto& info_family = families->at("colod_build_info");
  EXPECT_EQ(info_family.type, "gauge");
  ASSERT_EQ(info_family.samples.size(), 1u);
  EXPECT_EQ(info_family.samples[0].value, 1);
  EXPECT_EQ(info_family.samples[0].labels.at("component"), "coordinator");
  const auto& rpc = families->at("colod_rpc_duration_seconds");
  EXPECT_EQ(rpc.type, "histogram");
  bool saw_register = false;
  for (const auto& s : rpc.samples) {
    if (s.name == "colod_rpc_duration_seconds_count" && s.labels.at("method") == "RegisterWorker" &&
        s.labels.at("code") == "OK") {
      saw_register = s.value >= 1;
    }
  }
  EXPECT_TRUE(saw_register) << *body;
  EXPECT_EQ(families->at("colod_workers").type, "gauge");
  const std::map<std::string, double> want_workers = {{"busy", 0}, {"idle", 1}, {"left", 1}, {"lost", 0}};
  std::map<std::string, double> workers;
  for (int i = 0; i < 50 && workers != want_workers; ++i) {  // the sweeper publishes them every 100 ms
    absl::SleepFor(absl::Milliseconds(100));
    auto scraped = testing::ParsePrometheusText(*testing::HttpGet(coordinator_->metrics_address(), "/metrics"));
    ASSERT_TRUE(scraped.ok());
    workers.clear();
    for (const auto& s : scraped->at("colod_workers").samples) workers[s.labels.at("state")] = s.value;
  }
  EXPECT_EQ(workers, want_workers);
  // Every final state is counted from 0 on, so increase() sees the first.
  const auto& finished = families->at("colod_jobs_finished_total");
  EXPECT_EQ(finished.type, "counter");
  std::map<std::string, double> by_state;
  for (const auto& s : finished.samples) by_state[s.labels.at("state")] = s.value;
  EXPECT_EQ(by_state, (std::map<std::string, double>{{"cancelled", 0}, {"failed", 0}, {"succeeded", 0}}));
  // The sweeper (every 100 ms here) publishes each worker's heartbeat age.
  bool saw_age = false;
  for (int i = 0; i < 50 && !saw_age; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    auto again = testing::ParsePrometheusText(*testing::HttpGet(coordinator_->metrics_address(), "/metrics"));
    ASSERT_TRUE(again.ok());
    auto it = again->find("colod_worker_heartbeat_age_seconds");
    if (it == again->end() || it->second.samples.size() != 1) continue;  // the worker that left has none
    EXPECT_EQ(it->second.type, "gauge");
    EXPECT_FALSE(it->second.samples[0].labels.at("worker").empty());
    EXPECT_GE(it->second.samples[0].value, 0);
    EXPECT_LT(it->second.samples[0].value, 30);
    saw_age = true;
  }
  EXPECT_TRUE(saw_age) << "no colod_worker_heartbeat_age_seconds series";
}

// A failed start leaves no --data-dir it made behind.
TEST(CoordinatorStart, RefusesASharedDataDirAndBadOptions) {
  Coordinator::Options o;
  o.data_dir = testing::TempPath("shared");
  auto first = Coordinator::Start(o);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = Coordinator::Start(o);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("in use by another coordinator"), absl::string_view::npos);
  (*first)->Shutdown();
  auto third = Coordinator::Start(o);  // the lock is released on shutdown
  EXPECT_TRUE(third.ok()) << third.status();

  Coordinator::Options no_dir;
  EXPECT_EQ(Coordinator::Start(no_dir).status().code(), absl::StatusCode::kInvalidArgument);
  Coordinator::Options bad_listen;
  bad_listen.data_dir = testing::TempPath("bad_listen");
  bad_listen.listen = "127.0.0.1";
  EXPECT_EQ(Coordinator::Start(bad_listen).status().code(), absl::StatusCode::kInvalidArgument);
  Coordinator::Options bad_lease;
  bad_lease.data_dir = testing::TempPath("bad_lease");
  bad_lease.lease_duration = absl::Seconds(1);
  bad_lease.heartbeat_interval = absl::Seconds(2);
  EXPECT_EQ(Coordinator::Start(bad_lease).status().code(), absl::StatusCode::kInvalidArgument);
  Coordinator::Options bad_grace;
  bad_grace.data_dir = testing::TempPath("bad_grace");
  bad_grace.stop_grace = absl::Seconds(-1);
  const absl::Status grace = Coordinator::Start(bad_grace).status();
  EXPECT_EQ(grace.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(grace.message().find("--stop-grace"), absl::string_view::npos) << grace;
  Coordinator::Options bad_rpc;
  bad_rpc.data_dir = testing::TempPath("bad_rpc");
  bad_rpc.worker_rpc_timeout = absl::ZeroDuration();
  const absl::Status rpc = Coordinator::Start(bad_rpc).status();
  EXPECT_EQ(rpc.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(rpc.message().find("--worker-rpc-timeout"), absl::string_view::npos) << rpc;
  Coordinator::Options bad_ended;
  bad_ended.data_dir = testing::TempPath("bad_ended");
  bad_ended.max_ended_jobs = -1;
  const absl::Status ended = Coordinator::Start(bad_ended).status();
  EXPECT_EQ(ended.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ended.message().find("--max-ended-jobs"), absl::string_view::npos) << ended;

  // --data-dir-reserve: the file, held (the gauge says so), and removed by
  // a start that keeps none.
  Coordinator::Options reserved;
  reserved.data_dir = testing::TempPath("reserved");
  reserved.data_dir_reserve_bytes = 1 << 20;
  {
    auto c = Coordinator::Start(reserved);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(std::filesystem::file_size(reserved.data_dir + "/disk-reserve"), 1u << 20);
    const absl::StatusOr<std::string> metrics = testing::HttpGet((*c)->metrics_address(), "/metrics");
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    EXPECT_NE(metrics->find("colod_data_dir_reserve_bytes 1048576"), std::string::npos) << *metrics;
  }
  reserved.data_dir_reserve_bytes = 0;
  {
    auto c = Coordinator::Start(reserved);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_FALSE(std::filesystem::exists(reserved.data_dir + "/disk-reserve"));
    const absl::StatusOr<std::string> metrics = testing::HttpGet((*c)->metrics_address(), "/metrics");
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    EXPECT_EQ(metrics->find("colod_data_dir_reserve_bytes"), std::string::npos) << "no reserve, no series";
  }

  // Its port taken: the start fails after it made --data-dir (and a parent
  // of it), which go with it; a --data-dir that was there stays, as it was.
  Coordinator::Options taken;
  taken.listen = (*third)->address();
  taken.data_dir = testing::TempPath("made-data-dir/a");
  const absl::Status refused = Coordinator::Start(taken).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_FALSE(std::filesystem::exists(testing::TempPath("made-data-dir")));
  taken.data_dir = testing::TempPath("kept-data-dir");
  std::filesystem::create_directories(taken.data_dir + "/notes");
  EXPECT_EQ(Coordinator::Start(taken).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(std::filesystem::exists(taken.data_dir + "/notes"));
}

}  // namespace
}  // namespace colod
