#include "worker/tensor/autograd.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace colod {

struct AutogradNode {
  std::string name;
  int64_t sequence = 0;  // recording order on its thread
  std::vector<std::shared_ptr<Variable::Impl>> inputs;
  BackwardFn backward;         // one of the three
  FoldingBackwardFn folding;
  OfferTakingBackwardFn taking;
  std::optional<GeluGradOffer> offer;  // RecordOfferingOp's
};

struct Variable::Impl {
  Tensor value;
  bool requires_grad = false;
  std::optional<Tensor> grad;
  std::optional<Tensor> grad_storage;  // leaves: where grad lives, if set
  std::shared_ptr<AutogradNode> node;  // null for leaves
  std::function<void()> grad_ready;    // leaves: called when Backward completes grad
};

struct AutogradAccess {
  static const std::shared_ptr<Variable::Impl>& impl(const Variable& v) { return v.impl_; }
  static Variable Make(std::shared_ptr<Variable::Impl> impl) {
    Variable v;
    v.impl_ = std::move(impl);
    return v;
  }
};

namespace {
thread_local bool grad_enabled = true;
thread_local int64_t next_sequence = 0;
}  // namespace

Variable::Variable() : Variable(Tensor(), false) {}
Variable::Variable(Tensor value, bool requires_grad) : impl_(std::make_shared<Impl>()) {
  impl_->value = std::move(value);
  impl_->requires_grad = requires_grad;
}
const Tensor& Variable::value() const { return impl_->value; }
bool Variable::requires_grad() const { return impl_->requires_grad; }
bool Variable::is_leaf() const { return impl_->node == nullptr; }
std::optional<Tensor> Variable::grad() const { return impl_->grad; }
void Variable::ZeroGrad() { impl_->grad.reset(); }
absl::Status Variable::SetGradStorage(std::optional<Tensor> storage) {
  if (storage.has_value()) {
    const Tensor& v = impl_->value;
    if (storage->shape() != v.shape() || storage->dtype() != v.dtype() || !storage->is_contiguous() ||
        !(storage->device() == v.device())) {
      return absl::InvalidArgumentError(absl::StrCat("gradient storage ", DTypeName(storage->dtype()),
                                                     ShapeToString(storage->shape()), " for a parameter ",
                                                     DTypeName(v.dtype()), ShapeToString(v.shape())));
    }
  }
  // A new storage starts empty; dropping one leaves a gradient already
  // taken where it is (a view keeps its buffer alive).
  if (storage.has_value()) impl_->grad.reset();
  impl_->grad_storage = std::move(storage);
  return absl::OkStatus();
}
void Variable::SetGradReadyHook(std::function<void()> hook) { impl_->grad_ready = std::move(hook); }
std::string Variable::op_name() const { return impl_->node ? impl_->node->name : ""; }

NoGradScope::NoGradScope() : previous_(grad_enabled) { grad_enabled = false; }
NoGradScope::~NoGradScope() { grad_enabled = previous_; }
bool GradEnabled() { return grad_enabled; }
EnableGradScope::EnableGradScope() : previous_(grad_enabled) { grad_enabled = true; }
EnableGradScope::~EnableGradScope() { grad_enabled = previous_; }

namespace {

Variable Record(std::string name, const std::vector<Variable>& inputs, Tensor output, BackwardFn backward,
                FoldingBackwardFn folding, OfferTakingBackwardFn taking = nullptr,
                std::optional<GeluGradOffer> offer = std::nullopt) {
  Variable out(std::move(output), false);
  const bool needs = grad_enabled && std::any_of(inputs.begin(), inputs.end(),
                                                 [](const Variable& v) { return v.requires_grad(); });
  if (!needs) return out;
  auto node = std::make_shared<AutogradNode>();
  node->name = std::move(name);
  node->sequence = next_sequence++;
  for (const Variable& v : inputs) node->inputs.push_back(AutogradAccess::impl(v));
  node->backward = std::move(backward);
  node->folding = std::move(folding);
  node->taking = std::move(taking);
  node->offer = std::move(offer);
  auto& impl = AutogradAccess::impl(out);
  impl->requires_grad = true;
  impl->node = std::move(node);
  return out;
}

}  // namespace

