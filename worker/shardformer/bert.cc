// BertForMaskedLM (transformers/models/bert/modeling_bert.py), evaluation
// semantics (dropout off), every position attending to every other (no
// padding mask): embeddings (word + position + token type 0, LayerNorm),
// post-norm encoder layers (self-attention with biases, output dense +
// residual + LayerNorm, intermediate dense + GELU, output dense + residual +
// LayerNorm), and the MLM head (transform dense + GELU + LayerNorm, decoder
// tied to the word embeddings, cls.predictions.bias).
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/models.h"

namespace colod::shardformer {
namespace {

using Kind = LayerDecl::Kind;

ops::GeluApprox Approx(Module& m) {
  auto tanh = m.IntAttr("gelu_tanh");
  return tanh.ok() && *tanh ? ops::GeluApprox::kTanh : ops::GeluApprox::kNone;
}

absl::StatusOr<ColoTensor> EmbeddingsForward(Module& self, const ColoTensor& ids) {
  ASSIGN_OR_RETURN(ColoTensor pos_ids, PositionIds(ids));
  // token_type_ids: 0
  ASSIGN_OR_RETURN(Tensor types, Tensor::Zeros(ids.local().shape(), DType::kI64, ids.local().device()));
  ASSIGN_OR_RETURN(ColoTensor type_ids, ColoTensor::FromLocal(types, ids.spec(), ids.process_group()));
  ASSIGN_OR_RETURN(ColoTensor words, self.Call("word_embeddings", ids));
  ASSIGN_OR_RETURN(ColoTensor where, self.Call("position_embeddings", pos_ids));
  ASSIGN_OR_RETURN(ColoTensor kind, self.Call("token_type_embeddings", type_ids));
  ASSIGN_OR_RETURN(ColoTensor x, AddActivations(words, where));
  ASSIGN_OR_RETURN(x, AddActivations(x, kind));
  return self.Call("LayerNorm", x);
}

// BertLayer, attention included (its sub-modules keep the HF names).
absl::StatusOr<ColoTensor> LayerForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(Module * attn, self.Get("attention.self"));
  ASSIGN_OR_RETURN(int64_t heads, attn->IntAttr("num_attention_heads"));
  ASSIGN_OR_RETURN(int64_t head_dim, attn->IntAttr("attention_head_size"));
  Variable qkv[3];
  const char* names[] = {"query", "key", "value"};
  for (int i = 0; i < 3; ++i) {
    ASSIGN_OR_RETURN(ColoTensor t, attn->Call(names[i], x));
    ASSIGN_OR_RETURN(qkv[i], SplitHeads(t, heads, head_dim, names[i]));
  }
  ASSIGN_OR_RETURN(Variable ctx, nn::Attention(qkv[0], qkv[1], qkv[2],
                                               1.0f / std::sqrt(static_cast<float>(head_dim)), /*causal=*/false));
  const Shape& cs = ctx.value().shape();
  ASSIGN_OR_RETURN(ctx, nn::Reshape(ctx, {cs[0], cs[1], heads * head_dim}));
  ASSIGN_OR_RETURN(ColoTensor projected, CallWithLocal(self, "attention.output.dense", ctx, x.process_group()));
  ASSIGN_OR_RETURN(Layer::WithSum attended_sum, self.CallResidual("attention.output.LayerNorm", projected, x));
  const ColoTensor& attended = attended_sum.y;
  ASSIGN_OR_RETURN(Module * intermediate, self.Get("intermediate"));
  ASSIGN_OR_RETURN(ColoTensor inner,  // the dense's bias and the GELU fused
                   self.Call("intermediate.dense", attended, nn::GeluEpilogue(Approx(*intermediate))));
  ASSIGN_OR_RETURN(ColoTensor out, self.Call("output.dense", inner));
  ASSIGN_OR_RETURN(Layer::WithSum out_sum, self.CallResidual("output.LayerNorm", out, attended));
  return out_sum.y;
}

absl::StatusOr<ColoTensor> ModelForward(Module& self, const ColoTensor& ids) {
  ASSIGN_OR_RETURN(ColoTensor x, self.Call("embeddings", ids));
  ASSIGN_OR_RETURN(Module * layers, self.Get("encoder.layer"));
  return RunSequential(*layers, x);
}

absl::StatusOr<ColoTensor> PredictionHeadForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(Module * transform, self.Get("transform"));
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("transform.dense", x, nn::GeluEpilogue(Approx(*transform))));
  ASSIGN_OR_RETURN(h, self.Call("transform.LayerNorm", h));
  ASSIGN_OR_RETURN(ColoTensor logits, self.Call("decoder", h));
  return self.Call("bias", logits);
}

