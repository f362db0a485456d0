// ProgressReporter against a real gRPC coordinator stand-in: steps that
// cannot be delivered are kept and sent first, in order, once the
// coordinator answers; after an outage the last delivered ones are sent
// again; a report the coordinator refuses is dropped, not kept; End sends
// what is kept before the rank's result; a coordinator that answers
// nothing never holds the training thread; a "stop" answer reaches a
// later step; every report carries the worker the rank was placed on,
// also while the worker registers again.
#include "worker/daemon/progress_reporter.h"

#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/grpc_server.h"
#include "common/grpc_status.h"
#include "common/text.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

// Answers every report as `answer` says, and records the steps and results
// it accepted (and the steps it refused) in arrival order.
class FakeReports final : public v1::CoordinatorService::Service {
 public:
  // kHang: no answer until the answer changes (a SIGSTOPped coordinator).
  // kStale: recorded, then ABORTED (a coordinator that does not run the
  // job: one that restarted records a late step so).
  // kDenied: UNAUTHENTICATED (a worker whose token the coordinator does
  // not take).
  // kBusy: gRPC's own refusal of a server with no thread left.
  enum class Answer { kOk, kUnavailable, kRefuse, kHang, kStop, kStale, kDenied, kBusy };
  void Set(Answer a) {
    absl::MutexLock lock(&mu_);
    answer_ = a;
  }
  void SetIncarnation(std::string incarnation) {
    absl::MutexLock lock(&mu_);
    incarnation_ = std::move(incarnation);
  }
  std::vector<int64_t> Accepted() {
    absl::MutexLock lock(&mu_);
    return accepted_;
  }
  // Every report that reached it, answered or not.
  int Calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  // The worker ids of the reports it accepted.
  std::vector<std::string> Workers() {
    absl::MutexLock lock(&mu_);
    return workers_;
  }
  // The messages of the statuses and results it accepted.
  std::vector<std::string> Messages() {
    absl::MutexLock lock(&mu_);
    return messages_;
  }
  // The results it accepted.
  std::vector<v1::RankResult> Results() {
    absl::MutexLock lock(&mu_);
    return results_;
  }

  grpc::Status ReportProgress(grpc::ServerContext*, const v1::ReportProgressRequest* req,
                              v1::ReportProgressResponse* resp) override {
    absl::MutexLock lock(&mu_);
    ++calls_;
    auto answered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return answer_ != Answer::kHang; };
    mu_.AwaitWithTimeout(absl::Condition(&answered), absl::Seconds(30));
    if (answer_ == Answer::kUnavailable) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "away");
    if (answer_ == Answer::kBusy)
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "Server Threadpool Exhausted");
    if (answer_ == Answer::kRefuse) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "refused");
    if (answer_ == Answer::kDenied) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
    // As the coordinator's validation does.
    if (req->worker_id().empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "worker_id: required");
    if (req->has_status()) messages_.push_back(req->status().message());
    if (req->has_result()) messages_.push_back(req->result().message());
    if (req->has_result()) results_.push_back(req->result());
    if (!req->has_status()) accepted_.push_back(req->has_step() ? req->step().step() : -1);  // -1: the result
    workers_.push_back(req->worker_id());
    if (answer_ == Answer::kStale) return grpc::Status(grpc::StatusCode::ABORTED, "the job no longer runs");
    resp->set_stop(answer_ == Answer::kStop);
    resp->set_coordinator_incarnation(incarnation_);
    return grpc::Status::OK;
  }

 private:
  absl::Mutex mu_;
  Answer answer_ ABSL_GUARDED_BY(mu_) = Answer::kOk;
  std::vector<int64_t> accepted_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> messages_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::RankResult> results_ ABSL_GUARDED_BY(mu_);
  std::string incarnation_ ABSL_GUARDED_BY(mu_) = "first";
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

class ProgressReporterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto started = StartGrpcServer("127.0.0.1:0", {&service_});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = std::move(started->server);
    ProgressReporter::Options o;
    o.coordinator =
        v1::CoordinatorService::NewStub(grpc::CreateChannel(started->address, grpc::InsecureChannelCredentials()));
    o.rpc_timeout = absl::Seconds(5);
    o.worker_id = [this] {
      absl::MutexLock lock(&id_mu_);
      return worker_id_now_;
    };
    options_ = o;
    v1::AssignJobRequest assignment;
    assignment.set_job_id("job-000001");
    assignment.set_generation(1);
    v1::RankAssignment* placed = assignment.mutable_mesh()->add_ranks();
    placed->set_rank(0);
    placed->set_worker_id("worker-placed");
    reporter_ = std::make_unique<ProgressReporter>(o, assignment);
  }
  void SetWorkerIdNow(std::string id) {
    absl::MutexLock lock(&id_mu_);
    worker_id_now_ = std::move(id);
  }
  void TearDown() override { StopGrpcServer(*server_, absl::Seconds(1)); }

  bool Step(int64_t n) {
    train::StepStats st;
    st.step = n;
    st.seconds = 0.01;
    return reporter_->Step(st);
  }
  // Waits (bounded) for the sending thread to have delivered `n` steps in
  // all, or to keep `kept` undelivered after a failed attempt.
  void WaitDelivered(int64_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (reporter_->delivered() < n && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
    ASSERT_EQ(reporter_->delivered(), n);
  }
  void WaitKept(size_t kept) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (reporter_->undelivered() != kept && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
    ASSERT_EQ(reporter_->undelivered(), kept);
  }

  FakeReports service_;
  absl::Mutex id_mu_;
  std::string worker_id_now_ ABSL_GUARDED_BY(id_mu_) = "worker-now";
  ProgressReporter::Options options_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ProgressReporter> reporter_;
};

TEST_F(ProgressReporterTest, StepsKeptDuringAnOutageArriveInOrderAfterTheLastDeliveredOnesAgain) {
  EXPECT_FALSE(Step(1));
  EXPECT_FALSE(Step(2));
  WaitDelivered(2);
  service_.Set(FakeReports::Answer::kUnavailable);
  EXPECT_FALSE(Step(3));
  EXPECT_FALSE(Step(4));
  // 3 and 4, and 1 and 2 again (the coordinator may not have written them).
  WaitKept(4);
  service_.Set(FakeReports::Answer::kOk);
  EXPECT_FALSE(Step(5));
  WaitDelivered(7);
  EXPECT_EQ(reporter_->undelivered(), 0u);
  EXPECT_EQ(service_.Accepted(), (std::vector<int64_t>{1, 2, 1, 2, 3, 4, 5}));
}

// A coordinator with no server thread left refuses for want of room now:
// the report is kept and sent again, as while it is away (before, it was
// dropped as refused for good).
TEST_F(ProgressReporterTest, AReportABusyCoordinatorRefusedIsKept) {
  service_.Set(FakeReports::Answer::kBusy);
  EXPECT_FALSE(Step(1));
  WaitKept(1);
  service_.Set(FakeReports::Answer::kOk);
  EXPECT_FALSE(Step(2));
  WaitDelivered(2);
  EXPECT_EQ(reporter_->undelivered(), 0u);
  EXPECT_EQ(service_.Accepted(), (std::vector<int64_t>{1, 2}));
}

TEST_F(ProgressReporterTest, ARefusedReportIsDroppedNotKept) {
  service_.Set(FakeReports::Answer::kRefuse);
  EXPECT_FALSE(Step(1));
  WaitDelivered(1);  // answered: refused for good
  EXPECT_EQ(reporter_->undelivered(), 0u);
  service_.Set(FakeReports::Answer::kOk);
  EXPECT_FALSE(Step(2));
  WaitDelivered(2);
  EXPECT_EQ(service_.Accepted(), (std::vector<int64_t>{2}));
}

