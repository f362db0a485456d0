#include "worker/shardformer/table_family.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "spec/plan.h"

namespace colod::shardformer {
namespace {

using Kind = LayerDecl::Kind;

absl::StatusOr<Kind> ModuleKind(const PlanLeaf& leaf) {
  switch (leaf.kind) {
    case LeafKind::kLinear: return Kind::kLinear;
    case LeafKind::kConv1D: return Kind::kConv1D;
    case LeafKind::kEmbedding: return Kind::kEmbedding;
    case LeafKind::kLayerNorm: return Kind::kLayerNorm;
    case LeafKind::kRmsNorm: return Kind::kRmsNorm;
    case LeafKind::kBias: return Kind::kBias;
    case LeafKind::kParameter: return Kind::kParameter;
    case LeafKind::kPatchEmbedding: return Kind::kPatchEmbedding;
    case LeafKind::kOther: break;
  }
  return absl::InternalError(absl::StrCat("layer table entry '", leaf.name, "' names no module kind"));
}

// `path` under the base model, as a path under the root.
std::string UnderBase(const TableFamily& f, const std::string& path) {
  return f.base.empty() ? path : absl::StrCat(f.base, ".", path);
}

// The layer list a leaf is in ("<list>.*." starts its name), or null.
const TableFamily::LayerList* ListOf(const TableFamily& f, const PlanLeaf& leaf) {
  if (leaf.on_root) return nullptr;
  for (const TableFamily::LayerList& l : f.layer_lists) {
    if (absl::StartsWith(leaf.name, l.path + ".*.")) return &l;
  }
  return nullptr;
}

// A leaf's path under the root: a table path is under the base model unless
// the leaf is the root's.
std::string FullPath(const TableFamily& f, const PlanLeaf& leaf) {
  return leaf.on_root ? leaf.name : UnderBase(f, leaf.name);
}

// The container pattern of a path's first `n` components: a layer's index
// (the component after a layer list's path) written "*".
std::string Pattern(const TableFamily& f, const std::vector<std::string>& parts, size_t n) {
  std::vector<std::string> out(parts.begin(), parts.begin() + n);
  for (const TableFamily::LayerList& l : f.layer_lists) {
    const std::vector<std::string> list = absl::StrSplit(UnderBase(f, l.path), '.');
    if (out.size() > list.size() && std::equal(list.begin(), list.end(), out.begin())) out[list.size()] = "*";
  }
  return absl::StrJoin(out, ".");
}

// The base model's forward: the family's own, or the shared one.
Module::ForwardFn ModelForwardOf(const TableFamily& f, bool sequence_parallel, PipelineStage stage = {}) {
  return f.model_forward ? f.model_forward(sequence_parallel, stage) : DecoderModelForward(f, sequence_parallel, stage);
}

std::string Join(const std::string& at, const std::string& name) { return at.empty() ? name : absl::StrCat(at, ".", name); }

}  // namespace

void DropExcept(Module& parent, const std::string& at, const std::string& name, const std::vector<std::string>& keep) {
  const std::string path = Join(at, name);
  bool above = false;
  for (const std::string& k : keep) {
    if (k == path) return;
    above = above || absl::StartsWith(k, path + ".");
  }
  if (!above) {
    parent.Remove(name);
    return;
  }
  Module* child = parent.Find(name);
  for (const std::string& grand : child->ChildNames()) DropExcept(*child, path, grand, keep);
}

namespace {

// The class of the container at `pattern` ("" the root).
absl::StatusOr<std::string> ClassAt(const TableFamily& f, const std::string& pattern) {
  if (pattern.empty()) return f.root_class;
  if (pattern == f.base) return f.base_class;
  for (const TableFamily::LayerList& l : f.layer_lists) {
    if (pattern == UnderBase(f, l.path) + ".*") return l.class_name;
  }
  for (const TableFamily::Container& c : f.containers) {
    if (c.path == pattern) return c.class_name;
  }
  return absl::InternalError(absl::StrCat(f.root_class, ": the layer table needs a container at '", pattern,
                                          "', which the family does not declare"));
}

// A new container for `pattern`: the base model, the layer list, a layer
// (its index in `name`), or one of the family's.
absl::StatusOr<std::unique_ptr<Module>> NewContainer(const TableFamily& f, const std::string& pattern) {
  if (pattern == f.base) return std::make_unique<Module>(f.base_class, ModelForwardOf(f, false));
  for (const TableFamily::LayerList& l : f.layer_lists) {
    if (pattern == UnderBase(f, l.path)) return std::make_unique<Module>("ModuleList", nullptr);
    if (pattern == UnderBase(f, l.path) + ".*") return std::make_unique<Module>(l.class_name, l.forward);
  }
  for (const TableFamily::Container& c : f.containers) {
    if (c.path == pattern) return std::make_unique<Module>(c.class_name, c.forward);
  }
  return absl::InternalError(absl::StrCat(f.root_class, ": the layer table needs a container at '", pattern,
                                          "', which the family does not declare"));
}

// The module at `path` under `root` (the first `n` components of it),
// making the missing containers on the way.
absl::StatusOr<Module*> Ensure(const TableFamily& f, Module& root, const std::vector<std::string>& parts, size_t n) {
  Module* at = &root;
  for (size_t i = 0; i < n; ++i) {
    Module* next = at->Find(parts[i]);
    if (next == nullptr) {
      ASSIGN_OR_RETURN(std::unique_ptr<Module> made, NewContainer(f, Pattern(f, parts, i + 1)));
      next = at->Add(parts[i], std::move(made));
    }
    at = next;
  }
  return at;
}

// Adds the leaf at `path` (under the root), its containers made on the way.
absl::Status Place(const TableFamily& f, Module& root, const PlanLeaf& leaf, const std::string& path,
                   const ModelConfig& c) {
  ASSIGN_OR_RETURN(Kind kind, ModuleKind(leaf));
  const std::vector<std::string> parts = absl::StrSplit(path, '.');
  ASSIGN_OR_RETURN(Module * parent, Ensure(f, root, parts, parts.size() - 1));
  const bool norm = kind == Kind::kLayerNorm || kind == Kind::kRmsNorm;
  // A bias leaf is named by its owner ("cls.predictions" for
  // cls.predictions.bias); every other leaf by its path.
  const std::string prefix = kind == Kind::kBias ? absl::StrJoin(parts.begin(), parts.end() - 1, ".") : path;
  LayerDecl d = LayerDecl::Of(kind, prefix, leaf.in, leaf.out, leaf.bias, norm ? static_cast<float>(c.norm_eps) : 1e-5f);
  d.shape = leaf.shape;
  if (!leaf.tied_to.empty()) d.tied_to = UnderBase(f, leaf.tied_to);
  parent->Add(parts.back(), Module::Leaf(std::move(d)));
  return absl::OkStatus();
}

// The replacement layer for `leaf` in `shard`'s mode; empty: the leaf stays
// native.
absl::StatusOr<SubModuleReplacementDescription> Replacement(const PlanLeaf& leaf, const std::string& suffix,
                                                            const ShardConfig& shard) {
  SubModuleReplacementDescription r;
  r.suffix = suffix;
  const bool rms = leaf.kind == LeafKind::kRmsNorm;
  const std::string mode = shard.is_3d() ? "3D" : shard.is_2d() ? "2D" : "";
  switch (leaf.role) {
    case LeafRole::kWhole:
    case LeafRole::kTiedHead:  // holds nothing: it computes with its table's layer
      break;
    case LeafRole::kColumn:
      r.target_module = mode.empty() ? "Linear1D_Col" : "Linear" + mode;
      if (leaf.fused > 1) r.kwargs["n_fused"] = static_cast<double>(leaf.fused);
      break;
    case LeafRole::kRow:
      r.target_module = mode.empty() ? "Linear1D_Row" : "Linear" + mode;
      if (shard.is_3d()) r.kwargs["swap"] = 1;  // the second linear of its pair gives the stream's spec back
      break;
    case LeafRole::kNorm:
      if (mode.empty()) {
        if (shard.sequence_parallel() && leaf.sequence_split) r.target_module = "Norm1D";
      } else {
        r.target_module = (rms ? "RMSNorm" : "LayerNorm") + mode;
      }
      break;
    case LeafRole::kVocabTable:
      r.target_module = mode.empty() ? "VocabParallelEmbedding1D" : "Embedding" + mode;
      break;
    case LeafRole::kPositions:
      if (!mode.empty()) r.target_module = "Embedding" + mode;
      break;
    case LeafRole::kProjection:  // replicated in 1D
      if (!mode.empty()) r.target_module = "Linear" + mode;
      break;
    case LeafRole::kVocabHead:
      r.target_module = mode.empty() ? "VocabParallelLMHead1D" : "LMHead" + mode;
      break;
    case LeafRole::kVocabBias:
      r.target_module = mode.empty() ? "VocabParallelBias1D" : "Bias" + mode;
      break;
  }
  return r;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Module>> BuildFromTable(const TableFamily& f, const ModelConfig& c) {
  ASSIGN_OR_RETURN(std::vector<PlanLeaf> leaves, PlanLeaves(c));
  auto root = std::make_unique<Module>(f.root_class, f.root_forward ? f.root_forward
                                                   : f.root_cross_forward ? nullptr
                                                                          : DecoderLmForward(f));
  if (f.root_cross_forward) root->set_cross_forward(f.root_cross_forward);
  if (!f.base.empty()) {
    const std::vector<std::string> base = absl::StrSplit(f.base, '.');
    RETURN_IF_ERROR(Ensure(f, *root, base, base.size()).status());  // the base model first
  }
  std::set<const TableFamily::LayerList*> built;
  for (const PlanLeaf& leaf : leaves) {
    const TableFamily::LayerList* list = ListOf(f, leaf);
    if (list == nullptr) {
      RETURN_IF_ERROR(Place(f, *root, leaf, FullPath(f, leaf), c));
      continue;
    }
    if (!built.insert(list).second) continue;
    // The first leaf of a list's layers: every layer of it, each with all
    // of its leaves in the table's order.
    const std::string at = UnderBase(f, list->path);
    const std::vector<std::string> path = absl::StrSplit(at, '.');
    ASSIGN_OR_RETURN(Module * layers, Ensure(f, *root, path, path.size()));
    const int64_t n = list->decoder ? c.num_decoder_layers : c.num_layers;
    for (int64_t i = 0; i < n; ++i) {
      Module* layer = layers->Add(absl::StrCat(i), std::make_unique<Module>(list->class_name, list->forward));
      for (const PlanLeaf& l : leaves) {
        if (ListOf(f, l) != list) continue;
        const std::string rel = l.name.substr(list->path.size() + 3);  // after "<list>.*."
        RETURN_IF_ERROR(Place(f, *root, l, absl::StrCat(at, ".", i, ".", rel), c));
      }
      if (f.configure_layer) f.configure_layer(*layer, c);
    }
  }
  if (f.configure) f.configure(*root, c);
  return root;
}

absl::StatusOr<std::map<std::string, ModulePolicyDescription>> TablePolicy(const TableFamily& f,
                                                                           const ModelConfig& config,
                                                                           const ShardConfig& shard) {
  ASSIGN_OR_RETURN(std::vector<PlanLeaf> leaves, PlanLeaves(config));
  std::map<std::string, ModulePolicyDescription> policy;
  for (const PlanLeaf& leaf : leaves) {
    // A layer's leaf on the layer's class (unless anchor_at_container); any
    // other on its container's.
    const TableFamily::LayerList* list = ListOf(f, leaf);
    std::string cls, suffix;
    if (list != nullptr && !f.anchor_at_container) {
      cls = list->class_name;
      suffix = leaf.name.substr(list->path.size() + 3);
    } else {
      const std::vector<std::string> parts = absl::StrSplit(FullPath(f, leaf), '.');
      ASSIGN_OR_RETURN(cls, ClassAt(f, Pattern(f, parts, parts.size() - 1)));
      suffix = parts.back();
    }
    ASSIGN_OR_RETURN(SubModuleReplacementDescription r, Replacement(leaf, suffix, shard));
    if (!r.target_module.empty()) policy[cls].sub_module_replacement.push_back(std::move(r));
  }
  if (!shard.is_2d() && !shard.is_3d() && shard.sequence_parallel()) {
    policy[f.base_class].method_replacement = ModelForwardOf(f, /*sequence_parallel=*/true);
  }
  return policy;
}

Module::ForwardFn DecoderModelForward(const TableFamily& f, bool sequence_parallel, PipelineStage stage) {
  return [f, sequence_parallel, stage](Module& self, const ColoTensor& input) -> absl::StatusOr<ColoTensor> {
    ColoTensor x = input;
    if (stage.first()) {
      if (f.positions.empty()) {
        ASSIGN_OR_RETURN(x, self.Call(f.tokens, input));
      } else {
        ASSIGN_OR_RETURN(ColoTensor pos_ids, PositionIds(input));
        ASSIGN_OR_RETURN(ColoTensor tok, self.Call(f.tokens, input));
        ASSIGN_OR_RETURN(ColoTensor where, self.Call(f.positions, pos_ids));
        ASSIGN_OR_RETURN(x, AddActivations(tok, where));
      }
      if (sequence_parallel) {
        ASSIGN_OR_RETURN(x, SplitSequence(x));
      }
    }
    ASSIGN_OR_RETURN(Module * layers, self.Get(f.layer_lists.front().path));
    ASSIGN_OR_RETURN(x, RunSequential(*layers, x));
    if (!stage.last()) return x;
    return self.Call(f.final_norm, x);
  };
}

Module::ForwardFn DecoderLmForward(const TableFamily& f, PipelineStage stage) {
  // The root's child on the way to the base model.
  const std::string first = std::vector<std::string>(absl::StrSplit(f.base, '.')).front();
  return [f, first, stage](Module& self, const ColoTensor& ids) -> absl::StatusOr<ColoTensor> {
    ASSIGN_OR_RETURN(ColoTensor h, self.Call(first, ids));
    if (!stage.last()) return h;
    return self.Call(f.head, h);
  };
}

absl::StatusOr<std::vector<TiedTable>> SplitTableStage(const TableFamily& f, Module& root,
                                                       const PipelineStage& stage) {
  // The tables tied heads compute with (paths under the root).
  std::vector<std::string> tied;
  for (const auto& [path, m] : root.Modules()) {
    if (m->decl().has_value() && !m->decl()->tied_to.empty()) tied.push_back(m->decl()->tied_to);
  }
  // Down the path to the layer list: at each module on it, the children
  // before the path's next step are the first stage's, those after it the
  // last's (a tied table is the last stage's too).
  const std::vector<std::string> steps = absl::StrSplit(UnderBase(f, f.layer_lists.front().path), '.');
  Module* at = &root;
  std::string at_path;
  for (const std::string& step : steps) {
    bool before = true;
    for (const std::string& name : at->ChildNames()) {
      if (name == step) {
        before = false;
      } else if (before && !stage.first()) {
        DropExcept(*at, at_path, name, stage.last() ? tied : std::vector<std::string>{});
      } else if (!before && !stage.last()) {
        at->Remove(name);
      }
    }
    at = at->Find(step);
    if (at == nullptr) {
      return absl::InternalError(absl::StrCat(f.root_class, " has no '", Join(at_path, step), "' to split"));
    }
    at_path = Join(at_path, step);
  }
  const int64_t n = static_cast<int64_t>(at->Children().size());
  for (int64_t i = 0; i < n; ++i) {
    if (i < stage.begin || i >= stage.end) at->Remove(absl::StrCat(i));
  }
  ASSIGN_OR_RETURN(Module * model, root.Get(f.base));
  model->set_forward(ModelForwardOf(f, false, stage));
  root.set_forward(stage.last() && f.root_forward ? f.root_forward : DecoderLmForward(f, stage));
  std::vector<TiedTable> shared;
  if (stage.first() || stage.last()) {
    for (const std::string& path : tied) shared.push_back(TiedTable{path, {0, stage.count - 1}});
  }
  return shared;
}

}  // namespace colod::shardformer