absl::StatusOr<ColoTensor> MaskedLmForward(Module& self, const ColoTensor& ids) {
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("bert", ids));
  return self.Call("cls.predictions", h);
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) {
  if (c.activation != "gelu" && c.activation != "gelu_new" && c.activation != "gelu_pytorch_tanh") {
    return absl::InvalidArgumentError(absl::StrCat("hidden_act \"", c.activation, "\" is not one of gelu, gelu_new"));
  }
  const int64_t h = c.hidden_size, f = c.intermediate_size;
  const float eps = static_cast<float>(c.norm_eps);
  const double tanh = c.activation == "gelu" ? 0 : 1;
  auto leaf = [](Kind kind, const std::string& prefix, int64_t in, int64_t out, bool bias = true, float e = 1e-5f) {
    return Module::Leaf(LayerDecl::Of(kind, prefix, in, out, bias, e));
  };
  auto module = [](const char* cls, Module::ForwardFn fn = nullptr) {
    return std::make_unique<Module>(cls, std::move(fn));
  };
  auto root = module("BertForMaskedLM", MaskedLmForward);
  Module* bert = root->Add("bert", module("BertModel", ModelForward));
  Module* emb = bert->Add("embeddings", module("BertEmbeddings", EmbeddingsForward));
  emb->Add("word_embeddings", leaf(Kind::kEmbedding, "bert.embeddings.word_embeddings", c.vocab_size, h));
  emb->Add("position_embeddings", leaf(Kind::kEmbedding, "bert.embeddings.position_embeddings", c.max_positions, h));
  emb->Add("token_type_embeddings",
           leaf(Kind::kEmbedding, "bert.embeddings.token_type_embeddings", c.type_vocab_size, h));
  emb->Add("LayerNorm", leaf(Kind::kLayerNorm, "bert.embeddings.LayerNorm", 0, h, true, eps));
  Module* encoder = bert->Add("encoder", module("BertEncoder"));
  Module* layers = encoder->Add("layer", module("ModuleList"));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("bert.encoder.layer.", i);
    Module* layer = layers->Add(absl::StrCat(i), module("BertLayer", LayerForward));
    Module* attention = layer->Add("attention", module("BertAttention"));
    Module* self = attention->Add("self", module("BertSelfAttention"));
    self->SetAttr("num_attention_heads", static_cast<double>(c.num_heads));
    self->SetAttr("attention_head_size", static_cast<double>(c.head_dim()));
    for (const char* name : {"query", "key", "value"}) {
      self->Add(name, leaf(Kind::kLinear, absl::StrCat(p, ".attention.self.", name), h, h));
    }
    Module* out = attention->Add("output", module("BertSelfOutput"));
    out->Add("dense", leaf(Kind::kLinear, p + ".attention.output.dense", h, h));
    out->Add("LayerNorm", leaf(Kind::kLayerNorm, p + ".attention.output.LayerNorm", 0, h, true, eps));
    Module* intermediate = layer->Add("intermediate", module("BertIntermediate"));
    intermediate->SetAttr("gelu_tanh", tanh);
    intermediate->Add("dense", leaf(Kind::kLinear, p + ".intermediate.dense", h, f));
    Module* output = layer->Add("output", module("BertOutput"));
    output->Add("dense", leaf(Kind::kLinear, p + ".output.dense", f, h));
    output->Add("LayerNorm", leaf(Kind::kLayerNorm, p + ".output.LayerNorm", 0, h, true, eps));
  }
  Module* cls = root->Add("cls", module("BertOnlyMLMHead"));
  Module* predictions = cls->Add("predictions", module("BertLMPredictionHead", PredictionHeadForward));
  Module* transform = predictions->Add("transform", module("BertPredictionHeadTransform"));
  transform->SetAttr("gelu_tanh", tanh);
  transform->Add("dense", leaf(Kind::kLinear, "cls.predictions.transform.dense", h, h));
  transform->Add("LayerNorm", leaf(Kind::kLayerNorm, "cls.predictions.transform.LayerNorm", 0, h, true, eps));
  LayerDecl decoder = LayerDecl::Of(Kind::kLinear, "cls.predictions.decoder", h, c.vocab_size, /*bias=*/false);
  decoder.tied_to = "bert.embeddings.word_embeddings";
  predictions->Add("decoder", Module::Leaf(std::move(decoder)));
  predictions->Add("bias", leaf(Kind::kBias, "cls.predictions", 0, c.vocab_size));
  return root;
}

