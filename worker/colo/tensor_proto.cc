#include "worker/colo/tensor_proto.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "common/int_math.h"
#include "common/status_macros.h"
#include "worker/colo/colo_tensor.h"

namespace colod {

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, const std::string& field) {
  switch (dtype) {
    case v1::DTYPE_F32: return DType::kF32;
    case v1::DTYPE_BF16: return DType::kBF16;
    case v1::DTYPE_F16: return DType::kF16;
    case v1::DTYPE_I32: return DType::kI32;
    case v1::DTYPE_I64: return DType::kI64;
    default:
      return absl::InvalidArgumentError(absl::StrCat(field, ": required (F32, BF16, F16, I32 or I64)"));
  }
}

v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kF32: return v1::DTYPE_F32;
    case DType::kBF16: return v1::DTYPE_BF16;
    case DType::kF16: return v1::DTYPE_F16;
    case DType::kI32: return v1::DTYPE_I32;
    case DType::kI64: return v1::DTYPE_I64;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<ComputePattern> ComputePatternFromProto(v1::ComputePattern pattern, const std::string& field) {
  switch (pattern) {
    case v1::COMPUTE_PATTERN_UNSPECIFIED: return ComputePattern::kNone;
    case v1::COMPUTE_PATTERN_TP1D: return ComputePattern::kTP1D;
    case v1::COMPUTE_PATTERN_TP2D: return ComputePattern::kTP2D;
    case v1::COMPUTE_PATTERN_TP2P5D: return ComputePattern::kTP2P5D;
    case v1::COMPUTE_PATTERN_TP3D: return ComputePattern::kTP3D;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": unknown value ", static_cast<int>(pattern), " (TP1D, TP2D, TP2P5D or TP3D)"));
  }
}

v1::ComputePattern ComputePatternToProto(ComputePattern pattern) {
  switch (pattern) {
    case ComputePattern::kNone: return v1::COMPUTE_PATTERN_UNSPECIFIED;
    case ComputePattern::kTP1D: return v1::COMPUTE_PATTERN_TP1D;
    case ComputePattern::kTP2D: return v1::COMPUTE_PATTERN_TP2D;
    case ComputePattern::kTP2P5D: return v1::COMPUTE_PATTERN_TP2P5D;
    case ComputePattern::kTP3D: return v1::COMPUTE_PATTERN_TP3D;
  }
  return v1::COMPUTE_PATTERN_UNSPECIFIED;
}

namespace {

ReduceOp ReduceOpFromProto(v1::ReduceOp op) {
  switch (op) {
    case v1::REDUCE_OP_AVG: return ReduceOp::kAvg;
    case v1::REDUCE_OP_MAX: return ReduceOp::kMax;
    case v1::REDUCE_OP_MIN: return ReduceOp::kMin;
    default: return ReduceOp::kSum;
  }
}

v1::ReduceOp ReduceOpToProto(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAvg: return v1::REDUCE_OP_AVG;
    case ReduceOp::kMax: return v1::REDUCE_OP_MAX;
    case ReduceOp::kMin: return v1::REDUCE_OP_MIN;
    case ReduceOp::kSum: break;
  }
  return v1::REDUCE_OP_SUM;
}

}  // namespace

absl::StatusOr<DistSpec> DistSpecFromProto(const v1::DistSpec& proto, const std::string& field) {
  DistSpec spec;
  std::set<std::string> seen;
  for (int i = 0; i < proto.placements_size(); ++i) {
    const v1::AxisPlacement& ap = proto.placements(i);
    const std::string where = absl::StrCat(field, ".placements[", i, "]");
    if (ap.axis().empty()) return absl::InvalidArgumentError(absl::StrCat(where, ".axis: required"));
    if (!seen.insert(ap.axis()).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".axis: '", ap.axis(), "' is placed twice"));
    }
    const v1::Placement& p = ap.placement();
    switch (p.kind_case()) {
      case v1::Placement::kReplicate:
        spec.Set(ap.axis(), Placement::Replicate());
        break;
      case v1::Placement::kShard: {
        const v1::Shard& s = p.shard();
        if (s.dims_size() == 0 || s.dims_size() != s.num_partitions_size()) {
          return absl::InvalidArgumentError(absl::StrCat(
              where, ".placement.shard: needs as many num_partitions as dims (at least one), got ", s.dims_size(),
              " dims and ", s.num_partitions_size(), " num_partitions"));
        }
        std::vector<int64_t> dims(s.dims().begin(), s.dims().end());
        std::vector<int64_t> parts(s.num_partitions().begin(), s.num_partitions().end());
        for (int64_t n : parts) {
          if (n < 1) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ".placement.shard.num_partitions: must be >= 1, got ", n));
          }
        }
        spec.Set(ap.axis(), Placement::Shard(std::move(dims), std::move(parts)));
        break;
      }
      case v1::Placement::kPartial:
        if (!v1::ReduceOp_IsValid(p.partial().op())) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ".placement.partial.op: unknown value ", static_cast<int>(p.partial().op())));
        }
        spec.Set(ap.axis(), Placement::Partial(ReduceOpFromProto(p.partial().op())));
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(where, ".placement: one of replicate, shard, partial"));
    }
  }
  return spec;
}

