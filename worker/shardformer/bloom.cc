// BloomForCausalLM (transformers/models/bloom/modeling_bloom.py), evaluation
// semantics (dropout off, no padding): word embeddings and their LayerNorm,
// pre-norm blocks of self-attention with ALiBi instead of positions (the
// fused query_key_value laid out per head, [heads, 3, head_dim]; each head
// its own slope, a tensor-parallel rank's heads keeping theirs) and an MLP
// (dense_h_to_4h, BLOOM's tanh GELU, dense_4h_to_h), the residuals taken
// before the LayerNorms (or after, with
// apply_residual_connection_post_layernorm), ln_f, and an LM head tied to
// the word embeddings.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/models.h"

namespace colod::shardformer {
namespace {

using Kind = LayerDecl::Kind;

// The slopes of this rank's heads: the heads of a tensor-parallel group are
// split in rank order, so tp rank r holds heads [r * heads, (r + 1) * heads).
absl::StatusOr<std::vector<float>> LocalSlopes(const ColoTensor& x, int64_t heads, int64_t total) {
  const std::vector<float> all = nn::AlibiSlopes(total);
  int64_t first = 0;
  if (heads != total) {
    ASSIGN_OR_RETURN(int rank, x.process_group()->tp_local_rank());
    first = static_cast<int64_t>(rank) * heads;
  }
  if (heads < 1 || first + heads > total) {
    return absl::InvalidArgumentError(
        absl::StrCat("this rank's ", heads, " heads from head ", first, " do not lie within the ", total, " heads"));
  }
  return std::vector<float>(all.begin() + first, all.begin() + first + heads);
}

absl::StatusOr<ColoTensor> AttentionForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(int64_t heads, self.IntAttr("num_heads"));
  ASSIGN_OR_RETURN(int64_t total, self.IntAttr("alibi_heads"));
  ASSIGN_OR_RETURN(int64_t head_dim, self.IntAttr("head_dim"));
  ASSIGN_OR_RETURN(ColoTensor qkv, self.Call("query_key_value", x));
  const Shape& local = qkv.local().shape();
  if (local.size() != 3 || qkv.local().numel() != local[0] * local[1] * heads * 3 * head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("query_key_value gave ", ShapeToString(local), " locally, not ",
                                                   heads, " heads of q, k and v"));
  }
  const int64_t b = local[0], s = local[1];
  // Per head: q, k, v of head_dim each (BloomAttention._split_heads).
  ASSIGN_OR_RETURN(Variable split, nn::Reshape(qkv.variable(), {b, s, heads, 3, head_dim}));
  Variable parts[3];
  for (int i = 0; i < 3; ++i) {
    ASSIGN_OR_RETURN(Variable part, nn::Narrow(split, 3, i, 1));
    ASSIGN_OR_RETURN(parts[i], nn::Reshape(part, {b, s, heads, head_dim}));
  }
  ASSIGN_OR_RETURN(std::vector<float> slopes, LocalSlopes(x, heads, total));
  ASSIGN_OR_RETURN(Variable att, nn::AlibiAttention(parts[0], parts[1], parts[2],
                                                    1.0f / std::sqrt(static_cast<float>(head_dim)), slopes));
  ASSIGN_OR_RETURN(att, nn::Reshape(att, {b, s, heads * head_dim}));
  return CallWithLocal(self, "dense", att, x.process_group());
}

absl::StatusOr<ColoTensor> MlpForward(Module& self, const ColoTensor& x) {
  // dense_h_to_4h's bias and BloomGelu (the tanh approximation), one kernel.
  ASSIGN_OR_RETURN(ColoTensor inner, self.Call("dense_h_to_4h", x, nn::GeluEpilogue(ops::GeluApprox::kTanh)));
  return self.Call("dense_4h_to_h", inner);
}

absl::StatusOr<ColoTensor> BlockForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(int64_t post, self.IntAttr("apply_residual_connection_post_layernorm"));
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("input_layernorm", x));
  ASSIGN_OR_RETURN(ColoTensor a, self.Call("self_attention", h));
  // x1 = residual + attention and its norm, one kernel where the norm can.
  ASSIGN_OR_RETURN(Layer::WithSum x1, self.CallResidual("post_attention_layernorm", post ? h : x, a));
  ASSIGN_OR_RETURN(ColoTensor m, self.Call("mlp", x1.y));
  return AddActivations(post ? x1.y : x1.sum, m);
}

// BloomModel; with sequence_parallel (the policy's forward replacement) the
// normalized embeddings are split along the sequence over tp before the blocks.
Module::ForwardFn ModelForward(bool sequence_parallel) {
  return [sequence_parallel](Module& self, const ColoTensor& ids) -> absl::StatusOr<ColoTensor> {
    ASSIGN_OR_RETURN(ColoTensor x, self.Call("word_embeddings", ids));
    ASSIGN_OR_RETURN(x, self.Call("word_embeddings_layernorm", x));
    if (sequence_parallel) {
      ASSIGN_OR_RETURN(x, SplitSequence(x));
    }
    ASSIGN_OR_RETURN(Module * blocks, self.Get("h"));
    ASSIGN_OR_RETURN(x, RunSequential(*blocks, x));
    return self.Call("ln_f", x);
  };
}