// A coordinator that takes no report from this worker (its token is not
// the workers', after a coordinator's restart with another): the rank is
// told to stop, with the reason, rather than train on unheard while the
// job is placed again elsewhere; what is queued is dropped, not sent one by
// one to the same refusal.
TEST_F(ProgressReporterTest, ACoordinatorThatTakesNoReportStopsTheRankWithItsReason) {
  service_.Set(FakeReports::Answer::kUnavailable);
  for (int64_t n = 1; n <= 50; ++n) EXPECT_FALSE(Step(n));
  WaitKept(50);
  const int before = service_.Calls();
  service_.Set(FakeReports::Answer::kDenied);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (reporter_->StopReason().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_NE(reporter_->StopReason().find("the coordinator takes no report of this rank (UNAUTHENTICATED: invalid "
                                         "bearer token)"),
            std::string::npos)
      << reporter_->StopReason();
  WaitKept(0);
  EXPECT_TRUE(Step(51));  // stop
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_LE(service_.Calls() - before, 3);
  EXPECT_TRUE(service_.Accepted().empty());
}

// A coordinator that takes reports and answers none (SIGSTOPped) costs the
// training thread nothing; the steps arrive in order once it answers.
TEST_F(ProgressReporterTest, ACoordinatorThatAnswersNothingDoesNotHoldTheTrainingThread) {
  service_.Set(FakeReports::Answer::kHang);
  const absl::Time start = absl::Now();
  for (int64_t n = 1; n <= 20; ++n) EXPECT_FALSE(Step(n));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "Step waited on the coordinator";
  service_.Set(FakeReports::Answer::kOk);
  WaitDelivered(20);
  std::vector<int64_t> want;
  for (int64_t n = 1; n <= 20; ++n) want.push_back(n);
  EXPECT_EQ(service_.Accepted(), want);
}

// A coordinator restarted between two reports (no report failed) answers
// with another incarnation: the steps delivered before are sent again.
TEST_F(ProgressReporterTest, ACoordinatorRestartedBetweenReportsGetsTheLastStepsAgain) {
  Step(1);
  Step(2);
  WaitDelivered(2);
  service_.SetIncarnation("second");
  Step(3);
  WaitDelivered(5);
  EXPECT_EQ(service_.Accepted(), (std::vector<int64_t>{1, 2, 3, 1, 2}));
  Step(4);
  WaitDelivered(6);
  EXPECT_EQ(service_.Accepted().back(), 4) << "the same incarnation again: nothing resent";
}

// A coordinator killed right after it took steps 1 and 2 (not yet on its
// disk) and started again before the rank's next report: that report is
// answered ABORTED (the restarted coordinator does not run the job; it
// records the step late), with no incarnation to show the restart. The
// steps before it are sent again, once: a second refusal resends nothing.
TEST_F(ProgressReporterTest, AFirstRefusalSendsTheLastStepsAgainOnce) {
  Step(1);
  Step(2);
  WaitDelivered(2);
  service_.Set(FakeReports::Answer::kStale);
  Step(3);
  WaitDelivered(5);
  EXPECT_EQ(service_.Accepted(), (std::vector<int64_t>{1, 2, 3, 1, 2}));
  Step(4);
  WaitDelivered(6);
  EXPECT_EQ(service_.Accepted().back(), 4) << "refused again: nothing resent";
  EXPECT_EQ(service_.Accepted().size(), 6u);
}

// "Stop" in an answer reaches the steps after it.
TEST_F(ProgressReporterTest, AStopAnswerReachesALaterStep) {
  service_.Set(FakeReports::Answer::kStop);
  Step(1);
  WaitDelivered(1);
  EXPECT_TRUE(Step(2));
}

TEST_F(ProgressReporterTest, EndSendsWhatIsKeptBeforeTheResult) {
  service_.Set(FakeReports::Answer::kUnavailable);
  EXPECT_FALSE(Step(1));
  EXPECT_FALSE(Step(2));
  service_.Set(FakeReports::Answer::kOk);
  reporter_->End(absl::OkStatus(), std::nullopt);
  EXPECT_EQ(service_.Accepted(), (std::vector<int64_t>{1, 2, -1}));
  EXPECT_EQ(reporter_->undelivered(), 0u);
}

// A failure marked as the worker's own (its disk, its device) says so in
// the result; any other does not.
TEST_F(ProgressReporterTest, TheResultSaysWhetherTheFaultIsTheWorkers) {
  reporter_->End(MarkWorkerFault(absl::ResourceExhaustedError("No space left on device")), std::nullopt);
  reporter_->End(absl::ResourceExhaustedError("the rank ran out of host memory"), std::nullopt);
  const std::vector<v1::RankResult> got = service_.Results();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(got[0].worker_fault());
  EXPECT_FALSE(got[1].worker_fault());
  EXPECT_FALSE(got[0].peer_caused());
  EXPECT_FALSE(got[1].peer_caused());
}

// A failure that follows a peer's (a save another rank could not write its
// part of) says so, for the coordinator to wait for the peer's own.
TEST_F(ProgressReporterTest, TheResultSaysWhetherTheFailureFollowedAPeers) {
  reporter_->End(MarkPeerCaused(absl::AbortedError("another rank could not write its part")), std::nullopt);
  const std::vector<v1::RankResult> got = service_.Results();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].code(), static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_TRUE(got[0].peer_caused());
  EXPECT_FALSE(got[0].worker_fault());
}

