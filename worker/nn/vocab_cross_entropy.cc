#include "worker/nn/vocab_cross_entropy.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/colo/tensor_collectives.h"

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
  if (labels.numel() != rows || (labels.dtype() != DType::kI64 && labels.dtype() != DType::kI32)) {
    return absl::InvalidArgumentError(absl::StrCat("labels ", DTypeName(labels.dtype()), ShapeToString(labels.shape()),
                                                   " must be ", rows, " integers, one per row of the logits"));
  }
  const std::vector<int64_t> lab = labels.ToInt64s();
  for (int64_t r = 0; r < rows; ++r) {
    if (lab[r] != ignore_index && (lab[r] < 0 || lab[r] >= vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("label ", lab[r], " at row ", r,
                                                     " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  ASSIGN_OR_RETURN(Communicator * comm, pg->Comm("tp"));
  const int64_t start = k * local_v;
  const int64_t real = std::clamp<int64_t>(vocab_size - start, 0, local_v);  // real columns held here
  // Computed on a host copy of the shard; the collectives run where the
  // communicator wants them (worker/colo/tensor_collectives.h).
  const Device dev = logits.local().device();
  ASSIGN_OR_RETURN(Tensor z, logits.local().To(Device::Cpu()));
  ASSIGN_OR_RETURN(z, z.ToDType(DType::kF32));
  ASSIGN_OR_RETURN(z, z.Reshape({rows, local_v}));
  const float* pz = z.data<float>();

  std::vector<float> mx(rows, -std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < real; ++j) mx[r] = std::max(mx[r], pz[r * local_v + j]);
  }
  RETURN_IF_ERROR(AllReduceValues(mx, ReduceOp::kMax, *comm, dev, pg->timeout()));
  // [sum exp(z - max) | target logit | sum of logits], one all-reduce.
  std::vector<float> sums(3 * rows, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    double se = 0, sl = 0;
    for (int64_t j = 0; j < real; ++j) {
      se += std::exp(pz[r * local_v + j] - mx[r]);
      sl += pz[r * local_v + j];
    }
    sums[r] = static_cast<float>(se);
    sums[2 * rows + r] = static_cast<float>(sl);
    const int64_t t = lab[r] - start;
    if (lab[r] != ignore_index && t >= 0 && t < real) sums[rows + r] = pz[r * local_v + t];
  }
  RETURN_IF_ERROR(AllReduceValues(sums, ReduceOp::kSum, *comm, dev, pg->timeout()));

  ASSIGN_OR_RETURN(Tensor loss, Tensor::Zeros({rows}, DType::kF32));
  auto lse = std::make_shared<std::vector<float>>(rows);
  for (int64_t r = 0; r < rows; ++r) {
    (*lse)[r] = mx[r] + std::log(sums[r]);
    if (lab[r] == ignore_index) continue;
    loss.data<float>()[r] = (*lse)[r] - (1.0f - label_smoothing) * sums[rows + r] -
                            label_smoothing * sums[2 * rows + r] / static_cast<float>(vocab_size);
  }
  const Shape local_shape = logits.local().shape();
  const DType dtype = logits.local().dtype();
  ASSIGN_OR_RETURN(loss, loss.To(dev));
  return RecordOp("vocab_parallel_cross_entropy", {logits.variable()}, std::move(loss),
                  [z, lse, lab, start, real, rows, local_v, vocab_size, label_smoothing, ignore_index, local_shape,
                   dtype, dev](const Tensor& dloss) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
                    const std::vector<float> dl = dloss.ToFloats();
                    ASSIGN_OR_RETURN(Tensor dz, Tensor::Zeros({rows, local_v}, DType::kF32));
                    const float* pz = z.data<float>();
                    float* out = dz.data<float>();
                    const float smooth = label_smoothing / static_cast<float>(vocab_size);
                    for (int64_t r = 0; r < rows; ++r) {
                      if (lab[r] == ignore_index) continue;
                      for (int64_t j = 0; j < real; ++j) {
                        const float target = smooth + (start + j == lab[r] ? 1.0f - label_smoothing : 0.0f);
                        out[r * local_v + j] = dl[r] * (std::exp(pz[r * local_v + j] - (*lse)[r]) - target);
                      }
                    }
                    ASSIGN_OR_RETURN(dz, dz.Reshape(local_shape));
                    if (dtype != DType::kF32) {
                      ASSIGN_OR_RETURN(dz, dz.ToDType(dtype));
                    }
                    ASSIGN_OR_RETURN(dz, dz.To(dev));
                    return std::vector<std::optional<Tensor>>{dz};
                  });
}

}  // namespace colod::nn
