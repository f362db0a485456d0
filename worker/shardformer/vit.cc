// ViTForImageClassification (transformers/models/vit/modeling_vit.py),
// evaluation semantics (dropout off, no interpolation of positions): the
// patch embedding (a Conv2d with kernel = stride = patch_size, computed as a
// linear over the flattened patches), the CLS token before the patches,
// learned positions, pre-norm encoder layers (bidirectional self-attention
// with biases, GELU MLP), the final LayerNorm, and the classifier on the CLS
// token. Its logits are [B, 1, num_labels]: the one position the loss reads
// (ModelConfig::vocab_size is num_labels).
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/models.h"

namespace colod::shardformer {
namespace {

using Kind = LayerDecl::Kind;

// `t` [1, ...] repeated `batch` times along dim 0 (each copy on the tape:
// the gradient of t sums theirs).
absl::StatusOr<Variable> RepeatBatch(const Variable& t, int64_t batch) {
  if (batch == 1) return t;
  return nn::Cat(std::vector<Variable>(batch, t), 0);
}

// ViTEmbeddings: [CLS; patches] + positions.
absl::StatusOr<ColoTensor> EmbeddingsForward(Module& self, const ColoTensor& images) {
  ASSIGN_OR_RETURN(ColoTensor patches, self.Call("patch_embeddings.projection", images));
  ASSIGN_OR_RETURN(ColoTensor cls, self.Call("cls_token", images));
  ASSIGN_OR_RETURN(ColoTensor positions, self.Call("position_embeddings", images));
  const int64_t batch = patches.local().shape()[0];
  ASSIGN_OR_RETURN(Variable cls_rows, RepeatBatch(cls.variable(), batch));
  ASSIGN_OR_RETURN(Variable x, nn::Cat({cls_rows, patches.variable()}, 1));
  if (positions.local().shape() != Shape{1, x.value().shape()[1], x.value().shape()[2]}) {
    return absl::InvalidArgumentError(absl::StrCat("position_embeddings ", ShapeToString(positions.local().shape()),
                                                   " do not fit ", x.value().shape()[1] - 1, " patches"));
  }
  ASSIGN_OR_RETURN(Variable where, RepeatBatch(positions.variable(), batch));
  ASSIGN_OR_RETURN(x, Add(x, where));
  return ColoTensor::FromLocal(x, patches.spec(), patches.process_group());
}

// ViTLayer, attention included (its sub-modules keep the HF names):
// x + attention(layernorm_before(x)), then + MLP(layernorm_after(.)).
absl::StatusOr<ColoTensor> LayerForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("layernorm_before", x));
  ASSIGN_OR_RETURN(Module * attn, self.Get("attention.attention"));
  ASSIGN_OR_RETURN(int64_t heads, attn->IntAttr("num_attention_heads"));
  ASSIGN_OR_RETURN(int64_t head_dim, attn->IntAttr("attention_head_size"));
  Variable qkv[3];
  const char* names[] = {"query", "key", "value"};
  for (int i = 0; i < 3; ++i) {
    ASSIGN_OR_RETURN(ColoTensor t, attn->Call(names[i], h));
    ASSIGN_OR_RETURN(qkv[i], SplitHeads(t, heads, head_dim, names[i]));
  }
  ASSIGN_OR_RETURN(Variable ctx, nn::Attention(qkv[0], qkv[1], qkv[2],
                                               1.0f / std::sqrt(static_cast<float>(head_dim)), /*causal=*/false));
  const Shape& s = ctx.value().shape();
  ASSIGN_OR_RETURN(ctx, nn::Reshape(ctx, {s[0], s[1], heads * head_dim}));
  ASSIGN_OR_RETURN(ColoTensor a, CallWithLocal(self, "attention.output.dense", ctx, x.process_group()));
  ASSIGN_OR_RETURN(Layer::WithSum x1, self.CallResidual("layernorm_after", x, a));
  ASSIGN_OR_RETURN(Module * intermediate, self.Get("intermediate"));
  ASSIGN_OR_RETURN(int64_t tanh, intermediate->IntAttr("gelu_tanh"));
  ASSIGN_OR_RETURN(ColoTensor inner, self.Call("intermediate.dense", x1.y,
                                               nn::GeluEpilogue(tanh ? ops::GeluApprox::kTanh : ops::GeluApprox::kNone)));
  ASSIGN_OR_RETURN(ColoTensor out, self.Call("output.dense", inner));
  return AddActivations(x1.sum, out);
}

absl::StatusOr<ColoTensor> ModelForward(Module& self, const ColoTensor& images) {
  ASSIGN_OR_RETURN(ColoTensor x, self.Call("embeddings", images));
  ASSIGN_OR_RETURN(Module * layers, self.Get("encoder.layer"));
  ASSIGN_OR_RETURN(x, RunSequential(*layers, x));
  return self.Call("layernorm", x);
}