Variable RecordOp(std::string name, const std::vector<Variable>& inputs, Tensor output, BackwardFn backward) {
  return Record(std::move(name), inputs, std::move(output), std::move(backward), nullptr);
}

Variable RecordFoldingOp(std::string name, const std::vector<Variable>& inputs, Tensor output,
                         FoldingBackwardFn backward) {
  return Record(std::move(name), inputs, std::move(output), nullptr, std::move(backward));
}

Variable RecordOfferingOp(std::string name, const std::vector<Variable>& inputs, Tensor output, BackwardFn backward,
                          GeluGradOffer offer) {
  return Record(std::move(name), inputs, std::move(output), std::move(backward), nullptr, nullptr, std::move(offer));
}

Variable RecordOfferTakingOp(std::string name, const std::vector<Variable>& inputs, Tensor output,
                             OfferTakingBackwardFn backward) {
  return Record(std::move(name), inputs, std::move(output), nullptr, nullptr, std::move(backward));
}

absl::Status Backward(const Variable& root, float seed) {
  if (root.value().numel() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("Backward needs a scalar root or an explicit gradient; the root has shape ",
                                                   ShapeToString(root.value().shape())));
  }
  ASSIGN_OR_RETURN(Tensor one, Tensor::FromFloats(root.value().shape(), {seed}, root.value().dtype()));
  if (seed != 1.0f && one.ToFloats() != std::vector<float>{seed}) {
    return absl::InvalidArgumentError(absl::StrCat("a backward seeded with ", seed, " needs a root that holds it, not ",
                                                   DTypeName(root.value().dtype())));
  }
  ASSIGN_OR_RETURN(one, one.To(root.value().device()));
  return Backward(root, one);
}

