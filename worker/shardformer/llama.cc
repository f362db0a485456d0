// LlamaForCausalLM (transformers/models/llama/modeling_llama.py):
// embed_tokens, decoder layers of RMSNorm -> self-attention (q/k/v/o_proj,
// rotary embeddings with rope_theta, grouped-query attention over
// num_key_value_heads) -> residual -> RMSNorm -> SiLU-gated MLP
// (down(silu(gate(x)) * up(x))) -> residual, a final RMSNorm and lm_head
// (tied to embed_tokens when tie_word_embeddings).
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/models.h"

namespace colod::shardformer {
namespace {

using Kind = LayerDecl::Kind;

absl::StatusOr<ColoTensor> AttentionForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(int64_t heads, self.IntAttr("num_heads"));
  ASSIGN_OR_RETURN(int64_t kv_heads, self.IntAttr("num_key_value_heads"));
  ASSIGN_OR_RETURN(int64_t head_dim, self.IntAttr("head_dim"));
  ASSIGN_OR_RETURN(double theta, self.Attr("rope_theta"));
  ASSIGN_OR_RETURN(ColoTensor q, self.Call("q_proj", x));
  ASSIGN_OR_RETURN(ColoTensor k, self.Call("k_proj", x));
  ASSIGN_OR_RETURN(ColoTensor v, self.Call("v_proj", x));
  ASSIGN_OR_RETURN(Variable qh, SplitHeads(q, heads, head_dim, "q_proj"));
  ASSIGN_OR_RETURN(Variable kh, SplitHeads(k, kv_heads, head_dim, "k_proj"));
  ASSIGN_OR_RETURN(Variable vh, SplitHeads(v, kv_heads, head_dim, "v_proj"));
  ASSIGN_OR_RETURN(qh, nn::Rope(qh, static_cast<float>(theta)));
  ASSIGN_OR_RETURN(kh, nn::Rope(kh, static_cast<float>(theta)));
  ASSIGN_OR_RETURN(Variable att, nn::CausalAttention(qh, kh, vh, 1.0f / std::sqrt(static_cast<float>(head_dim))));
  const Shape& s = att.value().shape();
  ASSIGN_OR_RETURN(att, nn::Reshape(att, {s[0], s[1], heads * head_dim}));
  return CallWithLocal(self, "o_proj", att, x.process_group());
}

absl::StatusOr<ColoTensor> MlpForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(ColoTensor gate, self.Call("gate_proj", x));
  ASSIGN_OR_RETURN(ColoTensor up, self.Call("up_proj", x));
  RETURN_IF_ERROR(CheckSpec(up, gate.spec(), "up_proj's output"));
  ASSIGN_OR_RETURN(ColoTensor h, MapLocal(gate, [&up](const Variable& g) -> absl::StatusOr<Variable> {
                     ASSIGN_OR_RETURN(Variable act, nn::Silu(g));
                     return Mul(act, up.variable());
                   }));
  return self.Call("down_proj", h);
}

absl::StatusOr<ColoTensor> DecoderLayerForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("input_layernorm", x));
  ASSIGN_OR_RETURN(ColoTensor a, self.Call("self_attn", h));
  // x1 = x + a and its norm, one kernel where the norm can.
  ASSIGN_OR_RETURN(Layer::WithSum x1, self.CallResidual("post_attention_layernorm", x, a));
  ASSIGN_OR_RETURN(ColoTensor m, self.Call("mlp", x1.y));
  return AddActivations(x1.sum, m);
}

// LlamaModel; with sequence_parallel the embeddings are split along the
// sequence over tp before the layers (the policy's forward replacement). A
// pipeline stage embeds only if it is the first (otherwise `input` is the
// previous stage's activation) and normalizes only if it is the last.
Module::ForwardFn ModelForward(bool sequence_parallel, PipelineStage stage = {}) {
  return [sequence_parallel, stage](Module& self, const ColoTensor& input) -> absl::StatusOr<ColoTensor> {
    ColoTensor x = input;
    if (stage.first()) {
      ASSIGN_OR_RETURN(x, self.Call("embed_tokens", input));
      if (sequence_parallel) {
        ASSIGN_OR_RETURN(x, SplitSequence(x));
      }
    }
    ASSIGN_OR_RETURN(Module * layers, self.Get("layers"));
    ASSIGN_OR_RETURN(x, RunSequential(*layers, x));
    if (!stage.last()) return x;
    return self.Call("norm", x);
  };
}

