// GPT2LMHeadModel (transformers/models/gpt2/modeling_gpt2.py), evaluation
// semantics (dropout off): token + position embeddings, pre-norm blocks of
// causal self-attention (fused c_attn Conv1D, q|k|v) and an MLP (c_fc,
// gelu_new, c_proj), final ln_f, and an LM head tied to wte.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/models.h"

namespace colod::shardformer {
namespace {

using Kind = LayerDecl::Kind;

std::unique_ptr<Module> Leaf(Kind kind, const std::string& prefix, int64_t in, int64_t out, bool bias = true,
                             float eps = 1e-5f) {
  return Module::Leaf(LayerDecl::Of(kind, prefix, in, out, bias, eps));
}

// GPT2Attention: q|k|v from c_attn, causal attention over this rank's
// num_heads heads (the policy divides the attribute by the tp degree), the
// heads merged into the spec c_proj wants, then c_proj.
absl::StatusOr<ColoTensor> AttentionForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(int64_t heads, self.IntAttr("num_heads"));
  ASSIGN_OR_RETURN(int64_t head_dim, self.IntAttr("head_dim"));
  ASSIGN_OR_RETURN(ColoTensor qkv, self.Call("c_attn", x));
  const Shape& local = qkv.local().shape();
  const int64_t b = local[0], s = local[1];
  if (qkv.local().numel() != b * s * 3 * heads * head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("c_attn gave ", ShapeToString(local), " locally, not ", heads,
                                                   " heads of q, k and v"));
  }
  ASSIGN_OR_RETURN(Variable split, nn::Reshape(qkv.variable(), {b, s, 3, heads, head_dim}));
  Variable qkv_parts[3];
  for (int i = 0; i < 3; ++i) {
    ASSIGN_OR_RETURN(Variable part, nn::Narrow(split, 2, i, 1));
    ASSIGN_OR_RETURN(qkv_parts[i], nn::Reshape(part, {b, s, heads, head_dim}));
  }
  ASSIGN_OR_RETURN(Variable att, nn::CausalAttention(qkv_parts[0], qkv_parts[1], qkv_parts[2],
                                                     1.0f / std::sqrt(static_cast<float>(head_dim))));
  ASSIGN_OR_RETURN(att, nn::Reshape(att, {b, s, heads * head_dim}));
  return CallWithLocal(self, "c_proj", att, x.process_group());
}

absl::StatusOr<ColoTensor> MlpForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(int64_t tanh, self.IntAttr("gelu_tanh"));
  // c_fc's bias and the GELU are one kernel each way (nn::BiasEpilogue).
  ASSIGN_OR_RETURN(ColoTensor act,
                   self.Call("c_fc", x, nn::GeluEpilogue(tanh ? ops::GeluApprox::kTanh : ops::GeluApprox::kNone)));
  return self.Call("c_proj", act);
}

absl::StatusOr<ColoTensor> BlockForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("ln_1", x));
  ASSIGN_OR_RETURN(ColoTensor a, self.Call("attn", h));
  // x1 = x + a and ln_2(x1), one kernel where the norm can.
  ASSIGN_OR_RETURN(Layer::WithSum x1, self.CallResidual("ln_2", x, a));
  ASSIGN_OR_RETURN(ColoTensor m, self.Call("mlp", x1.y));
  return AddActivations(x1.sum, m);
}

