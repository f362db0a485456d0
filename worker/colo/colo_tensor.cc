#include "worker/colo/colo_tensor.h"

#include <algorithm>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace colod {
namespace {

// Checks `spec` against the mesh and a tensor of rank `ndim`, and returns it
// with negative dims normalized.
absl::StatusOr<DistSpec> Normalize(const DistSpec& spec, ProcessGroup& pg, int64_t ndim) {
  DistSpec out;
  std::set<int64_t> sharded;
  for (const auto& [axis, p] : spec.placements()) {
    auto size = pg.AxisSize(axis);
    if (!size.ok()) return absl::InvalidArgumentError(std::string(size.status().message()));
    Placement q = p;
    if (p.kind == Placement::Kind::kShard) {
      if (p.dims.empty() || p.dims.size() != p.num_partitions.size()) {
        return absl::InvalidArgumentError(absl::StrCat("shard on axis ", axis,
                                                       ": dims and num_partitions must be non-empty and equal in length"));
      }
      int64_t product = 1;
      for (size_t i = 0; i < p.dims.size(); ++i) {
        int64_t d = p.dims[i];
        if (d < -ndim || d >= ndim) {
          return absl::InvalidArgumentError(
              absl::StrCat("shard on axis ", axis, ": dim ", d, " is out of range for a ", ndim, "-d tensor"));
        }
        q.dims[i] = d < 0 ? d + ndim : d;
        if (p.num_partitions[i] < 1) {
          return absl::InvalidArgumentError(absl::StrCat("shard on axis ", axis, ": num_partitions must be >= 1"));
        }
        if (!sharded.insert(q.dims[i]).second) {
          return absl::UnimplementedError(
              absl::StrCat("dim ", q.dims[i], " is sharded twice; nested sharding of one dim is not supported"));
        }
        product *= p.num_partitions[i];
      }
      if (product != *size) {
        return absl::InvalidArgumentError(absl::StrCat("shard on axis ", axis, ": num_partitions multiply to ",
                                                       product, " but the axis has ", *size, " ranks"));
      }
    }
    out.Set(axis, q);
  }
  return out;
}

absl::Status WaitFor(const std::shared_ptr<Work>& w, const ProcessGroup& pg) { return w->Wait(pg.timeout()); }

// Axis-level conversions of this rank's local tensor. `comm` is the group
// along the axis; the tensors are contiguous.
absl::StatusOr<Tensor> Gather(const Tensor& local, const Placement& from, Communicator& comm,
                              const ProcessGroup& pg) {
  const int n = comm.size();
  Tensor in = local.Contiguous();
  ASSIGN_OR_RETURN(Tensor flat, Tensor::Empty({n * in.numel()}, in.dtype()));
  RETURN_IF_ERROR(WaitFor(comm.AllGather(in.raw_data(), flat.raw_data(), in.numel(), in.dtype()), pg));
  Shape full = in.shape();
  for (size_t i = 0; i < from.dims.size(); ++i) full[from.dims[i]] *= from.num_partitions[i];
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(full, in.dtype()));
  for (int j = 0; j < n; ++j) {
    ASSIGN_OR_RETURN(Tensor piece, flat.Narrow(0, j * in.numel(), in.numel()));
    ASSIGN_OR_RETURN(piece, piece.Reshape(in.shape()));
    ASSIGN_OR_RETURN(Tensor slot, ShardBlock(out, from, j));
    RETURN_IF_ERROR(slot.CopyFrom(piece));
  }
  return out;
}

