// Checkpoints of a training run, and resuming from them.
//
// DIR/step-000005/ holds the model as a sharded checkpoint
// (worker/shardformer/checkpoint.h), each rank's optimizer state
// (optim-rank-NNNNN-of-MMMMM.safetensors: "<param>.exp_avg", ..., or under
// ZeRO the parts of parameters the rank updates, "<param>.exp_avg@<offset>",
// 1-D runs of the flattened local shard: Optimizer::State) and
// train_state.json (the step, the optimizer's step count, the sampler's
// seed, the layout, and the job and generation that wrote it). Ranks write
// into step-000005.[JOB.]gen-G.tmp (StepTmpDir: the coordinator's job and
// generation; local-ID.gen-0 for a run outside a coordinator); once every rank
// agreed that every rank wrote its part (AgreeOverMesh: a rank that could
// not fails with its own error, the others with one marked IsPeerCaused),
// rank 0 writes train_state.json, checks every rank's files, and moves the
// directory into place, so a crash mid-write leaves the .tmp directory
// behind and the previous checkpoint whole. A generation writes only its own
// temporary directory, so a rank of an earlier generation that the
// coordinator gave up on (its --stop-grace) and that still writes never
// writes into a later generation's checkpoint, and it never replaces a
// later generation's checkpoint of the same step. Nor does a rank aborted
// by the time it puts its checkpoint in place (ProcessGroup::Aborted: the
// coordinator may have given up on it, and the directory's next job saved
// there) replace another job's checkpoint of the step: it removes its
// temporary directory instead (its whole checkpoint still goes in where
// nothing is in place, or its own job's is: a restart resumes from it),
// and an aborted rank starts no save and prunes nothing. Rank 0 removes the other
// temporary directories but those of its job's later generations when a
// save starts and again when it ends: a directory holds one job's
// temporary directories at a time. The job is the coordinator's job id and
// its uid (job-NNNNNN_UID: ids are counted in one coordinator's data dir).
// Resuming picks the newest checkpoint whose files all open and validate
// (a truncated file is detected by the safetensors header checks) and needs
// the layout it was written with but for data_parallel_size: each rank puts
// its optimizer state together from the pieces the ranks with its tp and pp
// coordinates wrote, so a run resumes at another dp size and with or
// without ZeRO (consolidate the checkpoint to change the rest).
// A job the coordinator restarts resumes from its own newest
// (LatestCheckpoint's writers). Retention (PruneCheckpoints) keeps the
// newest K of the run's own checkpoints and its best by eval loss
// (train_state.json's eval_loss) and removes the rest of its own, after
// each save; what other runs left in the directory is never removed.
//
// Thread-safety: free functions; SaveTrainingCheckpoint and
// RestoreTrainingCheckpoint are collective.
#ifndef COLOD_WORKER_TRAIN_CHECKPOINT_H_
#define COLOD_WORKER_TRAIN_CHECKPOINT_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/colo/process_group.h"
#include "worker/shardformer/shardformer.h"
#include "worker/tensor/dtype.h"
#include "worker/train/optimizer.h"

namespace colod::train {

// The checkpoint directory of `step` under `dir`: DIR/step-NNNNNN.
std::string StepDir(const std::string& dir, int64_t step);

// Who writes a checkpoint: the coordinator's job and generation
// (TrainOptions::job, generation), or, for a run outside a coordinator, an
// id of that run alone ("local-" and 16 hex digits) and generation 0
// (before 2026-12 no job: every such run was one writer).
struct CheckpointWriter {
  std::string job;  // letters, digits, '-' and '_', at most 128 (it names a directory)
  int64_t generation = 0;
  // The writers whose run this one continues (resumed from a directory of
  // their checkpoints, --resume D), oldest first, at most
  // kMaxCheckpointLineage (the newest): their checkpoints count as this
  // run's for retention (PruneCheckpoints). A save records them with its
  // own job in train_state.json ("lineage"), so that a chain of resumes
  // (each run killed and resumed in the same directory) prunes what every
  // earlier link wrote. "" stands for a run outside a coordinator of before
  // 2026-12.
  std::vector<std::string> lineage;

