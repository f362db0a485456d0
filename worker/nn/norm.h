// Norm layers for 1D tensor parallelism: LayerNorm and RMSNorm with
// replicated gamma (and beta). Without sequence parallelism their input is
// replicated over tp and nothing is communicated. With sequence_parallel the
// input is split along the sequence dim (ndim-2) over tp, each rank
// normalizes its rows, and the parameter gradients are all-reduced over tp.
//
// Thread-safety: a layer is used by one rank thread at a time.
#ifndef COLOD_WORKER_NN_NORM_H_
#define COLOD_WORKER_NN_NORM_H_

#include <optional>

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"

namespace colod::nn {

// LayerNorm (gamma and beta) or RMSNorm (gamma only), for Norm1D and Norm2D.
enum class NormKind { kLayerNorm, kRmsNorm };

class Norm1D {
 public:
  using Kind = NormKind;
  struct Options {
    Kind kind = Kind::kLayerNorm;
    float eps = 1e-5f;
    bool sequence_parallel = false;
  };
  // `beta` is required for LayerNorm and must be absent for RMSNorm.
  static absl::StatusOr<Norm1D> FromGlobal(const Tensor& gamma, const std::optional<Tensor>& beta, ProcessGroup* pg,
                                           Options options);
  // From replicated gamma (and beta) [hidden]; INVALID_ARGUMENT otherwise.
  static absl::StatusOr<Norm1D> FromParameters(ColoParameter gamma, std::optional<ColoParameter> beta,
                                               ProcessGroup* pg, Options options);
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) const;
  // The norm of a residual stream: sum = x + residual (specs equal;
  // INVALID_ARGUMENT otherwise) and Forward(sum). Replicated over tp (no
  // sequence parallelism), the add and the norm are one kernel (AddNorm).
  struct WithSum {
    ColoTensor sum, y;
  };
  absl::StatusOr<WithSum> Forward(const ColoTensor& x, const ColoTensor& residual) const;
  const ColoParameter& gamma() const { return gamma_; }
  const std::optional<ColoParameter>& beta() const { return beta_; }

 private:
  Norm1D(ColoParameter g, std::optional<ColoParameter> b, ProcessGroup* pg, Options o)
      : gamma_(std::move(g)), beta_(std::move(b)), pg_(pg), options_(o) {}
  ColoParameter gamma_;
  std::optional<ColoParameter> beta_;
  ProcessGroup* pg_;
  Options options_;
};

}  // namespace colod::nn

#endif  // COLOD_WORKER_NN_NORM_H_
