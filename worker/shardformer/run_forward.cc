#include "worker/shardformer/run_forward.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "common/text.h"
#include "spec/job_validation.h"
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

namespace {

// An image classifier's input and labels.
absl::Status CheckImages(const ForwardRequest& request, const ModelConfig& config) {
  const Tensor& pixels = request.input;
  if (pixels.dim() != 4 || !IsFloat(pixels.dtype()) || pixels.shape()[1] != config.num_channels ||
      pixels.shape()[2] != config.image_size || pixels.shape()[3] != config.image_size) {
    return absl::InvalidArgumentError(absl::StrCat("the input must be float pixel values [batch, ", config.num_channels,
                                                   ", ", config.image_size, ", ", config.image_size, "], got ",
                                                   DTypeName(pixels.dtype()), " ", ShapeToString(pixels.shape())));
  }
  if (!request.labels.has_value()) return absl::OkStatus();
  const Tensor& labels = *request.labels;
  if (labels.dim() != 1 || labels.shape()[0] != pixels.shape()[0] || !IsInteger(labels.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("the labels must be integers [", pixels.shape()[0], "], got ",
                                                   DTypeName(labels.dtype()), " ", ShapeToString(labels.shape())));
  }
  ASSIGN_OR_RETURN(const std::vector<int64_t> v, labels.ReadInt64s());
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] != -100 && (v[i] < 0 || v[i] >= config.vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("label ", v[i], " of image ", i, " is outside the model's ",
                                                     config.vocab_size, " labels"));
    }
  }
  return absl::OkStatus();
}

// A masked language model's labels (BERT's): integers [batch, seq], each
// the token its position predicts, or -100 where it predicts none.
absl::Status CheckMaskedLabels(const ForwardRequest& request, const ModelConfig& config) {
  if (!request.labels.has_value()) return absl::OkStatus();
  const Tensor& labels = *request.labels;
  if (labels.shape() != request.input.shape() || !IsInteger(labels.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("the labels must be integers shaped as the ids, ",
                                                   ShapeToString(request.input.shape()), ", got ",
                                                   DTypeName(labels.dtype()), " ", ShapeToString(labels.shape())));
  }
  ASSIGN_OR_RETURN(const std::vector<int64_t> v, labels.ReadInt64s());
  bool any = false;
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] != -100 && (v[i] < 0 || v[i] >= config.vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("label ", v[i], " at position ", i % labels.shape()[1], " of row ",
                                                     i / labels.shape()[1],
                                                     " is neither -100 nor an id of the model's ", config.vocab_size));
    }
    any |= v[i] != -100;
  }
  if (!any) return absl::InvalidArgumentError("every label is -100: no position predicts a token");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> CheckForward(const ForwardRequest& request) {
  const Tensor& ids = request.input;
  if (request.shard.layout.pipeline_parallel_size() > 1) {
    return absl::InvalidArgumentError("pipeline_parallel_size applies to training (a forward runs unpipelined)");
  }
  ASSIGN_OR_RETURN(ModelConfig config, LoadConfig(request.model_dir));
  if (config.takes_images()) {
    RETURN_IF_ERROR(CheckImages(request, config));
  } else {
    if (ids.dim() != 2 || !IsInteger(ids.dtype())) {
      return absl::InvalidArgumentError(absl::StrCat("the input must be integer token ids [batch, seq], got ",
                                                     DTypeName(ids.dtype()), " ", ShapeToString(ids.shape())));
    }
    if (config.masked_lm()) {
      RETURN_IF_ERROR(CheckMaskedLabels(request, config));
    } else {
      if (ids.shape()[1] < 2) {
        return absl::InvalidArgumentError("sequences need at least 2 tokens for a next-token loss");
      }
      if (request.labels.has_value()) {
        return absl::InvalidArgumentError(
            absl::StrCat("labels are for image classifiers and masked language models: a ", config.model_type,
                         " predicts its next tokens"));
      }
    }
    if (config.is_encoder_decoder()) {
      if (!request.decoder_input.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat("a ", config.model_type,
                                                       " encoder-decoder needs decoder input ids [batch, seq] too"));
      }
      const Tensor& dec = *request.decoder_input;
      if (dec.dim() != 2 || !IsInteger(dec.dtype()) || dec.shape()[0] != ids.shape()[0] || dec.shape()[1] < 2) {
        return absl::InvalidArgumentError(absl::StrCat("the decoder input must be integer ids [", ids.shape()[0],
                                                       ", seq >= 2], got ", DTypeName(dec.dtype()), " ",
                                                       ShapeToString(dec.shape())));
      }
    } else if (request.decoder_input.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("a ", config.model_type, " has no decoder input"));
    }
  }
  const int64_t batch = ids.shape()[0];
  RETURN_IF_ERROR(DeviceMesh::FromShardConfig(request.shard.layout).status());
  const int dp = std::max(1, request.shard.layout.data_parallel_size());
  if (batch % dp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the batch of ", batch, " inputs does not split over data_parallel_size ", dp));
  }
  RETURN_IF_ERROR(CheckShardable(config, request.shard.layout));
  return config;
}

