// ColoTensor: a global tensor whose payload is distributed over a process
// group mesh according to a DistSpec (ColossalAI's ColoTensor; Partial as in
// DTensor). Each rank holds its local shard; conversions between specs run
// the collectives of DESIGN.md section 3, planned by cost in
// worker/colo/redistribute.h (all-to-all for S(a) -> S(b), reduce-scatter
// for P -> S, nested shards of one dim across axes).
//
// Every conversion step is an autograd op when the local Variable requires
// grad; its backward runs the reverse collective (DESIGN.md's table):
// R -> S backward all-gather, S -> R backward slice, P -> R backward identity,
// P -> S backward all-gather, R -> P backward identity, S(a) -> S(b) backward
// all-to-all S(b) -> S(a).
#ifndef COLOD_WORKER_COLO_COLO_TENSOR_H_
#define COLOD_WORKER_COLO_COLO_TENSOR_H_

#include "absl/status/statusor.h"
#include "worker/colo/dist_spec.h"
#include "worker/colo/process_group.h"
#include "worker/colo/redistribute.h"
#include "worker/tensor/autograd.h"
#include "worker/tensor/tensor.h"

namespace colod {

// The compute pattern a parameter is used with (picks the layer kernels).
enum class ComputePattern { kNone, kTP1D, kTP2D, kTP2P5D, kTP3D };

// How a tensor is used in compute (ColossalAI's ComputeSpec): `pattern` names
// the parallel algorithm of the layer that owns the parameter. The layers set
// it; the TensorService reports it (TensorLayout.compute_pattern).
struct ComputeSpec {
  ComputePattern pattern = ComputePattern::kNone;
};

// A handle; not thread-safe for concurrent mutation (SetDistSpec).
class ColoTensor {
 public:
  // This rank's shard of `global` under `spec` (a local slice; no
  // communication). INVALID_ARGUMENT for a spec that does not fit the mesh or
  // the shape (naming the dim and the degree).
  // The shard is a new leaf (it requires grad if `requires_grad`).
  static absl::StatusOr<ColoTensor> FromGlobal(const Tensor& global, DistSpec spec, ProcessGroup* pg,
                                               bool requires_grad = false);
  // `local` is this rank's shard under `spec`; the global shape follows.
  static absl::StatusOr<ColoTensor> FromLocal(const Tensor& local, DistSpec spec, ProcessGroup* pg);
  // As above, keeping `local`'s place in the autograd graph.
  static absl::StatusOr<ColoTensor> FromLocal(const Variable& local, DistSpec spec, ProcessGroup* pg);

  const Tensor& local() const { return local_.value(); }
  const Variable& variable() const { return local_; }
  const Shape& global_shape() const { return global_shape_; }
  const DistSpec& spec() const { return spec_; }
  ProcessGroup* process_group() const { return pg_; }
  const ComputeSpec& compute_spec() const { return compute_spec_; }
  void set_compute_spec(ComputeSpec c) { compute_spec_ = c; }

  // The same global tensor under `target`. Collective: every rank of the
  // affected groups must call it.
  absl::StatusOr<ColoTensor> Redistribute(const DistSpec& target) const;
  // The steps Redistribute(target) would run, with their estimated bytes.
  absl::StatusOr<std::vector<RedistributeStep>> Plan(const DistSpec& target) const;
  absl::StatusOr<ColoTensor> ToReplicate() const { return Redistribute(DistSpec::Replicate()); }
  // Redistribute in place.
  absl::Status SetDistSpec(const DistSpec& target);

 private:
  ColoTensor(Variable local, Shape global_shape, DistSpec spec, ProcessGroup* pg)
      : local_(std::move(local)), global_shape_(std::move(global_shape)), spec_(std::move(spec)), pg_(pg) {}

  Variable local_;
  Shape global_shape_;
  DistSpec spec_;
  ProcessGroup* pg_;
  ComputeSpec compute_spec_;
};

// A ColoTensor that a module owns and an optimizer updates.
class ColoParameter : public ColoTensor {
 public:
  explicit ColoParameter(ColoTensor t, std::string name = "") : ColoTensor(std::move(t)), name_(std::move(name)) {}
  // This rank's shard of the full `value` under `spec`, requiring grad, used
  // with `compute`. INVALID_ARGUMENT (as FromGlobal's) prefixed with `name`.
  static absl::StatusOr<ColoParameter> Create(const Tensor& value, DistSpec spec, ProcessGroup* pg, std::string name,
                                              ComputeSpec compute);
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

// This rank's block of a tensor of shape `global` under `spec`: the start
// and length along each dim (nested shards narrow axis by axis in mesh
// order). INVALID_ARGUMENT for a spec that does not fit the mesh or shape,
// or that holds Partial.
struct Block {
  std::vector<int64_t> starts;
  std::vector<int64_t> lengths;
};
absl::StatusOr<Block> LocalBlock(const DistSpec& spec, const Shape& global, ProcessGroup* pg);
// The block of rank `rank` of `mesh`.
absl::StatusOr<Block> LocalBlock(const DistSpec& spec, const Shape& global, const DeviceMesh& mesh, int rank);

// OK when `t`'s spec is `want` (normalized on t's mesh and rank);
// INVALID_ARGUMENT naming `what` and both specs otherwise.
absl::Status CheckSpec(const ColoTensor& t, const DistSpec& want, const std::string& what);

}  // namespace colod

#endif  // COLOD_WORKER_COLO_COLO_TENSOR_H_
