#include "worker/shardformer/decoder_family.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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
    case LeafKind::kOther: break;
  }
  return absl::InternalError(absl::StrCat("layer table entry '", leaf.name, "' names no module kind"));
}

// "<layers>.*.": the prefix of a leaf in every layer.
std::string LayerPrefix(const DecoderFamily& f) { return f.layers + ".*."; }

// The leaf's module: its checkpoint name `prefix`, sizes and tying.
absl::StatusOr<std::unique_ptr<Module>> LeafModule(const DecoderFamily& f, const PlanLeaf& leaf,
                                                   const std::string& prefix, const ModelConfig& c) {
  ASSIGN_OR_RETURN(Kind kind, ModuleKind(leaf));
  const bool norm = kind == Kind::kLayerNorm || kind == Kind::kRmsNorm;
  LayerDecl d = LayerDecl::Of(kind, prefix, leaf.in, leaf.out, leaf.bias,
                              norm ? static_cast<float>(c.norm_eps) : 1e-5f);
  if (!leaf.tied_to.empty()) d.tied_to = absl::StrCat(f.base, ".", leaf.tied_to);
  return Module::Leaf(std::move(d));
}

// Adds the leaf at `path` (dot-separated, under `parent`) whose checkpoint
// name is `prefix`, making the containers on the way from `f.parts`.
absl::Status Place(const DecoderFamily& f, Module& parent, const std::string& path, std::unique_ptr<Module> leaf) {
  const std::vector<std::string> parts = absl::StrSplit(path, '.');
  Module* at = &parent;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    Module* next = at->Find(parts[i]);
    if (next == nullptr) {
      const DecoderFamily::Part* part = nullptr;
      for (const DecoderFamily::Part& p : f.parts) {
        if (p.name == parts[i]) part = &p;
      }
      if (part == nullptr) {
        return absl::InternalError(absl::StrCat(f.root_class, ": the layer table places '", path, "' in '", parts[i],
                                                "', a container the family does not declare"));
      }
      next = at->Add(parts[i], std::make_unique<Module>(part->class_name, part->forward));
    }
    at = next;
  }
  at->Add(parts.back(), std::move(leaf));
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
    case LeafRole::kTiedHead:
      break;  // holds nothing: it computes with its table's layer
    default:
      return absl::InternalError(absl::StrCat("layer table entry '", leaf.name,
                                              "': a declared decoder family has no rule for its role"));
  }
  return r;
}

