// Jobs on a real cluster: a coordinator and four CPU workers as processes on
// loopback. A TRAIN job submitted over gRPC runs tp=2 x dp=2 on the workers
// (Gloo through the coordinator's rendezvous store) with the losses of the
// in-process run; its mesh is ColossalAI's layout; malformed specs never
// reach a worker; cancel stops the ranks and frees the workers; every
// daemon's /metrics parses; a restarted coordinator still lists its jobs.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "colod/v1/worker.grpc.pb.h"
#include "common/proto_time.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/job_manager.h"
#include "spec/model_config.h"
#include "spec/plan.h"
#include "tests/jobs_fixture.h"
#include "tests/subprocess.h"
#include "tests/testing/prometheus_text.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"
#include "worker/train/job_options.h"
#include "worker/train/trainer.h"

namespace colod {
namespace {

using ::colod::testing::Daemon;
using ::colod::testing::JobsTest;
using ::colod::testing::StatusOf;
using ::colod::testing::ReadFile;
using ::colod::testing::Runfile;
using ::colod::testing::RunCommand;
using ::colod::testing::TempPath;

using ::colod::testing::kGpl;

// colod_jobs_finished_total{state} on the coordinator whose /metrics is at
// `metrics`; -1 if it cannot be read.
double JobsFinished(const std::string& metrics, const std::string& state) {
  auto body = testing::HttpGet(metrics, "/metrics");
  if (!body.ok()) return -1;
  auto families = testing::ParsePrometheusText(*body);
  if (!families.ok() || !families->count("colod_jobs_finished_total")) return -1;
  for (const testing::Sample& s : families->at("colod_jobs_finished_total").samples) {
    if (s.labels.at("state") == state) return s.value;
  }
  return -1;
}

TEST_F(JobsTest, TrainsOnTheWorkersWithTheInProcessLossesAndSurvivesARestart) {
  // Malformed specs are refused before any worker is touched.
  v1::JobSpec bad = Spec(Options(5));
  bad.mutable_shard()->set_tensor_parallel_size(3);  // 4 heads do not split 3 ways
  auto refused = client_->SubmitJob(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "spec.shard")) << refused.status();
  bad = Spec(Options(5));
  bad.mutable_train()->set_batch_size(3);  // not divisible by dp = 2
  refused = client_->SubmitJob(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "spec.train.batch_size")) << refused.status();
  EXPECT_TRUE(client_->ListJobs()->empty());
  for (const Daemon& w : workers_) {
    const v1::WorkerStatus s = StatusOf(w.grpc);
    EXPECT_EQ(s.state(), v1::WORKER_STATE_IDLE);
    EXPECT_TRUE(s.job_id().empty());
  }

  // The same run in this process, as `coloctl train` runs it.
  const train::TrainOptions options = Options(5);
  std::vector<double> want;
  ASSERT_TRUE(train::Train(options, [&](const train::StepStats& s) { want.push_back(s.loss); }).ok());
  ASSERT_EQ(want.size(), 5u);

  v1::JobSpec with_checkpoints = Spec(options);  // checkpoints leave the losses alone
  with_checkpoints.mutable_train()->set_checkpoint_every(2);
  with_checkpoints.mutable_train()->set_checkpoint_dir(TempPath("ck"));
  auto job = client_->SubmitJob(with_checkpoints);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::vector<v1::JobEvent> events = Watch(job->job_id());
  std::vector<v1::JobState> states;
  std::vector<double> got;
  std::set<int> training;
  for (const v1::JobEvent& e : events) {
    if (e.has_state_change()) states.push_back(e.state_change().state());
    if (e.has_step()) {
      got.push_back(e.step().loss());
      EXPECT_EQ(e.step().step(), static_cast<int64_t>(got.size()));
      EXPECT_GT(e.step().tokens_per_second(), 0);
    }
    if (e.has_rank_status() && e.rank_status().phase() == v1::RANK_PHASE_TRAINING) {
      training.insert(e.rank_status().rank());
      EXPECT_EQ(e.rank_status().precision(), v1::PRECISION_FP32);  // what it trains at: the spec's fp32
    }
  }
  EXPECT_EQ(states, (std::vector<v1::JobState>{v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED,
                                               v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED}))
      << Logs();
  EXPECT_EQ(training, (std::set<int>{0, 1, 2, 3}));
  ASSERT_EQ(got.size(), want.size()) << Logs();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << "step " << i + 1;
  EXPECT_LT(got.back(), got.front());
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->step(), 5);
  EXPECT_DOUBLE_EQ(done->loss(), got.back());
  // Checkpoints after steps 2, 4 and the last, each complete on disk.
  EXPECT_EQ(done->last_checkpoint(), TempPath("ck") + "/step-000005");
  for (const char* step : {"step-000002", "step-000004", "step-000005"}) {
    EXPECT_TRUE(std::filesystem::exists(TempPath("ck") + "/" + step + "/train_state.json")) << step;
  }

  // The mesh is ColossalAI's ProcessGroup(tp_degree=2, dp_degree=2) layout,
  // each rank on its own worker, and `coloctl mesh` draws it.
  auto got_mesh = client_->GetMesh(job->job_id());
  ASSERT_TRUE(got_mesh.ok()) << got_mesh.status();
  EXPECT_EQ(got_mesh->state(), v1::JOB_STATE_SUCCEEDED);  // the mesh of its (last) attempt
  EXPECT_EQ(got_mesh->generation(), done->generation());
  const v1::MeshSpec* mesh = &got_mesh->mesh();
  std::map<std::string, std::vector<int>> groups;
  for (const v1::ProcessGroupSpec& g : mesh->groups()) {
    groups[absl::StrCat(g.axis(), g.index())] = std::vector<int>(g.ranks().begin(), g.ranks().end());
  }
  EXPECT_EQ(groups, (std::map<std::string, std::vector<int>>{
                        {"tp0", {0, 1}}, {"tp1", {2, 3}}, {"dp0", {0, 2}}, {"dp1", {1, 3}}}));
  std::set<std::string> addresses;
  for (const v1::RankAssignment& a : mesh->ranks()) {
    addresses.insert(a.worker_address());
    EXPECT_EQ(a.device_ordinal(), a.rank());  // one host: ranks follow the device ordinal
  }
  EXPECT_EQ(addresses.size(), 4u);
  auto drawn = RunCommand({Runfile("client/coloctl"), "--coordinator", coordinator_.grpc, "mesh", job->job_id()},
                          TempPath(""));
  ASSERT_EQ(drawn.code, 0) << drawn.err;
  EXPECT_TRUE(absl::StrContains(drawn.out, "tp0: {0,1}")) << drawn.out;
  EXPECT_TRUE(absl::StrContains(drawn.err, absl::StrCat(job->job_id(), " (succeeded): the mesh of its last attempt")))
      << drawn.err;
  EXPECT_TRUE(absl::StrContains(drawn.out, "dp1: {1,3}")) << drawn.out;

  // Every daemon's metrics parse. Each worker ran one rank of the job (its
  // series labelled {job_id, rank}, still there after the rank ended): 5
  // steps on its replica's 2 x 32 tokens a step, shared with the replica's
  // other tp rank, so that the ranks' counts add up to the job's 5 x 4 x 32
  // tokens; it timed its tp and dp all-reduces. Nothing runs any more, so
  // nothing says a rank runs or when it stepped last.
  double job_tokens = 0;
  std::set<std::string> ranks;
  for (const Daemon& w : workers_) {
    auto body = testing::HttpGet(w.metrics, "/metrics");
    ASSERT_TRUE(body.ok()) << body.status();
    auto families = testing::ParsePrometheusText(*body);
    ASSERT_TRUE(families.ok()) << families.status();
    const testing::Sample& tokens = families->at("colod_tokens_total").samples.at(0);
    EXPECT_EQ(families->at("colod_tokens_total").samples.size(), 1u);
    EXPECT_EQ(tokens.labels.at("job_id"), job->job_id());
    ranks.insert(tokens.labels.at("rank"));
    EXPECT_EQ(tokens.value, 5 * 2 * 32 / 2);
    job_tokens += tokens.value;
    const testing::Sample& loss = families->at("colod_loss").samples.at(0);
    EXPECT_EQ(loss.labels, tokens.labels);
    EXPECT_NEAR(loss.value, got.back(), 1e-5);
    for (const char* gone : {"colod_rank_running", "colod_rank_last_step_timestamp_seconds"}) {
      auto it = families->find(gone);
      EXPECT_TRUE(it == families->end() || it->second.samples.empty()) << gone << "\n" << *body;
    }
    std::set<std::string> comm_groups;
    for (const auto& sample : families->at("colod_collective_bytes_total").samples) {
      EXPECT_EQ(sample.labels.at("job_id"), job->job_id());
      EXPECT_EQ(sample.labels.at("rank"), tokens.labels.at("rank"));
      if (sample.labels.at("op") != "all_reduce") continue;  // checkpoints add barriers, which move no bytes
      comm_groups.insert(sample.labels.at("group"));
      EXPECT_GT(sample.value, 0);
    }
    EXPECT_EQ(comm_groups, (std::set<std::string>{"dp", "tp"}));
    bool params = false;
    for (const auto& sample : families->at("colod_tensor_bytes").samples) {
      if (sample.labels.at("kind") == "params") params = sample.value > 0;
    }
    EXPECT_TRUE(params);
  }
  EXPECT_EQ(ranks, (std::set<std::string>{"0", "1", "2", "3"}));
  EXPECT_EQ(job_tokens, 5 * 4 * 32);
  auto body = testing::HttpGet(coordinator_.metrics, "/metrics");
  ASSERT_TRUE(body.ok());
  ASSERT_TRUE(testing::ParsePrometheusText(*body).ok());
  // Base units only: seconds and bytes, never milli-, micro-, kilo- or mega-.
  std::vector<std::string> pages = {*body};
  for (const Daemon& w : workers_) pages.push_back(*testing::HttpGet(w.metrics, "/metrics"));
  for (const std::string& page : pages) {
    auto families = testing::ParsePrometheusText(page);
    ASSERT_TRUE(families.ok()) << families.status();
    for (const auto& [name, family] : *families) {
      EXPECT_TRUE(absl::StartsWith(name, "colod_")) << name;
      for (const char* bad : {"_ms", "milli", "micro", "_us", "_ns", "_kb", "_mb", "_gb", "kilo", "mega", "_minutes",
                              "_hours"}) {
        EXPECT_FALSE(absl::StrContains(name, bad)) << name;
      }
    }
  }

  // A long job, cancelled while it runs: every rank stops, the workers go
  // back to idle, and a job submitted next runs on them.
  auto long_job = client_->SubmitJob(Spec(Options(100000)));
  ASSERT_TRUE(long_job.ok()) << long_job.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline && client_->GetJob(long_job->job_id())->step() < 2) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  auto cancelled = client_->CancelJob(long_job->job_id(), "enough");
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(cancelled->reason(), "enough");
  EXPECT_TRUE(AllIdle(absl::Seconds(60))) << Logs();
  auto again = client_->SubmitJob(Spec(Options(2)));
  ASSERT_TRUE(again.ok());
  Watch(again->job_id());
  EXPECT_EQ(client_->GetJob(again->job_id())->state(), v1::JOB_STATE_SUCCEEDED) << Logs();

  // A restarted coordinator still knows every job and its history.
  const std::vector<v1::Job> before = *client_->ListJobs();
  ASSERT_EQ(before.size(), 3u);
  coordinator_.process->Signal(SIGTERM);
  ASSERT_EQ(coordinator_.process->Wait(absl::Seconds(30)), 0) << ReadFile(coordinator_.log);
  StartCoordinator();
  const std::vector<v1::Job> after = *client_->ListJobs();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i].job_id(), before[i].job_id());
    EXPECT_EQ(after[i].state(), before[i].state());
    EXPECT_EQ(after[i].step(), before[i].step());
    EXPECT_EQ(after[i].reason(), before[i].reason());
    EXPECT_EQ(after[i].last_checkpoint(), before[i].last_checkpoint());
  }
  EXPECT_EQ(after[0].last_checkpoint(), TempPath("ck") + "/step-000005");
  std::vector<double> replayed;
  for (const v1::JobEvent& e : Watch(job->job_id())) {
    if (e.has_step()) replayed.push_back(e.step().loss());
  }
  EXPECT_EQ(replayed, got);
}

