// OPTForCausalLM (transformers/models/opt/modeling_opt.py), evaluation
// semantics (dropout off, no padding): token embeddings of width
// word_embed_proj_dim (project_in to hidden_size where it differs, as in
// opt-350m), learned positions read at row s + 2 (OPT's offset), decoder
// layers of self-attention (q/k/v/out_proj with biases, q scaled by
// head_dim^-1/2) and an MLP (fc1, ReLU, fc2), each with its LayerNorm before
// it (do_layer_norm_before) or after its residual add (opt-350m), the
// decoder's final LayerNorm (pre-norm models), project_out, and an LM head
// tied to embed_tokens.
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
  ASSIGN_OR_RETURN(int64_t head_dim, self.IntAttr("head_dim"));
  ASSIGN_OR_RETURN(ColoTensor q, self.Call("q_proj", x));
  ASSIGN_OR_RETURN(ColoTensor k, self.Call("k_proj", x));
  ASSIGN_OR_RETURN(ColoTensor v, self.Call("v_proj", x));
  ASSIGN_OR_RETURN(Variable qh, SplitHeads(q, heads, head_dim, "q_proj"));
  ASSIGN_OR_RETURN(Variable kh, SplitHeads(k, heads, head_dim, "k_proj"));
  ASSIGN_OR_RETURN(Variable vh, SplitHeads(v, heads, head_dim, "v_proj"));
  // OPT scales q by head_dim^-1/2 after its bias: the same scores.
  ASSIGN_OR_RETURN(Variable att, nn::CausalAttention(qh, kh, vh, 1.0f / std::sqrt(static_cast<float>(head_dim))));
  const Shape& s = att.value().shape();
  ASSIGN_OR_RETURN(att, nn::Reshape(att, {s[0], s[1], heads * head_dim}));
  return CallWithLocal(self, "out_proj", att, x.process_group());
}

// fc2(act(fc1(x))): ReLU (every published OPT) or GELU, the latter fused with fc1's bias.
absl::StatusOr<ColoTensor> Mlp(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(int64_t act, self.IntAttr("activation"));  // 0 relu, 1 gelu, 2 gelu tanh
  if (act != 0) {
    ASSIGN_OR_RETURN(ColoTensor inner, self.Call("fc1", x, nn::GeluEpilogue(act == 2 ? ops::GeluApprox::kTanh
                                                                                     : ops::GeluApprox::kNone)));
    return self.Call("fc2", inner);
  }
  ASSIGN_OR_RETURN(ColoTensor inner, self.Call("fc1", x));
  ASSIGN_OR_RETURN(inner, MapLocal(inner, [](const Variable& v) { return nn::Relu(v); }));
  return self.Call("fc2", inner);
}

// OPTDecoderLayer. Pre-norm: x + attn(ln(x)), then + fc(ln(.)); post-norm
// (do_layer_norm_before false): ln(x + attn(x)), then ln(. + fc(.)).
absl::StatusOr<ColoTensor> DecoderLayerForward(Module& self, const ColoTensor& x) {
  ASSIGN_OR_RETURN(int64_t pre, self.IntAttr("do_layer_norm_before"));
  if (pre) {
    ASSIGN_OR_RETURN(ColoTensor h, self.Call("self_attn_layer_norm", x));
    ASSIGN_OR_RETURN(ColoTensor a, self.Call("self_attn", h));
    ASSIGN_OR_RETURN(Layer::WithSum x1, self.CallResidual("final_layer_norm", x, a));
    ASSIGN_OR_RETURN(ColoTensor m, Mlp(self, x1.y));
    return AddActivations(x1.sum, m);
  }
  ASSIGN_OR_RETURN(ColoTensor a, self.Call("self_attn", x));
  ASSIGN_OR_RETURN(Layer::WithSum x1, self.CallResidual("self_attn_layer_norm", x, a));
  ASSIGN_OR_RETURN(ColoTensor m, Mlp(self, x1.y));
  ASSIGN_OR_RETURN(Layer::WithSum x2, self.CallResidual("final_layer_norm", x1.y, m));
  return x2.y;
}

