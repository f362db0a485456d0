#include "worker/nn/functional.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/types.h"
#include "worker/colo/tensor_collectives.h"

namespace colod::nn {
namespace {

using Grads = std::vector<std::optional<Tensor>>;

}  // namespace

absl::StatusOr<Tensor> Rows(const Tensor& t) {
  const int64_t last = t.shape().back();
  return t.Reshape({last == 0 ? 0 : t.numel() / last, last});
}

Epilogue GeluEpilogue(ops::GeluApprox approx) {
  return approx == ops::GeluApprox::kTanh ? Epilogue::kGeluTanh : Epilogue::kGelu;
}

namespace {

// A linear node's gradients from dy, its input xv and weight wv: dx (summed
// over `sum_dx` where set; where `gelu_pre` is set, taken on through the
// GELU before the node, whose input that is, in the GEMM: no sum then), dw
// and, with a bias, db.
absl::StatusOr<Grads> LinearBackward(const Tensor& dy, const Tensor& xv, const Tensor& wv, bool has_bias,
                                     Communicator* sum_dx, absl::Duration timeout,
                                     const Tensor* gelu_pre = nullptr) {
  if (gelu_pre != nullptr && sum_dx != nullptr) return absl::InternalError("linear: a GELU taken before a sum");
  ASSIGN_OR_RETURN(Tensor dx, gelu_pre != nullptr ? ops::MatMulGeluBackward(dy, wv, *gelu_pre) : ops::MatMul(dy, wv));
  // dx is this node's own buffer: summed in place, no copy, behind the
  // weight-gradient GEMM.
  std::shared_ptr<Work> sum;
  if (sum_dx != nullptr && dx.numel() > 0) {
    if (!dx.is_contiguous()) return absl::InternalError("linear: dx is not contiguous");
    sum = sum_dx->AllReduce(dx.raw_data(), dx.numel(), dx.dtype(), ReduceOp::kSum);
  }
  auto weight_grads = [&]() -> absl::StatusOr<Grads> {
    if (has_bias) {  // one GEMM, the bias's sums in its epilogue
      ASSIGN_OR_RETURN(ops::LinearGrads lg, ops::LinearWeightGrads(dy, xv));
      return Grads{std::nullopt, std::move(lg.dw), std::move(lg.db)};
    }
    ASSIGN_OR_RETURN(Tensor dy2, Rows(dy));
    ASSIGN_OR_RETURN(Tensor x2, Rows(xv));
    ASSIGN_OR_RETURN(Tensor dw, ops::MatMul(dy2, x2, /*trans_a=*/true));
    return Grads{std::nullopt, dw};
  };
  absl::StatusOr<Grads> g = weight_grads();
  // Waited for on every path: the all-reduce writes dx.
  const absl::Status summed = sum == nullptr ? absl::OkStatus() : sum->WaitOnDevice(timeout);
  if (!g.ok()) return g.status();
  RETURN_IF_ERROR(summed);
  (*g)[0] = dx;
  return g;
}

// Linear, and with `sum_dx` (LinearSumInputGrad) its input's gradient summed
// over that group while the weight's gradient is computed.
absl::StatusOr<Variable> LinearNode(const Variable& x, const Variable& w, const std::optional<Variable>& b,
                                    Epilogue epilogue, Communicator* sum_dx, absl::Duration timeout) {
  if (sum_dx != nullptr && sum_dx->size() == 1) sum_dx = nullptr;
  const Tensor xv = x.value(), wv = w.value();
  if (epilogue == Epilogue::kGeluTanh && b.has_value() && xv.dtype() == wv.dtype() && xv.dim() >= 2 &&
      ops::FusesGemmEpilogues(xv.device())) {
    // The bias and GELU in the GEMM's epilogue: one node, which keeps GELU's
    // input (x W^T + b) for its backward.
    // Its consumer (the down projection) may take GELU's backward into its
    // own input gradient's GEMM: the offer's backward starts at GELU's
    // input.
    ASSIGN_OR_RETURN(ops::BiasGeluProduct yp, ops::MatMulBiasGelu(xv, wv, b->value(), /*trans_b=*/true));
    const Tensor pre = yp.pre;
    auto from_pre = [xv, wv, sum_dx, timeout](const Tensor& dz) -> absl::StatusOr<Grads> {
      return LinearBackward(dz, xv, wv, /*has_bias=*/true, sum_dx, timeout);
    };
    return RecordOfferingOp(sum_dx == nullptr ? "linear_bias_gelu" : "linear_bias_gelu_sum_input_grad", {x, w, *b},
                            std::move(yp.y),
                            [pre, from_pre](const Tensor& dy) -> absl::StatusOr<Grads> {
                              ASSIGN_OR_RETURN(Tensor dz, ops::GeluBackward(dy, pre, ops::GeluApprox::kTanh));
                              return from_pre(dz);
                            },
                            GeluGradOffer{pre, from_pre});
  }
  if (epilogue != Epilogue::kNone) {
    ASSIGN_OR_RETURN(Variable z, LinearNode(x, w, std::nullopt, Epilogue::kNone, sum_dx, timeout));
    return BiasEpilogue(z, b, epilogue);
  }
  // The bias in the GEMM's epilogue (ops::MatMulBias).
  ASSIGN_OR_RETURN(Tensor y, b.has_value() ? ops::MatMulBias(xv, wv, b->value(), false, /*trans_b=*/true)
                                           : ops::MatMul(xv, wv, false, /*trans_b=*/true));
  std::vector<Variable> inputs = {x, w};
  if (b.has_value()) inputs.push_back(*b);
  const bool has_bias = b.has_value();
  // An offer of the GELU before it (an MLP's down projection after the up
  // projection's GELU) is taken into dx's GEMM where dx is not summed and
  // the dtypes agree.
  return RecordOfferTakingOp(
      sum_dx == nullptr ? "linear" : "linear_sum_input_grad", inputs, std::move(y),
      [xv, wv, has_bias, sum_dx, timeout](const Tensor& dy, const GeluGradOffer* offer) -> absl::StatusOr<OfferedGrads> {
        const bool take = offer != nullptr && sum_dx == nullptr && offer->pre.shape() == xv.shape() &&
                          offer->pre.dtype() == dy.dtype() && wv.dtype() == dy.dtype();
        ASSIGN_OR_RETURN(Grads g, LinearBackward(dy, xv, wv, has_bias, sum_dx, timeout, take ? &offer->pre : nullptr));
        return OfferedGrads{std::move(g), take};
      });
}

}  // namespace

absl::StatusOr<Variable> Linear(const Variable& x, const Variable& w, const std::optional<Variable>& b,
                                Epilogue epilogue) {
  return LinearNode(x, w, b, epilogue, nullptr, absl::ZeroDuration());
}

absl::StatusOr<Variable> LinearSumInputGrad(const Variable& x, const Variable& w, const std::optional<Variable>& b,
                                            Epilogue epilogue, Communicator* comm, absl::Duration timeout) {
  return LinearNode(x, w, b, epilogue, comm, timeout);
}

absl::StatusOr<Variable> ScatteredLinear(const Variable& x, const Variable& w, int64_t dim, Communicator* comm,
                                         absl::Duration timeout) {
  ASSIGN_OR_RETURN(const int64_t d, x.value().NormalizeDim(dim));
  Tensor y;
  {
    ASSIGN_OR_RETURN(Tensor partial, ops::MatMul(x.value(), w.value(), false, /*trans_b=*/true));  // freed here
    if (partial.shape()[d] % comm->size() != 0) {
      return absl::InvalidArgumentError(absl::StrCat("dim ", d, " of size ", partial.shape()[d],
                                                     " is not divisible by ", comm->size()));
    }
    ASSIGN_OR_RETURN(y, ReduceScatterDim(partial, d, *comm, timeout));
  }
  const Tensor xv = x.value(), wv = w.value();
  return RecordOp("scattered_linear", {x, w}, std::move(y),
                  [xv, wv, d, comm, timeout](const Tensor& dy) -> absl::StatusOr<Grads> {
                    ASSIGN_OR_RETURN(Tensor full, AllGatherDim(dy, d, *comm, timeout));
                    ASSIGN_OR_RETURN(Tensor dx, ops::MatMul(full, wv));
                    ASSIGN_OR_RETURN(Tensor dy2, Rows(full));
                    ASSIGN_OR_RETURN(Tensor x2, Rows(xv));
                    ASSIGN_OR_RETURN(Tensor dw, ops::MatMul(dy2, x2, /*trans_a=*/true));
                    return Grads{dx, dw};
                  });
}

absl::StatusOr<Variable> GatheredLinear(const Variable& x, const Variable& w, const std::optional<Variable>& b,
                                        Epilogue epilogue, int64_t dim, Communicator* comm, absl::Duration timeout) {
  if (epilogue != Epilogue::kNone) {
    ASSIGN_OR_RETURN(Variable z, GatheredLinear(x, w, std::nullopt, Epilogue::kNone, dim, comm, timeout));
    return BiasEpilogue(z, b, epilogue);
  }
  ASSIGN_OR_RETURN(const int64_t d, x.value().NormalizeDim(dim));
  ASSIGN_OR_RETURN(const Tensor shard, x.value().TryContiguous());  // what the node keeps
  Tensor y;
  {
    ASSIGN_OR_RETURN(Tensor gathered, AllGatherDim(shard, d, *comm, timeout));  // freed after the GEMM
    ASSIGN_OR_RETURN(y, b.has_value() ? ops::MatMulBias(gathered, w.value(), b->value(), false, /*trans_b=*/true)
                                      : ops::MatMul(gathered, w.value(), false, /*trans_b=*/true));
  }
  std::vector<Variable> inputs = {x, w};
  if (b.has_value()) inputs.push_back(*b);
  const Tensor wv = w.value();
  const bool has_bias = b.has_value();
  return RecordOp(
      "gathered_linear", inputs, std::move(y),
      [shard, wv, has_bias, d, comm, timeout](const Tensor& dy) -> absl::StatusOr<Grads> {
        // The shards again, gathered behind dx's GEMM.
        const int p = comm->size();
        ASSIGN_OR_RETURN(Tensor pieces, Tensor::Empty({p, shard.numel()}, shard.dtype(), shard.device()));
        std::shared_ptr<Work> gather =
            comm->AllGather(shard.raw_data(), pieces.raw_data(), shard.numel(), shard.dtype());
        absl::StatusOr<Tensor> dx_full = ops::MatMul(dy, wv);
        // Waited for on every path: the all-gather writes pieces.
        RETURN_IF_ERROR(gather->WaitOnDevice(timeout));
        if (!dx_full.ok()) return dx_full.status();
        std::vector<Tensor> parts;
        for (int j = 0; j < p; ++j) {
          ASSIGN_OR_RETURN(Tensor part, pieces.Narrow(0, j, 1));
          ASSIGN_OR_RETURN(part, part.Reshape(shard.shape()));
          parts.push_back(std::move(part));
        }
        ASSIGN_OR_RETURN(Tensor gathered, Tensor::Cat(parts, d));
        Grads g = {std::nullopt};
        if (has_bias) {  // one GEMM, the bias's sums in its epilogue
          ASSIGN_OR_RETURN(ops::LinearGrads lg, ops::LinearWeightGrads(dy, gathered));
          g.push_back(std::move(lg.dw));
          g.push_back(std::move(lg.db));
        } else {
          ASSIGN_OR_RETURN(Tensor dy2, Rows(dy));
          ASSIGN_OR_RETURN(Tensor x2, Rows(gathered));
          ASSIGN_OR_RETURN(Tensor dw, ops::MatMul(dy2, x2, /*trans_a=*/true));
          g.push_back(std::move(dw));
        }
        ASSIGN_OR_RETURN(g[0], ReduceScatterDim(*dx_full, d, *comm, timeout));
        return g;
      });
}

absl::StatusOr<Variable> Reshape(const Variable& x, const Shape& shape) {
  ASSIGN_OR_RETURN(Tensor y, x.value().Reshape(shape));
  const Shape original = x.value().shape();
  return RecordOp("reshape", {x}, std::move(y), [original](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor dx, dy.Reshape(original));
    return Grads{dx};
  });
}

