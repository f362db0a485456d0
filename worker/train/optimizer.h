// Optimizers over a sharded model's parameters, global gradient-norm
// clipping and the learning-rate schedule.
//
// Each rank updates its own shards: the update is elementwise, so sharded
// parameters need no communication, and replicated ones stay equal because
// their gradients are (the layers sum them over the replicas). The global
// gradient norm counts every element of the model once: a shard on the ranks
// that hold it, a parameter replicated over some tp axes on the rank at
// coordinate 0 of those axes; the squares are then summed over the tp group
// (and the pp group: each stage counts its own parameters, a mirror none;
// under stages in the fixed order of NormOrder).
// Gradients are identical across dp replicas when it runs (after the dp
// reduction), so dp is not summed over, except under ZeRO, where each dp rank
// updates (and counts) its own partition of the gradients.
//
// ZeRO (stages 1 and 2): an optimizer may update only part of a parameter,
// a ParamSlice of its flattened local shard, with the state of that part
// only (GradSync says which parts, data_parallel.h).
//
// Thread-safety: an optimizer belongs to one rank thread.
#ifndef COLOD_WORKER_TRAIN_OPTIMIZER_H_
#define COLOD_WORKER_TRAIN_OPTIMIZER_H_

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "spec/job_validation.h"
#include "worker/shardformer/module.h"

namespace colod::train {

struct OptimizerOptions {
  enum class Kind { kAdamW, kSgd };
  Kind kind = Kind::kAdamW;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // AdamW
  double momentum = 0.9;                          // SGD
  // AdamW: decoupled (p -= lr * wd * p); SGD: added to the gradient (torch's).
  double weight_decay = 0.0;
};
// "adamw" or "sgd".
absl::StatusOr<OptimizerOptions::Kind> ParseOptimizer(const std::string& name);

// The part of parameter `param` (an index into the optimizer's parameters)
// one rank updates: elements [offset, offset + length) of its flattened
// local shard. `grad`, if set, is those elements' gradient kept apart from
// the parameter (ZeRO: the dp-reduced partition GradSync holds, 1-D of
// `length`); else the parameter's own gradient is read.
struct ParamSlice {
  int param = 0;
  int64_t offset = 0, length = 0;
  std::optional<Tensor> grad;
};
// What one rank's optimizer updates. `over_dp`: the slices partition the
// parameters over the dp group (ZeRO), so the gradient norm sums over dp,
// and a parameter kept whole on every dp rank is counted on dp rank 0 only.
struct Partition {
  std::vector<ParamSlice> slices;
  bool over_dp = false;
  // Every parameter whole, reading its own gradient (no ZeRO).
  static Partition Whole(const std::vector<shardformer::NamedParam>& params);
};

class Optimizer {
 public:
  // Parameters held in bf16 or f16 (mixed precision) get f32 master
  // weights: the update runs on them in f32 with f32 state, and the
  // parameters are then rounded from them. The state covers `partition`'s
  // slices only (default: every parameter whole).
  static absl::StatusOr<Optimizer> Create(std::vector<shardformer::NamedParam> params, OptimizerOptions options);
  static absl::StatusOr<Optimizer> Create(std::vector<shardformer::NamedParam> params, OptimizerOptions options,
                                          Partition partition);
  // One update with learning rate `lr` from the current gradients times
  // `grad_scale` (ClipFactor's; the gradients themselves are left as they
  // are), FAILED_PRECONDITION naming a parameter without one. AdamW is
  // torch.optim.AdamW, one fused multi-tensor step (ops::AdamW); SGD is
  // torch.optim.SGD with momentum (the first step's buffer is the gradient).
  absl::Status Step(double lr, double grad_scale = 1.0);
  // The same with the scale a one-element f32 tensor on the parameters'
  // device (ClipOnDevice's): AdamW reads it there, so nothing waits for the
  // device; SGD reads it on the host first.
  absl::Status Step(double lr, const Tensor& grad_scale_at);
  void ZeroGrad();
  int64_t steps() const { return steps_; }
  void set_steps(int64_t steps) { steps_ = steps; }

