// Activation recomputation (--recompute full|selective): tiny GPT-2, LLaMA,
// OPT and BLOOM train with exactly the plain run's losses and gradient norms
// (the recomputed forward is the same arithmetic on the same inputs), at
// tp2 x dp2, with sequence parallelism, pipeline stages, micro-batches and
// ZeRO, and on the emulated NCCL; the tape holds a third of the activations
// or less under full recomputation and less by attention's probabilities
// under selective, and less with sequence parallelism than with tp alone;
// T5 is refused.
#include <atomic>
#include <filesystem>

#include "gtest/gtest.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "tests/testing/heap.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"
#include "worker/train/data.h"
#include "worker/train/train_testing.h"
#include "worker/train/trainer.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;
using shardformer::Recompute;
using testing::Losses;

using testing::TinyByteLevel;

TrainOptions Options(const std::string& model, int tp, int dp) { return testing::SmallRun(model, tp, dp, 4); }

// Every step's loss and gradient norm, bitwise.
void ExpectBitwise(const std::vector<StepStats>& got, const std::vector<StepStats>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].loss, want[i].loss) << what << " step " << i + 1;
    EXPECT_EQ(got[i].grad_norm, want[i].grad_norm) << what << " step " << i + 1;
  }
}

void ExpectRecomputeIsBitwise(TrainOptions o, const std::string& what) {
  o.shard.recompute = Recompute::kNone;
  const std::vector<StepStats> plain = Losses(o);
  ASSERT_FALSE(plain.empty()) << what;
  for (const Recompute r : {Recompute::kFull, Recompute::kSelective}) {
    o.shard.recompute = r;
    ExpectBitwise(Losses(o), plain, what + " recompute " + shardformer::RecomputeName(r));
  }
}

TEST(Recompute, EveryDecoderFamilyTrainsWithThePlainRunsLossesBitwise) {
  using Writer = absl::StatusOr<shardformer::testing::TinyModel> (*)(const std::string&,
                                                                     const shardformer::testing::TinyOptions&);
  const std::vector<std::pair<std::string, Writer>> families = {{"gpt2", shardformer::testing::WriteTinyGpt2},
                                                                {"llama", shardformer::testing::WriteTinyLlama},
                                                                {"opt", shardformer::testing::WriteTinyOpt},
                                                                {"bloom", shardformer::testing::WriteTinyBloom}};
  for (const auto& [name, write] : families) {
    auto model = write(TempPath("recompute_" + name), TinyByteLevel());
    ASSERT_TRUE(model.ok()) << name << ": " << model.status();
    ExpectRecomputeIsBitwise(Options(model->dir, 2, 2), name + " tp2 x dp2");
  }
}

TEST(Recompute, WithSequenceParallelismStagesMicroBatchesAndZero) {
  shardformer::testing::TinyOptions tiny = TinyByteLevel();
  tiny.layers = 4;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("recompute_more"), tiny);
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions sp = Options(model->dir, 2, 1);
  sp.shard.layout.set_sequence_parallel(true);
  ExpectRecomputeIsBitwise(sp, "tp2 sequence parallel");
  TrainOptions stages = Options(model->dir, 1, 2);
  stages.shard.layout.set_pipeline_parallel_size(2);
  stages.micro_batches = 2;
  ExpectRecomputeIsBitwise(stages, "pp2 x dp2, 2 micro-batches");
  TrainOptions zero = Options(model->dir, 2, 2);
  zero.zero_stage = 2;
  zero.micro_batches = 2;
  ExpectRecomputeIsBitwise(zero, "tp2 x dp2 zero 2, 2 micro-batches");
}