Module::ForwardFn CausalLmForward(PipelineStage stage = {}) {
  return [stage](Module& self, const ColoTensor& ids) -> absl::StatusOr<ColoTensor> {
    ASSIGN_OR_RETURN(ColoTensor h, self.Call("model", ids));
    if (!stage.last()) return h;
    return self.Call("lm_head", h);
  };
}

// A pipeline stage's part of LlamaForCausalLM: its decoder layers;
// embed_tokens on the first stage; the norm and lm_head on the last, which
// keeps embed_tokens as the head's table when they are tied (a mirror of
// the first stage's).
absl::StatusOr<std::vector<std::string>> SplitStage(Module& root, const PipelineStage& stage) {
  ASSIGN_OR_RETURN(Module * model, root.Get("model"));
  ASSIGN_OR_RETURN(Module * layers, model->Get("layers"));
  const int64_t n = static_cast<int64_t>(layers->Children().size());
  for (int64_t i = 0; i < n; ++i) {
    if (i < stage.begin || i >= stage.end) layers->Remove(absl::StrCat(i));
  }
  Module* head = root.Find("lm_head");
  const bool tied = head != nullptr && head->decl().has_value() && !head->decl()->tied_to.empty();
  std::vector<std::string> shared;
  if (tied && (stage.first() || stage.last())) shared.push_back("model.embed_tokens");
  if (!stage.first() && !(stage.last() && tied)) model->Remove("embed_tokens");
  if (!stage.last()) {
    model->Remove("norm");
    root.Remove("lm_head");
  }
  model->set_forward(ModelForward(false, stage));
  root.set_forward(CausalLmForward(stage));
  return shared;
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) {
  if (c.activation != "silu") {
    return absl::InvalidArgumentError(absl::StrCat("hidden_act \"", c.activation, "\" is not silu"));
  }
  if (c.head_dim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("rotary embeddings need an even head dim, got ", c.head_dim()));
  }
  const int64_t h = c.hidden_size, d = c.head_dim(), kv = c.num_kv_heads * d, f = c.intermediate_size;
  const float eps = static_cast<float>(c.norm_eps);
  auto leaf = [](Kind kind, const std::string& prefix, int64_t in, int64_t out, bool bias, float e = 1e-5f) {
    return Module::Leaf(LayerDecl::Of(kind, prefix, in, out, bias, e));
  };
  auto root = std::make_unique<Module>("LlamaForCausalLM", CausalLmForward());
  Module* model = root->Add("model", std::make_unique<Module>("LlamaModel", ModelForward(false)));
  model->Add("embed_tokens", leaf(Kind::kEmbedding, "model.embed_tokens", c.vocab_size, h, false));
  Module* layers = model->Add("layers", std::make_unique<Module>("ModuleList", nullptr));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i);
    Module* layer = layers->Add(absl::StrCat(i), std::make_unique<Module>("LlamaDecoderLayer", DecoderLayerForward));
    layer->Add("input_layernorm", leaf(Kind::kRmsNorm, p + ".input_layernorm", 0, h, false, eps));
    Module* attn = layer->Add("self_attn", std::make_unique<Module>("LlamaAttention", AttentionForward));
    attn->SetAttr("num_heads", static_cast<double>(c.num_heads));
    attn->SetAttr("num_key_value_heads", static_cast<double>(c.num_kv_heads));
    attn->SetAttr("head_dim", static_cast<double>(d));
    attn->SetAttr("rope_theta", c.rope_theta);
    attn->Add("q_proj", leaf(Kind::kLinear, p + ".self_attn.q_proj", h, h, false));
    attn->Add("k_proj", leaf(Kind::kLinear, p + ".self_attn.k_proj", h, kv, false));
    attn->Add("v_proj", leaf(Kind::kLinear, p + ".self_attn.v_proj", h, kv, false));
    attn->Add("o_proj", leaf(Kind::kLinear, p + ".self_attn.o_proj", h, h, false));
    layer->Add("post_attention_layernorm", leaf(Kind::kRmsNorm, p + ".post_attention_layernorm", 0, h, false, eps));
    Module* mlp = layer->Add("mlp", std::make_unique<Module>("LlamaMLP", MlpForward));
    mlp->Add("gate_proj", leaf(Kind::kLinear, p + ".mlp.gate_proj", h, f, false));
    mlp->Add("up_proj", leaf(Kind::kLinear, p + ".mlp.up_proj", h, f, false));
    mlp->Add("down_proj", leaf(Kind::kLinear, p + ".mlp.down_proj", f, h, false));
  }
  model->Add("norm", leaf(Kind::kRmsNorm, "model.norm", 0, h, false, eps));
  LayerDecl head = LayerDecl::Of(Kind::kLinear, "lm_head", h, c.vocab_size, false);
  if (c.tie_word_embeddings) head.tied_to = "model.embed_tokens";
  root->Add("lm_head", Module::Leaf(std::move(head)));
  return root;
}