  // "JOB.gen-G", or "gen-G" without a job.
  std::string Tag() const;
  // INVALID_ARGUMENT for a job name (own or of the lineage), a generation
  // or a lineage's length that cannot be.
  absl::Status Check() const;
};

// The most writers a CheckpointWriter's lineage holds.
inline constexpr size_t kMaxCheckpointLineage = 64;

// The lineage of a run resumed from `resumed` (a checkpoint's writer job and
// lineage) whose own job is `job`: `lineage`, then `resumed` where it is
// not already there, less `job` and any name no writer can have, the
// newest kMaxCheckpointLineage. (The trainer passes the checkpoint's
// lineage only where the run saves into the directory it resumed from.)
std::vector<std::string> ContinuedLineage(const std::vector<std::string>& lineage, const std::string& resumed,
                                          const std::string& job);

// `lineage` less the writers of which `dir` holds no checkpoint now
// (ListCheckpoints; `dir` as it is where it cannot be listed): a chain of
// resumes in one directory carries only the links whose checkpoints
// retention still counts, so that it stays far below kMaxCheckpointLineage
// however long the chain (a capped lineage lost its oldest link, whose best
// checkpoint was then neither counted nor removed, and a second "best" was
// kept). The trainer passes a resumed checkpoint's lineage through it.
std::vector<std::string> LineageWithCheckpointsIn(const std::vector<std::string>& lineage, const std::string& dir);

// The temporary directory `writer` writes StepDir(dir, step) through:
// DIR/step-NNNNNN.[JOB.]gen-G.tmp.
std::string StepTmpDir(const std::string& dir, int64_t step, const CheckpointWriter& writer);

// After `step` (1-based) optimizer steps, into StepDir(dir, step), with
// the held-out evaluation's loss of that step if one ran (retention keeps
// the best by it), through StepTmpDir(dir, step, writer). An existing
// StepDir(dir, step) (a run resumed from before it) is replaced by an
// atomic exchange and then removed (where the file system cannot exchange:
// moved aside, the new one renamed in, moved back if that fails); ABORTED,
// leaving it, where it is a later generation's of the same job, or another
// job's and the rank was aborted (ProcessGroup::Aborted).
absl::Status SaveTrainingCheckpoint(shardformer::ShardedModel& model, Optimizer& optimizer, const std::string& dir,
                                    int64_t step, uint64_t seed, std::optional<double> eval_loss = std::nullopt,
                                    const CheckpointWriter& writer = {});
// The same of every model chunk a rank holds (interleaved 1F1B), chunk 0
// first, whose parameters `optimizer` takes together. `report` (a JSON
// object's text, if given): what rank 0 reported of the step, kept in
// train_state.json so that a restart can report it again
// (Resumed::report). `mask_token_id`: a masked language model's, recorded
// so that a resume masks as the run did (Resumed::mask_token_id).
// `loss_scale`: fp16's, after the step, recorded so that a resume scales as
// the run would have (Resumed::loss_scale).
absl::Status SaveTrainingCheckpoint(const std::vector<shardformer::ShardedModel*>& chunks, Optimizer& optimizer,
                                    const std::string& dir, int64_t step, uint64_t seed,
                                    std::optional<double> eval_loss = std::nullopt, const CheckpointWriter& writer = {},
                                    const std::string& report = "", std::optional<int64_t> mask_token_id = std::nullopt,
                                    const LossScaler* loss_scale = nullptr);

// A worker's path policy (--allow-path: PathPolicy::Check) for what a
// directory a job names holds: PERMISSION_DENIED for a path that resolves
// outside the allowed ones.
using PathCheck = std::function<absl::Status(const std::string& path)>;

// The newest complete checkpoint directory under `dir` (DIR/step-NNNNNN),
// or `dir` itself where it is one (FAILED_PRECONDITION where it is damaged),
// skipping damaged ones; `skipped` (if given) gets the ones passed over and
// why. With `writers`, only the checkpoints one of them wrote count (their
// train_state.json's "job", CheckpointWriter::job, of any generation): a
// job restarted by the coordinator resumes from its own newest, never from
// a later step another run left in the same directory. NOT_FOUND when none
// is complete (or none is theirs) or `dir` cannot be listed, UNAVAILABLE
// when reading it fails midway. With `check` (a worker's --allow-path
// policy), each checkpoint directory and each file in it is checked before
// anything of it is read, since any may be a link out of the allowed
// paths: its error (PERMISSION_DENIED) ends the search.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& dir, std::vector<std::string>* skipped = nullptr,
                                             const std::optional<std::vector<std::string>>& writers = std::nullopt,
                                             const PathCheck& check = nullptr);

