#include "worker/shardformer/run_forward.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "worker/colo/rank_group.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/shardformer/shardformer.h"

namespace colod::shardformer {

absl::Status RunOnLocalRanks(const ShardConfig& shard, bool cuda,
                             const std::function<absl::Status(int, ProcessGroup&, const ShardConfig&)>& body,
                             absl::Duration comm_timeout) {
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromShardConfig(shard.layout));
  LocalRanksOptions options;
  options.cuda = cuda;
  options.timeout = comm_timeout;
  return RunLocalRanks(
      mesh,
      [&](int rank, ProcessGroup& pg) {
        ShardConfig mine = shard;
        if (cuda) mine.device = Device::Cuda(rank);
        return body(rank, pg, mine);
      },
      options);
}

absl::StatusOr<ModelConfig> CheckForward(const ForwardRequest& request) {
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
  return config;
}

absl::StatusOr<ForwardResult> ForwardRank(const ForwardRequest& request, ProcessGroup& pg, const ShardConfig& shard) {
  NoGradScope no_grad;  // a forward pass: no tape, no gradients
  const Tensor& ids = request.ids;
  const int dp = std::max(1, request.shard.layout.data_parallel_size());
  const int64_t rows = ids.shape()[0] / dp;
  ASSIGN_OR_RETURN(std::unique_ptr<ShardedModel> model, ShardFormer(shard, &pg).Load(request.model_dir));
  ASSIGN_OR_RETURN(int replica, pg.dp_local_rank());
  ASSIGN_OR_RETURN(Tensor mine, ids.Narrow(0, replica * rows, rows));
  mine = mine.Contiguous();
  ASSIGN_OR_RETURN(ColoTensor logits, model->Forward(mine));
  ASSIGN_OR_RETURN(LmLoss loss, model->NextTokenLoss(logits, mine));
  ForwardResult result;
  ASSIGN_OR_RETURN(Tensor full, model->GatherLogits(logits));  // this replica's rows, every tp rank
  // Back on the rank's device for the dp gather: an NCCL group moves device memory only.
  ASSIGN_OR_RETURN(full, full.To(logits.local().device()));
  ASSIGN_OR_RETURN(Communicator * dp_comm, pg.Comm("dp"));
  ASSIGN_OR_RETURN(result.logits, AllGatherDim(full, 0, *dp_comm, pg.timeout()));  // replicas in order
  ASSIGN_OR_RETURN(result.logits, result.logits.To(Device::Cpu()));
  result.loss = loss.value;
  result.tokens = loss.tokens;
  return result;
}

absl::StatusOr<ForwardResult> RunForward(const ForwardRequest& request) {
  RETURN_IF_ERROR(CheckForward(request).status());
  ForwardResult result;
  absl::Mutex mu;
  RETURN_IF_ERROR(RunOnLocalRanks(request.shard, request.cuda, [&](int rank, ProcessGroup& pg, const ShardConfig& shard)
                                                                     -> absl::Status {
    ASSIGN_OR_RETURN(ForwardResult mine, ForwardRank(request, pg, shard));
    if (rank != 0) return absl::OkStatus();
    absl::MutexLock lock(&mu);
    result = std::move(mine);
    return absl::OkStatus();
  }, request.comm_timeout));
  return result;
}

}  // namespace colod::shardformer
