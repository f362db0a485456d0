#include "worker/nn/dropout.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"

namespace colod::nn {

absl::StatusOr<TensorParallelDropout> TensorParallelDropout::Create(float p, uint64_t seed, Input input) {
  if (!(p >= 0.0f && p < 1.0f)) return absl::InvalidArgumentError(absl::StrCat("dropout p = ", p, " is not in [0, 1)"));
  return TensorParallelDropout(p, seed, input);
}

absl::StatusOr<ColoTensor> TensorParallelDropout::Forward(const ColoTensor& x, bool train) {
  if (!train || p_ == 0.0f) return x;
  const uint64_t n = static_cast<uint64_t>(x.local().numel());
  ASSIGN_OR_RETURN(int tp, x.process_group()->AxisSize("tp"));
  ASSIGN_OR_RETURN(int k, x.process_group()->tp_local_rank());
  const uint64_t mine = input_ == Input::kParallel ? offset_ + static_cast<uint64_t>(k) * n : offset_;
  offset_ += input_ == Input::kParallel ? static_cast<uint64_t>(tp) * n : n;
  ASSIGN_OR_RETURN(Variable y, Dropout(x.variable(), p_, seed_, mine));
  return ColoTensor::FromLocal(y, x.spec(), x.process_group());
}

}  // namespace colod::nn
