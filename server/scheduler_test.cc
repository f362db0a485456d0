// The scheduler as a state machine, driven tick by tick with a fake clock
// and a fake WorkerClient (no daemons, no threads of its own): placement,
// RUNNING, SUCCEEDED; restarts after a retryable rank failure (resuming from
// the checkpoint) until they are spent; errors of the job itself; a lost
// worker and the wait for workers; refused assignments and their cool-off;
// hang reports; job records written outside the scheduler's lock, and a
// generation handed out only once it is recorded.
#include "server/scheduler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/proto_time.h"
#include "gtest/gtest.h"
#include "spec/job_validation.h"
#include "tests/testing/full_disk.h"
#include "tests/testing/job_specs.h"

namespace colod {
namespace {

// Records every call; refuses assignments to the addresses in `refuse`.
class FakeWorkers final : public WorkerClient {
 public:
  std::vector<absl::Status> Assign(const std::vector<Call<v1::AssignJobRequest>>& calls, absl::Duration) override {
    if (during_assign) during_assign();  // (set before the scheduler runs, read on its assigning thread)
    absl::MutexLock lock(&mu_);
    std::vector<absl::Status> out;
    for (const auto& c : calls) {
      assigned.push_back(c);
      out.push_back(refuse.count(c.address) ? refusal : absl::OkStatus());
    }
    return out;
  }
  std::vector<absl::Status> Abort(const std::vector<Call<v1::AbortJobRequest>>& calls, absl::Duration) override {
    absl::MutexLock lock(&mu_);
    for (const auto& c : calls) aborted.push_back(c);
    return std::vector<absl::Status>(calls.size());
  }
  std::vector<absl::Status> Probe(const std::vector<Call<v1::GetStatusRequest>>& calls, absl::Duration) override {
    return std::vector<absl::Status>(calls.size());
  }

  absl::Mutex mu_;
  std::vector<Call<v1::AssignJobRequest>> assigned;
  std::vector<Call<v1::AbortJobRequest>> aborted;
  std::set<std::string> refuse;
  absl::Status refusal = absl::UnavailableError("stopped");
  std::function<void()> during_assign;  // runs as the calls go out
};

// testing::TinyTrainSpec, ten steps of 4 x 32 tokens with a checkpoint every
// two, in a directory of its own (a job saving into another active job's is
// refused).
v1::JobSpec TrainSpec(int tp, int dp) {
  v1::JobSpec s = testing::TinyTrainSpec(tp, dp);
  auto* t = s.mutable_train();
  t->set_steps(10);
  t->set_batch_size(4);
  t->set_seq_len(32);
  t->set_data_path("/data/corpus.bin");
  t->set_checkpoint_every(2);
  static std::atomic<int> dirs{0};
  t->set_checkpoint_dir(absl::StrCat("/ck/", ++dirs));
  return s;
}

class SchedulerTest : public ::testing::Test {
 protected:
  SchedulerTest() : registry_(RegistryOptions(&clock_)), jobs_(std::make_unique<JobManager>(&clock_)) {}

  static WorkerRegistry::Options RegistryOptions(Clock* clock) {
    WorkerRegistry::Options o;
    o.heartbeat_interval = absl::Seconds(1);
    o.lease_duration = absl::Seconds(5);
    o.clock = clock;
    return o;
  }

  // `memory`: each worker's memory_bytes (none: 0, not said).
  void Start(int workers, Scheduler::Options o = Scheduler::Options(), std::vector<int64_t> memory = {}) {
    o.worker_client = fake_;
    o.clock = &clock_;
    // Fail at once, unprobed, unless the test asks for probes.
    if (o.probe_timeout == Scheduler::Options().probe_timeout) o.probe_timeout = absl::ZeroDuration();
    if (o.hang_threshold == Scheduler::Options().hang_threshold) o.hang_threshold = absl::ZeroDuration();
    scheduler_ = std::make_unique<Scheduler>(jobs_.get(), &registry_, &store_, o);
    for (int i = 0; i < workers; ++i) {
      v1::WorkerInfo info;
      info.set_address("10.0.0." + std::to_string(i + 1) + ":7071");
      info.set_device_kind(cuda_peak_.has_value() ? v1::DEVICE_KIND_CUDA : v1::DEVICE_KIND_CPU);
      if (cuda_peak_.has_value()) *info.mutable_peak() = *cuda_peak_;
      info.set_device_ordinal(0);
      if (i < static_cast<int>(memory.size())) info.set_memory_bytes(memory[i]);
      info.set_downloads_carry_key(keyless_downloads_.count(i) == 0);
      info.set_drains(no_drain_.count(i) == 0);
      info.set_agrees_on_resume(no_drain_.count(i) == 0);
      auto r = registry_.Register(info, v1::WorkerStatus(), i < static_cast<int>(keys_.size()) ? keys_[i] : "");
      ASSERT_TRUE(r.ok()) << r.status();
      ids_.push_back(r->worker_id);
      Beat(i);
    }
  }
  void Beat(int worker, v1::WorkerStatus status = v1::WorkerStatus()) {
    if (status.state() == v1::WORKER_STATE_UNSPECIFIED) status.set_state(v1::WORKER_STATE_IDLE);
    ASSERT_TRUE(registry_.Heartbeat(ids_[worker], status).ok());
  }

  v1::Job Job(const std::string& id) { return *jobs_->Get(id); }

  // Jobs recorded in TEST_TMPDIR/NAME, empty at first: returns the path.
  std::string RecordJobsIn(const std::string& name) {
    const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
    std::filesystem::remove_all(dir);
    auto opened = JobManager::Open(dir, &clock_);
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (opened.ok()) jobs_ = std::move(*opened);
    return dir;
  }

  // Rank `rank` of the job's current placement reports, with its worker's
  // key (keys_), or `carried` where given.
  absl::StatusOr<bool> Report(const std::string& id, int rank, v1::ReportProgressRequest r,
                              std::optional<std::string> carried = std::nullopt) {
    const v1::Job j = Job(id);
    r.set_job_id(id);
    r.set_generation(j.generation());
    r.set_rank(rank);
    r.set_worker_id(j.mesh().ranks(rank).worker_id());
    if (!carried) carried = KeyOf(r.worker_id());
    return scheduler_->Report(r, [&](absl::string_view key) { return key == *carried; });
  }
  // The key Start registered worker `id` with ("" none).
  std::string KeyOf(const std::string& id) const {
    for (size_t i = 0; i < ids_.size() && i < keys_.size(); ++i) {
      if (ids_[i] == id) return keys_[i];
    }
    return "";
  }
  void Training(const std::string& id) {
    for (int r = 0; r < Job(id).mesh().world_size(); ++r) {
      v1::ReportProgressRequest req;
      req.mutable_status()->set_phase(v1::RANK_PHASE_TRAINING);
      ASSERT_TRUE(Report(id, r, req).ok());
    }
  }
  void Ended(const std::string& id, int rank, absl::StatusCode code, const std::string& message = "") {
    v1::ReportProgressRequest req;
    req.mutable_result()->set_code(static_cast<int>(code));
    req.mutable_result()->set_message(message);
    ASSERT_TRUE(Report(id, rank, req).ok());
  }
  std::vector<v1::JobEvent> Events(const std::string& id) {
    absl::StatusOr<JobManager::Events> got = jobs_->WaitForEvents(id, 1, absl::ZeroDuration());
    return got.ok() ? got->events : std::vector<v1::JobEvent>();
  }
  // Whether a PENDING event of the job's says each of `parts`.
  bool RequeuedSaying(const std::string& id, std::initializer_list<absl::string_view> parts) {
    for (const v1::JobEvent& e : Events(id)) {
      if (!e.has_state_change() || e.state_change().state() != v1::JOB_STATE_PENDING) continue;
      const std::string& why = e.state_change().reason();
      if (std::all_of(parts.begin(), parts.end(),
                      [&](absl::string_view part) { return absl::StrContains(why, part); })) {
        return true;
      }
    }
    return false;
  }
  // A tp=2 TRAIN job with `max_restarts`, placed and training: its id.
  std::string PlaceTraining(int max_restarts) {
    v1::JobSpec spec = TrainSpec(2, 1);
    spec.mutable_restart()->set_max_restarts(max_restarts);
    auto job = jobs_->Submit(spec, "");
    EXPECT_TRUE(job.ok()) << job.status();
    if (!job.ok()) return "";
    scheduler_->TickForTest();
    Training(job->job_id());
    return job->job_id();
  }
  // Rank 0 reports step `step` with its checkpoint.
  void Checkpointed(const std::string& id, int64_t step) {
    v1::ReportProgressRequest req;
    req.mutable_step()->set_step(step);
    req.mutable_step()->set_checkpoint(absl::StrFormat("/ck/step-%06d", step));
    ASSERT_TRUE(Report(id, 0, req).ok());
  }
  std::vector<v1::JobState> States(const std::string& id) {
    std::vector<v1::JobState> out;
    for (const v1::JobEvent& e : Events(id)) {
      if (e.has_state_change()) out.push_back(e.state_change().state());
    }
    return out;
  }
  // Lets `d` pass in heartbeat-sized steps, every worker but `except`
  // heartbeating (idle), then sweeps the registry.
  void Pass(absl::Duration d, int except = -1) {
    for (absl::Duration left = d; left > absl::ZeroDuration(); left -= absl::Seconds(1)) {
      clock_.Advance(std::min(left, absl::Seconds(1)));
      for (int w = 0; w < static_cast<int>(ids_.size()); ++w) {
        if (w != except) Beat(w);
      }
    }
    registry_.Sweep();
  }

  // On 3 workers: a tp=2 job's rank 1 fails RESOURCE_EXHAUSTED as its
  // worker's fault; the job restarts and runs on the other two, and the
  // worker takes jobs again after the cool-off.
  void WorkerFaultRestartsTheJobElsewhere(Scheduler::Options o) {
    const bool probed = o.probe_timeout > absl::ZeroDuration();
    Start(3, o);
    auto job = jobs_->Submit(TrainSpec(2, 1), "");  // the default policy: 3 restarts
    ASSERT_TRUE(job.ok());
    const std::string id = job->job_id();
    scheduler_->TickForTest();
    Training(id);
    const std::string faulty = Job(id).mesh().ranks(1).worker_address();
    {
      v1::ReportProgressRequest req;
      req.mutable_result()->set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
      req.mutable_result()->set_message("cannot write '/work/uploads/u.tmp/model.safetensors': No space left on device");
      req.mutable_result()->set_worker_fault(true);
      ASSERT_TRUE(Report(id, 1, req).ok());
    }
    if (probed) {
      EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);  // the probe decides
      scheduler_->TickForTest();  // probes rank 0's worker (alive): the failure is rank 1's
    }
    v1::Job j = Job(id);
    EXPECT_EQ(j.state(), v1::JOB_STATE_RESTARTING) << j.reason();
    EXPECT_EQ(j.restarts(), 1);
    EXPECT_TRUE(absl::StrContains(j.reason(), "No space left on device (the worker's own fault: it is given no "
                                              "job for 30s)"))
        << j.reason();
    EXPECT_TRUE(absl::StrContains(j.reason(), "restarting (restart 1 of 3)")) << j.reason();
    scheduler_->TickForTest();  // sends rank 0's abort
    Ended(id, 0, absl::StatusCode::kAborted, "aborted");
    scheduler_->TickForTest();
    j = Job(id);
    ASSERT_EQ(j.state(), v1::JOB_STATE_SCHEDULED) << j.reason();
    EXPECT_EQ(j.generation(), 2);
    for (const v1::RankAssignment& a : j.mesh().ranks()) EXPECT_NE(a.worker_address(), faulty);
    Training(id);
    for (int r = 0; r < 2; ++r) Ended(id, r, absl::StatusCode::kOk);
    EXPECT_EQ(Job(id).state(), v1::JOB_STATE_SUCCEEDED);
    // After the cool-off it takes jobs again.
    ExpectAJobOfThreeWorkersIsPlacedAfterTheCoolOff();
  }