absl::StatusOr<Variable> Narrow(const Variable& x, int64_t dim, int64_t start, int64_t length) {
  const Tensor xv = x.value();
  if (dim < 0) dim += xv.dim();
  ASSIGN_OR_RETURN(Tensor view, xv.Narrow(dim, start, length));
  const Shape shape = xv.shape();
  const DType dtype = xv.dtype();
  const Device device = xv.device();
  ASSIGN_OR_RETURN(Tensor dense, view.TryContiguous());
  return RecordOp("narrow", {x}, std::move(dense),
                  [shape, dtype, device, dim, start, length](const Tensor& dy) -> absl::StatusOr<Grads> {
                    ASSIGN_OR_RETURN(Tensor dx, Tensor::Zeros(shape, dtype, device));
                    ASSIGN_OR_RETURN(Tensor place, dx.Narrow(dim, start, length));
                    RETURN_IF_ERROR(place.CopyFrom(dy));
                    return Grads{dx};
                  });
}

absl::StatusOr<Variable> Select(const Variable& x, int64_t dim, int64_t index) {
  const Tensor xv = x.value();
  ASSIGN_OR_RETURN(dim, xv.NormalizeDim(dim));
  ASSIGN_OR_RETURN(Tensor view, xv.Select(dim, index));
  const Shape shape = xv.shape();
  const DType dtype = xv.dtype();
  const Device device = xv.device();
  return RecordOp("select", {x}, std::move(view),
                  [shape, dtype, device, dim, index](const Tensor& dy) -> absl::StatusOr<Grads> {
                    ASSIGN_OR_RETURN(Tensor dx, Tensor::Zeros(shape, dtype, device));
                    ASSIGN_OR_RETURN(Tensor place, dx.Select(dim, index));
                    RETURN_IF_ERROR(place.CopyFrom(dy));
                    return Grads{dx};
                  });
}