absl::Status Backward(const Variable& root, const Tensor& grad) {
  if (grad.shape() != root.value().shape()) {
    return absl::InvalidArgumentError(absl::StrCat("gradient shape ", ShapeToString(grad.shape()),
                                                   " differs from the root's ", ShapeToString(root.value().shape())));
  }
  if (!root.requires_grad()) return absl::FailedPreconditionError("the root does not require grad");
  using ImplPtr = std::shared_ptr<Variable::Impl>;
  // Collect the graph behind the root, then visit its nodes from the newest.
  std::map<Variable::Impl*, Tensor> grads;
  std::map<int64_t, ImplPtr, std::greater<int64_t>> pending;  // node sequence -> the Variable it produced
  std::set<Variable::Impl*> seen;
  std::vector<ImplPtr> stack = {AutogradAccess::impl(root)};
  while (!stack.empty()) {
    ImplPtr v = stack.back();
    stack.pop_back();
    if (!seen.insert(v.get()).second) continue;
    if (v->node) {
      pending[v->node->sequence] = v;
      for (const ImplPtr& in : v->node->inputs) stack.push_back(in);
    }
  }
  // For each leaf that requires grad, how many recorded ops consume it: its
  // gradient is complete once they have all run (or been skipped).
  std::map<Variable::Impl*, int> consumers;
  for (Variable::Impl* v : seen) {
    if (!v->node && v->requires_grad) consumers[v] = 0;
  }
  // For each output of an offering op, how many of those ops consume it:
  // its offer may be taken only by the one.
  std::map<Variable::Impl*, int> offer_uses;
  for (const auto& [seq, v] : pending) {
    std::set<Variable::Impl*> distinct;
    for (const ImplPtr& in : v->node->inputs) distinct.insert(in.get());
    for (Variable::Impl* in : distinct) {
      auto c = consumers.find(in);
      if (c != consumers.end()) ++c->second;
      if (in->node && in->node->offer) ++offer_uses[in];
    }
  }
  std::set<Variable::Impl*> taken;  // whose gradient came through their op's offer
  ASSIGN_OR_RETURN(grads[AutogradAccess::impl(root).get()], grad.TryClone());
  auto finish_leaf = [&](Variable::Impl* v) -> absl::Status {
    auto it = grads.find(v);
    if (it != grads.end()) {
      if (v->grad) {
        RETURN_IF_ERROR(AddInPlace(*v->grad, it->second));
      } else if (v->grad_storage && v->grad_storage->dtype() == it->second.dtype() &&
                 v->grad_storage->shape() == it->second.shape()) {
        RETURN_IF_ERROR(v->grad_storage->CopyFrom(it->second));
        v->grad = *v->grad_storage;
      } else if (it->second.IsSoleHandle()) {
        // A fresh gradient no other tensor shares (a GEMM's, a bias
        // gradient's): kept as it is. Without a flat buffer (dp = 1) this
        // was a copy of every parameter's gradient each step.
        v->grad = std::move(it->second);
      } else {  // it may be another leaf's too, or a view of a larger tensor
        ASSIGN_OR_RETURN(v->grad, it->second.TryClone());  // contiguous
      }
      grads.erase(it);
    }
    if (v->grad_ready) v->grad_ready();
    return absl::OkStatus();
  };
  auto accumulate = [&](const ImplPtr& v, Tensor g) -> absl::Status {
    auto it = grads.find(v.get());
    if (it == grads.end()) {
      grads.emplace(v.get(), std::move(g));
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(it->second, Add(it->second, g));
    return absl::OkStatus();
  };
  // Leaves complete in the order of the op's inputs (never of addresses), so
  // every rank runs the hooks in the same order.
  auto consumed = [&](const AutogradNode& node) -> absl::Status {
    std::set<Variable::Impl*> distinct;
    for (const ImplPtr& in : node.inputs) {
      if (!distinct.insert(in.get()).second) continue;
      auto c = consumers.find(in.get());
      if (c != consumers.end() && --c->second == 0) RETURN_IF_ERROR(finish_leaf(in.get()));
    }
    return absl::OkStatus();
  };
  for (const auto& [seq, v] : pending) {
    auto it = grads.find(v.get());
    const AutogradNode& node = *v->node;
    if (it == grads.end()) {  // nothing flows into this op
      RETURN_IF_ERROR(consumed(node));
      continue;
    }
    // A folding backward sees input 0's gradient so far (a leaf's too: it
    // is still in `grads` until its consumers have all run).
    bool folded = false;
    absl::StatusOr<std::vector<std::optional<Tensor>>> in_grads;
    if (node.folding) {
      const Tensor* so_far = nullptr;
      if (!node.inputs.empty() && node.inputs[0]->requires_grad) {
        auto p = grads.find(node.inputs[0].get());
        if (p != grads.end()) so_far = &p->second;
      }
      absl::StatusOr<FoldedGrads> f = node.folding(it->second, so_far);
      if (f.ok()) {
        folded = so_far != nullptr && f->folded;
        in_grads = std::move(f->grads);
      } else {
        in_grads = f.status();
      }
    } else if (node.taking) {
      // The offer of input 0's op, where this op alone consumes input 0
      // and names it once (so nothing else gives it a gradient: the root
      // has no consumer behind it).
      const GeluGradOffer* offer = nullptr;
      const ImplPtr* in0 = node.inputs.empty() ? nullptr : &node.inputs[0];
      if (in0 != nullptr && (*in0)->requires_grad && (*in0)->node && (*in0)->node->offer &&
          offer_uses[in0->get()] == 1 && std::count(node.inputs.begin(), node.inputs.end(), *in0) == 1) {
        offer = &*(*in0)->node->offer;
      }
      absl::StatusOr<OfferedGrads> t = node.taking(it->second, offer);
      if (t.ok()) {
        if (t->taken && offer == nullptr) {
          return absl::InternalError(absl::StrCat("backward of ", node.name, " took an offer it was not given"));
        }
        if (t->taken && (t->grads.empty() || !t->grads[0].has_value())) {
          return absl::InternalError(absl::StrCat("backward of ", node.name, " took an offer and gave no gradient"));
        }
        if (t->taken) taken.insert(in0->get());
        in_grads = std::move(t->grads);
      } else {
        in_grads = t.status();
      }
    } else if (taken.count(v.get()) > 0) {  // the gradient at its GELU's input
      in_grads = node.offer->backward(it->second);
    } else {
      in_grads = node.backward(it->second);
    }
    if (!in_grads.ok()) {
      return absl::Status(in_grads.status().code(),
                          absl::StrCat("backward of ", node.name, ": ", in_grads.status().message()));
    }
    if (folded && (in_grads->empty() || !(*in_grads)[0].has_value())) {
      return absl::InternalError(absl::StrCat("backward of ", node.name, " folded no gradient into its input"));
    }
    if (in_grads->size() != node.inputs.size()) {
      return absl::InternalError(absl::StrCat("backward of ", node.name, " returned ", in_grads->size(),
                                              " gradients for ", node.inputs.size(), " inputs"));
    }
    for (size_t i = 0; i < node.inputs.size(); ++i) {
      if (!(*in_grads)[i] || !node.inputs[i]->requires_grad) continue;
      if (i == 0 && folded) {  // the sum, in place of what was there
        grads[node.inputs[0].get()] = *std::move((*in_grads)[0]);
        continue;
      }
      // Moved: the map's handle is then a fresh gradient's only one.
      RETURN_IF_ERROR(accumulate(node.inputs[i], *std::move((*in_grads)[i])));
    }
    grads.erase(it);  // this op's output gradient is spent
    RETURN_IF_ERROR(consumed(node));
  }
  // A leaf root (no op consumes it) completes last.
  for (auto& [v, count] : consumers) {
    if (count == 0 && grads.count(v)) RETURN_IF_ERROR(finish_leaf(v));
  }
  return absl::OkStatus();
}

absl::StatusOr<Variable> Add(const Variable& a, const Variable& b) {
  ASSIGN_OR_RETURN(Tensor out, Add(a.value(), b.value()));
  return RecordOp("add", {a, b}, std::move(out), [](const Tensor& g) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
    return std::vector<std::optional<Tensor>>{g, g};
  });
}

