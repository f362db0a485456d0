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
#include "worker/shardformer/table_family.h"

namespace colod::shardformer {
namespace {

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

// The embeddings are replicated (native in every mode); the stream enters
// the layers in the spec the first layer's norm takes: as it is in 1D,
// split along the sequence with sequence parallelism, the 2D or 3D
// activation spec (a rank keeps its block; the backward gathers). A
// pipeline stage's: the embeddings on the first stage, the final norm on
// the last (the classifier, the root's, too).
Module::ForwardFn ModelForward(PipelineStage stage) {
  return [stage](Module& self, const ColoTensor& input) -> absl::StatusOr<ColoTensor> {
    ColoTensor x = input;
    if (stage.first()) {
      ASSIGN_OR_RETURN(x, self.Call("embeddings", input));
      ASSIGN_OR_RETURN(x, ToInputOf(self, "encoder.layer.0.layernorm_before", x));
    }
    ASSIGN_OR_RETURN(Module * layers, self.Get("encoder.layer"));
    ASSIGN_OR_RETURN(x, RunSequential(*layers, x));
    if (!stage.last()) return x;
    return self.Call("layernorm", x);
  };
}

// The classifier (replicated) on the CLS token, whole on every rank:
// [B, 1, num_labels].
absl::StatusOr<ColoTensor> ClassificationForward(Module& self, const ColoTensor& images) {
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("vit", images));
  if (SplitsDim(h.spec(), 1)) {
    ASSIGN_OR_RETURN(h, h.ToReplicate());  // sequence parallelism: position 0 is on one rank
  }
  ASSIGN_OR_RETURN(Variable cls, nn::Narrow(h.variable(), 1, 0, 1));
  ASSIGN_OR_RETURN(ColoTensor first, ColoTensor::FromLocal(cls, h.spec(), h.process_group()));
  ASSIGN_OR_RETURN(first, first.ToReplicate());  // 2D / 3D: the rows and features gathered
  return self.Call("classifier", first);
}

// ViTForImageClassification's names around its layer table
// (spec/plan.cc): the embeddings and the encoder's layers under vit, the
// classifier on the root.
const TableFamily& Vit() {
  static const TableFamily* const f = [] {
    auto* d = new TableFamily;
    d->root_class = "ViTForImageClassification";
    d->root_forward = ClassificationForward;
    d->base = "vit";
    d->base_class = "ViTModel";
    d->model_forward = [](bool, PipelineStage stage) { return ModelForward(stage); };
    d->layer_lists = {{"encoder.layer", "ViTLayer", LayerForward}};
    const std::string l = "vit.encoder.layer.*";
    d->containers = {
        {"vit.embeddings", "ViTEmbeddings", EmbeddingsForward},
        {"vit.embeddings.patch_embeddings", "ViTPatchEmbeddings", nullptr},
        {"vit.encoder", "ViTEncoder", nullptr},
        {l + ".attention", "ViTAttention", nullptr},
        {l + ".attention.attention", "ViTSelfAttention", nullptr},
        {l + ".attention.output", "ViTSelfOutput", nullptr},
        {l + ".intermediate", "ViTIntermediate", nullptr},
        {l + ".output", "ViTOutput", nullptr},
    };
    d->head = "classifier";
    d->configure_layer = [](Module& layer, const ModelConfig& c) {
      Module* self = layer.Find("attention.attention");
      self->SetAttr("num_attention_heads", static_cast<double>(c.num_heads));
      self->SetAttr("attention_head_size", static_cast<double>(c.head_dim()));
      layer.Find("intermediate")->SetAttr("gelu_tanh", c.activation == "gelu" ? 0 : 1);
    };
    return d;
  }();
  return *f;
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) {
  if (c.activation != "gelu" && c.activation != "gelu_new" && c.activation != "gelu_pytorch_tanh") {
    return absl::InvalidArgumentError(absl::StrCat("hidden_act \"", c.activation, "\" is not one of gelu, gelu_new"));
  }
  return BuildFromTable(Vit(), c);
}

// ShardFormer's ViTPolicy, 1D: query/key/value and intermediate.dense
// column-parallel, attention.output.dense and output.dense row-parallel,
// the heads split over tp; the embeddings, norms and the (small) classifier
// replicated.
class VitPolicy : public Policy {
 public:
  absl::Status Preprocess(const ModelConfig& config, ShardConfig& shard) override {
    RETURN_IF_ERROR(CheckShardable(config, shard.layout));  // the modes spec's LayoutsOf gives vit
    return absl::OkStatus();
  }
  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    ASSIGN_OR_RETURN(auto policy, TablePolicy(Vit(), config, shard));
    policy["ViTLayer"].attribute_replacement = {
        {"attention.attention.num_attention_heads", static_cast<double>(config.num_heads / shard.head_split())}};
    return policy;
  }
};

}  // namespace

ModelFamily VitFamily() {
  ModelFamily f;
  f.base_model_prefix = "vit";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new VitPolicy()); };
  f.split_stage = [](Module& root, const PipelineStage& stage) { return SplitTableStage(Vit(), root, stage); };
  return f;
}

}  // namespace colod::shardformer
