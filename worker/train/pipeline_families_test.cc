// Pipeline stages for every single-stack family, beyond GPT-2 and LLaMA
// (trainer_test): OPT (post-norm, project_in/out, the head tied to the
// table), BLOOM, BERT (its MLM head on the last stage) and ViT (the
// patches and the CLS token between stages, the classifier and its loss
// on the last) train with the
// unsharded run's losses and gradient norms at pp=2 (uneven stages), at
// tp2 x pp2 x dp2, in 2D under stages, and on CUDA ranks where there are
// two devices (the emulation's in CI). A family its user registers has
// stages by its own split_stage.
#include <fstream>

#include "gtest/gtest.h"
#include "kernels/device.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/shardformer.h"
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
  const testing::ImageSet images = testing::WriteImages("pp_vit", tiny);
  ExpectStagesTrainAsOneRank(
      testing::OnExamples(testing::SmallRun(vit->dir, 1, 1, 4), images.images_path, images.labels_path), "vit");
}

// A family its user registers (ModelRegistry, docs/SHARDFORMER.md) has
// pipeline stages by its own declaration, not by a list of colod's: GPT-2's
// parts registered as "my_gpt2" train at pp=2 as on one rank. Registered
// without a split_stage, pp=2 is refused, naming it.
//
// GPT-2's build and policy read their layer table by model_type: the user's
// family hands them the config as GPT-2's.
ModelConfig AsGpt2(ModelConfig c) {
  c.model_type = "gpt2";
  return c;
}

class AsGpt2Policy : public shardformer::Policy {
 public:
  explicit AsGpt2Policy(std::unique_ptr<shardformer::Policy> gpt2) : gpt2_(std::move(gpt2)) {}
  absl::Status Preprocess(const ModelConfig& config, shardformer::ShardConfig& shard) override {
    return gpt2_->Preprocess(AsGpt2(config), shard);
  }
  absl::StatusOr<std::map<std::string, shardformer::ModulePolicyDescription>> ModulePolicy(
      const ModelConfig& config, const shardformer::ShardConfig& shard) override {
    return gpt2_->ModulePolicy(AsGpt2(config), shard);
  }
  absl::Status Postprocess(shardformer::Module& model, const ModelConfig& config,
                           const shardformer::ShardConfig& shard) override {
    return gpt2_->Postprocess(model, AsGpt2(config), shard);
  }

 private:
  std::unique_ptr<shardformer::Policy> gpt2_;
};

void RegisterAsGpt2(const std::string& model_type, bool stages) {
  auto gpt2 = shardformer::ModelRegistry::Global().Get("gpt2");
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  shardformer::ModelFamily mine;
  mine.base_model_prefix = gpt2->base_model_prefix;
  mine.parse = [model_type](const std::string& text, const std::string& what) -> absl::StatusOr<ModelConfig> {
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) return absl::InvalidArgumentError(what + ": not a JSON object");
    j["model_type"] = "gpt2";
    absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump(), what);
    if (c.ok()) c->model_type = model_type;
    return c;
  };
  const shardformer::ModelFamily g = *gpt2;
  mine.build = [g](const ModelConfig& c) { return g.build(AsGpt2(c)); };
  mine.policy = [g] { return std::unique_ptr<shardformer::Policy>(new AsGpt2Policy(g.policy())); };
  if (stages) mine.split_stage = g.split_stage;
  shardformer::ModelRegistry::Global().Register(model_type, mine);
}

std::string WriteAs(const std::string& model_type) {
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("pp_" + model_type), Tiny());
  EXPECT_TRUE(gpt2.ok()) << gpt2.status();
  std::ifstream in(gpt2->dir + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  j["model_type"] = model_type;
  std::ofstream(gpt2->dir + "/config.json") << j.dump();
  return gpt2->dir;
}

TEST(PipelineFamilies, ARegisteredFamilyHasStagesByItsOwnDeclaration) {
  RegisterAsGpt2("my_gpt2", /*stages=*/true);
  const TrainOptions run = testing::SmallRun(WriteAs("my_gpt2"), 1, 1, 4);
  const std::vector<StepStats> want = Losses(run);
  ASSERT_EQ(want.size(), 4u);
  TrainOptions staged = run;
  staged.shard.layout.set_pipeline_parallel_size(2);
  staged.micro_batches = 2;
  ExpectSameLosses(Losses(staged), want, 1e-4, "my_gpt2 pp=2");

  RegisterAsGpt2("my_whole_gpt2", /*stages=*/false);
  TrainOptions whole = testing::SmallRun(WriteAs("my_whole_gpt2"), 1, 1, 1);
  whole.shard.layout.set_pipeline_parallel_size(2);
  whole.micro_batches = 2;
  const absl::Status s = Train(whole, [](const StepStats&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("my_whole_gpt2 policy has no pipeline stages: its family declares no split_stage"),
            std::string::npos)
      << s;
}

}  // namespace
}  // namespace colod::train
