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
#include "worker/shardformer/table_family.h"
#include "worker/shardformer/models.h"

namespace colod::shardformer {
namespace {

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

// LlamaForCausalLM's names around its layer table (spec/plan.cc): the
// decoder layers under model.layers, embed_tokens (no learned positions:
// rotary), the final norm, lm_head (tied to embed_tokens when
// tie_word_embeddings).
const TableFamily& Llama() {
  static const TableFamily* const f = [] {
    auto* d = new TableFamily;
    d->root_class = "LlamaForCausalLM";
    d->base = "model";
    d->base_class = "LlamaModel";
    d->layer_lists = {{"layers", "LlamaDecoderLayer", DecoderLayerForward}};
    d->containers = {{"model.layers.*.self_attn", "LlamaAttention", AttentionForward},
                     {"model.layers.*.mlp", "LlamaMLP", MlpForward}};
    d->tokens = "embed_tokens";
    d->final_norm = "norm";
    d->head = "lm_head";
    d->configure_layer = [](Module& layer, const ModelConfig& c) {
      Module* attn = layer.Find("self_attn");
      attn->SetAttr("num_heads", static_cast<double>(c.num_heads));
      attn->SetAttr("num_key_value_heads", static_cast<double>(c.num_kv_heads));
      attn->SetAttr("head_dim", static_cast<double>(c.head_dim()));
      attn->SetAttr("rope_theta", c.rope_theta);
    };
    return d;
  }();
  return *f;
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) {
  if (c.activation != "silu") {
    return absl::InvalidArgumentError(absl::StrCat("hidden_act \"", c.activation, "\" is not silu"));
  }
  if (c.head_dim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("rotary embeddings need an even head dim, got ", c.head_dim()));
  }
  return BuildFromTable(Llama(), c);
}

// ShardFormer's LlamaPolicy: 1D with optional sequence parallelism, 2D /
// 2.5D, and 3D; the layers' replacements from the layer table, each rank's
// share of the query and key/value heads here.
class LlamaPolicy : public CausalLmPolicy {
 public:
  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    ASSIGN_OR_RETURN(auto policy, TablePolicy(Llama(), config, shard));
    const int split = shard.head_split();
    policy["LlamaDecoderLayer"].attribute_replacement = {
        {"self_attn.num_heads", static_cast<double>(config.num_heads / split)},
        {"self_attn.num_key_value_heads", static_cast<double>(config.num_kv_heads / split)},
    };
    return policy;
  }
};

}  // namespace

ModelFamily LlamaFamily() {
  ModelFamily f;
  f.base_model_prefix = "model";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new LlamaPolicy()); };
  f.split_stage = [](Module& root, const PipelineStage& stage) { return SplitTableStage(Llama(), root, stage); };
  return f;
}

}  // namespace colod::shardformer