// The classifier on the CLS token: [B, 1, num_labels].
absl::StatusOr<ColoTensor> ClassificationForward(Module& self, const ColoTensor& images) {
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("vit", images));
  ASSIGN_OR_RETURN(Variable cls, nn::Narrow(h.variable(), 1, 0, 1));
  ASSIGN_OR_RETURN(ColoTensor first, ColoTensor::FromLocal(cls, h.spec(), h.process_group()));
  return self.Call("classifier", first);
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) {
  if (c.activation != "gelu" && c.activation != "gelu_new" && c.activation != "gelu_pytorch_tanh") {
    return absl::InvalidArgumentError(absl::StrCat("hidden_act \"", c.activation, "\" is not one of gelu, gelu_new"));
  }
  const int64_t h = c.hidden_size, f = c.intermediate_size, p = c.patch_size, ch = c.num_channels;
  const int64_t patches = (c.image_size / p) * (c.image_size / p);
  const float eps = static_cast<float>(c.norm_eps);
  auto leaf = [](Kind kind, const std::string& prefix, int64_t in, int64_t out, bool bias, float ln_eps = 1e-5f) {
    return Module::Leaf(LayerDecl::Of(kind, prefix, in, out, bias, ln_eps));
  };
  auto tensor = [](Kind kind, const std::string& prefix, Shape shape, int64_t in = 0, int64_t out = 0) {
    LayerDecl d = LayerDecl::Of(kind, prefix, in, out, kind == Kind::kPatchEmbedding);
    d.shape = std::move(shape);
    return Module::Leaf(std::move(d));
  };
  auto root = std::make_unique<Module>("ViTForImageClassification", ClassificationForward);
  Module* vit = root->Add("vit", std::make_unique<Module>("ViTModel", ModelForward));
  Module* emb = vit->Add("embeddings", std::make_unique<Module>("ViTEmbeddings", EmbeddingsForward));
  emb->Add("cls_token", tensor(Kind::kParameter, "vit.embeddings.cls_token", {1, 1, h}));
  emb->Add("position_embeddings", tensor(Kind::kParameter, "vit.embeddings.position_embeddings", {1, patches + 1, h}));
  Module* patch = emb->Add("patch_embeddings", std::make_unique<Module>("ViTPatchEmbeddings", nullptr));
  patch->Add("projection", tensor(Kind::kPatchEmbedding, "vit.embeddings.patch_embeddings.projection", {h, ch, p, p},
                                  ch * p * p, h));
  Module* layers = vit->Add("encoder", std::make_unique<Module>("ViTEncoder", nullptr))
                       ->Add("layer", std::make_unique<Module>("ModuleList", nullptr));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string b = absl::StrCat("vit.encoder.layer.", i);
    Module* layer = layers->Add(absl::StrCat(i), std::make_unique<Module>("ViTLayer", LayerForward));
    layer->Add("layernorm_before", leaf(Kind::kLayerNorm, b + ".layernorm_before", 0, h, true, eps));
    Module* attention = layer->Add("attention", std::make_unique<Module>("ViTAttention", nullptr));
    Module* self_attn = attention->Add("attention", std::make_unique<Module>("ViTSelfAttention", nullptr));
    self_attn->SetAttr("num_attention_heads", static_cast<double>(c.num_heads));
    self_attn->SetAttr("attention_head_size", static_cast<double>(c.head_dim()));
    for (const char* name : {"query", "key", "value"}) {
      self_attn->Add(name, leaf(Kind::kLinear, absl::StrCat(b, ".attention.attention.", name), h, h, c.linear_bias));
    }
    attention->Add("output", std::make_unique<Module>("ViTSelfOutput", nullptr))
        ->Add("dense", leaf(Kind::kLinear, b + ".attention.output.dense", h, h, true));
    layer->Add("layernorm_after", leaf(Kind::kLayerNorm, b + ".layernorm_after", 0, h, true, eps));
    Module* intermediate = layer->Add("intermediate", std::make_unique<Module>("ViTIntermediate", nullptr));
    intermediate->SetAttr("gelu_tanh", c.activation == "gelu" ? 0 : 1);
    intermediate->Add("dense", leaf(Kind::kLinear, b + ".intermediate.dense", h, f, true));
    layer->Add("output", std::make_unique<Module>("ViTOutput", nullptr))
        ->Add("dense", leaf(Kind::kLinear, b + ".output.dense", f, h, true));
  }
  vit->Add("layernorm", leaf(Kind::kLayerNorm, "vit.layernorm", 0, h, true, eps));
  root->Add("classifier", leaf(Kind::kLinear, "classifier", h, c.vocab_size, true));
  return root;
}

// ShardFormer's ViTPolicy, 1D: query/key/value and intermediate.dense
// column-parallel, attention.output.dense and output.dense row-parallel,
// the heads split over tp; the embeddings, norms and the (small) classifier
// replicated.
class VitPolicy : public Policy {
 public:
  absl::Status Preprocess(const ModelConfig& config, ShardConfig& shard) override {
    RETURN_IF_ERROR(CheckShardable(config, shard.layout));
    if (shard.sequence_parallel()) return absl::InvalidArgumentError("the vit policy has no sequence_parallel");
    return absl::OkStatus();
  }
  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    std::map<std::string, ModulePolicyDescription> policy;
    ModulePolicyDescription& layer = policy["ViTLayer"];
    layer.attribute_replacement = {
        {"attention.attention.num_attention_heads", static_cast<double>(config.num_heads / shard.head_split())}};
    layer.sub_module_replacement = {
        {"attention.attention.query", "Linear1D_Col"}, {"attention.attention.key", "Linear1D_Col"},
        {"attention.attention.value", "Linear1D_Col"}, {"attention.output.dense", "Linear1D_Row"},
        {"intermediate.dense", "Linear1D_Col"},        {"output.dense", "Linear1D_Row"},
    };
    return policy;
  }
};

}  // namespace

ModelFamily VitFamily() {
  ModelFamily f;
  f.base_model_prefix = "vit";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new VitPolicy()); };
  return f;
}

}  // namespace colod::shardformer
