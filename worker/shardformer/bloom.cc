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
#include "worker/shardformer/table_family.h"
#include "worker/shardformer/models.h"

namespace colod::shardformer {
namespace {

// The slopes of this rank's heads: those of the heads its block of the
// fused projection's output holds (per head, q|k|v of head_dim each), in
// every mode: 1D splits the heads over tp, 2D/2.5D over tp_row, 3D over the
// layer's column axis.
absl::StatusOr<std::vector<float>> LocalSlopes(const ColoTensor& qkv, int64_t heads, int64_t total,
                                               int64_t head_dim) {
  const std::vector<float> all = nn::AlibiSlopes(total);
  int64_t first = 0;
  if (heads != total) {
    ASSIGN_OR_RETURN(Block block, LocalBlock(qkv.spec(), qkv.global_shape(), qkv.process_group()));
    if (block.starts.empty() || block.starts.back() % (3 * head_dim) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("query_key_value's block does not start at a head (",
                                                     qkv.spec().ToString(), ")"));
    }
    first = block.starts.back() / (3 * head_dim);
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
  // q, k and v: slices of the fused projection's output, whose gradient the
  // attention writes into one buffer.
  ASSIGN_OR_RETURN(std::vector<float> slopes, LocalSlopes(qkv, heads, total, head_dim));
  ASSIGN_OR_RETURN(Variable att, nn::AlibiAttention(nn::PackedQkv{split, 3},
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
// normalized embeddings are split along the sequence over tp before the
// blocks. A pipeline stage's: the embeddings and their norm on the first
// stage, ln_f on the last.
Module::ForwardFn ModelForward(bool sequence_parallel, PipelineStage stage) {
  return [sequence_parallel, stage](Module& self, const ColoTensor& input) -> absl::StatusOr<ColoTensor> {
    ColoTensor x = input;
    if (stage.first()) {
      ASSIGN_OR_RETURN(x, self.Call("word_embeddings", input));
      ASSIGN_OR_RETURN(x, self.Call("word_embeddings_layernorm", x));
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

// BloomForCausalLM's names around its layer table (spec/plan.cc): the
// blocks under transformer.h, its own model forward (the embeddings'
// LayerNorm), the head tied to word_embeddings unless tie_word_embeddings is
// false.
const TableFamily& Bloom() {
  static const TableFamily* const f = [] {
    auto* d = new TableFamily;
    d->root_class = "BloomForCausalLM";
    d->base = "transformer";
    d->base_class = "BloomModel";
    d->layer_lists = {{"h", "BloomBlock", BlockForward}};
    d->containers = {{"transformer.h.*.self_attention", "BloomAttention", AttentionForward},
                     {"transformer.h.*.mlp", "BloomMLP", MlpForward}};
    d->tokens = "word_embeddings";
    d->final_norm = "ln_f";
    d->head = "lm_head";
    d->model_forward = ModelForward;
    d->configure_layer = [](Module& block, const ModelConfig& c) {
      block.SetAttr("apply_residual_connection_post_layernorm", c.residual_post_norm ? 1 : 0);
      Module* attn = block.Find("self_attention");
      attn->SetAttr("num_heads", static_cast<double>(c.num_heads));
      attn->SetAttr("alibi_heads", static_cast<double>(c.num_heads));  // the policy leaves it whole
      attn->SetAttr("head_dim", static_cast<double>(c.head_dim()));
    };
    return d;
  }();
  return *f;
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) { return BuildFromTable(Bloom(), c); }

// ShardFormer's BloomPolicy: 1D with optional sequence parallelism (the
// embeddings' LayerNorm, before the split, stays native). The fused
// query_key_value is column-parallel as it is (its per-head layout gives each
// rank whole heads with their q, k and v). The replacements from the layer
// table, each rank's share of the heads here (their ALiBi slopes stay whole).
class BloomPolicy : public CausalLmPolicy {
 public:
  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    ASSIGN_OR_RETURN(auto policy, TablePolicy(Bloom(), config, shard));
    policy["BloomBlock"].attribute_replacement = {
        {"self_attention.num_heads", static_cast<double>(config.num_heads / shard.head_split())}};
    return policy;
  }
};

}  // namespace

ModelFamily BloomFamily() {
  ModelFamily f;
  f.base_model_prefix = "transformer";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new BloomPolicy()); };
  f.split_stage = [](Module& root, const PipelineStage& stage) { return SplitTableStage(Bloom(), root, stage); };
  return f;
}

}  // namespace colod::shardformer
