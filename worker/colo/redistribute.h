// Planning and running DistSpec conversions (the engine behind
// ColoTensor::Redistribute).
//
// A spec places a tensor on each named mesh axis. When several axes shard the
// same dim they nest in mesh order: the outermost axis takes the coarsest
// split (with {dp: S(0|2), tp: S(0|2)} on a dp=2, tp=2 mesh, dp picks a half
// of dim 0 and tp a quarter inside it, so rank r holds quarter r).
//
// One axis converts by these steps; the cost is the bytes a rank sends with
// ring algorithms, B being the tensor's size at the axis' level (its local
// size with that axis' shards undone):
//
//   R -> S     local slice           0
//   R -> P     keep on local rank 0  0          (sum; avg/max/min keep all)
//   S -> R     all-gather            (n-1)/n B
//   P -> R     all-reduce            2(n-1)/n B
//   P -> S     reduce-scatter        (n-1)/n B
//   S(a) -> S(b)  all-to-all         (n-1)/n^2 B  (one dim each, a != b)
//
// Any other pair (S -> P, P -> P', S -> S' that is not a one-dim move) goes
// through R, and where both a direct step and the route through R exist the
// cheaper one is taken. Across axes, gathers run innermost axis first and
// slices outermost first, so that nesting stays correct; an axis that shards
// a dim another axis is about to change is gathered first and re-sliced after.
#ifndef COLOD_WORKER_COLO_REDISTRIBUTE_H_
#define COLOD_WORKER_COLO_REDISTRIBUTE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/colo/dist_spec.h"
#include "spec/mesh.h"
#include "worker/comm/communicator.h"
#include "worker/tensor/tensor.h"

namespace colod {

enum class Collective { kNone, kAllGather, kAllReduce, kReduceScatter, kAllToAll };
// "local", "all_gather", "all_reduce", "reduce_scatter", "all_to_all".
const char* CollectiveName(Collective c);

// One conversion step on one axis.
struct RedistributeStep {
  std::string axis;
  Placement from;
  Placement to;
  Collective collective = Collective::kNone;
  int64_t bytes_per_rank = 0;  // estimated bytes each rank sends
  std::string ToString() const;  // "tp: S(0|4) -> S(1|4) all_to_all 96 B"
};

// `spec` checked against `mesh` for a tensor of rank `ndim`, with negative
// dims made positive. INVALID_ARGUMENT for an unknown axis, two axes that
// overlap (tp and tp_row), a dim out of range or listed twice in one shard,
// or partitions that do not multiply to the axis size.
absl::StatusOr<DistSpec> NormalizeSpec(const DistSpec& spec, const DeviceMesh& mesh, int64_t ndim);
// INVALID_ARGUMENT naming the dim, its size and the degree when `global`
// cannot be split as a normalized `spec` says (nested shards multiply).
absl::Status CheckDivisible(const DistSpec& spec, const Shape& global);
// The local shape of each rank under a normalized spec.
Shape LocalShape(const DistSpec& spec, const Shape& global);
// The axes of a normalized spec in mesh order, outermost first.
std::vector<std::string> AxesInMeshOrder(const DistSpec& spec, const DeviceMesh& mesh);

// The steps from normalized `from` to normalized `to` for a tensor of shape
// `global`, in execution order. Empty when the specs are equal.
absl::StatusOr<std::vector<RedistributeStep>> PlanRedistribute(const DistSpec& from, const DistSpec& to,
                                                               const Shape& global, DType dtype,
                                                               const DeviceMesh& mesh);

// Runs one step on this rank's local tensor; `comm` is the rank's group along
// the step's axis and `local_rank` its index there. Every collective waits at
// most `timeout`.
absl::StatusOr<Tensor> RunStep(const Tensor& local, const RedistributeStep& step, Communicator& comm,
                               int local_rank, absl::Duration timeout);
// The gradient of a step's input from the gradient of its output: the
// reverse collective (S -> R: slice, R -> S: all-gather, P -> R and R -> P:
// identity, P -> S: all-gather, S(a) -> S(b): all-to-all back).
absl::StatusOr<Tensor> RunStepBackward(const Tensor& grad, const RedistributeStep& step, Communicator& comm,
                                       int local_rank, absl::Duration timeout);

}  // namespace colod

#endif  // COLOD_WORKER_COLO_REDISTRIBUTE_H_