absl::StatusOr<Variable> Cat(const std::vector<Variable>& parts, int64_t dim) {
  if (parts.empty()) return absl::InvalidArgumentError("Cat of no tensors");
  std::vector<Tensor> values;
  std::vector<int64_t> sizes;
  if (dim < 0) dim += parts[0].value().dim();
  for (const Variable& p : parts) {
    values.push_back(p.value());
    sizes.push_back(p.value().dim() > dim ? p.value().shape()[dim] : 0);
  }
  ASSIGN_OR_RETURN(Tensor y, Tensor::Cat(values, dim));
  return RecordOp("cat", parts, std::move(y), [sizes, dim](const Tensor& dy) -> absl::StatusOr<Grads> {
    Grads g;
    int64_t start = 0;
    for (int64_t s : sizes) {
      ASSIGN_OR_RETURN(Tensor piece, dy.Narrow(dim, start, s));
      ASSIGN_OR_RETURN(Tensor dense, piece.TryContiguous());
      g.push_back(std::move(dense));
      start += s;
    }
    return g;
  });
}

absl::StatusOr<Variable> Activation(const Variable& x, ops::ActivationKind kind) {
  ASSIGN_OR_RETURN(Tensor y, ops::Activation(x.value(), kind));
  const Tensor xv = x.value();
  return RecordOp(kind == ops::ActivationKind::kRelu ? "relu" : "silu", {x}, std::move(y),
                  [xv, kind](const Tensor& dy) -> absl::StatusOr<Grads> {
                    ASSIGN_OR_RETURN(Tensor dx, ops::ActivationBackward(dy, xv, kind));
                    return Grads{dx};
                  });
}

absl::StatusOr<Variable> Silu(const Variable& x) { return Activation(x, ops::ActivationKind::kSilu); }
absl::StatusOr<Variable> Relu(const Variable& x) { return Activation(x, ops::ActivationKind::kRelu); }

absl::StatusOr<Variable> Rope(const Variable& x, float theta, int64_t position_offset) {
  ASSIGN_OR_RETURN(Tensor y, ops::Rope(x.value(), theta, position_offset));
  return RecordOp("rope", {x}, std::move(y), [theta, position_offset](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor dx, ops::RopeBackward(dy, theta, position_offset));
    return Grads{dx};
  });
}

absl::StatusOr<Variable> BiasAdd(const Variable& x, const Variable& b) {
  ASSIGN_OR_RETURN(Tensor y, ops::BiasAdd(x.value(), b.value()));
  return RecordOp("bias_add", {x, b}, std::move(y), [](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor db, ops::BiasGrad(dy));
    return Grads{dy, db};
  });
}

absl::StatusOr<Variable> BiasEpilogue(const Variable& x, const std::optional<Variable>& b, Epilogue epilogue) {
  if (epilogue == Epilogue::kNone) return b.has_value() ? BiasAdd(x, *b) : x;
  const ops::GeluApprox approx = epilogue == Epilogue::kGeluTanh ? ops::GeluApprox::kTanh : ops::GeluApprox::kNone;
  if (!b.has_value()) return Gelu(x, approx);
  ASSIGN_OR_RETURN(Tensor y, ops::BiasGelu(x.value(), b->value(), approx));
  const Tensor xv = x.value(), bv = b->value();
  return RecordOp("bias_gelu", {x, *b}, std::move(y), [xv, bv, approx](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(ops::BiasGeluGrads g, ops::BiasGeluBackward(dy, xv, bv, approx));
    return Grads{std::move(g.dx), std::move(g.db)};
  });
}

absl::StatusOr<Variable> Gelu(const Variable& x, ops::GeluApprox approx) {
  ASSIGN_OR_RETURN(Tensor y, ops::Gelu(x.value(), approx));
  const Tensor xv = x.value();
  return RecordOp("gelu", {x}, std::move(y), [xv, approx](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor dx, ops::GeluBackward(dy, xv, approx));
    return Grads{dx};
  });
}

namespace {

// The gradient a norm's backward folds into its dx: x's pending one where
// ops::FoldsInto allows, else none (Backward adds it).
const Tensor* FoldedInto(const Tensor& x, const Tensor* pending) {
  return pending != nullptr && ops::FoldsInto(x, *pending) ? pending : nullptr;
}

// The tape entries of a norm computed as `r` from x. The backward folds the
// gradient x already has (a residual stream's, from its skip connection)
// into its dx where ops::FoldsInto allows: the add Backward would otherwise
// launch, with its bits.
absl::StatusOr<Variable> RecordLayerNorm(const Variable& x, const Variable& gamma, const Variable& beta,
                                         ops::LayerNormResult r) {
  const Tensor xv = x.value(), gv = gamma.value(), mean = r.mean, rstd = r.rstd;
  return RecordFoldingOp("layer_norm", {x, gamma, beta}, std::move(r.y),
                         [xv, gv, mean, rstd](const Tensor& dy, const Tensor* pending) -> absl::StatusOr<FoldedGrads> {
                           const Tensor* acc = FoldedInto(xv, pending);
                           ASSIGN_OR_RETURN(ops::LayerNormGrads g, ops::LayerNormBackward(dy, xv, gv, mean, rstd, acc));
                           return FoldedGrads{{g.dx, g.dgamma, g.dbeta}, acc != nullptr};
                         });
}

absl::StatusOr<Variable> RecordRmsNorm(const Variable& x, const Variable& gamma, ops::RmsNormResult r) {
  const Tensor xv = x.value(), gv = gamma.value(), rstd = r.rstd;
  return RecordFoldingOp("rms_norm", {x, gamma}, std::move(r.y),
                         [xv, gv, rstd](const Tensor& dy, const Tensor* pending) -> absl::StatusOr<FoldedGrads> {
                           const Tensor* acc = FoldedInto(xv, pending);
                           ASSIGN_OR_RETURN(ops::RmsNormGrads g, ops::RmsNormBackward(dy, xv, gv, rstd, acc));
                           return FoldedGrads{{g.dx, g.dgamma}, acc != nullptr};
                         });
}

}  // namespace

absl::StatusOr<Variable> LayerNorm(const Variable& x, const Variable& gamma, const Variable& beta, float eps) {
  ASSIGN_OR_RETURN(ops::LayerNormResult r, ops::LayerNorm(x.value(), gamma.value(), beta.value(), eps));
  return RecordLayerNorm(x, gamma, beta, std::move(r));
}

absl::StatusOr<Variable> RmsNorm(const Variable& x, const Variable& gamma, float eps) {
  ASSIGN_OR_RETURN(ops::RmsNormResult r, ops::RmsNorm(x.value(), gamma.value(), eps));
  return RecordRmsNorm(x, gamma, std::move(r));
}

