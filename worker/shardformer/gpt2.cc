// GPT2LMHeadModel (transformers/models/gpt2/modeling_gpt2.py), evaluation
// semantics (dropout off): token + position embeddings, pre-norm blocks of
// causal self-attention (fused c_attn Conv1D, q|k|v) and an MLP (c_fc,
// gelu_new, c_proj), final ln_f, and an LM head tied to wte.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/table_family.h"
#include "worker/shardformer/models.h"

namespace colod::shardformer {
namespace {

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
  // q, k and v: slices of c_attn's output, whose gradient the attention
  // writes into one buffer.
  ASSIGN_OR_RETURN(Variable att, nn::CausalAttention(nn::PackedQkv{split, 2},
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

// GPT2LMHeadModel's names around its layer table (spec/plan.cc): the
// blocks under transformer.h, token and position tables, ln_f, the head
// tied to wte.
const TableFamily& Gpt2() {
  static const TableFamily* const f = [] {
    auto* d = new TableFamily;
    d->root_class = "GPT2LMHeadModel";
    d->base = "transformer";
    d->base_class = "GPT2Model";
    d->layer_lists = {{"h", "GPT2Block", BlockForward}};
    d->containers = {{"transformer.h.*.attn", "GPT2Attention", AttentionForward},
                     {"transformer.h.*.mlp", "GPT2MLP", MlpForward}};
    d->tokens = "wte";
    d->positions = "wpe";
    d->final_norm = "ln_f";
    d->head = "lm_head";
    d->configure_layer = [](Module& block, const ModelConfig& c) {
      Module* attn = block.Find("attn");
      attn->SetAttr("num_heads", static_cast<double>(c.num_heads));
      attn->SetAttr("head_dim", static_cast<double>(c.head_dim()));
      block.Find("mlp")->SetAttr("gelu_tanh", c.activation == "gelu" ? 0 : 1);
    };
    return d;
  }();
  return *f;
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) {
  if (c.activation != "gelu_new" && c.activation != "gelu" && c.activation != "gelu_pytorch_tanh") {
    return absl::InvalidArgumentError(
        absl::StrCat("activation_function \"", c.activation, "\" is not one of gelu_new, gelu_pytorch_tanh, gelu"));
  }
  return BuildFromTable(Gpt2(), c);
}

// ShardFormer's GPT2Policy: 1D (Megatron) with optional sequence
// parallelism, 2D / 2.5D, and 3D; the layers' replacements from the layer
// table, each rank's share of the heads here.
class Gpt2Policy : public CausalLmPolicy {
 public:
  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    ASSIGN_OR_RETURN(auto policy, TablePolicy(Gpt2(), config, shard));
    policy["GPT2Block"].attribute_replacement = {
        {"attn.num_heads", static_cast<double>(config.num_heads / shard.head_split())}};
    return policy;
  }
};

}  // namespace

ModelFamily Gpt2Family() {
  ModelFamily f;
  f.base_model_prefix = "transformer";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new Gpt2Policy()); };
  f.split_stage = [](Module& root, const PipelineStage& stage) { return SplitTableStage(Gpt2(), root, stage); };
  return f;
}

}  // namespace colod::shardformer