TEST(Recompute, OnTheEmulatedNcclTheRunIsThePlainOnes) {
  if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices (the emulation has them)";
  auto model = shardformer::testing::WriteTinyLlama(TempPath("recompute_nccl"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions o = Options(model->dir, 2, 2);
  o.cuda = true;
  o.steps = 4;
  const std::vector<StepStats> plain = Losses(o);
  o.shard.recompute = Recompute::kFull;
  testing::ExpectSameLosses(Losses(o), plain, 1e-6, "NCCL recompute full");
}

// What one training forward leaves alive for its backward (the heap's
// growth from before the forward to after the loss), per rank of tp.
int64_t HeldByTheTape(const std::string& dir, Recompute recompute, const Tensor& ids, int tp = 1, bool sp = false) {
  shardformer::ShardConfig shard;
  shard.layout.set_tensor_parallel_size(tp);
  shard.layout.set_data_parallel_size(1);
  shard.layout.set_sequence_parallel(sp);
  shard.recompute = recompute;
  std::atomic<int64_t> before{0}, after{0};
  ::colod::testing::RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int rank, ProcessGroup& pg) {
    auto model = shardformer::ShardFormer(shard, &pg).Load(dir);
    ASSERT_TRUE(model.ok()) << model.status();
    auto step = [&]() -> absl::StatusOr<shardformer::LmLoss> {
      ASSIGN_OR_RETURN(ColoTensor logits, (*model)->Forward(ids));
      return (*model)->NextTokenLoss(logits, ids);
    };
    {  // a first step makes the gradients
      auto loss = step();
      ASSERT_TRUE(loss.ok()) << loss.status();
      ASSERT_TRUE(Backward(loss->loss).ok());
    }
    ASSERT_TRUE(pg.Barrier().ok());
    if (rank == 0) before = ::colod::testing::HeapInUse();
    ASSERT_TRUE(pg.Barrier().ok());
    auto loss = step();
    ASSERT_TRUE(loss.ok()) << loss.status();
    ASSERT_TRUE(pg.Barrier().ok());
    if (rank == 0) after = ::colod::testing::HeapInUse();
    ASSERT_TRUE(pg.Barrier().ok());
    ASSERT_TRUE(Backward(loss->loss).ok());
  });
  return (after - before) / tp;
}

TEST(Recompute, TheTapeHoldsLess) {
  shardformer::testing::TinyOptions tiny;
  tiny.vocab = 128;
  tiny.hidden = 128;
  tiny.heads = 4;
  tiny.layers = 4;
  tiny.positions = 128;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("recompute_heap"), tiny);
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t batch = 4, seq = 128;
  const Tensor ids = shardformer::testing::TokenIds(batch, seq, tiny.vocab, 3);
  const int64_t none = HeldByTheTape(model->dir, Recompute::kNone, ids);
  const int64_t full = HeldByTheTape(model->dir, Recompute::kFull, ids);
  const int64_t selective = HeldByTheTape(model->dir, Recompute::kSelective, ids);
  std::cerr << "held by the tape: none " << none << ", full " << full << ", selective " << selective << " bytes\n";
  EXPECT_LE(3 * full, none);
  // Selective drops each layer's f32 probabilities [B, heads, S, S], and
  // nothing else.
  const int64_t probs = tiny.layers * batch * tiny.heads * seq * seq * 4;
  EXPECT_NEAR(static_cast<double>(none - selective), static_cast<double>(probs), 0.05 * probs);
}

// Sequence parallelism keeps the stream's rows split and no gathered input
// or partial product (nn::GatheredLinear, ScatteredLinear): less than tp
// alone holds.
TEST(SequenceParallelism, TheTapeHoldsLessThanWithTensorParallelismAlone) {
  shardformer::testing::TinyOptions tiny;
  tiny.vocab = 128;
  tiny.hidden = 256;
  tiny.heads = 4;
  tiny.layers = 2;
  tiny.positions = 128;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("sp_heap"), tiny);
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = shardformer::testing::TokenIds(2, 128, tiny.vocab, 3);
  const int64_t tp = HeldByTheTape(model->dir, Recompute::kNone, ids, 2, false);
  const int64_t sp = HeldByTheTape(model->dir, Recompute::kNone, ids, 2, true);
  std::cerr << "held by the tape at tp=2: " << tp << " bytes a rank, with sequence parallelism " << sp << "\n";
  EXPECT_LT(sp, 0.95 * tp);
}

TEST(Recompute, AnEncoderDecoderIsRefused) {
  auto t5 = shardformer::testing::WriteTinyT5(TempPath("recompute_t5"), TinyByteLevel());
  ASSERT_TRUE(t5.ok()) << t5.status();
  shardformer::ShardConfig shard;
  shard.layout.set_tensor_parallel_size(1);
  shard.layout.set_data_parallel_size(1);
  shard.recompute = Recompute::kFull;
  ::colod::testing::RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    auto model = shardformer::ShardFormer(shard, &pg).Load(t5->dir);
    EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(model.status().message().find("not available for t5"), std::string::npos) << model.status();
  });
}

}  // namespace
}  // namespace colod::train
