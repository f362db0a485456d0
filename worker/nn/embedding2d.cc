#include "worker/nn/embedding2d.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/embedding1d.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear2d.h"

namespace colod::nn {

absl::StatusOr<Embedding2D> Embedding2D::FromGlobal(const Tensor& table, ProcessGroup* pg) {
  if (table.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("Embedding2D: the table must be [V, H], got ",
                                                   ShapeToString(table.shape())));
  }
  ASSIGN_OR_RETURN(const DistSpec spec, Spec(pg));
  auto w = ColoTensor::FromGlobal(table, spec, pg, true);
  if (!w.ok()) return absl::InvalidArgumentError(absl::StrCat("Embedding2D weight: ", w.status().message()));
  return FromParameters(ColoParameter(*std::move(w), "weight"), pg);
}

absl::StatusOr<DistSpec> Embedding2D::Spec(ProcessGroup* pg) {
  ASSIGN_OR_RETURN(Groups2D g, GetGroups2D(pg));
  return DistSpec().Set("tp_row", Placement::Shard({1}, {g.q}));
}

absl::StatusOr<Embedding2D> Embedding2D::FromParameters(ColoParameter table, ProcessGroup* pg) {
  ASSIGN_OR_RETURN(Groups2D g, GetGroups2D(pg));
  if (table.global_shape().size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("Embedding2D: the table must be [V, H], got ",
                                                   ShapeToString(table.global_shape())));
  }
  ASSIGN_OR_RETURN(const DistSpec spec, Spec(pg));
  RETURN_IF_ERROR(CheckSpec(table, spec, "Embedding2D table"));
  table.set_compute_spec({g.depth > 1 ? ComputePattern::kTP2P5D : ComputePattern::kTP2D});
  return Embedding2D(std::move(table), pg);
}

absl::StatusOr<ColoTensor> Embedding2D::Forward(const Tensor& ids) const {
  ASSIGN_OR_RETURN(Groups2D g, GetGroups2D(pg_));
  RETURN_IF_ERROR(CheckIds(ids, weight_.global_shape()[0]));
  if (ids.dim() < 1 || ids.shape()[0] % (g.q * g.depth) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Embedding2D: the batch of ids ", ShapeToString(ids.shape()),
                                                   " must divide into ", g.q * g.depth, " blocks"));
  }
  // This rank's batch block: depth layer first, then the column.
  ASSIGN_OR_RETURN(int i, pg_->LocalRank("tp_col"));
  int dep = 0;
  if (g.dep != nullptr) {
    ASSIGN_OR_RETURN(dep, pg_->LocalRank("tp_dep"));
  }
  ASSIGN_OR_RETURN(Tensor mine, ids.Chunk(0, g.q * g.depth, dep * g.q + i));
  ASSIGN_OR_RETURN(Variable table, SumGradOverReplicas(weight_.variable(), g, pg_->timeout()));
  ASSIGN_OR_RETURN(Tensor dense, mine.TryContiguous());
  ASSIGN_OR_RETURN(Variable out, Embedding(table, dense));
  return ColoTensor::FromLocal(out, Activation2D(out.value().dim(), g.q, g.depth), pg_);
}

absl::StatusOr<DistSpec> Embedding2D::ActivationSpec(int64_t ndim) const {
  ASSIGN_OR_RETURN(Groups2D g, GetGroups2D(pg_));
  return Activation2D(ndim, g.q, g.depth);
}

absl::StatusOr<ColoTensor> Embedding2D::TiedLogits(const ColoTensor& h) const {
  ASSIGN_OR_RETURN(Groups2D g, GetGroups2D(pg_));
  ASSIGN_OR_RETURN(ColoTensor in, ToActivation2D(h, g));
  DistSpec spec = in.spec();
  ASSIGN_OR_RETURN(Variable table, SumGradOverReplicas(weight_.variable(), g, pg_->timeout()));
  // [.., H/q] @ [V, H/q]^T: a partial sum over the row group's hidden blocks.
  ASSIGN_OR_RETURN(Variable partial, Linear(in.variable(), table, std::nullopt));
  spec.Set("tp_row", Placement::Partial());
  ASSIGN_OR_RETURN(ColoTensor logits, ColoTensor::FromLocal(partial, spec, pg_));
  spec.Set("tp_row", Placement::Replicate());
  return logits.Redistribute(spec);
}

}  // namespace colod::nn
