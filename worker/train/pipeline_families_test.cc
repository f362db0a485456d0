// Pipeline stages for every family beyond GPT-2 and LLaMA (trainer_test):
// OPT (post-norm, project_in/out, the head tied to the table), BLOOM, BERT
// (its MLM head on the last stage), ViT (the patches and the CLS token
// between stages, the classifier and its loss on the last) and T5
// (encoder and decoder stages) train with the
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

// `run` at tp x pp 2 x dp in `mode` with `micro` micro-batches.
TrainOptions TwoStages(TrainOptions run, int tp, int dp, int micro,
                       v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D) {
  run.shard.layout.set_tensor_parallel_size(tp);
  run.shard.layout.set_data_parallel_size(dp);
  run.shard.layout.set_tensor_parallel_mode(mode);
  run.shard.layout.set_pipeline_parallel_size(2);
  run.micro_batches = micro;
  return run;
}

// `run` (4 steps of one rank) and the same under pipeline stages. With
// `two_d_alone`, 2D under stages is held to 2D without them: T5's 2D run
// drifts from the unsharded one by up to 2e-4 over four AdamW steps, stages
// or none (AdamW's first steps, about lr times the gradient's sign, amplify
// f32 rounding; under SGD 2D and 1D tp 2 stay within 1e-5 of it).
void ExpectStagesTrainAsOneRank(const TrainOptions& run, const std::string& what, bool two_d_alone = false,
                                double grad_rel = 1e-3, bool on_cuda = true) {
  const std::vector<StepStats> want = Losses(run);
  ASSERT_EQ(want.size(), 4u) << what;
  auto staged = [&](int tp, int dp, int micro, v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D) {
    return TwoStages(run, tp, dp, micro, mode);
  };
  ExpectSameLosses(Losses(staged(1, 1, 4)), want, 1e-4, what + " pp=2", 0, grad_rel);
  ExpectSameLosses(Losses(staged(2, 2, 2)), want, 1e-4, what + " tp2 x pp2 x dp2", 0, grad_rel);
  const TrainOptions two_d = staged(4, 1, 2, v1::TENSOR_PARALLEL_MODE_2D);
  if (two_d_alone) {
    TrainOptions alone = two_d;
    alone.shard.layout.set_pipeline_parallel_size(1);
    ExpectSameLosses(Losses(two_d), Losses(alone), 1e-5, what + " 2d tp4 x pp2 (against 2d tp4)", 0, grad_rel);
  } else {
    ExpectSameLosses(Losses(two_d), want, 1e-4, what + " 2d tp4 x pp2", 0, grad_rel);
  }
  if (on_cuda && kernels::CudaDeviceCount() >= 2) {  // the emulation's 4 devices in CI; skipped only in the no-GPU default pass
    TrainOptions t = staged(1, 1, 2);
    t.cuda = true;
    ExpectSameLosses(Losses(t), want, 1e-4, what + " pp=2 on CUDA", 0, grad_rel);
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

// T5's stages (t5.cc): the encoder's layers, then the decoder's; the
// encoder's output joins the decoder's stream between decoder stages, each
// adding its cross-attentions' gradient on the way back; the shared
// embedding on the first stage, the first decoder stage and, tied to the
// head (v1.0), the last; each stack's position bias table mirrored on the
// stack's later stages, their gradients summed. At pp=2 (a stage a stack),
// tp2 x pp2 x dp2 and at pp=4 (two stages a stack: both tables mirrored,
// the shared embedding on three stages, flan-t5's untied head alone on the
// last), v1.0 and flan-t5 train with the unsharded run's losses; in 2D
// (tp4) under two stages, with 2D's own (ExpectStagesTrainAsOneRank). On
// CUDA ranks, on uneven stages and with a held-out evaluation, v1.0 alone:
// what differs there is the same code for both (flan-t5's gated MLP and
// untied head are held on CUDA by cuda_families_test).
// T5's gradient norm is chaotic under Adam (ExpectSameLosses): measured
// against the unsharded run, 1e-8 relative at step 1, up to 1e-5 at step 2,
// 1e-4 at step 3 and 1e-3 at step 4, where the OpenBLAS kernel differs
// (OPENBLAS_CORETYPE=Sandybridge here; the H200 host's), while the losses
// stay within 4e-6. So after the first step its norms are held to 1e-2.
constexpr double kT5GradRel = 1e-2;
TEST(PipelineFamilies, T5EncoderAndDecoderStages) {
  for (const bool flan : {false, true}) {
    shardformer::testing::TinyOptions o = flan ? shardformer::testing::TinyFlanT5() : Tiny();
    o.layers = 3;  // a stack
    o.tie = !flan;
    const std::string what = flan ? "flan-t5" : "t5 v1.0";
    auto t5 = shardformer::testing::WriteTinyT5(TempPath(flan ? "pp_flan_t5" : "pp_t5"), o);
    ASSERT_TRUE(t5.ok()) << t5.status();
    const testing::PairSet pairs = testing::WritePairs(flan ? "pp_flan_t5" : "pp_t5", t5->config.vocab_size);
    const TrainOptions run =
        testing::OnExamples(testing::SmallRun(t5->dir, 1, 1, 4), pairs.inputs_path, pairs.targets_path);
    ExpectStagesTrainAsOneRank(run, what, /*two_d_alone=*/true, kT5GradRel, /*on_cuda=*/!flan);
    const std::vector<StepStats> want = Losses(run);
    TrainOptions four = run;
    four.shard.layout.set_pipeline_parallel_size(4);  // stages of 2, 1 | 2, 1 layers
    four.micro_batches = 4;
    ExpectSameLosses(Losses(four), want, 1e-4, what + " pp=4", 0, kT5GradRel);
    if (flan) continue;
    TrainOptions uneven = run;
    uneven.shard.layout.set_pipeline_parallel_size(3);
    for (int n : {3, 1, 2}) uneven.shard.layout.add_pipeline_stage_layers(n);
    uneven.micro_batches = 2;
    ExpectSameLosses(Losses(uneven), want, 1e-4, what + " pp=3 of 3 | 1, 2 layers", 0, kT5GradRel);
    // A held-out evaluation through the stages: the unsharded run's.
    TrainOptions evaluated = run;
    evaluated.eval_split = 0.25;
    evaluated.eval_every = 2;
    const std::vector<StepStats> plain = Losses(evaluated);
    evaluated.shard.layout.set_pipeline_parallel_size(2);
    evaluated.micro_batches = 2;
    const std::vector<StepStats> staged = Losses(evaluated);
    ASSERT_EQ(staged.size(), plain.size()) << what;
    int evals = 0;
    for (size_t i = 0; i < plain.size(); ++i) {
      ASSERT_EQ(staged[i].eval.has_value(), plain[i].eval.has_value()) << what << " step " << plain[i].step;
      if (!plain[i].eval.has_value()) continue;
      ++evals;
      EXPECT_NEAR(staged[i].eval->loss, plain[i].eval->loss, 1e-4 * plain[i].eval->loss) << what << " step " << i;
    }
    EXPECT_EQ(evals, 2) << what;
  }
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
