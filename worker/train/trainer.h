// The training loop: a model directory sharded by ShardFormer on a local
// mesh of ranks (threads over Gloo on loopback; the daemons run the same
// loop once jobs run on them), fed by the seeded sampler, with gradient
// accumulation, bucketed dp gradient sync overlapping backward, global
// gradient-norm clipping, AdamW or SGD and a warm-up + cosine schedule.
//
// Losses are reported as the mean cross-entropy of the whole global batch:
// over its next tokens, its labelled images, or its pairs' targets. Dropout is not modelled (the model families run their
// evaluation semantics), so a run is deterministic for a given seed and
// layout, and runs at different layouts agree up to fp32 rounding.
#ifndef COLOD_WORKER_TRAIN_TRAINER_H_
#define COLOD_WORKER_TRAIN_TRAINER_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/limits.h"
#include "absl/status/status.h"
#include "colod/v1/job.pb.h"
#include "worker/shardformer/shard_config.h"
#include "worker/train/checkpoint.h"
#include "worker/train/data.h"
#include "worker/train/optimizer.h"

namespace colod::train {

struct TrainOptions {
  std::string model_dir;
  // Token data (data.h); for an image classifier (ViT) the images .npy,
  // with their labels in labels_path (image_data.h); for an encoder-decoder
  // (T5) the inputs .npy, with the targets in labels_path (seq2seq_data.h).
  std::string data_path;
  DataFormat data_format = DataFormat::kAuto;
  // Polled between documents while PrepareTrain tokenizes text data (a
  // multi-GB corpus takes minutes): true ends it, CANCELLED. A worker passes
  // its rank's stop, so that an abort or a shutdown need not wait for it.
  std::function<bool()> stopped;
  std::string labels_path;
  int64_t steps = 10;
  int64_t batch_size = 8;     // sequences (images) per pass (a step without grad_accum), over all dp replicas
  int64_t seq_len = 64;       // unused for images and pairs (their arrays' lengths hold)
  int64_t micro_batches = 1;  // each replica's rows in this many passes (a pipeline's micro-batches)
  // Gradient accumulation: this many passes of batch_size sequences (each
  // in its micro-batches) before each optimizer step, as one step on
  // batch_size * grad_accum sequences; the dp sync reduces once a step.
  int64_t grad_accum = 1;
  double lr = 1e-3;
  double min_lr = 0;          // the cosine schedule's floor
  int64_t warmup_steps = 0;
  OptimizerOptions optimizer;
  double clip_norm = 1.0;     // 0: no clipping (the norm is still reported)
  uint64_t seed = 1;
  // The layout; with pipeline stages, shard.layout.virtual_stages > 1 runs the
  // interleaved schedule over that many model chunks a rank (micro_batches a
  // multiple of the stages).
  shardformer::ShardConfig shard;
  // shard.param_dtype is the device's default, not the user's choice (a job
  // spec without a precision): a resumed run takes the checkpoint's instead
  // (a job restarted on workers of the other device kind, a CPU run resumed
  // on a GPU).
  bool precision_auto = false;
  // A resume first agrees over the mesh on the checkpoint's step (every
  // rank chose it on its own). Off where a rank's worker is older and would
  // not join that collective (AssignJobRequest.agree_on_resume).
  bool agree_on_resume = true;
  int64_t bucket_bytes = 25 << 20;
  int zero_stage = 0;         // ZeRO over dp: 0, 1 (optimizer state) or 2 (and gradients); data_parallel.h
  // Held-out evaluation (job.proto's TrainConfig.eval_*): eval_data_path
  // (read as data_path is, with eval_labels_path for examples) or
  // eval_split, the trailing fraction of the data (HeldOutStart).
  std::string eval_data_path, eval_labels_path;
  double eval_split = 0;
  int64_t eval_every = 0;  // 0: after the last step only
  int64_t eval_steps = 0;  // batches of batch_size rows; 0: the held-out data once, at most kDefaultEvalStepsMax
  bool eval_only = false;  // evaluate the model (or resume_dir's checkpoint) once, train nothing
  // If set, the trained model as a Hugging Face directory, after the last
  // step (not by a time-boxed run, stop_after < steps). It must hold no
  // model when the run starts, or the one this job wrote (its
  // kFinalWriterFile names the job: a restart after the write), and be
  // writable (checked before the first step).
  std::string final_dir;
  // final_dir's model's dtype (TrainConfig.final_dtype): nullopt, each
  // tensor in its parameters' (ConsolidateCheckpoint).
  std::optional<DType> final_dtype;
  std::string save_dir;       // if set, a training checkpoint every `save_every` steps
  int64_t save_every = 0;     //   (and after the last step)
  // Retention after each checkpoint (PruneCheckpoints): the newest
  // keep_last (0: all) and, with keep_best, the best by eval loss (which
  // needs eval_every > 0 dividing save_every).
  int64_t keep_last = 0;
  bool keep_best = false;
  // A masked language model's [MASK] id (TrainConfig.mask_token_id):
  // required for one (ModelConfig::masked_lm), refused for another.
  std::optional<int64_t> mask_token_id;
  // fp16 (shard.param_dtype F16): the loss scale the run starts at and the
  // steps without overflow after which it doubles (LossScaler;
  // TrainConfig.loss_scale, loss_scale_window). A resume goes on from its
  // checkpoint's scale. Other precisions scale nothing.
  double loss_scale = LossScaler::kDefaultInitial;
  int64_t loss_scale_window = LossScaler::kDefaultWindow;
  std::string resume_dir;     // if set, continue from its newest complete checkpoint, or from it if it is one
  // The coordinator's job and its generation (the worker daemon sets them;
  // none and 0 elsewhere): checkpoints are written through a temporary
  // directory of the generation's own (StepTmpDir), so that a rank of an
  // earlier generation still running never writes into this one's.
  std::string job;
  int64_t generation = 0;
  // If set, resume only from a checkpoint one of these wrote
  // (LatestCheckpoint's writers): the worker daemon sets it where the
  // coordinator restarts a job from its own checkpoints
  // (AssignJobRequest.resume_own_checkpoints), so that a later step another
  // job left in resume_dir is never taken: `job`, and the bare job id that
  // workers before the job uid recorded.
  std::optional<std::vector<std::string>> resume_writers;
  // The worker's path policy (--allow-path) for what a named directory
  // holds: the checkpoints a resume looks at, each a directory of files
  // that may be links out of the allowed paths (LatestCheckpoint's check).
  // Empty: none.
  PathCheck check_path;
  // If > 0 and < steps, stop after this step (as an interruption would),
  // writing no final model; at or past steps, the run is whole.
  int64_t stop_after = 0;
  bool cuda = false;          // one rank per CUDA device over NCCL (else host tensors over Gloo)
  bool allow_tf32 = false;    // CUDA: f32 GEMMs may round their operands to TF32 (ops::SetAllowTf32)
  // CUDA: read each step as it ends, not once the next step is enqueued (the
  // host then never runs ahead of the device; bench:train's A/B row).
  bool read_each_step = false;
  // Train(): each rendezvous and collective; a rank that stops taking part
  // fails the run with DEADLINE_EXCEEDED after it.
  absl::Duration comm_timeout = absl::Seconds(60);
};

inline constexpr int64_t kDefaultEvalStepsMax = 100;

// A held-out evaluation: the mean cross-entropy over every labelled
// position of its batches (all dp replicas), with no gradient.
struct EvalStats {
  int64_t step = 0;  // optimizer steps done before it
  double loss = 0;
  std::optional<double> perplexity;  // language models (token corpora, pairs): exp(loss)
  std::optional<double> accuracy;    // classifiers: labelled rows whose largest logit is their label's
  int64_t tokens = 0;                // labelled positions read
  double seconds = 0;
};

// The file in a run's final_dir naming the job that writes it (TrainOptions::
// final_dir): a restart of the job may write the model there again.
inline constexpr char kFinalWriterFile[] = ".colod-final-writer";

// What each step reports. Train() reports rank 0's; RunTrainRank reports
// every rank's own (the loss is the global batch's on every rank).
struct StepStats {
  int rank = 0;
  int64_t step = 0;  // 1-based
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;  // before clipping; computed on the device, rounded to f32
  // fp16: the loss scale the step's backward started from (0: none), and
  // whether its gradients overflowed at it (a norm that is not finite), so
  // that it updated nothing and the next step's scale is half (LossScaler).
  double loss_scale = 0;
  bool update_skipped = false;
  double tokens_per_second = 0;  // images per second for an image classifier; input + target tokens for pairs
  // On a CUDA device: its memory pool after the step (kernels::GetCudaPoolBytes).
  bool cuda = false;
  int64_t pool_reserved_bytes = 0, pool_used_bytes = 0;
  // The step's wall time: from its start, or, where the host ran a step
  // ahead (on a CUDA device the step is read once the next one is enqueued),
  // from the previous step's read to its own, the device's time for it.
  double seconds = 0;
  // The host's wait in the step's one read of the device (the loss and the
  // grad norm, after the update and, running ahead, the next step are
  // enqueued): how long the device was still busy with the step once the
  // host had enqueued that much. Near 0 where the host, not the device, sets
  // the pace. 0 on the CPU (nothing to wait for).
  double device_wait_seconds = 0;
  // The host's time to enqueue the step: from its start (its batch) to its
  // update and the tensor of its read. Near `seconds` where the host, not
  // the device, sets the pace (a CUDA step's launches outrun by its kernels).
  double enqueue_seconds = 0;
  // Pipeline stages: the idle time of this rank's pipeline's stages in the
  // step, averaged over the stages (the schedule's bubble;
  // PipelineStepResult::mean_wait_seconds), and the span it is idle in
  // (span_seconds), each accumulation pass's added.
  double pipeline_wait_seconds = 0;
  double pipeline_span_seconds = 0;
  int64_t rank_tokens = 0; // tokens this rank's replica processed in the step
  int64_t step_tokens = 0; // tokens the step trained on, over every replica
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
  // Data parallelism (GradSync): the step's gradient bucket bytes, and those
  // whose all-reduce was enqueued during backward (overlapping it).
  int64_t dp_bucket_bytes = 0, dp_overlapped_bytes = 0;
  std::string checkpoint;  // the training checkpoint written after this step, if any
  // Rank 0, after a checkpoint: every checkpoint kept after retention
  // (the newest kMaxReportedCheckpoints), oldest first.
  std::vector<CheckpointInfo> checkpoints;
  std::string resumed_from;  // the first step of a resumed run: the checkpoint it resumed from
  std::optional<EvalStats> eval;  // the held-out evaluation after this step, if one ran
  // False for an eval_only run's one report: `step` is the checkpoint's,
  // `eval` is set, and nothing else was measured.
  bool trained = true;
};

// INVALID_ARGUMENT, before any rank starts, for options that do not fit
// (a batch dp and the micro-batches do not split, a sequence longer than the
// model's positions, an empty corpus, ...), NOT_FOUND for a resume directory
// without a complete checkpoint; then the errors of loading and of the ranks.
// Resuming continues with the checkpoint's seed and the step after its own,
// and reports exactly the losses the uninterrupted run would have.
// A run that diverges ends with FAILED_PRECONDITION at the first step whose
// loss or gradient norm (or whose evaluation's loss) is not finite, naming
// it and its values: that step is not reported, evaluated or saved.
// `on_start` (if set) gets rank 0's RankStart once its model is loaded.
struct RankStart;
absl::Status Train(const TrainOptions& options, const std::function<void(const StepStats&)>& on_step,
                   const std::function<void(const RankStart&)>& on_start = nullptr);

// A run validated and opened once (options, model config, corpus, sampler,
// resume point), shared read-only by the ranks of one process. Train() is
// PrepareTrain + RunTrainRank on local ranks; a worker daemon prepares its
// own copy and runs the one rank it was assigned.
struct PreparedTrain;
absl::StatusOr<std::shared_ptr<const PreparedTrain>> PrepareTrain(const TrainOptions& options);

// Where a rank starts: the checkpoint it resumed from (step 0 and empty
// where it starts from the model).
struct RankStart {
  int64_t step = 0;
  std::string checkpoint;
  // Rank 0, where the checkpoint is this job's own (a restart): the step it
  // was written after, as rank 0 reported it then. The report may have died
  // with the worker that wrote the checkpoint (the checkpoint is put in
  // place before the step is reported), and the restart begins after that
  // step, so it is reported again (the coordinator records each step once).
  std::optional<v1::StepProgress> checkpoint_step;
  // Rank 0: newer checkpoints passed over as damaged ("step-000010: why").
  std::vector<std::string> skipped;
  // Rank 0: tensors of the model's files no parameter took
  // (ShardedModel::unread_tensors; none where the pipeline split it).
  std::vector<std::string> unread_tensors;
  // The parameters' dtype it trains at: TrainOptions' precision, or the
  // checkpoint's where precision_auto resumed one of another.
  DType param_dtype = DType::kF32;
};

struct RankHooks {
  // Called on this rank once the model (and any checkpoint) is loaded,
  // before the first step (also where the checkpoint leaves no step to run).
  std::function<void(const RankStart&)> on_start;
  // Called on this rank after each step, in step order; on a CUDA device
  // once the next step is enqueued, except after the run's last step and
  // where it evaluates, saves or stops.
  std::function<void(const StepStats&)> on_step;
  // Polled before each step; when it returns true the rank reports a step
  // it has enqueued (unless its communicators failed or were aborted
  // first) and stops with CANCELLED (its peers see their collectives fail
  // or time out, and are stopped by the same signal).
  std::function<bool()> stop;
  // A drain (a worker of the job shuts down): set on every rank of the run
  // or on none (AssignJobRequest.drain), and used only where the run saves
  // checkpoints (save_dir). Polled as each step is enqueued; the step's read
  // carries the largest answer of every rank of the mesh (one all-reduce of
  // one element a mesh axis), so every rank learns of a drain at the same
  // step. Each then finishes the step it has enqueued (the one the read
  // found, or on a CUDA device the next, enqueued ahead of it), saves its
  // checkpoint, reports it, and stops with MarkDrained(ABORTED) naming the
  // step. A drain found at the run's last step changes nothing.
  std::function<bool()> drain;
};

// One rank's training loop on `pg` (every rank of the mesh must run it), at
// `shard`'s layout and device and the run's precision (a resumed run's may
// be its checkpoint's: TrainOptions::precision_auto).
// With pipeline stages an error names the stage ("pipeline stage 1 of 2: ...").
absl::Status RunTrainRank(const PreparedTrain& run, int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard,
                          const RankHooks& hooks);

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_TRAINER_H_