// OPTDecoder; with sequence_parallel (the policy's forward replacement) the
// embeddings are split along the sequence over tp before the layers, and
// gathered again before project_out (a replicated layer). A pipeline
// stage's: the embeddings and project_in on the first stage, the final
// norm and project_out on the last.
Module::ForwardFn DecoderForward(bool sequence_parallel, PipelineStage stage) {
  return [sequence_parallel, stage](Module& self, const ColoTensor& input) -> absl::StatusOr<ColoTensor> {
    ColoTensor x = input;
    // The residual stream's spec; in 3D a lone projection (a Linear3D
    // without its pair) leaves its output in the swapped spec, moved back.
    DistSpec stream = input.spec();  // a later stage's input is the stream
    if (stage.first()) {
      ASSIGN_OR_RETURN(int64_t offset, self.IntAttr("position_offset"));
      ASSIGN_OR_RETURN(ColoTensor pos_ids, PositionIds(input, offset));
      ASSIGN_OR_RETURN(x, self.Call("embed_tokens", input));
      if (self.Find("project_in") != nullptr) {
        ASSIGN_OR_RETURN(x, self.Call("project_in", x));
      }
      ASSIGN_OR_RETURN(ColoTensor where, self.Call("embed_positions", pos_ids));
      stream = where.spec();
      ASSIGN_OR_RETURN(x, x.Redistribute(stream));  // no step where x is in it already
      ASSIGN_OR_RETURN(x, AddActivations(x, where));
      if (sequence_parallel) {
        ASSIGN_OR_RETURN(x, SplitSequence(x));
      }
    }
    ASSIGN_OR_RETURN(Module * layers, self.Get("layers"));
    ASSIGN_OR_RETURN(x, RunSequential(*layers, x));
    if (!stage.last()) return x;
    if (self.Find("final_layer_norm") != nullptr) {
      ASSIGN_OR_RETURN(x, self.Call("final_layer_norm", x));
    }
    if (self.Find("project_out") != nullptr) {
      if (sequence_parallel) {
        ASSIGN_OR_RETURN(x, x.ToReplicate());
      }
      ASSIGN_OR_RETURN(x, self.Call("project_out", x));
      ASSIGN_OR_RETURN(x, x.Redistribute(stream));  // 3D: for the head tied to embed_tokens
    }
    return x;
  };
}

absl::StatusOr<ColoTensor> ModelForward(Module& self, const ColoTensor& ids) { return self.Call("decoder", ids); }

// 0 relu, 1 gelu, 2 gelu tanh (Mlp's "activation"); -1 for another.
int ActivationCode(const std::string& activation) {
  if (activation == "relu") return 0;
  if (activation == "gelu") return 1;
  if (activation == "gelu_new" || activation == "gelu_pytorch_tanh") return 2;
  return -1;
}

// OPTForCausalLM's names around its layer table (spec/plan.cc): the
// decoder under model.decoder, its own forward (DecoderForward), the head
// tied to embed_tokens unless tie_word_embeddings is false.
const TableFamily& Opt() {
  static const TableFamily* const f = [] {
    auto* d = new TableFamily;
    d->root_class = "OPTForCausalLM";
    d->base = "model.decoder";
    d->base_class = "OPTDecoder";
    d->layer_lists = {{"layers", "OPTDecoderLayer", DecoderLayerForward}};
    d->containers = {{"model", "OPTModel", ModelForward},
                     {"model.decoder.layers.*.self_attn", "OPTAttention", AttentionForward}};
    d->tokens = "embed_tokens";
    d->positions = "embed_positions";
    d->final_norm = "final_layer_norm";
    d->head = "lm_head";
    d->model_forward = DecoderForward;
    d->configure = [](Module& root, const ModelConfig& c) {
      root.Find("model.decoder")->SetAttr("position_offset", static_cast<double>(c.position_offset));
    };
    d->configure_layer = [](Module& layer, const ModelConfig& c) {
      layer.SetAttr("do_layer_norm_before", c.norm_before ? 1 : 0);
      layer.SetAttr("activation", ActivationCode(c.activation));
      Module* attn = layer.Find("self_attn");
      attn->SetAttr("num_heads", static_cast<double>(c.num_heads));
      attn->SetAttr("head_dim", static_cast<double>(c.head_dim()));
    };
    return d;
  }();
  return *f;
}

absl::StatusOr<std::unique_ptr<Module>> Build(const ModelConfig& c) {
  if (ActivationCode(c.activation) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("activation_function \"", c.activation, "\" is not one of relu, gelu, gelu_new"));
  }
  return BuildFromTable(Opt(), c);
}

// ShardFormer's OPTPolicy: 1D (q/k/v and fc1 column-parallel, out_proj and
// fc2 row-parallel, vocab-parallel embeddings and head) with optional
// sequence parallelism, and 2D / 2.5D; project_in/out stay replicated in 1D.
// The replacements from the layer table, each rank's share of the heads
// here.
class OptPolicy : public CausalLmPolicy {
 public:
  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                              const ShardConfig& shard) override {
    ASSIGN_OR_RETURN(auto policy, TablePolicy(Opt(), config, shard));
    policy["OPTDecoderLayer"].attribute_replacement = {
        {"self_attn.num_heads", static_cast<double>(config.num_heads / shard.head_split())}};
    return policy;
  }
};

}  // namespace

ModelFamily OptFamily() {
  ModelFamily f;
  f.base_model_prefix = "model";
  f.build = Build;
  f.policy = [] { return std::unique_ptr<Policy>(new OptPolicy()); };
  f.split_stage = [](Module& root, const PipelineStage& stage) { return SplitTableStage(Opt(), root, stage); };
  return f;
}

}  // namespace colod::shardformer