  // 31 s pass (a refusal's cool-off and a second); then a job of 3 ranks, on
  // every worker of a 3-worker cluster, is placed at the next tick.
  void ExpectAJobOfThreeWorkersIsPlacedAfterTheCoolOff() {
    Pass(absl::Seconds(31));
    v1::JobSpec wide = TrainSpec(1, 3);
    wide.mutable_train()->set_batch_size(3);
    auto next = jobs_->Submit(wide, "");
    ASSERT_TRUE(next.ok()) << next.status();
    scheduler_->TickForTest();
    EXPECT_EQ(Job(next->job_id()).state(), v1::JOB_STATE_SCHEDULED);
  }

  // On 3 workers with `stop_grace`: a tp=2 job that may restart once runs,
  // its rank 1 fails; it is RESTARTING and rank 0's abort went out.
  void RestartingJob(absl::Duration stop_grace, std::string* id) {
    Scheduler::Options o;
    o.stop_grace = stop_grace;
    Start(3, o);
    v1::JobSpec spec = TrainSpec(2, 1);
    spec.mutable_restart()->set_max_restarts(1);
    auto job = jobs_->Submit(spec, "");
    ASSERT_TRUE(job.ok()) << job.status();
    *id = job->job_id();
    scheduler_->TickForTest();
    Training(*id);
    Ended(*id, 1, absl::StatusCode::kUnavailable, "connection reset");
    scheduler_->TickForTest();  // sends rank 0's abort
    ASSERT_EQ(Job(*id).state(), v1::JOB_STATE_RESTARTING);
    ASSERT_EQ(fake_->aborted.size(), 1u);
  }

