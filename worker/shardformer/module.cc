#include "worker/shardformer/module.h"

#include <algorithm>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace colod::shardformer {

const char* KindName(LayerDecl::Kind kind) {
  switch (kind) {
    case LayerDecl::Kind::kLinear: return "Linear";
    case LayerDecl::Kind::kConv1D: return "Conv1D";
    case LayerDecl::Kind::kEmbedding: return "Embedding";
    case LayerDecl::Kind::kLayerNorm: return "LayerNorm";
    case LayerDecl::Kind::kRmsNorm: return "RMSNorm";
    case LayerDecl::Kind::kBias: return "Bias";
    case LayerDecl::Kind::kParameter: return "Parameter";
    case LayerDecl::Kind::kPatchEmbedding: return "PatchEmbedding";
  }
  return "?";
}

std::unique_ptr<Module> Module::Leaf(LayerDecl decl) {
  auto m = std::make_unique<Module>(KindName(decl.kind), nullptr);
  m->decl_ = std::move(decl);
  return m;
}

Module* Module::Add(const std::string& name, std::unique_ptr<Module> child) {
  children_.emplace_back(name, std::move(child));
  return children_.back().second.get();
}

bool Module::Remove(const std::string& name) {
  for (auto it = children_.begin(); it != children_.end(); ++it) {
    if (it->first == name) {
      children_.erase(it);
      return true;
    }
  }
  return false;
}

std::vector<Module*> Module::Children() {
  std::vector<Module*> out;
  for (auto& [name, child] : children_) out.push_back(child.get());
  return out;
}

std::vector<std::string> Module::ChildNames() const {
  std::vector<std::string> out;
  for (const auto& [name, child] : children_) out.push_back(name);
  return out;
}

Module* Module::Find(const std::string& path) {
  Module* m = this;
  if (path.empty()) return m;
  for (absl::string_view part : absl::StrSplit(path, '.')) {
    Module* next = nullptr;
    for (auto& [name, child] : m->children_) {
      if (name == part) next = child.get();
    }
    if (next == nullptr) return nullptr;
    m = next;
  }
  return m;
}

absl::StatusOr<Module*> Module::Get(const std::string& path) {
  Module* m = Find(path);
  if (m == nullptr) return absl::NotFoundError(absl::StrCat(cls_, " has no submodule ", path));
  return m;
}

std::vector<std::pair<std::string, Module*>> Module::Modules() {
  std::vector<std::pair<std::string, Module*>> out = {{"", this}};
  for (auto& [name, child] : children_) {
    for (auto& [path, m] : child->Modules()) {
      out.emplace_back(path.empty() ? name : absl::StrCat(name, ".", path), m);
    }
  }
  return out;
}

absl::StatusOr<double> Module::Attr(const std::string& name) const {
  auto it = attrs_.find(name);
  if (it == attrs_.end()) return absl::NotFoundError(absl::StrCat(cls_, " has no attribute ", name));
  return it->second;
}

absl::StatusOr<int64_t> Module::IntAttr(const std::string& name) const {
  ASSIGN_OR_RETURN(double v, Attr(name));
  if (v != std::floor(v)) {
    return absl::InvalidArgumentError(absl::StrCat(cls_, ".", name, " = ", v, " is not a whole number"));
  }
  return static_cast<int64_t>(v);
}

absl::StatusOr<ColoTensor> Module::Forward(const ColoTensor& x) {
  if (decl_.has_value()) {
    if (layer_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(cls_, " ", decl_->prefix, " has no weights loaded"));
    }
    if (pass_through_ != nullptr) {
      *pass_through_ = x;
      return x;
    }
    return layer_->Forward(x);
  }
  if (!forward_) return absl::FailedPreconditionError(absl::StrCat(cls_, " has no forward"));
  return forward_(*this, x);
}

absl::StatusOr<ColoTensor> Module::Forward(const ColoTensor& x, const ColoTensor& context) {
  if (!cross_forward_) return absl::FailedPreconditionError(absl::StrCat(cls_, " takes one input"));
  return cross_forward_(*this, x, context);
}

absl::StatusOr<ColoTensor> Module::Call(const std::string& path, const ColoTensor& x) {
  ASSIGN_OR_RETURN(Module * m, Get(path));
  return m->Forward(x);
}

