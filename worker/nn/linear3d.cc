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
  if (!r.ok() || !kk.ok() || !cc.ok()) {
    return absl::FailedPreconditionError(
        "3D tensor parallelism needs a mesh with tp_output, tp_input and tp_weight axes (tensor_parallel_mode 3d)");
  }
  return Roles{*r, *kk, *cc, (*r)->size()};
}

absl::StatusOr<ColoTensor> Into(const ColoTensor& x, const DistSpec& want) {
  bool same = true;
  for (const char* axis : {"tp_output", "tp_input", "tp_weight"}) same = same && x.spec().Get(axis) == want.Get(axis);
  if (same) return x;
  return x.Redistribute(want);
}

// The 3D product on this rank's blocks: x [.., rows/q^2, in/q] and
// a [in/q, out/q^2] -> y [.., rows/q^2, out/q], on the tape.
absl::StatusOr<Variable> Matmul3D(const Variable& x, const Variable& a, const Roles& g, absl::Duration timeout) {
  ASSIGN_OR_RETURN(Tensor xm, Rows(x.value()));
  const Tensor am = a.value().Contiguous();
  ASSIGN_OR_RETURN(Tensor xg, AllGatherDim(xm, 0, *g.k, timeout));  // X_RC
  ASSIGN_OR_RETURN(Tensor ag, AllGatherDim(am, 1, *g.r, timeout));  // A_CK
  ASSIGN_OR_RETURN(Tensor partial, ops::MatMul(xg, ag));
  ASSIGN_OR_RETURN(Tensor y, ReduceScatterDim(partial, 0, *g.c, timeout));
  Shape out_shape = x.value().shape();
  out_shape.back() = y.shape()[1];
  ASSIGN_OR_RETURN(y, y.Reshape(out_shape));
  const Shape x_shape = x.value().shape();
  return RecordOp("matmul_3d", {x, a}, std::move(y),
                  [xg, ag, g, timeout, x_shape](const Tensor& dy_full) -> absl::StatusOr<Grads> {
                    ASSIGN_OR_RETURN(Tensor dy, Rows(dy_full));
                    ASSIGN_OR_RETURN(Tensor dyg, AllGatherDim(dy, 0, *g.c, timeout));  // dY_RK
                    ASSIGN_OR_RETURN(Tensor dxg, ops::MatMul(dyg, ag, false, true));
                    ASSIGN_OR_RETURN(Tensor dx, ReduceScatterDim(dxg, 0, *g.k, timeout));
                    ASSIGN_OR_RETURN(Tensor dag, ops::MatMul(xg, dyg, true));
                    ASSIGN_OR_RETURN(Tensor da, ReduceScatterDim(dag, 1, *g.r, timeout));
                    ASSIGN_OR_RETURN(dx, dx.Reshape(x_shape));
                    return Grads{dx, da};
                  });
}

}  // namespace

DistSpec Activation3D(int64_t ndim, int q, const std::string& k_axis, const std::string& c_axis) {
  return DistSpec()
      .Set(kR, Placement::Shard({0}, {q}))
      .Set(k_axis, Placement::Shard({0}, {q}))
      .Set(c_axis, Placement::Shard({ndim - 1}, {q}));
}

absl::StatusOr<Linear3D> Linear3D::FromGlobal(const Tensor& weight, const std::optional<Tensor>& bias,
                                              ProcessGroup* pg, Options options) {
  const std::string k = options.swap ? "tp_weight" : "tp_input", c = options.swap ? "tp_input" : "tp_weight";
  ASSIGN_OR_RETURN(Roles g, GetRoles(pg, k, c));
  const int q = g.q;
  if (weight.dim() != 2 || weight.shape()[1] % q != 0 || (bias.has_value() && bias->shape() != Shape{weight.shape()[1]})) {
    return absl::InvalidArgumentError(absl::StrCat("Linear3D: weight must be [in, out] with out divisible by q = ", q,
                                                   " and bias [out], got ", ShapeToString(weight.shape())));
  }
  const int64_t in = weight.shape()[0], out = weight.shape()[1];
  ASSIGN_OR_RETURN(Tensor view, weight.Reshape({in, q, out / q}));
  ASSIGN_OR_RETURN(ColoParameter w, ColoParameter::Create(view,
                                                          DistSpec()
                                                              .Set(c, Placement::Shard({0}, {q}))
                                                              .Set(k, Placement::Shard({1}, {q}))
                                                              .Set(kR, Placement::Shard({2}, {q})),
                                                          pg, "weight", kCompute));
  std::optional<ColoParameter> b;
  if (bias.has_value()) {
    ASSIGN_OR_RETURN(Tensor bview, bias->Reshape({q, out / q}));
    ASSIGN_OR_RETURN(b,
                     ColoParameter::Create(bview, DistSpec().Set(k, Placement::Shard({0}, {q})), pg, "bias", kCompute));
  }
  return Linear3D(std::move(w), std::move(b), pg, q, k, c);
}