  FakeClock clock_;
  WorkerRegistry registry_;
  std::unique_ptr<JobManager> jobs_;
  RendezvousStore store_{[] {
    RendezvousStoreLimits l;
    l.placed_scopes_only = true;  // as the coordinator runs it
    return l;
  }()};
  std::shared_ptr<FakeWorkers> fake_ = std::make_shared<FakeWorkers>();
  std::unique_ptr<Scheduler> scheduler_;
  std::vector<std::string> ids_;
  std::vector<std::string> keys_;  // Start registers worker i with keys_[i], where given
  std::set<int> keyless_downloads_;  // workers Start registers as older ones, whose downloads carry no key
  std::set<int> no_drain_;           // workers Start registers as older ones, which neither drain nor agree on a resume
  std::optional<v1::DevicePeak> cuda_peak_;  // set: Start registers CUDA workers of this peak
};

TEST_F(SchedulerTest, PlacesRunsAndSucceeds) {
  Start(4);
  auto job = jobs_->Submit(TrainSpec(2, 2), "");
  ASSERT_TRUE(job.ok()) << job.status();
  // The store takes nothing for a generation not placed (nor for a scope
  // no job has), so no client fills it under a scope no job's end deletes.
  const std::string scope = job->job_id() + "/gen-1";
  EXPECT_EQ(store_.Set(scope, "early", "x").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_.Set("mine/gen-1", "k", std::string(1000, 'x')).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_.Barrier(scope, "b", 0, 2, absl::Milliseconds(10)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_.Wait(scope, {"k"}, absl::Seconds(10)).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_.bytes(), 0);
  scheduler_->TickForTest();
  v1::Job j = Job(job->job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(j.generation(), 1);
  ASSERT_EQ(fake_->assigned.size(), 4u);  // every rank, at once
  // Placed: its ranks' rendezvous is taken.
  EXPECT_TRUE(store_.Set(scope, "k", "x").ok());
  EXPECT_EQ(*store_.Wait(scope, {"k"}, absl::Seconds(10)), std::vector<std::string>{"x"});
  std::set<std::string> addresses;
  for (size_t r = 0; r < 4; ++r) {
    const auto& c = fake_->assigned[r];
    EXPECT_EQ(c.request.rank(), static_cast<int>(r));
    EXPECT_EQ(c.request.generation(), 1);
    EXPECT_EQ(c.request.rendezvous_scope(), job->job_id() + "/gen-1");
    EXPECT_TRUE(c.request.spec().train().resume_from().empty());  // nothing to resume from yet
    EXPECT_FALSE(c.request.resume_own_checkpoints());
    // The job's uid, which checkpoints record with its id.
    EXPECT_EQ(c.request.job_uid(), j.uid());
    EXPECT_EQ(j.uid().size(), 16u);
    addresses.insert(c.address);
  }
  EXPECT_EQ(addresses.size(), 4u);
  Training(job->job_id());
  EXPECT_EQ(Job(job->job_id()).state(), v1::JOB_STATE_RUNNING);
  for (int r = 0; r < 4; ++r) Ended(job->job_id(), r, absl::StatusCode::kOk);
  EXPECT_EQ(States(job->job_id()), (std::vector<v1::JobState>{v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED,
                                                             v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED}));
  EXPECT_TRUE(fake_->aborted.empty());
  // Ended: its keys are dropped and its scope closed.
  EXPECT_EQ(store_.Set(scope, "late", "x").code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(store_.bytes(), 0);
}

// A rank's status reports add one event a phase (a report sent again, or a
// worker reporting in a loop, adds nothing), a phase that is none is
// refused, and a message is cut to 16 KiB at a UTF-8 boundary, as is a
// failure's that becomes the job's reason.
TEST_F(SchedulerTest, ARanksStatusesAddOneEventAPhaseAndLongMessagesAreCut) {
  Start(2);
  auto job = jobs_->Submit(TrainSpec(1, 2), "");
  ASSERT_TRUE(job.ok()) << job.status();
  scheduler_->TickForTest();
  const std::string id = job->job_id();
  const auto statuses = [&] {
    std::vector<v1::RankStatus> out;
    for (const v1::JobEvent& e : Events(id)) {
      if (e.has_rank_status()) out.push_back(e.rank_status());
    }
    return out;
  };
  // 3 bytes a character: 16 KiB is no whole number of them.
  std::string long_message;
  for (int i = 0; i < 100000; ++i) long_message += "\xe2\x82\xac";
  for (int i = 0; i < 50; ++i) {
    v1::ReportProgressRequest req;
    req.mutable_status()->set_phase(v1::RANK_PHASE_LOADING);
    req.mutable_status()->set_message(i == 0 ? long_message : absl::StrCat("again ", i));
    ASSERT_TRUE(Report(id, 0, req).ok());
  }
  std::vector<v1::RankStatus> recorded = statuses();
  ASSERT_EQ(recorded.size(), 1u);
  const std::string& kept = recorded[0].message();
  EXPECT_LE(kept.size(), 16u << 10);
  EXPECT_GE(kept.size(), (16u << 10) - 6);
  EXPECT_TRUE(absl::EndsWith(kept, "...")) << kept.size();
  EXPECT_TRUE(absl::StartsWith(long_message, kept.substr(0, kept.size() - 3)));
  EXPECT_EQ((kept.size() - 3) % 3, 0u) << "cut inside a character";
  for (const int phase : {0, 42, -1}) {
    v1::ReportProgressRequest req;
    req.mutable_status()->set_phase(static_cast<v1::RankPhase>(phase));
    EXPECT_EQ(Report(id, 0, req).status().code(), absl::StatusCode::kInvalidArgument) << phase;
  }
  Training(id);
  Training(id);
  recorded = statuses();
  ASSERT_EQ(recorded.size(), 3u);  // rank 0 loading; each rank training once
  // Step reports a rank never sends, which each full read of the job would
  // carry (a 3 MB checkpoint list broke ListJobs), are refused, recording
  // nothing; one within the bounds is recorded.
  const auto step_report = [](const std::function<void(v1::StepProgress&)>& change) {
    v1::ReportProgressRequest req;
    v1::StepProgress& st = *req.mutable_step();
    st.set_step(1);
    st.set_loss(2.5);
    *st.mutable_step_duration() = ToProtoDuration(absl::Milliseconds(5));
    change(st);
    return req;
  };
  const std::string path(4097, 'p');
  for (const auto& bad : std::vector<std::function<void(v1::StepProgress&)>>{
           [&](v1::StepProgress& st) { st.set_checkpoint(path); },
           [&](v1::StepProgress& st) { st.set_resumed_from(path); },
           [&](v1::StepProgress& st) { st.add_checkpoints()->set_path(path); },
           [&](v1::StepProgress& st) {
             for (int i = 0; i < 1001; ++i) st.add_checkpoints()->set_path("/ck/step-1");
           },
           [&](v1::StepProgress& st) {
             for (int i = 0; i < 200; ++i) st.add_checkpoints()->set_path(std::string(4000, 'c'));
           },
           [&](v1::StepProgress& st) { st.set_loss(std::nan("")); },
           [&](v1::StepProgress& st) { st.set_loss(std::numeric_limits<double>::infinity()); }}) {
    EXPECT_EQ(Report(id, 0, step_report(bad)).status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(Job(id).step(), 0);
  ASSERT_TRUE(Report(id, 0, step_report([](v1::StepProgress& st) { st.add_checkpoints()->set_path("/ck/a"); })).ok());
  EXPECT_EQ(Job(id).step(), 1);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  Ended(id, 1, absl::StatusCode::kInvalidArgument, long_message);
  const v1::Job failed = Job(id);
  EXPECT_LT(failed.reason().size(), (16u << 10) + 1024) << failed.reason().substr(0, 200);
  EXPECT_NE(failed.reason().find("..."), std::string::npos);
}

// A waiting job's reason follows the cluster (how many workers are idle),
// and each recorded reason is an event of its history: a new one is
// recorded at most every 30 s, the newest then, however often the cluster
// changes.
TEST_F(SchedulerTest, AWaitingJobsReasonIsRecordedAtMostEveryThirtySeconds) {
  Start(1);
  auto job = jobs_->Submit(TrainSpec(2, 1), "");
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  const auto events = [&] { return Events(id).size(); };
  scheduler_->TickForTest();
  EXPECT_NE(Job(id).reason().find("1 idle"), std::string::npos) << Job(id).reason();
  const size_t first = events();
  v1::WorkerStatus busy;
  busy.set_state(v1::WORKER_STATE_BUSY);
  for (int i = 0; i < 20; ++i) {  // 20 s of a worker going busy and idle again
    clock_.Advance(absl::Milliseconds(500));
    Beat(0, busy);
    scheduler_->TickForTest();
    clock_.Advance(absl::Milliseconds(500));
    Beat(0);
    scheduler_->TickForTest();
  }
  EXPECT_EQ(events(), first);
  EXPECT_NE(Job(id).reason().find("1 idle"), std::string::npos) << Job(id).reason();
  for (int i = 0; i < 10; ++i) {  // 30 s since the last recorded reason
    clock_.Advance(absl::Seconds(1));
    Beat(0, busy);
  }
  scheduler_->TickForTest();
  EXPECT_EQ(events(), first + 1);
  EXPECT_NE(Job(id).reason().find("0 idle"), std::string::npos) << Job(id).reason();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_PENDING);
}

TEST_F(SchedulerTest, ARetryableFailureRestartsFromTheCheckpointUntilTheRestartsAreSpent) {
  Start(2);
  v1::JobSpec spec = TrainSpec(2, 1);
  spec.mutable_restart()->set_max_restarts(1);
  auto job = jobs_->Submit(spec, "");
  ASSERT_TRUE(job.ok()) << job.status();
  scheduler_->TickForTest();
  Training(job->job_id());
  v1::ReportProgressRequest step;
  step.mutable_step()->set_step(4);
  step.mutable_step()->set_checkpoint("/ck/step-000004");
  ASSERT_TRUE(Report(job->job_id(), 0, step).ok());
  // Rank 1's collective broke: the job restarts and rank 0 is aborted.
  Ended(job->job_id(), 1, absl::StatusCode::kUnavailable, "connection reset");
  v1::Job j = Job(job->job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_RESTARTING);
  EXPECT_TRUE(absl::StartsWith(j.reason(), "rank 1 (worker " + j.mesh().ranks(1).worker_id())) << j.reason();
  EXPECT_TRUE(absl::StrContains(j.reason(), "restarting (restart 1 of 1) from its newest checkpoint in /ck"))
      << j.reason();
  EXPECT_EQ(j.restarts(), 1);
  scheduler_->TickForTest();  // sends the abort
  ASSERT_EQ(fake_->aborted.size(), 1u);
  EXPECT_EQ(fake_->aborted[0].request.generation(), 1);
  EXPECT_EQ(fake_->assigned.size(), 2u);  // not placed again while rank 0 still runs
  Ended(job->job_id(), 0, absl::StatusCode::kAborted, "aborted");
  scheduler_->TickForTest();
  j = Job(job->job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(j.generation(), 2);
  ASSERT_EQ(fake_->assigned.size(), 4u);
  EXPECT_EQ(fake_->assigned[2].request.generation(), 2);
  for (size_t i : {2, 3}) {  // every rank resumes, from the job's own checkpoints
    EXPECT_EQ(fake_->assigned[i].request.spec().train().resume_from(), spec.train().checkpoint_dir());
    EXPECT_TRUE(fake_->assigned[i].request.resume_own_checkpoints());
    EXPECT_EQ(fake_->assigned[i].request.job_uid(), j.uid());
  }
  // The second failure spends the restarts.
  Training(job->job_id());
  Ended(job->job_id(), 0, absl::StatusCode::kDeadlineExceeded, "collective timed out");
  j = Job(job->job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StartsWith(j.reason(), "failed after 1 restarts, all its policy allows: attempt 1: rank 1 "))
      << j.reason();
  EXPECT_TRUE(absl::StrContains(j.reason(), "connection reset; attempt 2: rank 0 ")) << j.reason();
  EXPECT_TRUE(absl::StrContains(j.reason(), "collective timed out")) << j.reason();
}

// Rank `rank`'s drained end (RankResult.drained), its worker `leaving` or not.
void DrainedEnd(v1::ReportProgressRequest* req, bool leaving) {
  req->mutable_result()->set_code(static_cast<int>(absl::StatusCode::kAborted));
  req->mutable_result()->set_message("stopped after step 4 for a drain (a worker of the job shuts down)");
  req->mutable_result()->set_drained(true);
  req->mutable_result()->set_worker_leaving(leaving);
}

// Placements refused in a row (here the cluster's: workers that do not
// answer) are tried again at once after the first, then 1 s, 2 s, 4 s ...
// after (at most the cool-off), not as fast as the workers come free: the
// history grows by two events a try. A placement taken by every rank starts
// over.
TEST_F(SchedulerTest, APlacementRefusedInARowWaitsLongerEachTime) {
  Start(8);
  for (int w = 1; w <= 8; ++w) fake_->refuse.insert(absl::StrCat("10.0.0.", w, ":7071"));
  auto job = jobs_->Submit(TrainSpec(1, 1), "");
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  scheduler_->TickForTest();
  ASSERT_EQ(Job(id).generation(), 1);
  scheduler_->TickForTest();  // at once after the first
  ASSERT_EQ(Job(id).generation(), 2);
  EXPECT_TRUE(absl::StrContains(Job(id).reason(), "; the next try in 1s (2 placements refused in a row)"))
      << Job(id).reason();
  for (int64_t wait : {1, 2, 4}) {
    SCOPED_TRACE(absl::StrCat("a wait of ", wait, " s"));
    const int64_t generation = Job(id).generation();
    ASSERT_EQ(Job(id).state(), v1::JOB_STATE_PENDING) << Job(id).reason();
    if (wait > 1) {
      Pass(absl::Seconds(wait - 1));
      scheduler_->TickForTest();
      EXPECT_EQ(Job(id).generation(), generation) << "placed again before its wait";
    }
    Pass(absl::Seconds(1));
    scheduler_->TickForTest();
    EXPECT_EQ(Job(id).generation(), generation + 1);
  }
  // A worker that takes it, after the next wait (8 s).
  fake_->refuse.clear();
  Pass(absl::Seconds(7));
  scheduler_->TickForTest();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_PENDING);
  Pass(absl::Seconds(1));
  scheduler_->TickForTest();
  ASSERT_EQ(Job(id).state(), v1::JOB_STATE_SCHEDULED) << Job(id).reason();
}

// A job waiting out its refusals keeps its place in the queue: a job
// submitted after it is not placed on the workers it waits for.
TEST_F(SchedulerTest, AJobWaitingOutItsRefusalsKeepsItsPlaceInTheQueue) {
  Start(6);
  for (int w = 1; w <= 6; ++w) fake_->refuse.insert(absl::StrCat("10.0.0.", w, ":7071"));
  auto first = jobs_->Submit(TrainSpec(2, 1), "");
  ASSERT_TRUE(first.ok()) << first.status();
  scheduler_->TickForTest();
  scheduler_->TickForTest();  // refused twice: 4 workers sit out, the next try in 1 s
  ASSERT_EQ(Job(first->job_id()).generation(), 2);
  fake_->refuse.clear();
  auto second = jobs_->Submit(TrainSpec(1, 1), "");
  ASSERT_TRUE(second.ok()) << second.status();
  scheduler_->TickForTest();
  EXPECT_EQ(Job(first->job_id()).generation(), 2);
  EXPECT_EQ(Job(second->job_id()).state(), v1::JOB_STATE_PENDING) << "behind the first, which fits the 2 idle";
  EXPECT_EQ(Job(second->job_id()).generation(), 0);
  Pass(absl::Seconds(1));
  scheduler_->TickForTest();
  EXPECT_EQ(Job(first->job_id()).state(), v1::JOB_STATE_SCHEDULED) << Job(first->job_id()).reason();
  EXPECT_EQ(Job(second->job_id()).state(), v1::JOB_STATE_PENDING);
}

// A placement every rank took starts the count of refused ones afresh: a
// job placed again after each drain, twice refused each time by workers
// that say it cannot run (max_placements 3), is not failed by refusals
// spread over its run, only by three in a row.
TEST_F(SchedulerTest, APlacementEveryRankTookStartsTheCountOfRefusalsAfresh) {
  Start(3);
  v1::JobSpec spec = TrainSpec(2, 1);
  spec.mutable_restart()->set_max_restarts(1);
  auto job = jobs_->Submit(spec, "");
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  fake_->refusal = absl::InvalidArgumentError("an older worker");
  const std::set<std::string> everyone = {"10.0.0.1:7071", "10.0.0.2:7071", "10.0.0.3:7071"};
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    fake_->refuse = everyone;
    if (round == 0) {
      scheduler_->TickForTest();  // placed, refused
    } else {                      // drained: placed again, refused
      v1::ReportProgressRequest drained;
      DrainedEnd(&drained, /*leaving=*/true);
      ASSERT_TRUE(Report(id, 1, drained).ok());
      DrainedEnd(&drained, /*leaving=*/false);
      ASSERT_TRUE(Report(id, 0, drained).ok());
      scheduler_->TickForTest();
    }
    ASSERT_EQ(Job(id).state(), v1::JOB_STATE_PENDING) << Job(id).reason();
    Pass(absl::Seconds(31));  // the refusing workers' cool-off
    scheduler_->TickForTest();
    ASSERT_EQ(Job(id).state(), v1::JOB_STATE_PENDING) << Job(id).reason();
    EXPECT_TRUE(absl::StrContains(Job(id).reason(), "(placement 3 of 3)")) << Job(id).reason();
    Pass(absl::Seconds(31));
    fake_->refuse.clear();
    scheduler_->TickForTest();
    ASSERT_EQ(Job(id).state(), v1::JOB_STATE_SCHEDULED) << Job(id).reason();
    Training(id);
    ASSERT_NO_FATAL_FAILURE(Checkpointed(id, 2 * (round + 1)));
  }
  // Three in a row fail it.
  fake_->refuse = everyone;
  v1::ReportProgressRequest drained;
  DrainedEnd(&drained, /*leaving=*/true);
  ASSERT_TRUE(Report(id, 1, drained).ok());
  DrainedEnd(&drained, /*leaving=*/false);
  ASSERT_TRUE(Report(id, 0, drained).ok());
  for (int placement = 1; placement <= 3; ++placement) {
    scheduler_->TickForTest();
    Pass(absl::Seconds(31));
  }
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StartsWith(Job(id).reason(), "every placement was refused: ")) << Job(id).reason();
}

// A job that saves checkpoints, on workers that all drain, is assigned with
// drain set. A drain ends no rank: each stops on its own, and once all
// ended (rank 1's worker the one leaving) the job is placed again from the
// checkpoint rank 0 reported, its restarts not counted, not on the leaving
// worker (it sits out the cool-off); a peer that does not end within the
// stop grace is aborted then.
TEST_F(SchedulerTest, ADrainedJobIsPlacedAgainFromItsCheckpointWithoutTheLeavingWorker) {
  Start(3);
  const std::string id = PlaceTraining(/*max_restarts=*/1);
  ASSERT_FALSE(id.empty());
  const v1::JobSpec spec = Job(id).spec();
  ASSERT_EQ(fake_->assigned.size(), 2u);
  for (const auto& c : fake_->assigned) {
    EXPECT_TRUE(c.request.drain());
    EXPECT_TRUE(c.request.agree_on_resume());
  }
  const std::string leaving = Job(id).mesh().ranks(1).worker_address();
  ASSERT_NO_FATAL_FAILURE(Checkpointed(id, 4));
  v1::ReportProgressRequest drained;
  DrainedEnd(&drained, /*leaving=*/true);
  ASSERT_TRUE(Report(id, 1, drained).ok());
  scheduler_->TickForTest();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING) << "rank 0 still saves";
  EXPECT_TRUE(fake_->aborted.empty()) << "no rank is aborted";
  DrainedEnd(&drained, /*leaving=*/false);
  ASSERT_TRUE(Report(id, 0, drained).ok());
  scheduler_->TickForTest();
  v1::Job j = Job(id);
  ASSERT_EQ(j.state(), v1::JOB_STATE_SCHEDULED) << j.reason();
  EXPECT_EQ(j.restarts(), 0) << "a drain is not counted against the job";
  EXPECT_EQ(j.generation(), 2);
  EXPECT_TRUE(fake_->aborted.empty());
  EXPECT_TRUE(RequeuedSaying(id, {"rank 1 (worker ", " shuts down: stopped after step 4",
                                  "placing the job again from that checkpoint (a drain, not counted"}))
      << "the PENDING event names the leaving rank and the drain";
  ASSERT_EQ(fake_->assigned.size(), 4u);
  for (size_t i : {2, 3}) {
    EXPECT_NE(fake_->assigned[i].address, leaving) << "the leaving worker sits out";
    EXPECT_TRUE(fake_->assigned[i].request.resume_own_checkpoints());
    EXPECT_EQ(fake_->assigned[i].request.spec().train().resume_from(), spec.train().checkpoint_dir());
  }
  // Rank 1 drains again after step 6; rank 0 never ends (its worker
  // heartbeats busy with it): aborted after the stop grace.
  Training(id);
  ASSERT_NO_FATAL_FAILURE(Checkpointed(id, 6));
  DrainedEnd(&drained, /*leaving=*/true);
  ASSERT_TRUE(Report(id, 1, drained).ok());
  const v1::Job second = Job(id);
  int stuck = -1;
  for (int w = 0; w < 3; ++w) stuck = second.mesh().ranks(0).worker_id() == ids_[w] ? w : stuck;
  ASSERT_GE(stuck, 0);
  v1::WorkerStatus busy;
  busy.set_state(v1::WORKER_STATE_BUSY);
  busy.set_job_id(id);
  busy.set_generation(2);
  busy.set_rank(0);
  for (absl::Duration left = Scheduler::Options().stop_grace; left > absl::ZeroDuration(); left -= absl::Seconds(1)) {
    clock_.Advance(absl::Seconds(1));
    for (int w = 0; w < 3; ++w) w == stuck ? Beat(w, busy) : Beat(w);
  }
  registry_.Sweep();
  scheduler_->TickForTest();
  ASSERT_EQ(fake_->aborted.size(), 1u);
  EXPECT_EQ(fake_->aborted[0].request.generation(), 2);
  Ended(id, 0, absl::StatusCode::kAborted, "aborted");
  scheduler_->TickForTest();
  EXPECT_EQ(Job(id).restarts(), 0);
  EXPECT_TRUE(RequeuedSaying(id, {"the ranks that had not ended 2m later were stopped"}));
  // A placement that resumed from an older checkpoint than the job's step
  // (step 4, the job at 6: the newest was lost) drains with a checkpoint of
  // step 5: progress, not counted.
  Pass(absl::Seconds(31));
  scheduler_->TickForTest();
  ASSERT_EQ(Job(id).state(), v1::JOB_STATE_SCHEDULED);
  const auto resumed_at = [&](int64_t resumed) {
    for (int r = 0; r < 2; ++r) {
      v1::ReportProgressRequest req;
      req.mutable_status()->set_phase(v1::RANK_PHASE_TRAINING);
      req.mutable_status()->set_resumed_step(resumed);
      req.mutable_status()->set_resumed_from(absl::StrFormat("/ck/step-%06d", resumed));
      ASSERT_TRUE(Report(id, r, req).ok());
    }
  };
  ASSERT_NO_FATAL_FAILURE(resumed_at(4));
  ASSERT_NO_FATAL_FAILURE(Checkpointed(id, 5));
  for (int r : {0, 1}) {
    DrainedEnd(&drained, /*leaving=*/r == 1);
    ASSERT_TRUE(Report(id, r, drained).ok());
  }
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_PENDING) << Job(id).reason();
  EXPECT_EQ(Job(id).restarts(), 0);
  // A drain that saved no checkpoint past the one its placement resumed
  // from: a failure, counted (no worker requeues a job for ever).
  Pass(absl::Seconds(31));
  scheduler_->TickForTest();
  ASSERT_EQ(Job(id).state(), v1::JOB_STATE_SCHEDULED);
  ASSERT_NO_FATAL_FAILURE(resumed_at(5));
  for (int r : {0, 1}) {
    DrainedEnd(&drained, /*leaving=*/r == 1);
    ASSERT_TRUE(Report(id, r, drained).ok());
  }
  const v1::Job failed = Job(id);
  EXPECT_EQ(failed.state(), v1::JOB_STATE_RESTARTING) << failed.reason();
  EXPECT_EQ(failed.restarts(), 1);
  EXPECT_TRUE(absl::StrContains(failed.reason(), "(a drain that saved no new checkpoint)")) << failed.reason();
}

// A drain whose leaving worker's end was never delivered (the worker left
// first): its peers drained, so its rank saved with them; the job is placed
// again from the drain's checkpoint, not counted.
TEST_F(SchedulerTest, ADrainWhoseLeavingRanksEndWasLostStillPlacesTheJobAgain) {
  Start(3);
  const std::string id = PlaceTraining(/*max_restarts=*/0);
  ASSERT_FALSE(id.empty());
  ASSERT_NO_FATAL_FAILURE(Checkpointed(id, 4));
  v1::ReportProgressRequest drained;
  DrainedEnd(&drained, /*leaving=*/false);
  ASSERT_TRUE(Report(id, 0, drained).ok());
  int leaving = -1;
  for (int w = 0; w < 3; ++w) leaving = Job(id).mesh().ranks(1).worker_id() == ids_[w] ? w : leaving;
  ASSERT_GE(leaving, 0);
  ASSERT_TRUE(registry_.Deregister(ids_[leaving], "the worker is shutting down").ok());
  scheduler_->TickForTest();
  const v1::Job j = Job(id);
  EXPECT_EQ(j.restarts(), 0);
  EXPECT_NE(j.state(), v1::JOB_STATE_FAILED) << j.reason();
  EXPECT_TRUE(
      RequeuedSaying(id, {"was lost: left: the worker is shutting down", "(a drain, not counted against the job)"}));
}

// A job with a rank on an older worker (which would not join the drain's
// collective, nor a resume's agreement) or with no checkpoint_dir is not
// drained, and a drained end
// claimed there counts as the failure it is.
TEST_F(SchedulerTest, AJobOnAWorkerThatDoesNotDrainIsNotDrained) {
  no_drain_ = {1};
  Start(2);
  auto job = jobs_->Submit(TrainSpec(2, 1), "");
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  scheduler_->TickForTest();
  ASSERT_EQ(fake_->assigned.size(), 2u);
  for (const auto& c : fake_->assigned) {
    EXPECT_FALSE(c.request.drain());
    EXPECT_FALSE(c.request.agree_on_resume());  // nor does it join the resume's agreement
  }
  Training(id);
  v1::ReportProgressRequest drained;
  DrainedEnd(&drained, /*leaving=*/true);
  ASSERT_TRUE(Report(id, 0, drained).ok());
  const v1::Job j = Job(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RESTARTING) << j.reason();
  EXPECT_EQ(j.restarts(), 1);
  // No checkpoint_dir: not drained either.
  v1::JobSpec unsaved = TrainSpec(1, 1);
  unsaved.mutable_train()->clear_checkpoint_dir();
  unsaved.mutable_train()->set_checkpoint_every(0);
  no_drain_.clear();
  auto other = jobs_->Submit(unsaved, "");
  ASSERT_TRUE(other.ok()) << other.status();
  fake_->assigned.clear();
  Pass(absl::Seconds(31));
  scheduler_->TickForTest();
  bool found = false;
  for (const auto& c : fake_->assigned) {
    if (c.request.job_id() != other->job_id()) continue;
    found = true;
    EXPECT_FALSE(c.request.drain());
  }
  EXPECT_TRUE(found);
}

// An uploaded model goes only to the workers placed in a job that uses it:
// a download carrying the key of one of its ranks' workers is served; one
// carrying another worker's key or none, or of an upload no placed job
// uses, is PERMISSION_DENIED (the workers' token is every worker's). A job
// with a rank on an older worker, whose downloads carry no key, serves its
// upload to the token alone.
TEST_F(SchedulerTest, AnUploadGoesOnlyToTheWorkersPlacedInAJobThatUsesIt) {
  keys_ = {std::string(32, 'a'), std::string(32, 'b'), std::string(32, 'c'), std::string(32, 'd')};
  keyless_downloads_ = {3};
  Start(4);
  const auto carrying = [](const std::string& carried) {
    return [carried](absl::string_view key) { return key == carried; };
  };
  v1::JobSpec spec = TrainSpec(2, 1);
  spec.mutable_model()->clear_weights_path();
  spec.mutable_model()->set_upload_id("upload-000001");
  auto job = jobs_->Submit(spec, "");
  ASSERT_TRUE(job.ok()) << job.status();
  const absl::Status unplaced = scheduler_->CheckDownloadCaller("upload-000001", carrying(keys_[0]));
  EXPECT_EQ(unplaced.code(), absl::StatusCode::kPermissionDenied) << unplaced;
  EXPECT_TRUE(absl::StrContains(unplaced.message(), "no job placed now uses upload 'upload-000001'")) << unplaced;
  scheduler_->TickForTest();
  const v1::MeshSpec mesh = Job(job->job_id()).mesh();
  ASSERT_EQ(mesh.ranks_size(), 2);
  std::set<std::string> placed;
  for (const v1::RankAssignment& a : mesh.ranks()) {
    placed.insert(KeyOf(a.worker_id()));
    EXPECT_TRUE(scheduler_->CheckDownloadCaller("upload-000001", carrying(KeyOf(a.worker_id()))).ok());
  }
  ASSERT_EQ(placed.count(keys_[3]), 0u) << "placed on the older worker: the test means another";
  for (const std::string& key : keys_) {
    if (placed.count(key)) continue;
    const absl::Status other = scheduler_->CheckDownloadCaller("upload-000001", carrying(key));
    EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied) << other;
    EXPECT_TRUE(absl::StrContains(other.message(), "carries the key of none of the workers placed in the jobs"))
        << other;
  }
  EXPECT_EQ(scheduler_->CheckDownloadCaller("upload-000001", carrying("")).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(scheduler_->CheckDownloadCaller("upload-000002", carrying(keys_[0])).code(),
            absl::StatusCode::kPermissionDenied);
  // A second job on the older worker and another: its upload goes to
  // anyone with the token, the first job's still to its workers only.
  v1::JobSpec second = TrainSpec(2, 1);  // a checkpoint directory of its own
  second.mutable_model()->clear_weights_path();
  second.mutable_model()->set_upload_id("upload-000002");
  auto old_job = jobs_->Submit(second, "");
  ASSERT_TRUE(old_job.ok()) << old_job.status();
  scheduler_->TickForTest();
  const v1::MeshSpec old_mesh = Job(old_job->job_id()).mesh();
  ASSERT_EQ(old_mesh.ranks_size(), 2);
  std::set<std::string> old_placed;
  for (const v1::RankAssignment& a : old_mesh.ranks()) old_placed.insert(KeyOf(a.worker_id()));
  ASSERT_EQ(old_placed.count(keys_[3]), 1u);
  EXPECT_TRUE(scheduler_->CheckDownloadCaller("upload-000002", carrying("")).ok());
  EXPECT_EQ(scheduler_->CheckDownloadCaller("upload-000001", carrying("")).code(), absl::StatusCode::kPermissionDenied);
}

// Only the worker that holds a rank reports for it: a report carries the key
// its worker registered with, the one it had when the rank was placed
// (the workers' token is every worker's). Without it, PERMISSION_DENIED,
// also once that worker registered again (another id, which the registry
// would know no key of); a late step of an ended generation is recorded
// only with the key of that generation's rank 0; the placement's
// rendezvous scope takes calls carrying any of its workers' keys.
TEST_F(SchedulerTest, OnlyTheWorkerThatHoldsARankReportsForIt) {
  keys_ = {std::string(32, 'a'), std::string(32, 'b')};
  Start(2);
  v1::JobSpec spec = TrainSpec(2, 1);
  spec.mutable_restart()->set_max_restarts(1);
  auto job = jobs_->Submit(spec, "");
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  scheduler_->TickForTest();
  const v1::Job placed = Job(id);
  const std::string worker0 = placed.mesh().ranks(0).worker_id();
  const std::string key0 = KeyOf(worker0), key1 = KeyOf(placed.mesh().ranks(1).worker_id());
  ASSERT_FALSE(key0.empty());
  // Each assignment carries its rank's worker's key: a daemon restarted at
  // its address since refuses it.
  {
    absl::MutexLock lock(&fake_->mu_);
    ASSERT_EQ(fake_->assigned.size(), 2u);
    for (const auto& c : fake_->assigned) {
      EXPECT_EQ(c.key, c.request.rank() == 0 ? key0 : key1) << c.address;
      EXPECT_EQ(c.address, placed.mesh().ranks(c.request.rank()).worker_address());
    }
  }
  const auto carrying = [](const std::string& carried) {
    return [carried](absl::string_view key) { return key == carried; };
  };
  // Its rendezvous scope takes calls from its workers only (any of them).
  const std::string scope = id + "/gen-1";
  const absl::Status stranger = scheduler_->CheckScopeCaller(scope, carrying(std::string(32, 'x')));
  EXPECT_EQ(stranger.code(), absl::StatusCode::kPermissionDenied) << stranger;
  EXPECT_TRUE(absl::StrContains(stranger.message(), "carries the key of none of the workers placed in it"))
      << stranger;
  EXPECT_TRUE(scheduler_->CheckScopeCaller(scope, carrying(key0)).ok());
  EXPECT_TRUE(scheduler_->CheckScopeCaller(scope, carrying(key1)).ok());
  EXPECT_TRUE(scheduler_->CheckScopeCaller(id + "/gen-7", carrying("")).ok());  // no placement's: the store's
  v1::ReportProgressRequest training;
  training.mutable_status()->set_phase(v1::RANK_PHASE_TRAINING);
  for (const std::string& carried : {std::string(), key1}) {
    const absl::StatusOr<bool> forged = Report(id, 0, training, carried);
    EXPECT_EQ(forged.status().code(), absl::StatusCode::kPermissionDenied) << forged.status();
    EXPECT_TRUE(absl::StrContains(forged.status().message(), "lacks the key of worker '" + worker0 + "'"))
        << forged.status();
  }
  Training(id);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  // Rank 0's daemon registers again (a reply it lost): a new id, the same
  // key. The placement still names the old id, which the registry no
  // longer has a key for; the rank's key is still asked for.
  const size_t at = std::find(ids_.begin(), ids_.end(), worker0) - ids_.begin();
  v1::WorkerInfo again;
  again.set_address("10.0.0." + std::to_string(at + 1) + ":7071");
  again.set_device_kind(v1::DEVICE_KIND_CPU);
  ASSERT_TRUE(registry_.Register(again, v1::WorkerStatus(), key0).ok());
  ASSERT_EQ(registry_.KeyOf(worker0), "");
  v1::ReportProgressRequest step;
  step.mutable_step()->set_step(2);
  step.mutable_step()->set_loss(5.0);
  step.mutable_step()->set_checkpoint("/ck/step-000002");
  EXPECT_EQ(Report(id, 0, step, "").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Job(id).step(), 0);
  ASSERT_TRUE(Report(id, 0, step, key0).ok());
  EXPECT_EQ(Job(id).step(), 2);
  // Generation 1 ends (rank 1 failed) and the job is placed again; rank 0
  // of generation 1 reports a step it kept: recorded only with its key
  // (PERMISSION_DENIED without it).
  // (Rank 0's worker registered again under another id: the tick counts
  // the rank as ended with the id it had.)
  Ended(id, 1, absl::StatusCode::kUnavailable, "connection reset");
  scheduler_->TickForTest();
  ASSERT_EQ(Job(id).generation(), 2);
  // Generation 1's abort of rank 0 carries the key its worker held when the
  // rank was placed (its new registration holds the same one).
  {
    absl::MutexLock lock(&fake_->mu_);
    int aborts = 0;
    for (const auto& c : fake_->aborted) {
      if (c.request.generation() != 1) continue;
      ++aborts;
      EXPECT_EQ(c.address, placed.mesh().ranks(0).worker_address());
      EXPECT_EQ(c.key, key0);
    }
    EXPECT_EQ(aborts, 1);
  }
  v1::ReportProgressRequest late;
  late.set_job_id(id);
  late.set_generation(1);
  late.set_rank(0);
  late.set_worker_id(worker0);
  late.mutable_step()->set_step(3);
  late.mutable_step()->set_loss(4.5);
  const absl::Status refused = scheduler_->Report(late, carrying(key1)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;  // logged as a refusal
  EXPECT_NE(refused.message().find("lacks the key of that generation's rank 0"), std::string::npos) << refused;
  EXPECT_EQ(Job(id).step(), 2);
  EXPECT_EQ(scheduler_->Report(late, carrying(key0)).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(Job(id).step(), 3);
}

// Rank 0 of a restart that resumed from the job's own checkpoints says
// from where: where the job's record is behind it (steps a coordinator
// could not write, then lost in a crash), the job's step and last
// checkpoint follow, so that a run resumed at its last step ends showing
// it; a rank other than 0, an earlier step, or the first generation's
// resume (a user's resume_from, another run's checkpoint) changes nothing.
TEST_F(SchedulerTest, TheStepRankZeroResumedFromIsTheJobsWhereTheRecordIsBehind) {
  Start(2);
  auto job = jobs_->Submit(TrainSpec(2, 1), "");
  ASSERT_TRUE(job.ok());
  const std::string id = job->job_id();
  scheduler_->TickForTest();
  v1::ReportProgressRequest step;
  step.mutable_step()->set_step(4);
  step.mutable_step()->set_loss(2.5);
  step.mutable_step()->mutable_step_duration()->set_nanos(1000);
  step.mutable_step()->set_checkpoint("/ck/step-000004");
  ASSERT_TRUE(Report(id, 0, step).ok());
  ASSERT_EQ(Job(id).step(), 4);
  const auto resumed = [&](int rank, int64_t at) {
    v1::ReportProgressRequest req;
    req.mutable_status()->set_phase(v1::RANK_PHASE_TRAINING);
    req.mutable_status()->set_resumed_step(at);
    req.mutable_status()->set_resumed_from(absl::StrCat("/ck/step-00000", at));
    ASSERT_TRUE(Report(id, rank, req).ok());
  };
  resumed(0, 9);  // the first generation's: a user's resume_from, no checkpoint of this job
  EXPECT_EQ(Job(id).step(), 4);
  EXPECT_EQ(Job(id).last_checkpoint(), "/ck/step-000004");
  // A restart, from the job's own checkpoints.
  Ended(id, 1, absl::StatusCode::kUnavailable, "connection reset");
  scheduler_->TickForTest();
  Ended(id, 0, absl::StatusCode::kAborted, "aborted");
  scheduler_->TickForTest();
  ASSERT_EQ(Job(id).generation(), 2);
  ASSERT_TRUE(fake_->assigned.back().request.resume_own_checkpoints());
  resumed(1, 9);  // not rank 0's
  EXPECT_EQ(Job(id).step(), 4);
  resumed(0, 3);  // behind the record
  EXPECT_EQ(Job(id).step(), 4);
  EXPECT_EQ(Job(id).last_checkpoint(), "/ck/step-000004");
  resumed(0, 8);
  const v1::Job j = Job(id);
  EXPECT_EQ(j.step(), 8);
  EXPECT_EQ(j.last_checkpoint(), "/ck/step-000008");
  EXPECT_EQ(j.loss(), 2.5);  // the last recorded
  bool saw = false;
  for (const v1::JobEvent& e : Events(id)) saw = saw || (e.has_rank_status() && e.rank_status().resumed_step() == 9);
  EXPECT_TRUE(saw) << "the history shows where it resumed";
}

// The MFU divides by the placed devices' peak at the precision the run
// trains at: the spec's, or where it names none the one rank 0 reports (a
// GPU run at auto that resumed an fp32 checkpoint trains at fp32, not at
// the device's bf16); another rank's report does not count, a new attempt
// starts from the spec's again, and where the spec named the precision no
// report changes it.
TEST_F(SchedulerTest, TheMfuDividesByThePeakAtThePrecisionRankZeroTrainsAt) {
  cuda_peak_.emplace();
  cuda_peak_->set_f32(50e12);
  cuda_peak_->set_tf32(400e12);
  cuda_peak_->set_bf16(800e12);
  cuda_peak_->set_f16(900e12);
  Start(2);
  const auto peak_after_step = [&](const std::string& id, int64_t step) {
    v1::ReportProgressRequest req;
    req.mutable_step()->set_step(step);
    req.mutable_step()->set_loss(2.5);
    req.mutable_step()->set_tokens(1000);
    req.mutable_step()->mutable_step_duration()->set_nanos(1000000);
    EXPECT_TRUE(Report(id, 0, req).ok());
    return Job(id).summary().peak_flops_per_second();
  };
  const auto training = [&](const std::string& id, int rank, v1::Precision precision) {
    v1::ReportProgressRequest req;
    req.mutable_status()->set_phase(v1::RANK_PHASE_TRAINING);
    req.mutable_status()->set_precision(precision);
    ASSERT_TRUE(Report(id, rank, req).ok());
  };
  auto job = jobs_->Submit(TrainSpec(2, 1), "");  // precision unspecified
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  scheduler_->TickForTest();
  ASSERT_EQ(Job(id).state(), v1::JOB_STATE_SCHEDULED);
  training(id, 0, v1::PRECISION_FP32);
  training(id, 1, v1::PRECISION_FP16_MIXED);  // not rank 0's: the peak stays fp32's
  EXPECT_EQ(peak_after_step(id, 1), 2 * 50e12);
  const v1::RunSummary sum = Job(id).summary();
  EXPECT_DOUBLE_EQ(sum.mfu(), sum.mean_tokens_per_second() * sum.model_flops_per_token() / (2 * 50e12));
  // The next attempt's rank 0 said nothing of its precision (an older
  // worker) or one this coordinator does not know (a newer worker, kept in
  // the history as unspecified): the device's default for the spec, bf16
  // on a GPU.
  Ended(id, 1, absl::StatusCode::kUnavailable, "connection reset");
  scheduler_->TickForTest();
  Ended(id, 0, absl::StatusCode::kAborted, "aborted");
  scheduler_->TickForTest();
  ASSERT_EQ(Job(id).generation(), 2);
  training(id, 0, static_cast<v1::Precision>(99));
  training(id, 1, v1::PRECISION_UNSPECIFIED);
  EXPECT_EQ(peak_after_step(id, 2), 2 * 800e12);
  for (const v1::JobEvent& e : Events(id)) {
    if (e.has_rank_status()) {
      EXPECT_TRUE(v1::Precision_IsValid(e.rank_status().precision())) << e.DebugString();
    }
  }
  for (int r = 0; r < 2; ++r) Ended(id, r, absl::StatusCode::kOk);
  ASSERT_EQ(Job(id).state(), v1::JOB_STATE_SUCCEEDED);

  // A spec that names fp32 with TF32 allowed: that peak, whatever is reported.
  v1::JobSpec tf32 = TrainSpec(2, 1);
  tf32.mutable_train()->set_precision(v1::PRECISION_FP32);
  tf32.mutable_train()->set_allow_tf32(true);
  job = jobs_->Submit(tf32, "");
  ASSERT_TRUE(job.ok()) << job.status();
  scheduler_->TickForTest();
  training(job->job_id(), 0, v1::PRECISION_BF16_MIXED);
  EXPECT_EQ(peak_after_step(job->job_id(), 1), 2 * 400e12);
}

TEST_F(SchedulerTest, AnErrorOfTheJobItselfIsNotRetried) {
  Start(2);
  auto job = jobs_->Submit(TrainSpec(2, 1), "");  // the default policy: 3 restarts
  ASSERT_TRUE(job.ok());
  scheduler_->TickForTest();
  Ended(job->job_id(), 0, absl::StatusCode::kNotFound, "spec.train.data_path: no such file");
  const v1::Job j = Job(job->job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::EndsWith(j.reason(), "no such file (not restarted: an error of the job itself)")) << j.reason();
  EXPECT_EQ(j.restarts(), 0);
}

// A rank that failed by its worker's own fault (its --work-dir full: the
// code is RESOURCE_EXHAUSTED, which by itself is the job's and not
// retried) restarts the job on the other workers; its worker is given no
// job for the refusal cool-off, then takes jobs again. With the same code
// unmarked, the job fails (AnErrorOfTheJobItselfIsNotRetried). Failed at
// once, and (as the daemon runs) after its peers were probed.
TEST_F(SchedulerTest, AWorkersOwnFaultRestartsTheJobWithoutThatWorkerForTheCoolOff) {
  Scheduler::Options o;
  o.probe_timeout = absl::ZeroDuration();  // failed at once
  WorkerFaultRestartsTheJobElsewhere(o);
}

// A second worker failing by its own fault in one job (an upload larger
// than every worker's disk) makes it the job's: it fails, not passed from
// worker to worker up to its max_restarts; both workers sit out.
TEST_F(SchedulerTest, ASecondWorkerFaultInAJobIsTakenAsTheJobsOwn) {
  Scheduler::Options o;
  o.probe_timeout = absl::ZeroDuration();
  Start(4, o);
  auto job = jobs_->Submit(TrainSpec(2, 1), "");  // the default policy: 3 restarts
  ASSERT_TRUE(job.ok());
  const std::string id = job->job_id();
  const auto disk_full = [&](int rank) {
    v1::ReportProgressRequest req;
    req.mutable_result()->set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
    req.mutable_result()->set_message("No space left on device");
    req.mutable_result()->set_worker_fault(true);
    ASSERT_TRUE(Report(id, rank, req).ok());
  };
  scheduler_->TickForTest();
  Training(id);
  const std::string first = Job(id).mesh().ranks(1).worker_address();
  disk_full(1);
  ASSERT_EQ(Job(id).state(), v1::JOB_STATE_RESTARTING);
  scheduler_->TickForTest();
  Ended(id, 0, absl::StatusCode::kAborted, "aborted");
  scheduler_->TickForTest();
  ASSERT_EQ(Job(id).generation(), 2);
  Training(id);
  const std::string second = Job(id).mesh().ranks(0).worker_address();
  ASSERT_NE(second, first);
  disk_full(0);
  const v1::Job j = Job(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED) << j.reason();
  EXPECT_TRUE(absl::StrContains(j.reason(), "the second worker to fail so in this job, taken as the job's own"))
      << j.reason();
  EXPECT_EQ(j.restarts(), 1);
  // Both sit out: a job of 3 ranks does not fit on the 2 workers left.
  scheduler_->TickForTest();
  Ended(id, 1, absl::StatusCode::kAborted, "aborted");
  v1::JobSpec wide = TrainSpec(1, 3);
  wide.mutable_train()->set_batch_size(3);
  auto next = jobs_->Submit(wide, "");
  ASSERT_TRUE(next.ok()) << next.status();
  scheduler_->TickForTest();
  EXPECT_EQ(Job(next->job_id()).state(), v1::JOB_STATE_PENDING);
  EXPECT_TRUE(absl::StrContains(Job(next->job_id()).reason(),
                                "2 idle; 2 of the workers not idle sit out a refusal or a fault of their own (30s)"))
      << Job(next->job_id()).reason();
}

TEST_F(SchedulerTest, AWorkersOwnFaultRestartsTheJobElsewhereAfterTheProbe) {
  Scheduler::Options o;
  o.probe_timeout = absl::Seconds(1);
  WorkerFaultRestartsTheJobElsewhere(o);
}

TEST_F(SchedulerTest, ALostWorkerRestartsTheJobWhichWaitsForWorkersUpToItsDeadline) {
  Start(4);
  v1::JobSpec spec = TrainSpec(2, 2);
  *spec.mutable_restart()->mutable_worker_wait() = ToProtoDuration(absl::Minutes(1));
  auto job = jobs_->Submit(spec, "");
  ASSERT_TRUE(job.ok());
  scheduler_->TickForTest();
  Training(job->job_id());
  const v1::MeshSpec mesh = Job(job->job_id()).mesh();
  // Worker of rank 3 stops heartbeating; the others go on.
  int lost = -1;
  for (int w = 0; w < 4; ++w) lost = mesh.ranks(3).worker_id() == ids_[w] ? w : lost;
  Pass(absl::Seconds(6), lost);
  scheduler_->TickForTest();
  v1::Job j = Job(job->job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_RESTARTING);
  EXPECT_TRUE(absl::StartsWith(j.reason(), "rank 3 (worker " + ids_[lost])) << j.reason();
  EXPECT_TRUE(absl::StrContains(j.reason(), "was lost: no heartbeat within 5s")) << j.reason();
  EXPECT_EQ(fake_->aborted.size(), 3u);  // ranks 0-2
  for (int r = 0; r < 3; ++r) Ended(job->job_id(), r, absl::StatusCode::kAborted);
  scheduler_->TickForTest();
  j = Job(job->job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_RESTARTING);  // 3 workers for 4 ranks
  EXPECT_TRUE(absl::StrContains(j.reason(), "restarting (restart 1 of 3): waiting for workers: needs 4 workers of one device kind; "
                                            "3 registered (3 cpu, 0 cuda), 3 idle"))
      << j.reason();
  // Generation 1 ended without the lost rank's end: if it still runs, its
  // rendezvous scope is closed to it (nothing it sets would ever be dropped).
  EXPECT_EQ(store_.Set(job->job_id() + "/gen-1", "late", "x").code(), absl::StatusCode::kCancelled);
  Pass(absl::Seconds(61), lost);
  scheduler_->TickForTest();
  j = Job(job->job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StartsWith(j.reason(), "no 4 workers of one device kind came free within 1m to restart it; "
                                           "attempt 1: rank 3 "))
      << j.reason();
}

// A rank that never ends after its abort, its worker heartbeating busy with
// it (a rank stuck in its own end): the restart waits for it only
// Options::stop_grace, then places the job again on the workers that are
// free, never on the stuck one; the stuck worker's stale rank is aborted
// once more.
TEST_F(SchedulerTest, ARankThatNeverEndsAfterItsAbortIsGivenUpOnAfterTheStopGrace) {
  std::string id;
  ASSERT_NO_FATAL_FAILURE(RestartingJob(absl::Minutes(1), &id));
  const v1::MeshSpec first = Job(id).mesh();
  int stuck = -1;
  for (int w = 0; w < 3; ++w) stuck = first.ranks(0).worker_id() == ids_[w] ? w : stuck;
  ASSERT_GE(stuck, 0);
  v1::WorkerStatus busy;
  busy.set_state(v1::WORKER_STATE_BUSY);
  busy.set_job_id(id);
  busy.set_generation(1);
  busy.set_rank(0);
  auto pass = [&](absl::Duration d) {  // every worker heartbeats; the stuck one busy
    for (absl::Duration left = d; left > absl::ZeroDuration(); left -= absl::Seconds(1)) {
      clock_.Advance(std::min(left, absl::Seconds(1)));
      for (int w = 0; w < 3; ++w) w == stuck ? Beat(w, busy) : Beat(w);
    }
    registry_.Sweep();
    scheduler_->TickForTest();
  };
  pass(absl::Seconds(59));
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(fake_->assigned.size(), 2u);  // still waiting for rank 0
  pass(absl::Seconds(2));
  const v1::Job j = Job(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(j.generation(), 2);
  ASSERT_EQ(fake_->assigned.size(), 4u);
  for (size_t i = 2; i < 4; ++i) {
    EXPECT_EQ(fake_->assigned[i].request.generation(), 2);
    EXPECT_NE(fake_->assigned[i].address, first.ranks(0).worker_address());
  }
  // The stuck worker, still running generation 1, is told to stop again
  // (at the next tick: the one that gave up placed generation 2 after its
  // look at stale ranks).
  scheduler_->TickForTest();
  ASSERT_EQ(fake_->aborted.size(), 2u);
  EXPECT_EQ(fake_->aborted[1].address, first.ranks(0).worker_address());
  EXPECT_EQ(fake_->aborted[1].request.generation(), 1);
  // Generation 1's rendezvous scope stays aborted (its data dropped): the
  // stuck rank, if it comes back, finds it closed rather than open again.
  EXPECT_EQ(store_.Set(id + "/gen-1", "late", "x").code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(store_.Set(id + "/gen-2", "k", "x").ok());
}

// With stop_grace zero the restart waits for every rank's end, however long.
TEST_F(SchedulerTest, AZeroStopGraceWaitsForEveryRank) {
  std::string id;
  ASSERT_NO_FATAL_FAILURE(RestartingJob(absl::ZeroDuration(), &id));
  Pass(absl::Hours(1));
  scheduler_->TickForTest();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(fake_->assigned.size(), 2u);
  Ended(id, 0, absl::StatusCode::kAborted, "aborted");
  scheduler_->TickForTest();
  EXPECT_EQ(Job(id).generation(), 2);
}

TEST_F(SchedulerTest, ARefusedAssignmentPlacesTheJobAgainWithoutTheRefusingWorkerUntilItsCoolOff) {
  Start(3);
  fake_->refuse.insert("10.0.0.2:7071");
  auto job = jobs_->Submit(TrainSpec(2, 1), "");
  ASSERT_TRUE(job.ok());
  scheduler_->TickForTest();
  v1::Job j = Job(job->job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_SCHEDULED);  // rank 0 started; it is being stopped
  // The abort goes out in this tick or the next (the assignments answer on
  // a thread of their own), and once.
  scheduler_->TickForTest();
  ASSERT_EQ(fake_->aborted.size(), 1u);
  EXPECT_EQ(fake_->aborted[0].address, "10.0.0.1:7071");
  Ended(job->job_id(), 0, absl::StatusCode::kAborted);
  j = Job(job->job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_PENDING);
  EXPECT_TRUE(absl::StrContains(j.reason(), "refused the assignment: UNAVAILABLE: stopped; placing the job again "
                                            "without the refusing worker (the cluster's refusal"))
      << j.reason();
  fake_->refuse.clear();
  scheduler_->TickForTest();
  j = Job(job->job_id());
  EXPECT_EQ(j.generation(), 2);
  for (const v1::RankAssignment& a : j.mesh().ranks()) EXPECT_NE(a.worker_address(), "10.0.0.2:7071");
  Training(job->job_id());
  for (int r = 0; r < 2; ++r) Ended(job->job_id(), r, absl::StatusCode::kOk);
  // After its 30 s cool-off the worker takes jobs again.
  ExpectAJobOfThreeWorkersIsPlacedAfterTheCoolOff();
}

// Refusals of the cluster's (no answer) never fail the job, however many;
// a worker saying the job cannot run does, at the third placement.
TEST_F(SchedulerTest, OnlyRefusalsOfTheJobsOwnCountAgainstItsPlacements) {
  Start(1);
  fake_->refuse.insert("10.0.0.1:7071");
  auto job = jobs_->Submit(TrainSpec(1, 1), "");
  ASSERT_TRUE(job.ok());
  for (int placement = 1; placement <= 5; ++placement) {
    scheduler_->TickForTest();  // placed, refused: nothing started, so it is pending again at once
    const v1::Job j = Job(job->job_id());
    ASSERT_EQ(j.state(), v1::JOB_STATE_PENDING) << "placement " << placement << ": " << j.reason();
    EXPECT_EQ(j.generation(), placement);
    Pass(absl::Seconds(31));  // the worker's cool-off
  }
  fake_->refusal = absl::InvalidArgumentError("rank: 3 is outside the mesh");
  for (int placement = 1; placement <= 3; ++placement) {
    scheduler_->TickForTest();
    Pass(absl::Seconds(31));
  }
  const v1::Job j = Job(job->job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StartsWith(j.reason(), "every placement was refused: rank 0 "));
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(j.reason(), "INVALID_ARGUMENT")).size() - 1, 3u) << j.reason();
  EXPECT_FALSE(absl::StrContains(j.reason(), "UNAVAILABLE")) << j.reason();
}

// A placement stopped while its assignments are on their way (here the job
// is cancelled) sends its aborts at once; a worker that gets the abort
// first refuses the assignment (ABORTED). That refusal is no fault of the
// worker's: it sits out no cool-off, and the rank counts as ended, so the
// workers take the next job at once.
TEST_F(SchedulerTest, AnAssignmentOvertakenByItsAbortCostsTheWorkerNoCoolOff) {
  Start(2);
  const std::string id = jobs_->Submit(TrainSpec(2, 1), "")->job_id();
  fake_->during_assign = [&] { EXPECT_TRUE(scheduler_->Cancel(id, "not wanted").ok()); };
  fake_->refuse = {"10.0.0.1:7071", "10.0.0.2:7071"};
  fake_->refusal = absl::AbortedError(
      "generation 1 of job 'job-000001' no longer runs: this worker was told to abort "
      "its generation 1 before this assignment arrived");
  scheduler_->TickForTest();
  fake_->during_assign = nullptr;
  fake_->refuse.clear();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(fake_->assigned.size(), 2u);
  const std::string next = jobs_->Submit(TrainSpec(2, 1), "")->job_id();
  scheduler_->TickForTest();
  EXPECT_EQ(Job(next).state(), v1::JOB_STATE_SCHEDULED) << Job(next).reason();
  EXPECT_EQ(fake_->assigned.size(), 4u);
}

// An ABORTED answer to a placement that is not stopping (a worker that saw
// a later generation of the job) is a refusal like any other: the job is
// placed again, and the worker sits out its cool-off.
TEST_F(SchedulerTest, AnAbortedAnswerToARunningPlacementIsARefusal) {
  Start(1);
  fake_->refuse = {"10.0.0.1:7071"};
  fake_->refusal = absl::AbortedError(
      "generation 1 of job 'job-000001' no longer runs: this worker ran its "
      "generation 2");
  const std::string id = jobs_->Submit(TrainSpec(1, 1), "")->job_id();
  scheduler_->TickForTest();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_PENDING);
  fake_->refuse.clear();
  scheduler_->TickForTest();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_PENDING) << "placed on a worker in its cool-off";
  EXPECT_TRUE(absl::StrContains(Job(id).reason(), "sits out a refusal")) << Job(id).reason();
  Pass(absl::Seconds(31));
  scheduler_->TickForTest();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_SCHEDULED) << Job(id).reason();
}