// An error may quote a file's bytes, any bytes, at any length: a status or
// result whose message is not UTF-8 would not parse at the coordinator (a
// proto3 string), which would never hear of the rank's end. They arrive
// valid and cut to kMaxReportedMessageBytes.
TEST_F(ProgressReporterTest, MessagesArriveAsValidUtf8AndBounded) {
  const std::string bad = "npy header: descr '<\xff\xfe' is not supported: \xC3(";
  reporter_->Phase(v1::RANK_PHASE_LOADING, bad);
  reporter_->End(absl::InvalidArgumentError(bad + std::string(100000, 'x')), std::nullopt);
  const std::vector<std::string> got = service_.Messages();
  ASSERT_EQ(got.size(), 2u);
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(got[0], "npy header: descr '<" + fffd + fffd + "' is not supported: " + fffd + "(");
  EXPECT_EQ(got[1].size(), kMaxReportedMessageBytes);
  EXPECT_EQ(got[1].substr(0, got[0].size()), got[0]);
  EXPECT_EQ(got[1].substr(got[1].size() - 3), "...");
  EXPECT_EQ(service_.Accepted(), (std::vector<int64_t>{-1}));
}

// A coordinator that restarted has forgotten the worker, which registers
// again: for a moment it has no id, then another one. The rank's reports
// still name the worker the rank was placed on (which the coordinator
// checks them against); under the id of the moment, the first would be
// refused (worker_id: required) and its step lost.
TEST_F(ProgressReporterTest, ReportsNameTheWorkerTheRankWasPlacedOnWhileItRegistersAgain) {
  SetWorkerIdNow("");
  Step(1);
  WaitDelivered(1);
  SetWorkerIdNow("worker-registered-again");
  Step(2);
  reporter_->End(absl::OkStatus(), std::nullopt);
  EXPECT_EQ(service_.Accepted(), (std::vector<int64_t>{1, 2, -1}));
  EXPECT_EQ(service_.Workers(), (std::vector<std::string>(3, "worker-placed")));
}

// An assignment whose mesh names no worker for the rank: the worker's own
// id at each report (one made while the worker had none gets it later).
TEST_F(ProgressReporterTest, WithoutAMeshTheWorkersOwnIdIsSent) {
  v1::AssignJobRequest assignment;
  assignment.set_job_id("job-000002");
  assignment.set_generation(1);
  SetWorkerIdNow("");
  ProgressReporter reporter(options_, assignment);
  SetWorkerIdNow("worker-now");
  reporter.End(absl::OkStatus(), std::nullopt);
  EXPECT_EQ(service_.Workers(), (std::vector<std::string>{"worker-now"}));
}

}  // namespace
}  // namespace colod