namespace {

absl::StatusOr<ColoTensor> ApplyEpilogue(const ColoTensor& y, nn::Epilogue epilogue) {
  if (epilogue == nn::Epilogue::kNone) return y;
  return MapLocal(y, [epilogue](const Variable& v) { return nn::BiasEpilogue(v, std::nullopt, epilogue); });
}

}  // namespace

absl::StatusOr<ColoTensor> Layer::ForwardWithEpilogue(const ColoTensor& x, nn::Epilogue epilogue) {
  ASSIGN_OR_RETURN(ColoTensor y, Forward(x));
  return ApplyEpilogue(y, epilogue);
}

absl::StatusOr<Layer::WithSum> Layer::ForwardResidual(const ColoTensor& x, const ColoTensor& residual) {
  ASSIGN_OR_RETURN(ColoTensor sum, AddActivations(x, residual));
  ASSIGN_OR_RETURN(ColoTensor y, Forward(sum));
  return WithSum{std::move(sum), std::move(y)};
}

absl::StatusOr<Layer::WithSum> Module::CallResidual(const std::string& path, const ColoTensor& x,
                                                    const ColoTensor& residual) {
  ASSIGN_OR_RETURN(Module * m, Get(path));
  if (!m->decl_.has_value() || m->layer_ == nullptr) {
    ASSIGN_OR_RETURN(ColoTensor sum, AddActivations(x, residual));
    ASSIGN_OR_RETURN(ColoTensor y, m->Forward(sum));
    return Layer::WithSum{std::move(sum), std::move(y)};
  }
  return m->layer_->ForwardResidual(x, residual);
}

absl::StatusOr<ColoTensor> Module::Forward(const ColoTensor& x, nn::Epilogue epilogue) {
  if (decl_.has_value() && layer_ != nullptr && pass_through_ == nullptr) {
    return layer_->ForwardWithEpilogue(x, epilogue);
  }
  ASSIGN_OR_RETURN(ColoTensor y, Forward(x));
  return ApplyEpilogue(y, epilogue);
}

absl::StatusOr<ColoTensor> Module::Call(const std::string& path, const ColoTensor& x, nn::Epilogue epilogue) {
  ASSIGN_OR_RETURN(Module * m, Get(path));
  return m->Forward(x, epilogue);
}

LayerDecl LayerDecl::Of(Kind kind, std::string prefix, int64_t in, int64_t out, bool bias, float eps) {
  LayerDecl d;
  d.kind = kind;
  d.prefix = std::move(prefix);
  d.in = in;
  d.out = out;
  d.bias = bias;
  d.eps = eps;
  return d;
}

namespace {

// `block`'s forward of x, recomputed in the backward (RunSequential).
absl::StatusOr<ColoTensor> ForwardRecomputed(Module& block, const ColoTensor& x) {
  absl::StatusOr<ColoTensor> ran;
  {
    NoGradScope no_tape;  // nothing inside the block is kept
    ran = block.Forward(x);
  }
  if (!ran.ok()) return ran.status();
  const ColoTensor& out = *ran;
  const Tensor input = x.local();
  const DistSpec spec = x.spec();
  ProcessGroup* pg = x.process_group();
  Module* m = &block;  // the model outlives its tape
  Variable y = RecordOp(
      "recompute(" + block.cls() + ")", {x.variable()}, out.local(),
      [m, input, spec, pg](const Tensor& dy) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
        EnableGradScope tape;
        Variable in(input, /*requires_grad=*/true);
        ASSIGN_OR_RETURN(ColoTensor again, ColoTensor::FromLocal(in, spec, pg));
        ASSIGN_OR_RETURN(ColoTensor redone, m->Forward(again));
        if (!redone.variable().requires_grad()) {
          return absl::InternalError(absl::StrCat("the recomputed ", m->cls(), " recorded nothing"));
        }
        RETURN_IF_ERROR(Backward(redone.variable(), dy));
        return std::vector<std::optional<Tensor>>{in.grad()};
      });
  ASSIGN_OR_RETURN(ColoTensor result, ColoTensor::FromLocal(y, out.spec(), out.process_group()));
  result.set_compute_spec(out.compute_spec());
  return result;
}

}  // namespace