TEST_F(SchedulerTest, RanksGoOnlyToWorkersWithTheMemoryTheyNeed) {
  const int64_t need = RankMemoryFloorBytes(TrainSpec(1, 1));
  ASSERT_GT(need, 0);
  Start(2, Scheduler::Options(), {need - 1, need});
  auto first = jobs_->Submit(TrainSpec(1, 1), "");
  auto second = jobs_->Submit(TrainSpec(1, 1), "");
  ASSERT_TRUE(first.ok() && second.ok());
  scheduler_->TickForTest();
  const v1::Job j = Job(first->job_id());
  ASSERT_EQ(j.state(), v1::JOB_STATE_SCHEDULED) << j.reason();
  EXPECT_EQ(j.mesh().ranks(0).worker_address(), "10.0.0.2:7071");
  const v1::Job waiting = Job(second->job_id());
  EXPECT_EQ(waiting.state(), v1::JOB_STATE_PENDING);
  EXPECT_TRUE(absl::StrContains(waiting.reason(), "needs 1 workers of one device kind with "));
  EXPECT_TRUE(absl::StrContains(waiting.reason(), "1 registered that have it (1 cpu, 0 cuda), 0 idle; "
                                                  "1 more with less memory"))
      << waiting.reason();
}

TEST_F(SchedulerTest, ReportsAHangOncePerCollective) {
  Scheduler::Options o;
  o.hang_threshold = absl::Seconds(5);
  Start(2, o);
  auto job = jobs_->Submit(TrainSpec(2, 1), "");
  ASSERT_TRUE(job.ok());
  scheduler_->TickForTest();
  Training(job->job_id());
  const v1::Job j = Job(job->job_id());
  auto status = [&](int rank, int64_t entered, int64_t pending) {
    v1::WorkerStatus s;
    s.set_state(v1::WORKER_STATE_BUSY);
    s.set_job_id(job->job_id());
    s.set_rank(rank);
    s.set_generation(j.generation());
    v1::CollectiveProgress* p = s.add_collectives();
    p->set_group("tp/0_1");
    p->set_entered(entered);
    if (pending > 0) {
      p->set_pending_sequence(pending);
      p->set_pending_op("all_reduce");
      *p->mutable_pending_for() = ToProtoDuration(absl::Seconds(4));
    }
    return s;
  };
  int w0 = j.mesh().ranks(0).worker_id() == ids_[0] ? 0 : 1;
  Beat(w0, status(0, 8, 8));      // rank 0 waits in #8
  Beat(1 - w0, status(1, 7, 0));  // rank 1 never entered it
  scheduler_->TickForTest();
  EXPECT_TRUE(Job(job->job_id()).stalled().empty());  // 4 s < 5 s
  clock_.Advance(absl::Seconds(2));  // the pending collective aged since its heartbeat
  scheduler_->TickForTest();
  scheduler_->TickForTest();  // once only
  const v1::Job stalled = Job(job->job_id());
  EXPECT_TRUE(absl::StartsWith(stalled.stalled(), "collective #8 (all_reduce) of group tp/0_1 pending for 6s on ranks 0; "
                                                  "not entered by rank 1 (worker "))
      << stalled.stalled();
  int hangs = 0;
  for (const v1::JobEvent& e : Events(job->job_id())) hangs += e.has_hang();
  EXPECT_EQ(hangs, 1);
  EXPECT_EQ(jobs_->HangCount(), 1);
}