// Gradient accumulation on the daemons: a job of 2 passes of 2 sequences a
// step (tp2 x dp2) trains with the losses of 4 sequences a step in 2
// micro-batches, run in this process.
TEST_F(JobsTest, AnAccumulatingJobTrainsWithTheLargerBatchsLosses) {
  train::TrainOptions larger = Options(3);
  larger.batch_size = 4;
  larger.micro_batches = 2;
  std::vector<double> want;
  ASSERT_TRUE(train::Train(larger, [&](const train::StepStats& s) { want.push_back(s.loss); }).ok());
  train::TrainOptions accum = Options(3);
  accum.batch_size = 2;
  accum.grad_accum = 2;
  v1::JobSpec spec = Spec(accum);
  EXPECT_EQ(spec.train().grad_accum(), 2);
  auto job = client_->SubmitJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::map<int64_t, double> got = LastLosses(Watch(job->job_id()));
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  ASSERT_EQ(got.size(), want.size()) << Logs();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got.at(i + 1), want[i], 1e-6 * want[i]) << "step " << i + 1;
}

// Held-out evaluation on the daemons: a tp2 x dp2 job holding out a tenth
// of its corpus evaluates after steps 2 and 3; the watch stream carries
// both, the job record the last and the best (with the checkpoint of its
// step), every worker's colod_eval_loss the last; and an eval_only job at
// tp=1 on the model the job wrote gives the same loss within 1e-5.
TEST_F(JobsTest, AnEvaluatingJobsHeldOutLossIsTheTpOneEvaluations) {
  train::TrainOptions o = Options(3);
  o.eval_split = 0.1;
  o.eval_every = 2;
  o.eval_steps = 2;
  o.save_dir = TempPath("eval_ck");
  o.save_every = 2;
  o.final_dir = TempPath("eval_final");
  auto job = client_->SubmitJob(Spec(o));
  ASSERT_TRUE(job.ok()) << job.status();
  std::map<int64_t, v1::EvalResult> evals;
  for (const v1::JobEvent& e : Watch(job->job_id())) {
    if (e.has_step() && e.step().has_eval()) evals[e.step().step()] = e.step().eval();
  }
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  ASSERT_EQ(evals.size(), 2u) << Logs();
  ASSERT_TRUE(evals.count(2) && evals.count(3));
  EXPECT_EQ(evals[2].checkpoint(), TempPath("eval_ck") + "/step-000002");
  EXPECT_EQ(evals[2].tokens(), 2 * 4 * 32);
  EXPECT_DOUBLE_EQ(evals[3].perplexity(), std::exp(evals[3].loss()));
  EXPECT_EQ(done->last_eval().step(), 3);
  EXPECT_EQ(done->last_eval().loss(), evals[3].loss());
  // The run's summary: 3 steps of 4 x 32 tokens, timed.
  EXPECT_EQ(done->summary().steps(), 3);
  EXPECT_EQ(done->summary().tokens(), 3 * 4 * 32);
  EXPECT_GT(done->summary().mean_tokens_per_second(), 0);
  EXPECT_GE(FromProtoDuration(done->summary().wall_time()), FromProtoDuration(done->summary().train_time()));
  EXPECT_GT(done->summary().model_flops_per_token(), 0);
  EXPECT_EQ(done->summary().peak_flops_per_second(), 0) << "CPU workers without --peak-tflops";
  EXPECT_EQ(done->summary().mfu(), 0);
  const int64_t best = evals[2].loss() <= evals[3].loss() ? 2 : 3;
  EXPECT_EQ(done->best_eval().step(), best);
  EXPECT_EQ(done->best_eval().checkpoint(), evals[best].checkpoint());
  for (const Daemon& w : workers_) {
    auto body = testing::HttpGet(w.metrics, "/metrics");
    ASSERT_TRUE(body.ok()) << body.status();
    auto families = testing::ParsePrometheusText(*body);
    ASSERT_TRUE(families.ok()) << families.status();
    ASSERT_EQ(families->count("colod_eval_loss"), 1u) << *body;
    ASSERT_EQ(families->at("colod_eval_loss").samples.size(), 1u) << *body;
    EXPECT_NEAR(families->at("colod_eval_loss").samples[0].value, evals[3].loss(), 1e-6 * evals[3].loss());
  }
  ASSERT_TRUE(AllIdle(absl::Seconds(30))) << Logs();

  train::TrainOptions tp1 = Options(3);
  tp1.model_dir = o.final_dir;
  tp1.shard.layout.set_tensor_parallel_size(1);
  tp1.shard.layout.set_data_parallel_size(1);
  tp1.eval_split = 0.1;
  tp1.eval_steps = 2;
  tp1.eval_only = true;
  auto again = client_->SubmitJob(Spec(tp1));
  ASSERT_TRUE(again.ok()) << again.status();
  std::vector<v1::EvalResult> got;
  for (const v1::JobEvent& e : Watch(again->job_id())) {
    if (e.has_step()) {
      EXPECT_TRUE(e.step().has_eval());
      EXPECT_FALSE(e.step().has_step_duration());  // nothing trained
      got.push_back(e.step().eval());
    }
  }
  auto evaluated = client_->GetJob(again->job_id());
  ASSERT_TRUE(evaluated.ok());
  ASSERT_EQ(evaluated->state(), v1::JOB_STATE_SUCCEEDED) << evaluated->reason() << "\n" << Logs();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].step(), 0);  // the model directory, not a checkpoint
  EXPECT_NEAR(got[0].loss(), evals[3].loss(), 1e-5 * evals[3].loss());
  EXPECT_EQ(evaluated->step(), 0);  // no step was trained
  EXPECT_EQ(evaluated->best_eval().loss(), got[0].loss());
}

