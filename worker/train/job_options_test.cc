// A TRAIN spec as training options and back: the precision a spec leaves
// unspecified is the device's (bf16 on CUDA, f32 on the CPU), and the fields
// survive the round trip.
#include "worker/train/job_options.h"

#include "gtest/gtest.h"

namespace colod::train {
namespace {

TEST(JobOptions, AnUnspecifiedPrecisionIsTheDevicesDefault) {
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_TRAIN);
  ASSERT_EQ(spec.train().precision(), v1::PRECISION_UNSPECIFIED);
  absl::StatusOr<TrainOptions> cpu = TrainOptionsFromSpec(spec, "/m", /*cuda=*/false);
  absl::StatusOr<TrainOptions> gpu = TrainOptionsFromSpec(spec, "/m", /*cuda=*/true);
  ASSERT_TRUE(cpu.ok() && gpu.ok()) << cpu.status() << gpu.status();
  EXPECT_EQ(cpu->shard.param_dtype, DType::kF32);
  EXPECT_FALSE(cpu->cuda);
  EXPECT_EQ(gpu->shard.param_dtype, DType::kBF16);
  EXPECT_TRUE(gpu->cuda);
  // A precision the spec names holds on every device.
  for (auto [precision, dtype] :
       {std::pair{v1::PRECISION_FP32, DType::kF32}, std::pair{v1::PRECISION_BF16_MIXED, DType::kBF16}}) {
    spec.mutable_train()->set_precision(precision);
    for (bool cuda : {false, true}) {
      absl::StatusOr<TrainOptions> o = TrainOptionsFromSpec(spec, "/m", cuda);
      ASSERT_TRUE(o.ok()) << o.status();
      EXPECT_EQ(o->shard.param_dtype, dtype) << precision << " cuda " << cuda;
    }
  }
  // fp16 trains with its loss scaled: GradScaler's defaults unless the
  // spec names a scale and window.
  spec.mutable_train()->set_precision(v1::PRECISION_FP16_MIXED);
  for (bool cuda : {false, true}) {
    absl::StatusOr<TrainOptions> fp16 = TrainOptionsFromSpec(spec, "/m", cuda);
    ASSERT_TRUE(fp16.ok()) << fp16.status();
    EXPECT_EQ(fp16->shard.param_dtype, DType::kF16);
    EXPECT_EQ(fp16->loss_scale, 65536);
    EXPECT_EQ(fp16->loss_scale_window, 2000);
  }
  spec.mutable_train()->set_loss_scale(256);
  spec.mutable_train()->set_loss_scale_window(50);
  absl::StatusOr<TrainOptions> scaled = TrainOptionsFromSpec(spec, "/m", false);
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  EXPECT_EQ(scaled->loss_scale, 256);
  EXPECT_EQ(scaled->loss_scale_window, 50);
  spec.mutable_train()->set_precision(static_cast<v1::Precision>(99));
  EXPECT_EQ(TrainOptionsFromSpec(spec, "/m", true).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(JobOptions, TheFieldsSurviveTheRoundTrip) {
  TrainOptions o;
  o.data_path = "/data/corpus.bin";
  o.labels_path = "/data/labels.npy";
  o.steps = 17;
  o.batch_size = 12;
  o.seq_len = 48;
  o.lr = 2e-3;
  o.min_lr = 2e-4;
  o.warmup_steps = 3;
  o.clip_norm = 0.5;
  o.seed = 9;
  o.bucket_bytes = 1 << 20;
  o.zero_stage = 2;
  o.shard.recompute = shardformer::Recompute::kSelective;
  o.allow_tf32 = true;
  o.shard.param_dtype = DType::kF32;
  o.shard.layout.set_tensor_parallel_size(2);
  const v1::JobSpec spec = SpecFromTrainOptions(o);
  EXPECT_TRUE(spec.train().allow_tf32());
  EXPECT_EQ(spec.train().precision(), v1::PRECISION_FP32);
  absl::StatusOr<TrainOptions> back = TrainOptionsFromSpec(spec, "/m", /*cuda=*/true);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->allow_tf32);
  EXPECT_EQ(back->shard.param_dtype, DType::kF32);  // named, so not the CUDA default
  EXPECT_EQ(back->data_path, o.data_path);
  EXPECT_EQ(back->labels_path, o.labels_path);
  EXPECT_EQ(back->steps, o.steps);
  EXPECT_EQ(back->batch_size, o.batch_size);
  EXPECT_EQ(back->seq_len, o.seq_len);
  EXPECT_EQ(back->lr, o.lr);
  EXPECT_EQ(back->min_lr, o.min_lr);
  EXPECT_EQ(back->warmup_steps, o.warmup_steps);
  EXPECT_EQ(back->clip_norm, o.clip_norm);
  EXPECT_EQ(back->seed, o.seed);
  EXPECT_EQ(back->bucket_bytes, o.bucket_bytes);
  EXPECT_EQ(back->zero_stage, 2);
  EXPECT_EQ(back->shard.recompute, shardformer::Recompute::kSelective);
  EXPECT_EQ(back->shard.tp(), 2);
  o.allow_tf32 = false;
  EXPECT_FALSE(TrainOptionsFromSpec(SpecFromTrainOptions(o), "/m", true)->allow_tf32);
}

// The step a worker reports and coloctl prints: every field of the stats,
// the checkpoint written and the one a resumed run continued from.
TEST(JobOptions, AStepReportsItsStatsAsProgress) {
  StepStats st;
  st.step = 7;
  st.loss = 2.5;
  st.lr = 1e-3;
  st.grad_norm = 0.75;
  st.tokens_per_second = 1234;
  st.seconds = 0.25;
  st.param_bytes = 10;
  st.grad_bytes = 20;
  st.optimizer_bytes = 40;
  st.checkpoint = "/ck/step-000007";
  st.resumed_from = "/ck/step-000006";
  st.pipeline_wait_seconds = 0.125;
  st.pipeline_span_seconds = 0.1875;
  const v1::StepProgress p = StepProgressOf(st);
  EXPECT_EQ(p.step(), 7);
  EXPECT_EQ(p.loss(), 2.5);
  EXPECT_EQ(p.learning_rate(), 1e-3);
  EXPECT_EQ(p.grad_norm(), 0.75);
  EXPECT_EQ(p.tokens_per_second(), 1234);
  EXPECT_EQ(p.step_duration().nanos(), 250000000);
  EXPECT_EQ(p.param_bytes(), 10);
  EXPECT_EQ(p.grad_bytes(), 20);
  EXPECT_EQ(p.optimizer_bytes(), 40);
  EXPECT_EQ(p.checkpoint(), "/ck/step-000007");
  EXPECT_EQ(p.resumed_from(), "/ck/step-000006");
  EXPECT_EQ(p.pipeline_wait().nanos(), 125000000);
  EXPECT_EQ(p.pipeline_span().nanos(), 187500000);
}

}  // namespace
}  // namespace colod::train