// On an asynchronous engine (NCCL) a rank enqueues collectives ahead of the
// device: a rank stopped after enqueueing one has "entered" it, and the first
// report names nobody. Once that rank's silence passes the threshold the
// same collective is reported again, naming it; then no more.
TEST_F(SchedulerTest, ReportsAHangAgainWhenARankFallsSilent) {
  Scheduler::Options o;
  o.hang_threshold = absl::Seconds(2);
  Start(2, o);
  auto job = jobs_->Submit(TrainSpec(2, 1), "");
  ASSERT_TRUE(job.ok());
  scheduler_->TickForTest();
  Training(job->job_id());
  const v1::Job j = Job(job->job_id());
  auto status = [&](int rank) {
    v1::WorkerStatus s;
    s.set_state(v1::WORKER_STATE_BUSY);
    s.set_job_id(job->job_id());
    s.set_rank(rank);
    s.set_generation(j.generation());
    v1::CollectiveProgress* p = s.add_collectives();
    p->set_group("tp/0_1");
    p->set_entered(8);
    p->set_pending_sequence(8);
    p->set_pending_op("all_reduce");
    *p->mutable_pending_for() = ToProtoDuration(absl::Seconds(4));
    return s;
  };
  const int w0 = j.mesh().ranks(0).worker_id() == ids_[0] ? 0 : 1;
  Beat(w0, status(0));
  Beat(1 - w0, status(1));  // its last heartbeat
  scheduler_->TickForTest();
  EXPECT_TRUE(absl::StrContains(Job(job->job_id()).stalled(), "every rank of the group entered it"))
      << Job(job->job_id()).stalled();
  clock_.Advance(absl::Seconds(3));  // within the lease
  Beat(w0, status(0));  // rank 0 reports on; rank 1 has been silent 3 s
  scheduler_->TickForTest();
  scheduler_->TickForTest();  // once only
  const v1::Job stalled = Job(job->job_id());
  EXPECT_TRUE(absl::StrContains(stalled.stalled(), "collective #8 (all_reduce) of group tp/0_1"));
  EXPECT_TRUE(absl::StrContains(stalled.stalled(), "rank 1 (worker ")) << stalled.stalled();
  EXPECT_TRUE(absl::StrContains(stalled.stalled(), "has not reported for 3s")) << stalled.stalled();
  std::vector<v1::HangReport> reports;
  for (const v1::JobEvent& e : Events(job->job_id())) {
    if (e.has_hang()) reports.push_back(e.hang());
  }
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports[0].silent_ranks_size(), 0);
  ASSERT_EQ(reports[1].silent_ranks_size(), 1);
  EXPECT_EQ(reports[1].silent_ranks(0), 1);
}

