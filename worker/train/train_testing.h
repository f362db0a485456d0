// Tests' helpers for training runs: a small run's options, a run's
// per-step stats, and two runs' losses compared step by step.
#ifndef COLOD_WORKER_TRAIN_TRAIN_TESTING_H_
#define COLOD_WORKER_TRAIN_TRAIN_TESTING_H_

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/shardformer/testing.h"
#include "worker/train/data.h"
#include "worker/train/trainer.h"

namespace colod::train::testing {

// What the small runs train on: the GPL's text, byte-level.
inline constexpr char kGplText[] = "/usr/share/common-licenses/GPL-3";

// A tiny model for it: the byte vocabulary, 32 positions.
inline shardformer::testing::TinyOptions TinyByteLevel() {
  shardformer::testing::TinyOptions o;
  o.vocab = kByteVocab;
  o.positions = 32;
  return o;
}

// `steps` AdamW steps of 8 sequences of 32 tokens of kGplText at tp x dp
// (1D), lr 3e-3 after 2 warm-up steps decaying to 3e-4, clipped at 1, in
// 64 KiB gradient buckets (several even for a tiny model).
inline TrainOptions SmallRun(const std::string& model, int tp, int dp, int64_t steps) {
  TrainOptions o;
  o.model_dir = model;
  o.data_path = kGplText;
  o.steps = steps;
  o.batch_size = 8;
  o.seq_len = 32;
  o.lr = 3e-3;
  o.warmup_steps = 2;
  o.min_lr = 3e-4;
  o.clip_norm = 1.0;
  o.seed = 7;
  o.shard.layout.set_tensor_parallel_size(tp);
  o.shard.layout.set_data_parallel_size(dp);
  o.bucket_bytes = 64 << 10;
  return o;
}

// Rank 0's stats of every step of Train(o), which must succeed.
inline std::vector<StepStats> Losses(const TrainOptions& o) {
  std::vector<StepStats> steps;
  const absl::Status s = Train(o, [&](const StepStats& st) { steps.push_back(st); });
  EXPECT_TRUE(s.ok()) << s;
  return steps;
}

// `got` is `want` from its step `from` + 1 on (a resumed run: 0 for a whole
// one): the same steps and learning rates, the losses within `rel`
// relative, the gradient norms within 1e-3.
inline void ExpectSameLosses(const std::vector<StepStats>& got, const std::vector<StepStats>& want, double rel,
                             const std::string& what, size_t from = 0) {
  ASSERT_EQ(got.size() + from, want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const StepStats& w = want[i + from];
    EXPECT_EQ(got[i].step, w.step) << what;
    EXPECT_NEAR(got[i].loss, w.loss, rel * w.loss) << what << " step " << w.step;
    EXPECT_NEAR(got[i].grad_norm, w.grad_norm, 1e-3 * w.grad_norm) << what << " step " << w.step;
    EXPECT_DOUBLE_EQ(got[i].lr, w.lr) << what << " step " << w.step;
  }
}

}  // namespace colod::train::testing

#endif  // COLOD_WORKER_TRAIN_TRAIN_TESTING_H_
