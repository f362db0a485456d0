#include "worker/nn/linear2d.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/nn/functional.h"
#include "worker/tensor/ops.h"

namespace colod::nn {
namespace {

using Grads = std::vector<std::optional<Tensor>>;


// 2.5D where the mesh has a depth axis.
ComputeSpec Compute2D(ProcessGroup* pg) {
  return {pg->mesh().AxisIndices("tp_dep").ok() ? ComputePattern::kTP2P5D : ComputePattern::kTP2D};
}

}  // namespace

absl::StatusOr<Groups2D> GetGroups2D(ProcessGroup* pg) {
  auto row = pg->Comm("tp_row");
  auto col = pg->Comm("tp_col");
  for (const auto* made : {&row, &col}) {
    if (made->ok()) continue;
    // An axis the mesh lacks; any other error (a rendezvous) is its own.
    if (!absl::IsNotFound(made->status())) return made->status();
    return absl::FailedPreconditionError(
        "2D and 2.5D tensor parallelism need a mesh with tp_col and tp_row axes (tensor_parallel_mode 2d or 2.5d)");
  }
  Groups2D c{*row, *col, nullptr, (*row)->size(), 1};
  if (pg->mesh().AxisIndices("tp_dep").ok()) {
    ASSIGN_OR_RETURN(c.dep, pg->Comm("tp_dep"));
    c.depth = c.dep->size();
  }
  return c;
}

absl::StatusOr<ColoTensor> ToActivation2D(const ColoTensor& x, const Groups2D& c) {
  const DistSpec want = Activation2D(static_cast<int64_t>(x.global_shape().size()), c.q, c.depth);
  bool same = true;
  for (const char* axis : {"tp_dep", "tp_col", "tp_row"}) same = same && x.spec().Get(axis) == want.Get(axis);
  if (same) return x;
  return x.Redistribute(want);
}

absl::StatusOr<Variable> SumGradOverReplicas(const Variable& p, const Groups2D& c, absl::Duration timeout) {
  ASSIGN_OR_RETURN(Variable v, ReduceGradient(p, c.col, timeout));
  if (c.dep != nullptr) {
    ASSIGN_OR_RETURN(v, ReduceGradient(v, c.dep, timeout));
  }
  return v;
}

DistSpec Activation2D(int64_t ndim, int q, int depth) {
  DistSpec s;
  if (depth > 1) s.Set("tp_dep", Placement::Shard({0}, {depth}));
  return s.Set("tp_col", Placement::Shard({0}, {q})).Set("tp_row", Placement::Shard({ndim - 1}, {q}));
}

absl::StatusOr<Variable> Summa(const Variable& x, const Variable& a, Communicator* row, Communicator* col,
                               absl::Duration timeout) {
  const int q = row->size();
  ASSIGN_OR_RETURN(Tensor xm, Rows(x.value()));
  ASSIGN_OR_RETURN(const Tensor am, a.value().TryContiguous());
  if (am.dim() != 2 || xm.shape()[1] != am.shape()[0]) {
    return absl::InvalidArgumentError(absl::StrCat("SUMMA: blocks ", ShapeToString(x.value().shape()), " and ",
                                                   ShapeToString(am.shape()), " do not multiply"));
  }
  const int64_t r = xm.shape()[0], n = am.shape()[1];
  ASSIGN_OR_RETURN(Tensor y, Tensor::Zeros({r, n}, DType::kF32, xm.device()));
  for (int t = 0; t < q; ++t) {
    ASSIGN_OR_RETURN(Tensor xt, BroadcastFrom(xm, t, *row, timeout));
    ASSIGN_OR_RETURN(Tensor at, BroadcastFrom(am, t, *col, timeout));
    ASSIGN_OR_RETURN(Tensor part, ops::MatMul(xt, at));
    ASSIGN_OR_RETURN(part, part.ToDType(DType::kF32));
    RETURN_IF_ERROR(AddInPlace(y, part));
  }
  Shape out_shape = x.value().shape();
  out_shape.back() = n;
  ASSIGN_OR_RETURN(y, y.Reshape(out_shape));
  ASSIGN_OR_RETURN(y, y.ToDType(x.value().dtype()));
  return RecordOp("summa", {x, a}, std::move(y),
                  [xm, am, row, col, q, timeout](const Tensor& dy_full) -> absl::StatusOr<Grads> {
                    ASSIGN_OR_RETURN(Tensor dy, Rows(dy_full));
                    std::vector<Tensor> dx_parts, da_parts;
                    for (int t = 0; t < q; ++t) {
                      // dX_it gets dY_ij A_tj^T from every j; dA_tj gets X_it^T dY_ij from every i.
                      ASSIGN_OR_RETURN(Tensor at, BroadcastFrom(am, t, *col, timeout));
                      ASSIGN_OR_RETURN(Tensor p, ops::MatMul(dy, at, false, true));
                      dx_parts.push_back(std::move(p));
                      ASSIGN_OR_RETURN(Tensor xt, BroadcastFrom(xm, t, *row, timeout));
                      ASSIGN_OR_RETURN(Tensor g, ops::MatMul(xt, dy, true));
                      da_parts.push_back(std::move(g));
                    }
                    ASSIGN_OR_RETURN(Tensor dx, ReduceScatterBlocks(dx_parts, *row, timeout));
                    ASSIGN_OR_RETURN(Tensor da, ReduceScatterBlocks(da_parts, *col, timeout));
                    Shape x_shape = dy_full.shape();
                    x_shape.back() = xm.shape()[1];
                    ASSIGN_OR_RETURN(dx, dx.Reshape(x_shape));
                    return Grads{dx, da};
                  });
}

absl::StatusOr<Linear2D> Linear2D::FromGlobal(const Tensor& weight, const std::optional<Tensor>& bias,
                                              ProcessGroup* pg) {
  ASSIGN_OR_RETURN(Groups2D c, GetGroups2D(pg));
  if (weight.dim() != 2 || (bias.has_value() && bias->shape() != Shape{weight.shape()[1]})) {
    return absl::InvalidArgumentError(absl::StrCat("Linear2D: weight must be [in, out] and bias [out], got ",
                                                   ShapeToString(weight.shape()), " and ",
                                                   bias.has_value() ? ShapeToString(bias->shape()) : "none"));
  }
  ASSIGN_OR_RETURN(ParamSpecs specs, Specs(pg));
  ASSIGN_OR_RETURN(ColoParameter w, ColoParameter::Create(weight, specs.weight, pg, "weight", Compute2D(pg)));
  std::optional<ColoParameter> b;
  if (bias.has_value()) {
    ASSIGN_OR_RETURN(b, ColoParameter::Create(*bias, specs.bias, pg, "bias", Compute2D(pg)));
  }
  return Linear2D(std::move(w), std::move(b), pg, c.q);
}

absl::StatusOr<ParamSpecs> Linear2D::Specs(ProcessGroup* pg) {
  ASSIGN_OR_RETURN(Groups2D c, GetGroups2D(pg));
  return ParamSpecs{DistSpec().Set("tp_col", Placement::Shard({0}, {c.q})).Set("tp_row", Placement::Shard({1}, {c.q})),
                    DistSpec().Set("tp_row", Placement::Shard({0}, {c.q}))};
}

absl::StatusOr<Linear2D> Linear2D::FromParameters(ColoParameter weight, std::optional<ColoParameter> bias,
                                                  ProcessGroup* pg) {
  ASSIGN_OR_RETURN(Groups2D c, GetGroups2D(pg));
  ASSIGN_OR_RETURN(ParamSpecs specs, Specs(pg));
  if (weight.global_shape().size() != 2 ||
      (bias.has_value() && bias->global_shape() != Shape{weight.global_shape()[1]})) {
    return absl::InvalidArgumentError(absl::StrCat("Linear2D: weight must be [in, out] and bias [out], got ",
                                                   ShapeToString(weight.global_shape()), " and ",
                                                   bias.has_value() ? ShapeToString(bias->global_shape()) : "none"));
  }
  RETURN_IF_ERROR(CheckSpec(weight, specs.weight, "Linear2D weight"));
  weight.set_compute_spec(Compute2D(pg));
  if (bias.has_value()) {
    RETURN_IF_ERROR(CheckSpec(*bias, specs.bias, "Linear2D bias"));
    bias->set_compute_spec(Compute2D(pg));
  }
  return Linear2D(std::move(weight), std::move(bias), pg, c.q);
}

absl::StatusOr<ColoTensor> Linear2D::Forward(const ColoTensor& x, Epilogue epilogue) const {
  ASSIGN_OR_RETURN(Groups2D c, GetGroups2D(pg_));
  ASSIGN_OR_RETURN(ColoTensor in, ToActivation2D(x, c));
  // 2.5D: the weight is replicated over depth, so its gradient sums the layers'.
  Variable w = weight_.variable();
  if (c.dep != nullptr) {
    ASSIGN_OR_RETURN(w, ReduceGradient(w, c.dep, pg_->timeout()));
  }
  ASSIGN_OR_RETURN(Variable y, Summa(in.variable(), w, c.row, c.col, pg_->timeout()));
  std::optional<Variable> b;
  if (bias_.has_value()) {
    // The bias is replicated over tp_col (and depth): each row block adds a gradient term.
    ASSIGN_OR_RETURN(b, SumGradOverReplicas(bias_->variable(), c, pg_->timeout()));
  }
  ASSIGN_OR_RETURN(y, BiasEpilogue(y, b, epilogue));
  return ColoTensor::FromLocal(y, Activation2D(y.value().dim(), q_, c.depth), pg_);
}

namespace {

absl::Status CheckNormShapes(const Shape& gamma, const std::optional<Shape>& beta, Norm2D::Kind kind) {
  const bool layer_norm = kind == Norm2D::Kind::kLayerNorm;
  if (gamma.size() != 1 || layer_norm != beta.has_value() || (beta.has_value() && *beta != gamma)) {
    return absl::InvalidArgumentError(absl::StrCat(
        layer_norm ? "LayerNorm2D needs gamma and beta" : "RMSNorm2D needs gamma only", " of one shape [hidden]; got gamma ",
        ShapeToString(gamma), beta.has_value() ? absl::StrCat(" and beta ", ShapeToString(*beta)) : ""));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Norm2D> Norm2D::FromGlobal(const Tensor& gamma, const std::optional<Tensor>& beta, ProcessGroup* pg,
                                          Options options) {
  std::optional<Shape> beta_shape;
  if (beta.has_value()) beta_shape = beta->shape();
  RETURN_IF_ERROR(CheckNormShapes(gamma.shape(), beta_shape, options.kind));
  ASSIGN_OR_RETURN(const DistSpec spec, Spec(pg));
  ASSIGN_OR_RETURN(ColoParameter g, ColoParameter::Create(gamma, spec, pg, "gamma", Compute2D(pg)));
  std::optional<ColoParameter> b;
  if (beta.has_value()) {
    ASSIGN_OR_RETURN(b, ColoParameter::Create(*beta, spec, pg, "beta", Compute2D(pg)));
  }
  return Norm2D(std::move(g), std::move(b), pg, options);
}

absl::StatusOr<DistSpec> Norm2D::Spec(ProcessGroup* pg) {
  ASSIGN_OR_RETURN(Groups2D c, GetGroups2D(pg));
  return DistSpec().Set("tp_row", Placement::Shard({0}, {c.q}));
}

absl::StatusOr<Norm2D> Norm2D::FromParameters(ColoParameter gamma, std::optional<ColoParameter> beta,
                                              ProcessGroup* pg, Options options) {
  std::optional<Shape> beta_shape;
  if (beta.has_value()) beta_shape = beta->global_shape();
  RETURN_IF_ERROR(CheckNormShapes(gamma.global_shape(), beta_shape, options.kind));
  ASSIGN_OR_RETURN(const DistSpec spec, Spec(pg));
  RETURN_IF_ERROR(CheckSpec(gamma, spec, "Norm2D gamma"));
  gamma.set_compute_spec(Compute2D(pg));
  if (beta.has_value()) {
    RETURN_IF_ERROR(CheckSpec(*beta, spec, "Norm2D beta"));
    beta->set_compute_spec(Compute2D(pg));
  }
  return Norm2D(std::move(gamma), std::move(beta), pg, options);
}

absl::StatusOr<ColoTensor> Norm2D::Forward(const ColoTensor& x) const {
  ASSIGN_OR_RETURN(Groups2D c, GetGroups2D(pg_));
  ASSIGN_OR_RETURN(ColoTensor in, ToActivation2D(x, c));
  // Hidden split along the row group; gamma and beta replicated over tp_col (and depth).
  std::vector<Communicator*> replicas = {c.col};
  if (c.dep != nullptr) replicas.push_back(c.dep);
  Variable y;
  if (options_.kind == Kind::kLayerNorm) {
    ASSIGN_OR_RETURN(y, ShardedLayerNorm(in.variable(), gamma_.variable(), beta_->variable(), options_.eps, c.row,
                                         replicas, pg_->timeout()));
  } else {
    ASSIGN_OR_RETURN(y, ShardedRmsNorm(in.variable(), gamma_.variable(), options_.eps, c.row, replicas,
                                       pg_->timeout()));
  }
  return ColoTensor::FromLocal(y, in.spec(), pg_);
}

}  // namespace colod::nn
