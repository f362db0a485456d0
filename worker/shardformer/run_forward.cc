#include "worker/shardformer/run_forward.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "worker/colo/local_mesh.h"
#ifdef COLOD_WITH_CUDA
#include "worker/colo/nccl_process_group.h"
#endif
#include "worker/shardformer/shardformer.h"

namespace colod::shardformer {

absl::Status RunOnLocalRanks(const ShardConfig& shard, bool cuda,
                             const std::function<absl::Status(int, ProcessGroup&, const ShardConfig&)>& body) {
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromShardConfig(shard.layout));
  if (!cuda) {
    return RunLocalMesh(mesh, [&](int rank, ProcessGroup& pg) { return body(rank, pg, shard); });
  }
#ifdef COLOD_WITH_CUDA
  return RunLocalNcclMesh(mesh, [&](int rank, ProcessGroup& pg) {
    ShardConfig mine = shard;
    mine.device = Device::Cuda(rank);
    return body(rank, pg, mine);
  });
#else
  return absl::FailedPreconditionError("this build has no CUDA: run on the CPU (without --device cuda)");
#endif
}

absl::StatusOr<ForwardResult> RunForward(const ForwardRequest& request) {
  const Tensor& ids = request.ids;
  if (ids.dim() != 2 || (ids.dtype() != DType::kI64 && ids.dtype() != DType::kI32)) {
    return absl::InvalidArgumentError(absl::StrCat("the input must be integer token ids [batch, seq], got ",
                                                   DTypeName(ids.dtype()), " ", ShapeToString(ids.shape())));
  }
  const int64_t batch = ids.shape()[0], seq = ids.shape()[1];
  if (seq < 2) return absl::InvalidArgumentError("sequences need at least 2 tokens for a next-token loss");
  RETURN_IF_ERROR(DeviceMesh::FromShardConfig(request.shard.layout).status());
  const int dp = std::max(1, request.shard.layout.data_parallel_size());
  if (batch % dp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the batch of ", batch, " sequences does not split over data_parallel_size ", dp));
  }
  ASSIGN_OR_RETURN(ModelConfig config, LoadConfig(request.model_dir));
  RETURN_IF_ERROR(CheckShardable(config, request.shard.layout));

  ForwardResult result;
  ASSIGN_OR_RETURN(result.logits, Tensor::Zeros({batch, seq, config.vocab_size}, DType::kF32));
  absl::Mutex mu;
  const int64_t rows = batch / dp;
  RETURN_IF_ERROR(RunOnLocalRanks(request.shard, request.cuda, [&](int, ProcessGroup& pg, const ShardConfig& shard)
                                                                     -> absl::Status {
    NoGradScope no_grad;  // a forward pass: no tape, no gradients
    ASSIGN_OR_RETURN(std::unique_ptr<ShardedModel> model, ShardFormer(shard, &pg).Load(request.model_dir));
    ASSIGN_OR_RETURN(int replica, pg.dp_local_rank());
    ASSIGN_OR_RETURN(Tensor mine, ids.Narrow(0, replica * rows, rows));
    mine = mine.Contiguous();
    ASSIGN_OR_RETURN(ColoTensor logits, model->Forward(mine));
    ASSIGN_OR_RETURN(LmLoss loss, model->NextTokenLoss(logits, mine));
    ASSIGN_OR_RETURN(Tensor full, model->GatherLogits(logits));
    ASSIGN_OR_RETURN(int tp_rank, pg.tp_local_rank());
    if (tp_rank != 0) return absl::OkStatus();  // one writer per replica
    absl::MutexLock lock(&mu);
    ASSIGN_OR_RETURN(Tensor place, result.logits.Narrow(0, replica * rows, rows));
    RETURN_IF_ERROR(place.CopyFrom(full));
    result.loss = loss.value;
    result.tokens = loss.tokens;
    return absl::OkStatus();
  }));
  return result;
}

}  // namespace colod::shardformer