// The scheduler changes jobs under its lock; their records are written
// after it is released. While one job's record is being written (a slow
// disk, here the write hook), another job's report gets through the
// scheduler: it does not wait for that write.
TEST_F(SchedulerTest, ARecordBeingWrittenHoldsUpNoOtherReport) {
  RecordJobsIn("scheduler-records");
  Start(4);
  const std::string a = jobs_->Submit(TrainSpec(2, 1), "")->job_id();
  const std::string b = jobs_->Submit(TrainSpec(2, 1), "")->job_id();
  scheduler_->TickForTest();
  ASSERT_EQ(Job(a).state(), v1::JOB_STATE_SCHEDULED);
  ASSERT_EQ(Job(b).state(), v1::JOB_STATE_SCHEDULED);
  const v1::Job jb = Job(b);
  std::atomic<int> slow_writes{0};
  std::atomic<bool> got_through{true};
  jobs_->SetBeforeWriteForTest([&](const std::string& id) {
    if (id != a || slow_writes++ > 0) return;
    auto other = std::async(std::launch::async, [&] {
      v1::ReportProgressRequest r;
      r.set_job_id(b);
      r.set_generation(jb.generation());
      r.set_rank(0);
      r.set_worker_id(jb.mesh().ranks(0).worker_id());
      r.mutable_status()->set_phase(v1::RANK_PHASE_TRAINING);
      return scheduler_->Report(r, [](absl::string_view) { return false; });  // keyless workers: none asked
    });
    got_through = other.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
    // (Otherwise the report waits for this write, and ends after it.)
  });
  Training(a);  // each rank's status change writes a's record
  EXPECT_GT(slow_writes.load(), 0);
  EXPECT_TRUE(got_through) << "job " << b << "'s report waited for job " << a << "'s record";
  EXPECT_EQ(Job(a).state(), v1::JOB_STATE_RUNNING);
  jobs_->SetBeforeWriteForTest(nullptr);
}