absl::StatusOr<ResidualNorm> AddNorm(const Variable& x, const Variable& residual, const Variable& gamma,
                                     const std::optional<Variable>& beta, float eps) {
  const Tensor &xv = x.value(), &rv = residual.value();
  if (xv.dtype() != rv.dtype() || xv.shape() != rv.shape() || xv.device() != rv.device()) {
    ASSIGN_OR_RETURN(Variable sum, Add(x, residual));  // the add's own promotion or error
    ASSIGN_OR_RETURN(Variable y, beta.has_value() ? LayerNorm(sum, gamma, *beta, eps) : RmsNorm(sum, gamma, eps));
    return ResidualNorm{std::move(sum), std::move(y)};
  }
  Tensor sum_value;
  std::optional<ops::LayerNormResult> ln;
  std::optional<ops::RmsNormResult> rms;
  if (beta.has_value()) {
    ASSIGN_OR_RETURN(ln, ops::LayerNorm(xv, gamma.value(), beta->value(), eps, &rv));
    sum_value = ln->sum;
  } else {
    ASSIGN_OR_RETURN(rms, ops::RmsNorm(xv, gamma.value(), eps, &rv));
    sum_value = rms->sum;
  }
  // The tape is Add then the norm, as unfused.
  Variable sum = RecordOp("add", {x, residual}, std::move(sum_value),
                          [](const Tensor& g) -> absl::StatusOr<Grads> { return Grads{g, g}; });
  Variable y;
  if (ln.has_value()) {
    ASSIGN_OR_RETURN(y, RecordLayerNorm(sum, gamma, *beta, std::move(*ln)));
  } else {
    ASSIGN_OR_RETURN(y, RecordRmsNorm(sum, gamma, std::move(*rms)));
  }
  return ResidualNorm{std::move(sum), std::move(y)};
}

absl::StatusOr<Variable> CrossEntropy(const Variable& logits, const Tensor& labels, float label_smoothing,
                                      int64_t ignore_index) {
  ASSIGN_OR_RETURN(Tensor loss, ops::CrossEntropy(logits.value(), labels, label_smoothing, ignore_index));
  const Tensor z = logits.value();
  return RecordOp("cross_entropy", {logits}, std::move(loss),
                  [z, labels, label_smoothing, ignore_index](const Tensor& dloss) -> absl::StatusOr<Grads> {
                    ASSIGN_OR_RETURN(Tensor dz,
                                     ops::CrossEntropyBackward(dloss, z, labels, label_smoothing, ignore_index));
                    return Grads{dz};
                  });
}

absl::StatusOr<Variable> Dropout(const Variable& x, float p, uint64_t seed, uint64_t offset) {
  ASSIGN_OR_RETURN(Tensor y, ops::Dropout(x.value(), p, seed, offset));
  return RecordOp("dropout", {x}, std::move(y), [p, seed, offset](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor dx, ops::DropoutBackward(dy, p, seed, offset));
    return Grads{dx};
  });
}

absl::StatusOr<Variable> Embedding(const Variable& table, const Tensor& ids, int64_t row_offset,
                                   bool mask_out_of_range) {
  ASSIGN_OR_RETURN(Tensor y, ops::Embedding(table.value(), ids, row_offset, mask_out_of_range));
  const int64_t rows = table.value().shape()[0];
  return RecordOp("embedding", {table}, std::move(y), [ids, rows, row_offset](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor dt, ops::EmbeddingBackward(dy, ids, rows, row_offset));
    return Grads{dt};
  });
}

namespace {

// [B, S, H, D] -> [B, H, S, D], contiguous, so that each (b, h) is an [S, D] matrix.
absl::StatusOr<Tensor> HeadsFirst(const Tensor& t) {
  ASSIGN_OR_RETURN(Tensor v, t.Transpose(1, 2));
  return v.TryContiguous();
}

absl::StatusOr<Tensor> HeadMatrix(const Tensor& heads_first, int64_t b, int64_t h) {
  ASSIGN_OR_RETURN(Tensor m, heads_first.Narrow(0, b, 1));
  ASSIGN_OR_RETURN(m, m.Narrow(1, h, 1));
  return m.Reshape({heads_first.shape()[2], heads_first.shape()[3]});
}

}  // namespace

absl::StatusOr<Variable> CausalAttention(const Variable& q, const Variable& k, const Variable& v, float scale) {
  return Attention(q, k, v, scale, /*causal=*/true);
}

