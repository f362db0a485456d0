// Gradient accumulation (TrainOptions::grad_accum): N passes of batch_size
// sequences before each optimizer step are one step on N times the batch.
// Against the larger batch run in N micro-batches the arithmetic is the
// same (the same rows, the same order of additions): bitwise on Gloo and on
// the emulated NCCL, with pipeline stages too; against the larger batch in
// one pass, within f32 rounding.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"
#include "worker/train/train_testing.h"
#include "worker/train/trainer.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;
using testing::ExpectSameLosses;
using testing::Losses;
using testing::TinyByteLevel;

// `steps` steps at tp x pp x dp of `batch` sequences a pass.
TrainOptions RunOptions(const std::string& model, int tp, int pp, int dp, int64_t batch, int64_t micro, int64_t accum) {
  TrainOptions o = testing::SmallRun(model, tp, dp, 4);
  o.shard.layout.set_pipeline_parallel_size(pp);
  o.batch_size = batch;
  o.micro_batches = micro;
  o.grad_accum = accum;
  return o;
}

// The same losses and gradient norms, bit for bit, step by step.
void ExpectBitwise(const std::vector<StepStats>& got, const std::vector<StepStats>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].loss, want[i].loss) << what << " step " << i + 1;
    EXPECT_EQ(got[i].grad_norm, want[i].grad_norm) << what << " step " << i + 1;
  }
}

TEST(GradAccum, TwoPassesOfFourAreOneStepOnEight) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("accum_gpt2"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<StepStats> accum = Losses(RunOptions(model->dir, 2, 1, 2, 4, 1, 2));
  const std::vector<StepStats> micro = Losses(RunOptions(model->dir, 2, 1, 2, 8, 2, 1));
  const std::vector<StepStats> whole = Losses(RunOptions(model->dir, 2, 1, 2, 8, 1, 1));
  ASSERT_EQ(accum.size(), 4u);
  ExpectBitwise(accum, micro, "4 x 2 passes against 8 in 2 micro-batches");
  ExpectSameLosses(accum, whole, 1e-5, "4 x 2 passes against 8 in one");
  // A step reads the larger batch's tokens. (That the dp buckets are
  // reduced once a step, PlanAgainstARun's accumulation cases count.)
  EXPECT_EQ(accum[0].rank_tokens, whole[0].rank_tokens);
  // Not the 4-sequence step: a different loss.
  const std::vector<StepStats> small = Losses(RunOptions(model->dir, 2, 1, 2, 4, 1, 1));
  ASSERT_FALSE(small.empty());
  EXPECT_NE(small[0].loss, accum[0].loss);
}

// Pipeline stages: two 1F1B flushes of 2 micro-batches a step are the
// step of one flush over 4: the same gradients, bit for bit (each stage
// adds the micro-batches' in their order either way); the reported loss
// sums the micro-batches' in f32 in another grouping, so it agrees to f32 rounding.
TEST(GradAccum, CombinesWithPipelineMicroBatches) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("accum_pp"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<StepStats> accum = Losses(RunOptions(model->dir, 1, 2, 2, 4, 2, 2));
  const std::vector<StepStats> flush = Losses(RunOptions(model->dir, 1, 2, 2, 8, 4, 1));
  ASSERT_EQ(accum.size(), 4u);
  ExpectSameLosses(accum, flush, 1e-6, "pp=2: 2 passes of 2 micro-batches against 4 micro-batches");
  for (size_t i = 0; i < accum.size(); ++i) EXPECT_EQ(accum[i].grad_norm, flush[i].grad_norm) << "step " << i + 1;
}

TEST(GradAccum, OnTheEmulatedNcclTooAndBadCountsAreRefused) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("accum_nccl"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  for (int64_t bad : {0, -1, 65537}) {
    TrainOptions o = RunOptions(model->dir, 2, 1, 2, 4, 1, bad);
    const absl::Status s = Train(o, [](const StepStats&) {});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << s;
    EXPECT_NE(s.message().find("grad_accum"), absl::string_view::npos) << s;
  }
  if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices (the emulation has them)";
  TrainOptions accum = RunOptions(model->dir, 2, 1, 2, 4, 1, 2), micro = RunOptions(model->dir, 2, 1, 2, 8, 2, 1);
  accum.cuda = micro.cuda = true;
  accum.steps = micro.steps = 2;
  ExpectBitwise(Losses(accum), Losses(micro), "NCCL: 4 x 2 passes against 8 in 2 micro-batches");
}

}  // namespace
}  // namespace colod::train