Shape ForwardLogitsShape(const ForwardRequest& request, const ModelConfig& config) {
  Shape shape = {request.input.shape()[0]};
  if (!config.takes_images()) {
    shape.push_back(request.decoder_input.has_value() ? request.decoder_input->shape()[1] : request.input.shape()[1]);
  }
  shape.push_back(config.vocab_size);
  return shape;
}

absl::StatusOr<ForwardResult> ForwardRank(const ForwardRequest& request, ProcessGroup& pg, const ShardConfig& shard) {
  NoGradScope no_grad;  // a forward pass: no tape, no gradients
  const Tensor& input = request.input;
  const int dp = std::max(1, request.shard.layout.data_parallel_size());
  const int64_t rows = input.shape()[0] / dp;
  ASSIGN_OR_RETURN(std::unique_ptr<ShardedModel> model, ShardFormer(shard, &pg).Load(request.model_dir));
  ASSIGN_OR_RETURN(int replica, pg.dp_local_rank());
  ASSIGN_OR_RETURN(Tensor mine, input.Narrow(0, replica * rows, rows));
  ASSIGN_OR_RETURN(mine, mine.TryContiguous());
  const bool images = model->config().takes_images();
  std::optional<Tensor> decoder;
  if (request.decoder_input.has_value()) {
    ASSIGN_OR_RETURN(Tensor dec, request.decoder_input->Narrow(0, replica * rows, rows));
    ASSIGN_OR_RETURN(decoder, dec.TryContiguous());
  }
  ASSIGN_OR_RETURN(ColoTensor logits, decoder.has_value() ? model->Forward(mine, *decoder) : model->Forward(mine));
  LmLoss loss;
  if (decoder.has_value()) {
    ASSIGN_OR_RETURN(loss, model->NextTokenLoss(logits, *decoder));
  } else if (model->config().masked_lm()) {  // a loss only against the labels of its masked positions
    if (request.labels.has_value()) {
      ASSIGN_OR_RETURN(Tensor labels, request.labels->Narrow(0, replica * rows, rows));
      ASSIGN_OR_RETURN(const Tensor dense, labels.TryContiguous());
      ASSIGN_OR_RETURN(loss, model->TokenLoss(logits, dense));
    }
  } else if (!images) {
    ASSIGN_OR_RETURN(loss, model->NextTokenLoss(logits, mine));
  } else if (request.labels.has_value()) {
    ASSIGN_OR_RETURN(Tensor labels, request.labels->Narrow(0, replica * rows, rows));
    ASSIGN_OR_RETURN(const Tensor dense, labels.TryContiguous());
    ASSIGN_OR_RETURN(loss, model->ClassificationLoss(logits, dense));
  }
  ForwardResult result;
  result.logits_shape = ForwardLogitsShape(request, model->config());
  result.unread_tensors = model->unread_tensors();
  if (request.gather_logits) {
    ASSIGN_OR_RETURN(Tensor full, model->GatherLogits(logits));  // this replica's rows, every tp rank
    // Back on the rank's device for the dp gather: an NCCL group moves device memory only.
    ASSIGN_OR_RETURN(full, full.To(logits.local().device()));
    ASSIGN_OR_RETURN(Communicator * dp_comm, pg.Comm("dp"));
    ASSIGN_OR_RETURN(result.logits, AllGatherDim(full, 0, *dp_comm, pg.timeout()));  // replicas in order
    ASSIGN_OR_RETURN(result.logits, result.logits.To(Device::Cpu()));
    // An image classifier's [batch, 1, labels]: one prediction an image.
    ASSIGN_OR_RETURN(result.logits, result.logits.Reshape(result.logits_shape));
  }
  // Every result was read on the host above; on NCCL a collective of the
  // pass that the watchdog aborted (a peer late past the timeout) left the
  // stream to run past it, so that what was read is not the model's.
  RETURN_IF_ERROR(pg.AsyncError());
  result.loss = loss.value;
  result.tokens = loss.tokens;
  return result;
}

void SetUnreadTensors(const std::vector<std::string>& names, v1::ForwardResult& result) {
  result.clear_unread_tensors();
  for (size_t i = 0; i < names.size() && i < kMaxUnreadTensorsReported; ++i) result.add_unread_tensors(names[i]);
  result.set_unread_tensor_count(static_cast<int64_t>(names.size()));
  BoundUnreadTensors(result);
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