namespace {

// What kAuto means for q: the fused kernel on a CUDA device (head dims up to
// kMaxFusedHeadDim), the per-head GEMMs elsewhere.
AttentionImpl Resolve(AttentionImpl impl, const Variable& q) {
  if (impl != AttentionImpl::kAuto) return impl;
  return q.value().device().is_cuda() && q.value().shape()[3] <= kernels::kMaxFusedHeadDim ? AttentionImpl::kFused
                                                                                          : AttentionImpl::kPerHead;
}

// What is added to each head's scaled scores before the softmax: ALiBi's
// slopes[h] * (j - i) (constant: nothing in the backward but the
// probabilities it shapes), or a learned bias [Hq, Sq, Sk] on the tape
// (T5's relative position bias), whose gradient is the scores' summed over
// the batch.
struct ScoreBias {
  std::vector<float> slopes;
  std::optional<Variable> learned;
};

// The fused kernels (Sq = Sk) with what `bias` adds to the scores. With
// `packed`, q, k and v are its three slices, and the node's input is the
// packed tensor, whose gradient the backward writes slice by slice into one
// buffer.
absl::StatusOr<Variable> FusedAttention(const Variable& q, const Variable& k, const Variable& v, float scale,
                                        bool causal, const ScoreBias& bias = {}, const PackedQkv* packed = nullptr) {
  const DType dtype = q.value().dtype();
  const Device dev = q.value().device();
  // What the kernels read (ops::AttentionInputs): views in place (the
  // slices of packed q, k and v), else contiguous copies, made once here and
  // kept for the backward, which copies nothing again.
  ASSIGN_OR_RETURN(const ops::AttentionQkv in, ops::AttentionInputs(q.value(), k.value(), v.value()));
  const Tensor& qf = in.q;
  const Tensor& kf = in.k;
  const Tensor& vf = in.v;
  ops::AttentionExtras extras;
  if (!bias.slopes.empty()) {
    ASSIGN_OR_RETURN(Tensor host, Tensor::FromFloats({static_cast<int64_t>(bias.slopes.size())}, bias.slopes));
    ASSIGN_OR_RETURN(extras.alibi, host.To(dev));
  }
  std::vector<Variable> inputs = {q, k, v};
  std::optional<Shape> packed_shape;  // the packed tensor's, where the node's input is it
  int64_t packed_dim = 0;
  if (packed != nullptr) {
    inputs = {packed->qkv};
    packed_shape = packed->qkv.value().shape();
    packed_dim = packed->dim;
  }
  const DType bias_dtype = bias.learned.has_value() ? bias.learned->value().dtype() : DType::kF32;
  if (bias.learned.has_value()) {
    ASSIGN_OR_RETURN(extras.bias, bias.learned->value().ContiguousAs(DType::kF32));
    ASSIGN_OR_RETURN(extras.bias, extras.bias->To(dev));
    inputs.push_back(*bias.learned);
  }
  ASSIGN_OR_RETURN(ops::AttentionForward f, ops::FusedAttention(qf, kf, vf, scale, causal, extras));
  ASSIGN_OR_RETURN(Tensor y, f.out.ContiguousAs(dtype));
  const std::string name = std::string(packed != nullptr ? "packed_" : "") + (causal ? "causal_attention" : "attention");
  return RecordOp(name, inputs, std::move(y),
                  [qf, kf, vf, f, scale, causal, dtype, extras, bias_dtype, packed_shape, packed_dim,
                   dev](const Tensor& dy) -> absl::StatusOr<Grads> {
                    // Packed: one gradient buffer, whose three slices the
                    // backward writes (ops::AttentionGradPlaces).
                    Grads out;
                    ops::AttentionGradPlaces places;
                    if (packed_shape.has_value()) {
                      ASSIGN_OR_RETURN(Tensor dqkv, Tensor::Empty(*packed_shape, dtype, dev));
                      ASSIGN_OR_RETURN(places.dq, dqkv.Select(packed_dim, 0));
                      ASSIGN_OR_RETURN(places.dk, dqkv.Select(packed_dim, 1));
                      ASSIGN_OR_RETURN(places.dv, dqkv.Select(packed_dim, 2));
                      out.push_back(std::move(dqkv));
                    }
                    ASSIGN_OR_RETURN(ops::AttentionGrads g,
                                     ops::FusedAttentionBackward(dy, qf, kf, vf, f, scale, causal, extras, places));
                    if (!packed_shape.has_value()) {
                      for (const Tensor* t : {&g.dq, &g.dk, &g.dv}) {
                        ASSIGN_OR_RETURN(Tensor back, t->ContiguousAs(dtype));
                        out.push_back(std::move(back));
                      }
                    }
                    if (g.dbias.has_value()) {
                      ASSIGN_OR_RETURN(Tensor db, g.dbias->ContiguousAs(bias_dtype));
                      out.push_back(std::move(db));
                    }
                    return out;
                  });
}

thread_local bool recompute_scores = false;

// The scores' additions of one attention call: ALiBi's j - i [Sq, Sk]
// times each head's slope, or a learned bias [Hq, Sq, Sk] (f32, contiguous).
struct HeadBias {
  std::vector<float> slopes;
  std::optional<Tensor> distance, learned;
  int64_t sq = 0, sk = 0;
  absl::StatusOr<std::optional<Tensor>> Of(int64_t h) const {
    if (distance.has_value()) {
      ASSIGN_OR_RETURN(Tensor b, Scale(*distance, slopes[h]));
      return std::optional<Tensor>(b);
    }
    if (learned.has_value()) {
      ASSIGN_OR_RETURN(Tensor b, learned->Narrow(0, h, 1));
      ASSIGN_OR_RETURN(b, b.Reshape({sq, sk}));
      return std::optional<Tensor>(b);
    }
    return std::optional<Tensor>();
  }
};

// Head h's probabilities [Sq, Sk] of query matrix qm and key matrix km.
absl::StatusOr<Tensor> HeadProbs(const Tensor& qm, const Tensor& km, float scale, bool causal, const HeadBias& bias,
                                 int64_t h) {
  ASSIGN_OR_RETURN(Tensor scores, ops::MatMul(qm, km, false, true));
  ASSIGN_OR_RETURN(scores, Scale(scores, scale));
  ASSIGN_OR_RETURN(std::optional<Tensor> added, bias.Of(h));
  if (added.has_value()) {
    ASSIGN_OR_RETURN(scores, Add(scores, *added));
  }
  return ops::Softmax(scores, causal);
}

}  // namespace

RecomputeScoresScope::RecomputeScoresScope() : previous_(recompute_scores) { recompute_scores = true; }
RecomputeScoresScope::~RecomputeScoresScope() { recompute_scores = previous_; }

