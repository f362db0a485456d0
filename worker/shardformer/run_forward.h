// One forward pass of a model directory on a local mesh of ranks (threads
// over Gloo on loopback): what `coloctl forward` runs without a cluster,
// and what a worker daemon's FORWARD job runs on each of its ranks.
#ifndef COLOD_WORKER_SHARDFORMER_RUN_FORWARD_H_
#define COLOD_WORKER_SHARDFORMER_RUN_FORWARD_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "colod/v1/job.pb.h"
#include "spec/model_config.h"
#include "worker/colo/process_group.h"
#include "worker/shardformer/shard_config.h"
#include "worker/tensor/tensor.h"

namespace colod::shardformer {

// Runs body(rank, pg, shard) on every rank of `shard`'s mesh as threads of
// this process: over Gloo on loopback with host tensors, or with `cuda`
// over NCCL, rank r on CUDA device r (`shard.device` set accordingly;
// FAILED_PRECONDITION in a build without CUDA or with too few devices).
// `comm_timeout` bounds each rendezvous and collective: a rank that stops
// taking part fails the others with DEADLINE_EXCEEDED after it, and a rank
// that fails aborts the others at once (RunLocalRanks).
absl::Status RunOnLocalRanks(const ShardConfig& shard, bool cuda,
                             const std::function<absl::Status(int rank, ProcessGroup& pg, const ShardConfig& shard)>& body,
                             absl::Duration comm_timeout = absl::Seconds(60));

struct ForwardRequest {
  std::string model_dir;
  // Integer token ids [batch, seq], or for a model that takes images (ViT)
  // float pixel values [batch, channels, image_size, image_size]; the batch
  // splits over dp.
  Tensor input;
  // An image classifier's integer labels [batch] (-100: left out); without
  // them its pass has no loss.
  std::optional<Tensor> labels;
  // An encoder-decoder's (T5's) decoder ids [batch, seq]: required for one;
  // its loss is next-token cross-entropy over them.
  std::optional<Tensor> decoder_input;
  ShardConfig shard;
  bool cuda = false;  // one rank per CUDA device, over NCCL
  absl::Duration comm_timeout = absl::Seconds(60);  // per rendezvous and collective
  // Whether the logits are wanted (ForwardResult::logits). Without them
  // the ranks gather nothing: each keeps only its part of the batch's
  // logits, and the result holds the loss and the logits' shape.
  bool gather_logits = true;
};

struct ForwardResult {
  // f32 [batch, seq, vocab_size] (an encoder-decoder's decoder seq),
  // vocabulary padding removed; an image classifier's [batch, num_labels].
  // Empty unless ForwardRequest::gather_logits.
  Tensor logits;
  // Their shape (ForwardLogitsShape), gathered or not.
  Shape logits_shape;
  // Mean next-token cross-entropy, or an image classifier's cross-entropy
  // against its labels (0 without them).
  double loss = 0;
  // How many predictions it averages: batch * (seq - 1), or the labelled
  // images (0: no loss).
  int64_t tokens = 0;
  // ShardedModel::unread_tensors of the model it ran.
  std::vector<std::string> unread_tensors;
};

// INVALID_ARGUMENT, before any rank starts, for an input that is not what
// the model reads (integer ids [batch, seq]; an image classifier's float
// [batch, channels, image_size, image_size] and labels [batch] within its
// num_labels), a batch the dp degree does not divide, or a layout the model
// cannot take; errors of the model directory as ShardFormer::Load.
absl::StatusOr<ForwardResult> RunForward(const ForwardRequest& request);

// The checks RunForward makes before any rank starts (above); returns the
// model's config.
absl::StatusOr<ModelConfig> CheckForward(const ForwardRequest& request);

// The shape of the batch's logits (ForwardResult::logits) for a request
// CheckForward accepted with `config`.
Shape ForwardLogitsShape(const ForwardRequest& request, const ModelConfig& config);

// One rank's part of RunForward (every rank of the mesh runs it): the
// batch's loss, and with gather_logits the logits of every sequence of the
// batch, gathered over tp and dp, on every rank.
absl::StatusOr<ForwardResult> ForwardRank(const ForwardRequest& request, ProcessGroup& pg, const ShardConfig& shard);

// Puts `names` (ForwardResult::unread_tensors) into `result`, held to what
// a job keeps (BoundUnreadTensors), and their count.
void SetUnreadTensors(const std::vector<std::string>& names, v1::ForwardResult& result);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_RUN_FORWARD_H_
