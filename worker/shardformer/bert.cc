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
#include "worker/shardformer/table_family.h"

namespace colod::shardformer {
namespace {

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

// With sequence parallelism the embeddings (their LayerNorm included) are
// whole and the stream enters the layers split along the sequence, as the
// first layer's norm takes it. A pipeline stage's: the embeddings on the
// first stage (the MLM head, the root's, on the last).
Module::ForwardFn ModelForward(PipelineStage stage) {
  return [stage](Module& self, const ColoTensor& input) -> absl::StatusOr<ColoTensor> {
    ColoTensor x = input;
    if (stage.first()) {
      ASSIGN_OR_RETURN(x, self.Call("embeddings", input));
      ASSIGN_OR_RETURN(x, ToInputOf(self, "encoder.layer.0.attention.output.LayerNorm", x));
    }
    ASSIGN_OR_RETURN(Module * layers, self.Get("encoder.layer"));
    return RunSequential(*layers, x);
  };
}

// The MLM transform (replicated in 1D) runs on the whole sequence: with
// sequence parallelism the stream is gathered before it, and the decoder,
// tied to the vocabulary-parallel table, takes its input split again (its
// forward gathers it: Linear1D_Col with sequence parallelism).
absl::StatusOr<ColoTensor> PredictionHeadForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(Module * transform, self.Get("transform"));
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("transform.dense", x, nn::GeluEpilogue(Approx(*transform))));
  ASSIGN_OR_RETURN(h, self.Call("transform.LayerNorm", h));
  ASSIGN_OR_RETURN(h, ToInputOf(self, "decoder", h));
  ASSIGN_OR_RETURN(ColoTensor logits, self.Call("decoder", h));
  return self.Call("bias", logits);
}

absl::StatusOr<ColoTensor> MaskedLmForward(Module& self, const ColoTensor& ids) {
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("bert", ids));
  if (SplitsDim(h.spec(), 1)) {
    ASSIGN_OR_RETURN(h, h.ToReplicate());  // sequence parallelism: the whole sequence for the transform
  }
  return self.Call("cls.predictions", h);
}

// BertForMaskedLM's names around its layer table (spec/plan.cc): the
// embeddings and the encoder's layers under bert, the MLM head under cls.
const TableFamily& Bert() {
  static const TableFamily* const f = [] {
    auto* d = new TableFamily;
    d->root_class = "BertForMaskedLM";
    d->root_forward = MaskedLmForward;
    d->base = "bert";
    d->base_class = "BertModel";
    d->model_forward = [](bool, PipelineStage stage) { return ModelForward(stage); };
    d->layer_lists = {{"encoder.layer", "BertLayer", LayerForward}};
    const std::string l = "bert.encoder.layer.*";
    d->containers = {
        {"bert.embeddings", "BertEmbeddings", EmbeddingsForward},
        {"bert.encoder", "BertEncoder", nullptr},
        {l + ".attention", "BertAttention", nullptr},
        {l + ".attention.self", "BertSelfAttention", nullptr},
        {l + ".attention.output", "BertSelfOutput", nullptr},
        {l + ".intermediate", "BertIntermediate", nullptr},
        {l + ".output", "BertOutput", nullptr},
        {"cls", "BertOnlyMLMHead", nullptr},
        {"cls.predictions", "BertLMPredictionHead", PredictionHeadForward},
        {"cls.predictions.transform", "BertPredictionHeadTransform", nullptr},
    };
    d->head = "cls.predictions.decoder";
    d->configure_layer = [](Module& layer, const ModelConfig& c) {
      Module* self = layer.Find("attention.self");
      self->SetAttr("num_attention_heads", static_cast<double>(c.num_heads));
      self->SetAttr("attention_head_size", static_cast<double>(c.head_dim()));
      layer.Find("intermediate")->SetAttr("gelu_tanh", c.activation == "gelu" ? 0 : 1);
    };
    d->configure = [](Module& root, const ModelConfig& c) {
      root.Find("cls.predictions.transform")->SetAttr("gelu_tanh", c.activation == "gelu" ? 0 : 1);
    };
    return d;
  }();
  return *f;
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) {
  if (c.activation != "gelu" && c.activation != "gelu_new" && c.activation != "gelu_pytorch_tanh") {
    return absl::InvalidArgumentError(absl::StrCat("hidden_act \"", c.activation, "\" is not one of gelu, gelu_new"));
  }
  return BuildFromTable(Bert(), c);
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
    RETURN_IF_ERROR(CheckShardable(config, shard.layout));  // the modes spec's LayoutsOf gives bert
    if (shard.layout.gather_output()) {
      return absl::InvalidArgumentError("the bert policy keeps the logits vocab-parallel; unset gather_output");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    ASSIGN_OR_RETURN(auto policy, TablePolicy(Bert(), config, shard));
    policy["BertLayer"].attribute_replacement = {
        {"attention.self.num_attention_heads", static_cast<double>(config.num_heads / shard.head_split())}};
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
  f.split_stage = [](Module& root, const PipelineStage& stage) { return SplitTableStage(Bert(), root, stage); };
  return f;
}

}  // namespace colod::shardformer
