#include "worker/colo/colo_tensor.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/colo/redistribute.h"

namespace colod {

absl::StatusOr<ColoTensor> ColoTensor::FromGlobal(const Tensor& global, DistSpec spec, ProcessGroup* pg,
                                                  bool requires_grad) {
  ASSIGN_OR_RETURN(DistSpec norm, NormalizeSpec(spec, pg->mesh(), global.dim()));
  RETURN_IF_ERROR(CheckDivisible(norm, global.shape()));
  // Outermost axis first, so that shards of one dim nest in mesh order.
  Tensor local = global;
  for (const std::string& axis : AxesInMeshOrder(norm, pg->mesh())) {
    const Placement p = norm.Get(axis);
    ASSIGN_OR_RETURN(int k, pg->LocalRank(axis));
    if (p.kind == Placement::Kind::kShard) {
      ASSIGN_OR_RETURN(local, ShardBlock(local, p, k));
    } else if (p.kind == Placement::Kind::kPartial && p.op == ReduceOp::kSum && k != 0) {
      ASSIGN_OR_RETURN(local, Tensor::Zeros(local.shape(), local.dtype(), local.device()));
    }
  }
  ASSIGN_OR_RETURN(Tensor copy, local.TryClone());
  return ColoTensor(Variable(std::move(copy), requires_grad), global.shape(), std::move(norm), pg);
}

absl::StatusOr<ColoTensor> ColoTensor::FromLocal(const Tensor& local, DistSpec spec, ProcessGroup* pg) {
  ASSIGN_OR_RETURN(Tensor dense, local.TryContiguous());
  return FromLocal(Variable(std::move(dense)), std::move(spec), pg);
}

absl::StatusOr<ColoTensor> ColoTensor::FromLocal(const Variable& local, DistSpec spec, ProcessGroup* pg) {
  ASSIGN_OR_RETURN(DistSpec norm, NormalizeSpec(spec, pg->mesh(), local.value().dim()));
  Shape global = local.value().shape();
  for (const auto& [axis, p] : norm.placements()) {
    if (p.kind != Placement::Kind::kShard) continue;
    for (size_t i = 0; i < p.dims.size(); ++i) global[p.dims[i]] *= p.num_partitions[i];
  }
  return ColoTensor(local, std::move(global), std::move(norm), pg);
}

absl::StatusOr<std::vector<RedistributeStep>> ColoTensor::Plan(const DistSpec& target) const {
  ASSIGN_OR_RETURN(DistSpec to, NormalizeSpec(target, pg_->mesh(), static_cast<int64_t>(global_shape_.size())));
  RETURN_IF_ERROR(CheckDivisible(to, global_shape_));
  return PlanRedistribute(spec_, to, global_shape_, local_.value().dtype(), pg_->mesh());
}

absl::StatusOr<ColoTensor> ColoTensor::Redistribute(const DistSpec& target) const {
  // Everything is checked before the first collective.
  ASSIGN_OR_RETURN(DistSpec to, NormalizeSpec(target, pg_->mesh(), static_cast<int64_t>(global_shape_.size())));
  ASSIGN_OR_RETURN(std::vector<RedistributeStep> plan, Plan(to));
  Variable local = local_;
  for (const RedistributeStep& step : plan) {
    ASSIGN_OR_RETURN(Communicator * comm, pg_->Comm(step.axis));
    ASSIGN_OR_RETURN(int k, pg_->LocalRank(step.axis));
    const absl::Duration timeout = pg_->timeout();
    ASSIGN_OR_RETURN(Tensor next, RunStep(local.value(), step, *comm, k, timeout));
    local = RecordOp(absl::StrCat("redistribute ", step.axis, " ", step.from.ToString(), "->", step.to.ToString()),
                     {local}, std::move(next),
                     [step, comm, k, timeout](const Tensor& g) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
                       ASSIGN_OR_RETURN(Tensor gi, RunStepBackward(g, step, *comm, k, timeout));
                       return std::vector<std::optional<Tensor>>{gi};
                     });
  }
  ColoTensor out(std::move(local), global_shape_, std::move(to), pg_);
  out.compute_spec_ = compute_spec_;
  return out;
}

absl::Status ColoTensor::SetDistSpec(const DistSpec& target) {
  ASSIGN_OR_RETURN(ColoTensor next, Redistribute(target));
  *this = std::move(next);
  return absl::OkStatus();
}

absl::StatusOr<ColoParameter> ColoParameter::Create(const Tensor& value, DistSpec spec, ProcessGroup* pg,
                                                   std::string name, ComputeSpec compute) {
  auto t = ColoTensor::FromGlobal(value, std::move(spec), pg, /*requires_grad=*/true);
  if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat(name, ": ", t.status().message()));
  t->set_compute_spec(compute);
  return ColoParameter(*std::move(t), std::move(name));
}

absl::StatusOr<Block> LocalBlock(const DistSpec& spec, const Shape& global, ProcessGroup* pg) {
  return LocalBlock(spec, global, pg->mesh(), pg->rank());
}

absl::StatusOr<Block> LocalBlock(const DistSpec& spec, const Shape& global, const DeviceMesh& mesh, int rank) {
  const int64_t ndim = static_cast<int64_t>(global.size());
  ASSIGN_OR_RETURN(DistSpec norm, NormalizeSpec(spec, mesh, ndim));
  RETURN_IF_ERROR(CheckDivisible(norm, global));
  Block b{std::vector<int64_t>(ndim, 0), std::vector<int64_t>(global.begin(), global.end())};
  for (const std::string& axis : AxesInMeshOrder(norm, mesh)) {
    const Placement p = norm.Get(axis);
    if (p.kind == Placement::Kind::kPartial) {
      return absl::InvalidArgumentError(absl::StrCat("a Partial placement (axis ", axis, ") has no block"));
    }
    if (p.kind != Placement::Kind::kShard) continue;
    ASSIGN_OR_RETURN(int k, mesh.LocalRank(axis, rank));
    const std::vector<int64_t> coords = BlockCoordinates(k, p.num_partitions);
    for (size_t i = 0; i < p.dims.size(); ++i) {
      const int64_t d = p.dims[i];
      b.lengths[d] /= p.num_partitions[i];
      b.starts[d] += coords[i] * b.lengths[d];
    }
  }
  return b;
}

absl::Status CheckSpec(const ColoTensor& t, const DistSpec& want, const std::string& what) {
  auto norm = NormalizeSpec(want, t.process_group()->mesh(), static_cast<int64_t>(t.global_shape().size()));
  if (!norm.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", norm.status().message()));
  bool same = true;
  for (const DistSpec* spec : {static_cast<const DistSpec*>(&*norm), &t.spec()}) {
    for (const auto& [axis, p] : spec->placements()) same = same && norm->Get(axis) == t.spec().Get(axis);
  }
  if (!same) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be ", norm->ToString(), ", got ", t.spec().ToString()));
  }
  return absl::OkStatus();
}

}  // namespace colod
