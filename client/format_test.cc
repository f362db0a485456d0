#include "client/format.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

TEST(RenderTable, PadsColumnsToTheWidestCell) {
  EXPECT_EQ(RenderTable({"A", "BB"}, {{"xxx", "y"}, {"z", "wwww"}}),
            "A    BB\n"
            "xxx  y\n"
            "z    wwww\n");
}

TEST(RenderWorkersTable, ShowsDeviceStateAndHeartbeatAge) {
  v1::Worker w;
  w.mutable_info()->set_worker_id("worker-000001");
  w.mutable_info()->set_address("127.0.0.1:7071");
  w.mutable_info()->set_host("node1");
  w.mutable_info()->set_device_kind(v1::DEVICE_KIND_CUDA);
  w.mutable_info()->set_device_ordinal(3);
  w.mutable_info()->set_device_name("H100");
  w.set_state(v1::WORKER_STATE_IDLE);
  w.mutable_last_heartbeat_time()->set_seconds(1000);
  w.mutable_info()->set_version("0.51.0");
  const std::string table = RenderWorkersTable({w}, absl::FromUnixSeconds(1002));
  EXPECT_EQ(table,
            "ID             ADDRESS         HOST   DEVICE         STATE  LAST HEARTBEAT  VERSION\n"
            "worker-000001  127.0.0.1:7071  node1  cuda:3 (H100)  idle   2.0s ago        0.51.0\n");
  // A lost worker says why.
  w.set_state(v1::WORKER_STATE_LOST);
  w.set_lost_reason("left: shutting down");
  EXPECT_NE(RenderWorkersTable({w}, absl::FromUnixSeconds(1002)).find("  lost (left: shutting down)  2.0s ago"),
            std::string::npos);
}

TEST(RenderJson, UsesProto3JsonNames) {
  v1::Worker w;
  w.mutable_info()->set_worker_id("worker-000001");
  w.set_state(v1::WORKER_STATE_LOST);
  auto json = RenderJson(w, /*pretty=*/false);
  ASSERT_TRUE(json.ok());
  EXPECT_NE(json->find("\"workerId\":\"worker-000001\""), std::string::npos) << *json;
  EXPECT_NE(json->find("\"state\":\"WORKER_STATE_LOST\""), std::string::npos) << *json;
}

// `checkpoints --output json` is the checkpoints alone, not a Job of
// empty fields around them.
TEST(RenderCheckpointsJson, IsTheCheckpointsAlone) {
  v1::Job job;
  job.set_job_id("job-000001");
  job.set_state(v1::JOB_STATE_RUNNING);
  EXPECT_EQ(*RenderCheckpointsJson(job, false), "{\"checkpoints\":[]}\n");
  v1::CheckpointInfo* c = job.add_checkpoints();
  c->set_path("/ck/step-000002");
  c->set_step(2);
  c->set_eval_loss(1.5);
  c->set_bytes(4096);
  job.add_checkpoints()->set_step(4);
  EXPECT_EQ(*RenderCheckpointsJson(job, false),
            "{\"checkpoints\":[{\"path\":\"/ck/step-000002\",\"step\":\"2\",\"bytes\":\"4096\",\"evalLoss\":1.5},"
            "{\"path\":\"\",\"step\":\"4\",\"bytes\":\"0\"}]}\n");
  const std::string pretty = *RenderCheckpointsJson(job, true);
  EXPECT_EQ(pretty.find("jobId"), std::string::npos) << pretty;
  EXPECT_NE(pretty.find("\"checkpoints\": [\n  {\"path\":\"/ck/step-000002\""), std::string::npos) << pretty;
}

TEST(Sparkline, MapsTheRangeOntoEightLevelsAndAveragesLongSeries) {
  EXPECT_EQ(Sparkline({1, 2, 3, 4, 5, 6, 7, 8}, 60), "\u2581\u2582\u2583\u2584\u2585\u2586\u2587\u2588");
  EXPECT_EQ(Sparkline({5, 5, 5}, 60), "\u2581\u2581\u2581");
  // 4 values into 2 buckets: means 1.5 and 3.5, the low and the high end.
  EXPECT_EQ(Sparkline({1, 2, 3, 4}, 2), "\u2581\u2588");
  EXPECT_EQ(Sparkline({}, 10), "");
}

