// Pipeline stages for every single-stack family, beyond GPT-2 and LLaMA
// (trainer_test): OPT (post-norm, project_in/out, the head tied to the
// table), BLOOM, BERT (its MLM head on the last stage) and ViT (the
// patches and the CLS token between stages, the classifier and its loss
// on the last) train with the
// unsharded run's losses and gradient norms at pp=2 (uneven stages), at
// tp2 x pp2 x dp2, in 2D under stages, and on CUDA ranks where there are
// two devices (the emulation's in CI).
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"
#include "worker/tensor/npy.h"
#include "worker/train/train_testing.h"
#include "worker/train/trainer.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;
using testing::ExpectSameLosses;
using testing::Losses;

// `run` (4 steps of one rank) and the same under pipeline stages.
void ExpectStagesTrainAsOneRank(const TrainOptions& run, const std::string& what) {
  const std::vector<StepStats> want = Losses(run);
  ASSERT_EQ(want.size(), 4u) << what;
  auto staged = [&](int tp, int dp, int micro, v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D) {
    TrainOptions t = run;
    t.shard.layout.set_tensor_parallel_size(tp);
    t.shard.layout.set_data_parallel_size(dp);
    t.shard.layout.set_tensor_parallel_mode(mode);
    t.shard.layout.set_pipeline_parallel_size(2);
    t.micro_batches = micro;
    return t;
  };
  ExpectSameLosses(Losses(staged(1, 1, 4)), want, 1e-4, what + " pp=2");
  ExpectSameLosses(Losses(staged(2, 2, 2)), want, 1e-4, what + " tp2 x pp2 x dp2");
  ExpectSameLosses(Losses(staged(4, 1, 2, v1::TENSOR_PARALLEL_MODE_2D)), want, 1e-4, what + " 2d tp4 x pp2");
  if (kernels::CudaDeviceCount() >= 2) {  // the emulation's 4 devices in CI; skipped only in the no-GPU default pass
    TrainOptions t = staged(1, 1, 2);
    t.cuda = true;
    ExpectSameLosses(Losses(t), want, 1e-4, what + " pp=2 on CUDA");
  }
}

shardformer::testing::TinyOptions Tiny() {
  shardformer::testing::TinyOptions o = testing::TinyByteLevel();
  o.layers = 3;  // stages of 2 and 1 layers
  return o;
}

TEST(PipelineFamilies, OptPostNormWithProjectionsAndATiedHead) {
  shardformer::testing::TinyOptions o = Tiny();
  o.pre_norm = false;
  o.embed_dim = 32;  // project_in on the first stage, project_out on the last
  o.tie = true;      // the last stage's head computes with its mirror of the table
  auto opt = shardformer::testing::WriteTinyOpt(TempPath("pp_opt"), o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ExpectStagesTrainAsOneRank(testing::SmallRun(opt->dir, 1, 1, 4), "opt");
}

// 3D (tp 8) under two stages: the last stage's project_out, a lone
// Linear3D, gives its output back in the stream's spec for the tied head.
TEST(PipelineFamilies, OptIn3DUnderStages) {
  shardformer::testing::TinyOptions o = Tiny();
  o.embed_dim = 32;
  o.tie = true;
  auto opt = shardformer::testing::WriteTinyOpt(TempPath("pp_opt_3d"), o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  TrainOptions run = testing::SmallRun(opt->dir, 1, 1, 2);
  const std::vector<StepStats> want = Losses(run);
  run.shard.layout.set_tensor_parallel_size(8);
  run.shard.layout.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_3D);
  run.shard.layout.set_pipeline_parallel_size(2);
  run.micro_batches = 2;
  ExpectSameLosses(Losses(run), want, 1e-4, "opt 3d tp8 x pp2");
}

TEST(PipelineFamilies, Bloom) {
  auto bloom = shardformer::testing::WriteTinyBloom(TempPath("pp_bloom"), Tiny());
  ASSERT_TRUE(bloom.ok()) << bloom.status();
  ExpectStagesTrainAsOneRank(testing::SmallRun(bloom->dir, 1, 1, 4), "bloom");
}

TEST(PipelineFamilies, BertWithItsMlmHeadOnTheLastStage) {
  auto bert = shardformer::testing::WriteTinyBert(TempPath("pp_bert"), Tiny());
  ASSERT_TRUE(bert.ok()) << bert.status();
  ExpectStagesTrainAsOneRank(testing::SmallRun(bert->dir, 1, 1, 4), "bert");
}

TEST(PipelineFamilies, VitWithItsClassifierOnTheLastStage) {
  shardformer::testing::TinyOptions tiny;
  tiny.layers = 3;
  auto vit = shardformer::testing::WriteTinyVit(TempPath("pp_vit"), tiny);
  ASSERT_TRUE(vit.ok()) << vit.status();
  ASSERT_TRUE(WriteNpy(TempPath("pp_images.npy"), shardformer::testing::PixelValues(24, tiny, 9)).ok());
  ASSERT_TRUE(WriteNpy(TempPath("pp_labels.npy"), shardformer::testing::ImageLabels(24, tiny.labels, 4)).ok());
  TrainOptions run = testing::SmallRun(vit->dir, 1, 1, 4);
  run.data_path = TempPath("pp_images.npy");
  run.labels_path = TempPath("pp_labels.npy");
  ExpectStagesTrainAsOneRank(run, "vit");
}

}  // namespace
}  // namespace colod::train
