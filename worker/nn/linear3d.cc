#include "worker/nn/linear3d.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/nn/functional.h"
#include "worker/tensor/ops.h"

namespace colod::nn {
namespace {

using Grads = std::vector<std::optional<Tensor>>;
constexpr char kR[] = "tp_output";
constexpr ComputeSpec kCompute = {ComputePattern::kTP3D};

struct Roles {
  Communicator *r, *k, *c;
  int q;
};

absl::StatusOr<Roles> GetRoles(ProcessGroup* pg, const std::string& k, const std::string& c) {
  auto r = pg->Comm(kR);
  auto kk = pg->Comm(k);
  auto cc = pg->Comm(c);
  for (const auto* made : {&r, &kk, &cc}) {
    if (made->ok()) continue;
    // An axis the mesh lacks; any other error (a rendezvous) is its own.
    if (!absl::IsNotFound(made->status())) return made->status();
    return absl::FailedPreconditionError(
        "3D tensor parallelism needs a mesh with tp_output, tp_input and tp_weight axes (tensor_parallel_mode 3d)");
  }
  return Roles{*r, *kk, *cc, (*r)->size()};
}

// The 3D product on this rank's blocks: x [.., rows/q^2, in/q] and
// at = A^T's block [out/q^2, in/q] -> y [.., rows/q^2, out/q], on the tape.
absl::StatusOr<Variable> Matmul3D(const Variable& x, const Variable& at, const Roles& g, absl::Duration timeout) {
  ASSIGN_OR_RETURN(Tensor xm, Rows(x.value()));
  ASSIGN_OR_RETURN(const Tensor am, at.value().TryContiguous());
  ASSIGN_OR_RETURN(Tensor xg, AllGatherDim(xm, 0, *g.k, timeout));  // X_RC
  ASSIGN_OR_RETURN(Tensor ag, AllGatherDim(am, 0, *g.r, timeout));  // A_CK^T [out/q, in/q]
  ASSIGN_OR_RETURN(Tensor partial, ops::MatMul(xg, ag, false, /*trans_b=*/true));
  ASSIGN_OR_RETURN(Tensor y, ReduceScatterDim(partial, 0, *g.c, timeout));
  Shape out_shape = x.value().shape();
  out_shape.back() = y.shape()[1];
  ASSIGN_OR_RETURN(y, y.Reshape(out_shape));
  const Shape x_shape = x.value().shape();
  return RecordOp("matmul_3d", {x, at}, std::move(y),
                  [xg, ag, g, timeout, x_shape](const Tensor& dy_full) -> absl::StatusOr<Grads> {
                    ASSIGN_OR_RETURN(Tensor dy, Rows(dy_full));
                    ASSIGN_OR_RETURN(Tensor dyg, AllGatherDim(dy, 0, *g.c, timeout));  // dY_RK
                    ASSIGN_OR_RETURN(Tensor dxg, ops::MatMul(dyg, ag));
                    ASSIGN_OR_RETURN(Tensor dx, ReduceScatterDim(dxg, 0, *g.k, timeout));
                    ASSIGN_OR_RETURN(Tensor dag, ops::MatMul(dyg, xg, /*trans_a=*/true));  // dA^T
                    ASSIGN_OR_RETURN(Tensor da, ReduceScatterDim(dag, 0, *g.r, timeout));
                    ASSIGN_OR_RETURN(dx, dx.Reshape(x_shape));
                    return Grads{dx, da};
                  });
}

std::string KAxis(const Linear3D::Options& o) { return o.swap ? "tp_weight" : "tp_input"; }
std::string CAxis(const Linear3D::Options& o) { return o.swap ? "tp_input" : "tp_weight"; }

}  // namespace

DistSpec Activation3D(int64_t ndim, int q, const std::string& k_axis, const std::string& c_axis) {
  return DistSpec()
      .Set(kR, Placement::Shard({0}, {q}))
      .Set(k_axis, Placement::Shard({0}, {q}))
      .Set(c_axis, Placement::Shard({ndim - 1}, {q}));
}

absl::StatusOr<ColoTensor> ToSpec3D(const ColoTensor& x, const DistSpec& want) {
  bool same = true;
  for (const char* axis : {"tp_output", "tp_input", "tp_weight"}) same = same && x.spec().Get(axis) == want.Get(axis);
  if (same) return x;
  return x.Redistribute(want);
}

absl::StatusOr<int> Get3DSize(ProcessGroup* pg) {
  ASSIGN_OR_RETURN(Roles g, GetRoles(pg, kStreamK, kStreamC));
  return g.q;
}

absl::StatusOr<DistSpec> StreamSpec3D(int64_t ndim, ProcessGroup* pg) {
  ASSIGN_OR_RETURN(int q, Get3DSize(pg));
  return Activation3D(ndim, q, kStreamK, kStreamC);
}

absl::StatusOr<ParamSpecs> Linear3D::Specs(ProcessGroup* pg, Options options) {
  ASSIGN_OR_RETURN(int q, Get3DSize(pg));
  return ParamSpecs{DistSpec()
                        .Set(KAxis(options), Placement::Shard({0}, {q}))
                        .Set(kR, Placement::Shard({1}, {q}))
                        .Set(CAxis(options), Placement::Shard({2}, {q})),
                    DistSpec().Set(KAxis(options), Placement::Shard({0}, {q}))};
}

absl::StatusOr<Linear3D> Linear3D::FromGlobal(const Tensor& weight, const std::optional<Tensor>& bias,
                                              ProcessGroup* pg, Options options) {
  ASSIGN_OR_RETURN(int q, Get3DSize(pg));
  if (weight.dim() != 2 || weight.shape()[1] % q != 0 || (bias.has_value() && bias->shape() != Shape{weight.shape()[1]})) {
    return absl::InvalidArgumentError(absl::StrCat("Linear3D: weight must be [in, out] with out divisible by q = ", q,
                                                   " and bias [out], got ", ShapeToString(weight.shape())));
  }
  const int64_t in = weight.shape()[0], out = weight.shape()[1];
  ASSIGN_OR_RETURN(ParamSpecs specs, Specs(pg, options));
  ASSIGN_OR_RETURN(Tensor at, weight.Transpose(0, 1));
  ASSIGN_OR_RETURN(Tensor view, at.Reshape({q, out / q, in}));  // a copy if strided
  ASSIGN_OR_RETURN(ColoParameter w, ColoParameter::Create(view, specs.weight, pg, "weight", kCompute));
  std::optional<ColoParameter> b;
  if (bias.has_value()) {
    ASSIGN_OR_RETURN(Tensor bview, bias->Reshape({q, out / q}));
    ASSIGN_OR_RETURN(b, ColoParameter::Create(bview, specs.bias, pg, "bias", kCompute));
  }
  return FromParameters(std::move(w), std::move(b), pg, options);
}

absl::StatusOr<Linear3D> Linear3D::FromParameters(ColoParameter weight, std::optional<ColoParameter> bias,
                                                  ProcessGroup* pg, Options options) {
  ASSIGN_OR_RETURN(int q, Get3DSize(pg));
  ASSIGN_OR_RETURN(ParamSpecs specs, Specs(pg, options));
  const Shape& ws = weight.global_shape();
  if (ws.size() != 3 || ws[0] != q || (bias.has_value() && bias->global_shape() != Shape{q, ws[1]})) {
    return absl::InvalidArgumentError(absl::StrCat("Linear3D: weight must be [q, out/q, in] and bias [q, out/q] (q = ",
                                                   q, "), got ", ShapeToString(ws), " and ",
                                                   bias.has_value() ? ShapeToString(bias->global_shape()) : "none"));
  }
  RETURN_IF_ERROR(CheckSpec(weight, specs.weight, "Linear3D weight"));
  weight.set_compute_spec(kCompute);
  if (bias.has_value()) {
    RETURN_IF_ERROR(CheckSpec(*bias, specs.bias, "Linear3D bias"));
    bias->set_compute_spec(kCompute);
  }
  return Linear3D(std::move(weight), std::move(bias), pg, q, KAxis(options), CAxis(options));
}

absl::StatusOr<ColoTensor> Linear3D::Forward(const ColoTensor& x, Epilogue epilogue) const {
  ASSIGN_OR_RETURN(Roles g, GetRoles(pg_, k_, c_));
  const int64_t ndim = static_cast<int64_t>(x.global_shape().size());
  ASSIGN_OR_RETURN(ColoTensor in, ToSpec3D(x, InputSpec(ndim)));
  const Shape& wl = weight_.local().shape();  // [1, out/q^2, in/q]
  ASSIGN_OR_RETURN(Variable at, Reshape(weight_.variable(), {wl[1], wl[2]}));
  ASSIGN_OR_RETURN(Variable y, Matmul3D(in.variable(), at, g, pg_->timeout()));
  std::optional<Variable> b;
  if (bias_.has_value()) {
    ASSIGN_OR_RETURN(b, Reshape(bias_->variable(), {bias_->local().numel()}));
    ASSIGN_OR_RETURN(b, ReduceGradient(*b, g.r, pg_->timeout()));  // replicated over R and C
    ASSIGN_OR_RETURN(b, ReduceGradient(*b, g.c, pg_->timeout()));
  }
  ASSIGN_OR_RETURN(y, BiasEpilogue(y, b, epilogue));
  return ColoTensor::FromLocal(y, OutputSpec(ndim), pg_);
}

absl::StatusOr<DistSpec> Norm3D::Spec(ProcessGroup* pg, const Options& options) {
  ASSIGN_OR_RETURN(Roles g, GetRoles(pg, options.k_axis, options.c_axis));
  return DistSpec().Set(options.c_axis, Placement::Shard({0}, {g.q}));
}

absl::StatusOr<Norm3D> Norm3D::FromGlobal(const Tensor& gamma, const std::optional<Tensor>& beta, ProcessGroup* pg,
                                          Options options) {
  ASSIGN_OR_RETURN(DistSpec spec, Spec(pg, options));
  if (gamma.dim() != 1 || (beta.has_value() && beta->shape() != gamma.shape())) {
    return absl::InvalidArgumentError(absl::StrCat("Norm3D: gamma ", ShapeToString(gamma.shape()),
                                                   beta.has_value() ? " and beta " + ShapeToString(beta->shape()) : "",
                                                   " must be the same [hidden]"));
  }
  ASSIGN_OR_RETURN(ColoParameter gp, ColoParameter::Create(gamma, spec, pg, "gamma", kCompute));
  std::optional<ColoParameter> bp;
  if (beta.has_value()) {
    ASSIGN_OR_RETURN(bp, ColoParameter::Create(*beta, spec, pg, "beta", kCompute));
  }
  return FromParameters(std::move(gp), std::move(bp), pg, std::move(options));
}

absl::StatusOr<Norm3D> Norm3D::FromParameters(ColoParameter gamma, std::optional<ColoParameter> beta,
                                              ProcessGroup* pg, Options options) {
  ASSIGN_OR_RETURN(Roles g, GetRoles(pg, options.k_axis, options.c_axis));
  ASSIGN_OR_RETURN(DistSpec spec, Spec(pg, options));
  const bool layer_norm = options.kind == Kind::kLayerNorm;
  if (layer_norm != beta.has_value()) {
    return absl::InvalidArgumentError(layer_norm ? "LayerNorm3D needs a beta" : "RMSNorm3D has no beta");
  }
  if (gamma.global_shape().size() != 1 || (beta.has_value() && beta->global_shape() != gamma.global_shape())) {
    return absl::InvalidArgumentError(absl::StrCat("Norm3D: gamma and beta must be the same [hidden], got ",
                                                   ShapeToString(gamma.global_shape())));
  }
  RETURN_IF_ERROR(CheckSpec(gamma, spec, "Norm3D gamma"));
  gamma.set_compute_spec(kCompute);
  if (beta.has_value()) {
    RETURN_IF_ERROR(CheckSpec(*beta, spec, "Norm3D beta"));
    beta->set_compute_spec(kCompute);
  }
  return Norm3D(std::move(gamma), std::move(beta), pg, g.q, std::move(options));
}

absl::StatusOr<ColoTensor> Norm3D::Forward(const ColoTensor& x) const {
  ASSIGN_OR_RETURN(Roles g, GetRoles(pg_, options_.k_axis, options_.c_axis));
  ASSIGN_OR_RETURN(ColoTensor in, ToSpec3D(x, Activation3D(static_cast<int64_t>(x.global_shape().size()), q_,
                                                       options_.k_axis, options_.c_axis)));
  Variable y;
  if (beta_.has_value()) {
    ASSIGN_OR_RETURN(y, ShardedLayerNorm(in.variable(), gamma_.variable(), beta_->variable(), options_.eps, g.c,
                                         {g.r, g.k}, pg_->timeout()));
  } else {
    ASSIGN_OR_RETURN(y, ShardedRmsNorm(in.variable(), gamma_.variable(), options_.eps, g.c, {g.r, g.k},
                                       pg_->timeout()));
  }
  return ColoTensor::FromLocal(y, in.spec(), pg_);
}

}  // namespace colod::nn
