#include "worker/shardformer/module.h"

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
    return layer_->Forward(x);
  }
  if (!forward_) return absl::FailedPreconditionError(absl::StrCat(cls_, " has no forward"));
  return forward_(*this, x);
}

absl::StatusOr<ColoTensor> Module::Call(const std::string& path, const ColoTensor& x) {
  ASSIGN_OR_RETURN(Module * m, Get(path));
  return m->Forward(x);
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

}  // namespace colod::shardformer
