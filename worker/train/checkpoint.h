// Checkpoints of a training run, and resuming from them.
//
// DIR/step-000005/ holds the model as a sharded checkpoint
// (worker/shardformer/checkpoint.h), each rank's optimizer state
// (optim-rank-NNNNN-of-MMMMM.safetensors: "<param>.exp_avg", ..., or under
// ZeRO the parts of parameters the rank updates, "<param>.exp_avg@<offset>",
// 1-D runs of the flattened local shard: Optimizer::State) and
// train_state.json (the step, the optimizer's step count, the sampler's
// seed, the layout). Ranks write into step-000005.tmp; after a barrier rank 0
// writes train_state.json and renames the directory into place, so a crash
// mid-write leaves step-000005.tmp behind and the previous checkpoint whole.
// Resuming picks the newest checkpoint whose files all open and validate
// (a truncated file is detected by the safetensors header checks) and needs
// the layout it was written with but for data_parallel_size: each rank puts
// its optimizer state together from the pieces the ranks with its tp and pp
// coordinates wrote, so a run resumes at another dp size and with or
// without ZeRO (consolidate the checkpoint to change the rest).
//
// Thread-safety: free functions; SaveTrainingCheckpoint and
// RestoreTrainingCheckpoint are collective.
#ifndef COLOD_WORKER_TRAIN_CHECKPOINT_H_
#define COLOD_WORKER_TRAIN_CHECKPOINT_H_

#include <string>

#include "absl/status/statusor.h"
#include "worker/shardformer/shardformer.h"
#include "worker/train/optimizer.h"

namespace colod::train {

// The checkpoint directory of `step` under `dir`: DIR/step-NNNNNN.
std::string StepDir(const std::string& dir, int64_t step);

// After `step` (1-based) optimizer steps, into StepDir(dir, step).
absl::Status SaveTrainingCheckpoint(shardformer::ShardedModel& model, Optimizer& optimizer, const std::string& dir,
                                    int64_t step, uint64_t seed);

// The newest complete checkpoint directory under `dir` (DIR/step-NNNNNN),
// skipping damaged ones; `skipped` (if given) gets the ones passed over and
// why. NOT_FOUND when none is complete.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& dir, std::vector<std::string>* skipped = nullptr);

struct Resumed {
  int64_t step = 0;  // steps done; training continues with step + 1
  uint64_t seed = 0;
};
// The step and seed a checkpoint records.
absl::StatusOr<Resumed> ReadTrainState(const std::string& checkpoint);
// Loads the parameters and optimizer state of `checkpoint` (a step
// directory) into this rank's model and optimizer. FAILED_PRECONDITION when
// it was written at another layout (data_parallel_size aside),
// INVALID_ARGUMENT when a piece this rank needs is missing.
absl::StatusOr<Resumed> RestoreTrainingCheckpoint(const std::string& checkpoint, shardformer::ShardedModel& model,
                                                  Optimizer& optimizer);

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_CHECKPOINT_H_
