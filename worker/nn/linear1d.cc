#include "worker/nn/linear1d.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"

namespace colod::nn {
namespace {

constexpr ComputeSpec kCompute = {ComputePattern::kTP1D};

absl::Status CheckMatrix(const Tensor& w, const std::optional<Tensor>& b, int64_t bias_size, const char* layer) {
  if (w.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(layer, ": weight must be [out, in], got ", ShapeToString(w.shape())));
  }
  if (b.has_value() && b->shape() != Shape{bias_size}) {
    return absl::InvalidArgumentError(absl::StrCat(layer, ": bias must be [", bias_size, "], got ",
                                                   ShapeToString(b->shape())));
  }
  return absl::OkStatus();
}

std::optional<Variable> BiasVar(const std::optional<ColoParameter>& b) {
  if (!b.has_value()) return std::nullopt;
  return b->variable();
}

}  // namespace

DistSpec WithTp(const DistSpec& spec, Placement p) {
  DistSpec out = spec;
  out.Set("tp", std::move(p));
  return out;
}

absl::StatusOr<Tensor> Conv1DToLinear(const Tensor& conv1d_weight) {
  if (conv1d_weight.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("a Conv1D weight must be [in, out], got ",
                                                   ShapeToString(conv1d_weight.shape())));
  }
  ASSIGN_OR_RETURN(Tensor t, conv1d_weight.Transpose(0, 1));
  return t.TryContiguous();
}

absl::StatusOr<ParamSpecs> Linear1DCol::Specs(ProcessGroup* pg, const Options& options) {
  ASSIGN_OR_RETURN(int p, pg->AxisSize("tp"));
  // Unfused: [out, in] on dim 0. Fused: [n, out/n, in] on dim 1.
  const DistSpec spec = WithTp({}, Placement::Shard({options.fused == 1 ? 0 : 1}, {p}));
  return ParamSpecs{spec, spec};
}

absl::StatusOr<Linear1DCol> Linear1DCol::FromGlobal(const Tensor& weight, const std::optional<Tensor>& bias,
                                                    ProcessGroup* pg, Options options) {
  RETURN_IF_ERROR(CheckMatrix(weight, bias, weight.dim() == 2 ? weight.shape()[0] : 0, "Linear1D_Col"));
  const int64_t out = weight.shape()[0], in = weight.shape()[1], n = options.fused;
  if (n < 1 || out % n != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Linear1D_Col: ", out, " outputs cannot be split into fused = ", n, " projections"));
  }
  ASSIGN_OR_RETURN(ParamSpecs specs, Specs(pg, options));
  ASSIGN_OR_RETURN(Tensor w_full, n == 1 ? weight : weight.Reshape({n, out / n, in}));
  ASSIGN_OR_RETURN(ColoParameter w, ColoParameter::Create(w_full, specs.weight, pg, "weight", kCompute));
  std::optional<ColoParameter> b;
  if (bias.has_value()) {
    ASSIGN_OR_RETURN(Tensor b_full, n == 1 ? *bias : bias->Reshape({n, out / n}));
    ASSIGN_OR_RETURN(b, ColoParameter::Create(b_full, specs.bias, pg, "bias", kCompute));
  }
  return Linear1DCol(std::move(w), std::move(b), pg, options);
}

absl::StatusOr<Linear1DCol> Linear1DCol::FromParameters(ColoParameter weight, std::optional<ColoParameter> bias,
                                                        ProcessGroup* pg, Options options) {
  ASSIGN_OR_RETURN(ParamSpecs specs, Specs(pg, options));
  const size_t w_dims = options.fused == 1 ? 2 : 3;
  if (weight.global_shape().size() != w_dims ||
      (options.fused > 1 && weight.global_shape()[0] != options.fused)) {
    return absl::InvalidArgumentError(absl::StrCat("Linear1D_Col: weight must be ",
                                                   options.fused == 1 ? "[out, in]" : "[fused, out/fused, in]",
                                                   ", got ", ShapeToString(weight.global_shape())));
  }
  RETURN_IF_ERROR(CheckSpec(weight, specs.weight, "Linear1D_Col weight"));
  if (bias.has_value()) {
    const Shape want(weight.global_shape().begin(), weight.global_shape().end() - 1);
    if (bias->global_shape() != want) {
      return absl::InvalidArgumentError(absl::StrCat("Linear1D_Col: bias must be ", ShapeToString(want), ", got ",
                                                     ShapeToString(bias->global_shape())));
    }
    RETURN_IF_ERROR(CheckSpec(*bias, specs.bias, "Linear1D_Col bias"));
  }
  return Linear1DCol(std::move(weight), std::move(bias), pg, options);
}

