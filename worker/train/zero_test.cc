// ZeRO stages 1 and 2 over the dp group: tiny GPT-2 and LLaMA at tp2 x dp2
// train with the plain run's losses (the gradients are summed by a
// reduce-scatter instead of an all-reduce, the norm from each rank's
// partition: rounding apart, the same arithmetic), on Gloo and on the
// emulated NCCL, with gradient accumulation, SGD, bf16 and pipeline stages;
// each rank keeps 1/dp of the optimizer state (and with stage 2 of the
// gradients); and a checkpoint resumes at another dp size and stage.
#include <cmath>
#include <filesystem>

#include "gtest/gtest.h"
#include "kernels/device.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/safetensors.h"
#include "worker/shardformer/testing.h"
#include "worker/train/data.h"
#include "worker/train/train_testing.h"
#include "worker/train/trainer.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;

using testing::TinyByteLevel;

TrainOptions Options(const std::string& model, int tp, int dp, int zero) {
  TrainOptions o = testing::SmallRun(model, tp, dp, 8);
  o.zero_stage = zero;
  return o;
}

using testing::ExpectSameLosses;
using testing::Losses;

// Within 1 % of want / 2 (each bucket's chunk is rounded up).
void ExpectHalf(int64_t got, int64_t want, const std::string& what) {
  EXPECT_NEAR(static_cast<double>(got), want / 2.0, 0.01 * want) << what;
}

TEST(Zero, StagesOneAndTwoTrainWithThePlainRunsLosses) {
  for (const bool llama : {false, true}) {
    const std::string dir = TempPath(llama ? "zero_llama" : "zero_gpt2");
    auto model = llama ? shardformer::testing::WriteTinyLlama(dir, TinyByteLevel())
                       : shardformer::testing::WriteTinyGpt2(dir, TinyByteLevel());
    ASSERT_TRUE(model.ok()) << model.status();
    const std::string name = llama ? "llama" : "gpt2";
    const std::vector<StepStats> base = Losses(Options(model->dir, 2, 2, 0));
    ASSERT_EQ(base.size(), 8u);
    EXPECT_LT(base.back().loss, base[0].loss - 0.3) << name;
    const std::vector<StepStats> one = Losses(Options(model->dir, 2, 2, 1));
    ExpectSameLosses(one, base, 1e-5, name + " zero 1");
    const std::vector<StepStats> two = Losses(Options(model->dir, 2, 2, 2));
    ExpectSameLosses(two, base, 1e-5, name + " zero 2");
    ASSERT_FALSE(one.empty() || two.empty());
    // Stage 1 keeps half the optimizer state and every gradient; stage 2 half
    // of both. The parameters stay whole.
    ExpectHalf(one[0].optimizer_bytes, base[0].optimizer_bytes, name + " zero 1 optimizer bytes");
    EXPECT_EQ(one[0].grad_bytes, base[0].grad_bytes) << name;
    ExpectHalf(two[0].optimizer_bytes, base[0].optimizer_bytes, name + " zero 2 optimizer bytes");
    ExpectHalf(two[0].grad_bytes, base[0].grad_bytes, name + " zero 2 gradient bytes");
    EXPECT_EQ(two[0].param_bytes, base[0].param_bytes) << name;
  }
}

TEST(Zero, AccumulationSgdAndMixedPrecision) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("zero_more"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  // Stage 2 reduces every micro-batch and adds the partitions up.
  TrainOptions accumulate = Options(model->dir, 2, 2, 0);
  accumulate.micro_batches = 2;
  const std::vector<StepStats> plain = Losses(accumulate);
  for (int zero : {1, 2}) {
    accumulate.zero_stage = zero;
    ExpectSameLosses(Losses(accumulate), plain, 1e-5, absl::StrCat("2 micro-batches, zero ", zero));
  }
  TrainOptions sgd = Options(model->dir, 1, 2, 0);
  sgd.optimizer.kind = OptimizerOptions::Kind::kSgd;
  sgd.optimizer.weight_decay = 0.01;
  sgd.lr = 0.05;
  const std::vector<StepStats> sgd_plain = Losses(sgd);
  sgd.zero_stage = 2;
  ExpectSameLosses(Losses(sgd), sgd_plain, 1e-5, "sgd, zero 2");
  // bf16 parameters: the f32 master weights are partitioned with the state.
  TrainOptions bf16 = Options(model->dir, 2, 2, 0);
  bf16.shard.param_dtype = DType::kBF16;
  const std::vector<StepStats> bf16_plain = Losses(bf16);
  bf16.zero_stage = 2;
  const std::vector<StepStats> bf16_zero = Losses(bf16);
  ExpectSameLosses(bf16_zero, bf16_plain, 1e-4, "bf16, zero 2");
  ASSERT_FALSE(bf16_zero.empty());
  ExpectHalf(bf16_zero[0].optimizer_bytes, bf16_plain[0].optimizer_bytes, "bf16 zero 2 optimizer bytes");
}

