// OPTForCausalLM (transformers/models/opt/modeling_opt.py), evaluation
// semantics (dropout off, no padding): token embeddings of width
// word_embed_proj_dim (project_in to hidden_size where it differs, as in
// opt-350m), learned positions read at row s + 2 (OPT's offset), decoder
// layers of self-attention (q/k/v/out_proj with biases, q scaled by
// head_dim^-1/2) and an MLP (fc1, ReLU, fc2), each with its LayerNorm before
// it (do_layer_norm_before) or after its residual add (opt-350m), the
// decoder's final LayerNorm (pre-norm models), project_out, and an LM head
// tied to embed_tokens.
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
  ASSIGN_OR_RETURN(int64_t head_dim, self.IntAttr("head_dim"));
  ASSIGN_OR_RETURN(ColoTensor q, self.Call("q_proj", x));
  ASSIGN_OR_RETURN(ColoTensor k, self.Call("k_proj", x));
  ASSIGN_OR_RETURN(ColoTensor v, self.Call("v_proj", x));
  ASSIGN_OR_RETURN(Variable qh, SplitHeads(q, heads, head_dim, "q_proj"));
  ASSIGN_OR_RETURN(Variable kh, SplitHeads(k, heads, head_dim, "k_proj"));
  ASSIGN_OR_RETURN(Variable vh, SplitHeads(v, heads, head_dim, "v_proj"));
  // OPT scales q by head_dim^-1/2 after its bias: the same scores.
  ASSIGN_OR_RETURN(Variable att, nn::CausalAttention(qh, kh, vh, 1.0f / std::sqrt(static_cast<float>(head_dim))));
  const Shape& s = att.value().shape();
  ASSIGN_OR_RETURN(att, nn::Reshape(att, {s[0], s[1], heads * head_dim}));
  return CallWithLocal(self, "out_proj", att, x.process_group());
}

// fc2(act(fc1(x))): ReLU (every published OPT) or GELU, the latter fused with fc1's bias.
absl::StatusOr<ColoTensor> Mlp(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(int64_t act, self.IntAttr("activation"));  // 0 relu, 1 gelu, 2 gelu tanh
  if (act != 0) {
    ASSIGN_OR_RETURN(ColoTensor inner, self.Call("fc1", x, nn::GeluEpilogue(act == 2 ? ops::GeluApprox::kTanh
                                                                                     : ops::GeluApprox::kNone)));
    return self.Call("fc2", inner);
  }
  ASSIGN_OR_RETURN(ColoTensor inner, self.Call("fc1", x));
  ASSIGN_OR_RETURN(inner, MapLocal(inner, [](const Variable& v) { return nn::Relu(v); }));
  return self.Call("fc2", inner);
}

// OPTDecoderLayer. Pre-norm: x + attn(ln(x)), then + fc(ln(.)); post-norm
// (do_layer_norm_before false): ln(x + attn(x)), then ln(. + fc(.)).
absl::StatusOr<ColoTensor> DecoderLayerForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(int64_t pre, self.IntAttr("do_layer_norm_before"));
  if (pre) {
    ASSIGN_OR_RETURN(ColoTensor h, self.Call("self_attn_layer_norm", x));
    ASSIGN_OR_RETURN(ColoTensor a, self.Call("self_attn", h));
    ASSIGN_OR_RETURN(Layer::WithSum x1, self.CallResidual("final_layer_norm", x, a));
    ASSIGN_OR_RETURN(ColoTensor m, Mlp(self, x1.y));
    return AddActivations(x1.sum, m);
  }
  ASSIGN_OR_RETURN(ColoTensor a, self.Call("self_attn", x));
  ASSIGN_OR_RETURN(Layer::WithSum x1, self.CallResidual("self_attn_layer_norm", x, a));
  ASSIGN_OR_RETURN(ColoTensor m, Mlp(self, x1.y));
  ASSIGN_OR_RETURN(Layer::WithSum x2, self.CallResidual("final_layer_norm", x1.y, m));
  return x2.y;
}