absl::StatusOr<ColoTensor> Linear1DCol::Forward(const ColoTensor& x, Epilogue epilogue) const {
  ASSIGN_OR_RETURN(Communicator * comm, pg_->Comm("tp"));
  ASSIGN_OR_RETURN(int p, pg_->AxisSize("tp"));
  ColoTensor in = x;
  Variable xr;
  if (options_.sequence_parallel) {
    const int64_t seq = static_cast<int64_t>(x.global_shape().size()) - 2;
    if (seq < 0) return absl::InvalidArgumentError("Linear1D_Col with sequence_parallel needs [.., seq, hidden] input");
    if (!(x.spec().Get("tp") == Placement::Shard({seq}, {p}))) {
      ASSIGN_OR_RETURN(in, x.Redistribute(WithTp(x.spec(), Placement::Shard({seq}, {p}))));
    }
    xr = in.variable();  // the shard: the linear below gathers it (and again in its backward)
  } else {
    if (!(x.spec().Get("tp") == Placement::Replicate())) {
      ASSIGN_OR_RETURN(in, x.Redistribute(WithTp(x.spec(), Placement::Replicate())));
    }
    xr = in.variable();  // its gradient summed over tp by the linear below
  }
  const int64_t n = options_.fused;
  const Shape& wl = weight_.local().shape();
  Variable w = weight_.variable();
  std::optional<Variable> b = BiasVar(bias_);
  if (n > 1) {  // [n, o, in] -> [n*o, in], and the bias alike
    ASSIGN_OR_RETURN(w, Reshape(w, {wl[0] * wl[1], wl[2]}));
    if (b.has_value()) {
      ASSIGN_OR_RETURN(b, Reshape(*b, {wl[0] * wl[1]}));
    }
  }
  // Under sequence parallelism the linear gathers the shards and keeps only
  // them, and its backward reduce-scatters the input gradient (summing it
  // over tp); otherwise the linear sums it over tp.
  Variable y;
  if (options_.sequence_parallel) {
    const int64_t seq = static_cast<int64_t>(x.global_shape().size()) - 2;
    ASSIGN_OR_RETURN(y, GatheredLinear(xr, w, b, epilogue, seq, comm, pg_->timeout()));
  } else {
    ASSIGN_OR_RETURN(y, LinearSumInputGrad(xr, w, b, epilogue, comm, pg_->timeout()));
  }
  if (n > 1) {  // [..., n*o] -> [..., n, o]
    Shape local_shape = y.value().shape();
    local_shape.back() = wl[1];
    local_shape.insert(local_shape.end() - 1, n);
    ASSIGN_OR_RETURN(y, Reshape(y, local_shape));
  }
  const int64_t last = y.value().dim() - 1;
  ASSIGN_OR_RETURN(ColoTensor out, ColoTensor::FromLocal(y, WithTp(in.spec(), Placement::Shard({last}, {p})), pg_));
  if (!options_.gather_output) return out;
  ASSIGN_OR_RETURN(ColoTensor gathered, out.Redistribute(WithTp(out.spec(), Placement::Replicate())));
  if (n == 1) return gathered;
  Shape flat = gathered.global_shape();
  flat.pop_back();
  flat.back() *= gathered.global_shape().back();
  ASSIGN_OR_RETURN(Variable merged, Reshape(gathered.variable(), flat));
  return ColoTensor::FromLocal(merged, gathered.spec(), pg_);
}

absl::StatusOr<ParamSpecs> Linear1DRow::Specs(ProcessGroup* pg, const Options&) {
  ASSIGN_OR_RETURN(int p, pg->AxisSize("tp"));
  return ParamSpecs{WithTp({}, Placement::Shard({1}, {p})), DistSpec()};
}

