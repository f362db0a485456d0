// WorkerMetrics: series per job rank, {job_id, rank} labels, and their
// removal when the rank ends (at once, or after the linger).
#include "worker/daemon/worker_metrics.h"

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "tests/testing/prometheus_text.h"

namespace colod {
namespace {

using Labels = std::map<std::string, std::string>;

class WorkerMetricsTest : public ::testing::Test {
 protected:
  // The registry as a scrape would see it, parsed strictly.
  std::map<std::string, testing::MetricFamily> Scrape() {
    const std::string text = prometheus::TextSerializer().Serialize(registry_.Collect());
    auto families = testing::ParsePrometheusText(text);
    EXPECT_TRUE(families.ok()) << families.status() << "\n" << text;
    return families.ok() ? *families : std::map<std::string, testing::MetricFamily>{};
  }

  // Samples named `sample` (a family's name, or NAME_bucket/_sum/_count).
  std::vector<testing::Sample> Samples(const std::string& sample) {
    std::vector<testing::Sample> out;
    for (const auto& [name, family] : Scrape()) {
      for (const testing::Sample& s : family.samples) {
        if (s.name == sample) out.push_back(s);
      }
    }
    return out;
  }

  // The value of the one sample named `sample` with `labels`; -1 if absent.
  double Value(const std::string& sample, const Labels& labels) {
    double value = -1;
    int found = 0;
    for (const testing::Sample& s : Samples(sample)) {
      if (s.labels == labels) {
        value = s.value;
        ++found;
      }
    }
    EXPECT_LE(found, 1) << sample;
    return value;
  }