absl::StatusOr<ColoTensor> Linear3D::Forward(const ColoTensor& x, Epilogue epilogue) const {
  ASSIGN_OR_RETURN(Roles g, GetRoles(pg_, k_, c_));
  const int64_t ndim = static_cast<int64_t>(x.global_shape().size());
  ASSIGN_OR_RETURN(ColoTensor in, Into(x, InputSpec(ndim)));
  const Shape& wl = weight_.local().shape();  // [in/q, 1, out/q^2]
  ASSIGN_OR_RETURN(Variable a, Reshape(weight_.variable(), {wl[0], wl[2]}));
  ASSIGN_OR_RETURN(Variable y, Matmul3D(in.variable(), a, g, pg_->timeout()));
  std::optional<Variable> b;
  if (bias_.has_value()) {
    ASSIGN_OR_RETURN(b, Reshape(bias_->variable(), {bias_->local().numel()}));
    ASSIGN_OR_RETURN(b, ReduceGradient(*b, g.r, pg_->timeout()));  // replicated over R and C
    ASSIGN_OR_RETURN(b, ReduceGradient(*b, g.c, pg_->timeout()));
  }
  ASSIGN_OR_RETURN(y, BiasEpilogue(y, b, epilogue));
  return ColoTensor::FromLocal(y, OutputSpec(ndim), pg_);
}

absl::StatusOr<LayerNorm3D> LayerNorm3D::FromGlobal(const Tensor& gamma, const Tensor& beta, float eps,
                                                    ProcessGroup* pg, const std::string& k_axis,
                                                    const std::string& c_axis) {
  ASSIGN_OR_RETURN(Roles g, GetRoles(pg, k_axis, c_axis));
  if (gamma.dim() != 1 || gamma.shape() != beta.shape()) {
    return absl::InvalidArgumentError(absl::StrCat("LayerNorm3D: gamma ", ShapeToString(gamma.shape()), " and beta ",
                                                   ShapeToString(beta.shape()), " must be the same [hidden]"));
  }
  const DistSpec spec = DistSpec().Set(c_axis, Placement::Shard({0}, {g.q}));
  ASSIGN_OR_RETURN(ColoParameter gp, ColoParameter::Create(gamma, spec, pg, "gamma", kCompute));
  ASSIGN_OR_RETURN(ColoParameter bp, ColoParameter::Create(beta, spec, pg, "beta", kCompute));
  return LayerNorm3D(std::move(gp), std::move(bp), eps, pg, g.q, k_axis, c_axis);
}

absl::StatusOr<ColoTensor> LayerNorm3D::Forward(const ColoTensor& x) const {
  ASSIGN_OR_RETURN(Roles g, GetRoles(pg_, k_, c_));
  ASSIGN_OR_RETURN(ColoTensor in, Into(x, Activation3D(static_cast<int64_t>(x.global_shape().size()), q_, k_, c_)));
  ASSIGN_OR_RETURN(Variable y, ShardedLayerNorm(in.variable(), gamma_.variable(), beta_.variable(), eps_, g.c,
                                                {g.r, g.k}, pg_->timeout()));
  return ColoTensor::FromLocal(y, in.spec(), pg_);
}

}  // namespace colod::nn