  // One state tensor (AdamW: exp_avg, exp_avg_sq; SGD: momentum_buffer;
  // "master" with mixed precision) of one slice, for checkpoints: named
  // "<param>.<state>" in the parameter's shape for a whole parameter, else
  // "<param>.<state>@<offset>", 1-D.
  struct StateTensor {
    std::string name;
    const shardformer::NamedParam* param;
    std::string state;
    int64_t offset = 0;
    Tensor value;
  };
  std::vector<StateTensor> State();
  // Parameter `param`'s weights in f32, its local shape, on its device: the
  // master copy where it is held in 16 bits (mixed precision: what the
  // updates run on, of which the parameter is a rounding), else the
  // parameter itself. With ZeRO the master copy's slices are spread over
  // dp: each rank's are summed over the dp group (zeros elsewhere, so the
  // sum is exact; a parameter kept whole on every dp rank needs none),
  // after the group agreed that every rank took its part (AgreeOverGroup):
  // collective over dp, every dp rank calling it for the same parameters in
  // the same order, and failing alike (a peer's failure is ABORTED, marked
  // IsPeerCaused). For the final model (TrainOptions::final_dtype).
  absl::StatusOr<Tensor> F32Weights(size_t param, ProcessGroup* pg) const;
  int64_t state_bytes() const;
  const std::vector<shardformer::NamedParam>& params() const { return params_; }
  const Partition& partition() const { return partition_; }
  // Slice i's gradient: its own (Partition) or the parameter's, viewed as
  // the slice. FAILED_PRECONDITION naming a parameter without one.
  absl::StatusOr<Tensor> SliceGrad(size_t i) const;

 private:
  absl::Status Step(double lr, double grad_scale, const std::optional<Tensor>& grad_scale_at);
  absl::Status SgdStep(Tensor& param, const Tensor& grad, Tensor& buffer, double lr);
  Optimizer(std::vector<shardformer::NamedParam> params, OptimizerOptions options, Partition partition)
      : params_(std::move(params)), options_(options), partition_(std::move(partition)) {}
  // `t` (of slice i's parameter's local shape) viewed as slice i: itself for
  // a whole parameter, else the slice's 1-D run of its flattened elements.
  absl::StatusOr<Tensor> SliceOf(size_t i, const Tensor& t) const;
  bool Whole(size_t i) const;
  std::vector<shardformer::NamedParam> params_;
  OptimizerOptions options_;
  Partition partition_;
  // Per slice: AdamW moments, or SGD momentum in m_; f32 copies of
  // low-precision weights (else empty tensors).
  std::vector<Tensor> m_, v_, master_;
  // Whether slice i's parameter is held in 16 bits (and so has a master copy).
  bool Mixed(size_t i) const {
    return params_[partition_.slices[i].param].bound.param.local().dtype() != DType::kF32;
  }
  int64_t steps_ = 0;
};

// The order a pipeline's gradient norm adds its parameters' squares in:
// one slot a parameter (a mirror has none) in a vector the same on every
// rank, the slots in the order of the parameters' names' hashes over the
// whole model, so the norm's bits do not depend on which stages hold which
// layers (interleaved 1F1B's norm is 1F1B's over the same layers).
// Empty without pipeline stages, where each rank sums its own into one
// number. Thread-safety: a plain value.
class NormOrder {
 public:
  // This rank's parameters' slots, from every pipeline stage's names
  // (hashed, all-gathered over the pp group through `device`, the rank's:
  // collective over it). INTERNAL if two names hash alike.
  static absl::StatusOr<NormOrder> Create(const std::vector<shardformer::NamedParam>& params, ProcessGroup* pg,
                                          const Device& device);
  bool empty() const { return size_ == 0; }
  int64_t size() const { return size_; }
  // The slot of this rank's parameter `name`; -1 for one it has none for.
  int64_t Slot(const std::string& name) const;

