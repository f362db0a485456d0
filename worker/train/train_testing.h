// Tests' helpers for training runs: a small run's options, a run's
// per-step stats, and two runs' losses compared step by step.
#ifndef COLOD_WORKER_TRAIN_TRAIN_TESTING_H_
#define COLOD_WORKER_TRAIN_TRAIN_TESTING_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "spec/model_config.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"
#include "worker/tensor/npy.h"
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
  // A masked language model (BERT) trains on masked positions: its [MASK],
  // the vocabulary's last id (the byte-level corpus never holds it).
  if (const absl::StatusOr<ModelConfig> config = ReadModelConfig(model); config.ok() && config->masked_lm()) {
    o.mask_token_id = config->vocab_size - 1;
  }
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
// relative, the gradient norms within 1e-3 (the first step's, before any
// update), then within `grad_rel`. A model whose gradient norm is chaotic
// under Adam passes a larger `grad_rel`: where a gradient is rounding noise,
// Adam's update is +-lr whatever its size, so a different summation order
// (another OpenBLAS kernel, another split) moves the norm 10-100x more each
// step, while the losses stay within `rel`.
inline void ExpectSameLosses(const std::vector<StepStats>& got, const std::vector<StepStats>& want, double rel,
                             const std::string& what, size_t from = 0, double grad_rel = 1e-3) {
  ASSERT_EQ(got.size() + from, want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const StepStats& w = want[i + from];
    const double g = i + from == 0 ? std::min(grad_rel, 1e-3) : grad_rel;
    EXPECT_EQ(got[i].step, w.step) << what;
    EXPECT_NEAR(got[i].loss, w.loss, rel * w.loss) << what << " step " << w.step;
    EXPECT_NEAR(got[i].grad_norm, w.grad_norm, g * w.grad_norm) << what << " step " << w.step;
    EXPECT_DOUBLE_EQ(got[i].lr, w.lr) << what << " step " << w.step;
  }
}

// Labelled images for a ViT of `tiny`'s shape, and the .npy files that hold
// them (TempPath(name + "_images.npy") and name + "_labels.npy").
struct ImageSet {
  Tensor images;  // [24, channels, size, size] f32 (PixelValues, salt 9)
  Tensor labels;  // [24] i64 (ImageLabels, salt 4)
  std::string images_path, labels_path;
};

inline ImageSet WriteImages(const std::string& name, const shardformer::testing::TinyOptions& tiny) {
  ImageSet set{shardformer::testing::PixelValues(24, tiny, 9), shardformer::testing::ImageLabels(24, tiny.labels, 4),
               colod::testing::TempPath(name + "_images.npy"), colod::testing::TempPath(name + "_labels.npy")};
  EXPECT_TRUE(WriteNpy(set.images_path, set.images).ok()) << set.images_path;
  EXPECT_TRUE(WriteNpy(set.labels_path, set.labels).ok()) << set.labels_path;
  return set;
}

// (input, target) pairs for an encoder-decoder of `vocab` tokens, and the
// .npy files that hold them (TempPath(name + "_inputs.npy"), i32, and
// name + "_targets.npy"): 24 inputs of 10 tokens (TokenIds, salt 11) and
// targets of 6 (salt 13), of which pair i has 1 + i % 6, the rest -100.
struct PairSet {
  static constexpr int64_t kPairs = 24, kInputLen = 10, kTargetLen = 6;
  Tensor inputs;                 // [24, 10] i64
  std::vector<int64_t> targets;  // [24, 6], row-major
  std::string inputs_path, targets_path;
};

inline PairSet WritePairs(const std::string& name, int64_t vocab) {
  constexpr int64_t n = PairSet::kPairs, sd = PairSet::kTargetLen;
  PairSet set{shardformer::testing::TokenIds(n, PairSet::kInputLen, vocab, 11),
              shardformer::testing::TokenIds(n, sd, vocab, 13).ToInt64s(),
              colod::testing::TempPath(name + "_inputs.npy"), colod::testing::TempPath(name + "_targets.npy")};
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t s = 1 + i % sd; s < sd; ++s) set.targets[i * sd + s] = -100;
  }
  EXPECT_TRUE(WriteNpy(set.inputs_path, *set.inputs.ToDType(DType::kI32)).ok()) << set.inputs_path;
  EXPECT_TRUE(WriteNpy(set.targets_path, *Tensor::FromInt64s({n, sd}, set.targets)).ok()) << set.targets_path;
  return set;
}

// `o` reading its examples from `data` and their labels (or targets) from
// `labels`.
inline TrainOptions OnExamples(TrainOptions o, const std::string& data, const std::string& labels) {
  o.data_path = data;
  o.labels_path = labels;
  return o;
}

}  // namespace colod::train::testing

#endif  // COLOD_WORKER_TRAIN_TRAIN_TESTING_H_