TEST(Zero, PipelineStagesKeepTheTiedTableWhole) {
  shardformer::testing::TinyOptions tiny = TinyByteLevel();
  tiny.layers = 4;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("zero_pp"), tiny);
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions o = Options(model->dir, 1, 2, 0);
  o.shard.layout.set_pipeline_parallel_size(2);
  o.micro_batches = 2;
  const std::vector<StepStats> plain = Losses(o);
  for (int zero : {1, 2}) {
    o.zero_stage = zero;
    ExpectSameLosses(Losses(o), plain, 1e-5, absl::StrCat("pp=2 dp=2 zero ", zero));
  }
}

TEST(Zero, OnTheEmulatedNcclTheRunIsGloos) {
  if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices (the emulation has them)";
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("zero_nccl"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<StepStats> gloo = Losses(Options(model->dir, 2, 2, 0));
  for (int zero : {1, 2}) {
    TrainOptions o = Options(model->dir, 2, 2, zero);
    o.cuda = true;
    o.micro_batches = 2;
    ExpectSameLosses(Losses(o), gloo, 1e-4, absl::StrCat("NCCL zero ", zero));
  }
}

// A run at dp=2 with ZeRO 2 resumes at dp=1 without ZeRO and at dp=4 with
// ZeRO 1, and a plain run's checkpoint under ZeRO 2: each rank's optimizer
// state is put together from the pieces the others wrote.
TEST(Zero, ACheckpointResumesAtAnotherDpSizeAndStage) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("zero_ck"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions full = Options(model->dir, 2, 2, 2);
  const std::vector<StepStats> want = Losses(full);
  ASSERT_EQ(want.size(), 8u);
  for (const int saved_zero : {2, 0}) {
    TrainOptions cut = Options(model->dir, 2, 2, saved_zero);
    cut.save_dir = TempPath(absl::StrCat("zero_ck_", saved_zero));
    cut.save_every = 4;
    cut.stop_after = 4;
    ASSERT_EQ(Losses(cut).size(), 4u);
    for (const auto& [dp, zero] : std::vector<std::pair<int, int>>{{1, 0}, {4, 1}, {2, 2}}) {
      TrainOptions resumed = Options(model->dir, 2, dp, zero);
      resumed.resume_dir = cut.save_dir;
      ExpectSameLosses(Losses(resumed), want, 1e-5,
                       absl::StrCat("saved at zero ", saved_zero, ", resumed at dp=", dp, " zero ", zero), 4);
    }
  }
  // A piece missing (rank 1's file without one of its tensors): the rank
  // that needs it says which.
  const std::string victim = TempPath("zero_ck_2") + "/step-000004/optim-rank-00001-of-00004.safetensors";
  std::string dropped;
  {
    auto f = shardformer::SafetensorsFile::Open(victim);
    ASSERT_TRUE(f.ok()) << f.status();
    std::vector<std::pair<std::string, Tensor>> kept;
    for (const auto& [name, info] : (*f)->tensors()) {
      if (dropped.empty() && name.find(".exp_avg_sq@") != std::string::npos) {
        dropped = name;
        continue;
      }
      kept.emplace_back(name, *(*f)->Read(name));
    }
    ASSERT_FALSE(dropped.empty());
    ASSERT_TRUE(shardformer::WriteSafetensors(victim, kept).ok());
  }
  TrainOptions broken = Options(model->dir, 2, 1, 0);
  broken.resume_dir = TempPath("zero_ck_2");
  const absl::Status s = Train(broken, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("lacks this rank's " + dropped.substr(0, dropped.find('@'))), std::string::npos)
      << s;
}

}  // namespace
}  // namespace colod::train
