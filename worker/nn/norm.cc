#include "worker/nn/norm.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear1d.h"

namespace colod::nn {

absl::StatusOr<Norm1D> Norm1D::FromGlobal(const Tensor& gamma, const std::optional<Tensor>& beta, ProcessGroup* pg,
                                          Options options) {
  const bool layer_norm = options.kind == Kind::kLayerNorm;
  if (gamma.dim() != 1 || layer_norm != beta.has_value() || (beta.has_value() && beta->shape() != gamma.shape())) {
    return absl::InvalidArgumentError(absl::StrCat(layer_norm ? "LayerNorm needs gamma and beta" : "RMSNorm needs gamma only",
                                                   " of one shape [hidden]; got gamma ", ShapeToString(gamma.shape())));
  }
  ASSIGN_OR_RETURN(ColoTensor g, ColoTensor::FromGlobal(gamma, DistSpec(), pg, true));
  std::optional<ColoParameter> b;
  if (beta.has_value()) {
    ASSIGN_OR_RETURN(ColoTensor bt, ColoTensor::FromGlobal(*beta, DistSpec(), pg, true));
    b = ColoParameter(std::move(bt), "bias");
  }
  return Norm1D(ColoParameter(std::move(g), "weight"), std::move(b), pg, options);
}

absl::StatusOr<Norm1D> Norm1D::FromParameters(ColoParameter gamma, std::optional<ColoParameter> beta,
                                              ProcessGroup* pg, Options options) {
  const bool layer_norm = options.kind == Kind::kLayerNorm;
  if (gamma.global_shape().size() != 1 || layer_norm != beta.has_value() ||
      (beta.has_value() && beta->global_shape() != gamma.global_shape())) {
    return absl::InvalidArgumentError(absl::StrCat(layer_norm ? "LayerNorm needs gamma and beta" : "RMSNorm needs gamma only",
                                                   " of one shape [hidden]; got gamma ",
                                                   ShapeToString(gamma.global_shape())));
  }
  RETURN_IF_ERROR(CheckSpec(gamma, DistSpec(), "Norm1D gamma"));
  if (beta.has_value()) {
    RETURN_IF_ERROR(CheckSpec(*beta, DistSpec(), "Norm1D beta"));
  }
  return Norm1D(std::move(gamma), std::move(beta), pg, options);
}

absl::StatusOr<ColoTensor> Norm1D::Forward(const ColoTensor& x) const {
  ColoTensor in = x;
  Variable g = gamma_.variable();
  std::optional<Variable> b;
  if (beta_.has_value()) b = beta_->variable();
  if (options_.sequence_parallel) {
    ASSIGN_OR_RETURN(int p, pg_->AxisSize("tp"));
    const int64_t seq = static_cast<int64_t>(x.global_shape().size()) - 2;
    if (seq < 0) return absl::InvalidArgumentError("a sequence-parallel norm needs [.., seq, hidden] input");
    if (!(x.spec().Get("tp") == Placement::Shard({seq}, {p}))) {
      ASSIGN_OR_RETURN(in, x.Redistribute(WithTp(x.spec(), Placement::Shard({seq}, {p}))));
    }
    // Each rank normalizes different rows: the parameters' gradients sum over tp.
    ASSIGN_OR_RETURN(Communicator * comm, pg_->Comm("tp"));
    ASSIGN_OR_RETURN(g, ReduceGradient(g, comm, pg_->timeout()));
    if (b.has_value()) {
      ASSIGN_OR_RETURN(b, ReduceGradient(*b, comm, pg_->timeout()));
    }
  } else if (!(x.spec().Get("tp") == Placement::Replicate())) {
    ASSIGN_OR_RETURN(in, x.Redistribute(WithTp(x.spec(), Placement::Replicate())));
  }
  Variable y;
  if (options_.kind == Kind::kLayerNorm) {
    ASSIGN_OR_RETURN(y, LayerNorm(in.variable(), g, *b, options_.eps));
  } else {
    ASSIGN_OR_RETURN(y, RmsNorm(in.variable(), g, options_.eps));
  }
  return ColoTensor::FromLocal(y, in.spec(), pg_);
}

absl::StatusOr<Norm1D::WithSum> Norm1D::Forward(const ColoTensor& x, const ColoTensor& residual) const {
  if (x.global_shape() != residual.global_shape()) {
    return absl::InvalidArgumentError(absl::StrCat("a residual norm cannot add ", ShapeToString(x.global_shape()),
                                                   " and ", ShapeToString(residual.global_shape())));
  }
  RETURN_IF_ERROR(CheckSpec(residual, x.spec(), "the residual"));
  if (options_.sequence_parallel || !(x.spec().Get("tp") == Placement::Replicate())) {
    ASSIGN_OR_RETURN(Variable sum, Add(x.variable(), residual.variable()));
    ASSIGN_OR_RETURN(ColoTensor s, ColoTensor::FromLocal(sum, x.spec(), pg_));
    ASSIGN_OR_RETURN(ColoTensor y, Forward(s));
    return WithSum{std::move(s), std::move(y)};
  }
  std::optional<Variable> b;
  if (beta_.has_value()) b = beta_->variable();
  ASSIGN_OR_RETURN(ResidualNorm r, AddNorm(x.variable(), residual.variable(), gamma_.variable(),
                                           options_.kind == Kind::kLayerNorm ? b : std::nullopt, options_.eps));
  ASSIGN_OR_RETURN(ColoTensor s, ColoTensor::FromLocal(r.sum, x.spec(), pg_));
  ASSIGN_OR_RETURN(ColoTensor y, ColoTensor::FromLocal(r.y, x.spec(), pg_));
  return WithSum{std::move(s), std::move(y)};
}

}  // namespace colod::nn