absl::StatusOr<ColoTensor> RunSequential(Module& list, ColoTensor x) {
  const Recompute mode = list.recompute();
  const bool full = mode == Recompute::kFull && GradEnabled() && x.variable().requires_grad();
  for (Module* m : list.Children()) {
    if (full) {
      ASSIGN_OR_RETURN(x, ForwardRecomputed(*m, x));
    } else if (mode == Recompute::kSelective) {
      nn::RecomputeScoresScope scores;
      ASSIGN_OR_RETURN(x, m->Forward(x));
    } else {
      ASSIGN_OR_RETURN(x, m->Forward(x));
    }
  }
  return x;
}

absl::StatusOr<ColoTensor> PositionIds(const ColoTensor& ids, int64_t offset) {
  const Shape& shape = ids.local().shape();
  if (shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("token ids must be [batch, seq], got ", ShapeToString(shape)));
  }
  std::vector<int64_t> positions(ids.local().numel());
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int64_t>(i) % shape[1] + offset;
  ASSIGN_OR_RETURN(Tensor pos, Tensor::FromInt64s(shape, positions));
  ASSIGN_OR_RETURN(pos, pos.To(ids.local().device()));
  return ColoTensor::FromLocal(pos, ids.spec(), ids.process_group());
}

absl::StatusOr<Variable> SplitHeads(const ColoTensor& t, int64_t heads, int64_t head_dim, const std::string& what) {
  const Shape& s = t.local().shape();
  if (s.size() != 3 || t.local().numel() != s[0] * s[1] * heads * head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " gave ", ShapeToString(s), " locally, not ", heads, " heads of ", head_dim));
  }
  return nn::Reshape(t.variable(), {s[0], s[1], heads, head_dim});
}

absl::StatusOr<ColoTensor> SplitSequence(const ColoTensor& x) {
  ASSIGN_OR_RETURN(int p, x.process_group()->AxisSize("tp"));
  DistSpec spec = x.spec();
  spec.Set("tp", Placement::Shard({1}, {p}));
  return x.Redistribute(spec);
}

absl::StatusOr<ColoTensor> CallWithLocal(Module& self, const std::string& path, const Variable& local,
                                         ProcessGroup* pg) {
  ASSIGN_OR_RETURN(Module * m, self.Get(path));
  if (m->layer() == nullptr) return absl::FailedPreconditionError(absl::StrCat(path, " has no weights loaded"));
  ASSIGN_OR_RETURN(DistSpec spec, m->layer()->InputSpec(local.value().dim()));
  ASSIGN_OR_RETURN(ColoTensor in, ColoTensor::FromLocal(local, spec, pg));
  return m->Forward(in);
}

absl::StatusOr<ColoTensor> MapLocal(const ColoTensor& x,
                                    const std::function<absl::StatusOr<Variable>(const Variable&)>& op) {
  ASSIGN_OR_RETURN(Variable y, op(x.variable()));
  return ColoTensor::FromLocal(y, x.spec(), x.process_group());
}

absl::StatusOr<ColoTensor> AddActivations(const ColoTensor& a, const ColoTensor& b) {
  if (a.global_shape() != b.global_shape()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot add activations of shapes ",
                                                   ShapeToString(a.global_shape()), " and ",
                                                   ShapeToString(b.global_shape())));
  }
  RETURN_IF_ERROR(CheckSpec(b, a.spec(), "the second summand"));
  ASSIGN_OR_RETURN(Variable sum, Add(a.variable(), b.variable()));
  return ColoTensor::FromLocal(sum, a.spec(), a.process_group());
}

bool SplitsDim(const DistSpec& spec, int64_t dim) {
  for (const auto& [axis, p] : spec.placements()) {
    if (p.kind == Placement::Kind::kShard && std::find(p.dims.begin(), p.dims.end(), dim) != p.dims.end()) return true;
  }
  return false;
}

absl::StatusOr<ColoTensor> ToInputOf(Module& self, const std::string& path, const ColoTensor& x) {
  ASSIGN_OR_RETURN(Module * m, self.Get(path));
  if (m->layer() == nullptr) return absl::FailedPreconditionError(absl::StrCat(path, " has no weights loaded"));
  ASSIGN_OR_RETURN(DistSpec want, m->layer()->InputSpec(static_cast<int64_t>(x.global_shape().size())));
  return x.Redistribute(want);  // no step (and nothing on the tape) where x is in it already
}

}  // namespace colod::shardformer