// A complete checkpoint of a run's directory, as retention and `coloctl
// checkpoints` see it.
struct CheckpointInfo {
  std::string path;  // DIR/step-NNNNNN
  int64_t step = 0;
  std::optional<double> eval_loss;  // the held-out evaluation of its step, if one ran
  int64_t bytes = 0;                // its files' sizes
  std::string job;  // its writer (CheckpointWriter::job; "" of a run outside a coordinator before 2026-12)
};

// The checkpoints under `dir` whose train_state.json reads (rank 0 writes it
// last, before the directory is renamed into place), oldest first; a
// directory being written (.tmp) or whose state does not read is left out
// (`skipped` gets it and why). NOT_FOUND when `dir` cannot be listed,
// UNAVAILABLE when reading it fails midway.
absl::StatusOr<std::vector<CheckpointInfo>> ListCheckpoints(const std::string& dir,
                                                            std::vector<std::string>* skipped = nullptr);

// Which checkpoints a run keeps (TrainConfig.keep_last, keep_best).
struct Retention {
  int64_t keep_last = 0;   // the newest this many; 0: all
  bool keep_best = false;  // and the one of lowest eval loss (the earliest of equals)
};

// Puts back as DIR/step-N each checkpoint a save moved aside to replace it
// (DIR/.trash-step-N.[JOB.]gen-G, where the file system cannot exchange)
// when no DIR/step-N is there and it is a whole checkpoint of step N: the
// save's process ended between its two renames, and the moved-aside copy
// is the only one of step N. Those of
// `writer`'s job's later generations are left alone (that save may be
// running). A resume calls it before it looks for the newest checkpoint,
// and PruneCheckpoints before it removes leftovers. Never fails: what
// cannot be put back (a read-only directory) is logged and left, and so is
// one `check` refuses (nothing of it is read).
void RestoreMovedAsideCheckpoints(const std::string& dir, const CheckpointWriter& writer,
                                  const PathCheck& check = nullptr);

// Removes `writer`'s checkpoints under `dir` (those its job wrote, of any
// generation) that `keep` does not keep, and the leftovers of removals a
// crash interrupted; returns its checkpoints kept, oldest first. Other
// writers' checkpoints (a run the directory held before, another job) are
// neither counted nor removed nor returned, but those of the writers in
// its lineage, which count as its own: the runs it continues, whose
// checkpoints in a directory a run continues in are the same run's
// (--resume D --save D). Its newest is always kept (a
// restart resumes from it), and nothing being written (.tmp) or unreadable
// is touched. A removal first renames
// the directory out of the checkpoints' names (DIR/.trash-step-NNNNNN,
// atomic, needing no space), so a crash or a failing removal never leaves
// a half-deleted checkpoint for a resume to pick; a removal that fails
// leaves the checkpoint in place (kept, and logged), with the rest done.
// `must_keep` (a path as ListCheckpoints gives it) is kept whatever the
// rest: the checkpoint just written, even where the directory holds a
// higher-numbered one of the same writer (an earlier run outside a
// coordinator). The leftovers of `writer`'s
// job's later generations (a checkpoint moved aside mid-replace where the
// file system cannot exchange, .trash-step-N.JOB.gen-G) are left alone;
// the others' are put back where their step has no checkpoint
// (RestoreMovedAsideCheckpoints, with `check`), and removed where it has.
absl::StatusOr<std::vector<CheckpointInfo>> PruneCheckpoints(const std::string& dir, const Retention& keep,
                                                             const std::string& must_keep = "",
                                                             const CheckpointWriter& writer = {},
                                                             const PathCheck& check = nullptr);