// ShardFormer's BertPolicy. 1D: vocab-parallel word embeddings and tied
// decoder (with its bias split alike), column-parallel q/k/v and
// intermediate, row-parallel attention output and output dense. 3D: every
// table an Embedding3D, every norm a LayerNorm3D; q/k/v and the
// intermediate dense take the residual stream's spec and the linears after
// them (swap) give it back (worker/nn/linear3d.h); the MLM transform's
// dense leaves its output in the swapped spec, which its LayerNorm3D moves
// back to the stream's (one redistribution); the tied decoder is the word
// table's head and the vocabulary bias a Bias3D.
class BertPolicy : public Policy {
 public:
  absl::Status Preprocess(const ModelConfig& config, ShardConfig& shard) override {
    RETURN_IF_ERROR(CheckShardable(config, shard.layout));  // 1d and 3d
    if (shard.sequence_parallel()) {
      return absl::InvalidArgumentError("the bert policy does not support sequence_parallel");
    }
    if (shard.layout.gather_output()) {
      return absl::InvalidArgumentError("the bert policy keeps the logits vocab-parallel; unset gather_output");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    std::map<std::string, ModulePolicyDescription> policy;
    ModulePolicyDescription& layer = policy["BertLayer"];
    layer.attribute_replacement = {
        {"attention.self.num_attention_heads", static_cast<double>(config.num_heads / shard.head_split())}};
    if (shard.is_3d()) {
      policy["BertEmbeddings"].sub_module_replacement = {{"word_embeddings", "Embedding3D"},
                                                         {"position_embeddings", "Embedding3D"},
                                                         {"token_type_embeddings", "Embedding3D"},
                                                         {"LayerNorm", "LayerNorm3D"}};
      layer.sub_module_replacement = {
          {"attention.self.query", "Linear3D"},
          {"attention.self.key", "Linear3D"},
          {"attention.self.value", "Linear3D"},
          {"attention.output.dense", "Linear3D", {{"swap", 1}}},
          {"attention.output.LayerNorm", "LayerNorm3D"},
          {"intermediate.dense", "Linear3D"},
          {"output.dense", "Linear3D", {{"swap", 1}}},
          {"output.LayerNorm", "LayerNorm3D"},
      };
      policy["BertLMPredictionHead"].sub_module_replacement = {
          {"transform.dense", "Linear3D"}, {"transform.LayerNorm", "LayerNorm3D"}, {"bias", "Bias3D"}};
      return policy;
    }
    policy["BertEmbeddings"].sub_module_replacement = {{"word_embeddings", "VocabParallelEmbedding1D"}};
    layer.sub_module_replacement = {
        {"attention.self.query", "Linear1D_Col"}, {"attention.self.key", "Linear1D_Col"},
        {"attention.self.value", "Linear1D_Col"}, {"attention.output.dense", "Linear1D_Row"},
        {"intermediate.dense", "Linear1D_Col"},   {"output.dense", "Linear1D_Row"},
    };
    policy["BertLMPredictionHead"].sub_module_replacement = {{"bias", "VocabParallelBias1D"}};
    return policy;
  }

  absl::Status Postprocess(Module& model, const ModelConfig&, const ShardConfig&) override {
    return TieLmHeads(model);
  }
};

}  // namespace

ModelFamily BertFamily() {
  ModelFamily f;
  f.base_model_prefix = "bert";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new BertPolicy()); };
  return f;
}

}  // namespace colod::shardformer
