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
#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

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

// The blocks [lo, hi) of `stack` on the stream x (in their norms' input
// spec), each `x + sublayer(norm(x))`, the decoder's with cross-attention
// over `encoder_out` (null for the encoder). Every block reads the stack's
// position bias, from block 0's table (a pipeline stage without block 0
// holds a mirror of it at the same path).
absl::StatusOr<ColoTensor> Blocks(Module& stack, int64_t lo, int64_t hi, ColoTensor x,
                                  const ColoTensor* encoder_out) {
  const bool decoder = encoder_out != nullptr;
  const int64_t seq = x.global_shape()[1];
  ASSIGN_OR_RETURN(Module * first_attn, stack.Get("block.0.layer.0.SelfAttention"));
  ASSIGN_OR_RETURN(StackBias bias, PositionBias(*first_attn, x, seq, seq, decoder));
  ASSIGN_OR_RETURN(Module * blocks, stack.Get("block"));
  for (int64_t i = lo; i < hi; ++i) {
    ASSIGN_OR_RETURN(Module * block, blocks->Get(absl::StrCat(i)));
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
  return x;
}

// A stack's input: the shared embedding of `ids` in the input spec of block
// `first`'s norm. With sequence parallelism the stream is split along the
// sequence from here on (as the blocks' norms take it; the attentions'
// projections gather it, the decoder's cross-attention the encoder's output
// too).
absl::StatusOr<ColoTensor> Embed(Module& root, Module& stack, const ColoTensor& ids, int64_t first) {
  ASSIGN_OR_RETURN(ColoTensor x, root.Call("shared", ids));
  return ToInputOf(stack, absl::StrCat("block.", first, ".layer.0.layer_norm"), x);
}

// One T5Stack over token ids: the shared embedding, the blocks, the final
// norm. `encoder_out` is the encoder's output for the decoder's
// cross-attention (null for the encoder).
absl::StatusOr<ColoTensor> Stack(Module& root, const std::string& name, const ColoTensor& ids,
                                 const ColoTensor* encoder_out) {
  ASSIGN_OR_RETURN(Module * stack, root.Get(name));
  ASSIGN_OR_RETURN(Module * blocks, stack->Get("block"));
  const int64_t n = static_cast<int64_t>(blocks->Children().size());
  ASSIGN_OR_RETURN(ColoTensor x, Embed(root, *stack, ids, 0));
  ASSIGN_OR_RETURN(x, Blocks(*stack, 0, n, x, encoder_out));
  return stack->Call("final_layer_norm", x);
}

// The LM head over the decoder's output; the tied head reads it scaled by
// d_model^-1/2.
absl::StatusOr<ColoTensor> Head(Module& self, ColoTensor decoded) {
  ASSIGN_OR_RETURN(int64_t tied, self.IntAttr("tie_word_embeddings"));
  if (tied) {
    ASSIGN_OR_RETURN(double scale, self.Attr("model_dim_scale"));
    ASSIGN_OR_RETURN(decoded, MapLocal(decoded, [scale](const Variable& v) {
                       return Scale(v, static_cast<float>(scale));
                     }));
  }
  return self.Call("lm_head", decoded);
}

absl::StatusOr<ColoTensor> ConditionalGenerationForward(Module& self, const ColoTensor& ids,
                                                        const ColoTensor& decoder_ids) {
  ASSIGN_OR_RETURN(ColoTensor encoded, Stack(self, "encoder", ids, nullptr));
  ASSIGN_OR_RETURN(ColoTensor decoded, Stack(self, "decoder", decoder_ids, &encoded));
  return Head(self, decoded);
}

// Pipeline stages. The stages' layers are the encoder's blocks, then the
// decoder's, and no stage holds both stacks' (spec's PipelineStageLayers):
//   - an encoder stage runs its blocks on the encoder's stream (the first
//     embeds the token ids); the last encoder stage ends in the encoder's
//     final norm, and its output is the encoder's;
//   - the first decoder stage takes the encoder's output and embeds the
//     decoder ids (it holds a mirror of the shared embedding);
//   - every decoder stage but the last sends on its stream and the
//     encoder's output joined along the sequence, [rows, decoder seq + seq, hidden], so each
//     decoder stage has the encoder's output for its cross-attention, and
//     the gradient of the encoder's output comes back the same way, each
//     decoder stage's cross-attentions adding theirs;
//   - the last stage ends in the decoder's final norm and the LM head.
// Each stack's position bias table (block 0's) is mirrored on the stack's
// other stages; the shared embedding on the first decoder stage and, tied
// to the head, on the last. The holders' gradients are summed after each
// step (TiedTable).

// An activation [rows, decoder seq + seq, hidden] split into the decoder's
// stream (its first `decoder_seq` positions) and the encoder's output, each
// in its spec.
absl::StatusOr<std::pair<ColoTensor, ColoTensor>> Unjoin(const ColoTensor& x, int64_t decoder_seq) {
  const Variable& joined = x.variable();
  const int64_t total = joined.value().dim() == 3 ? joined.value().shape()[1] : 0;
  if (total <= decoder_seq) {
    return absl::InvalidArgumentError(absl::StrCat("a decoder stage's input of ", total, " positions does not hold ",
                                                   "the decoder's ", decoder_seq, " and the encoder's output"));
  }
  ASSIGN_OR_RETURN(Variable stream, nn::Narrow(joined, 1, 0, decoder_seq));
  ASSIGN_OR_RETURN(Variable encoded, nn::Narrow(joined, 1, decoder_seq, total - decoder_seq));
  ASSIGN_OR_RETURN(ColoTensor a, ColoTensor::FromLocal(stream, x.spec(), x.process_group()));
  ASSIGN_OR_RETURN(ColoTensor b, ColoTensor::FromLocal(encoded, x.spec(), x.process_group()));
  return std::make_pair(std::move(a), std::move(b));
}

// The forward of stage `stage` of a T5 whose encoder has `encoder` layers:
// x is the token ids on the first stage, the previous stage's activation on
// the others; decoder_ids the decoder's input ids (every decoder stage
// reads their length, the first embeds them).
Module::CrossForwardFn StageForward(PipelineStage stage, int64_t encoder) {
  return [stage, encoder](Module& self, const ColoTensor& x,
                          const ColoTensor& decoder_ids) -> absl::StatusOr<ColoTensor> {
    if (stage.end <= encoder) {
      ASSIGN_OR_RETURN(Module * stack, self.Get("encoder"));
      ColoTensor h = x;
      if (stage.first()) {
        ASSIGN_OR_RETURN(h, Embed(self, *stack, x, stage.begin));
      }
      ASSIGN_OR_RETURN(h, Blocks(*stack, stage.begin, stage.end, h, nullptr));
      if (stage.end < encoder) return h;
      return stack->Call("final_layer_norm", h);  // the encoder's output
    }
    ASSIGN_OR_RETURN(Module * stack, self.Get("decoder"));
    const int64_t lo = stage.begin - encoder, hi = stage.end - encoder;
    std::optional<std::pair<ColoTensor, ColoTensor>> parts;  // the stream and the encoder's output
    if (lo == 0) {
      ASSIGN_OR_RETURN(ColoTensor h, Embed(self, *stack, decoder_ids, 0));
      parts.emplace(std::move(h), x);
    } else {
      ASSIGN_OR_RETURN(parts, Unjoin(x, decoder_ids.global_shape()[1]));
    }
    auto& [h, encoded] = *parts;
    ASSIGN_OR_RETURN(h, Blocks(*stack, lo, hi, h, &encoded));
    if (stage.last()) {
      ASSIGN_OR_RETURN(ColoTensor decoded, stack->Call("final_layer_norm", h));
      return Head(self, decoded);
    }
    RETURN_IF_ERROR(CheckSpec(encoded, h.spec(), "the encoder's output"));
    ASSIGN_OR_RETURN(Variable joined, nn::Cat({h.variable(), encoded.variable()}, 1));
    return ColoTensor::FromLocal(joined, h.spec(), h.process_group());
  };
}

// ModelFamily::split_stage of T5 (above).
absl::StatusOr<std::vector<TiedTable>> SplitStage(Module& root, const PipelineStage& stage) {
  ASSIGN_OR_RETURN(Module * encoder_blocks, root.Get("encoder.block"));
  const int64_t encoder = static_cast<int64_t>(encoder_blocks->Children().size());
  int first_decoder = -1;  // the stage whose layers begin the decoder's
  int64_t at = 0;
  for (size_t s = 0; s < stage.layers.size(); ++s) {
    if (at == encoder) first_decoder = static_cast<int>(s);
    at += stage.layers[s];
  }
  if (first_decoder < 1 || (stage.begin < encoder && stage.end > encoder)) {
    return absl::InvalidArgumentError(absl::StrCat("T5 pipeline stages hold one stack's layers each: no stage may ",
                                                   "hold both the encoder's first ", encoder,
                                                   " layers and the decoder's"));
  }
  const bool in_encoder = stage.end <= encoder;
  const std::string stack = in_encoder ? "encoder" : "decoder";
  const int64_t lo = in_encoder ? stage.begin : stage.begin - encoder;
  const int64_t hi = in_encoder ? stage.end : stage.end - encoder;
  Module* head = root.Find("lm_head");
  const bool tied_head = head != nullptr && head->decl().has_value() && head->decl()->tied_to == "shared";
  // The shared embedding's holders: the encoder's first stage, the
  // decoder's, and the last stage when the head is tied to it.
  std::vector<int> embedders = {0, first_decoder};
  if (tied_head && stage.count - 1 != first_decoder) embedders.push_back(stage.count - 1);
  const bool embeds = std::find(embedders.begin(), embedders.end(), stage.index) != embedders.end();
  root.Remove(in_encoder ? "decoder" : "encoder");
  if (!embeds) root.Remove("shared");
  if (!stage.last()) root.Remove("lm_head");
  const std::string blocks_path = stack + ".block";
  const std::string bias = blocks_path + ".0.layer.0.SelfAttention.relative_attention_bias";
  ASSIGN_OR_RETURN(Module * blocks, root.Get(blocks_path));
  const int64_t n = static_cast<int64_t>(blocks->Children().size());
  for (int64_t i = 0; i < n; ++i) {
    if (i >= lo && i < hi) continue;
    if (i == 0) {
      DropExcept(*blocks, blocks_path, "0", {bias});  // the mirror of the stack's position bias
    } else {
      blocks->Remove(absl::StrCat(i));
    }
  }
  if (hi < n) {
    ASSIGN_OR_RETURN(Module * s, root.Get(stack));
    s->Remove("final_layer_norm");
  }
  root.set_cross_forward(StageForward(stage, encoder));
  std::vector<TiedTable> tied;
  if (embeds) tied.push_back(TiedTable{"shared", embedders});
  // The stack's stages: the encoder's [0, first_decoder), the decoder's the rest.
  const int from = in_encoder ? 0 : first_decoder, to = in_encoder ? first_decoder : stage.count;
  if (to - from > 1) {
    TiedTable t{bias, {}};
    for (int s = from; s < to; ++s) t.stages.push_back(s);
    tied.push_back(std::move(t));
  }
  return tied;
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
  f.split_stage = SplitStage;
  return f;
}

}  // namespace colod::shardformer