TEST_F(JobsTest, TensorJobsHostColoTensorsOverGrpc) {
  // The ColoTensor document's example through coloctl: shapes per rank.
  auto demo = RunCommand({Runfile("client/coloctl"), "--coordinator", coordinator_.grpc, "--tp", "2", "--dp", "2",
                          "--seed", "7", "--output", "json", "tensor", "demo"},
                         TempPath(""), absl::Seconds(120));
  ASSERT_EQ(demo.code, 0) << demo.err << Logs();
  const nlohmann::json out = nlohmann::json::parse(demo.out, nullptr, false);
  ASSERT_FALSE(out.is_discarded()) << demo.out;
  const std::vector<std::vector<int64_t>> want_shapes = {{2, 3, 1}, {2, 3, 2}, {1, 3, 2}};
  ASSERT_EQ(out["stages"].size(), want_shapes.size()) << demo.out;
  for (size_t i = 0; i < want_shapes.size(); ++i) {
    ASSERT_EQ(out["stages"][i]["ranks"].size(), 4u);
    for (const auto& r : out["stages"][i]["ranks"]) {
      EXPECT_EQ(r["shape"].get<std::vector<int64_t>>(), want_shapes[i]) << "stage " << i << " " << r;
    }
  }
  EXPECT_EQ(client_->GetJob(out["job_id"].get<std::string>())->state(), v1::JOB_STATE_CANCELLED);
  ASSERT_TRUE(AllIdle(absl::Seconds(30))) << Logs();

  // A known value: each rank's shard is its block, and the gathered value
  // is the value again, whatever the conversions in between.
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_TENSOR);
  spec.mutable_shard()->set_tensor_parallel_size(2);
  spec.mutable_shard()->set_data_parallel_size(2);
  auto job = client_->SubmitJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline && client_->GetJob(job->job_id())->state() != v1::JOB_STATE_RUNNING) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(client_->GetJob(job->job_id())->state(), v1::JOB_STATE_RUNNING) << Logs();
  std::vector<float> values(4 * 6);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.5f * static_cast<float>(i) - 3.0f;
  v1::CreateTensorRequest create;
  create.set_job_id(job->job_id());
  create.set_name("x");
  create.mutable_value()->set_dtype(v1::DTYPE_F32);
  create.mutable_value()->add_shape(4);
  create.mutable_value()->add_shape(6);
  create.mutable_value()->set_data(values.data(), values.size() * sizeof(float));
  auto* placement = create.mutable_dist_spec()->add_placements();
  placement->set_axis("tp");
  placement->mutable_placement()->mutable_shard()->add_dims(1);
  placement->mutable_placement()->mutable_shard()->add_num_partitions(2);
  create.set_compute_pattern(static_cast<v1::ComputePattern>(99));
  EXPECT_EQ(client_->CreateTensor(create).status().code(), absl::StatusCode::kInvalidArgument);
  create.set_compute_pattern(v1::COMPUTE_PATTERN_TP1D);
  {
    // Shapes whose element counts wrap around int64 (2^62 x 16 is 0 in
    // plain arithmetic): refused by every rank, which stay up.
    v1::CreateTensorRequest huge = create;
    huge.set_name("huge");
    huge.mutable_value()->clear_shape();
    huge.mutable_value()->add_shape(int64_t{4611686018427387904});
    huge.mutable_value()->add_shape(16);
    huge.mutable_value()->clear_data();
    auto refused = client_->CreateTensor(huge);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "too large")) << refused.status();
    huge.clear_value();
    huge.mutable_random()->add_shape(int64_t{4611686018427387904});
    huge.mutable_random()->add_shape(16);
    refused = client_->CreateTensor(huge);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_FALSE(client_->GetShard(job->job_id(), "huge", 0).ok());
  }
  auto layout = client_->CreateTensor(create);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->compute_pattern(), v1::COMPUTE_PATTERN_TP1D);
  EXPECT_EQ(client_->CreateTensor(create).status().code(), absl::StatusCode::kAlreadyExists);
  auto floats = [](const v1::TensorValue& v) {
    std::vector<float> out(v.data().size() / sizeof(float));
    std::memcpy(out.data(), v.data().data(), v.data().size());
    return out;
  };
  // tp rank t holds columns [3t, 3t + 3) of every row; dp replicas alike.
  for (int rank = 0; rank < 4; ++rank) {
    auto shard = client_->GetShard(job->job_id(), "x", rank);
    ASSERT_TRUE(shard.ok()) << shard.status();
    const int t = rank % 2;
    std::vector<float> want;
    for (int r = 0; r < 4; ++r) {
      for (int c = 3 * t; c < 3 * t + 3; ++c) want.push_back(values[r * 6 + c]);
    }
    EXPECT_EQ(floats(shard->value()), want) << "rank " << rank;
    EXPECT_EQ(shard->layout().offsets(1), 3 * t);
  }
  // Resharded on rows over dp and columns over tp, then gathered.
  v1::DistSpec two;
  for (auto [axis, dim] : {std::pair<const char*, int>{"dp", 0}, {"tp", 1}}) {
    auto* p = two.add_placements();
    p->set_axis(axis);
    p->mutable_placement()->mutable_shard()->add_dims(dim);
    p->mutable_placement()->mutable_shard()->add_num_partitions(2);
  }
  auto resharded = client_->SetDistSpec(job->job_id(), "x", two);
  ASSERT_TRUE(resharded.ok()) << resharded.status();
  EXPECT_EQ(resharded->compute_pattern(), v1::COMPUTE_PATTERN_TP1D);  // kept by the ColoTensor
  auto shard3 = client_->GetShard(job->job_id(), "x", 3);  // dp 1, tp 1: rows 2-3, columns 3-5
  ASSERT_TRUE(shard3.ok());
  EXPECT_EQ(floats(shard3->value()),
            (std::vector<float>{values[15], values[16], values[17], values[21], values[22], values[23]}));
  auto global = client_->GetGlobal(job->job_id(), "x");
  ASSERT_TRUE(global.ok()) << global.status();
  EXPECT_EQ(floats(*global), values);
  {
    // Calls from many clients at once: each redistribution and gather is a
    // collective of every rank, so every rank must see the job's calls in one
    // order (the proxy's turns), or they would wait on each other's. The
    // value is the same whatever the layout.
    v1::DistSpec one;
    *one.add_placements() = create.dist_spec().placements(0);
    std::vector<std::thread> clients;
    std::atomic<int> good{0};
    for (int c = 0; c < 8; ++c) {
      clients.emplace_back([&, c] {
        for (int round = 0; round < 3; ++round) {
          if (!client_->SetDistSpec(job->job_id(), "x", (c + round) % 2 == 0 ? two : one).ok()) return;
          auto got = client_->GetGlobal(job->job_id(), "x");
          if (!got.ok() || floats(*got) != values) return;
        }
        ++good;
      });
    }
    for (std::thread& t : clients) t.join();
    EXPECT_EQ(good.load(), 8) << Logs();
  }
  EXPECT_EQ(client_->GetGlobal(job->job_id(), "missing").status().code(), absl::StatusCode::kNotFound);
  auto listed = client_->ListTensors(job->job_id());
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].shards_size(), 4);
  // The coordinator times TensorService calls like its own.
  auto page = testing::HttpGet(coordinator_.metrics, "/metrics");
  ASSERT_TRUE(page.ok());
  auto families = testing::ParsePrometheusText(*page);
  ASSERT_TRUE(families.ok()) << families.status();
  double creates = 0;
  for (const auto& sample : families->at("colod_rpc_duration_seconds").samples) {
    if (sample.name == "colod_rpc_duration_seconds_count" && sample.labels.count("method") &&
        sample.labels.at("method") == "CreateTensor") {
      creates += sample.value;
    }
  }
  // The demo's, the INVALID_ARGUMENT one, the two huge ones, this one, and
  // the ALREADY_EXISTS one.
  EXPECT_EQ(creates, 6);
  ASSERT_TRUE(client_->DeleteTensor(job->job_id(), "x").ok());
  EXPECT_TRUE(client_->ListTensors(job->job_id())->empty());
  ASSERT_TRUE(client_->CancelJob(job->job_id()).ok());
  EXPECT_TRUE(AllIdle(absl::Seconds(30))) << Logs();
}

TEST_F(JobsTest, AWorkerKilledMidJobFailsTheJobAndFreesTheOthers) {
  const LongJob run = StartLongJobOn(1);
  ASSERT_GE(run.worker, 0);
  const std::string& job_id = run.job_id;
  const v1::MeshSpec& mesh = run.mesh;
  const int victim = run.worker;
  // Kill the worker of rank 1 without a chance to say goodbye.
  workers_[victim].process->Signal(SIGKILL);
  workers_[victim].process->Wait(absl::Seconds(10));
  Watch(job_id);
  auto failed = client_->GetJob(job_id);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED) << failed->reason();
  // The reason names the killed worker, not only a peer whose collective
  // broke first: the coordinator probes the peers of a failed rank (or,
  // should no peer fail first, the lease runs out).
  EXPECT_TRUE(absl::StrContains(failed->reason(), absl::StrCat("rank 1 (worker ", mesh.ranks(1).worker_id())))
      << failed->reason();
  // Its peers stop (their collectives fail) and go back to idle; the lost
  // worker is marked so.
  EXPECT_TRUE(AllIdle(absl::Seconds(45), victim)) << Logs();
  const absl::Time lost_deadline = absl::Now() + absl::Seconds(10);
  bool lost = false;
  while (!lost && absl::Now() < lost_deadline) {
    auto listed = client_->ListWorkers(true);
    ASSERT_TRUE(listed.ok()) << listed.status();
    for (const v1::Worker& w : *listed) {
      lost = lost || (w.info().address() == workers_[victim].grpc && w.state() == v1::WORKER_STATE_LOST);
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(lost);
}

// A worker SIGSTOPped mid-training: its lease runs out, the job fails naming
// it, and the healthy workers, whose ranks sit in a Gloo collective with the
// stopped one, are idle again within 10 s of the job's end (the abort ends
// the collective in flight instead of waiting out --comm-timeout); their
// heartbeats never stop, so none of them is marked lost.
TEST_F(JobsTest, AStoppedPeerFailsTheJobAndTheHealthyWorkersAreIdleWithinSeconds) {
  const LongJob run = StartLongJobOn(2);
  ASSERT_GE(run.worker, 0);
  const std::string& job_id = run.job_id;
  const v1::MeshSpec& mesh = run.mesh;
  const int stopped = run.worker;
  workers_[stopped].process->Signal(SIGSTOP);
  Watch(job_id);
  const absl::Time ended = absl::Now();
  auto failed = client_->GetJob(job_id);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED) << failed->reason();
  EXPECT_TRUE(absl::StrContains(failed->reason(), absl::StrCat("rank 2 (worker ", mesh.ranks(2).worker_id())))
      << failed->reason();
  EXPECT_TRUE(AllIdle(absl::Seconds(10), stopped)) << "healthy workers still busy 10 s after the job ended\n"
                                                    << Logs();
  EXPECT_LT(absl::Now() - ended, absl::Seconds(11));
  std::printf("stopped peer: healthy workers idle %.2f s after the job ended\n",
              absl::ToDoubleSeconds(absl::Now() - ended));
  auto listed = client_->ListWorkers(/*include_lost=*/true);
  ASSERT_TRUE(listed.ok()) << listed.status();
  for (const v1::Worker& w : *listed) {
    if (w.info().address() != workers_[stopped].grpc) {
      EXPECT_NE(w.state(), v1::WORKER_STATE_LOST) << w.info().address() << ": " << w.lost_reason();
    }
  }
  workers_[stopped].process->Signal(SIGCONT);
}

