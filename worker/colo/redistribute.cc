#include "worker/colo/redistribute.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/colo/tensor_collectives.h"

namespace colod {
namespace {

using K = Placement::Kind;

std::set<int64_t> ShardDims(const Placement& p) {
  if (p.kind != K::kShard) return {};
  return std::set<int64_t>(p.dims.begin(), p.dims.end());
}

bool Intersects(const std::set<int64_t>& a, const std::set<int64_t>& b) {
  for (int64_t x : a) {
    if (b.count(x)) return true;
  }
  return false;
}

int AxisPosition(const DeviceMesh& mesh, const std::string& axis) {
  auto idx = mesh.AxisIndices(axis);
  return idx.ok() ? idx->front() : static_cast<int>(mesh.axes().size());
}

int GroupSize(const Placement& p) {
  int n = 1;
  for (int64_t k : p.num_partitions) n *= static_cast<int>(k);
  return n;
}

// S(a|n) -> S(b|n) with a != b: every pair of blocks meets in equal pieces.
bool AllToAllable(const Placement& from, const Placement& to) {
  return from.kind == K::kShard && to.kind == K::kShard && from.dims.size() == 1 && to.dims.size() == 1 &&
         from.dims[0] != to.dims[0] && from.num_partitions[0] == to.num_partitions[0];
}

struct Edge {
  Collective collective;
  double cost;  // in units of B, the axis-level bytes
};

// The single step from -> to on an axis of n ranks, if there is one.
std::optional<Edge> Direct(const Placement& from, const Placement& to, int n) {
  const double frac = n > 0 ? static_cast<double>(n - 1) / n : 0;
  if (from == to) return std::nullopt;
  if (n == 1) return Edge{Collective::kNone, 0};  // one rank: every placement holds the whole tensor
  if (from.kind == K::kReplicate) return Edge{Collective::kNone, 0};  // slice or keep
  if (to.kind == K::kReplicate) {
    return from.kind == K::kShard ? Edge{Collective::kAllGather, frac} : Edge{Collective::kAllReduce, 2 * frac};
  }
  if (from.kind == K::kPartial && to.kind == K::kShard) return Edge{Collective::kReduceScatter, frac};
  if (AllToAllable(from, to)) return Edge{Collective::kAllToAll, frac / n};
  return std::nullopt;
}

absl::StatusOr<Tensor> GatherShards(const Tensor& local, const Placement& from, Communicator& comm,
                                    absl::Duration timeout) {
  ASSIGN_OR_RETURN(std::vector<Tensor> pieces, AllGatherPieces(local, comm, timeout));
  Shape full = local.shape();
  for (size_t i = 0; i < from.dims.size(); ++i) full[from.dims[i]] *= from.num_partitions[i];
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(full, local.dtype(), local.device()));
  for (int j = 0; j < comm.size(); ++j) {
    ASSIGN_OR_RETURN(Tensor slot, ShardBlock(out, from, j));
    RETURN_IF_ERROR(slot.CopyFrom(pieces[j]));
  }
  return out;
}

// S(a|n) -> S(b|n): rank k sends the j-th piece of its block along b to rank
// j, and places the piece from rank k at block k along a.
absl::StatusOr<Tensor> AllToAllShards(const Tensor& local, const Placement& from, const Placement& to,
                                      Communicator& comm, absl::Duration timeout) {
  const int n = comm.size();
  const int64_t a = from.dims[0], b = to.dims[0];
  std::vector<Tensor> pieces;
  for (int j = 0; j < n; ++j) {
    ASSIGN_OR_RETURN(Tensor piece, local.Chunk(b, n, j));
    ASSIGN_OR_RETURN(piece, piece.Reshape({piece.numel()}));
    pieces.push_back(std::move(piece));
  }
  ASSIGN_OR_RETURN(Tensor send, Tensor::Cat(pieces, 0));
  ASSIGN_OR_RETURN(Tensor recv, Tensor::Empty(send.shape(), send.dtype(), send.device()));
  const int64_t count = send.numel() / n;
  RETURN_IF_ERROR(comm.AllToAll(send.raw_data(), recv.raw_data(), count, send.dtype())->Wait(timeout));
  ASSIGN_OR_RETURN(Tensor first, local.Chunk(b, n, 0));
  const Shape piece_shape = first.shape();
  Shape out_shape = piece_shape;
  out_shape[a] *= n;
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(out_shape, local.dtype(), local.device()));
  for (int k = 0; k < n; ++k) {
    ASSIGN_OR_RETURN(Tensor piece, recv.Narrow(0, k * count, count));
    ASSIGN_OR_RETURN(piece, piece.Reshape(piece_shape));
    ASSIGN_OR_RETURN(Tensor slot, out.Chunk(a, n, k));
    RETURN_IF_ERROR(slot.CopyFrom(piece));
  }
  return out;
}

