// A pipeline stage's training step (issue 20): the step's micro-batches
// through this stage in the 1F1B order (pipeline_schedule.h), activations
// sent to the next stage and their gradients to the previous one, and what
// a step needs across stages besides (the tied embedding's gradient, the
// loss on every stage).
//
// Channels: each direction between two neighbours has its own communicator
// of the pp group ("pp#f0"/"pp#f1" forward, "pp#b0"/"pp#b1" backward, by
// the sending stage's parity), so each of a stage's communicator threads
// (Gloo) or streams (NCCL) carries one flow in micro-batch order: a send
// waits for its receiver on its own thread or stream, never in front of a
// receive; the schedule's simulation (SimulatePipeline) shows 1F1B
// deadlock-free under exactly this model, receives posted when needed. On
// Gloo each channel's next receive is posted as soon as its previous one
// was read (a gradient's once its forward ran), ahead of the task that
// reads it, so that the transfer overlaps the stage's compute (a Gloo send
// waits until its receiver posted); a receive posted ahead holds up only
// its channel's own thread, which only receives. On NCCL receives are
// posted when needed: NCCL connects a pair of ranks at its first
// operation, holding the host until the peer's matching one. On CUDA ranks
// a receive is waited for by the compute stream (Work::WaitOnDevice), not
// the host. A step that fails with a receive still posted (one posted
// ahead, or one whose wait failed) aborts that channel before it returns
// (its sender may wait for this rank).
//
// Thread-safety: called by the stage's rank thread.
#ifndef COLOD_WORKER_TRAIN_PIPELINE_H_
#define COLOD_WORKER_TRAIN_PIPELINE_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/colo/process_group.h"
#include "worker/shardformer/shardformer.h"
#include "worker/train/data_parallel.h"

namespace colod::train {

struct PipelineStepResult {
  double loss = 0;          // the step's, the same on every stage
  // The step's span on this stage: from its first task until the loss's
  // all-reduce over pp, which every stage leaves at once, ended it.
  double span_seconds = 0;
  // This stage's idle time in the span: the span less its tasks' busy time
  // (its waits for a neighbour, and a later stage's time after its last
  // task). Its bubble.
  double wait_seconds = 0;
  // The pipeline's stages' idle time, averaged: the span less their mean
  // busy time (the schedule's bubble, (p - 1) / (V m + p - 1) of the span
  // with even stages). All three are host times: on CUDA ranks the host
  // does not wait for the device, so they describe its enqueueing there.
  double mean_wait_seconds = 0;
  // An evaluation's classifier (train false): the rows whose largest logit
  // is their label's, this replica's, on every stage.
  int64_t correct = 0;
};

// The rows of `logits` ([rows, 1, labels], whole) whose largest logit is
// their label's (`labels` [rows]; -100 is no label). The read's error where
// the logits cannot be copied to the host.
absl::StatusOr<int64_t> CorrectRows(const Tensor& logits, const Tensor& labels);

// `forward`'s output (logits, or the LM head's input where the head is
// fused) and its loss against `labels`, divided by `denominator`: an image
// classifier's ClassificationLoss (labels [rows]; with `correct`, the rows
// it classifies right added to it: the logits gathered), any other model's
// ForwardTokenLoss (labels [rows, seq]). Collective over the model's ranks.
absl::StatusOr<shardformer::LmLoss> ForwardLoss(shardformer::ShardedModel& model,
                                                const std::function<absl::StatusOr<ColoTensor>()>& forward,
                                                const Tensor& labels, int64_t denominator,
                                                int64_t* correct = nullptr);

// Makes the four channels (those a pipeline of `stages` uses), in one order
// on every rank: collective over the pp group, and over the whole mesh on
// NCCL, whose groups are splits of the world communicator; so every rank
// calls it at the same point, before its first step.
// With virtual_stages > 1, the two channels between the last rank and the
// first as well ("pp#fw", "pp#bw").
absl::Status MakePipelineChannels(ProcessGroup& pg, int stages, int virtual_stages = 1);

// Runs one step's forwards and backwards of `model`'s stage over
// `micro_batches` equal parts of this replica's `inputs` (token ids [rows,
// seq], or an image classifier's pixels [rows, channels, side, side]) and
// `labels`, each micro-batch's loss divided by `step_labels`.
// With `reduce`, GradSync reduces over dp during the stage's last backward;
// without (an accumulation pass before the step's last), the gradients
// only add up. Without `train` (an evaluation, under a NoGradScope) the
// micro-batches only go forward, in order, and `sync` is not used.
// Collective over the pp group (and the groups the layers use).
// An encoder-decoder (T5) takes its decoder's input ids [rows, decoder
// seq] as `decoder_inputs` (required for one, refused for any other).
// The last stage's backwards start from each loss times `loss_scale` (fp16's,
// LossScaler), so every stage's gradients are scaled by it.
absl::StatusOr<PipelineStepResult> RunPipelineStep(shardformer::ShardedModel& model, ProcessGroup& pg, GradSync& sync,
                                                   const Tensor& inputs, const Tensor& labels, int64_t micro_batches,
                                                   int64_t step_labels, bool reduce = true, bool train = true,
                                                   const Tensor* decoder_inputs = nullptr, double loss_scale = 1.0);
// The interleaved schedule (InterleavedSchedule) over this rank's model
// chunks, chunks[c] virtual stage c * pp + (its pp coordinate) of pp * V
// (ShardConfig::virtual_stages): activations and gradients go between
// virtual stages, the last rank's chunk c sending to the first rank's chunk
// c + 1 on channels of their own, each message tagged with its sender's
// virtual stage and micro-batch. micro_batches must be a multiple of pp
// where V > 1. One chunk is the call above.
absl::StatusOr<PipelineStepResult> RunPipelineStep(const std::vector<shardformer::ShardedModel*>& chunks,
                                                   ProcessGroup& pg, GradSync& sync, const Tensor& inputs,
                                                   const Tensor& labels, int64_t micro_batches, int64_t step_labels,
                                                   bool reduce = true, bool train = true,
                                                   const Tensor* decoder_inputs = nullptr, double loss_scale = 1.0);

// `value` summed over the `axis` group of `pg`, through the rank's
// `device` (NCCL reduces device memory), in f32. Collective over the group.
absl::StatusOr<double> SumOver(ProcessGroup& pg, const std::string& axis, double value, const Device& device);
// The same, element by element, in one all-reduce.
absl::StatusOr<std::vector<double>> SumOver(ProcessGroup& pg, const std::string& axis, std::vector<double> values,
                                            const Device& device);

// The gradients of every table several (virtual) stages hold
// (NamedParam::tie_stages: an embedding and the last stage's mirror of it
// for a tied head; T5's shared embedding and position bias tables) summed
// over their holders in stage order, the same bits on each: the owner
// (the first holder) gathers the others' over "pp#f0" and sends the sum
// back over "pp#b1"; copies on one rank (chunks of an interleaved rank) are
// added in place. `chunk_params[c]` are chunks[c]'s Parameters(). Nothing
// without such tables. After the step's backwards (and the dp
// reduction); collective over the holders' ranks.
absl::Status SumTiedGradients(const std::vector<shardformer::ShardedModel*>& chunks,
                              const std::vector<std::vector<shardformer::NamedParam>>& chunk_params,
                              ProcessGroup& pg);

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_PIPELINE_H_