absl::StatusOr<ColoTensor> CausalLmForward(Module& self, const ColoTensor& ids) {
  ASSIGN_OR_RETURN(ColoTensor h, self.Call("transformer", ids));
  return self.Call("lm_head", h);
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) {
  const int64_t h = c.hidden_size, f = c.intermediate_size;
  const float eps = static_cast<float>(c.norm_eps);
  auto leaf = [](Kind kind, const std::string& prefix, int64_t in, int64_t out, bool bias, float ln_eps = 1e-5f) {
    return Module::Leaf(LayerDecl::Of(kind, prefix, in, out, bias, ln_eps));
  };
  auto root = std::make_unique<Module>("BloomForCausalLM", CausalLmForward);
  Module* model = root->Add("transformer", std::make_unique<Module>("BloomModel", ModelForward(false)));
  model->Add("word_embeddings", leaf(Kind::kEmbedding, "transformer.word_embeddings", c.vocab_size, h, false));
  model->Add("word_embeddings_layernorm",
             leaf(Kind::kLayerNorm, "transformer.word_embeddings_layernorm", 0, h, true, eps));
  Module* blocks = model->Add("h", std::make_unique<Module>("ModuleList", nullptr));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("transformer.h.", i);
    Module* block = blocks->Add(absl::StrCat(i), std::make_unique<Module>("BloomBlock", BlockForward));
    block->SetAttr("apply_residual_connection_post_layernorm", c.residual_post_norm ? 1 : 0);
    block->Add("input_layernorm", leaf(Kind::kLayerNorm, p + ".input_layernorm", 0, h, true, eps));
    Module* attn = block->Add("self_attention", std::make_unique<Module>("BloomAttention", AttentionForward));
    attn->SetAttr("num_heads", static_cast<double>(c.num_heads));
    attn->SetAttr("alibi_heads", static_cast<double>(c.num_heads));  // the policy leaves it whole
    attn->SetAttr("head_dim", static_cast<double>(c.head_dim()));
    attn->Add("query_key_value", leaf(Kind::kLinear, p + ".self_attention.query_key_value", h, 3 * h, true));
    attn->Add("dense", leaf(Kind::kLinear, p + ".self_attention.dense", h, h, true));
    block->Add("post_attention_layernorm", leaf(Kind::kLayerNorm, p + ".post_attention_layernorm", 0, h, true, eps));
    Module* mlp = block->Add("mlp", std::make_unique<Module>("BloomMLP", MlpForward));
    mlp->Add("dense_h_to_4h", leaf(Kind::kLinear, p + ".mlp.dense_h_to_4h", h, f, true));
    mlp->Add("dense_4h_to_h", leaf(Kind::kLinear, p + ".mlp.dense_4h_to_h", f, h, true));
  }
  model->Add("ln_f", leaf(Kind::kLayerNorm, "transformer.ln_f", 0, h, true, eps));
  LayerDecl head = LayerDecl::Of(Kind::kLinear, "lm_head", h, c.vocab_size, false);
  if (c.tie_word_embeddings) head.tied_to = "transformer.word_embeddings";
  root->Add("lm_head", Module::Leaf(std::move(head)));
  return root;
}

// ShardFormer's BloomPolicy: 1D with optional sequence parallelism. The
// fused query_key_value is column-parallel as it is (its per-head layout
// gives each rank whole heads with their q, k and v).
class BloomPolicy : public CausalLmPolicy {
 public:
  BloomPolicy() : CausalLmPolicy("bloom") {}

  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    std::map<std::string, ModulePolicyDescription> policy;
    ModulePolicyDescription& lm = policy["BloomForCausalLM"];
    ModulePolicyDescription& model = policy["BloomModel"];
    ModulePolicyDescription& block = policy["BloomBlock"];
    block.attribute_replacement = {
        {"self_attention.num_heads", static_cast<double>(config.num_heads / shard.head_split())}};
    if (!config.tie_word_embeddings) lm.sub_module_replacement = {{"lm_head", "VocabParallelLMHead1D"}};
    model.sub_module_replacement = {{"word_embeddings", "VocabParallelEmbedding1D"}};
    block.sub_module_replacement = {
        {"self_attention.query_key_value", "Linear1D_Col"},
        {"self_attention.dense", "Linear1D_Row"},
        {"mlp.dense_h_to_4h", "Linear1D_Col"},
        {"mlp.dense_4h_to_h", "Linear1D_Row"},
    };
    if (shard.sequence_parallel()) {
      model.sub_module_replacement.push_back({"ln_f", "Norm1D"});
      model.method_replacement = ModelForward(true);
      block.sub_module_replacement.push_back({"input_layernorm", "Norm1D"});
      block.sub_module_replacement.push_back({"post_attention_layernorm", "Norm1D"});
    }
    return policy;
  }
};

}  // namespace

ModelFamily BloomFamily() {
  ModelFamily f;
  f.base_model_prefix = "transformer";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new BloomPolicy()); };
  return f;
}

}  // namespace colod::shardformer