  FakeClock clock_;
  prometheus::Registry registry_;
};

TEST_F(WorkerMetricsTest, LabelsEachSeriesByJobAndRank) {
  WorkerMetrics metrics(registry_, absl::Minutes(1), &clock_);
  // Nothing runs: no series.
  for (const char* name : {"colod_rank_running", "colod_rank_last_step_timestamp_seconds",
                           "colod_step_duration_seconds_count", "colod_tokens_total", "colod_loss",
                           "colod_tensor_bytes", "colod_collective_duration_seconds_count",
                           "colod_collective_bytes_total"}) {
    EXPECT_TRUE(Samples(name).empty()) << name;
  }
  const Labels rank{{"job_id", "job-000007"}, {"rank", "3"}};
  std::unique_ptr<WorkerMetrics::Rank> r = metrics.StartRank("job-000007", 3, "train", 2);
  EXPECT_EQ(Value("colod_rank_running", {{"job_id", "job-000007"}, {"rank", "3"}, {"kind", "train"}}), 1);
  EXPECT_TRUE(Samples("colod_rank_last_step_timestamp_seconds").empty());  // still loading
  EXPECT_TRUE(Samples("colod_tokens_total").empty());

  r->TrainingStarted();
  const double started = absl::ToDoubleSeconds(clock_.Now() - absl::UnixEpoch());
  EXPECT_EQ(Value("colod_rank_last_step_timestamp_seconds", rank), started);
  EXPECT_EQ(Value("colod_tokens_total", rank), 0);  // counters start at 0, before the first step
  EXPECT_EQ(Value("colod_step_duration_seconds_count", rank), 0);
  EXPECT_TRUE(Samples("colod_loss").empty());

  clock_.Advance(absl::Seconds(7));
  // 64 tokens of the replica, shared by its 2 tensor-parallel ranks.
  r->ObserveStep(0.25, 64, 2.5, 1000, 1000, 2000);
  EXPECT_EQ(Value("colod_rank_last_step_timestamp_seconds", rank), started + 7);
  EXPECT_EQ(Value("colod_tokens_total", rank), 32);
  EXPECT_EQ(Value("colod_loss", rank), 2.5);
  EXPECT_EQ(Value("colod_step_duration_seconds_count", rank), 1);
  EXPECT_EQ(Value("colod_step_duration_seconds_sum", rank), 0.25);
  EXPECT_EQ(Value("colod_step_duration_seconds_bucket", {{"job_id", "job-000007"}, {"rank", "3"}, {"le", "0.3"}}), 1);
  EXPECT_EQ(Value("colod_tensor_bytes", {{"job_id", "job-000007"}, {"rank", "3"}, {"kind", "optimizer_state"}}),
            2000);
  EXPECT_TRUE(Samples("colod_device_pool_bytes").empty());  // a CPU rank has no pool
  r->ObserveDevicePool(1 << 20, 3000);
  EXPECT_EQ(Value("colod_device_pool_bytes", {{"job_id", "job-000007"}, {"rank", "3"}, {"kind", "reserved"}}),
            1 << 20);
  EXPECT_EQ(Value("colod_device_pool_bytes", {{"job_id", "job-000007"}, {"rank", "3"}, {"kind", "used"}}), 3000);
  // Two data-parallel steps: 1000 bucket bytes each, 700 then 1000 of them
  // enqueued during backward.
  r->ObserveGradSync(1000, 700);
  r->ObserveGradSync(1000, 1000);
  EXPECT_EQ(Value("colod_dp_bucket_bytes_total", {{"job_id", "job-000007"}, {"rank", "3"}, {"when", "backward"}}),
            1700);
  EXPECT_EQ(Value("colod_dp_bucket_bytes_total", {{"job_id", "job-000007"}, {"rank", "3"}, {"when", "after"}}), 300);

  InstrumentedCommunicator::Observer tp = r->CollectiveObserver("tp");
  tp("all_reduce", 4096, absl::Milliseconds(2));
  tp("all_reduce", 4096, absl::Milliseconds(4));
  r->CollectiveObserver("dp")("all_gather", 100, absl::Microseconds(50));
  const Labels tp_reduce{{"job_id", "job-000007"}, {"rank", "3"}, {"op", "all_reduce"}, {"group", "tp"}};
  EXPECT_EQ(Value("colod_collective_bytes_total", tp_reduce), 8192);
  EXPECT_EQ(Value("colod_collective_duration_seconds_count", tp_reduce), 2);
  EXPECT_NEAR(Value("colod_collective_duration_seconds_sum", tp_reduce), 0.006, 1e-12);
  EXPECT_EQ(Value("colod_collective_bytes_total",
                  {{"job_id", "job-000007"}, {"rank", "3"}, {"op", "all_gather"}, {"group", "dp"}}),
            100);

  // A NaN loss is exported as NaN (the alert looks for it).
  r->ObserveStep(0.25, 64, std::nan(""), 1000, 1000, 2000);
  EXPECT_TRUE(std::isnan(Value("colod_loss", rank)));

  // A held-out evaluation: the last one's loss, nothing before the first.
  EXPECT_TRUE(Samples("colod_eval_loss").empty());
  r->ObserveEval(3.25);
  r->ObserveEval(3.125);
  EXPECT_EQ(Value("colod_eval_loss", rank), 3.125);

  // fp16: the last step's loss scale, and the steps that overflowed (none
  // before an fp16 step).
  EXPECT_TRUE(Samples("colod_loss_scale").empty());
  EXPECT_TRUE(Samples("colod_skipped_updates_total").empty());
  r->LossScalingStarted();  // before the first fp16 step: the count from 0
  EXPECT_EQ(Value("colod_skipped_updates_total", rank), 0);
  EXPECT_TRUE(Samples("colod_loss_scale").empty());
  r->ObserveLossScale(65536, false);
  EXPECT_EQ(Value("colod_loss_scale", rank), 65536);
  EXPECT_EQ(Value("colod_skipped_updates_total", rank), 0);
  r->ObserveLossScale(65536, true);
  r->ObserveLossScale(32768, true);
  r->ObserveLossScale(16384, false);
  EXPECT_EQ(Value("colod_loss_scale", rank), 16384);
  EXPECT_EQ(Value("colod_skipped_updates_total", rank), 2);
}

TEST_F(WorkerMetricsTest, AnEndedRanksSeriesGoAtOnceOrAfterTheLinger) {
  WorkerMetrics metrics(registry_, absl::Minutes(1), &clock_);
  const Labels rank{{"job_id", "job-000001"}, {"rank", "0"}};
  {
    std::unique_ptr<WorkerMetrics::Rank> r = metrics.StartRank("job-000001", 0, "train", 1);
    r->TrainingStarted();
    r->ObserveStep(0.1, 128, 3.0, 10, 10, 20);
    r->ObserveDevicePool(4096, 1024);
    r->ObserveGradSync(10, 5);
    r->ObserveEval(2.0);
    r->ObserveLossScale(1024, true);
    r->CollectiveObserver("dp")("all_reduce", 10, absl::Milliseconds(1));
  }
  // Nothing runs, so nothing can stall: these go at once.
  EXPECT_TRUE(Samples("colod_rank_running").empty());
  EXPECT_TRUE(Samples("colod_rank_last_step_timestamp_seconds").empty());
  // The rest stays for a scrape to see the final values.
  EXPECT_EQ(Value("colod_tokens_total", rank), 128);
  EXPECT_EQ(Value("colod_loss", rank), 3.0);
  clock_.Advance(absl::Seconds(59));
  metrics.RemoveExpired();
  EXPECT_EQ(Value("colod_tokens_total", rank), 128);
  clock_.Advance(absl::Seconds(1));
  metrics.RemoveExpired();
  for (const char* name :
       {"colod_step_duration_seconds_count", "colod_step_duration_seconds_bucket", "colod_tokens_total", "colod_loss",
        "colod_eval_loss", "colod_loss_scale", "colod_skipped_updates_total", "colod_tensor_bytes",
        "colod_device_pool_bytes", "colod_dp_bucket_bytes_total", "colod_collective_duration_seconds_count",
        "colod_collective_duration_seconds_bucket", "colod_collective_bytes_total"}) {
    EXPECT_TRUE(Samples(name).empty()) << name;
  }
  // The page still parses, and names no job.
  const std::string page = prometheus::TextSerializer().Serialize(registry_.Collect());
  EXPECT_TRUE(testing::ParsePrometheusText(page).ok()) << page;
  EXPECT_EQ(page.find("job_id="), std::string::npos) << page;
}

TEST_F(WorkerMetricsTest, WithoutALingerAnEndedRankLeavesNothing) {
  WorkerMetrics metrics(registry_, absl::ZeroDuration(), &clock_);
  {
    std::unique_ptr<WorkerMetrics::Rank> r = metrics.StartRank("job-000002", 1, "tensor", 4);
    r->CollectiveObserver("tp")("all_to_all", 64, absl::Milliseconds(1));
    EXPECT_EQ(Samples("colod_collective_bytes_total").size(), 1u);
    EXPECT_EQ(Value("colod_rank_running", {{"job_id", "job-000002"}, {"rank", "1"}, {"kind", "tensor"}}), 1);
    EXPECT_TRUE(Samples("colod_tokens_total").empty());  // no training loop: no training series
  }
  const std::string page = prometheus::TextSerializer().Serialize(registry_.Collect());
  EXPECT_EQ(page.find("job_id="), std::string::npos) << page;
}

TEST_F(WorkerMetricsTest, TheSameJobRankAgainTakesItsSeriesOver) {
  WorkerMetrics metrics(registry_, absl::Minutes(1), &clock_);
  const Labels rank{{"job_id", "job-000003"}, {"rank", "1"}};
  {
    auto first = metrics.StartRank("job-000003", 1, "train", 1);
    first->ObserveStep(0.1, 10, 1.0, 1, 1, 1);
    first->CollectiveObserver("dp")("broadcast", 5, absl::Milliseconds(1));
  }
  clock_.Advance(absl::Seconds(30));
  // Another job's rank ends meanwhile; its series expire on their own.
  metrics.StartRank("job-000004", 0, "train", 1)->ObserveStep(0.1, 10, 1.0, 1, 1, 1);
  auto second = metrics.StartRank("job-000003", 1, "train", 1);
  clock_.Advance(absl::Seconds(61));
  metrics.RemoveExpired();
  // The first run's expiry no longer applies: the series continue.
  EXPECT_EQ(Value("colod_tokens_total", rank), 10);
  EXPECT_EQ(Value("colod_tokens_total", {{"job_id", "job-000004"}, {"rank", "0"}}), -1);
  second->ObserveStep(0.1, 10, 1.0, 1, 1, 1);
  EXPECT_EQ(Value("colod_tokens_total", rank), 20);
  second.reset();
  clock_.Advance(absl::Minutes(1));
  metrics.RemoveExpired();
  // The first run's collective series go with the second's.
  EXPECT_TRUE(Samples("colod_collective_bytes_total").empty());
  EXPECT_TRUE(Samples("colod_tokens_total").empty());
}

}  // namespace
}  // namespace colod
