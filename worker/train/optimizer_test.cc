// AdamW and SGD with momentum against their update rules written out, the
// schedule's closed form, and the global gradient norm of a sharded model
// against the unsharded gradients.
#include "worker/train/optimizer.h"

#include <cmath>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"

namespace colod::train {
namespace {

using shardformer::NamedParam;

// One replicated parameter on a 1-rank mesh, with gradient `grad`.
struct Single {
  std::unique_ptr<ProcessGroup> pg;
  std::vector<NamedParam> params;
  NamedParam& p() { return params[0]; }
};
Single Make(const std::vector<float>& value) {
  Single s;
  s.pg = *ProcessGroup::Create(::colod::testing::TpDpMesh(1, 1), 0,
                               [](const ProcessGroup::GroupInfo&) -> absl::StatusOr<std::unique_ptr<Communicator>> {
                                 return absl::InternalError("none");
                               });
  auto t = ColoTensor::FromGlobal(*Tensor::FromFloats({static_cast<int64_t>(value.size())}, value), DistSpec(),
                                  s.pg.get(), true);
  s.params.push_back(NamedParam{"w", shardformer::BoundParam{"weight", ColoParameter(*t, "weight"), {}}});
  return s;
}
void SetGrad(NamedParam& p, const std::vector<float>& g) {
  Variable v = p.bound.param.variable();
  v.ZeroGrad();
  ASSERT_TRUE(Backward(*Sum(*Mul(v, Variable(*Tensor::FromFloats({static_cast<int64_t>(g.size())}, g))))).ok());
}

TEST(Optimizer, AdamWFollowsTorchsUpdate) {
  Single s = Make({1.0f, -2.0f});
  OptimizerOptions o;
  o.weight_decay = 0.1;
  auto opt = Optimizer::Create(s.params, o);
  ASSERT_TRUE(opt.ok());
  double p[2] = {1, -2}, m[2] = {0, 0}, v[2] = {0, 0};
  const std::vector<std::vector<float>> grads = {{0.5f, -1.0f}, {0.1f, 0.3f}, {-0.2f, 0.4f}};
  for (int t = 1; t <= 3; ++t) {
    SetGrad(s.p(), grads[t - 1]);
    const double scale = t == 2 ? 0.5 : 1.0;  // step 2 clipped: its gradient halved as it is read
    ASSERT_TRUE(opt->Step(0.01, scale).ok());
    EXPECT_EQ(s.p().bound.param.variable().grad()->ToFloats(), grads[t - 1]) << "the step rewrote the gradient";
    for (int i = 0; i < 2; ++i) {
      const double g = scale * grads[t - 1][i];
      p[i] -= 0.01 * 0.1 * p[i];
      m[i] = 0.9 * m[i] + 0.1 * g;
      v[i] = 0.999 * v[i] + 0.001 * g * g;
      const double mh = m[i] / (1 - std::pow(0.9, t)), vh = v[i] / (1 - std::pow(0.999, t));
      p[i] -= 0.01 * mh / (std::sqrt(vh) + 1e-8);
    }
  }
  const std::vector<float> got = s.p().bound.param.local().ToFloats();
  EXPECT_NEAR(got[0], p[0], 1e-6);
  EXPECT_NEAR(got[1], p[1], 1e-6);
  EXPECT_EQ(opt->State().size(), 2u);
  EXPECT_EQ(opt->state_bytes(), 16);
}

TEST(Optimizer, SgdWithMomentumFollowsTorchsUpdate) {
  Single s = Make({1.0f, -2.0f});
  OptimizerOptions o;
  o.kind = OptimizerOptions::Kind::kSgd;
  o.momentum = 0.9;
  o.weight_decay = 0.01;
  auto opt = Optimizer::Create(s.params, o);
  ASSERT_TRUE(opt.ok());
  double p[2] = {1, -2}, buf[2] = {0, 0};
  const std::vector<std::vector<float>> grads = {{0.5f, -1.0f}, {0.1f, 0.3f}, {-0.2f, 0.4f}};
  for (int t = 1; t <= 3; ++t) {
    SetGrad(s.p(), grads[t - 1]);
    const double scale = t == 3 ? 0.25 : 1.0;
    ASSERT_TRUE(opt->Step(0.1, scale).ok());
    for (int i = 0; i < 2; ++i) {
      const double g = scale * grads[t - 1][i] + 0.01 * p[i];
      buf[i] = t == 1 ? g : 0.9 * buf[i] + g;
      p[i] -= 0.1 * buf[i];
    }
  }
  const std::vector<float> got = s.p().bound.param.local().ToFloats();
  EXPECT_NEAR(got[0], p[0], 1e-6);
  EXPECT_NEAR(got[1], p[1], 1e-6);
}

TEST(Optimizer, ClipFactorIsTorchsClipGradNorm) {
  EXPECT_EQ(ClipFactor(0.5, 1.0), 1.0);  // under the limit: untouched
  EXPECT_EQ(ClipFactor(1.0, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(ClipFactor(4.0, 1.0), 1.0 / (4.0 + 1e-6));
  EXPECT_EQ(ClipFactor(4.0, 0.0), 1.0);  // clipping off
}

// torch.cuda.amp.GradScaler's rule, step by step: a norm that is not finite
// (an overflow) skips the update and halves the scale; `window` finite ones
// in a row double it (to at most 2^24); an overflow at 1 is divergence.
TEST(LossScaler, HalvesOnOverflowAndDoublesAfterItsWindow) {
  absl::StatusOr<LossScaler> s = LossScaler::Create(8, 3);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s->Update(INFINITY), false);
  EXPECT_EQ(s->scale(), 4);
  EXPECT_EQ(*s->Update(NAN), false);
  EXPECT_EQ(s->scale(), 2);
  EXPECT_EQ(*s->Update(0.5), true);
  EXPECT_EQ(*s->Update(1e30), true);
  EXPECT_EQ(s->scale(), 2);
  EXPECT_EQ(s->good_steps(), 2);
  EXPECT_EQ(*s->Update(0.0), true);  // the window's third: doubled, counted anew
  EXPECT_EQ(s->scale(), 4);
  EXPECT_EQ(s->good_steps(), 0);
  EXPECT_EQ(*s->Update(1.0), true);
  EXPECT_EQ(*s->Update(-INFINITY), false);  // an overflow starts the count again
  EXPECT_EQ(s->scale(), 2);
  EXPECT_EQ(s->good_steps(), 0);
  EXPECT_EQ(*s->Update(INFINITY), false);
  EXPECT_EQ(s->scale(), 1);
  const absl::StatusOr<bool> diverged = s->Update(INFINITY);
  EXPECT_EQ(diverged.status().code(), absl::StatusCode::kFailedPrecondition) << diverged.status();
  EXPECT_NE(diverged.status().message().find("at a loss scale of 1"), std::string::npos) << diverged.status();
  // At the top it stays there.
  absl::StatusOr<LossScaler> top = LossScaler::Create(LossScaler::kMax, 1);
  ASSERT_TRUE(top.ok());
  EXPECT_EQ(*top->Update(1.0), true);
  EXPECT_EQ(top->scale(), LossScaler::kMax);
  // A checkpoint's state resumes where it was.
  absl::StatusOr<LossScaler> resumed = LossScaler::Create(1024, 4, 3);
  ASSERT_TRUE(resumed.ok());
  EXPECT_EQ(*resumed->Update(1.0), true);
  EXPECT_EQ(resumed->scale(), 2048);
  // What it refuses: a scale that is not a power of two in [1, 2^24], a
  // window outside [1, 1e9], good steps outside [0, window).
  for (const double bad :
       {0.0, 0.5, 3.0, 1000.0, 33554432.0, static_cast<double>(NAN), static_cast<double>(INFINITY)}) {
    EXPECT_EQ(LossScaler::Create(bad, 10).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(LossScaler::Create(2, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LossScaler::Create(2, 1000000001).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LossScaler::Create(2, 4, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LossScaler::Create(2, 4, -1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Schedule, WarmupThenCosine) {
  EXPECT_DOUBLE_EQ(LearningRate(0, 1.0, 4, 20, 0.1), 0.25);
  EXPECT_DOUBLE_EQ(LearningRate(3, 1.0, 4, 20, 0.1), 1.0);
  EXPECT_DOUBLE_EQ(LearningRate(4, 1.0, 4, 20, 0.1), 1.0);
  EXPECT_NEAR(LearningRate(12, 1.0, 4, 20, 0.1), 0.55, 1e-12);  // halfway: the mean
  EXPECT_DOUBLE_EQ(LearningRate(20, 1.0, 4, 20, 0.1), 0.1);
  EXPECT_DOUBLE_EQ(LearningRate(5, 1.0, 0, 0, 0.1), 1.0);  // no schedule
}

TEST(GradNorm, CountsEveryElementOnceAtEveryLayout) {
  auto model = shardformer::testing::WriteTinyGpt2(::colod::testing::TempPath("norm_gpt2"));
  ASSERT_TRUE(model.ok());
  const Tensor ids = shardformer::testing::TokenIds(4, 8, model->config.vocab_size, 1);
  auto ref = shardformer::testing::ReferenceGpt2(*model, ids);
  ASSERT_TRUE(ref.ok());
  double sq = 0;
  for (const auto& [name, g] : ref->grads) sq += SumAll(*Mul(g, g));
  const double want = std::sqrt(sq);
  for (const auto& layout : std::vector<std::pair<int, v1::TensorParallelMode>>{
           {2, v1::TENSOR_PARALLEL_MODE_1D}, {4, v1::TENSOR_PARALLEL_MODE_2D}}) {
    const int tp = layout.first;  // not a binding: a lambda captures it
    const v1::TensorParallelMode mode = layout.second;
    shardformer::ShardConfig shard;
    shard.layout.set_tensor_parallel_size(tp);
    shard.layout.set_data_parallel_size(1);
    shard.layout.set_tensor_parallel_mode(mode);
    ::colod::testing::RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
      auto m = shardformer::ShardFormer(shard, &pg).Load(model->dir);
      ASSERT_TRUE(m.ok());
      auto logits = (*m)->Forward(ids);
      ASSERT_TRUE(Backward((*m)->NextTokenLoss(*logits, ids)->loss).ok());
      auto norm = GlobalGradNorm((*m)->Parameters(), &pg);
      ASSERT_TRUE(norm.ok()) << norm.status();
      EXPECT_NEAR(*norm, want, 1e-4 * want) << "tp " << tp;
      // Clipping to half scales every gradient, so the norm halves.
      ASSERT_TRUE(ClipGradNorm((*m)->Parameters(), want / 2, &pg).ok());
      EXPECT_NEAR(*GlobalGradNorm((*m)->Parameters(), &pg), want / 2, 1e-4 * want);
    });
  }
}

}  // namespace
}  // namespace colod::train
