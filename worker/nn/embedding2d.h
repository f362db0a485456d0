// The token embedding of a 2D / 2.5D model and the LM head tied to it.
//
// The table [V, H] is split on H over tp_row and replicated over tp_col (and
// tp_dep): {tp_row: S(1)}. Ids [B, S] are split on the batch like every 2D
// activation (worker/nn/linear2d.h); a rank looks up its batch rows in its
// hidden columns, giving the activation block [B/q, S, H/q] with no
// communication. The tied head computes logits = h E^T: each rank's
// [B/q, S, V] is a partial sum over the hidden columns, all-reduced along
// the row group, so every rank of a row holds its batch block's full logits
// ({tp_col: S(0)}, replicated over tp_row). The table's gradient, summed
// over the batch blocks, is all-reduced over tp_col (and tp_dep).
//
// Thread-safety: used by one rank thread at a time.
#ifndef COLOD_WORKER_NN_EMBEDDING2D_H_
#define COLOD_WORKER_NN_EMBEDDING2D_H_

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"

namespace colod::nn {

class Embedding2D {
 public:
  static absl::StatusOr<Embedding2D> FromGlobal(const Tensor& table, ProcessGroup* pg);
  // The table's spec: [V, H] {tp_row: S(1)}.
  static absl::StatusOr<DistSpec> Spec(ProcessGroup* pg);
  static absl::StatusOr<Embedding2D> FromParameters(ColoParameter table, ProcessGroup* pg);
  // `ids` is the full [B, S] (every rank passes the same); INVALID_ARGUMENT
  // for an id outside the vocabulary, before any collective.
  absl::StatusOr<ColoTensor> Forward(const Tensor& ids) const;
  // Logits of the LM head tied to this table, for h in the 2D activation spec.
  absl::StatusOr<ColoTensor> TiedLogits(const ColoTensor& h) const;
  // The spec of the lookup's output and of the head's input.
  absl::StatusOr<DistSpec> ActivationSpec(int64_t ndim) const;
  const ColoParameter& weight() const { return weight_; }

 private:
  Embedding2D(ColoParameter w, ProcessGroup* pg) : weight_(std::move(w)), pg_(pg) {}
  ColoParameter weight_;
  ProcessGroup* pg_;
};

}  // namespace colod::nn

#endif  // COLOD_WORKER_NN_EMBEDDING2D_H_