// The family's base model forward: its own, or the shared one.
Module::ForwardFn ModelForwardOf(const DecoderFamily& f, bool sequence_parallel) {
  return f.model_forward ? f.model_forward(sequence_parallel) : DecoderModelForward(f, sequence_parallel);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Module>> BuildDecoder(const DecoderFamily& f, const ModelConfig& c) {
  ASSIGN_OR_RETURN(std::vector<PlanLeaf> leaves, PlanLeaves(c));
  auto root = std::make_unique<Module>(f.root_class, DecoderLmForward(f));
  Module* parent = root.get();
  for (const DecoderFamily::Part& p : f.outer) parent = parent->Add(p.name, std::make_unique<Module>(p.class_name, p.forward));
  const std::vector<std::string> base_path = absl::StrSplit(f.base, '.');
  Module* model = parent->Add(base_path.back(), std::make_unique<Module>(f.base_class, ModelForwardOf(f, false)));
  if (f.configure_base) f.configure_base(*model, c);
  const std::string in_layer = LayerPrefix(f);
  bool layers_built = false;
  for (const PlanLeaf& leaf : leaves) {
    if (leaf.on_root) {
      ASSIGN_OR_RETURN(std::unique_ptr<Module> m, LeafModule(f, leaf, leaf.name, c));
      RETURN_IF_ERROR(Place(f, *root, leaf.name, std::move(m)));
      continue;
    }
    if (!absl::StartsWith(leaf.name, in_layer)) {
      ASSIGN_OR_RETURN(std::unique_ptr<Module> m, LeafModule(f, leaf, absl::StrCat(f.base, ".", leaf.name), c));
      RETURN_IF_ERROR(Place(f, *model, leaf.name, std::move(m)));
      continue;
    }
    if (layers_built) continue;
    // The first leaf of a layer: every layer, each with all of its leaves
    // in the table's order.
    layers_built = true;
    Module* list = model->Add(f.layers, std::make_unique<Module>("ModuleList", nullptr));
    for (int64_t i = 0; i < c.num_layers; ++i) {
      Module* layer = list->Add(absl::StrCat(i), std::make_unique<Module>(f.layer_class, f.layer_forward));
      for (const PlanLeaf& l : leaves) {
        if (l.on_root || !absl::StartsWith(l.name, in_layer)) continue;
        const std::string path = l.name.substr(in_layer.size());
        ASSIGN_OR_RETURN(std::unique_ptr<Module> m,
                         LeafModule(f, l, absl::StrCat(f.base, ".", f.layers, ".", i, ".", path), c));
        RETURN_IF_ERROR(Place(f, *layer, path, std::move(m)));
      }
      if (f.configure_layer) f.configure_layer(*layer, c);
    }
  }
  return root;
}

absl::StatusOr<std::map<std::string, ModulePolicyDescription>> DecoderPolicy(const DecoderFamily& f,
                                                                             const ModelConfig& config,
                                                                             const ShardConfig& shard) {
  ASSIGN_OR_RETURN(std::vector<PlanLeaf> leaves, PlanLeaves(config));
  std::map<std::string, ModulePolicyDescription> policy;
  ModulePolicyDescription& root = policy[f.root_class];
  ModulePolicyDescription& model = policy[f.base_class];
  ModulePolicyDescription& layer = policy[f.layer_class];
  const std::string in_layer = LayerPrefix(f);
  for (const PlanLeaf& leaf : leaves) {
    const bool per_layer = !leaf.on_root && absl::StartsWith(leaf.name, in_layer);
    const std::string suffix = per_layer ? leaf.name.substr(in_layer.size()) : leaf.name;
    ASSIGN_OR_RETURN(SubModuleReplacementDescription r, Replacement(leaf, suffix, shard));
    if (r.target_module.empty()) continue;
    (leaf.on_root ? root : per_layer ? layer : model).sub_module_replacement.push_back(std::move(r));
  }
  if (!shard.is_2d() && !shard.is_3d() && shard.sequence_parallel()) {
    model.method_replacement = ModelForwardOf(f, /*sequence_parallel=*/true);
  }
  return policy;
}

Module::ForwardFn DecoderModelForward(const DecoderFamily& f, bool sequence_parallel, PipelineStage stage) {
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
    ASSIGN_OR_RETURN(Module * layers, self.Get(f.layers));
    ASSIGN_OR_RETURN(x, RunSequential(*layers, x));
    if (!stage.last()) return x;
    return self.Call(f.final_norm, x);
  };
}

Module::ForwardFn DecoderLmForward(const DecoderFamily& f, PipelineStage stage) {
  // The root's child on the way to the base model.
  const std::string first = f.outer.empty() ? f.base : f.outer.front().name;
  return [f, first, stage](Module& self, const ColoTensor& ids) -> absl::StatusOr<ColoTensor> {
    ASSIGN_OR_RETURN(ColoTensor h, self.Call(first, ids));
    if (!stage.last()) return h;
    return self.Call(f.head, h);
  };
}

absl::StatusOr<std::vector<std::string>> SplitDecoderStage(const DecoderFamily& f, Module& root,
                                                           const PipelineStage& stage) {
  ASSIGN_OR_RETURN(Module * model, root.Get(f.base));
  ASSIGN_OR_RETURN(Module * layers, model->Get(f.layers));
  const int64_t n = static_cast<int64_t>(layers->Children().size());
  for (int64_t i = 0; i < n; ++i) {
    if (i < stage.begin || i >= stage.end) layers->Remove(absl::StrCat(i));
  }
  Module* head = root.Find(f.head);
  const bool tied = head != nullptr && head->decl().has_value() && !head->decl()->tied_to.empty();
  std::vector<std::string> shared;
  if (tied && (stage.first() || stage.last())) shared.push_back(absl::StrCat(f.base, ".", f.tokens));
  if (!stage.first()) {
    if (!f.positions.empty()) model->Remove(f.positions);
    if (!(stage.last() && tied)) model->Remove(f.tokens);
  }
  if (!stage.last()) {
    model->Remove(f.final_norm);
    root.Remove(f.head);
  }
  model->set_forward(DecoderModelForward(f, false, stage));
  root.set_forward(DecoderLmForward(f, stage));
  return shared;
}

}  // namespace colod::shardformer
