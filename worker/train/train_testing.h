// Tests' helpers for training runs: a run's per-step stats, and two runs'
// losses compared step by step.
#ifndef COLOD_WORKER_TRAIN_TRAIN_TESTING_H_
#define COLOD_WORKER_TRAIN_TRAIN_TESTING_H_

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/train/trainer.h"

namespace colod::train::testing {

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