// One direct conversion step on an axis (no two-step cases; see Steps).
absl::StatusOr<Tensor> ConvertStep(const Tensor& local, const Placement& from, const Placement& to,
                                   Communicator& comm, int local_rank, const ProcessGroup& pg) {
  using K = Placement::Kind;
  if (from == to) return local;
  if (from.kind == K::kReplicate && to.kind == K::kShard) {
    ASSIGN_OR_RETURN(Tensor block, ShardBlock(local, to, local_rank));
    return block.Contiguous();
  }
  if (from.kind == K::kShard && to.kind == K::kReplicate) return Gather(local, from, comm, pg);
  if (from.kind == K::kPartial && to.kind == K::kReplicate) {
    Tensor out = local.Clone();
    RETURN_IF_ERROR(WaitFor(comm.AllReduce(out.raw_data(), out.numel(), out.dtype(), from.op), pg));
    return out;
  }
  if (from.kind == K::kPartial && to.kind == K::kShard) {
    // Lay the blocks out in rank order, then reduce-scatter: block k lands on rank k.
    const int n = comm.size();
    std::vector<Tensor> blocks;
    for (int j = 0; j < n; ++j) {
      ASSIGN_OR_RETURN(Tensor b, ShardBlock(local, to, j));
      ASSIGN_OR_RETURN(b, b.Reshape({b.numel()}));
      blocks.push_back(std::move(b));
    }
    ASSIGN_OR_RETURN(Tensor staged, Tensor::Cat(blocks, 0));
    ASSIGN_OR_RETURN(Tensor mine, ShardBlock(local, to, local_rank));
    ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(mine.shape(), local.dtype()));
    RETURN_IF_ERROR(WaitFor(comm.ReduceScatter(staged.raw_data(), out.raw_data(), out.numel(), out.dtype(), from.op), pg));
    return out;
  }
  if (from.kind == K::kReplicate && to.kind == K::kPartial) {
    // A sum of the group's operands must equal the value: rank 0 keeps it.
    // Avg, max and min of identical copies are the value itself.
    if (to.op == ReduceOp::kSum && local_rank != 0) return Tensor::Zeros(local.shape(), local.dtype());
    return local.Clone();
  }
  return absl::InternalError(absl::StrCat("no direct conversion ", from.ToString(), " -> ", to.ToString()));
}

// The direct steps from `from` to `to`: S(a) -> S(b), S -> P and P -> P' go
// through Replicate.
std::vector<std::pair<Placement, Placement>> Steps(const Placement& from, const Placement& to) {
  using K = Placement::Kind;
  if (from == to) return {};
  if ((from.kind == K::kShard && to.kind != K::kReplicate) || (from.kind == K::kPartial && to.kind == K::kPartial)) {
    return {{from, Placement::Replicate()}, {Placement::Replicate(), to}};
  }
  return {{from, to}};
}

// The gradient of a step's input from the gradient of its output.
absl::StatusOr<Tensor> BackwardStep(const Tensor& grad, const Placement& from, const Placement& to,
                                    Communicator& comm, int local_rank, const ProcessGroup& pg) {
  using K = Placement::Kind;
  if (to.kind == K::kPartial) return grad;  // R -> P: identity
  if (from.kind == K::kPartial) {
    if (to.kind == K::kReplicate) return grad;                                   // P -> R: identity
    return ConvertStep(grad, to, Placement::Replicate(), comm, local_rank, pg);  // P -> S: all-gather
  }
  return ConvertStep(grad, to, from, comm, local_rank, pg);  // R <-> S: the reverse step
}

}  // namespace

absl::StatusOr<ColoTensor> ColoTensor::FromGlobal(const Tensor& global, DistSpec spec, ProcessGroup* pg,
                                                  bool requires_grad) {
  ASSIGN_OR_RETURN(DistSpec norm, Normalize(spec, *pg, global.dim()));
  Tensor local = global;
  for (const auto& [axis, p] : norm.placements()) {
    ASSIGN_OR_RETURN(int k, pg->LocalRank(axis));
    if (p.kind == Placement::Kind::kShard) {
      auto block = ShardBlock(local, p, k);
      if (!block.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("shard on axis ", axis, ": ", block.status().message()));
      }
      local = *block;
    } else if (p.kind == Placement::Kind::kPartial && p.op == ReduceOp::kSum && k != 0) {
      ASSIGN_OR_RETURN(local, Tensor::Zeros(local.shape(), local.dtype()));
    }
  }
  return ColoTensor(Variable(local.Clone(), requires_grad), global.shape(), std::move(norm), pg);
}