// GPT2Model; with sequence_parallel (the policy's forward replacement) the
// embeddings are split along the sequence over tp before the blocks. A
// pipeline stage embeds only if it is the first (otherwise `input` is the
// previous stage's activation) and normalizes only if it is the last.
Module::ForwardFn ModelForward(bool sequence_parallel, PipelineStage stage = {}) {
  return [sequence_parallel, stage](Module& self, const ColoTensor& input) -> absl::StatusOr<ColoTensor> {
    ColoTensor x = input;
    if (stage.first()) {
      ASSIGN_OR_RETURN(ColoTensor pos_ids, PositionIds(input));
      ASSIGN_OR_RETURN(ColoTensor tok, self.Call("wte", input));
      ASSIGN_OR_RETURN(ColoTensor where, self.Call("wpe", pos_ids));
      ASSIGN_OR_RETURN(x, AddActivations(tok, where));
      if (sequence_parallel) {
        ASSIGN_OR_RETURN(x, SplitSequence(x));
      }
    }
    ASSIGN_OR_RETURN(Module * blocks, self.Get("h"));
    ASSIGN_OR_RETURN(x, RunSequential(*blocks, x));
    if (!stage.last()) return x;
    return self.Call("ln_f", x);
  };
}

Module::ForwardFn LmHeadModelForward(PipelineStage stage = {}) {
  return [stage](Module& self, const ColoTensor& ids) -> absl::StatusOr<ColoTensor> {
    ASSIGN_OR_RETURN(ColoTensor h, self.Call("transformer", ids));
    if (!stage.last()) return h;
    return self.Call("lm_head", h);
  };
}

// A pipeline stage's part of GPT2LMHeadModel: its blocks; the embeddings on
// the first stage; ln_f and the head on the last, which keeps wte as the
// tied head's table (a mirror of the first stage's).
absl::StatusOr<std::vector<std::string>> SplitStage(Module& root, const PipelineStage& stage) {
  ASSIGN_OR_RETURN(Module * model, root.Get("transformer"));
  ASSIGN_OR_RETURN(Module * blocks, model->Get("h"));
  const int64_t layers = static_cast<int64_t>(blocks->Children().size());
  for (int64_t i = 0; i < layers; ++i) {
    if (i < stage.begin || i >= stage.end) blocks->Remove(absl::StrCat(i));
  }
  std::vector<std::string> tied;
  if (stage.first() || stage.last()) tied.push_back("transformer.wte");  // the head is always tied
  if (!stage.first()) {
    model->Remove("wpe");
    if (!stage.last()) model->Remove("wte");
  }
  if (!stage.last()) {
    model->Remove("ln_f");
    root.Remove("lm_head");
  }
  model->set_forward(ModelForward(false, stage));
  root.set_forward(LmHeadModelForward(stage));
  return tied;
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) {
  if (c.activation != "gelu_new" && c.activation != "gelu" && c.activation != "gelu_pytorch_tanh") {
    return absl::InvalidArgumentError(
        absl::StrCat("activation_function \"", c.activation, "\" is not one of gelu_new, gelu_pytorch_tanh, gelu"));
  }
  const int64_t h = c.hidden_size;
  const float eps = static_cast<float>(c.norm_eps);
  auto root = std::make_unique<Module>("GPT2LMHeadModel", LmHeadModelForward());
  Module* model = root->Add("transformer", std::make_unique<Module>("GPT2Model", ModelForward(false)));
  model->Add("wte", Leaf(Kind::kEmbedding, "transformer.wte", c.vocab_size, h));
  model->Add("wpe", Leaf(Kind::kEmbedding, "transformer.wpe", c.max_positions, h));
  Module* blocks = model->Add("h", std::make_unique<Module>("ModuleList", nullptr));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("transformer.h.", i);
    Module* block = blocks->Add(absl::StrCat(i), std::make_unique<Module>("GPT2Block", BlockForward));
    block->Add("ln_1", Leaf(Kind::kLayerNorm, p + ".ln_1", 0, h, true, eps));
    Module* attn = block->Add("attn", std::make_unique<Module>("GPT2Attention", AttentionForward));
    attn->SetAttr("num_heads", static_cast<double>(c.num_heads));
    attn->SetAttr("head_dim", static_cast<double>(c.head_dim()));
    attn->Add("c_attn", Leaf(Kind::kConv1D, p + ".attn.c_attn", h, 3 * h));
    attn->Add("c_proj", Leaf(Kind::kConv1D, p + ".attn.c_proj", h, h));
    block->Add("ln_2", Leaf(Kind::kLayerNorm, p + ".ln_2", 0, h, true, eps));
    Module* mlp = block->Add("mlp", std::make_unique<Module>("GPT2MLP", MlpForward));
    mlp->SetAttr("gelu_tanh", c.activation == "gelu" ? 0 : 1);
    mlp->Add("c_fc", Leaf(Kind::kConv1D, p + ".mlp.c_fc", h, c.intermediate_size));
    mlp->Add("c_proj", Leaf(Kind::kConv1D, p + ".mlp.c_proj", c.intermediate_size, h));
  }
  model->Add("ln_f", Leaf(Kind::kLayerNorm, "transformer.ln_f", 0, h, true, eps));
  std::unique_ptr<Module> head = Leaf(Kind::kLinear, "lm_head", h, c.vocab_size, /*bias=*/false);
  LayerDecl tied = *head->decl();
  tied.tied_to = "transformer.wte";
  root->Add("lm_head", Module::Leaf(std::move(tied)));
  return root;
}