absl::StatusOr<Tensor> Convert(const Tensor& local, const Placement& from, const Placement& to,
                               Communicator& comm, int local_rank, absl::Duration timeout) {
  if (from == to) return local;
  RETURN_IF_ERROR(CheckBackend(local, comm));
  if (from.kind == K::kReplicate && to.kind == K::kShard) {
    ASSIGN_OR_RETURN(Tensor block, ShardBlock(local, to, local_rank));
    return block.TryContiguous();
  }
  if (from.kind == K::kShard && to.kind == K::kReplicate) return GatherShards(local, from, comm, timeout);
  if (from.kind == K::kPartial && to.kind == K::kReplicate) {
    ASSIGN_OR_RETURN(Tensor out, local.TryClone());
    RETURN_IF_ERROR(comm.AllReduce(out.raw_data(), out.numel(), out.dtype(), from.op)->WaitOnDevice(timeout));
    return out;
  }
  if (from.kind == K::kPartial && to.kind == K::kShard) {
    // Block k of the reduction lands on rank k.
    std::vector<Tensor> blocks;
    for (int j = 0; j < comm.size(); ++j) {
      ASSIGN_OR_RETURN(Tensor b, ShardBlock(local, to, j));
      blocks.push_back(std::move(b));
    }
    return ReduceScatterBlocks(blocks, comm, timeout, from.op);
  }
  if (from.kind == K::kReplicate && to.kind == K::kPartial) {
    // A sum of the group's operands must equal the value: rank 0 keeps it.
    // Avg, max and min of identical copies are the value itself.
    if (to.op == ReduceOp::kSum && local_rank != 0) return Tensor::Zeros(local.shape(), local.dtype(), local.device());
    return local.TryClone();
  }
  if (AllToAllable(from, to)) return AllToAllShards(local, from, to, comm, timeout);
  return absl::InternalError(absl::StrCat("no direct conversion ", from.ToString(), " -> ", to.ToString()));
}

}  // namespace

const char* CollectiveName(Collective c) {
  switch (c) {
    case Collective::kNone: return "local";
    case Collective::kAllGather: return "all_gather";
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllToAll: return "all_to_all";
  }
  return "?";
}

std::string RedistributeStep::ToString() const {
  return absl::StrCat(axis, ": ", from.ToString(), " -> ", to.ToString(), " ", CollectiveName(collective), " ",
                      bytes_per_rank, " B");
}