// OPTDecoder; with sequence_parallel (the policy's forward replacement) the
// embeddings are split along the sequence over tp before the layers, and
// gathered again before project_out (a replicated layer).
Module::ForwardFn DecoderForward(bool sequence_parallel) {
  return [sequence_parallel](Module& self, const ColoTensor& ids) -> absl::StatusOr<ColoTensor> {
    ASSIGN_OR_RETURN(int64_t offset, self.IntAttr("position_offset"));
    ASSIGN_OR_RETURN(ColoTensor pos_ids, PositionIds(ids, offset));
    ASSIGN_OR_RETURN(ColoTensor x, self.Call("embed_tokens", ids));
    if (self.Find("project_in") != nullptr) {
      ASSIGN_OR_RETURN(x, self.Call("project_in", x));
    }
    ASSIGN_OR_RETURN(ColoTensor where, self.Call("embed_positions", pos_ids));
    ASSIGN_OR_RETURN(x, AddActivations(x, where));
    if (sequence_parallel) {
      ASSIGN_OR_RETURN(x, SplitSequence(x));
    }
    ASSIGN_OR_RETURN(Module * layers, self.Get("layers"));
    ASSIGN_OR_RETURN(x, RunSequential(*layers, x));
    if (self.Find("final_layer_norm") != nullptr) {
      ASSIGN_OR_RETURN(x, self.Call("final_layer_norm", x));
    }
    if (self.Find("project_out") != nullptr) {
      if (sequence_parallel) {
        ASSIGN_OR_RETURN(x, x.ToReplicate());
      }
      ASSIGN_OR_RETURN(x, self.Call("project_out", x));
    }
    return x;
  };
}

absl::StatusOr<ColoTensor> ModelForward(Module& self, const ColoTensor& ids) { return self.Call("decoder", ids); }

absl::StatusOr<ColoTensor> CausalLmForward(Module& self, const ColoTensor& ids) {
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("model", ids));
  return self.Call("lm_head", h);
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) {
  int activation = 0;
  if (c.activation == "relu") {
    activation = 0;
  } else if (c.activation == "gelu") {
    activation = 1;
  } else if (c.activation == "gelu_new" || c.activation == "gelu_pytorch_tanh") {
    activation = 2;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("activation_function \"", c.activation, "\" is not one of relu, gelu, gelu_new"));
  }
  const int64_t h = c.hidden_size, e = c.embed_dim, f = c.intermediate_size;
  const float eps = static_cast<float>(c.norm_eps);
  const bool bias = c.linear_bias;
  auto leaf = [](Kind kind, const std::string& prefix, int64_t in, int64_t out, bool b, float ln_eps = 1e-5f) {
    return Module::Leaf(LayerDecl::Of(kind, prefix, in, out, b, ln_eps));
  };
  auto root = std::make_unique<Module>("OPTForCausalLM", CausalLmForward);
  Module* model = root->Add("model", std::make_unique<Module>("OPTModel", ModelForward));
  Module* decoder = model->Add("decoder", std::make_unique<Module>("OPTDecoder", DecoderForward(false)));
  decoder->SetAttr("position_offset", static_cast<double>(c.position_offset));
  decoder->Add("embed_tokens", leaf(Kind::kEmbedding, "model.decoder.embed_tokens", c.vocab_size, e, false));
  decoder->Add("embed_positions",
               leaf(Kind::kEmbedding, "model.decoder.embed_positions", c.max_positions + c.position_offset, h, false));
  if (e != h) {
    decoder->Add("project_in", leaf(Kind::kLinear, "model.decoder.project_in", e, h, false));
  }
  Module* layers = decoder->Add("layers", std::make_unique<Module>("ModuleList", nullptr));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.decoder.layers.", i);
    Module* layer = layers->Add(absl::StrCat(i), std::make_unique<Module>("OPTDecoderLayer", DecoderLayerForward));
    layer->SetAttr("do_layer_norm_before", c.norm_before ? 1 : 0);
    layer->SetAttr("activation", activation);
    Module* attn = layer->Add("self_attn", std::make_unique<Module>("OPTAttention", AttentionForward));
    attn->SetAttr("num_heads", static_cast<double>(c.num_heads));
    attn->SetAttr("head_dim", static_cast<double>(c.head_dim()));
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "out_proj"}) {
      attn->Add(proj, leaf(Kind::kLinear, absl::StrCat(p, ".self_attn.", proj), h, h, bias));
    }
    layer->Add("self_attn_layer_norm", leaf(Kind::kLayerNorm, p + ".self_attn_layer_norm", 0, h, true, eps));
    layer->Add("fc1", leaf(Kind::kLinear, p + ".fc1", h, f, bias));
    layer->Add("fc2", leaf(Kind::kLinear, p + ".fc2", f, h, bias));
    layer->Add("final_layer_norm", leaf(Kind::kLayerNorm, p + ".final_layer_norm", 0, h, true, eps));
  }
  if (c.final_norm) {
    decoder->Add("final_layer_norm", leaf(Kind::kLayerNorm, "model.decoder.final_layer_norm", 0, h, true, eps));
  }
  if (e != h) {
    decoder->Add("project_out", leaf(Kind::kLinear, "model.decoder.project_out", h, e, false));
  }
  LayerDecl head = LayerDecl::Of(Kind::kLinear, "lm_head", e, c.vocab_size, false);
  if (c.tie_word_embeddings) head.tied_to = "model.decoder.embed_tokens";
  root->Add("lm_head", Module::Leaf(std::move(head)));
  return root;
}

