#include "worker/nn/embedding3d.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/embedding1d.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear3d.h"

namespace colod::nn {

absl::StatusOr<DistSpec> Embedding3D::Spec(ProcessGroup* pg) {
  ASSIGN_OR_RETURN(int q, Get3DSize(pg));
  return DistSpec().Set(kStreamC, Placement::Shard({1}, {q}));
}

absl::StatusOr<Embedding3D> Embedding3D::FromGlobal(const Tensor& table, ProcessGroup* pg) {
  if (table.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("Embedding3D: the table must be [V, H], got ",
                                                   ShapeToString(table.shape())));
  }
  ASSIGN_OR_RETURN(const DistSpec spec, Spec(pg));
  auto w = ColoTensor::FromGlobal(table, spec, pg, true);
  if (!w.ok()) return absl::InvalidArgumentError(absl::StrCat("Embedding3D weight: ", w.status().message()));
  return FromParameters(ColoParameter(*std::move(w), "weight"), pg);
}

absl::StatusOr<Embedding3D> Embedding3D::FromParameters(ColoParameter table, ProcessGroup* pg) {
  ASSIGN_OR_RETURN(int q, Get3DSize(pg));
  if (table.global_shape().size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("Embedding3D: the table must be [V, H], got ",
                                                   ShapeToString(table.global_shape())));
  }
  ASSIGN_OR_RETURN(const DistSpec spec, Spec(pg));
  RETURN_IF_ERROR(CheckSpec(table, spec, "Embedding3D table"));
  table.set_compute_spec({ComputePattern::kTP3D});
  return Embedding3D(std::move(table), pg, q);
}

absl::StatusOr<Variable> Embedding3D::Table() const {
  ASSIGN_OR_RETURN(Communicator * r, pg_->Comm("tp_output"));
  ASSIGN_OR_RETURN(Communicator * k, pg_->Comm(kStreamK));
  ASSIGN_OR_RETURN(Variable t, ReduceGradient(weight_.variable(), r, pg_->timeout()));
  return ReduceGradient(t, k, pg_->timeout());
}

absl::StatusOr<ColoTensor> Embedding3D::Forward(const Tensor& ids) const {
  RETURN_IF_ERROR(CheckIds(ids, weight_.global_shape()[0]));
  const int blocks = q_ * q_;
  if (ids.dim() < 1 || ids.shape()[0] % blocks != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Embedding3D: the batch of ids ", ShapeToString(ids.shape()),
                                                   " must divide into ", blocks, " blocks"));
  }
  ASSIGN_OR_RETURN(int r, pg_->LocalRank("tp_output"));
  ASSIGN_OR_RETURN(int k, pg_->LocalRank(kStreamK));
  ASSIGN_OR_RETURN(Tensor mine, ids.Chunk(0, blocks, r * q_ + k));
  ASSIGN_OR_RETURN(Variable table, Table());
  ASSIGN_OR_RETURN(Tensor dense, mine.TryContiguous());
  ASSIGN_OR_RETURN(Variable out, Embedding(table, dense));
  return ColoTensor::FromLocal(out, Activation3D(out.value().dim(), q_, kStreamK, kStreamC), pg_);
}

absl::StatusOr<DistSpec> Embedding3D::ActivationSpec(int64_t ndim) const {
  return Activation3D(ndim, q_, kStreamK, kStreamC);
}

absl::StatusOr<ColoTensor> Embedding3D::TiedLogits(const ColoTensor& h) const {
  const int64_t ndim = static_cast<int64_t>(h.global_shape().size());
  DistSpec spec = Activation3D(ndim, q_, kStreamK, kStreamC);
  ASSIGN_OR_RETURN(ColoTensor in, ToSpec3D(h, spec));
  ASSIGN_OR_RETURN(Variable table, Table());
  // [.., H/q] @ [V, H/q]^T: a partial sum over C's hidden blocks.
  ASSIGN_OR_RETURN(Variable partial, Linear(in.variable(), table, std::nullopt));
  spec.Set(kStreamC, Placement::Partial());
  ASSIGN_OR_RETURN(ColoTensor logits, ColoTensor::FromLocal(partial, spec, pg_));
  spec.Set(kStreamC, Placement::Replicate());
  return logits.Redistribute(spec);
}

}  // namespace colod::nn