namespace {

// q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] (Sq = Sk when causal); `bias` as
// its callers checked it (a slope per query head, a learned [Hq, Sq, Sk]).
absl::StatusOr<Variable> PerHeadAttention(const Variable& q, const Variable& k, const Variable& v, float scale,
                                          bool causal, const ScoreBias& bias = {}) {
  const Shape& qs = q.value().shape();
  const Shape& ks = k.value().shape();
  const int64_t batch = qs[0], sq = qs[1], sk = ks[1], hq = qs[2], hkv = ks[2], d = qs[3], group = hq / hkv;
  // Computed in f32 whatever the inputs' dtype (bf16 under mixed precision).
  ASSIGN_OR_RETURN(Tensor qh, HeadsFirst(q.value()));
  ASSIGN_OR_RETURN(Tensor kh, HeadsFirst(k.value()));
  ASSIGN_OR_RETURN(Tensor vh, HeadsFirst(v.value()));
  ASSIGN_OR_RETURN(qh, qh.ToDType(DType::kF32));
  ASSIGN_OR_RETURN(kh, kh.ToDType(DType::kF32));
  ASSIGN_OR_RETURN(vh, vh.ToDType(DType::kF32));
  const Device dev = q.value().device();
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({batch, hq, sq, d}, DType::kF32, dev));
  // The probabilities of every (b, h), kept for the backward: [B, Hq, Sq,
  // Sk], unless the backward recomputes them (RecomputeScoresScope).
  const bool keep = !recompute_scores;
  std::optional<Tensor> probs;
  if (keep) {
    ASSIGN_OR_RETURN(probs, Tensor::Empty({batch, hq, sq, sk}, DType::kF32, dev));
  }
  HeadBias added;
  added.sq = sq;
  added.sk = sk;
  added.slopes = bias.slopes;
  if (!bias.slopes.empty()) {
    std::vector<float> dist(sq * sk);
    for (int64_t i = 0; i < sq; ++i) {
      for (int64_t j = 0; j < sk; ++j) dist[i * sk + j] = static_cast<float>(j - i);
    }
    ASSIGN_OR_RETURN(Tensor t, Tensor::FromFloats({sq, sk}, dist));
    ASSIGN_OR_RETURN(added.distance, t.To(dev));
  }
  if (bias.learned.has_value()) {
    ASSIGN_OR_RETURN(added.learned, bias.learned->value().ContiguousAs(DType::kF32));
    ASSIGN_OR_RETURN(added.learned, added.learned->To(dev));
  }
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < hq; ++h) {
      ASSIGN_OR_RETURN(Tensor qm, HeadMatrix(qh, b, h));
      ASSIGN_OR_RETURN(Tensor km, HeadMatrix(kh, b, h / group));
      ASSIGN_OR_RETURN(Tensor vm, HeadMatrix(vh, b, h / group));
      ASSIGN_OR_RETURN(Tensor pm, HeadProbs(qm, km, scale, causal, added, h));
      ASSIGN_OR_RETURN(Tensor om, ops::MatMul(pm, vm));
      ASSIGN_OR_RETURN(Tensor slot, HeadMatrix(out, b, h));
      RETURN_IF_ERROR(slot.CopyFrom(om));
      if (keep) {
        ASSIGN_OR_RETURN(Tensor pslot, HeadMatrix(*probs, b, h));
        RETURN_IF_ERROR(pslot.CopyFrom(pm));
      }
    }
  }
  ASSIGN_OR_RETURN(Tensor y, out.Transpose(1, 2));
  const DType dtype = q.value().dtype();
  ASSIGN_OR_RETURN(y, y.ContiguousAs(dtype));
  std::vector<Variable> inputs = {q, k, v};
  const bool learns_bias = bias.learned.has_value();
  const DType bias_dtype = learns_bias ? bias.learned->value().dtype() : DType::kF32;
  if (learns_bias) inputs.push_back(*bias.learned);
  if (keep) added = HeadBias();  // the backward needs it only to recompute the probabilities
  return RecordOp(
      causal ? "causal_attention" : "attention", inputs, std::move(y),
      [qh, kh, vh, probs, added, causal, batch, sq, sk, hq, hkv, d, group, scale, dtype, dev, learns_bias,
       bias_dtype](const Tensor& dy) -> absl::StatusOr<Grads> {
        ASSIGN_OR_RETURN(Tensor dyh, HeadsFirst(dy));
        ASSIGN_OR_RETURN(dyh, dyh.ToDType(DType::kF32));
        ASSIGN_OR_RETURN(Tensor dq, Tensor::Zeros({batch, hq, sq, d}, DType::kF32, dev));
        ASSIGN_OR_RETURN(Tensor dk, Tensor::Zeros({batch, hkv, sk, d}, DType::kF32, dev));
        ASSIGN_OR_RETURN(Tensor dv, Tensor::Zeros({batch, hkv, sk, d}, DType::kF32, dev));
        std::optional<Tensor> dbias;
        if (learns_bias) {
          ASSIGN_OR_RETURN(dbias, Tensor::Zeros({hq, sq, sk}, DType::kF32, dev));
        }
        for (int64_t b = 0; b < batch; ++b) {
          for (int64_t h = 0; h < hq; ++h) {
            ASSIGN_OR_RETURN(Tensor qm, HeadMatrix(qh, b, h));
            ASSIGN_OR_RETURN(Tensor km, HeadMatrix(kh, b, h / group));
            ASSIGN_OR_RETURN(Tensor vm, HeadMatrix(vh, b, h / group));
            Tensor pm;
            if (probs.has_value()) {
              ASSIGN_OR_RETURN(pm, HeadMatrix(*probs, b, h));
            } else {  // recomputed as the forward computed them
              ASSIGN_OR_RETURN(pm, HeadProbs(qm, km, scale, causal, added, h));
            }
            ASSIGN_OR_RETURN(Tensor dom, HeadMatrix(dyh, b, h));
            ASSIGN_OR_RETURN(Tensor dp, ops::MatMul(dom, vm, false, true));  // dO v^T
            ASSIGN_OR_RETURN(Tensor dvm, ops::MatMul(pm, dom, true));       // P^T dO
            ASSIGN_OR_RETURN(Tensor ds, ops::SoftmaxBackward(dp, pm));
            if (dbias.has_value()) {  // the bias enters the scores unscaled
              ASSIGN_OR_RETURN(Tensor slot, dbias->Narrow(0, h, 1));
              ASSIGN_OR_RETURN(slot, slot.Reshape({sq, sk}));
              ASSIGN_OR_RETURN(Tensor sum, Add(slot, ds));
              RETURN_IF_ERROR(slot.CopyFrom(sum));
            }
            ASSIGN_OR_RETURN(ds, Scale(ds, scale));
            ASSIGN_OR_RETURN(Tensor dqm, ops::MatMul(ds, km));        // dS k
            ASSIGN_OR_RETURN(Tensor dkm, ops::MatMul(ds, qm, true));  // dS^T q
            ASSIGN_OR_RETURN(Tensor dq_slot, HeadMatrix(dq, b, h));
            RETURN_IF_ERROR(dq_slot.CopyFrom(dqm));
            ASSIGN_OR_RETURN(Tensor dk_slot, HeadMatrix(dk, b, h / group));
            ASSIGN_OR_RETURN(Tensor dk_sum, Add(dk_slot, dkm));
            RETURN_IF_ERROR(dk_slot.CopyFrom(dk_sum));
            ASSIGN_OR_RETURN(Tensor dv_slot, HeadMatrix(dv, b, h / group));
            ASSIGN_OR_RETURN(Tensor dv_sum, Add(dv_slot, dvm));
            RETURN_IF_ERROR(dv_slot.CopyFrom(dv_sum));
          }
        }
        Grads g;
        for (Tensor* t : {&dq, &dk, &dv}) {
          ASSIGN_OR_RETURN(Tensor back, t->Transpose(1, 2));
          ASSIGN_OR_RETURN(back, back.ContiguousAs(dtype));
          g.push_back(back);
        }
        if (dbias.has_value()) {
          ASSIGN_OR_RETURN(Tensor db, dbias->ContiguousAs(bias_dtype));
          g.push_back(db);
        }
        return g;
      });
}

}  // namespace

absl::StatusOr<Variable> Attention(const Variable& q, const Variable& k, const Variable& v, float scale, bool causal,
                                   AttentionImpl impl) {
  RETURN_IF_ERROR(ops::CheckAttentionShapes(q.value(), k.value(), v.value()));
  if (Resolve(impl, q) == AttentionImpl::kFused) return FusedAttention(q, k, v, scale, causal);
  return PerHeadAttention(q, k, v, scale, causal);
}

absl::StatusOr<Tensor> ImagePatches(const Tensor& images, int64_t patch) {
  const Shape& s = images.shape();
  if (s.size() != 4 || patch < 1 || s[2] % patch != 0 || s[3] % patch != 0) {
    return absl::InvalidArgumentError(absl::StrCat("images ", ShapeToString(s), " do not split into ", patch, " x ",
                                                   patch, " patches ([batch, channels, height, width] with height "
                                                   "and width multiples of the patch size)"));
  }
  const int64_t b = s[0], c = s[1], hp = s[2] / patch, wp = s[3] / patch;
  // [B, C, Hp, P, Wp, P] -> [B, Hp, Wp, C, P, P], as views, then one copy.
  ASSIGN_OR_RETURN(Tensor t, images.Reshape({b, c, hp, patch, wp, patch}));  // a copy if strided
  ASSIGN_OR_RETURN(t, t.Transpose(1, 2));  // [B, Hp, C, P, Wp, P]
  ASSIGN_OR_RETURN(t, t.Transpose(2, 4));  // [B, Hp, Wp, P, C, P]
  ASSIGN_OR_RETURN(t, t.Transpose(3, 4));  // [B, Hp, Wp, C, P, P]
  return t.Reshape({b, hp * wp, c * patch * patch});  // a contiguous copy
}

