// Distributed specs: how a ColoTensor's payload is laid out on each mesh axis.
#ifndef COLOD_WORKER_COLO_DIST_SPEC_H_
#define COLOD_WORKER_COLO_DIST_SPEC_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/tensor/tensor.h"

namespace colod {

// The placement of a tensor along one mesh axis.
//  Replicate: every rank of the group holds the whole (axis-level) tensor.
//  Shard(dims, num_partitions): dims[i] is split evenly into num_partitions[i]
//    parts; the product of the parts is the group size, and local rank k holds
//    block k in row-major block order (the last listed dim varies fastest).
//  Partial(op): every rank holds an operand of a pending reduction.
struct Placement {
  enum class Kind { kReplicate, kShard, kPartial };
  Kind kind = Kind::kReplicate;
  std::vector<int64_t> dims;
  std::vector<int64_t> num_partitions;
  ReduceOp op = ReduceOp::kSum;

  static Placement Replicate() { return Placement(); }
  static Placement Shard(std::vector<int64_t> dims, std::vector<int64_t> num_partitions);
  static Placement Partial(ReduceOp op = ReduceOp::kSum);
  bool operator==(const Placement& o) const;
  std::string ToString() const;  // "R", "S(0,1|2,2)", "P(sum)"
};

// A placement per named axis; axes not listed are Replicate.
class DistSpec {
 public:
  DistSpec() = default;
  static DistSpec Replicate() { return DistSpec(); }
  DistSpec& Set(const std::string& axis, Placement p);
  // The placement on `axis` (Replicate if unset).
  Placement Get(const std::string& axis) const;
  bool Has(const std::string& axis) const;
  const std::vector<std::pair<std::string, Placement>>& placements() const { return placements_; }
  std::string ToString() const;

 private:
  std::vector<std::pair<std::string, Placement>> placements_;
};

// Block helpers for Shard placements.
// Row-major block coordinates of block `index` for `num_partitions`.
std::vector<int64_t> BlockCoordinates(int64_t index, const std::vector<int64_t>& num_partitions);
// A view of block `index` of `t` under Shard(dims, num_partitions).
// INVALID_ARGUMENT naming the dim, its size and the degree when indivisible.
absl::StatusOr<Tensor> ShardBlock(const Tensor& t, const Placement& shard, int64_t index);

}  // namespace colod

#endif  // COLOD_WORKER_COLO_DIST_SPEC_H_