// The restart policy at work: the worker of rank 1 is SIGKILLed after the
// job wrote a checkpoint; the job goes RESTARTING naming the rank and the
// worker, waits for a fourth worker (one joins), is placed again under
// generation 2, resumes from the newest checkpoint and SUCCEEDS with the
// losses of the uninterrupted run, bit for bit, every step. The run uses
// ZeRO 2 (tp=2 x dp=2): the killed rank held half of its tp shard's
// optimizer state and gradients, which the checkpoint's partitions restore.
TEST_F(JobsTest, AWorkerKilledMidRunRestartsTheJobWhichSucceedsWithTheUninterruptedLosses) {
  train::TrainOptions o = Options(30);
  o.zero_stage = 2;
  std::vector<double> want;
  ASSERT_TRUE(train::Train(o, [&](const train::StepStats& s) { want.push_back(s.loss); }).ok());
  v1::JobSpec spec = Spec(o);
  spec.mutable_train()->set_checkpoint_every(5);
  spec.mutable_train()->set_checkpoint_dir(TempPath("ck-restart"));
  spec.mutable_train()->set_keep_last(2);  // retention across the restart
  auto job = client_->SubmitJob(spec);  // the default policy: 3 restarts
  ASSERT_TRUE(job.ok()) << job.status();
  v1::MeshSpec mesh;
  int victim = -1;
  ASSERT_TRUE(RunUntilStepThenStop(job->job_id(), 7, 1, &mesh, &victim));
  const absl::Time killed = absl::Now();
  ASSERT_NO_FATAL_FAILURE(KillAndReplaceWorker(victim));
  const std::vector<v1::JobEvent> events = Watch(job->job_id());
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  EXPECT_EQ(done->generation(), 2);
  EXPECT_EQ(done->restarts(), 1);
  ASSERT_EQ(done->attempt_failures_size(), 1);
  EXPECT_TRUE(absl::StrContains(done->attempt_failures(0), absl::StrCat("rank 1 (worker ", mesh.ranks(1).worker_id())))
      << done->attempt_failures(0);
  bool restarting = false;
  for (const v1::JobEvent& e : events) {
    if (e.has_state_change() && e.state_change().state() == v1::JOB_STATE_RESTARTING &&
        absl::StrContains(e.state_change().reason(), absl::StrCat("rank 1 (worker ", mesh.ranks(1).worker_id())) &&
        absl::StrContains(e.state_change().reason(), "restart 1 of 3") &&
        absl::StrContains(e.state_change().reason(), "from its newest checkpoint in " + TempPath("ck-restart"))) {
      restarting = true;
    }
  }
  EXPECT_TRUE(restarting) << "no RESTARTING event names the killed rank's worker";
  absl::Time restart_time = absl::InfinitePast(), running_again = absl::InfinitePast();
  for (const v1::JobEvent& e : events) {
    if (!e.has_state_change()) continue;
    if (e.state_change().state() == v1::JOB_STATE_RESTARTING) restart_time = FromProtoTimestamp(e.time());
    if (e.state_change().state() == v1::JOB_STATE_RUNNING) running_again = FromProtoTimestamp(e.time());
  }
  std::printf("worker SIGKILL: RESTARTING after %.2f s, RUNNING again after %.2f s\n",
              absl::ToDoubleSeconds(restart_time - killed), absl::ToDoubleSeconds(running_again - killed));
  for (const v1::RankAssignment& a : done->mesh().ranks()) EXPECT_NE(a.worker_address(), workers_[victim].grpc);
  ASSERT_NO_FATAL_FAILURE(ExpectLastLosses(events, want));
  // Retention kept the newest two checkpoints through the restart, and
  // nothing else is left in the directory; the job lists them.
  std::set<std::string> left;
  for (const auto& entry : std::filesystem::directory_iterator(TempPath("ck-restart"))) {
    left.insert(entry.path().filename().string());
  }
  EXPECT_EQ(left, (std::set<std::string>{"step-000025", "step-000030"}));
  ASSERT_EQ(done->checkpoints_size(), 2);
  EXPECT_EQ(done->checkpoints(0).step(), 25);
  EXPECT_EQ(done->checkpoints(1).path(), TempPath("ck-restart") + "/step-000030");
  EXPECT_GT(done->checkpoints(1).bytes(), 0);
}

// An interleaved pipeline (pp2 x dp2, two virtual stages a rank) on the
// daemons: a worker SIGKILLed mid-run restarts the job from its checkpoint
// of every rank's chunks, and it succeeds with the uninterrupted in-process
// run's losses, bit for bit. The checkpoint directory is reused: the
// in-process run left its checkpoints of every 4th step to the last there,
// and the restart takes the job's own newest (step 4), not that run's step
// 24 (AssignJobRequest.resume_own_checkpoints, the job's uid).
TEST_F(JobsTest, AnInterleavedJobKilledMidRunRestartsWithTheUninterruptedLosses) {
  shardformer::testing::TinyOptions tiny;
  tiny.vocab = 257;
  tiny.positions = 32;
  tiny.layers = 4;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("gpt2-4"), tiny);
  ASSERT_TRUE(model.ok()) << model.status();
  train::TrainOptions o = Options(24);
  o.model_dir = model->dir;
  o.shard.layout.set_tensor_parallel_size(1);
  o.shard.layout.set_pipeline_parallel_size(2);
  o.shard.layout.set_virtual_stages(2);
  o.micro_batches = 2;
  std::vector<double> want;
  train::TrainOptions earlier = o;
  earlier.save_dir = TempPath("ck-interleaved");
  earlier.save_every = 4;
  ASSERT_TRUE(train::Train(earlier, [&](const train::StepStats& s) { want.push_back(s.loss); }).ok());
  ASSERT_TRUE(std::filesystem::exists(TempPath("ck-interleaved") + "/step-000024"));
  v1::JobSpec spec = Spec(o);
  spec.mutable_train()->set_checkpoint_every(4);
  spec.mutable_train()->set_checkpoint_dir(TempPath("ck-interleaved"));
  auto job = client_->SubmitJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::MeshSpec mesh;
  int victim = -1;
  ASSERT_TRUE(RunUntilStepThenStop(job->job_id(), 6, 1, &mesh, &victim));
  ASSERT_NO_FATAL_FAILURE(KillAndReplaceWorker(victim));
  const std::vector<v1::JobEvent> events = Watch(job->job_id());
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  EXPECT_EQ(done->restarts(), 1);
  bool restarting = false;
  for (const v1::JobEvent& e : events) {
    restarting = restarting || (e.has_state_change() && e.state_change().state() == v1::JOB_STATE_RESTARTING &&
                                absl::StrContains(e.state_change().reason(),
                                                  "from its newest checkpoint in " + TempPath("ck-interleaved")));
  }
  EXPECT_TRUE(restarting) << "no RESTARTING event resumes from the checkpoints";
  ASSERT_NO_FATAL_FAILURE(ExpectLastLosses(events, want));
  // Every checkpoint is the job's now, recording its id and uid.
  std::ifstream state_file(TempPath("ck-interleaved") + "/step-000024/train_state.json");
  const std::string state((std::istreambuf_iterator<char>(state_file)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(absl::StrContains(state, absl::StrCat("\"job\": \"", done->job_id(), "_", done->uid(), "\"")))
      << state;
  EXPECT_EQ(done->uid().size(), 16u);
}

// A job whose restarts are spent fails, listing every attempt's failure.
TEST_F(JobsTest, AJobThatSpendsItsRestartsFailsListingEveryAttempt) {
  train::TrainOptions o = Options(100000);
  o.shard.layout.set_data_parallel_size(1);  // 2 ranks: 2 spare workers
  o.batch_size = 2;
  v1::JobSpec spec = Spec(o);
  spec.mutable_restart()->set_max_restarts(1);
  spec.mutable_train()->set_checkpoint_every(2);
  spec.mutable_train()->set_checkpoint_dir(TempPath("ck-spent"));
  auto job = client_->SubmitJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<std::string> killed;
  for (int attempt = 1; attempt <= 2; ++attempt) {
    // Rank 1's worker of this attempt (generation `attempt`) is killed.
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    absl::StatusOr<v1::Job> j = client_->GetJob(job->job_id());
    while (absl::Now() < deadline && j.ok() && (j->generation() < attempt || j->state() != v1::JOB_STATE_RUNNING)) {
      absl::SleepFor(absl::Milliseconds(20));
      j = client_->GetJob(job->job_id());
    }
    ASSERT_TRUE(j.ok() && j->generation() == attempt && j->state() == v1::JOB_STATE_RUNNING)
        << (j.ok() ? j->DebugString() : j.status().ToString()) << Logs();
    const int victim = WorkerOf(j->mesh(), 1);
    ASSERT_GE(victim, 0);
    killed.push_back(j->mesh().ranks(1).worker_id());
    workers_[victim].process->Signal(SIGKILL);
    workers_[victim].process->Wait(absl::Seconds(10));
  }
  Watch(job->job_id());
  auto failed = client_->GetJob(job->job_id());
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(failed->restarts(), 1);
  EXPECT_TRUE(absl::StartsWith(failed->reason(), "failed after 1 restarts, all its policy allows: attempt 1: "))
      << failed->reason();
  for (const std::string& id : killed) {
    EXPECT_TRUE(absl::StrContains(failed->reason(), absl::StrCat("rank 1 (worker ", id))) << failed->reason();
  }
  EXPECT_TRUE(absl::StrContains(failed->reason(), "; attempt 2: ")) << failed->reason();
}

// A rank's own error is the job's reason, not a peer's consequence of it.
// Rank 0 of a dp=2 job finds its updated weights not finite as it saves
// (FAILED_PRECONDITION: no restart mends it), while rank 1, which owns no
// parameter, learns of it at the save's first agreement and fails with an
// error marked as following a peer's (RankResult.peer_caused), for which
// the coordinator waits for rank 0's own. (Before the agreement, rank 1's
// "connection closed by peer", UNAVAILABLE, which restarts a job, could be
// heard first; rank 0 also reports before its connections close.)
TEST_F(JobsTest, ARanksOwnErrorIsTheJobsReasonNotItsPeersConsequence) {
  train::TrainOptions o = Options(3);
  o.shard.layout.set_tensor_parallel_size(1);
  o.lr = 1e39;  // the first update overflows every weight it moves
  o.min_lr = 0;
  o.warmup_steps = 0;
  o.clip_norm = 0;
  v1::JobSpec spec = Spec(o);
  spec.mutable_restart()->set_max_restarts(2);
  spec.mutable_train()->set_checkpoint_every(1);
  spec.mutable_train()->set_checkpoint_dir(TempPath("ck-diverged"));
  auto job = client_->SubmitJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  Watch(job->job_id());
  auto failed = client_->GetJob(job->job_id());
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED) << failed->reason() << Logs();
  EXPECT_EQ(failed->restarts(), 0) << failed->reason();
  EXPECT_TRUE(absl::StartsWith(failed->reason(), "rank 0 ")) << failed->reason();
  EXPECT_TRUE(absl::StrContains(failed->reason(), "FAILED_PRECONDITION: the weights are not finite (parameter "))
      << failed->reason();
  EXPECT_TRUE(absl::StrContains(failed->reason(), "(not restarted: an error of the job itself)")) << failed->reason();
}