std::vector<int64_t> RelativePositionBuckets(int64_t q_len, int64_t k_len, bool bidirectional, int64_t num_buckets,
                                             int64_t max_distance) {
  std::vector<int64_t> out(q_len * k_len);
  const int64_t n = bidirectional ? num_buckets / 2 : num_buckets;
  const int64_t max_exact = n / 2;
  // torch: log(rel.float() / max_exact) / math.log(max_distance / max_exact) * (n - max_exact), all in f32.
  const float divisor =
      static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)));
  for (int64_t i = 0; i < q_len; ++i) {
    for (int64_t j = 0; j < k_len; ++j) {
      int64_t rel = j - i, bucket = 0;
      if (bidirectional) {
        if (rel > 0) bucket += n;
        rel = rel < 0 ? -rel : rel;
      } else {
        rel = rel > 0 ? 0 : -rel;
      }
      if (rel < max_exact) {
        bucket += rel;
      } else {
        const float ratio = static_cast<float>(rel) / static_cast<float>(max_exact);
        const float scaled = std::log(ratio) / divisor * static_cast<float>(n - max_exact);
        bucket += std::min(max_exact + static_cast<int64_t>(scaled), n - 1);
      }
      out[i * k_len + j] = bucket;
    }
  }
  return out;
}

std::vector<float> AlibiSlopes(int64_t heads) {
  std::vector<float> slopes;
  if (heads < 1) return slopes;
  int64_t n = 1;  // the largest power of two <= heads
  while (n * 2 <= heads) n *= 2;
  // 2^(-8/n) to the powers 1..n, in double, as torch computes the base.
  const double base = std::pow(2.0, -8.0 / static_cast<double>(n));
  for (int64_t k = 1; k <= n; ++k) slopes.push_back(static_cast<float>(std::pow(base, static_cast<double>(k))));
  const double extra = std::pow(2.0, -4.0 / static_cast<double>(n));
  for (int64_t k = 1; static_cast<int64_t>(slopes.size()) < heads; k += 2) {
    slopes.push_back(static_cast<float>(std::pow(extra, static_cast<double>(k))));
  }
  return slopes;
}