 private:
  std::map<std::string, int64_t> slots_;
  int64_t size_ = 0;
};

// The global L2 norm of the gradients (see the file comment), each
// parameter counted once: pipeline stages each count their own (a mirror
// not at all). Collective over the tp group of `pg`, and its pp group.
absl::StatusOr<double> GlobalGradNorm(const std::vector<shardformer::NamedParam>& params, ProcessGroup* pg);
// The same over the gradients `optimizer` reads (its partition's slices;
// with ZeRO summed over the dp group too). With a non-empty `order`, each
// parameter's squares go to its slot and the slots, reduced over the
// groups, are added in slot order (NormOrder).
absl::StatusOr<double> GlobalGradNorm(const Optimizer& optimizer, ProcessGroup* pg,
                                      const NormOrder* order = nullptr);
// torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6) when
// norm > max_norm > 0, else 1 (kernels/clip.h). Optimizer::Step scales the
// gradients by it as the fused update reads them.
double ClipFactor(double norm, double max_norm);
// GlobalGradNorm(optimizer, pg, order) and its ClipFactor computed where the
// gradients are, enqueued with no host read: the trainer's step passes
// `scale` to Optimizer::Step and reads `norm_and_scale` ([2] f32: the norm,
// rounded to f32, and ClipFactor's value rounded to f32, the bits the host
// passed as grad_scale) after the
// update is enqueued, so the device does not wait for the host between
// backward and the update. Collective as GlobalGradNorm; a failed all-reduce
// is seen by ProcessGroup::AsyncError once the host has read the norm.
// `loss_scale`: the gradients are the loss's scaled by it (fp16,
// LossScaler): the norm is theirs divided by it, and the factor unscales
// them too (ops::GradNormClip).
struct DeviceClip {
  Tensor norm_and_scale;
  Tensor scale;  // norm_and_scale's element 1
};
absl::StatusOr<DeviceClip> ClipOnDevice(const Optimizer& optimizer, double max_norm, ProcessGroup* pg,
                                        const NormOrder* order = nullptr, double loss_scale = 1.0);

// fp16 mixed precision's dynamic loss scale, torch.cuda.amp.GradScaler's
// rule: the backward starts from the loss times scale() so that small
// gradients stay above f16's smallest (6e-8) instead of flushing to zero;
// the update unscales them (ClipOnDevice). A step whose gradients overflowed
// (a norm that is not finite) updates nothing and halves the scale; after
// `window` steps in a row that did not, the scale doubles (at most kMax).
// Every rank decides alike: the norm is the global one. The scale is a
// power of two, so scaling and unscaling are exact. Unlike GradScaler, the
// scale stays in [1, 2^24]: an overflow at 1 is divergence (no scale keeps
// the gradients finite), not a halving below it.
// Thread-safety: a plain value, of one rank thread.
class LossScaler {
 public:
  static constexpr double kDefaultInitial = 65536;  // GradScaler's init_scale, 2^16
  static constexpr int64_t kDefaultWindow = 2000;   // its growth_interval
  static constexpr double kMax = kMaxLossScale;     // 2^24
  // INVALID_ARGUMENT unless `scale` is a power of two in [1, kMax], `window`
  // in [1, kMaxLossScaleWindow] and `good_steps` in [0, window).
  static absl::StatusOr<LossScaler> Create(double scale, int64_t window, int64_t good_steps = 0);
  double scale() const { return scale_; }
  int64_t window() const { return window_; }
  // Steps in a row whose gradients did not overflow since the scale last
  // changed (a checkpoint records it with the scale).
  int64_t good_steps() const { return good_steps_; }
  // After a step whose unscaled gradient norm is `norm`: whether its update
  // runs (the norm is finite), the scale then updated for the next step.
  // FAILED_PRECONDITION where the norm is not finite at a scale of 1: no
  // scale keeps the gradients finite (the run diverged).
  absl::StatusOr<bool> Update(double norm);

 private:
  LossScaler(double scale, int64_t window, int64_t good_steps)
      : scale_(scale), window_(window), good_steps_(good_steps) {}
  double scale_;
  int64_t window_;
  int64_t good_steps_;
};
// Scales every gradient by ClipFactor in place; returns the norm before
// clipping.
absl::StatusOr<double> ClipGradNorm(const std::vector<shardformer::NamedParam>& params, double max_norm,
                                    ProcessGroup* pg);

// Linear warm-up over `warmup` steps to `lr`, then cosine decay to `min_lr`
// at `total` steps (and `min_lr` after). `step` counts from 0.
double LearningRate(int64_t step, double lr, int64_t warmup, int64_t total, double min_lr);

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_OPTIMIZER_H_