// Hang blame: a 1 s hang threshold and a 5 s lease, so that a stopped rank
// is named while its job still runs.
class JobsHangTest : public JobsTest {
 protected:
  JobsHangTest() { coordinator_flags_ = {"--hang-threshold", "1s", "--lease-duration", "5s"}; }
};

// A rank's worker SIGSTOPped mid-training: its peers wait in their next
// collective with it; within 2x the threshold the coordinator reports the
// group, the collective and the stopped rank as the one that has not
// entered it (and has not reported since), as a job event, in `coloctl
// status`, and in colod_collective_hangs_total. The ranks that end dump
// their flight recorders.
TEST_F(JobsHangTest, AStoppedRankIsNamedAsTheOneThatHasNotEnteredTheCollective) {
  // Under ZeRO 2: the dp collectives are the gradients' reduce-scatters and
  // the updated weights' all-gathers.
  const LongJob run = StartLongJobOn(2, /*zero_stage=*/2);
  ASSERT_GE(run.worker, 0);
  const std::string& job_id = run.job_id;
  const v1::MeshSpec& mesh = run.mesh;
  const int stopped = run.worker;
  workers_[stopped].process->Signal(SIGSTOP);
  const absl::Time t0 = absl::Now();
  const std::string who = absl::StrCat("rank 2 (worker ", mesh.ranks(2).worker_id());
  // Its tp peer waits for it, and their dp peers for them: the report that
  // names rank 2 itself is the one to wait for. Stopped before it entered
  // the collective its peer waits in, it is named as not having entered it;
  // stopped inside it, as the rank not heard from.
  const std::string silent = absl::StrCat(who, " at ", mesh.ranks(2).worker_address(), ") has not reported");
  auto names_it = [&](const std::string& stalled) {
    return absl::StrContains(stalled, "not entered by " + who) || absl::StrContains(stalled, silent);
  };
  absl::StatusOr<v1::Job> job = client_->GetJob(job_id);
  while (absl::Now() < t0 + absl::Seconds(4) && job.ok() && !names_it(job->stalled())) {
    absl::SleepFor(absl::Milliseconds(20));
    job = client_->GetJob(job_id);
  }
  const absl::Duration named = absl::Now() - t0;
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_LE(named, absl::Seconds(2)) << "named after " << named;
  std::printf("stopped rank named %.2f s after SIGSTOP (threshold 1 s)\n", absl::ToDoubleSeconds(named));
  EXPECT_TRUE(names_it(job->stalled())) << job->stalled();
  EXPECT_TRUE(absl::StrContains(job->stalled(), silent)) << job->stalled();
  auto status = RunCommand({Runfile("client/coloctl"), "--coordinator", coordinator_.grpc, "status", job_id},
                           TempPath(""));
  EXPECT_TRUE(absl::StrContains(status.out, "stalled:    collective #")) << status.out << status.err;
  const std::vector<v1::JobEvent> events = Watch(job_id);
  bool reported = false;
  for (const v1::JobEvent& e : events) {
    if (!e.has_hang()) continue;
    const v1::HangReport& h = e.hang();
    if (std::count(h.missing_ranks().begin(), h.missing_ranks().end(), 2) == 0 &&
        std::count(h.silent_ranks().begin(), h.silent_ranks().end(), 2) == 0) {
      continue;
    }
    reported = true;
    EXPECT_GT(h.sequence(), 0);
    EXPECT_FALSE(h.op().empty());
    EXPECT_EQ(std::count(h.silent_ranks().begin(), h.silent_ranks().end(), 2), 1) << h.message();
  }
  EXPECT_TRUE(reported) << "no hang event names rank 2";
  auto body = testing::HttpGet(coordinator_.metrics, "/metrics");
  ASSERT_TRUE(body.ok());
  auto families = testing::ParsePrometheusText(*body);
  ASSERT_TRUE(families.ok());
  ASSERT_TRUE(families->count("colod_collective_hangs_total"));
  EXPECT_GE(families->at("colod_collective_hangs_total").samples.at(0).value, 1);
  // A healthy rank that ended dumped its flight recorder: its last
  // collective failed.
  const int healthy = WorkerOf(mesh, 0);
  const std::string dump = absl::StrCat(TempPath(absl::StrCat("work", healthy)), "/flight-recorder/", job_id,
                                        "-gen-1-rank-0.json");
  // The stopped worker stays stopped until the others ended: the job's FAILED
  // event is visible before the coordinator's aborts reach the healthy
  // ranks, and a peer resumed in between would complete their collective.
  const bool others_idle = AllIdle(absl::Seconds(20), stopped);
  workers_[stopped].process->Signal(SIGCONT);
  ASSERT_TRUE(others_idle) << Logs();
  const nlohmann::json recorded = nlohmann::json::parse(ReadFile(dump), nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(recorded.is_array() && !recorded.empty()) << dump;
  int failed = 0;
  for (const nlohmann::json& e : recorded) failed += e["state"] == "failed";
  EXPECT_GE(failed, 1) << recorded.dump();
  EXPECT_NE(recorded.back()["state"], "pending") << recorded.back().dump();
}

// A worker stopped cleanly (SIGTERM) leaves the registry at once, saying
// so, instead of waiting out its lease: the next job is placed on the
// others. Here that job needs exactly the 3 workers left.
TEST_F(JobsTest, AWorkerThatStopsCleanlyLeavesAndTheNextJobRunsElsewhere) {
  const std::string gone = workers_[2].grpc;
  workers_[2].process->Signal(SIGTERM);
  ASSERT_EQ(workers_[2].process->Wait(absl::Seconds(20)), 0) << Logs();
  auto listed = client_->ListWorkers(/*include_lost=*/true);
  ASSERT_TRUE(listed.ok()) << listed.status();
  int live = 0;
  for (const v1::Worker& w : *listed) {
    if (w.info().address() == gone) {
      EXPECT_EQ(w.state(), v1::WORKER_STATE_LOST);
      EXPECT_TRUE(absl::StartsWith(w.lost_reason(), "left: ")) << w.lost_reason();  // not a lease expiry
    } else {
      live += w.state() != v1::WORKER_STATE_LOST;
    }
  }
  EXPECT_EQ(live, 3);
  train::TrainOptions o = Options(2);
  o.shard.layout.set_tensor_parallel_size(1);
  o.shard.layout.set_data_parallel_size(3);
  o.batch_size = 3;
  auto job = client_->SubmitJob(Spec(o));
  ASSERT_TRUE(job.ok()) << job.status();
  Watch(job->job_id());
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  for (const v1::RankAssignment& a : done->mesh().ranks()) EXPECT_NE(a.worker_address(), gone);
}

// A worker stopped cleanly mid-job leaves the registry on its way out, so
// the job fails at once naming that worker and why ("left: ..."), not after
// a lease or a peer's broken connection, and the other workers are freed.
TEST_F(JobsTest, AWorkerThatStopsMidJobFailsItNamingTheWorker) {
  const LongJob run = StartLongJobOn(3);
  ASSERT_GE(run.worker, 0);
  const std::string& job_id = run.job_id;
  const v1::MeshSpec& mesh = run.mesh;
  const int leaving = run.worker;
  workers_[leaving].process->Signal(SIGTERM);
  Watch(job_id);
  auto failed = client_->GetJob(job_id);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED) << failed->reason();
  EXPECT_TRUE(absl::StrContains(failed->reason(), absl::StrCat("rank 3 (worker ", mesh.ranks(3).worker_id())) &&
              absl::StrContains(failed->reason(), "left: the worker is shutting down"))
      << failed->reason();
  EXPECT_EQ(workers_[leaving].process->Wait(absl::Seconds(30)), 0) << Logs();
  EXPECT_TRUE(AllIdle(absl::Seconds(45), leaving)) << Logs();
}

// A worker stopped cleanly (SIGTERM) while its job saves checkpoints
// drains it (DrainMidRun): the job goes on from the drain's checkpoint on a
// new worker, with the uninterrupted run's losses, bit for bit, and no
// restart counted.
TEST_F(JobsTest, AWorkerStoppedMidRunDrainsItsJobWhichGoesOnFromTheDrainsCheckpoint) {
  ASSERT_NO_FATAL_FAILURE(DrainMidRun(Options(30), [&](int) {
    std::vector<testing::Daemon> joined = testing::StartTestWorkers(coordinator_.grpc, 1, {}, /*first=*/4);
    ASSERT_EQ(joined.size(), 1u);
    workers_.push_back(std::move(joined[0]));
  }));
}

// Workers that drain for at most 6 s, and a lease long enough that a
// SIGSTOPped worker is not found out by its heartbeats within a test.
class JobsShortDrainTest : public JobsTest {
 protected:
  JobsShortDrainTest() {
    coordinator_flags_ = {"--lease-duration", "30s"};
    worker_flags_ = {"--drain-timeout", "6s"};
  }

  // Waits until `log` (a daemon's) says `what`, for at most 30 s.
  static bool LogSays(const std::string& log, absl::string_view what) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline && !absl::StrContains(ReadFile(log), what)) absl::SleepFor(absl::Milliseconds(20));
    return absl::StrContains(ReadFile(log), what);
  }
};

