// T5ForConditionalGeneration (transformers/models/t5/modeling_t5.py),
// evaluation semantics (dropout off, no padding mask): the shared token
// embedding, an encoder stack and a decoder stack of pre-norm blocks (T5's
// RMS norm, no biases anywhere), attention without score scaling whose
// scores gain a relative position bias that each stack's layer 0 holds
// (bidirectional buckets in the encoder, causal in the decoder; every layer
// of the stack uses it), cross-attention of the decoder over the encoder's
// output, feed-forward blocks of ReLU (T5 v1.0) or gated GELU (v1.1,
// flan-t5), each stack's final norm, and the LM head (tied to the shared
// embedding with the decoder output scaled by d_model^-1/2, or untied).
//
// The root takes two inputs (Module::Forward(ids, decoder_ids)); the stacks
// and blocks are walked here rather than through single-input forwards, as
// the blocks share the position bias and the decoder reads the encoder.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/models.h"
#include "worker/shardformer/table_family.h"

namespace colod::shardformer {
namespace {


// A stack's relative position bias: layer 0's relative_attention_bias
// table [buckets, heads] (replicated) looked up for every (query, key)
// pair, [sq, sk, heads], and this rank's heads' rows of it, [local heads,
// sq, sk], built at the stack's first attention (which knows the rank's
// heads) and shared by its blocks. When the heads are split the table's
// gradient is summed over tp (each rank contributes its heads' columns,
// for its rows).
struct StackBias {
  Variable values;                // [sq, sk, heads]
  std::optional<Variable> local;  // [local heads, sq, sk]
};

absl::StatusOr<StackBias> PositionBias(Module& attn, const ColoTensor& like, int64_t sq, int64_t sk, bool decoder) {
  ASSIGN_OR_RETURN(int64_t heads, attn.IntAttr("n_heads"));
  ASSIGN_OR_RETURN(int64_t total, attn.IntAttr("total_heads"));
  ASSIGN_OR_RETURN(int64_t buckets, attn.IntAttr("relative_attention_num_buckets"));
  ASSIGN_OR_RETURN(int64_t max_distance, attn.IntAttr("relative_attention_max_distance"));
  const std::vector<int64_t> ids = nn::RelativePositionBuckets(sq, sk, !decoder, buckets, max_distance);
  ASSIGN_OR_RETURN(Tensor bucket_ids, Tensor::FromInt64s({sq, sk}, ids));
  ASSIGN_OR_RETURN(ColoTensor id_tensor, ColoTensor::FromLocal(bucket_ids, DistSpec(), like.process_group()));
  ASSIGN_OR_RETURN(ColoTensor values, attn.Call("relative_attention_bias", id_tensor));  // [sq, sk, total]
  StackBias bias{values.variable(), std::nullopt};
  if (heads != total) {
    ProcessGroup* pg = like.process_group();
    ASSIGN_OR_RETURN(Communicator * tp, pg->Comm("tp"));
    ASSIGN_OR_RETURN(bias.values, nn::ReduceGradient(bias.values, tp, pg->timeout()));
  }
  return bias;
}

// Rows [first, first + heads) of the bias as [heads, sq, sk].
absl::StatusOr<Variable> LocalBias(const Variable& values, int64_t first, int64_t heads) {
  const Shape& s = values.value().shape();  // [sq, sk, total]
  std::vector<Variable> per_head;
  for (int64_t h = 0; h < heads; ++h) {
    ASSIGN_OR_RETURN(Variable column, nn::Narrow(values, 2, first + h, 1));
    ASSIGN_OR_RETURN(column, nn::Reshape(column, {1, s[0], s[1]}));
    per_head.push_back(column);
  }
  return nn::Cat(per_head, 0);
}

// T5Attention without scaling: q from x, k and v from `kv` (x itself, or
// the encoder's output), the scores plus the stack's bias (none for
// cross-attention) for this rank's heads: those its block of q's output
// holds, in any mode (1D splits the heads over tp, 2D/2.5D over tp_row, 3D
// over the layer's column axis).
absl::StatusOr<ColoTensor> Attention(Module& attn, const ColoTensor& x, const ColoTensor& kv, StackBias* bias,
                                     bool causal) {
  ASSIGN_OR_RETURN(int64_t heads, attn.IntAttr("n_heads"));
  ASSIGN_OR_RETURN(int64_t total, attn.IntAttr("total_heads"));
  ASSIGN_OR_RETURN(int64_t head_dim, attn.IntAttr("key_value_proj_dim"));
  ASSIGN_OR_RETURN(ColoTensor q, attn.Call("q", x));
  ASSIGN_OR_RETURN(ColoTensor k, attn.Call("k", kv));
  ASSIGN_OR_RETURN(ColoTensor v, attn.Call("v", kv));
  ASSIGN_OR_RETURN(Variable qh, SplitHeads(q, heads, head_dim, "q"));
  ASSIGN_OR_RETURN(Variable kh, SplitHeads(k, heads, head_dim, "k"));
  ASSIGN_OR_RETURN(Variable vh, SplitHeads(v, heads, head_dim, "v"));
  std::optional<Variable> scores_bias;
  if (bias != nullptr) {
    if (!bias->local.has_value()) {
      int64_t first = 0;
      if (heads != total) {
        ASSIGN_OR_RETURN(Block block, LocalBlock(q.spec(), q.global_shape(), q.process_group()));
        if (block.starts.empty() || block.starts.back() % head_dim != 0 ||
            block.starts.back() / head_dim + heads > total) {
          return absl::InvalidArgumentError(
              absl::StrCat("q's block does not hold whole heads (", q.spec().ToString(), ")"));
        }
        first = block.starts.back() / head_dim;
      }
      ASSIGN_OR_RETURN(bias->local, LocalBias(bias->values, first, heads));
    }
    scores_bias = bias->local;
  }
  ASSIGN_OR_RETURN(Variable att, nn::BiasedAttention(qh, kh, vh, 1.0f, causal, scores_bias));
  const Shape& s = att.value().shape();
  ASSIGN_OR_RETURN(att, nn::Reshape(att, {s[0], s[1], heads * head_dim}));
  return CallWithLocal(attn, "o", att, x.process_group());
}

// T5DenseActDense (relu) or T5DenseGatedActDense (gelu_new(wi_0) * wi_1).
absl::StatusOr<ColoTensor> FeedForward(Module& ff, const ColoTensor& x) {
  if (ff.Find("wi") != nullptr) {
    ASSIGN_OR_RETURN(ColoTensor inner, ff.Call("wi", x));
    ASSIGN_OR_RETURN(inner, MapLocal(inner, [](const Variable& v) { return nn::Relu(v); }));
    return ff.Call("wo", inner);
  }
  ASSIGN_OR_RETURN(ColoTensor gate, ff.Call("wi_0", x, nn::GeluEpilogue(ops::GeluApprox::kTanh)));
  ASSIGN_OR_RETURN(ColoTensor up, ff.Call("wi_1", x));
  RETURN_IF_ERROR(CheckSpec(up, gate.spec(), "wi_1's output"));
  ASSIGN_OR_RETURN(ColoTensor h, MapLocal(gate, [&up](const Variable& g) { return Mul(g, up.variable()); }));
  return ff.Call("wo", h);
}

// One T5Stack over token ids: the shared embedding, the blocks (each
// `x + sublayer(norm(x))`), the final norm. `encoder_out` is the encoder's
// output for the decoder's cross-attention (null for the encoder).
absl::StatusOr<ColoTensor> Stack(Module& root, const std::string& name, const ColoTensor& ids,
                                 const ColoTensor* encoder_out) {
  ASSIGN_OR_RETURN(Module * stack, root.Get(name));
  const bool decoder = encoder_out != nullptr;
  ASSIGN_OR_RETURN(ColoTensor x, root.Call("shared", ids));
  // With sequence parallelism the stream is split along the sequence from
  // here on (as the blocks' norms take it; the attentions' projections
  // gather it, the decoder's cross-attention the encoder's output too).
  ASSIGN_OR_RETURN(x, ToInputOf(*stack, "block.0.layer.0.layer_norm", x));
  const int64_t seq = ids.local().shape()[1];
  ASSIGN_OR_RETURN(Module * first_attn, stack->Get("block.0.layer.0.SelfAttention"));
  ASSIGN_OR_RETURN(StackBias bias, PositionBias(*first_attn, x, seq, seq, decoder));
  ASSIGN_OR_RETURN(Module * blocks, stack->Get("block"));
  for (int64_t i = 0;; ++i) {
    Module* block = blocks->Find(absl::StrCat(i));
    if (block == nullptr) break;
    ASSIGN_OR_RETURN(ColoTensor h, block->Call("layer.0.layer_norm", x));
    ASSIGN_OR_RETURN(Module * self_attn, block->Get("layer.0.SelfAttention"));
    ASSIGN_OR_RETURN(ColoTensor a, Attention(*self_attn, h, h, &bias, /*causal=*/decoder));
    ASSIGN_OR_RETURN(x, AddActivations(x, a));
    int ff = 1;
    if (decoder) {
      ASSIGN_OR_RETURN(ColoTensor hc, block->Call("layer.1.layer_norm", x));
      ASSIGN_OR_RETURN(Module * cross, block->Get("layer.1.EncDecAttention"));
      ASSIGN_OR_RETURN(ColoTensor c, Attention(*cross, hc, *encoder_out, nullptr, /*causal=*/false));
      ASSIGN_OR_RETURN(x, AddActivations(x, c));
      ff = 2;
    }
    ASSIGN_OR_RETURN(ColoTensor hf, block->Call(absl::StrCat("layer.", ff, ".layer_norm"), x));
    ASSIGN_OR_RETURN(Module * dense, block->Get(absl::StrCat("layer.", ff, ".DenseReluDense")));
    ASSIGN_OR_RETURN(ColoTensor f, FeedForward(*dense, hf));
    ASSIGN_OR_RETURN(x, AddActivations(x, f));
  }
  return stack->Call("final_layer_norm", x);
}

absl::StatusOr<ColoTensor> ConditionalGenerationForward(Module& self, const ColoTensor& ids,
                                                        const ColoTensor& decoder_ids) {
  ASSIGN_OR_RETURN(ColoTensor encoded, Stack(self, "encoder", ids, nullptr));
  ASSIGN_OR_RETURN(ColoTensor decoded, Stack(self, "decoder", decoder_ids, &encoded));
  ASSIGN_OR_RETURN(int64_t tied, self.IntAttr("tie_word_embeddings"));
  if (tied) {  // the tied head reads the decoder output scaled by d_model^-1/2
    ASSIGN_OR_RETURN(double scale, self.Attr("model_dim_scale"));
    ASSIGN_OR_RETURN(decoded, MapLocal(decoded, [scale](const Variable& v) {
                       return Scale(v, static_cast<float>(scale));
                     }));
  }
  return self.Call("lm_head", decoded);
}

// T5ForConditionalGeneration's names around its layer table (spec/plan.cc):
// the root holds shared, the two stacks and lm_head; a block's sublayers are
// layer.0 (self-attention), in the decoder layer.1 (cross-attention), then
// the feed-forward, whose class says whether it is gated.
TableFamily T5(const ModelConfig& c) {
  TableFamily d;
  d.root_class = "T5ForConditionalGeneration";
  d.root_cross_forward = ConditionalGenerationForward;
  d.layer_lists = {{"encoder.block", "T5Block", nullptr}, {"decoder.block", "T5Block", nullptr, /*decoder=*/true}};
  const std::string dense = c.activation == "gated-gelu" ? "T5DenseGatedActDense" : "T5DenseActDense";
  for (const bool decoder : {false, true}) {
    const std::string s = decoder ? "decoder" : "encoder", b = s + ".block.*.layer";
    const std::string ff = decoder ? ".2" : ".1";
    d.containers.push_back({s, "T5Stack", nullptr});
    d.containers.push_back({b, "ModuleList", nullptr});
    d.containers.push_back({b + ".0", "T5LayerSelfAttention", nullptr});
    d.containers.push_back({b + ".0.SelfAttention", "T5Attention", nullptr});
    if (decoder) {
      d.containers.push_back({b + ".1", "T5LayerCrossAttention", nullptr});
      d.containers.push_back({b + ".1.EncDecAttention", "T5Attention", nullptr});
    }
    d.containers.push_back({b + ff, "T5LayerFF", nullptr});
    d.containers.push_back({b + ff + ".DenseReluDense", dense, nullptr});
  }
  d.head = "lm_head";
  d.anchor_at_container = true;
  d.configure_layer = [](Module& block, const ModelConfig& c) {
    for (const char* path : {"layer.0.SelfAttention", "layer.1.EncDecAttention"}) {
      Module* attn = block.Find(path);
      if (attn == nullptr) continue;  // an encoder block has no cross-attention
      attn->SetAttr("n_heads", static_cast<double>(c.num_heads));
      attn->SetAttr("total_heads", static_cast<double>(c.num_heads));  // the policy leaves it whole
      attn->SetAttr("key_value_proj_dim", static_cast<double>(c.kv_dim));
    }
  };
  d.configure = [](Module& root, const ModelConfig& c) {
    root.SetAttr("tie_word_embeddings", c.tie_word_embeddings ? 1 : 0);
    root.SetAttr("model_dim_scale", 1.0 / std::sqrt(static_cast<double>(c.hidden_size)));
    for (const char* stack : {"encoder", "decoder"}) {  // block 0 holds each stack's position bias
      Module* attn = root.Find(absl::StrCat(stack, ".block.0.layer.0.SelfAttention"));
      if (attn == nullptr) continue;
      attn->SetAttr("relative_attention_num_buckets", static_cast<double>(c.relative_buckets));
      attn->SetAttr("relative_attention_max_distance", static_cast<double>(c.relative_max_distance));
    }
  };
  return d;
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) { return BuildFromTable(T5(c), c); }

// ShardFormer's T5 policy, 1D: q, k, v and wi (wi_0, wi_1) column-parallel,
// o and wo row-parallel, the heads split over tp (layer 0's bias table
// replicated, each rank reading its heads' columns), vocab-parallel shared
// embedding and head; the replacements from the layer table, set on
// T5Attention and T5Dense*, the head split here.
class T5Policy : public Policy {
 public:
  absl::Status Preprocess(const ModelConfig& config, ShardConfig& shard) override {
    RETURN_IF_ERROR(CheckShardable(config, shard.layout));  // the modes spec's LayoutsOf gives t5
    return absl::OkStatus();
  }
  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    ASSIGN_OR_RETURN(auto policy, TablePolicy(T5(config), config, shard));
    policy["T5Attention"].attribute_replacement = {
        {"n_heads", static_cast<double>(config.num_heads / shard.head_split())}};
    return policy;
  }
  absl::Status Postprocess(Module& model, const ModelConfig&, const ShardConfig&) override {
    return TieLmHeads(model);
  }
};

}  // namespace

ModelFamily T5Family() {
  ModelFamily f;
  f.base_model_prefix = "";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new T5Policy()); };
  return f;
}

}  // namespace colod::shardformer