absl::StatusOr<DistSpec> NormalizeSpec(const DistSpec& spec, const DeviceMesh& mesh, int64_t ndim) {
  DistSpec out;
  std::map<int, std::string> owner;  // mesh axis index -> spec axis using it
  for (const auto& [axis, p] : spec.placements()) {
    auto size = mesh.AxisSize(axis);
    if (!size.ok()) return absl::InvalidArgumentError(std::string(size.status().message()));
    const std::vector<int> indices = *mesh.AxisIndices(axis);
    for (int i : indices) {
      auto [it, fresh] = owner.emplace(i, axis);
      if (!fresh) {
        return absl::InvalidArgumentError(
            absl::StrCat("axes ", it->second, " and ", axis, " overlap; place the tensor on one of them"));
      }
    }
    Placement q = p;
    if (p.kind == K::kShard) {
      if (p.dims.empty() || p.dims.size() != p.num_partitions.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "shard on axis ", axis, ": dims and num_partitions must be non-empty and equal in length"));
      }
      std::set<int64_t> seen;
      int64_t product = 1;
      for (size_t i = 0; i < p.dims.size(); ++i) {
        const int64_t d = p.dims[i];
        if (d < -ndim || d >= ndim) {
          return absl::InvalidArgumentError(
              absl::StrCat("shard on axis ", axis, ": dim ", d, " is out of range for a ", ndim, "-d tensor"));
        }
        q.dims[i] = d < 0 ? d + ndim : d;
        if (!seen.insert(q.dims[i]).second) {
          return absl::InvalidArgumentError(
              absl::StrCat("shard on axis ", axis, ": dim ", q.dims[i], " is listed twice"));
        }
        if (p.num_partitions[i] < 1) {
          return absl::InvalidArgumentError(absl::StrCat("shard on axis ", axis, ": num_partitions must be >= 1"));
        }
        // Never past the axis size: a product that wrapped could match it.
        if (p.num_partitions[i] > *size / product) {
          return absl::InvalidArgumentError(absl::StrCat("shard on axis ", axis,
                                                         ": num_partitions multiply to more than the axis's ", *size,
                                                         " ranks"));
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

absl::Status CheckDivisible(const DistSpec& spec, const Shape& global) {
  std::map<int64_t, int64_t> parts;
  for (const auto& [axis, p] : spec.placements()) {
    if (p.kind != K::kShard) continue;
    for (size_t i = 0; i < p.dims.size(); ++i) {
      int64_t& total = parts.emplace(p.dims[i], 1).first->second;
      total *= p.num_partitions[i];
      if (global[p.dims[i]] % total != 0) {
        return absl::InvalidArgumentError(absl::StrCat("shard on axis ", axis, ": dim ", p.dims[i], " of size ",
                                                       global[p.dims[i]], " is not divisible by ", total));
      }
    }
  }
  return absl::OkStatus();
}

Shape LocalShape(const DistSpec& spec, const Shape& global) {
  Shape local = global;
  for (const auto& [axis, p] : spec.placements()) {
    if (p.kind != K::kShard) continue;
    for (size_t i = 0; i < p.dims.size(); ++i) local[p.dims[i]] /= p.num_partitions[i];
  }
  return local;
}

std::vector<std::string> AxesInMeshOrder(const DistSpec& spec, const DeviceMesh& mesh) {
  std::vector<std::string> axes;
  for (const auto& [axis, p] : spec.placements()) axes.push_back(axis);
  std::stable_sort(axes.begin(), axes.end(), [&](const std::string& a, const std::string& b) {
    return AxisPosition(mesh, a) < AxisPosition(mesh, b);
  });
  return axes;
}

absl::StatusOr<std::vector<RedistributeStep>> PlanRedistribute(const DistSpec& from, const DistSpec& to,
                                                               const Shape& global, DType dtype,
                                                               const DeviceMesh& mesh) {
  DistSpec all = from;
  for (const auto& [axis, p] : to.placements()) {
    if (!from.Has(axis)) all.Set(axis, Placement::Replicate());
  }
  const std::vector<std::string> axes = AxesInMeshOrder(all, mesh);
  DistSpec cur = from;
  std::vector<RedistributeStep> plan;

  // Appends the single step a -> b on `axis` with its cost at the current layout.
  auto emit = [&](const std::string& axis, const Placement& a, const Placement& b, const Edge& e) {
    const int64_t local_bytes = NumElements(LocalShape(cur, global)) * static_cast<int64_t>(SizeOf(dtype));
    const int64_t axis_bytes = a.kind == K::kShard ? local_bytes * GroupSize(a) : local_bytes;
    plan.push_back({axis, a, b, e.collective, static_cast<int64_t>(e.cost * static_cast<double>(axis_bytes))});
    cur.Set(axis, b);
  };
  // The cheaper of the direct step and the route through R.
  auto convert = [&](const std::string& axis, const Placement& a, const Placement& b) -> absl::Status {
    if (a == b) return absl::OkStatus();
    const int n = *mesh.AxisSize(axis);
    const std::optional<Edge> direct = Direct(a, b, n);
    std::optional<Edge> first, second;
    if (a.kind != K::kReplicate && b.kind != K::kReplicate) {
      first = Direct(a, Placement::Replicate(), n);
      second = Direct(Placement::Replicate(), b, n);
    }
    const bool via_r = first && second;
    if (direct && (!via_r || direct->cost <= first->cost + second->cost)) {
      emit(axis, a, b, *direct);
    } else if (via_r) {
      emit(axis, a, Placement::Replicate(), *first);
      emit(axis, Placement::Replicate(), b, *second);
    } else {
      return absl::InternalError(absl::StrCat("no route ", a.ToString(), " -> ", b.ToString()));
    }
    return absl::OkStatus();
  };
  auto touched = [&](const std::string& axis) {
    std::set<int64_t> d = ShardDims(cur.Get(axis));
    for (int64_t x : ShardDims(to.Get(axis))) d.insert(x);
    return d;
  };

  // Phase 1, innermost axis first: finish conversions that need no slicing
  // of a whole tensor, and gather what is in the way.
  for (int i = static_cast<int>(axes.size()) - 1; i >= 0; --i) {
    const std::string& x = axes[i];
    const Placement f = cur.Get(x), t = to.Get(x);
    bool in_the_way = false;  // x shards a dim that a changing outer axis touches
    for (int j = 0; j < i; ++j) {
      if (!(cur.Get(axes[j]) == to.Get(axes[j])) && Intersects(ShardDims(f), touched(axes[j]))) in_the_way = true;
    }
    if (in_the_way) {
      RETURN_IF_ERROR(convert(x, f, Placement::Replicate()));
      continue;
    }
    if (f == t || f.kind == K::kReplicate) continue;  // settled, or a slice for phase 2
    if (t.kind != K::kShard) {
      RETURN_IF_ERROR(convert(x, f, t));
      continue;
    }
    bool alone = true;  // no other axis shards the dims this move touches
    for (const std::string& y : axes) {
      if (y != x && Intersects(touched(x), touched(y))) alone = false;
    }
    RETURN_IF_ERROR(convert(x, f, alone ? t : Placement::Replicate()));
  }
  // Phase 2, outermost axis first: slice (every axis left to convert is R).
  for (const std::string& x : axes) RETURN_IF_ERROR(convert(x, cur.Get(x), to.Get(x)));
  return plan;
}

absl::StatusOr<Tensor> RunStep(const Tensor& local, const RedistributeStep& step, Communicator& comm,
                               int local_rank, absl::Duration timeout) {
  // The backend check comes first: a tensor on the wrong device is an error
  // even where a group of one has nothing to move.
  RETURN_IF_ERROR(CheckBackend(local, comm));
  if (comm.size() == 1) return local;
  return Convert(local, step.from, step.to, comm, local_rank, timeout);
}

absl::StatusOr<Tensor> RunStepBackward(const Tensor& grad, const RedistributeStep& step, Communicator& comm,
                                       int local_rank, absl::Duration timeout) {
  const Placement& from = step.from;
  const Placement& to = step.to;
  if (comm.size() == 1) return grad;
  if (to.kind == K::kPartial) return grad;  // R -> P: identity
  if (from.kind == K::kPartial) {
    if (to.kind == K::kReplicate) return grad;                                           // P -> R: identity
    return Convert(grad, to, Placement::Replicate(), comm, local_rank, timeout);         // P -> S: all-gather
  }
  return Convert(grad, to, from, comm, local_rank, timeout);  // R <-> S, S -> S': the reverse step
}

}  // namespace colod