// A drain that cannot end (the leaving rank's peer is SIGSTOPped: their
// collectives wait on it) holds the worker's exit for --drain-timeout and no
// longer, and a second signal ends it at once. Either way the worker exits 0
// having left the registry, its job fails naming it (no drain was agreed:
// nothing is placed again uncounted), and the stopped peer, continued, is
// idle again. Two tp=2 jobs side by side, one for each path.
TEST_F(JobsShortDrainTest, ADrainThatCannotEndLastsItsTimeoutOrEndsAtASecondSignal) {
  train::TrainOptions o = Options(100000);
  o.shard.layout.set_data_parallel_size(1);
  struct Run {
    std::string job_id;
    int stopped = -1, leaving = -1;
    std::string leaving_id;
  };
  std::vector<Run> runs(2);
  for (int i = 0; i < 2; ++i) {
    v1::JobSpec spec = Spec(o);
    spec.mutable_train()->set_checkpoint_every(1000);
    spec.mutable_train()->set_checkpoint_dir(TempPath(absl::StrCat("ck-short-drain-", i)));
    spec.mutable_restart()->set_max_restarts(0);
    auto job = client_->SubmitJob(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    runs[i].job_id = job->job_id();
  }
  for (Run& run : runs) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    absl::StatusOr<v1::Job> now = client_->GetJob(run.job_id);
    while (absl::Now() < deadline && now.ok() && now->step() < 2 && !JobManager::IsFinal(now->state())) {
      absl::SleepFor(absl::Milliseconds(20));
      now = client_->GetJob(run.job_id);
    }
    ASSERT_TRUE(now.ok() && now->step() >= 2 && !JobManager::IsFinal(now->state())) << Logs();
    run.stopped = WorkerOf(now->mesh(), 0);
    run.leaving = WorkerOf(now->mesh(), 1);
    run.leaving_id = now->mesh().ranks(1).worker_id();
    ASSERT_GE(run.stopped, 0);
    ASSERT_GE(run.leaving, 0);
  }
  for (const Run& run : runs) workers_[run.stopped].process->Signal(SIGSTOP);
  const absl::Time signalled = absl::Now();
  for (const Run& run : runs) workers_[run.leaving].process->Signal(SIGTERM);
  // The second job's leaving worker gets a second signal once it drains.
  const Daemon& interrupted = workers_[runs[1].leaving];
  ASSERT_TRUE(LogSays(interrupted.log, "draining its job")) << ReadFile(interrupted.log);
  const absl::Time second = absl::Now();
  interrupted.process->Signal(SIGTERM);
  ASSERT_EQ(interrupted.process->Wait(absl::Seconds(30)), 0) << ReadFile(interrupted.log);
  const absl::Duration after_second = absl::Now() - second;
  const std::string interrupted_log = ReadFile(interrupted.log);
  EXPECT_TRUE(absl::StrContains(interrupted_log, "the drain was interrupted (a second signal)")) << interrupted_log;
  EXPECT_FALSE(absl::StrContains(interrupted_log, "did not end within")) << interrupted_log;
  // The first job's leaving worker waits out its --drain-timeout, then
  // stops its rank (no longer: not the 30 s --comm-timeout of the
  // collective its rank waits in).
  const Daemon& timed_out = workers_[runs[0].leaving];
  ASSERT_EQ(timed_out.process->Wait(absl::Seconds(40)), 0) << ReadFile(timed_out.log);
  const absl::Duration after_first = absl::Now() - signalled;
  const std::string timed_out_log = ReadFile(timed_out.log);
  EXPECT_TRUE(absl::StrContains(timed_out_log, "draining its job")) << timed_out_log;
  EXPECT_TRUE(absl::StrContains(timed_out_log, "the drain did not end within --drain-timeout (6s)")) << timed_out_log;
  EXPECT_GE(after_first, absl::Seconds(6));
  EXPECT_LT(after_first, absl::Seconds(25)) << "the stuck rank is stopped at the drain's timeout";
  EXPECT_LT(after_second, absl::Seconds(3)) << "a second signal does not wait for the drain's timeout";
  std::printf(
      "a drain that cannot end: the worker exited %.2f s after its signal; one signalled again exited %.2f s "
      "after the second signal\n",
      absl::ToDoubleSeconds(after_first), absl::ToDoubleSeconds(after_second));
  for (const Run& run : runs) workers_[run.stopped].process->Signal(SIGCONT);
  for (const Run& run : runs) {
    Watch(run.job_id);
    auto failed = client_->GetJob(run.job_id);
    ASSERT_TRUE(failed.ok());
    EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED) << failed->reason();
    EXPECT_TRUE(absl::StrContains(failed->reason(), absl::StrCat("rank 1 (worker ", run.leaving_id)) &&
                absl::StrContains(failed->reason(), "left: the worker is shutting down"))
        << failed->reason();
    EXPECT_EQ(failed->generation(), 1) << "not placed again for a drain";
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(45);
  for (const Run& run : runs) {
    while (absl::Now() < deadline && StatusOf(workers_[run.stopped].grpc).state() != v1::WORKER_STATE_IDLE) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_EQ(StatusOf(workers_[run.stopped].grpc).state(), v1::WORKER_STATE_IDLE) << Logs();
  }
}

// A lease longer than the assignment deadline (--worker-rpc-timeout), so
// that a stopped worker is found out by its assignment, not by its heartbeats.
class JobsLongLeaseTest : public JobsTest {
 protected:
  JobsLongLeaseTest() { coordinator_flags_ = {"--lease-duration", "30s", "--worker-rpc-timeout", "3s"}; }
};

// A worker that does not answer its assignment (SIGSTOPped: AssignJob runs
// out its deadline) no longer fails the job: the ranks already started are
// stopped, the job goes back to PENDING saying why, and it is placed again
// under a new generation on the workers that answer, where it succeeds.
TEST_F(JobsLongLeaseTest, ARefusedAssignmentPlacesTheJobAgainElsewhere) {
  // Placement goes by device ordinal: ranks 0, 1, 2 on w0, w1, w2.
  const std::string stopped = workers_[2].grpc;
  workers_[2].process->Signal(SIGSTOP);
  train::TrainOptions o = Options(2);
  o.shard.layout.set_tensor_parallel_size(1);
  o.shard.layout.set_data_parallel_size(3);
  o.batch_size = 3;
  auto job = client_->SubmitJob(Spec(o));
  ASSERT_TRUE(job.ok()) << job.status();
  const std::vector<v1::JobEvent> events = Watch(job->job_id());
  workers_[2].process->Signal(SIGCONT);
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  EXPECT_EQ(done->generation(), 2);
  for (const v1::RankAssignment& a : done->mesh().ranks()) EXPECT_NE(a.worker_address(), stopped);
  bool requeued = false;
  for (const v1::JobEvent& e : events) {
    if (e.has_state_change() && e.state_change().state() == v1::JOB_STATE_PENDING &&
        absl::StrContains(e.state_change().reason(), "rank 2 (worker ") &&
        absl::StrContains(e.state_change().reason(), "refused the assignment") &&
        absl::StrContains(e.state_change().reason(),
                          "placing the job again without the refusing worker (the cluster's refusal")) {
      requeued = true;
    }
  }
  EXPECT_TRUE(requeued) << "no event says the job was placed again";
  // The ranks of the first placement that had started were stopped: every
  // answering worker is idle again.
  EXPECT_TRUE(AllIdle(absl::Seconds(20), /*except=*/2)) << Logs();
}

// A job bigger than the cluster waits, saying what it needs and what there
// is, and does not hold back a job behind it that fits (backfill); a job
// that fits the cluster but not its idle workers keeps its place (FIFO).
TEST_F(JobsTest, AJobTooBigForTheClusterWaitsWithoutBlockingTheQueue) {
  train::TrainOptions big = Options(2);
  big.shard.layout.set_tensor_parallel_size(4);
  big.shard.layout.set_data_parallel_size(2);
  auto waiting = client_->SubmitJob(Spec(big));
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  train::TrainOptions small = Options(2);
  small.shard.layout.set_tensor_parallel_size(1);
  small.shard.layout.set_data_parallel_size(1);
  auto job = client_->SubmitJob(Spec(small));
  ASSERT_TRUE(job.ok()) << job.status();
  Watch(job->job_id());
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  auto still = client_->GetJob(waiting->job_id());
  ASSERT_TRUE(still.ok());
  EXPECT_EQ(still->state(), v1::JOB_STATE_PENDING);
  EXPECT_TRUE(absl::StrContains(still->reason(), "needs 8 workers of one device kind; 4 registered (4 cpu, 0 cuda)"))
      << still->reason();
  ASSERT_TRUE(client_->CancelJob(waiting->job_id(), "test over").ok());
}

// Workers that declare 1.5 MB each (--memory-limit): the tiny GPT-2 at dp=4
// needs 2.35 MB a rank plainly (its f32 parameters, gradients, AdamW state
// and activations), 0.91 MB with ZeRO 2 and full recomputation. And a peak
// of 2 GFLOP/s each (--peak-tflops), which their jobs' MFU divides by.
class JobsSmallWorkersTest : public JobsTest {
 protected:
  JobsSmallWorkersTest() { worker_flags_ = {"--memory-limit", "1500000", "--peak-tflops", "0.002"}; }
};

TEST_F(JobsSmallWorkersTest, ZeroAndRecomputationAdmitAModelTheWorkersWereTooSmallFor) {
  train::TrainOptions o = Options(3);
  o.shard.layout.set_tensor_parallel_size(1);
  o.shard.layout.set_data_parallel_size(4);
  o.batch_size = 4;
  auto refused = client_->SubmitJob(Spec(o));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "the largest of the 4 registered workers has"))
      << refused.status();
  o.zero_stage = 2;
  o.shard.recompute = shardformer::Recompute::kFull;
  auto job = client_->SubmitJob(Spec(o));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_LT(job->memory_floor().total_bytes(), 1500000);
  EXPECT_GT(job->memory_floor().total_bytes(), 0);
  Watch(job->job_id());
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  EXPECT_EQ(done->step(), 3);
  // The summary's MFU: the run's model FLOPs over the 4 workers' declared
  // peak (recomputation earns nothing).
  const v1::RunSummary& sum = done->summary();
  auto config = ReadModelConfig(TempPath("gpt2"));
  ASSERT_TRUE(config.ok()) << config.status();
  auto flops = TrainFlopsPerToken(*config, o.seq_len);
  ASSERT_TRUE(flops.ok()) << flops.status();
  EXPECT_EQ(sum.model_flops_per_token(), *flops);
  EXPECT_EQ(sum.peak_flops_per_second(), 4 * 2e9);
  EXPECT_GT(sum.mfu(), 0);
  EXPECT_DOUBLE_EQ(sum.mfu(), sum.mean_tokens_per_second() * *flops / 8e9);
}