// A cancel that comes while the job is being placed (between its new
// generation's record and its placement) finds no placement to stop: no
// rank may be assigned after it, or nothing would ever stop it.
TEST_F(SchedulerTest, ACancelWhileTheJobIsBeingPlacedAssignsNoRank) {
  RecordJobsIn("scheduler-cancel-placing");
  Start(2);
  const std::string id = jobs_->Submit(TrainSpec(2, 1), "")->job_id();
  bool cancelled = false;
  jobs_->SetBeforeWriteForTest([&](const std::string& job) {
    if (job != id || cancelled) return;
    cancelled = true;  // the first write: Schedule's, on the scheduler's thread, no lock held
    absl::StatusOr<v1::Job> c = scheduler_->Cancel(id, "not wanted");
    EXPECT_TRUE(c.ok()) << c.status();
  });
  scheduler_->TickForTest();
  jobs_->SetBeforeWriteForTest(nullptr);
  ASSERT_TRUE(cancelled);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_TRUE(fake_->assigned.empty());
  scheduler_->TickForTest();
  EXPECT_TRUE(fake_->assigned.empty());
  // The workers are free for the next job.
  const std::string next = jobs_->Submit(TrainSpec(2, 1), "")->job_id();
  scheduler_->TickForTest();
  EXPECT_EQ(Job(next).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(fake_->assigned.size(), 2u);
}

// A rank failed and, before its peers were probed, the others finished
// (their last steps needed no collective): the job fails, as it does
// unprobed, and never counts as succeeded.
TEST_F(SchedulerTest, ARankFailureIsNotForgottenWhenThePeersFinishBeforeTheProbe) {
  Scheduler::Options o;
  o.probe_timeout = absl::Seconds(1);
  Start(2, o);
  const std::string id = jobs_->Submit(TrainSpec(2, 1), "")->job_id();
  scheduler_->TickForTest();
  Training(id);
  Ended(id, 1, absl::StatusCode::kResourceExhausted, "disk full: cannot write the final checkpoint");
  Ended(id, 0, absl::StatusCode::kOk);
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);  // not SUCCEEDED: the probe decides
  scheduler_->TickForTest();  // probes (nobody left to ask) and fails it
  const v1::Job j = Job(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(j.reason(), "cannot write the final checkpoint")) << j.reason();
  EXPECT_TRUE(fake_->aborted.empty());  // every rank had ended
  // Its workers are free again.
  const std::string next = jobs_->Submit(TrainSpec(2, 1), "")->job_id();
  scheduler_->TickForTest();
  EXPECT_EQ(Job(next).state(), v1::JOB_STATE_SCHEDULED);
}