absl::StatusOr<Linear1DRow> Linear1DRow::FromGlobal(const Tensor& weight, const std::optional<Tensor>& bias,
                                                    ProcessGroup* pg, Options options) {
  RETURN_IF_ERROR(CheckMatrix(weight, bias, weight.dim() == 2 ? weight.shape()[0] : 0, "Linear1D_Row"));
  ASSIGN_OR_RETURN(ParamSpecs specs, Specs(pg, options));
  ASSIGN_OR_RETURN(ColoParameter w, ColoParameter::Create(weight, specs.weight, pg, "weight", kCompute));
  std::optional<ColoParameter> b;
  if (bias.has_value()) {
    ASSIGN_OR_RETURN(b, ColoParameter::Create(*bias, specs.bias, pg, "bias", kCompute));
  }
  return Linear1DRow(std::move(w), std::move(b), pg, options);
}

absl::StatusOr<Linear1DRow> Linear1DRow::FromParameters(ColoParameter weight, std::optional<ColoParameter> bias,
                                                        ProcessGroup* pg, Options options) {
  ASSIGN_OR_RETURN(ParamSpecs specs, Specs(pg, options));
  if (weight.global_shape().size() != 2 ||
      (bias.has_value() && bias->global_shape() != Shape{weight.global_shape()[0]})) {
    return absl::InvalidArgumentError(absl::StrCat("Linear1D_Row: weight must be [out, in] and bias [out], got ",
                                                   ShapeToString(weight.global_shape()), " and ",
                                                   bias.has_value() ? ShapeToString(bias->global_shape()) : "none"));
  }
  RETURN_IF_ERROR(CheckSpec(weight, specs.weight, "Linear1D_Row weight"));
  if (bias.has_value()) {
    RETURN_IF_ERROR(CheckSpec(*bias, specs.bias, "Linear1D_Row bias"));
  }
  return Linear1DRow(std::move(weight), std::move(bias), pg, options);
}

absl::StatusOr<ColoTensor> Linear1DRow::Forward(const ColoTensor& x) const {
  ASSIGN_OR_RETURN(int p, pg_->AxisSize("tp"));
  const int64_t last = static_cast<int64_t>(x.global_shape().size()) - 1;
  const Placement sharded = Placement::Shard({last}, {p});
  ColoTensor in = x;
  if (!(x.spec().Get("tp") == sharded)) {
    if (options_.parallel_input) {
      return absl::InvalidArgumentError(absl::StrCat("Linear1D_Row with parallel_input expects its input sharded on "
                                                     "the last dim over tp, got ", x.spec().ToString()));
    }
    ASSIGN_OR_RETURN(in, x.Redistribute(WithTp(x.spec(), sharded)));
  }
  ASSIGN_OR_RETURN(Communicator * comm, pg_->Comm("tp"));
  if (comm->size() == 1 && bias_.has_value() && !options_.sequence_parallel) {
    // Nothing to sum: the bias in the GEMM's epilogue.
    ASSIGN_OR_RETURN(Variable y, Linear(in.variable(), weight_.variable(), bias_->variable()));
    return ColoTensor::FromLocal(y, WithTp(in.spec(), Placement::Replicate()), pg_);
  }
  if (!options_.sequence_parallel) {
    ASSIGN_OR_RETURN(Variable partial, Linear(in.variable(), weight_.variable(), std::nullopt));
    // The partial sums are the GEMM's own buffer: summed and biased in place
    // (the P -> R conversion would sum a copy, and a bias add make another).
    std::optional<Variable> b;
    if (bias_.has_value()) b = bias_->variable();
    ASSIGN_OR_RETURN(Variable y, SumPartialAddBias(partial, b, comm, pg_->timeout()));
    return ColoTensor::FromLocal(y, WithTp(in.spec(), Placement::Replicate()), pg_);
  }
  const int64_t seq = last - 1;
  if (seq < 0) return absl::InvalidArgumentError("Linear1D_Row with sequence_parallel needs [.., seq, hidden] input");
  // Summed and scattered in one node that keeps no partial product.
  ASSIGN_OR_RETURN(Variable y, ScatteredLinear(in.variable(), weight_.variable(), seq, comm, pg_->timeout()));
  ASSIGN_OR_RETURN(ColoTensor out, ColoTensor::FromLocal(y, WithTp(in.spec(), Placement::Shard({seq}, {p})), pg_));
  if (!bias_.has_value()) return out;
  // Each rank adds the bias to its own rows: their gradients sum over tp.
  ASSIGN_OR_RETURN(Variable bias, ReduceGradient(bias_->variable(), comm, pg_->timeout()));
  ASSIGN_OR_RETURN(Variable z, BiasAdd(out.variable(), bias));
  return ColoTensor::FromLocal(z, out.spec(), pg_);
}

}  // namespace colod::nn