// ShardFormer's GPT2Policy: 1D (Megatron) with optional sequence
// parallelism, 2D / 2.5D, and 3D.
class Gpt2Policy : public CausalLmPolicy {
 public:
  Gpt2Policy() : CausalLmPolicy("gpt2", /*supports_3d=*/true) {}

  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    std::map<std::string, ModulePolicyDescription> policy;
    ModulePolicyDescription& model = policy["GPT2Model"];
    ModulePolicyDescription& block = policy["GPT2Block"];
    block.attribute_replacement = {{"attn.num_heads", static_cast<double>(config.num_heads / shard.head_split())}};
    if (shard.is_3d()) {
      // Each pair of linears: the first takes the residual stream's spec,
      // the second (swap) gives it back (worker/nn/linear3d.h).
      model.sub_module_replacement = {{"wte", "Embedding3D"}, {"wpe", "Embedding3D"}, {"ln_f", "LayerNorm3D"}};
      block.sub_module_replacement = {
          {"ln_1", "LayerNorm3D"},
          {"attn.c_attn", "Linear3D", {{"n_fused", 3}}},
          {"attn.c_proj", "Linear3D", {{"swap", 1}}},
          {"ln_2", "LayerNorm3D"},
          {"mlp.c_fc", "Linear3D"},
          {"mlp.c_proj", "Linear3D", {{"swap", 1}}},
      };
      return policy;
    }
    if (shard.is_2d()) {
      model.sub_module_replacement = {{"wte", "Embedding2D"}, {"wpe", "Embedding2D"}, {"ln_f", "LayerNorm2D"}};
      block.sub_module_replacement = {
          {"ln_1", "LayerNorm2D"},   {"attn.c_attn", "Linear2D", {{"n_fused", 3}}},
          {"attn.c_proj", "Linear2D"}, {"ln_2", "LayerNorm2D"},
          {"mlp.c_fc", "Linear2D"},  {"mlp.c_proj", "Linear2D"},
      };
      return policy;
    }
    model.sub_module_replacement = {{"wte", "VocabParallelEmbedding1D"}};
    block.sub_module_replacement = {
        {"attn.c_attn", "Linear1D_Col", {{"n_fused", 3}}},
        {"attn.c_proj", "Linear1D_Row"},
        {"mlp.c_fc", "Linear1D_Col"},
        {"mlp.c_proj", "Linear1D_Row"},
    };
    if (shard.sequence_parallel()) {
      model.sub_module_replacement.push_back({"ln_f", "Norm1D"});
      model.method_replacement = ModelForward(true);
      block.sub_module_replacement.push_back({"ln_1", "Norm1D"});
      block.sub_module_replacement.push_back({"ln_2", "Norm1D"});
    }
    return policy;
  }
};

}  // namespace

ModelFamily Gpt2Family() {
  ModelFamily f;
  f.base_model_prefix = "transformer";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new Gpt2Policy()); };
  f.split_stage = SplitStage;
  return f;
}

}  // namespace colod::shardformer