// ShardFormer's OPTPolicy: 1D (q/k/v and fc1 column-parallel, out_proj and
// fc2 row-parallel, vocab-parallel embeddings and head) with optional
// sequence parallelism, and 2D / 2.5D. project_in/out stay replicated in 1D.
class OptPolicy : public CausalLmPolicy {
 public:
  OptPolicy() : CausalLmPolicy("opt") {}

  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    std::map<std::string, ModulePolicyDescription> policy;
    ModulePolicyDescription& lm = policy["OPTForCausalLM"];
    ModulePolicyDescription& decoder = policy["OPTDecoder"];
    ModulePolicyDescription& layer = policy["OPTDecoderLayer"];
    const bool two_d = shard.is_2d();
    layer.attribute_replacement = {{"self_attn.num_heads", static_cast<double>(config.num_heads / shard.head_split())}};
    if (!config.tie_word_embeddings) {
      lm.sub_module_replacement = {{"lm_head", two_d ? "LMHead2D" : "VocabParallelLMHead1D"}};
    }
    if (two_d) {
      decoder.sub_module_replacement = {
          {"embed_tokens", "Embedding2D"},
          {"embed_positions", "Embedding2D"},
          {"project_in", "Linear2D", {}, /*ignore_if_not_exist=*/true},
          {"project_out", "Linear2D", {}, true},
          {"final_layer_norm", "LayerNorm2D", {}, true},
      };
      layer.sub_module_replacement = {
          {"self_attn.q_proj", "Linear2D"}, {"self_attn.k_proj", "Linear2D"},
          {"self_attn.v_proj", "Linear2D"}, {"self_attn.out_proj", "Linear2D"},
          {"fc1", "Linear2D"},              {"fc2", "Linear2D"},
          {"self_attn_layer_norm", "LayerNorm2D"}, {"final_layer_norm", "LayerNorm2D"},
      };
      return policy;
    }
    decoder.sub_module_replacement = {{"embed_tokens", "VocabParallelEmbedding1D"}};
    layer.sub_module_replacement = {
        {"self_attn.q_proj", "Linear1D_Col"}, {"self_attn.k_proj", "Linear1D_Col"},
        {"self_attn.v_proj", "Linear1D_Col"}, {"self_attn.out_proj", "Linear1D_Row"},
        {"fc1", "Linear1D_Col"},              {"fc2", "Linear1D_Row"},
    };
    if (shard.sequence_parallel()) {
      decoder.sub_module_replacement.push_back({"final_layer_norm", "Norm1D", {}, true});
      decoder.method_replacement = DecoderForward(true);
      layer.sub_module_replacement.push_back({"self_attn_layer_norm", "Norm1D"});
      layer.sub_module_replacement.push_back({"final_layer_norm", "Norm1D"});
    }
    return policy;
  }
};

}  // namespace

ModelFamily OptFamily() {
  ModelFamily f;
  f.base_model_prefix = "model";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new OptPolicy()); };
  return f;
}

}  // namespace colod::shardformer