TEST_F(JobsTest, ModelsUploadedThroughTheCoordinatorTrainLikeModelsOnDisk) {
  auto uploaded = client_->UploadModel(TempPath("gpt2"), absl::Seconds(60));
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  EXPECT_EQ(std::vector<std::string>(uploaded->files().begin(), uploaded->files().end()),
            (std::vector<std::string>{"config.json", "model.safetensors"}));
  EXPECT_EQ(uploaded->bytes(), static_cast<int64_t>(std::filesystem::file_size(TempPath("gpt2/config.json")) +
                                                    std::filesystem::file_size(TempPath("gpt2/model.safetensors"))));
  v1::JobSpec spec = Spec(Options(3));
  spec.mutable_model()->clear_weights_path();
  spec.mutable_model()->set_upload_id("upload-999999");
  EXPECT_EQ(client_->SubmitJob(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.mutable_model()->set_upload_id(uploaded->upload_id());
  auto from_upload = client_->SubmitJob(spec);
  auto from_disk = client_->SubmitJob(Spec(Options(3)));
  ASSERT_TRUE(from_upload.ok() && from_disk.ok());
  std::vector<double> a, b;
  for (const v1::JobEvent& e : Watch(from_upload->job_id())) {
    if (e.has_step()) a.push_back(e.step().loss());
  }
  for (const v1::JobEvent& e : Watch(from_disk->job_id())) {
    if (e.has_step()) b.push_back(e.step().loss());
  }
  EXPECT_EQ(client_->GetJob(from_upload->job_id())->state(), v1::JOB_STATE_SUCCEEDED) << Logs();
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a, b);
  // Each worker downloaded it once into its work dir.
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(std::filesystem::exists(
        absl::StrCat(TempPath(absl::StrCat("work", i)), "/uploads/", uploaded->upload_id(), "/model.safetensors")));
  }
  // A model whose tokenizer.json has a field of the wrong type (json's
  // value() threw on it in the rank's thread, and every worker the job was
  // placed on ended): the job fails naming it, and the workers live on to
  // run the jobs below.
  const std::string hostile = TempPath("gpt2-hostile-tokenizer");
  std::filesystem::create_directories(hostile);
  for (const char* f : {"config.json", "model.safetensors"}) {
    std::filesystem::copy_file(TempPath(absl::StrCat("gpt2/", f)), absl::StrCat(hostile, "/", f),
                               std::filesystem::copy_options::overwrite_existing);
  }
  std::ofstream(hostile + "/tokenizer.json") << R"({"model": {"type": "BPE"}, "pre_tokenizer": {"type": 1}})";
  train::TrainOptions hostile_options = Options(2);
  hostile_options.model_dir = hostile;
  auto refused = client_->SubmitJob(Spec(hostile_options));
  ASSERT_TRUE(refused.ok()) << refused.status();
  Watch(refused->job_id());
  auto failed = client_->GetJob(refused->job_id());
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED) << Logs();
  EXPECT_TRUE(absl::StrContains(failed->reason(), "pre_tokenizer")) << failed->reason();
  auto workers = client_->ListWorkers(/*include_lost=*/false);
  ASSERT_TRUE(workers.ok());
  EXPECT_EQ(workers->size(), 4u) << Logs();

  // coloctl submit uploads by default.
  auto run = RunCommand({Runfile("client/coloctl"), "--coordinator", coordinator_.grpc, "submit", "--model",
                         TempPath("gpt2"), "--data", kGpl, "--tp", "2", "--dp", "2", "--steps", "2", "--batch-size",
                         "4", "--seq-len", "32", "--watch"},
                        TempPath(""), absl::Seconds(120));
  EXPECT_EQ(run.code, 0) << run.err << run.out;
  EXPECT_TRUE(absl::StrContains(run.err, "uploaded 2 files")) << run.err;
  EXPECT_TRUE(absl::StrContains(run.out, "succeeded")) << run.out;
  // A spec the coordinator would refuse is a usage error before anything
  // is uploaded.
  for (const std::vector<std::string>& bad :
       std::vector<std::vector<std::string>>{{"--steps", "-5"}, {"--lr", "nan"}, {"--tp", "0"}, {"--upload-timeout=0s"},
                                             {"--watch-timeout=-1s"}}) {
    std::vector<std::string> argv = {Runfile("client/coloctl"), "--coordinator", coordinator_.grpc, "submit",
                                     "--model", TempPath("gpt2"), "--data", kGpl, "--batch-size", "4"};
    argv.insert(argv.end(), bad.begin(), bad.end());
    auto refused = RunCommand(argv, TempPath(""), absl::Seconds(60));
    EXPECT_EQ(refused.code, 2) << bad[0] << ": " << refused.err << refused.out;
    EXPECT_FALSE(absl::StrContains(refused.err, "uploaded")) << refused.err;
  }
  // An upload past --upload-timeout says so, and is not "unreachable" (69:
  // a retry as it is ends the same way).
  auto slow =
      RunCommand({Runfile("client/coloctl"), "--coordinator", coordinator_.grpc, "submit", "--model", TempPath("gpt2"),
                  "--data", kGpl, "--batch-size", "4", "--seq-len", "32", "--upload-timeout=1us"},
                 TempPath(""), absl::Seconds(60));
  EXPECT_EQ(slow.code, 1) << slow.err;
  EXPECT_TRUE(absl::StrContains(slow.err, "did not finish within --upload-timeout 1us")) << slow.err;

  // A YAML job file, sent as it is (the workers read the weights' path).
  std::ofstream(TempPath("job.yaml")) << "name: from-yaml\nkind: JOB_KIND_TRAIN\nmodel:\n  weightsPath: "
                                      << TempPath("gpt2") << "\n  configJson: '"
                                      << ReadFile(TempPath("gpt2/config.json")) << "'\n"
                                      << "shard: {tensorParallelSize: 2, dataParallelSize: 2}\n"
                                      << "train: {steps: 2, batchSize: 4, seqLen: 32, learningRate: 1e-3, dataPath: "
                                      << kGpl << "}\n";
  auto yaml = RunCommand({Runfile("client/coloctl"), "--coordinator", coordinator_.grpc, "submit", "--job-file",
                          TempPath("job.yaml"), "--watch"},
                         TempPath(""), absl::Seconds(120));
  EXPECT_EQ(yaml.code, 0) << yaml.err << yaml.out;
  auto jobs = client_->ListJobs();
  ASSERT_TRUE(jobs.ok());
  EXPECT_EQ(jobs->back().spec().name(), "from-yaml");
  EXPECT_EQ(jobs->back().state(), v1::JOB_STATE_SUCCEEDED);
  // A watch that ends before its job does names the job (with --output
  // json its events would have been the only place of the id).
  auto unwatched = RunCommand({Runfile("client/coloctl"), "--coordinator", coordinator_.grpc, "submit", "--job-file",
                               TempPath("job.yaml"), "--watch", "--watch-timeout=1ms", "--output", "json"},
                              TempPath(""), absl::Seconds(60));
  EXPECT_EQ(unwatched.code, 1) << unwatched.err << unwatched.out;
  auto listed = client_->ListJobs();
  ASSERT_TRUE(listed.ok());
  const std::string unwatched_id = listed->back().job_id();
  EXPECT_NE(unwatched_id, jobs->back().job_id());
  EXPECT_TRUE(absl::StrContains(unwatched.err, absl::StrCat("watching ", unwatched_id, ": WatchJob to coordinator")))
      << unwatched.err;
  (void)client_->CancelJob(unwatched_id);  // (or it ended already)
  Watch(unwatched_id);

  // A TENSOR job submitted again with the same --request-id is the same job
  // (a retried submit must not hold a second set of workers).
  std::vector<std::string> tensor_ids;
  for (int i = 0; i < 2; ++i) {
    auto t = RunCommand({Runfile("client/coloctl"), "--coordinator", coordinator_.grpc, "submit", "--kind", "tensor",
                         "--tp", "2", "--dp", "2", "--request-id", "tensor-once"},
                        TempPath(""), absl::Seconds(60));
    EXPECT_EQ(t.code, 0) << t.err << t.out;
    tensor_ids.push_back(std::string(absl::StripAsciiWhitespace(t.out)));
  }
  EXPECT_EQ(tensor_ids[0], tensor_ids[1]);
  EXPECT_TRUE(absl::StartsWith(tensor_ids[0], "job-")) << tensor_ids[0];
  EXPECT_TRUE(client_->CancelJob(tensor_ids[0]).ok());
}

