// ProgressReporter against a real gRPC coordinator stand-in: steps that
// cannot be delivered are kept and sent first, in order, once the
// coordinator answers; after an outage the last delivered ones are sent
// again; a report the coordinator refuses is dropped, not kept; End sends
// what is kept before the rank's result.
#include "worker/daemon/progress_reporter.h"

#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/grpc_server.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

// Answers every report as `answer` says, and records the steps and results
// it accepted (and the steps it refused) in arrival order.
class FakeReports final : public v1::CoordinatorService::Service {
 public:
  enum class Answer { kOk, kUnavailable, kRefuse };
  void Set(Answer a) {
    absl::MutexLock lock(&mu_);
    answer_ = a;
  }
  std::vector<int64_t> Accepted() {
    absl::MutexLock lock(&mu_);
    return accepted_;
  }

  grpc::Status ReportProgress(grpc::ServerContext*, const v1::ReportProgressRequest* req,
                              v1::ReportProgressResponse*) override {
    absl::MutexLock lock(&mu_);
    if (answer_ == Answer::kUnavailable) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "away");
    if (answer_ == Answer::kRefuse) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "refused");
    accepted_.push_back(req->has_step() ? req->step().step() : -1);  // -1: the result
    return grpc::Status::OK;
  }

 private:
  absl::Mutex mu_;
  Answer answer_ ABSL_GUARDED_BY(mu_) = Answer::kOk;
  std::vector<int64_t> accepted_ ABSL_GUARDED_BY(mu_);
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
    v1::AssignJobRequest assignment;
    assignment.set_job_id("job-000001");
    assignment.set_generation(1);
    reporter_ = std::make_unique<ProgressReporter>(o, assignment);
  }
  void TearDown() override { StopGrpcServer(*server_, absl::Seconds(1)); }

  bool Step(int64_t n) {
    train::StepStats st;
    st.step = n;
    st.seconds = 0.01;
    return reporter_->Step(st);
  }

  FakeReports service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ProgressReporter> reporter_;
};

TEST_F(ProgressReporterTest, StepsKeptDuringAnOutageArriveInOrderAfterTheLastDeliveredOnesAgain) {
  EXPECT_FALSE(Step(1));
  EXPECT_FALSE(Step(2));
  service_.Set(FakeReports::Answer::kUnavailable);
  EXPECT_FALSE(Step(3));
  EXPECT_FALSE(Step(4));
  // 3 and 4, and 1 and 2 again (the coordinator may not have written them).
  EXPECT_EQ(reporter_->undelivered(), 4u);
  service_.Set(FakeReports::Answer::kOk);
  EXPECT_FALSE(Step(5));
  EXPECT_EQ(reporter_->undelivered(), 0u);
  EXPECT_EQ(service_.Accepted(), (std::vector<int64_t>{1, 2, 1, 2, 3, 4, 5}));
}

TEST_F(ProgressReporterTest, ARefusedReportIsDroppedNotKept) {
  service_.Set(FakeReports::Answer::kRefuse);
  EXPECT_FALSE(Step(1));
  EXPECT_EQ(reporter_->undelivered(), 0u);
  service_.Set(FakeReports::Answer::kOk);
  EXPECT_FALSE(Step(2));
  EXPECT_EQ(service_.Accepted(), (std::vector<int64_t>{2}));
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

}  // namespace
}  // namespace colod
