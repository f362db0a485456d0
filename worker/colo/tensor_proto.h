// Conversions between the runtime's tensors and specs and their colod.v1
// wire form (tensor.proto, mesh.proto), for the TensorService.
//
// Thread-safety: free functions.
#ifndef COLOD_WORKER_COLO_TENSOR_PROTO_H_
#define COLOD_WORKER_COLO_TENSOR_PROTO_H_

#include <string>

#include "absl/status/statusor.h"
#include "colod/v1/mesh.pb.h"
#include "colod/v1/tensor.pb.h"
#include "worker/colo/colo_tensor.h"
#include "worker/colo/dist_spec.h"
#include "spec/mesh.h"
#include "worker/tensor/tensor.h"

namespace colod {

// INVALID_ARGUMENT naming `field` for an unspecified or unknown dtype.
absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, const std::string& field = "dtype");
v1::DType DTypeToProto(DType dtype);

// INVALID_ARGUMENT naming `field` for a value outside the enum (unspecified
// is kNone).
absl::StatusOr<ComputePattern> ComputePatternFromProto(v1::ComputePattern pattern,
                                                       const std::string& field = "compute_pattern");
v1::ComputePattern ComputePatternToProto(ComputePattern pattern);

// INVALID_ARGUMENT naming the field for a shard without dims, dims and
// num_partitions of different lengths, a partition < 1, an axis named twice
// or an unspecified placement. Axis names are checked against a mesh later.
absl::StatusOr<DistSpec> DistSpecFromProto(const v1::DistSpec& spec, const std::string& field = "dist_spec");
v1::DistSpec DistSpecToProto(const DistSpec& spec);

// INVALID_ARGUMENT when the data is not product(shape) * sizeof(dtype) bytes.
absl::StatusOr<Tensor> TensorFromProto(const v1::TensorValue& value, const std::string& field = "value");
// A host copy of `t` (any device), row-major.
absl::StatusOr<v1::TensorValue> TensorToProto(const Tensor& t);

// Every rank's block of a tensor of shape `global` under `spec` on `mesh`
// (a Partial placement leaves the whole tensor on each rank, marked partial).
absl::StatusOr<v1::TensorLayout> DescribeLayout(const std::string& name, DType dtype, const Shape& global,
                                                const DistSpec& spec, const DeviceMesh& mesh);

}  // namespace colod

#endif  // COLOD_WORKER_COLO_TENSOR_PROTO_H_