TEST(Sparkline, ADivergedRunsNonFiniteLossesAreMarkedAndScaleNothing) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(Sparkline({1, 8, nan, inf}, 60), "\u2581\u2588!!");
  EXPECT_EQ(Sparkline({nan, nan}, 60), "!!");
  EXPECT_EQ(Sparkline({-inf, 2, 3}, 60), "!\u2581\u2588");
  EXPECT_EQ(Sparkline({-1e308, 1e308}, 60), "\u2581\u2588");  // a span past the largest double
}

TEST(RenderRunCurves, ALateStepTakesItsPlaceByStep) {
  // Steps 1, 2, 4, then 3 (a restarted coordinator heard it late): the
  // curve rises 1..4 in step order, the last loss is step 4's.
  const std::string out = RenderRunCurves({{1, 1.0}, {2, 2.0}, {4, 4.0}, {3, 3.0}}, 400, {{4, 0.5}, {2, 0.25}});
  EXPECT_NE(out.find("loss 1.0000 -> 4.0000 over 4 steps (min 1.0000), mean 100 tokens/s\n"), std::string::npos)
      << out;
  EXPECT_NE(out.find("loss curve \u2581\u2583\u2586\u2588\n"), std::string::npos) << out;
  EXPECT_NE(out.find("eval curve \u2581\u2588\n"), std::string::npos) << out;
  EXPECT_EQ(RenderRunCurves({}, 0, {}), "");
  // One evaluation draws no curve.
  EXPECT_EQ(RenderRunCurves({{1, 2.0}}, 10, {{1, 1.0}}).find("eval curve"), std::string::npos);
}

TEST(RenderMesh, DrawsDpRowsTpColumnsAndEveryGroup) {
  v1::MeshSpec mesh;
  mesh.set_world_size(4);
  auto* dp = mesh.add_axes();
  dp->set_name("dp");
  dp->set_size(2);
  auto* tp = mesh.add_axes();
  tp->set_name("tp");
  tp->set_size(2);
  for (int r = 0; r < 4; ++r) {
    auto* a = mesh.add_ranks();
    a->set_rank(r);
    a->set_worker_id(absl::StrCat("w", r));
    a->set_host("h");
    a->set_device_ordinal(r);
  }
  auto* g = mesh.add_groups();
  g->set_axis("tp");
  g->set_index(1);
  g->add_ranks(2);
  g->add_ranks(3);
  EXPECT_EQ(RenderMesh(mesh),
            "4 ranks, axes dp=2 x tp=2 (outermost first)\n\n"
            "     tp0            tp1\n"
            "dp0  rank 0 w0@h:0  rank 1 w1@h:1\n"
            "dp1  rank 2 w2@h:2  rank 3 w3@h:3\n"
            "\ngroups:\n"
            "  tp1: {2,3}\n");
}

TEST(RenderMesh, DrawsARowPerPipelineStageOfEachReplica) {
  v1::MeshSpec mesh;
  mesh.set_world_size(8);
  for (const char* name : {"dp", "pp", "tp"}) {
    auto* a = mesh.add_axes();
    a->set_name(name);
    a->set_size(2);
  }
  auto* g = mesh.add_groups();
  g->set_axis("pp");
  g->set_index(0);
  g->add_ranks(0);
  g->add_ranks(2);
  const std::string drawn = RenderMesh(mesh);
  EXPECT_NE(drawn.find("8 ranks, axes dp=2 x pp=2 x tp=2 (outermost first)"), std::string::npos) << drawn;
  EXPECT_NE(drawn.find("dp0 pp1  rank 2"), std::string::npos) << drawn;
  EXPECT_NE(drawn.find("dp1 pp0  rank 4"), std::string::npos) << drawn;
  EXPECT_NE(drawn.find("  pp0: {0,2}"), std::string::npos) << drawn;
}