struct Resumed {
  int64_t step = 0;  // steps done; training continues with step + 1
  uint64_t seed = 0;
  std::string job;     // its writer (CheckpointWriter::job; "" of a run outside a coordinator before 2026-12)
  std::vector<std::string> lineage;  // its writer's (CheckpointWriter::lineage); none before 2026-12
  std::string report;  // SaveTrainingCheckpoint's report (a JSON object's text), or ""
  // The parameters' dtype it was trained with (F32, or BF16/F16 under mixed
  // precision); in a checkpoint of before 2026-12-06, which records none,
  // what its index's dtypes say (none where they do not read).
  std::optional<DType> param_dtype;
  // A masked language model's [MASK] id it trained with; none for another
  // model, and in a checkpoint of before 2026-12-07 (a BERT then trained on
  // next tokens).
  std::optional<int64_t> mask_token_id;
  // fp16's loss scale after the checkpoint's step and the steps in a row
  // without overflow since it last changed (LossScaler); none for another
  // precision, and in a checkpoint of before 2026-12-08.
  std::optional<double> loss_scale;
  int64_t loss_scale_good_steps = 0;
};
// The step, seed and writer a checkpoint records.
absl::StatusOr<Resumed> ReadTrainState(const std::string& checkpoint);
// Loads the parameters and optimizer state of `checkpoint` (a step
// directory) into this rank's model and optimizer. FAILED_PRECONDITION when
// it was written at another layout (data_parallel_size aside),
// INVALID_ARGUMENT when a piece this rank needs is missing.
absl::StatusOr<Resumed> RestoreTrainingCheckpoint(const std::string& checkpoint, shardformer::ShardedModel& model,
                                                  Optimizer& optimizer);
// Into every model chunk a rank holds (written at the same virtual stages).
// `parameters_only`: the optimizer's state is not read (an evaluation, which
// updates nothing: a checkpoint of another optimizer's evaluates too).
absl::StatusOr<Resumed> RestoreTrainingCheckpoint(const std::string& checkpoint,
                                                  const std::vector<shardformer::ShardedModel*>& chunks,
                                                  Optimizer& optimizer, bool parameters_only = false);

namespace internal {
// Testing only, a fault-injection seam for the race a save can lose: where
// rank 0 exchanges its checkpoint with the one in place (renameat2's
// RENAME_EXCHANGE), hook(1) runs just before that exchange and hook(2)
// before a later generation's checkpoint, found exchanged out, is put back;
// a non-zero return fails that exchange with it as errno. An empty function
// (the default) removes the hook. Thread-safe; the hook runs on the saving
// thread, without the seam's lock held.
void SetCheckpointExchangeHookForTesting(std::function<int(int exchange)> hook);
// Testing only: hook(pg) runs on rank 0 once its checkpoint is whole (every
// rank wrote its part, the state is written and checked), just before it
// puts the checkpoint in place (which then asks whether `pg` was aborted).
// An empty function removes it. Thread-safe, as the exchange's.
void SetCheckpointBeforeInstallHookForTesting(std::function<void(ProcessGroup&)> hook);
// Testing only: hook(pg, tmp) runs on every rank of a save just before it
// writes its part into the temporary directory `tmp` (every rank passed the
// save's first agreement). An empty function removes it. Thread-safe, as the
// exchange's.
void SetCheckpointBeforeWriteHookForTesting(std::function<void(ProcessGroup&, const std::string& tmp)> hook);
}  // namespace internal

// shardformer::ConsolidateCheckpoint of `dir`, a training checkpoint (a
// step directory) or a sharded one: where `dtype` is given and differs from
// a mixed-precision run's parameters' (f32 after bf16, f16 after bf16, ...),
// each block is the run's f32 master weights instead (the optimizer state
// "master", put together from the pieces of the block's rank's dp peers:
// ZeRO's partitions at the dp it was saved at), so that the model is what
// the updates ran on rounded once, as a run's --final-dtype writes it. The
// checkpoint's every file is validated first; INVALID_ARGUMENT naming a
// block whose master weights are not all there.
absl::Status ConsolidateTrainingCheckpoint(const std::string& dir, const std::string& out_dir,
                                           std::optional<DType> dtype);

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_CHECKPOINT_H_
