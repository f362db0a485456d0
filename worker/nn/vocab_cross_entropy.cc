#include "worker/nn/vocab_cross_entropy.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/tensor/ops.h"

namespace colod::nn {

absl::StatusOr<Variable> VocabParallelCrossEntropy(const ColoTensor& logits, const Tensor& labels, int64_t vocab_size,
                                                   float label_smoothing, int64_t ignore_index) {
  ProcessGroup* pg = logits.process_group();
  ASSIGN_OR_RETURN(int p, pg->AxisSize("tp"));
  ASSIGN_OR_RETURN(int k, pg->tp_local_rank());
  const Shape& global = logits.global_shape();
  const int64_t last = static_cast<int64_t>(global.size()) - 1;
  if (last < 0 || !(logits.spec().Get("tp") == Placement::Shard({last}, {p}))) {
    return absl::InvalidArgumentError(absl::StrCat("vocab-parallel cross-entropy needs logits sharded on the last dim "
                                                   "over tp, got ", logits.spec().ToString()));
  }
  const int64_t padded = global[last], local_v = padded / p, rows = NumElements(global) / std::max<int64_t>(padded, 1);
  if (vocab_size < 1 || vocab_size > padded) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size ", vocab_size, " must be in [1, ", padded, "], the logits' last dim"));
  }
  if (labels.numel() != rows || !IsInteger(labels.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("labels ", DTypeName(labels.dtype()), ShapeToString(labels.shape()),
                                                   " must be ", rows, " integers, one per row of the logits"));
  }
  const std::vector<int64_t> lab = labels.ToInt64s();  // free for host labels
  for (int64_t r = 0; r < rows; ++r) {
    if (lab[r] != ignore_index && (lab[r] < 0 || lab[r] >= vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("label ", lab[r], " at row ", r,
                                                     " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  ASSIGN_OR_RETURN(Communicator * comm, pg->Comm("tp"));
  const int64_t start = k * local_v;
  const int64_t real = std::clamp<int64_t>(vocab_size - start, 0, local_v);  // real columns held here
  const Device dev = logits.local().device();
  ASSIGN_OR_RETURN(Tensor lab64, labels.ToDType(DType::kI64));
  ASSIGN_OR_RETURN(lab64, lab64.Reshape({rows}));
  ASSIGN_OR_RETURN(lab64, lab64.To(dev));
  ASSIGN_OR_RETURN(Tensor z, logits.local().Contiguous().Reshape({rows, local_v}));
  const absl::Duration timeout = pg->timeout();
  auto all_gather = [comm, timeout](const Tensor& in, Tensor& out) -> absl::Status {
    return comm->AllGather(in.raw_data(), out.raw_data(), in.numel(), in.dtype())->WaitOnDevice(timeout);
  };
  ASSIGN_OR_RETURN(auto forward, ops::VocabShardCrossEntropy(z, lab64, real, start, vocab_size, label_smoothing,
                                                        ignore_index, p, all_gather));
  Tensor loss = forward.loss;
  auto saved = std::make_shared<ops::VocabShardForward>(std::move(forward));
  const Shape local_shape = logits.local().shape();
  const DType dtype = logits.local().dtype();
  return RecordOp("vocab_parallel_cross_entropy", {logits.variable()}, std::move(loss),
                  [saved, lab64, start, real, vocab_size, label_smoothing, ignore_index, local_shape,
                   dtype](const Tensor& dloss) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
                    ASSIGN_OR_RETURN(Tensor dz, ops::VocabShardCrossEntropyBackward(dloss, *saved, lab64, real, start,
                                                                               vocab_size, label_smoothing,
                                                                               ignore_index, dtype));
                    ASSIGN_OR_RETURN(dz, dz.Reshape(local_shape));
                    return std::vector<std::optional<Tensor>>{dz};
                  });
}

}  // namespace colod::nn
