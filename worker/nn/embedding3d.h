// The token (and position) embedding of a 3D model and the LM head computed
// with its table.
//
// The table [V, H] is split on H over the residual stream's C axis
// (tp_weight; worker/nn/linear3d.h) and replicated over tp_output and K
// (tp_input): {tp_weight: S(1)}. Ids [B, S] come whole to every rank; a rank
// looks up its batch block (dim 0 split q*q ways, tp_output outer, K inner,
// as every 3D activation) in its hidden columns, which gives the stream's
// activation block [B/q^2, S, H/q] with no communication. The head computes
// logits = h E^T: each rank's [B/q^2, S, V] is a partial sum over the hidden
// blocks, all-reduced over C, so the q ranks of a C group hold their batch
// block's whole logits (rows split over tp_output and K, replicated over
// C). The table's gradient, one term per batch block, is summed over
// tp_output and K. The vocabulary is not split, so it needs no padding.
//
// Thread-safety: used by one rank thread at a time.
#ifndef COLOD_WORKER_NN_EMBEDDING3D_H_
#define COLOD_WORKER_NN_EMBEDDING3D_H_

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"

namespace colod::nn {

class Embedding3D {
 public:
  static absl::StatusOr<Embedding3D> FromGlobal(const Tensor& table, ProcessGroup* pg);
  // The table's spec: [V, H] {tp_weight: S(1)}.
  static absl::StatusOr<DistSpec> Spec(ProcessGroup* pg);
  static absl::StatusOr<Embedding3D> FromParameters(ColoParameter table, ProcessGroup* pg);
  // `ids` is the full [B, S] (every rank passes the same); INVALID_ARGUMENT
  // for an id outside the vocabulary or a batch that does not split q*q
  // ways, before any collective.
  absl::StatusOr<ColoTensor> Forward(const Tensor& ids) const;
  // The logits h E^T (of the LM head tied to this table, or of an untied
  // head held as a table) for h in any 3D activation spec (moved to the
  // stream's first).
  absl::StatusOr<ColoTensor> TiedLogits(const ColoTensor& h) const;
  // The spec of the lookup's output and of the head's input.
  absl::StatusOr<DistSpec> ActivationSpec(int64_t ndim) const;
  const ColoParameter& weight() const { return weight_; }

 private:
  Embedding3D(ColoParameter w, ProcessGroup* pg, int q) : weight_(std::move(w)), pg_(pg), q_(q) {}
  // The table with its gradient summed over tp_output and K.
  absl::StatusOr<Variable> Table() const;
  ColoParameter weight_;
  ProcessGroup* pg_;
  int q_;
};

}  // namespace colod::nn

#endif  // COLOD_WORKER_NN_EMBEDDING3D_H_
