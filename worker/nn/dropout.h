// Dropout for tensor-parallel activations (ShardFormer's
// DropoutForParallelInput and DropoutForReplicatedInput), with counter-based
// masks (worker/tensor/ops.h) so that a mask depends only on (seed, offset):
//
//   parallel input    each tp rank holds a different shard, so each draws a
//                     different part of the stream (offset advanced by
//                     tp_rank * numel): masks differ across tp ranks.
//   replicated input  every tp rank holds the same tensor and draws the same
//                     part: masks are bitwise equal across tp ranks.
//
// Every call advances the layer's offset past what it drew, so successive
// calls (steps, micro-batches) get fresh masks; the sequence of masks is the
// same on every run with the same seed. Not thread-safe (one rank thread).
#ifndef COLOD_WORKER_NN_DROPOUT_H_
#define COLOD_WORKER_NN_DROPOUT_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"

namespace colod::nn {

class TensorParallelDropout {
 public:
  enum class Input { kParallel, kReplicated };
  // INVALID_ARGUMENT for p outside [0, 1).
  static absl::StatusOr<TensorParallelDropout> Create(float p, uint64_t seed, Input input);
  // The same spec out as in; in evaluation (train = false) the identity.
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x, bool train = true);
  uint64_t offset() const { return offset_; }

 private:
  TensorParallelDropout(float p, uint64_t seed, Input input) : p_(p), seed_(seed), input_(input) {}
  float p_;
  uint64_t seed_;
  Input input_;
  uint64_t offset_ = 0;
};

}  // namespace colod::nn

#endif  // COLOD_WORKER_NN_DROPOUT_H_