v1::DistSpec DistSpecToProto(const DistSpec& spec) {
  v1::DistSpec out;
  for (const auto& [axis, p] : spec.placements()) {
    v1::AxisPlacement& ap = *out.add_placements();
    ap.set_axis(axis);
    switch (p.kind) {
      case Placement::Kind::kReplicate:
        ap.mutable_placement()->mutable_replicate();
        break;
      case Placement::Kind::kShard:
        for (int64_t d : p.dims) ap.mutable_placement()->mutable_shard()->add_dims(static_cast<int32_t>(d));
        for (int64_t n : p.num_partitions) {
          ap.mutable_placement()->mutable_shard()->add_num_partitions(static_cast<int32_t>(n));
        }
        break;
      case Placement::Kind::kPartial:
        ap.mutable_placement()->mutable_partial()->set_op(ReduceOpToProto(p.op));
        break;
    }
  }
  return out;
}

absl::StatusOr<Tensor> TensorFromProto(const v1::TensorValue& value, const std::string& field) {
  ASSIGN_OR_RETURN(DType dtype, DTypeFromProto(value.dtype(), field + ".dtype"));
  Shape shape(value.shape().begin(), value.shape().end());
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat(field, ".shape: negative size ", d));
  }
  const std::optional<int64_t> bytes = CheckedBytes(shape, static_cast<int64_t>(SizeOf(dtype)));
  if (!bytes.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shape: ", ShapeToString(shape), " of ", DTypeName(dtype), " is too large"));
  }
  const int64_t want = *bytes;
  if (static_cast<int64_t>(value.data().size()) != want) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data: ", value.data().size(), " bytes, but shape ",
                                                   ShapeToString(shape), " of ", DTypeName(dtype), " needs ", want));
  }
  return Tensor::FromBytes(shape, dtype, value.data());
}

absl::StatusOr<v1::TensorValue> TensorToProto(const Tensor& t) {
  ASSIGN_OR_RETURN(Tensor host, t.To(Device::Cpu()));
  ASSIGN_OR_RETURN(host, host.TryContiguous());
  v1::TensorValue out;
  out.set_dtype(DTypeToProto(host.dtype()));
  for (int64_t d : host.shape()) out.add_shape(d);
  out.set_data(static_cast<const char*>(host.raw_data()), static_cast<size_t>(host.nbytes()));
  return out;
}

absl::StatusOr<v1::TensorLayout> DescribeLayout(const std::string& name, DType dtype, const Shape& global,
                                                const DistSpec& spec, const DeviceMesh& mesh) {
  v1::TensorLayout layout;
  layout.set_name(name);
  layout.set_dtype(DTypeToProto(dtype));
  for (int64_t d : global) layout.add_global_shape(d);
  *layout.mutable_dist_spec() = DistSpecToProto(spec);
  // A Partial axis holds whole-tensor summands: its blocks are those of Replicate.
  DistSpec blocks;
  bool partial = false;
  for (const auto& [axis, p] : spec.placements()) {
    partial = partial || p.kind == Placement::Kind::kPartial;
    blocks.Set(axis, p.kind == Placement::Kind::kPartial ? Placement::Replicate() : p);
  }
  for (int r = 0; r < mesh.world_size(); ++r) {
    ASSIGN_OR_RETURN(Block b, LocalBlock(blocks, global, mesh, r));
    v1::ShardLayout& s = *layout.add_shards();
    s.set_rank(r);
    for (int64_t l : b.lengths) s.add_shape(l);
    for (int64_t o : b.starts) s.add_offsets(o);
    s.set_partial(partial);
  }
  return layout;
}

}  // namespace colod