absl::StatusOr<ColoTensor> ColoTensor::FromLocal(const Tensor& local, DistSpec spec, ProcessGroup* pg) {
  return FromLocal(Variable(local.Contiguous()), std::move(spec), pg);
}

absl::StatusOr<ColoTensor> ColoTensor::FromLocal(const Variable& local, DistSpec spec, ProcessGroup* pg) {
  ASSIGN_OR_RETURN(DistSpec norm, Normalize(spec, *pg, local.value().dim()));
  Shape global = local.value().shape();
  for (const auto& [axis, p] : norm.placements()) {
    if (p.kind != Placement::Kind::kShard) continue;
    for (size_t i = 0; i < p.dims.size(); ++i) global[p.dims[i]] *= p.num_partitions[i];
  }
  return ColoTensor(local, std::move(global), std::move(norm), pg);
}

absl::StatusOr<ColoTensor> ColoTensor::Redistribute(const DistSpec& target) const {
  ASSIGN_OR_RETURN(DistSpec to, Normalize(target, *pg_, static_cast<int64_t>(global_shape_.size())));
  // Check divisibility against the global shape before any communication.
  for (const auto& [axis, p] : to.placements()) {
    if (p.kind != Placement::Kind::kShard) continue;
    for (size_t i = 0; i < p.dims.size(); ++i) {
      if (global_shape_[p.dims[i]] % p.num_partitions[i] != 0) {
        return absl::InvalidArgumentError(absl::StrCat("shard on axis ", axis, ": dim ", p.dims[i], " of size ",
                                                       global_shape_[p.dims[i]], " is not divisible by ",
                                                       p.num_partitions[i]));
      }
    }
  }
  std::vector<std::string> axes;
  for (const auto& [axis, p] : spec_.placements()) axes.push_back(axis);
  for (const auto& [axis, p] : to.placements()) {
    if (std::find(axes.begin(), axes.end(), axis) == axes.end()) axes.push_back(axis);
  }
  // Gather/reduce first, then slice, so that a dim moving between axes is
  // whole when the new axis slices it.
  std::stable_sort(axes.begin(), axes.end(), [&](const std::string& a, const std::string& b) {
    auto rank_of = [&](const std::string& x) { return to.Get(x).kind == Placement::Kind::kShard ? 1 : 0; };
    return rank_of(a) < rank_of(b);
  });
  Variable local = local_;
  for (const std::string& axis : axes) {
    const Placement from = spec_.Get(axis), dest = to.Get(axis);
    if (from == dest) continue;
    ASSIGN_OR_RETURN(Communicator * comm, pg_->Comm(axis));
    ASSIGN_OR_RETURN(int k, pg_->LocalRank(axis));
    for (const auto& [a, b] : Steps(from, dest)) {
      ASSIGN_OR_RETURN(Tensor next, ConvertStep(local.value(), a, b, *comm, k, *pg_));
      ProcessGroup* pg = pg_;
      local = RecordOp(absl::StrCat("redistribute ", axis, " ", a.ToString(), "->", b.ToString()), {local},
                       std::move(next),
                       [a = a, b = b, comm, k, pg](const Tensor& g) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
                         ASSIGN_OR_RETURN(Tensor gi, BackwardStep(g, a, b, *comm, k, *pg));
                         return std::vector<std::optional<Tensor>>{gi};
                       });
    }
  }
  ColoTensor out(std::move(local), global_shape_, std::move(to), pg_);
  out.compute_pattern_ = compute_pattern_;
  return out;
}

absl::Status ColoTensor::SetDistSpec(const DistSpec& target) {
  ASSIGN_OR_RETURN(ColoTensor next, Redistribute(target));
  *this = std::move(next);
  return absl::OkStatus();
}

}  // namespace colod