TEST(RenderJobsTable, ShowsLayoutProgressAndReason) {
  v1::Job j;
  j.set_job_id("job-000007");
  j.mutable_spec()->set_name("tiny");
  j.mutable_spec()->set_kind(v1::JOB_KIND_TRAIN);
  j.mutable_spec()->mutable_shard()->set_tensor_parallel_size(4);
  j.mutable_spec()->mutable_shard()->set_data_parallel_size(2);
  j.mutable_spec()->mutable_shard()->set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
  j.mutable_spec()->mutable_train()->set_steps(10);
  j.set_state(v1::JOB_STATE_RUNNING);
  j.set_step(3);
  j.set_loss(2.5);
  j.set_reason("all 8 ranks are training");
  const std::string table = RenderJobsTable({j}, absl::Now());
  EXPECT_NE(table.find("job-000007  tiny  train  running  tp4 x dp2 2d  3/10  2.5000"), std::string::npos) << table;
  EXPECT_NE(table.find("all 8 ranks are training"), std::string::npos) << table;
}

TEST(RenderJob, ShowsRestartsAndEveryAttempt) {
  v1::Job j;
  j.set_job_id("job-000008");
  j.mutable_spec()->set_kind(v1::JOB_KIND_TRAIN);
  j.set_state(v1::JOB_STATE_RESTARTING);
  j.set_reason("rank 1 (worker w1 at a:1) was lost; restarting (restart 2 of 3)");
  j.set_restarts(2);
  j.add_attempt_failures("rank 0 (worker w0 at a:0): UNAVAILABLE: connection reset");
  j.add_attempt_failures("rank 1 (worker w1 at a:1) was lost");
  const std::string out = RenderJob(j, absl::Now());
  EXPECT_NE(out.find("state:      restarting: rank 1 (worker w1 at a:1) was lost; restarting (restart 2 of 3)\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("restarts:   2\n  attempt 1: rank 0 (worker w0 at a:0): UNAVAILABLE: connection reset\n"
                     "  attempt 2: rank 1 (worker w1 at a:1) was lost\n"),
            std::string::npos)
      << out;
  j.set_restarts(0);
  j.clear_attempt_failures();
  EXPECT_EQ(RenderJob(j, absl::Now()).find("restarts:"), std::string::npos);
  EXPECT_EQ(RenderJob(j, absl::Now()).find("stalled:"), std::string::npos);
  j.set_stalled("collective #41 (all_reduce) of group tp/2_3 pending for 7s on ranks 2; not entered by rank 3");
  EXPECT_NE(RenderJob(j, absl::Now()).find("stalled:    collective #41 (all_reduce) of group tp/2_3"), std::string::npos);
  // Its durations are as of the report, which says when it came; once the
  // job ended it is its last hang, not a stall.
  const absl::Time now = absl::FromUnixSeconds(1'800'000'100);
  j.mutable_stalled_time()->set_seconds(1'800'000'090);
  EXPECT_NE(RenderJob(j, now).find("not entered by rank 3 (reported 10.0s ago)\n"), std::string::npos)
      << RenderJob(j, now);
  j.set_state(v1::JOB_STATE_FAILED);
  EXPECT_NE(RenderJob(j, now).find("last hang:  collective #41"), std::string::npos) << RenderJob(j, now);
  EXPECT_EQ(RenderJob(j, now).find("stalled:"), std::string::npos);
}

// The model's weights: a path every worker reads, or an upload (submit's
// default), which has no path.
TEST(RenderJob, NamesTheWeightsPathOrTheUpload) {
  v1::Job j;
  j.set_job_id("job-000009");
  j.mutable_spec()->mutable_model()->set_weights_path("/models/gpt2");
  EXPECT_NE(RenderJob(j, absl::Now()).find("weights:    /models/gpt2\n"), std::string::npos) << RenderJob(j, absl::Now());
  j.mutable_spec()->mutable_model()->clear_weights_path();
  j.mutable_spec()->mutable_model()->set_upload_id("upload-1f2e");
  EXPECT_NE(RenderJob(j, absl::Now()).find("weights:    upload upload-1f2e\n"), std::string::npos)
      << RenderJob(j, absl::Now());
}

TEST(Format, CheckpointsListTheBestAndTheLatest) {
  v1::Job j;
  for (const auto& [step, loss] : std::vector<std::pair<int64_t, double>>{{20, 2.25}, {50, 2.5}, {60, 2.75}}) {
    v1::CheckpointInfo* c = j.add_checkpoints();
    c->set_step(step);
    c->set_eval_loss(loss);
    c->set_bytes(3 << 20);
    c->set_path(absl::StrCat("/ck/step-0000", step));
  }
  j.add_checkpoints()->set_step(70);  // not evaluated
  const std::string out = RenderCheckpoints(j);
  EXPECT_NE(out.find("20    2.250000   3.00 MiB  /ck/step-000020  best"), std::string::npos) << out;
  EXPECT_NE(out.find("70    -          0 B"), std::string::npos) << out;
  EXPECT_NE(out.find("latest (a restart resumes here)"), std::string::npos) << out;
  EXPECT_EQ(HumanBytes(1536), "1.50 KiB");
}

TEST(Format, AJobShowsItsLastAndBestEvaluation) {
  v1::Job j;
  j.set_job_id("job-000004");
  j.mutable_spec()->set_kind(v1::JOB_KIND_TRAIN);
  EXPECT_EQ(RenderJob(j, absl::Now()).find("eval:"), std::string::npos);
  v1::EvalResult* last = j.mutable_last_eval();
  last->set_step(30);
  last->set_loss(2.5);
  last->set_perplexity(std::exp(2.5));
  v1::EvalResult* best = j.mutable_best_eval();
  best->set_step(20);
  best->set_loss(2.25);
  best->set_accuracy(0.875);
  best->set_checkpoint("/ck/step-000020");
  v1::RunSummary* run = j.mutable_summary();
  run->set_steps(30);
  run->set_tokens(30 * 4096);
  run->mutable_train_time()->set_seconds(12);
  run->mutable_wall_time()->set_seconds(15);
  run->set_mean_tokens_per_second(10240);
  run->set_last_tokens_per_second(10500.4);
  const std::string out = RenderJob(j, absl::Now());
  EXPECT_NE(out.find("eval:       loss 2.500000  perplexity 12.18  after step 30\n"), std::string::npos) << out;
  EXPECT_NE(out.find("run:        30 steps, 122880 tokens in 12s of steps (wall 15s); 10240 tokens/s mean, 10500 "
                     "last\n"),
            std::string::npos)
      << out;
  run->set_skipped_updates(2);  // fp16's overflowed steps are told apart
  EXPECT_NE(RenderJob(j, absl::Now())
                .find("run:        30 steps (2 overflowed in fp16 and updated nothing), 122880 tokens in 12s"),
            std::string::npos)
      << RenderJob(j, absl::Now());
  run->set_skipped_updates(0);
  EXPECT_NE(out.find("best eval:  loss 2.250000  accuracy 87.50%  after step 20  (/ck/step-000020)\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("mfu:        unknown (no FLOPs per token for this model)\n"), std::string::npos) << out;
  run->set_model_flops_per_token(7.5e8);
  EXPECT_NE(RenderJob(j, absl::Now()).find("mfu:        unknown (a device's peak is not known: colod-worker "
                                           "--peak-tflops)\n"),
            std::string::npos);
  run->set_peak_flops_per_second(4 * 989.4e12);
  run->set_mfu(10240 * 7.5e8 / (4 * 989.4e12));
  EXPECT_NE(RenderJob(j, absl::Now()).find("mfu:        0.19% (7.5e+08 model FLOPs a token; peak 3958 TFLOP/s)\n"),
            std::string::npos)
      << RenderJob(j, absl::Now());
}

TEST(LossScaleSuffix, ShowsAnFp16StepsScaleAndWhetherItUpdated) {
  v1::StepProgress p;
  EXPECT_EQ(LossScaleSuffix(p), "");  // another precision
  p.set_loss_scale(65536);
  EXPECT_EQ(LossScaleSuffix(p), "  loss_scale 65536");
  p.set_loss_scale(1024);
  p.set_update_skipped(true);
  EXPECT_EQ(LossScaleSuffix(p), "  loss_scale 1024 (overflowed: no update)");
}

}  // namespace
}  // namespace colod