// ShardFormer's LlamaPolicy: 1D with optional sequence parallelism, 2D / 2.5D, and 3D.
class LlamaPolicy : public CausalLmPolicy {
 public:
  LlamaPolicy() : CausalLmPolicy("llama", /*supports_3d=*/true) {}

  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    std::map<std::string, ModulePolicyDescription> policy;
    ModulePolicyDescription& lm = policy["LlamaForCausalLM"];
    ModulePolicyDescription& model = policy["LlamaModel"];
    ModulePolicyDescription& layer = policy["LlamaDecoderLayer"];
    const bool two_d = shard.is_2d();
    const int split = shard.head_split();
    layer.attribute_replacement = {
        {"self_attn.num_heads", static_cast<double>(config.num_heads / split)},
        {"self_attn.num_key_value_heads", static_cast<double>(config.num_kv_heads / split)},
    };
    if (!config.tie_word_embeddings) {
      lm.sub_module_replacement = {
          {"lm_head", shard.is_3d() ? "LMHead3D" : two_d ? "LMHead2D" : "VocabParallelLMHead1D"}};
    }
    if (shard.is_3d()) {
      // o_proj and down_proj are the second linears of their pairs (swap).
      model.sub_module_replacement = {{"embed_tokens", "Embedding3D"}, {"norm", "RMSNorm3D"}};
      layer.sub_module_replacement = {
          {"input_layernorm", "RMSNorm3D"},
          {"post_attention_layernorm", "RMSNorm3D"},
          {"self_attn.q_proj", "Linear3D"},
          {"self_attn.k_proj", "Linear3D"},
          {"self_attn.v_proj", "Linear3D"},
          {"self_attn.o_proj", "Linear3D", {{"swap", 1}}},
          {"mlp.gate_proj", "Linear3D"},
          {"mlp.up_proj", "Linear3D"},
          {"mlp.down_proj", "Linear3D", {{"swap", 1}}},
      };
      return policy;
    }
    if (two_d) {
      model.sub_module_replacement = {{"embed_tokens", "Embedding2D"}, {"norm", "RMSNorm2D"}};
      layer.sub_module_replacement = {
          {"input_layernorm", "RMSNorm2D"}, {"post_attention_layernorm", "RMSNorm2D"},
          {"self_attn.q_proj", "Linear2D"}, {"self_attn.k_proj", "Linear2D"},
          {"self_attn.v_proj", "Linear2D"}, {"self_attn.o_proj", "Linear2D"},
          {"mlp.gate_proj", "Linear2D"},    {"mlp.up_proj", "Linear2D"},
          {"mlp.down_proj", "Linear2D"},
      };
      return policy;
    }
    model.sub_module_replacement = {{"embed_tokens", "VocabParallelEmbedding1D"}};
    layer.sub_module_replacement = {
        {"self_attn.q_proj", "Linear1D_Col"}, {"self_attn.k_proj", "Linear1D_Col"},
        {"self_attn.v_proj", "Linear1D_Col"}, {"self_attn.o_proj", "Linear1D_Row"},
        {"mlp.gate_proj", "Linear1D_Col"},    {"mlp.up_proj", "Linear1D_Col"},
        {"mlp.down_proj", "Linear1D_Row"},
    };
    if (shard.sequence_parallel()) {
      model.sub_module_replacement.push_back({"norm", "Norm1D"});
      model.method_replacement = ModelForward(true);
      layer.sub_module_replacement.push_back({"input_layernorm", "Norm1D"});
      layer.sub_module_replacement.push_back({"post_attention_layernorm", "Norm1D"});
    }
    return policy;
  }
};

}  // namespace

ModelFamily LlamaFamily() {
  ModelFamily f;
  f.base_model_prefix = "model";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new LlamaPolicy()); };
  f.split_stage = SplitStage;
  return f;
}

}  // namespace colod::shardformer