absl::StatusOr<Variable> Sub(const Variable& a, const Variable& b) {
  ASSIGN_OR_RETURN(Tensor out, Sub(a.value(), b.value()));
  return RecordOp("sub", {a, b}, std::move(out), [](const Tensor& g) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
    ASSIGN_OR_RETURN(Tensor neg, Scale(g, -1.0f));
    return std::vector<std::optional<Tensor>>{g, neg};
  });
}

absl::StatusOr<Variable> Mul(const Variable& a, const Variable& b) {
  ASSIGN_OR_RETURN(Tensor out, Mul(a.value(), b.value()));
  Tensor av = a.value(), bv = b.value();
  return RecordOp("mul", {a, b}, std::move(out), [av, bv](const Tensor& g) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
    ASSIGN_OR_RETURN(Tensor ga, Mul(g, bv));
    ASSIGN_OR_RETURN(Tensor gb, Mul(g, av));
    return std::vector<std::optional<Tensor>>{ga, gb};
  });
}

absl::StatusOr<Variable> Scale(const Variable& a, float s) {
  ASSIGN_OR_RETURN(Tensor out, Scale(a.value(), s));
  return RecordOp("scale", {a}, std::move(out), [s](const Tensor& g) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
    ASSIGN_OR_RETURN(Tensor ga, Scale(g, s));
    return std::vector<std::optional<Tensor>>{ga};
  });
}

absl::StatusOr<Variable> Sum(const Variable& a) {
  // On a's device in both directions: a loss summed on a GPU is not read back.
  ASSIGN_OR_RETURN(Tensor out, SumToTensor(a.value()));
  const Shape shape = a.value().shape();
  const DType dtype = a.value().dtype();
  return RecordOp("sum", {a}, std::move(out), [shape, dtype](const Tensor& g) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
    ASSIGN_OR_RETURN(Tensor ga, BroadcastScalar(g, shape, dtype));
    return std::vector<std::optional<Tensor>>{ga};
  });
}

}  // namespace colod
