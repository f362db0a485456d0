#include "worker/nn/functional.h"

#include "common/status_macros.h"

namespace colod::nn {
namespace {

using Grads = std::vector<std::optional<Tensor>>;

// t as a matrix [rows, last dim].
absl::StatusOr<Tensor> Rows(const Tensor& t) {
  const int64_t last = t.shape().back();
  return t.Reshape({last == 0 ? 0 : t.numel() / last, last});
}

}  // namespace

absl::StatusOr<Variable> Linear(const Variable& x, const Variable& w, const std::optional<Variable>& b) {
  ASSIGN_OR_RETURN(Tensor y, kernels::MatMul(x.value(), w.value(), false, /*trans_b=*/true));
  if (b.has_value()) {
    ASSIGN_OR_RETURN(y, kernels::BiasAdd(y, b->value()));
  }
  std::vector<Variable> inputs = {x, w};
  if (b.has_value()) inputs.push_back(*b);
  const Tensor xv = x.value(), wv = w.value();
  const bool has_bias = b.has_value();
  return RecordOp("linear", inputs, std::move(y), [xv, wv, has_bias](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor dx, kernels::MatMul(dy, wv));
    ASSIGN_OR_RETURN(Tensor dy2, Rows(dy));
    ASSIGN_OR_RETURN(Tensor x2, Rows(xv));
    ASSIGN_OR_RETURN(Tensor dw, kernels::MatMul(dy2, x2, /*trans_a=*/true));
    Grads g = {dx, dw};
    if (has_bias) {
      ASSIGN_OR_RETURN(Tensor db, kernels::BiasGrad(dy));
      g.push_back(db);
    }
    return g;
  });
}

absl::StatusOr<Variable> BiasAdd(const Variable& x, const Variable& b) {
  ASSIGN_OR_RETURN(Tensor y, kernels::BiasAdd(x.value(), b.value()));
  return RecordOp("bias_add", {x, b}, std::move(y), [](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor db, kernels::BiasGrad(dy));
    return Grads{dy, db};
  });
}

absl::StatusOr<Variable> Gelu(const Variable& x, kernels::GeluApprox approx) {
  ASSIGN_OR_RETURN(Tensor y, kernels::Gelu(x.value(), approx));
  const Tensor xv = x.value();
  return RecordOp("gelu", {x}, std::move(y), [xv, approx](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor dx, kernels::GeluBackward(dy, xv, approx));
    return Grads{dx};
  });
}

absl::StatusOr<Variable> LayerNorm(const Variable& x, const Variable& gamma, const Variable& beta, float eps) {
  ASSIGN_OR_RETURN(kernels::LayerNormResult r, kernels::LayerNorm(x.value(), gamma.value(), beta.value(), eps));
  const Tensor xv = x.value(), gv = gamma.value(), mean = r.mean, rstd = r.rstd;
  return RecordOp("layer_norm", {x, gamma, beta}, std::move(r.y),
                  [xv, gv, mean, rstd](const Tensor& dy) -> absl::StatusOr<Grads> {
                    ASSIGN_OR_RETURN(kernels::LayerNormGrads g, kernels::LayerNormBackward(dy, xv, gv, mean, rstd));
                    return Grads{g.dx, g.dgamma, g.dbeta};
                  });
}

absl::StatusOr<Variable> RmsNorm(const Variable& x, const Variable& gamma, float eps) {
  ASSIGN_OR_RETURN(kernels::RmsNormResult r, kernels::RmsNorm(x.value(), gamma.value(), eps));
  const Tensor xv = x.value(), gv = gamma.value(), rstd = r.rstd;
  return RecordOp("rms_norm", {x, gamma}, std::move(r.y), [xv, gv, rstd](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(kernels::RmsNormGrads g, kernels::RmsNormBackward(dy, xv, gv, rstd));
    return Grads{g.dx, g.dgamma};
  });
}

absl::StatusOr<Variable> Dropout(const Variable& x, float p, uint64_t seed, uint64_t offset) {
  ASSIGN_OR_RETURN(Tensor y, kernels::Dropout(x.value(), p, seed, offset));
  return RecordOp("dropout", {x}, std::move(y), [p, seed, offset](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor dx, kernels::DropoutBackward(dy, p, seed, offset));
    return Grads{dx};
  });
}

absl::StatusOr<Variable> Embedding(const Variable& table, const Tensor& ids, int64_t row_offset,
                                   bool mask_out_of_range) {
  ASSIGN_OR_RETURN(Tensor y, kernels::Embedding(table.value(), ids, row_offset, mask_out_of_range));
  const int64_t rows = table.value().shape()[0];
  return RecordOp("embedding", {table}, std::move(y), [ids, rows, row_offset](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor dt, kernels::EmbeddingBackward(dy, ids, rows, row_offset));
    return Grads{dt};
  });
}

absl::StatusOr<Variable> ReduceGradient(const Variable& x, Communicator* comm, absl::Duration timeout) {
  return RecordOp("reduce_gradient", {x}, x.value(), [comm, timeout](const Tensor& dy) -> absl::StatusOr<Grads> {
    if (comm->size() == 1) return Grads{dy};
    Tensor g = dy.Clone();
    RETURN_IF_ERROR(comm->AllReduce(g.raw_data(), g.numel(), g.dtype(), ReduceOp::kSum)->Wait(timeout));
    return Grads{g};
  });
}

}  // namespace colod::nn