// A failure that follows from a peer's (RankResult.peer_caused: a save
// another rank could not write its part of) reported first is not the
// job's reason: the scheduler waits for the peers' reports, up to
// Options::peer_caused_wait, and takes a rank's own failure. Here rank 1's
// FAILED_PRECONDITION (a job's own error: no restart), where rank 0's
// ABORTED would have restarted the job. Where no rank's own failure comes,
// the first one is the reason once the wait passed.
TEST_F(SchedulerTest, AFailureThatFollowedAPeersWaitsForTheCauseWhichIsTheJobsReason) {
  Scheduler::Options o;
  o.probe_timeout = absl::Seconds(1);
  o.peer_caused_wait = absl::Seconds(3);
  Start(4, o);
  const auto peer_caused = [&](const std::string& id, int rank) {
    v1::ReportProgressRequest req;
    req.mutable_result()->set_code(static_cast<int>(absl::StatusCode::kAborted));
    req.mutable_result()->set_message("the checkpoint of step 2 was not saved: another rank could not write its part");
    req.mutable_result()->set_peer_caused(true);
    ASSERT_TRUE(Report(id, rank, req).ok());
  };
  v1::JobSpec spec = TrainSpec(2, 1);
  spec.mutable_restart()->set_max_restarts(3);
  const std::string id = jobs_->Submit(spec, "")->job_id();
  scheduler_->TickForTest();
  Training(id);
  peer_caused(id, 0);
  scheduler_->TickForTest();
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);  // waiting for the cause
  EXPECT_TRUE(fake_->aborted.empty());
  Ended(id, 1, absl::StatusCode::kFailedPrecondition, "cannot write rank-00001-of-00002.safetensors: Is a directory");
  scheduler_->TickForTest();
  v1::Job j = Job(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED) << j.reason();
  EXPECT_TRUE(absl::StartsWith(j.reason(), "rank 1 ")) << j.reason();
  EXPECT_TRUE(absl::StrContains(j.reason(), "Is a directory")) << j.reason();

  // Only failures that followed a peer's: the first, once the timeout
  // passed, with the peer still running (probed, it answers).
  const std::string next = jobs_->Submit(spec, "")->job_id();
  scheduler_->TickForTest();
  Training(next);
  peer_caused(next, 1);
  Pass(absl::Seconds(2));
  scheduler_->TickForTest();
  EXPECT_EQ(Job(next).state(), v1::JOB_STATE_RUNNING);
  Pass(absl::Seconds(2));
  scheduler_->TickForTest();
  j = Job(next);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RESTARTING) << j.reason();
  EXPECT_TRUE(absl::StartsWith(j.reason(), "rank 1 ")) << j.reason();
  EXPECT_TRUE(absl::StrContains(j.reason(), "another rank could not write its part")) << j.reason();
}

// A rank whose end never reached the coordinator (its worker's tries ran
// out in a network blip) would keep the job RUNNING for ever: once its
// worker's heartbeats have said for Options::lost_report_wait that it ran
// the rank to its end (WorkerStatus.ended_*), the rank ends as they say:
// OK, the job's success; an error, the job's failure with its code. A
// worker busy with the rank, idle without saying so (an older worker, a
// heartbeat built before the assignment), or saying so of another
// generation, ends nothing.
TEST_F(SchedulerTest, ARankWhoseEndNeverCameEndsAsItsWorkerSays) {
  Scheduler::Options o;
  o.lost_report_wait = absl::Seconds(3);
  Start(2, o);
  v1::JobSpec spec = TrainSpec(2, 1);
  spec.mutable_restart()->set_max_restarts(2);
  // The index of rank 1's worker.
  const auto rank1 = [&](const std::string& id) {
    return static_cast<int>(std::find(ids_.begin(), ids_.end(), Job(id).mesh().ranks(1).worker_id()) - ids_.begin());
  };
  // A second passes; rank 1's worker beats `how` (busy, idle, ended with `code`).
  const auto beat = [&](const std::string& id, int64_t generation, const std::string& how,
                        absl::StatusCode code = absl::StatusCode::kOk) {
    const int w = rank1(id);
    v1::WorkerStatus st;
    st.set_state(how == "busy" ? v1::WORKER_STATE_BUSY : v1::WORKER_STATE_IDLE);
    if (how == "busy") {
      st.set_job_id(id);
      st.set_generation(generation);
      st.set_rank(1);
    } else if (how == "ended") {
      st.set_ended_job_id(id);
      st.set_ended_generation(generation);
      st.set_ended_rank(1);
      st.set_ended_code(static_cast<int>(code));
      if (code != absl::StatusCode::kOk) st.set_last_error(id + " rank 1: FAILED_PRECONDITION: corpus.bin: cut short");
    }
    clock_.Advance(absl::Seconds(1));
    Beat(1 - w);
    Beat(w, st);
    scheduler_->TickForTest();
  };
  const std::string id = jobs_->Submit(spec, "")->job_id();
  scheduler_->TickForTest();
  Training(id);
  const int64_t g = Job(id).generation();
  Ended(id, 0, absl::StatusCode::kOk);
  for (int i = 0; i < 6; ++i) beat(id, g, "busy");
  for (int i = 0; i < 6; ++i) beat(id, g, "idle");       // says nothing of its end
  for (int i = 0; i < 6; ++i) beat(id, g - 1, "ended");  // another generation's
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  beat(id, g, "ended");  // seen
  beat(id, g, "ended");
  beat(id, g, "ended");
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);  // 2 s of the 3: a report may still come
  beat(id, g, "ended");
  v1::Job j = Job(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED) << j.reason();
  EXPECT_EQ(j.reason(), "all 2 ranks finished");

  // An error: the job's failure, with the worker's last error; this one a
  // job's own (FAILED_PRECONDITION), which no restart mends.
  const std::string next = jobs_->Submit(spec, "")->job_id();
  scheduler_->TickForTest();
  Training(next);
  const int64_t g2 = Job(next).generation();
  for (int i = 0; i < 5; ++i) beat(next, g2, "ended", absl::StatusCode::kFailedPrecondition);
  j = Job(next);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED) << j.reason();
  EXPECT_TRUE(absl::StrContains(j.reason(), "rank 1 (worker " + ids_[rank1(next)] + " at ")) << j.reason();
  EXPECT_TRUE(absl::StrContains(j.reason(),
                                "ended FAILED_PRECONDITION (its worker says; its report never reached "
                                "the coordinator): " +
                                    next + " rank 1: FAILED_PRECONDITION: corpus.bin"))
      << j.reason();
}

// A job's new generation is on disk before a rank gets it. Where the
// record cannot be written (a full disk), the job is not placed: it goes
// back to PENDING and says why, the placement undone and the generation
// spent, and it is not tried again before the cool-off, which doubles at
// each failure in a row. Once the record can be written it is placed under
// the next generation, which a reopened JobManager reads back; so a
// restarted coordinator never hands out again a generation that ranks may
// still run (their rendezvous scope, their checkpoints' names).
TEST_F(SchedulerTest, AGenerationIsHandedOutOnlyOnceItIsRecorded) {
  const std::string dir = RecordJobsIn("scheduler-unrecorded");
  Start(2);
  const std::string id = jobs_->Submit(TrainSpec(2, 1), "")->job_id();
  const auto full_disk_tick = [&] {
    testing::FullDisk disk(16);
    scheduler_->TickForTest();
  };
  full_disk_tick();
  v1::Job j = Job(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_PENDING);
  EXPECT_NE(j.reason().find("its new generation cannot be recorded"), std::string::npos) << j.reason();
  EXPECT_EQ(j.generation(), 1);  // spent
  EXPECT_EQ(j.mesh().ranks_size(), 0);  // undone
  EXPECT_TRUE(j.rank0_workers().empty());
  EXPECT_TRUE(fake_->assigned.empty());
  Pass(absl::Seconds(29));
  scheduler_->TickForTest();  // within the cool-off: not tried
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job(id).generation(), 1);
  Pass(absl::Seconds(2));
  full_disk_tick();  // tried again: fails again, and waits twice as long
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job(id).generation(), 2);
  Pass(absl::Seconds(59));
  scheduler_->TickForTest();
  EXPECT_EQ(Job(id).generation(), 2);
  EXPECT_TRUE(fake_->assigned.empty());
  Pass(absl::Seconds(2));
  scheduler_->TickForTest();
  j = Job(id);
  ASSERT_EQ(j.state(), v1::JOB_STATE_SCHEDULED) << j.reason();
  EXPECT_EQ(j.generation(), 3);
  ASSERT_EQ(fake_->assigned.size(), 2u);
  for (const auto& c : fake_->assigned) {
    EXPECT_EQ(c.request.generation(), 3);
    EXPECT_EQ(c.request.rendezvous_scope(), id + "/gen-3");
  }
  EXPECT_EQ(j.rank0_workers().size(), 1u);
  auto reopened = JobManager::Open(dir, &clock_);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  auto read_back = (*reopened)->Get(id);
  ASSERT_TRUE(read_back.ok()) << read_back.status();
  EXPECT_EQ(read_back->generation(), 3);  // a restarted coordinator places it again under 4
  EXPECT_EQ(read_back->state(), v1::JOB_STATE_RESTARTING);
}

}  // namespace
}  // namespace colod