// The coordinator SIGKILLed mid-job and started again on its data dir: the
// workers register again, their orphaned ranks are stopped, and the job
// (RESTARTING, "the coordinator restarted") is placed again by itself under
// a new generation, resumes from its newest checkpoint and SUCCEEDS with the
// uninterrupted losses. A worker is held (SIGSTOP) through the outage so
// that the ranks cannot finish unseen. The test prints restart-to-running.
// A coordinator SIGKILLed while every rank trains, and restarted on its
// data dir a second later: the ranks keep training and rank 0 keeps the
// steps it cannot report, sends them when the coordinator is back (the
// coordinator records a step of the earlier generation it lacks), the job
// resumes from its newest checkpoint, and the re-run steps are not recorded
// again: the watch stream holds every step's loss exactly once, the
// uninterrupted run's.
TEST_F(JobsTest, ACoordinatorKilledWhileRanksTrainLeavesNoHoleInTheHistory) {
  train::TrainOptions o = Options(40);
  std::vector<double> want;
  ASSERT_TRUE(train::Train(o, [&](const train::StepStats& s) { want.push_back(s.loss); }).ok());
  v1::JobSpec spec = Spec(o);
  spec.mutable_train()->set_checkpoint_every(4);
  spec.mutable_train()->set_checkpoint_dir(TempPath("ck-hole"));
  auto job = client_->SubmitJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (absl::Now() < deadline && client_->GetJob(job->job_id())->step() < 5) absl::SleepFor(absl::Milliseconds(5));
  const int64_t recorded = client_->GetJob(job->job_id())->step();
  ASSERT_GE(recorded, 5) << Logs();
  const std::string address = coordinator_.grpc;
  coordinator_.process->Signal(SIGKILL);
  coordinator_.process->Wait(absl::Seconds(10));
  // The ranks train on, unheard, until a checkpoint lies past a step the
  // coordinator never recorded: the job resumes after it, so only rank 0's
  // late reports can fill that step in.
  int64_t past = 0;
  const absl::Time wait_until = absl::Now() + absl::Seconds(60);
  while (past <= recorded + 1 && absl::Now() < wait_until) {
    absl::SleepFor(absl::Milliseconds(20));
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(TempPath("ck-hole"), ec)) {
      int64_t n = 0;
      const std::string name = entry.path().filename().string();
      if (absl::StartsWith(name, "step-") && !absl::EndsWith(name, ".tmp") &&
          absl::SimpleAtoi(name.substr(5), &n)) {
        past = std::max(past, n);
      }
    }
  }
  ASSERT_GT(past, recorded + 1) << Logs();
  StartCoordinator(address);
  const std::vector<v1::JobEvent> events = Watch(job->job_id());
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  EXPECT_GE(done->generation(), 2);
  std::map<int64_t, int> seen;
  std::map<int64_t, double> losses;
  bool restarting = false, late = false;
  for (const v1::JobEvent& e : events) {
    restarting = restarting || (e.has_state_change() && e.state_change().state() == v1::JOB_STATE_RESTARTING);
    if (!e.has_step()) continue;
    ++seen[e.step().step()];
    losses[e.step().step()] = e.step().loss();
    late = late || (restarting && e.step().step() <= past);  // the new generation resumes after `past`
  }
  EXPECT_TRUE(late) << "no step up to " << past << " was recorded after the restart: none came late";
  EXPECT_EQ(losses.size(), want.size()) << Logs();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(seen[i + 1], 1) << "step " << i + 1;
    EXPECT_EQ(losses[i + 1], want[i]) << "step " << i + 1;
  }
  EXPECT_EQ(done->step(), 40);
  // The last checkpoint is this job's, written through its generation's
  // temporary directory (the worker passes the job and generation down),
  // and no temporary directory is left. Which generation wrote it depends
  // on the machine: unheard, the first generation's ranks may train to the
  // end before the coordinator is back (the next then resumes at step 40
  // and trains nothing); otherwise the last one does.
  std::ifstream state_file(TempPath("ck-hole") + "/step-000040/train_state.json");
  const nlohmann::json state = nlohmann::json::parse(state_file, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(state.is_object()) << Logs();
  EXPECT_EQ(state.value("job", ""), absl::StrCat(job->job_id(), "_", job->uid()));
  const int64_t wrote = state.value("generation", int64_t{0});
  if (wrote != done->generation()) {
    // Only a generation that trained nothing after it (it resumed at 40:
    // a resumed run's first step says where from) leaves an earlier one's.
    EXPECT_GE(wrote, 1);
    EXPECT_LT(wrote, done->generation());
    bool after_restart = false, resumed_step = false;
    for (const v1::JobEvent& e : events) {
      after_restart |= e.has_state_change() && e.state_change().state() == v1::JOB_STATE_RESTARTING;
      resumed_step |= after_restart && e.has_step() && !e.step().resumed_from().empty();
    }
    EXPECT_FALSE(resumed_step) << "generation " << wrote << " wrote step 40, though generation "
                               << done->generation() << " trained after it";
  }
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(TempPath("ck-hole"), ec)) {
    EXPECT_FALSE(absl::EndsWith(entry.path().filename().string(), ".tmp")) << entry.path();
  }
}

// A coordinator that stops answering (SIGSTOP: its connections stay open,
// nothing resets them) ends a watch in about the keepalive's time and one
// reconnect, UNAVAILABLE: never at the watch's own deadline (a day, from
// coloctl), as it did before the channels pinged.
TEST_F(JobsTest, AWatchOfACoordinatorThatStopsAnsweringEndsUnavailable) {
  auto job = client_->SubmitJob(Spec(Options(100000)));
  ASSERT_TRUE(job.ok()) << job.status();
  CoordinatorClient::Options options;
  options.keepalive = Keepalive{.time = absl::Seconds(1), .timeout = absl::Seconds(1)};
  options.watch_reconnect_limit = absl::Seconds(2);
  auto watcher = CoordinatorClient::Create(coordinator_.grpc, options);
  ASSERT_TRUE(watcher.ok()) << watcher.status();
  bool stopped = false;
  absl::Time since;
  const absl::Status watched = (*watcher)->WatchJob(job->job_id(), 1, absl::Minutes(3), [&](const v1::JobEvent& e) {
    if (!stopped && e.has_step()) {
      coordinator_.process->Signal(SIGSTOP);
      stopped = true;
      since = absl::Now();
    }
    return true;
  });
  const absl::Duration took = absl::Now() - since;
  if (stopped) coordinator_.process->Signal(SIGCONT);
  ASSERT_TRUE(stopped) << watched << "\n" << Logs();
  EXPECT_EQ(watched.code(), absl::StatusCode::kUnavailable) << watched;
  EXPECT_NE(watched.message().find("while watching"), std::string::npos) << watched;
  // Keepalive's 2 s, then the 2 s limit: not gRPC's 20 s connect timeout
  // (the stopped process's kernel accepts the reconnection).
  EXPECT_LT(took, absl::Seconds(12)) << watched;
  // Back, it answers on the same channel kind.
  EXPECT_TRUE(client_->CancelJob(job->job_id()).ok());
  (*watcher).reset();
}

TEST_F(JobsTest, ACoordinatorKilledMidJobResumesItByItself) {
  train::TrainOptions o = Options(30);
  std::vector<double> want;
  ASSERT_TRUE(train::Train(o, [&](const train::StepStats& s) { want.push_back(s.loss); }).ok());
  v1::JobSpec spec = Spec(o);
  spec.mutable_train()->set_checkpoint_every(5);
  spec.mutable_train()->set_checkpoint_dir(TempPath("ck-coordinator"));
  auto job = client_->SubmitJob(spec, "the-request");
  ASSERT_TRUE(job.ok()) << job.status();
  auto queued = client_->SubmitJob(Spec(Options(2)));  // waits behind it, all 4 workers busy
  ASSERT_TRUE(queued.ok()) << queued.status();
  v1::MeshSpec mesh;
  int held = -1;
  ASSERT_TRUE(RunUntilStepThenStop(job->job_id(), 7, 3, &mesh, &held));
  const std::string address = coordinator_.grpc;
  coordinator_.process->Signal(SIGKILL);
  coordinator_.process->Wait(absl::Seconds(10));
  const absl::Time restarted = absl::Now();
  StartCoordinator(address);
  workers_[held].process->Signal(SIGCONT);
  auto back = client_->GetJob(job->job_id());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->state(), v1::JOB_STATE_RESTARTING) << back->reason();
  EXPECT_EQ(client_->GetJob(queued->job_id())->state(), v1::JOB_STATE_PENDING);
  // A submit retried with its request id is still recognized.
  auto retried = client_->SubmitJob(spec, "the-request");
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->job_id(), job->job_id());
  absl::Time running = absl::InfiniteFuture();
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    auto j = client_->GetJob(job->job_id());
    if (j.ok() && j->generation() >= 2 && j->state() == v1::JOB_STATE_RUNNING) {
      running = absl::Now();
      break;
    }
    if (j.ok() && JobManager::IsFinal(j->state())) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_LT(running, absl::InfiniteFuture()) << client_->GetJob(job->job_id())->DebugString() << Logs();
  std::printf("coordinator restart to the job running again: %.2f s\n", absl::ToDoubleSeconds(running - restarted));
  const std::vector<v1::JobEvent> events = Watch(job->job_id());
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  EXPECT_EQ(done->generation(), 2);
  EXPECT_EQ(done->restarts(), 0);  // not the job's failure
  bool said = false;
  for (const v1::JobEvent& e : events) {
    said = said || (e.has_state_change() && e.state_change().state() == v1::JOB_STATE_RESTARTING &&
                    absl::StrContains(e.state_change().reason(), "the coordinator restarted while the job ran"));
  }
  EXPECT_TRUE(said) << "no RESTARTING event says the coordinator restarted";
  ASSERT_NO_FATAL_FAILURE(ExpectLastLosses(events, want));
  // The queued job runs after it.
  Watch(queued->job_id());
  EXPECT_EQ(client_->GetJob(queued->job_id())->state(), v1::JOB_STATE_SUCCEEDED) << Logs();
  // Counted by the new coordinator (within the sweeper's 200 ms period).
  const absl::Time counted = absl::Now() + absl::Seconds(10);
  while (absl::Now() < counted && JobsFinished(coordinator_.metrics, "succeeded") < 2) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(JobsFinished(coordinator_.metrics, "succeeded"), 2);
  EXPECT_EQ(JobsFinished(coordinator_.metrics, "failed"), 0);
}

// With no restarts allowed, a coordinator restart fails the running job
// naming the checkpoint to resume from, and stops its ranks.
TEST_F(JobsTest, ACoordinatorRestartFailsAJobThatMayNotRestart) {
  const std::string job_id = StartLongJob(/*max_restarts=*/0);
  ASSERT_FALSE(job_id.empty());
  const std::string address = coordinator_.grpc;
  coordinator_.process->Signal(SIGTERM);
  ASSERT_EQ(coordinator_.process->Wait(absl::Seconds(30)), 0) << ReadFile(coordinator_.log);
  StartCoordinator(address);
  auto failed = client_->GetJob(job_id);
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(failed->reason(), "coordinator restarted")) << failed->reason();
  EXPECT_EQ(JobsFinished(coordinator_.metrics, "failed"), 1);
  // The workers register again, are told to stop the orphaned ranks, and
  // go back to idle.
  EXPECT_TRUE(AllIdle(absl::Seconds(30))) << Logs();
}

}  // namespace
}  // namespace colod
