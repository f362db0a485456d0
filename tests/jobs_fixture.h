// The fixture of the cluster tests (jobs_test.cc, cuda_daemons_test.cc): a
// coordinator and four worker daemons as processes on loopback, a tiny GPT-2,
// and helpers to submit, watch, stop and find the workers of a job's ranks.
#ifndef COLOD_TESTS_JOBS_FIXTURE_H_
#define COLOD_TESTS_JOBS_FIXTURE_H_

#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "colod/v1/worker.grpc.pb.h"
#include "common/proto_time.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/job_manager.h"
#include "tests/subprocess.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"
#include "worker/train/job_options.h"
#include "worker/train/trainer.h"

namespace colod::testing {

inline constexpr char kGpl[] = "/usr/share/common-licenses/GPL-3";

// A worker's status over its gRPC service.
inline v1::WorkerStatus StatusOf(const std::string& address) {
  auto stub = v1::WorkerService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::GetStatusResponse resp;
  EXPECT_TRUE(stub->GetStatus(&ctx, v1::GetStatusRequest(), &resp).ok());
  return resp.status();
}

// A coordinator and four workers (CPU ones unless worker_flags_ say
// otherwise) and a tiny byte-level GPT-2 at TempPath("gpt2"); torn down by
// the destructors.
class JobsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shardformer::testing::TinyOptions tiny;
    tiny.vocab = 257;  // byte-level text
    tiny.positions = 32;
    auto model = shardformer::testing::WriteTinyGpt2(TempPath("gpt2"), tiny);
    ASSERT_TRUE(model.ok()) << model.status();
    StartCoordinator();
    workers_ = StartTestWorkers(coordinator_.grpc, 4, worker_flags_);
    for (const Daemon& w : workers_) ASSERT_FALSE(w.grpc.empty()) << ReadFile(w.log);
    const absl::Status registered = WaitForWorkers(*client_, 4);
    ASSERT_TRUE(registered.ok()) << registered << "\n" << Logs();
  }

  // `listen`: where to serve (a restart reuses the address the workers know).
  // Each test's coordinator has a data dir of its own, so that no test's
  // unfinished jobs come back (restarting) in the next one.
  void StartCoordinator(const std::string& listen = "127.0.0.1:0") {
    const std::string data =
        TempPath(absl::StrCat("data-", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::vector<std::string> flags = {"--data-dir", data};
    flags.insert(flags.end(), coordinator_flags_.begin(), coordinator_flags_.end());
    coordinator_ = StartTestCoordinator(listen, flags);
    ASSERT_FALSE(coordinator_.grpc.empty()) << ReadFile(coordinator_.log);
    auto client = CoordinatorClient::Create(coordinator_.grpc);
    ASSERT_TRUE(client.ok());
    client_ = std::move(*client);
  }

  train::TrainOptions Options(int64_t steps) const {
    train::TrainOptions o;
    o.model_dir = TempPath("gpt2");
    o.data_path = kGpl;
    o.steps = steps;
    o.batch_size = 4;
    o.seq_len = 32;
    o.lr = 3e-3;
    o.min_lr = 3e-4;
    o.seed = 3;
    o.shard.layout.set_tensor_parallel_size(2);
    o.shard.layout.set_data_parallel_size(2);
    o.shard.layout.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_1D);
    return o;
  }

  v1::JobSpec Spec(const train::TrainOptions& o) const {
    v1::JobSpec spec = train::SpecFromTrainOptions(o);
    spec.set_name("tiny");
    spec.mutable_model()->set_config_json(ReadFile(o.model_dir + "/config.json"));
    spec.mutable_model()->set_weights_path(o.model_dir);
    return spec;
  }

  // Events until the job ends.
  std::vector<v1::JobEvent> Watch(const std::string& job_id) {
    std::vector<v1::JobEvent> events;
    const absl::Status s = client_->WatchJob(job_id, 1, absl::Seconds(240), [&](const v1::JobEvent& e) {
      events.push_back(e);
      return true;
    });
    EXPECT_TRUE(s.ok()) << s;
    return events;
  }

  std::string Logs() { return DaemonLogs(coordinator_, workers_); }

  // Submits a long TRAIN job (tp=2 x dp=2; restarts as given) and returns
  // its id once rank 0 reported step 2; "" (and a test failure) if it did not
  // within 60 s.
  std::string StartLongJob(int max_restarts = 0, int zero_stage = 0) {
    train::TrainOptions o = Options(100000);
    o.zero_stage = zero_stage;
    v1::JobSpec spec = Spec(o);
    spec.mutable_restart()->set_max_restarts(max_restarts);
    auto job = client_->SubmitJob(spec);
    if (!job.ok()) {
      ADD_FAILURE() << job.status();
      return "";
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline && client_->GetJob(job->job_id())->step() < 2) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    if (client_->GetJob(job->job_id())->step() < 2) {
      ADD_FAILURE() << "job " << job->job_id() << " did not reach step 2\n" << Logs();
      return "";
    }
    return job->job_id();
  }

  // The index in workers_ of the worker holding `rank` of `mesh`; -1 if none.
  int WorkerOf(const v1::MeshSpec& mesh, int rank) const {
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (workers_[i].grpc == mesh.ranks(rank).worker_address()) return static_cast<int>(i);
    }
    return -1;
  }

  // A long job (StartLongJob, no restarts) at step 2, its mesh, and the
  // index in workers_ of the worker holding `rank`: -1 (and a test failure)
  // if the job did not get there.
  struct LongJob {
    std::string job_id;
    v1::MeshSpec mesh;
    int worker = -1;
  };
  LongJob StartLongJobOn(int rank, int zero_stage = 0) {
    LongJob out;
    out.job_id = StartLongJob(/*max_restarts=*/0, zero_stage);
    if (out.job_id.empty()) return out;
    auto mesh = client_->GetMesh(out.job_id);
    if (!mesh.ok()) {
      ADD_FAILURE() << mesh.status();
      return out;
    }
    out.mesh = mesh->mesh();
    out.worker = WorkerOf(out.mesh, rank);
    if (out.worker < 0) ADD_FAILURE() << "no worker holds rank " << rank;
    return out;
  }

  bool AllIdle(absl::Duration within, int except = -1) {
    const absl::Time deadline = absl::Now() + within;
    while (absl::Now() < deadline) {
      bool idle = true;
      for (size_t i = 0; i < workers_.size(); ++i) {
        if (static_cast<int>(i) != except) idle = idle && StatusOf(workers_[i].grpc).state() == v1::WORKER_STATE_IDLE;
      }
      if (idle) return true;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return false;
  }

  // Submits `spec` and waits until rank 0 reported at least step `step` and
  // a checkpoint; then stops (SIGSTOP) the worker of `rank`, so the job
  // cannot finish meanwhile, and returns the mesh and the step it reached.
  // False (and a test failure) if the job ended or took longer than 60 s.
  bool RunUntilStepThenStop(const std::string& job_id, int64_t step, int rank, v1::MeshSpec* mesh, int* worker) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    absl::StatusOr<v1::Job> job = client_->GetJob(job_id);
    while (absl::Now() < deadline && job.ok() && (job->step() < step || job->last_checkpoint().empty()) &&
           !JobManager::IsFinal(job->state())) {
      absl::SleepFor(absl::Milliseconds(5));
      job = client_->GetJob(job_id);
    }
    if (!job.ok() || job->step() < step || JobManager::IsFinal(job->state())) {
      ADD_FAILURE() << "job " << job_id << " did not reach step " << step << " and run on: "
                    << (job.ok() ? job->DebugString() : job.status().ToString()) << Logs();
      return false;
    }
    *mesh = job->mesh();
    *worker = WorkerOf(*mesh, rank);
    if (*worker < 0) return false;
    workers_[*worker].process->Signal(SIGSTOP);
    return true;
  }

  // SIGKILLs worker `victim` and starts a CPU worker in its stead (numbered
  // after the first four), registered with the coordinator.
  void KillAndReplaceWorker(int victim) {
    workers_[victim].process->Signal(SIGKILL);
    workers_[victim].process->Wait(absl::Seconds(10));
    std::vector<Daemon> joined = StartTestWorkers(coordinator_.grpc, 1, {}, /*first=*/4);
    ASSERT_EQ(joined.size(), 1u);
    workers_.push_back(std::move(joined[0]));
  }

  // A run of `o` (tp=2 x dp=2) on the workers, saving checkpoints only at
  // its end: once it reported step 3, the worker of rank 1 is stopped
  // cleanly (SIGTERM). It drains the job: it logs so and exits 0; the job
  // goes back to PENDING naming that rank and the drain, and is placed again
  // once `replace(leaving)` started a worker in its stead; every rank of
  // generation 2 resumes from the drain's step, whose checkpoint is on disk;
  // the job succeeds with the in-process run's losses, bit for bit, and no
  // restart counted (it may restart none). Callers ASSERT_NO_FATAL_FAILURE it.
  void DrainMidRun(const train::TrainOptions& o, const std::function<void(int leaving)>& replace) {
    std::vector<double> want;
    ASSERT_TRUE(train::Train(o, [&](const train::StepStats& s) { want.push_back(s.loss); }).ok());
    v1::JobSpec spec = Spec(o);
    spec.mutable_train()->set_checkpoint_every(1000);  // none but the drain's before the last step
    spec.mutable_train()->set_checkpoint_dir(TempPath("ck-drain"));
    spec.mutable_restart()->set_max_restarts(0);
    auto job = client_->SubmitJob(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    absl::StatusOr<v1::Job> now = client_->GetJob(job->job_id());
    while (absl::Now() < deadline && now.ok() && now->step() < 3 && !JobManager::IsFinal(now->state())) {
      absl::SleepFor(absl::Milliseconds(5));
      now = client_->GetJob(job->job_id());
    }
    ASSERT_TRUE(now.ok() && now->step() >= 3 && !JobManager::IsFinal(now->state())) << Logs();
    const v1::MeshSpec mesh = now->mesh();
    const int leaving = WorkerOf(mesh, 1);
    ASSERT_GE(leaving, 0);
    const absl::Time stopped = absl::Now();
    workers_[leaving].process->Signal(SIGTERM);
    ASSERT_EQ(workers_[leaving].process->Wait(absl::Seconds(60)), 0) << Logs();
    const absl::Time exited = absl::Now();
    const std::string log = ReadFile(workers_[leaving].log);
    EXPECT_TRUE(absl::StrContains(log, "draining its job")) << log;
    EXPECT_TRUE(absl::StrContains(log, "drained: the job's rank here ended")) << log;
    ASSERT_NO_FATAL_FAILURE(replace(leaving));
    const std::vector<v1::JobEvent> events = Watch(job->job_id());
    auto done = client_->GetJob(job->job_id());
    ASSERT_TRUE(done.ok());
    ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
    EXPECT_EQ(done->restarts(), 0);
    EXPECT_EQ(done->generation(), 2);
    for (const v1::RankAssignment& a : done->mesh().ranks()) EXPECT_NE(a.worker_address(), workers_[leaving].grpc);
    int64_t drained_at = -1;
    for (const v1::JobEvent& e : events) {
      if (!e.has_state_change() || e.state_change().state() != v1::JOB_STATE_PENDING) continue;
      const std::string& why = e.state_change().reason();
      if (!absl::StrContains(why, absl::StrCat("rank 1 (worker ", mesh.ranks(1).worker_id())) ||
          !absl::StrContains(why, "(a drain, not counted against the job)")) {
        continue;
      }
      const size_t at = why.find("stopped after step ");
      ASSERT_NE(at, std::string::npos) << why;
      drained_at = std::atoll(why.c_str() + at + std::strlen("stopped after step "));
    }
    ASSERT_GE(drained_at, 3) << "no PENDING event names the drain and the leaving rank";
    EXPECT_LT(drained_at, o.steps);
    // Every rank of generation 2 resumed from the drain's step: none trained one twice.
    int resumed = 0;
    for (const v1::JobEvent& e : events) {
      if (e.has_rank_status() && e.rank_status().phase() == v1::RANK_PHASE_TRAINING &&
          e.rank_status().resumed_step() > 0) {
        EXPECT_EQ(e.rank_status().resumed_step(), drained_at) << e.rank_status().ShortDebugString();
        ++resumed;
      }
    }
    EXPECT_EQ(resumed, 4);
    ASSERT_NO_FATAL_FAILURE(ExpectLastLosses(events, want));
    EXPECT_TRUE(std::filesystem::exists(TempPath("ck-drain") + "/" + absl::StrFormat("step-%06d", drained_at)));
    absl::Time pending = absl::InfinitePast(), running_again = absl::InfinitePast();
    for (const v1::JobEvent& e : events) {
      if (!e.has_state_change()) continue;
      if (e.state_change().state() == v1::JOB_STATE_PENDING) pending = FromProtoTimestamp(e.time());
      if (e.state_change().state() == v1::JOB_STATE_RUNNING) running_again = FromProtoTimestamp(e.time());
    }
    std::printf(
        "worker SIGTERM: drained and exited after %.2f s, the job PENDING after %.2f s, RUNNING again %.2f s "
        "after it exited (a replacement started meanwhile)\n",
        absl::ToDoubleSeconds(exited - stopped), absl::ToDoubleSeconds(pending - stopped),
        absl::ToDoubleSeconds(running_again - exited));
  }

  // Every step of `events` once, with rank 0's last reported loss `want`
  // (steps 1, 2, ... in order), exactly. Callers ASSERT_NO_FATAL_FAILURE it.
  void ExpectLastLosses(const std::vector<v1::JobEvent>& events, const std::vector<double>& want) {
    const std::map<int64_t, double> got = LastLosses(events);
    ASSERT_EQ(got.size(), want.size()) << Logs();
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got.at(i + 1), want[i]) << "step " << i + 1;
  }

  // Rank 0's loss of each step as last reported (a restart repeats the steps
  // after its checkpoint), by step.
  static std::map<int64_t, double> LastLosses(const std::vector<v1::JobEvent>& events) {
    std::map<int64_t, double> losses;
    for (const v1::JobEvent& e : events) {
      if (e.has_step()) losses[e.step().step()] = e.step().loss();
    }
    return losses;
  }

  std::vector<std::string> coordinator_flags_;  // set before SetUp
  std::vector<std::string> worker_flags_;       // set before SetUp: {"--device", "cuda"} for CUDA workers
  Daemon coordinator_;
  std::vector<Daemon> workers_;
  std::unique_ptr<CoordinatorClient> client_;
};

}  // namespace colod::testing

#endif  // COLOD_TESTS_JOBS_FIXTURE_H_
