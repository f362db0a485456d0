// Reverse-mode autograd over Tensors.
//
// Each differentiable op records a node (its inputs and a backward function)
// when grad mode is on and an input requires grad. Backward(root) replays the
// recorded nodes that lead to `root` in reverse recording order (the tape),
// so every rank running the same program calls the backward collectives of
// communication ops in the same order, and accumulates gradients into the
// leaves that require grad (repeated Backward calls add up, as in PyTorch).
//
// Thread-safety: recording order and grad mode are per thread (each rank
// thread has its own tape); a Variable must not be used from two threads at
// once.
#ifndef COLOD_WORKER_TENSOR_AUTOGRAD_H_
#define COLOD_WORKER_TENSOR_AUTOGRAD_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/tensor/tensor.h"

namespace colod {

struct AutogradNode;

class Variable {
 public:
  Variable();
  explicit Variable(Tensor value, bool requires_grad = false);

  const Tensor& value() const;
  bool requires_grad() const;
  // True for a Variable no op produced (a parameter or input).
  bool is_leaf() const;
  // The gradient accumulated by Backward, for leaves that require grad.
  std::optional<Tensor> grad() const;
  void ZeroGrad();
  // For a leaf: where its gradient lives (a contiguous tensor of its shape
  // and dtype, e.g. a view into a data-parallel bucket, as DDP's
  // gradient_as_bucket_view). Backward copies the first gradient into it
  // instead of allocating one and adds later ones in place; grad() is then
  // that view. Setting one clears the gradient; ZeroGrad keeps the storage;
  // nullopt goes back to allocating (a gradient already there stays).
  // INVALID_ARGUMENT for a view of another shape, dtype or device.
  absl::Status SetGradStorage(std::optional<Tensor> storage);
  // For a leaf: called by Backward on its thread as soon as this leaf's
  // gradient is complete (accumulated into grad()), while the rest of the
  // graph is still being differentiated; data-parallel training starts
  // reducing gradients from here. Called once per Backward that reaches the
  // leaf, even when no gradient flowed to it.
  void SetGradReadyHook(std::function<void()> hook);
  // The name of the op that produced this Variable ("" for a leaf).
  std::string op_name() const;

  struct Impl;  // opaque; defined in autograd.cc

 private:
  friend struct AutogradAccess;
  std::shared_ptr<Impl> impl_;
};

// Returns the gradient for each input given the output's gradient; an entry
// may be nullopt for an input that gets none.
using BackwardFn =
    std::function<absl::StatusOr<std::vector<std::optional<Tensor>>>(const Tensor& grad_output)>;

// Wraps `output` = op(inputs) into a Variable, recording `backward` when grad
// mode is on and some input requires grad.
Variable RecordOp(std::string name, const std::vector<Variable>& inputs, Tensor output, BackwardFn backward);

// A backward that may add its first input's gradient so far into the one it
// returns for that input, in its own kernel rather than Backward's add (a
// norm's input: the residual stream, whose skip connection's gradient
// arrives first). `pending` is what the ops after this one gave input 0
// (null: nothing yet); `folded` says the returned gradient for input 0
// includes it, and Backward then takes that gradient in its place instead
// of adding the two. A fold must give the bits of Add(*pending, gradient).
struct FoldedGrads {
  std::vector<std::optional<Tensor>> grads;
  bool folded = false;
};
using FoldingBackwardFn =
    std::function<absl::StatusOr<FoldedGrads>(const Tensor& grad_output, const Tensor* pending)>;
Variable RecordFoldingOp(std::string name, const std::vector<Variable>& inputs, Tensor output,
                         FoldingBackwardFn backward);

// What an op ending in the tanh-approximated GELU (an MLP's up projection
// with GELU in its GEMM's epilogue) offers the one op that consumes its
// output: to take that output's gradient already through GELU's derivative
// at `pre`, GELU's input, which the consumer applies in its own kernel (its
// input gradient's GEMM: ops::MatMulGeluBackward), so that GELU's backward
// is no pass of its own. `backward` is then the op's backward, given the
// gradient at GELU's input instead of at its output.
struct GeluGradOffer {
  Tensor pre;
  BackwardFn backward;
};
// RecordOp with the offer.
Variable RecordOfferingOp(std::string name, const std::vector<Variable>& inputs, Tensor output, BackwardFn backward,
                          GeluGradOffer offer);
// A backward that may take the offer of the op producing its first input:
// `offer` is that op's where this op is the only one the backward reaches
// that consumes the input, and takes it once (null otherwise); `taken` says
// the gradient returned for input 0 is through the offer's derivative, and
// Backward then gives it to the offer's backward in place of the op's own.
struct OfferedGrads {
  std::vector<std::optional<Tensor>> grads;
  bool taken = false;
};
using OfferTakingBackwardFn =
    std::function<absl::StatusOr<OfferedGrads>(const Tensor& grad_output, const GeluGradOffer* offer)>;
Variable RecordOfferTakingOp(std::string name, const std::vector<Variable>& inputs, Tensor output,
                             OfferTakingBackwardFn backward);

// Back-propagates from a scalar (one element) root with gradient `seed`:
// 1, or fp16 training's loss scale (train::LossScaler), which the root's
// dtype must hold exactly (INVALID_ARGUMENT otherwise).
absl::Status Backward(const Variable& root, float seed = 1.0f);
// Back-propagates `grad` (same shape as root) from any root.
absl::Status Backward(const Variable& root, const Tensor& grad);

// While alive, ops on this thread record nothing (evaluation, optimizer steps).
class NoGradScope {
 public:
  NoGradScope();
  ~NoGradScope();
  NoGradScope(const NoGradScope&) = delete;
  NoGradScope& operator=(const NoGradScope&) = delete;

 private:
  bool previous_;
};
bool GradEnabled();
// While alive, ops on this thread record again (inside a NoGradScope: the
// recomputed forward of activation recomputation, run during a Backward).
class EnableGradScope {
 public:
  EnableGradScope();
  ~EnableGradScope();
  EnableGradScope(const EnableGradScope&) = delete;
  EnableGradScope& operator=(const EnableGradScope&) = delete;

 private:
  bool previous_;
};

// Differentiable elementwise ops and the full sum.
absl::StatusOr<Variable> Add(const Variable& a, const Variable& b);
absl::StatusOr<Variable> Sub(const Variable& a, const Variable& b);
absl::StatusOr<Variable> Mul(const Variable& a, const Variable& b);
absl::StatusOr<Variable> Scale(const Variable& a, float s);
// A one-element f32 tensor of shape [] holding the sum of all elements.
absl::StatusOr<Variable> Sum(const Variable& a);

}  // namespace colod

#endif  // COLOD_WORKER_TENSOR_AUTOGRAD_H_
