// Checkpoints of a training run, and resuming from them.
//
// DIR/step-000005/ holds the model as a sharded checkpoint
// (worker/shardformer/checkpoint.h), each rank's optimizer state
// (optim-rank-NNNNN-of-MMMMM.safetensors: "<param>.exp_avg", ..., or under
// ZeRO the parts of parameters the rank updates, "<param>.exp_avg@<offset>",
// 1-D runs of the flattened local shard: Optimizer::State) and
// train_state.json (the step, the optimizer's step count, the sampler's
// seed, the layout). Ranks write into step-000005.gen-G.tmp, G the job's
// generation (0 outside a coordinator's job); after a barrier rank 0
// writes train_state.json and renames the directory into place, so a crash
// mid-write leaves the .tmp directory behind and the previous checkpoint
// whole. A generation writes only its own temporary directory: a rank of an
// earlier generation that the coordinator gave up on (its --stop-grace) and
// that still writes never writes into a later generation's checkpoint. Rank
// 0 removes the temporary directories of its own and earlier generations
// (and those named step-N.tmp, of colod before 2026-12) when it starts a
// save, and never a later generation's.
// Resuming picks the newest checkpoint whose files all open and validate
// (a truncated file is detected by the safetensors header checks) and needs
// the layout it was written with but for data_parallel_size: each rank puts
// its optimizer state together from the pieces the ranks with its tp and pp
// coordinates wrote, so a run resumes at another dp size and with or
// without ZeRO (consolidate the checkpoint to change the rest).
// Retention (PruneCheckpoints) keeps the newest K and the best by eval loss
// (train_state.json's eval_loss) and removes the rest, after each save.
//
// Thread-safety: free functions; SaveTrainingCheckpoint and
// RestoreTrainingCheckpoint are collective.
#ifndef COLOD_WORKER_TRAIN_CHECKPOINT_H_
#define COLOD_WORKER_TRAIN_CHECKPOINT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/shardformer/shardformer.h"
#include "worker/train/optimizer.h"

namespace colod::train {

// The checkpoint directory of `step` under `dir`: DIR/step-NNNNNN.
std::string StepDir(const std::string& dir, int64_t step);

// The temporary directory generation `generation` writes StepDir(dir,
// step) through: DIR/step-NNNNNN.gen-G.tmp.
std::string StepTmpDir(const std::string& dir, int64_t step, int64_t generation);

// After `step` (1-based) optimizer steps, into StepDir(dir, step), with
// the held-out evaluation's loss of that step if one ran (retention keeps
// the best by it), through StepTmpDir(dir, step, generation). An existing
// StepDir(dir, step) (a run resumed from before it) is replaced: moved
// aside, the new one renamed into place, the old one removed; moved back
// if the rename fails.
absl::Status SaveTrainingCheckpoint(shardformer::ShardedModel& model, Optimizer& optimizer, const std::string& dir,
                                    int64_t step, uint64_t seed, std::optional<double> eval_loss = std::nullopt,
                                    int64_t generation = 0);
// The same of every model chunk a rank holds (interleaved 1F1B), chunk 0
// first, whose parameters `optimizer` takes together.
absl::Status SaveTrainingCheckpoint(const std::vector<shardformer::ShardedModel*>& chunks, Optimizer& optimizer,
                                    const std::string& dir, int64_t step, uint64_t seed,
                                    std::optional<double> eval_loss = std::nullopt, int64_t generation = 0);

// The newest complete checkpoint directory under `dir` (DIR/step-NNNNNN),
// skipping damaged ones; `skipped` (if given) gets the ones passed over and
// why. NOT_FOUND when none is complete.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& dir, std::vector<std::string>* skipped = nullptr);

// A complete checkpoint of a run's directory, as retention and `coloctl
// checkpoints` see it.
struct CheckpointInfo {
  std::string path;  // DIR/step-NNNNNN
  int64_t step = 0;
  std::optional<double> eval_loss;  // the held-out evaluation of its step, if one ran
  int64_t bytes = 0;                // its files' sizes
};

// The checkpoints under `dir` whose train_state.json reads (rank 0 writes it
// last, before the directory is renamed into place), oldest first; a
// directory being written (.tmp) or whose state does not read is left out
// (`skipped` gets it and why). NOT_FOUND when `dir` cannot be listed.
absl::StatusOr<std::vector<CheckpointInfo>> ListCheckpoints(const std::string& dir,
                                                            std::vector<std::string>* skipped = nullptr);

// Which checkpoints a run keeps (TrainConfig.keep_last, keep_best).
struct Retention {
  int64_t keep_last = 0;   // the newest this many; 0: all
  bool keep_best = false;  // and the one of lowest eval loss (the earliest of equals)
};

// Removes the checkpoints under `dir` that `keep` does not keep, and the
// leftovers of removals a crash interrupted; returns those kept, oldest
// first. The newest is always kept (a restart resumes from it), and nothing
// being written (.tmp) or unreadable is touched. A removal first renames
// the directory out of the checkpoints' names (DIR/.trash-step-NNNNNN,
// atomic, needing no space), so a crash or a failing removal never leaves
// a half-deleted checkpoint for a resume to pick; a removal that fails
// leaves the checkpoint in place (kept, and logged), with the rest done.
// `must_keep` (a path as ListCheckpoints gives it) is kept whatever the
// rest: the checkpoint just written, even where the directory holds a
// higher-numbered one (an earlier run's).
absl::StatusOr<std::vector<CheckpointInfo>> PruneCheckpoints(const std::string& dir, const Retention& keep,
                                                             const std::string& must_keep = "");

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
// Into every model chunk a rank holds (written at the same virtual stages).
absl::StatusOr<Resumed> RestoreTrainingCheckpoint(const std::string& checkpoint,
                                                  const std::vector<shardformer::ShardedModel*>& chunks,
                                                  Optimizer& optimizer);

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_CHECKPOINT_H_