namespace {

// A slope for each query head of q.
absl::Status CheckSlopes(const std::vector<float>& slopes, const Tensor& q) {
  const int64_t hq = q.shape()[2];
  if (static_cast<int64_t>(slopes.size()) != hq) {
    return absl::InvalidArgumentError(
        absl::StrCat("ALiBi needs a slope for each of the ", hq, " query heads, got ", slopes.size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Variable> AlibiAttention(const Variable& q, const Variable& k, const Variable& v, float scale,
                                        const std::vector<float>& slopes, AttentionImpl impl) {
  RETURN_IF_ERROR(ops::CheckAttentionShapes(q.value(), k.value(), v.value()));
  RETURN_IF_ERROR(CheckSlopes(slopes, q.value()));
  ScoreBias bias;
  bias.slopes = slopes;
  if (Resolve(impl, q) == AttentionImpl::kFused) return FusedAttention(q, k, v, scale, /*causal=*/true, bias);
  return PerHeadAttention(q, k, v, scale, /*causal=*/true, bias);
}

absl::StatusOr<Variable> BiasedAttention(const Variable& q, const Variable& k, const Variable& v, float scale,
                                         bool causal, const std::optional<Variable>& bias, AttentionImpl impl) {
  RETURN_IF_ERROR(ops::CheckAttentionShapes(q.value(), k.value(), v.value(), /*same_length=*/causal));
  ScoreBias b;
  b.learned = bias;
  const int64_t hq = q.value().shape()[2], sq = q.value().shape()[1], sk = k.value().shape()[1];
  if (bias.has_value() && bias->value().shape() != Shape{hq, sq, sk}) {
    return absl::InvalidArgumentError(absl::StrCat("an attention bias must be [", hq, ", ", sq, ", ", sk,
                                                   "] (heads, queries, keys), got ",
                                                   ShapeToString(bias->value().shape())));
  }
  // The fused kernels take one sequence length (self-attention); T5's
  // cross-attention (Sq != Sk, no bias) takes the per-head GEMMs.
  if (sq == sk && Resolve(impl, q) == AttentionImpl::kFused) return FusedAttention(q, k, v, scale, causal, b);
  if (impl == AttentionImpl::kFused && sq != sk) {
    return absl::InvalidArgumentError(absl::StrCat("the fused attention takes one sequence length, not ", sq,
                                                   " queries over ", sk, " keys"));
  }
  return PerHeadAttention(q, k, v, scale, causal, b);
}

namespace {

// Causal attention over `packed`'s three slices, their scores gaining
// ALiBi's `slopes` where set: the fused node over the packed tensor (the
// slices, views, recorded as nothing), or the per-head path over three
// Selects on the tape.
absl::StatusOr<Variable> PackedCausalAttention(const PackedQkv& packed, float scale,
                                               const std::vector<float>* slopes, AttentionImpl impl) {
  const Tensor& t = packed.qkv.value();
  absl::StatusOr<int64_t> dim = t.NormalizeDim(packed.dim);
  if (!dim.ok() || t.shape()[*dim] != 3) {
    return absl::InvalidArgumentError(absl::StrCat("packed q, k and v need a dim of 3 at ", packed.dim, ", not ",
                                                   ShapeToString(t.shape())));
  }
  Variable parts[3];
  for (int i = 0; i < 3; ++i) {
    ASSIGN_OR_RETURN(Tensor view, t.Select(*dim, i));
    parts[i] = Variable(std::move(view));
  }
  RETURN_IF_ERROR(ops::CheckAttentionShapes(parts[0].value(), parts[1].value(), parts[2].value()));
  ScoreBias bias;
  if (slopes != nullptr) {
    RETURN_IF_ERROR(CheckSlopes(*slopes, parts[0].value()));
    bias.slopes = *slopes;
  }
  if (Resolve(impl, parts[0]) == AttentionImpl::kFused) {
    const PackedQkv normalized{packed.qkv, *dim};
    return FusedAttention(parts[0], parts[1], parts[2], scale, /*causal=*/true, bias, &normalized);
  }
  for (int i = 0; i < 3; ++i) {
    ASSIGN_OR_RETURN(parts[i], Select(packed.qkv, *dim, i));
  }
  return PerHeadAttention(parts[0], parts[1], parts[2], scale, /*causal=*/true, bias);
}

}  // namespace

absl::StatusOr<Variable> CausalAttention(const PackedQkv& packed, float scale, AttentionImpl impl) {
  return PackedCausalAttention(packed, scale, nullptr, impl);
}

absl::StatusOr<Variable> AlibiAttention(const PackedQkv& packed, float scale, const std::vector<float>& slopes,
                                        AttentionImpl impl) {
  return PackedCausalAttention(packed, scale, &slopes, impl);
}

namespace {

// LayerNorm (with beta) or RMSNorm (without) over a hidden dim split across
// `hidden`; see ShardedLayerNorm. Every pass runs where x is (ops::Norm*),
// and the row statistics are all-reduced there: on CUDA nothing is read on
// the host. Collectives, in order: the row sums (LayerNorm), the squared
// deviations; backward: the two row sums, then the parameter gradients over
// each replica group.
absl::StatusOr<Variable> ShardedNorm(const Variable& x, const Variable& gamma, const std::optional<Variable>& beta,
                                     float eps, Communicator* hidden, const std::vector<Communicator*>& replicas,
                                     absl::Duration timeout) {
  const bool rms = !beta.has_value();
  ASSIGN_OR_RETURN(const Tensor xv, x.value().TryContiguous());
  if (xv.dim() == 0 || gamma.value().shape() != Shape{xv.shape().back()} ||
      (!rms && beta->value().shape() != gamma.value().shape())) {
    return absl::InvalidArgumentError(absl::StrCat("sharded norm: gamma ", ShapeToString(gamma.value().shape()),
                                                   rms ? "" : " and beta", " must be [", xv.dim() ? xv.shape().back() : 0,
                                                   "] for the local input ", ShapeToString(xv.shape())));
  }
  const int64_t h = xv.shape().back() * hidden->size();
  std::optional<Tensor> mean;
  if (!rms) {
    ASSIGN_OR_RETURN(Tensor sums, ops::NormRowSums(xv, std::nullopt, /*square=*/false));
    RETURN_IF_ERROR(AllReduceInPlace(sums, ReduceOp::kSum, *hidden, timeout));
    ASSIGN_OR_RETURN(mean, Scale(sums, 1.0f / static_cast<float>(h)));
  }
  ASSIGN_OR_RETURN(Tensor squares, ops::NormRowSums(xv, mean, /*square=*/true));
  RETURN_IF_ERROR(AllReduceInPlace(squares, ReduceOp::kSum, *hidden, timeout));
  std::optional<Tensor> b;
  if (!rms) b = beta->value();
  const Tensor g = gamma.value();
  ASSIGN_OR_RETURN(ops::NormApplied applied, ops::NormApply(xv, g, b, mean, squares, h, eps));
  std::vector<Variable> inputs = {x, gamma};
  if (!rms) inputs.push_back(*beta);
  const DType param_dtype = g.dtype();
  return RecordOp(
      rms ? "sharded_rms_norm" : "sharded_layer_norm", inputs, std::move(applied.y),
      [xv, g, mean, rstd = applied.rstd, h, hidden, replicas, timeout, rms,
       param_dtype](const Tensor& dy) -> absl::StatusOr<Grads> {
        ASSIGN_OR_RETURN(Tensor sums, ops::NormBackwardSums(dy, xv, g, mean, rstd));
        RETURN_IF_ERROR(AllReduceInPlace(sums, ReduceOp::kSum, *hidden, timeout));
        ASSIGN_OR_RETURN(Tensor dx, ops::NormBackwardApply(dy, xv, g, mean, rstd, sums, h));
        ASSIGN_OR_RETURN(ops::NormParamGrads pg, ops::NormParamGrad(dy, xv, mean, rstd, !rms));
        // [dgamma | dbeta] of this block's rows, summed over the replicas in one collective each.
        std::vector<Tensor> parts = {pg.dgamma};
        if (!rms) parts.push_back(*pg.dbeta);
        ASSIGN_OR_RETURN(Tensor dgb, Tensor::Cat(parts, 0));
        for (Communicator* replica : replicas) RETURN_IF_ERROR(AllReduceInPlace(dgb, ReduceOp::kSum, *replica, timeout));
        const int64_t hl = g.numel();
        ASSIGN_OR_RETURN(Tensor dgamma, dgb.Narrow(0, 0, hl));
        ASSIGN_OR_RETURN(dgamma, dgamma.ContiguousAs(param_dtype));
        if (rms) return Grads{dx, dgamma};
        ASSIGN_OR_RETURN(Tensor dbeta, dgb.Narrow(0, hl, hl));
        ASSIGN_OR_RETURN(dbeta, dbeta.ContiguousAs(param_dtype));
        return Grads{dx, dgamma, dbeta};
      });
}

}  // namespace

absl::StatusOr<Variable> ShardedLayerNorm(const Variable& x, const Variable& gamma, const Variable& beta, float eps,
                                          Communicator* hidden, const std::vector<Communicator*>& replicas,
                                          absl::Duration timeout) {
  return ShardedNorm(x, gamma, beta, eps, hidden, replicas, timeout);
}

absl::StatusOr<Variable> ShardedRmsNorm(const Variable& x, const Variable& gamma, float eps, Communicator* hidden,
                                        const std::vector<Communicator*>& replicas, absl::Duration timeout) {
  return ShardedNorm(x, gamma, std::nullopt, eps, hidden, replicas, timeout);
}


absl::StatusOr<Variable> GatherAlongDim(const Variable& x, int64_t dim, Communicator* comm, absl::Duration timeout) {
  ASSIGN_OR_RETURN(int64_t d, x.value().NormalizeDim(dim));
  ASSIGN_OR_RETURN(Tensor y, AllGatherDim(x.value(), d, *comm, timeout));
  return RecordOp("gather_along_dim", {x}, std::move(y), [d, comm, timeout](const Tensor& dy) -> absl::StatusOr<Grads> {
    ASSIGN_OR_RETURN(Tensor dx, ReduceScatterDim(dy, d, *comm, timeout));
    return Grads{dx};
  });
}

absl::StatusOr<Variable> ReduceScatterAlongDim(const Variable& x, int64_t dim, Communicator* comm,
                                               absl::Duration timeout) {
  ASSIGN_OR_RETURN(int64_t d, x.value().NormalizeDim(dim));
  if (x.value().shape()[d] % comm->size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("dim ", d, " of size ", x.value().shape()[d],
                                                   " is not divisible by ", comm->size()));
  }
  ASSIGN_OR_RETURN(Tensor y, ReduceScatterDim(x.value(), d, *comm, timeout));
  return RecordOp("reduce_scatter_along_dim", {x}, std::move(y),
                  [d, comm, timeout](const Tensor& dy) -> absl::StatusOr<Grads> {
                    ASSIGN_OR_RETURN(Tensor dx, AllGatherDim(dy, d, *comm, timeout));
                    return Grads{dx};
                  });
}

absl::StatusOr<Variable> SumPartialAddBias(const Variable& x, const std::optional<Variable>& b, Communicator* comm,
                                           absl::Duration timeout) {
  Tensor y = x.value();
  RETURN_IF_ERROR(AllReduceInPlace(y, ReduceOp::kSum, *comm, timeout));
  if (b.has_value()) RETURN_IF_ERROR(ops::BiasAddInPlace(y, b->value()));
  std::vector<Variable> inputs = {x};
  if (b.has_value()) inputs.push_back(*b);
  const bool has_bias = b.has_value();
  return RecordOp(has_bias ? "sum_partial_add_bias" : "sum_partial", inputs, std::move(y),
                  [has_bias](const Tensor& dy) -> absl::StatusOr<Grads> {
                    Grads g = {dy};
                    if (has_bias) {
                      ASSIGN_OR_RETURN(Tensor db, ops::BiasGrad(dy));
                      g.push_back(std::move(db));
                    }
                    return g;
                  });
}

absl::StatusOr<Variable> ReduceGradient(const Variable& x, Communicator* comm, absl::Duration timeout) {
  return RecordOp("reduce_gradient", {x}, x.value(), [comm, timeout](const Tensor& dy) -> absl::StatusOr<Grads> {
    if (comm->size() == 1) return Grads{dy};
    ASSIGN_OR_RETURN(Tensor g, dy.TryClone());
    RETURN_IF_ERROR(AllReduceInPlace(g, ReduceOp::kSum, *comm, timeout));
    return Grads{g};
  });
}

}  // namespace colod::nn
