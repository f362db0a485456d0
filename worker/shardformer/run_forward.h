// One forward pass of a model directory on a local mesh of ranks (threads
// over Gloo on loopback): what `coloctl forward` runs without a cluster,
// and what a worker daemon's FORWARD job runs on each of its ranks.
#ifndef COLOD_WORKER_SHARDFORMER_RUN_FORWARD_H_
#define COLOD_WORKER_SHARDFORMER_RUN_FORWARD_H_

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "worker/colo/process_group.h"
#include "worker/shardformer/model_config.h"
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
  Tensor ids;  // integer token ids [batch, seq]; the batch splits over dp
  ShardConfig shard;
  bool cuda = false;  // one rank per CUDA device, over NCCL
  absl::Duration comm_timeout = absl::Seconds(60);  // per rendezvous and collective
};

struct ForwardResult {
  Tensor logits;      // f32 [batch, seq, vocab_size], vocabulary padding removed
  double loss = 0;    // mean next-token cross-entropy
  int64_t tokens = 0; // how many predictions it averages: batch * (seq - 1)
};

// INVALID_ARGUMENT, before any rank starts, for ids that are not an integer
// [batch, seq] array, a batch the dp degree does not divide, or a layout the
// model cannot take; errors of the model directory as ShardFormer::Load.
absl::StatusOr<ForwardResult> RunForward(const ForwardRequest& request);

// The checks RunForward makes before any rank starts (above); returns the
// model's config.
absl::StatusOr<ModelConfig> CheckForward(const ForwardRequest& request);

// One rank's part of RunForward (every rank of the mesh runs it): the
// logits of every sequence of the batch, gathered over tp and dp, on every
// rank, with the batch's loss.
absl::StatusOr<ForwardResult> ForwardRank(const ForwardRequest& request, ProcessGroup& pg, const ShardConfig& shard);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_RUN_FORWARD_H_
