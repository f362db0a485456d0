// Training a tiny GPT-2 on the text of the GPL (byte-level tokens): the
// first 10 losses agree across layouts (tp, dp, both, 2D), the loss falls,
// gradient accumulation and clipping give the same run, and runs are
// deterministic.
#include "worker/train/trainer.h"

#include <cmath>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;

constexpr char kText[] = "/usr/share/common-licenses/GPL-3";

std::string TinyModel(const std::string& name) {
  shardformer::testing::TinyOptions o;
  o.vocab = kByteVocab;
  o.positions = 32;
  auto m = shardformer::testing::WriteTinyGpt2(TempPath(name), o);
  EXPECT_TRUE(m.ok()) << m.status();
  return m->dir;
}

TrainOptions Options(const std::string& model, int tp, int dp, v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D) {
  TrainOptions o;
  o.model_dir = model;
  o.data_path = kText;
  o.steps = 10;
  o.batch_size = 8;
  o.seq_len = 32;
  o.lr = 3e-3;
  o.warmup_steps = 2;
  o.min_lr = 3e-4;
  o.clip_norm = 1.0;
  o.seed = 7;
  o.shard.layout.set_tensor_parallel_size(tp);
  o.shard.layout.set_data_parallel_size(dp);
  o.shard.layout.set_tensor_parallel_mode(mode);
  o.bucket_bytes = 64 << 10;  // several buckets even for the tiny model
  return o;
}

std::vector<StepStats> Losses(const TrainOptions& o) {
  std::vector<StepStats> steps;
  const absl::Status s = Train(o, [&](const StepStats& st) { steps.push_back(st); });
  EXPECT_TRUE(s.ok()) << s;
  return steps;
}

void ExpectSameLosses(const std::vector<StepStats>& got, const std::vector<StepStats>& want, double rel,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i].loss, want[i].loss, rel * want[i].loss) << what << " step " << i + 1;
    EXPECT_NEAR(got[i].grad_norm, want[i].grad_norm, 1e-3 * want[i].grad_norm) << what << " step " << i + 1;
    EXPECT_DOUBLE_EQ(got[i].lr, want[i].lr) << what;
  }
}

TEST(Trainer, LossesAgreeAcrossLayoutsAndFall) {
  const std::string model = TinyModel("train_gpt2");
  const std::vector<StepStats> base = Losses(Options(model, 1, 1));
  ASSERT_EQ(base.size(), 10u);
  EXPECT_LT(base.back().loss, base[0].loss - 0.5);  // and it learns
  for (const StepStats& s : base) EXPECT_GT(s.tokens_per_second, 0);
  ExpectSameLosses(Losses(Options(model, 2, 1)), base, 1e-4, "tp=2");
  ExpectSameLosses(Losses(Options(model, 1, 2)), base, 1e-4, "dp=2");
  ExpectSameLosses(Losses(Options(model, 2, 2)), base, 1e-4, "tp=2 dp=2");
  ExpectSameLosses(Losses(Options(model, 4, 1, v1::TENSOR_PARALLEL_MODE_2D)), base, 1e-4, "2d");
}

TEST(Trainer, GradientAccumulationAndDeterminism) {
  const std::string model = TinyModel("train_accum");
  TrainOptions one = Options(model, 1, 2);
  one.steps = 4;
  const std::vector<StepStats> base = Losses(one);
  TrainOptions two = one;
  two.micro_batches = 2;  // 2 micro-batches of B/2 per step
  ExpectSameLosses(Losses(two), base, 1e-5, "2 micro-batches");
  // The same seed and layout reproduce the losses bitwise.
  const std::vector<StepStats> again = Losses(one);
  ASSERT_EQ(again.size(), base.size());
  for (size_t i = 0; i < base.size(); ++i) EXPECT_EQ(again[i].loss, base[i].loss) << i;
  // Another seed draws other batches.
  TrainOptions other = one;
  other.seed = 8;
  EXPECT_NE(Losses(other)[0].loss, base[0].loss);
}

TEST(Trainer, ClippingIsTheSameAcrossLayouts) {
  const std::string model = TinyModel("train_clip");
  TrainOptions tight = Options(model, 1, 1);
  tight.steps = 3;
  tight.clip_norm = 0.05;  // below every norm: each step is clipped
  const std::vector<StepStats> base = Losses(tight);
  for (const StepStats& s : base) EXPECT_GT(s.grad_norm, 0.05);
  TrainOptions sharded = tight;
  sharded.shard.layout.set_tensor_parallel_size(2);
  sharded.shard.layout.set_data_parallel_size(2);
  ExpectSameLosses(Losses(sharded), base, 1e-4, "clipped tp=2 dp=2");
  TrainOptions unclipped = tight;
  unclipped.clip_norm = 0;
  EXPECT_NE(Losses(unclipped)[2].loss, base[2].loss);
}

TEST(Trainer, OptionsThatDoNotFitAreRefusedBeforeAnyRankStarts) {
  const std::string model = TinyModel("train_bad");
  TrainOptions o = Options(model, 1, 2);
  o.batch_size = 3;
  EXPECT_EQ(Train(o, nullptr).code(), absl::StatusCode::kInvalidArgument);
  o = Options(model, 1, 1);
  o.seq_len = 64;  // the model has 32 positions
  EXPECT_EQ(Train(o, nullptr).code(), absl::StatusCode::kInvalidArgument);
  o = Options(model, 1, 1);
  o.micro_batches = 3;
  EXPECT_EQ(Train(o, nullptr).code(), absl::StatusCode::kInvalidArgument);
  o = Options(model, 1, 1);
  o.data_path = TempPath("no_such_corpus.bin");
  EXPECT_EQ(Train(o, nullptr).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace colod::train
