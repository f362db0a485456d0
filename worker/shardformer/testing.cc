#include "worker/shardformer/testing.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "gtest/gtest.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/safetensors.h"
#include "worker/shardformer/shardformer.h"

namespace colod::shardformer::testing {
namespace {

absl::StatusOr<Tensor> Random(const Shape& shape, uint64_t seed, float scale, float mean = 0) {
  ASSIGN_OR_RETURN(Tensor t, Tensor::RandomNormal(shape, seed));
  std::vector<float> v = t.ToFloats();
  for (float& x : v) x = mean + scale * x;
  return Tensor::FromFloats(shape, v);
}

absl::StatusOr<Tensor> Transposed(const Tensor& t) {
  ASSIGN_OR_RETURN(Tensor v, t.Transpose(0, 1));
  return v.Contiguous();
}

// Collects a tiny model's random tensors (in order) and writes its directory.
struct Writer {
  TinyModel& m;
  uint64_t seed;
  std::vector<std::pair<std::string, Tensor>> tensors;
  absl::Status Add(const std::string& name, const Shape& shape, float scale, float mean = 0) {
    ASSIGN_OR_RETURN(Tensor t, Random(shape, ++seed, scale, mean));
    tensors.emplace_back(name, t);
    m.tensors[name] = t;
    return absl::OkStatus();
  }
  // An nn.Linear's weight [out, in] and bias [out].
  absl::Status Linear(const std::string& name, int64_t in, int64_t out, float scale) {
    RETURN_IF_ERROR(Add(name + ".weight", {out, in}, scale));
    return Add(name + ".bias", {out}, 0.1f);
  }
  // A LayerNorm's weight (about 1) and bias.
  absl::Status Norm(const std::string& name, int64_t size) {
    RETURN_IF_ERROR(Add(name + ".weight", {size}, 0.1f, 1.0f));
    return Add(name + ".bias", {size}, 0.1f);
  }
  absl::Status Write(const std::string& config) {
    ::mkdir(m.dir.c_str(), 0755);
    std::ofstream(m.dir + "/config.json") << config;
    return WriteSafetensors(m.dir + "/model.safetensors", tensors);
  }
};

}  // namespace

Tensor TokenIds(int64_t batch, int64_t seq, int64_t vocab, uint64_t salt) {
  std::vector<int64_t> v(batch * seq);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>((i * 7 + salt * 13 + i * i * 3) % vocab);
  return *Tensor::FromInt64s({batch, seq}, v);
}

absl::StatusOr<TinyModel> WriteTinyGpt2(const std::string& dir, const TinyOptions& o) {
  TinyModel m;
  m.dir = dir;
  const std::string config = absl::StrCat(
      R"({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": )", o.vocab,
      R"(, "n_embd": )", o.hidden, R"(, "n_layer": )", o.layers, R"(, "n_head": )", o.heads,
      R"(, "n_positions": )", o.positions, R"(, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"})");
  ASSIGN_OR_RETURN(m.config, ParseModelConfig(config));
  const std::string p = o.prefixed ? "transformer." : "";
  const int64_t h = o.hidden, f = 4 * o.hidden;
  Writer w{m, o.seed * 1000, {}};
  auto add = [&w](const std::string& name, const Shape& shape, float scale, float mean = 0) {
    return w.Add(name, shape, scale, mean);
  };
  RETURN_IF_ERROR(add(p + "wte.weight", {o.vocab, h}, 0.5f));
  RETURN_IF_ERROR(add(p + "wpe.weight", {o.positions, h}, 0.1f));
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string b = absl::StrCat(p, "h.", i, ".");
    RETURN_IF_ERROR(add(b + "ln_1.weight", {h}, 0.1f, 1.0f));
    RETURN_IF_ERROR(add(b + "ln_1.bias", {h}, 0.1f));
    RETURN_IF_ERROR(add(b + "attn.c_attn.weight", {h, 3 * h}, 0.15f));
    RETURN_IF_ERROR(add(b + "attn.c_attn.bias", {3 * h}, 0.1f));
    RETURN_IF_ERROR(add(b + "attn.c_proj.weight", {h, h}, 0.1f));
    RETURN_IF_ERROR(add(b + "attn.c_proj.bias", {h}, 0.1f));
    RETURN_IF_ERROR(add(b + "ln_2.weight", {h}, 0.1f, 1.0f));
    RETURN_IF_ERROR(add(b + "ln_2.bias", {h}, 0.1f));
    RETURN_IF_ERROR(add(b + "mlp.c_fc.weight", {h, f}, 0.1f));
    RETURN_IF_ERROR(add(b + "mlp.c_fc.bias", {f}, 0.1f));
    RETURN_IF_ERROR(add(b + "mlp.c_proj.weight", {f, h}, 0.05f));
    RETURN_IF_ERROR(add(b + "mlp.c_proj.bias", {h}, 0.1f));
  }
  RETURN_IF_ERROR(add(p + "ln_f.weight", {h}, 0.1f, 1.0f));
  RETURN_IF_ERROR(add(p + "ln_f.bias", {h}, 0.1f));
  RETURN_IF_ERROR(w.Write(config));
  return m;
}

Tensor MaskedLabels(const Tensor& ids) {
  std::vector<int64_t> v = ids.ToInt64s();
  for (size_t i = 0; i < v.size(); ++i) {
    if (i % 3 != 1) v[i] = -100;
  }
  return *Tensor::FromInt64s(ids.shape(), v);
}

absl::StatusOr<TinyModel> WriteTinyBert(const std::string& dir, const TinyOptions& o) {
  TinyModel m;
  m.dir = dir;
  const int64_t h = o.hidden, f = 2 * o.hidden;
  const std::string config = absl::StrCat(
      R"({"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": )", o.vocab,
      R"(, "hidden_size": )", h, R"(, "num_hidden_layers": )", o.layers, R"(, "num_attention_heads": )", o.heads,
      R"(, "intermediate_size": )", f, R"(, "max_position_embeddings": )", o.positions,
      R"(, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_act": "gelu"})");
  ASSIGN_OR_RETURN(m.config, ParseModelConfig(config));
  const std::string p = o.prefixed ? "bert." : "";
  Writer w{m, o.seed * 1000 + 700, {}};
  auto add = [&w](const std::string& name, const Shape& shape, float scale, float mean = 0) {
    return w.Add(name, shape, scale, mean);
  };
  RETURN_IF_ERROR(add(p + "embeddings.word_embeddings.weight", {o.vocab, h}, 0.5f));
  RETURN_IF_ERROR(add(p + "embeddings.position_embeddings.weight", {o.positions, h}, 0.1f));
  RETURN_IF_ERROR(add(p + "embeddings.token_type_embeddings.weight", {2, h}, 0.1f));
  RETURN_IF_ERROR(w.Norm(p + "embeddings.LayerNorm", h));
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string b = absl::StrCat(p, "encoder.layer.", i, ".");
    for (const char* name : {"query", "key", "value"}) {
      RETURN_IF_ERROR(w.Linear(b + "attention.self." + name, h, h, 0.15f));
    }
    RETURN_IF_ERROR(w.Linear(b + "attention.output.dense", h, h, 0.1f));
    RETURN_IF_ERROR(w.Norm(b + "attention.output.LayerNorm", h));
    RETURN_IF_ERROR(w.Linear(b + "intermediate.dense", h, f, 0.1f));
    RETURN_IF_ERROR(w.Linear(b + "output.dense", f, h, 0.08f));
    RETURN_IF_ERROR(w.Norm(b + "output.LayerNorm", h));
  }
  RETURN_IF_ERROR(w.Linear("cls.predictions.transform.dense", h, h, 0.1f));
  RETURN_IF_ERROR(w.Norm("cls.predictions.transform.LayerNorm", h));
  RETURN_IF_ERROR(add("cls.predictions.bias", {o.vocab}, 0.1f));
  RETURN_IF_ERROR(w.Write(config));
  return m;
}

absl::StatusOr<TinyModel> WriteTinyLlama(const std::string& dir, const TinyOptions& o) {
  TinyModel m;
  m.dir = dir;
  const std::string config = absl::StrCat(
      R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": )", o.vocab,
      R"(, "hidden_size": )", o.hidden, R"(, "num_hidden_layers": )", o.layers, R"(, "num_attention_heads": )",
      o.heads, R"(, "num_key_value_heads": )", o.kv_heads, R"(, "intermediate_size": )", o.intermediate,
      R"(, "max_position_embeddings": )", o.positions,
      R"(, "rms_norm_eps": 1e-6, "rope_theta": 500.0, "hidden_act": "silu", "tie_word_embeddings": )",
      o.tie ? "true" : "false", "}");
  ASSIGN_OR_RETURN(m.config, ParseModelConfig(config));
  const std::string p = o.prefixed ? "model." : "";
  const int64_t h = o.hidden, kv = o.kv_heads * (o.hidden / o.heads), f = o.intermediate;
  Writer w{m, o.seed * 1000 + 500, {}};
  auto add = [&w](const std::string& name, const Shape& shape, float scale, float mean = 0) {
    return w.Add(name, shape, scale, mean);
  };
  RETURN_IF_ERROR(add(p + "embed_tokens.weight", {o.vocab, h}, 0.5f));
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string b = absl::StrCat(p, "layers.", i, ".");
    RETURN_IF_ERROR(add(b + "input_layernorm.weight", {h}, 0.1f, 1.0f));
    RETURN_IF_ERROR(add(b + "self_attn.q_proj.weight", {h, h}, 0.15f));
    RETURN_IF_ERROR(add(b + "self_attn.k_proj.weight", {kv, h}, 0.15f));
    RETURN_IF_ERROR(add(b + "self_attn.v_proj.weight", {kv, h}, 0.15f));
    RETURN_IF_ERROR(add(b + "self_attn.o_proj.weight", {h, h}, 0.1f));
    RETURN_IF_ERROR(add(b + "post_attention_layernorm.weight", {h}, 0.1f, 1.0f));
    RETURN_IF_ERROR(add(b + "mlp.gate_proj.weight", {f, h}, 0.15f));
    RETURN_IF_ERROR(add(b + "mlp.up_proj.weight", {f, h}, 0.15f));
    RETURN_IF_ERROR(add(b + "mlp.down_proj.weight", {h, f}, 0.1f));
  }
  RETURN_IF_ERROR(add(p + "norm.weight", {h}, 0.1f, 1.0f));
  if (!o.tie) {
    RETURN_IF_ERROR(add("lm_head.weight", {o.vocab, h}, 0.3f));
  }
  RETURN_IF_ERROR(w.Write(config));
  return m;
}

absl::StatusOr<TinyModel> WriteTinyOpt(const std::string& dir, const TinyOptions& o) {
  TinyModel m;
  m.dir = dir;
  const int64_t h = o.hidden, e = o.embed_dim == 0 ? o.hidden : o.embed_dim, f = o.intermediate;
  const std::string config = absl::StrCat(
      R"({"model_type": "opt", "architectures": ["OPTForCausalLM"], "vocab_size": )", o.vocab,
      R"(, "hidden_size": )", h, R"(, "num_hidden_layers": )", o.layers, R"(, "num_attention_heads": )", o.heads,
      R"(, "ffn_dim": )", f, R"(, "max_position_embeddings": )", o.positions, R"(, "word_embed_proj_dim": )", e,
      R"(, "do_layer_norm_before": )", o.pre_norm ? "true" : "false", R"(, "activation_function": ")", o.activation,
      R"(", "enable_bias": true, "tie_word_embeddings": )", o.tie ? "true" : "false", "}");
  ASSIGN_OR_RETURN(m.config, ParseModelConfig(config));
  const std::string p = o.prefixed ? "model.decoder." : "decoder.";
  Writer w{m, o.seed * 1000 + 900, {}};
  auto add = [&w](const std::string& name, const Shape& shape, float scale, float mean = 0) {
    return w.Add(name, shape, scale, mean);
  };
  RETURN_IF_ERROR(add(p + "embed_tokens.weight", {o.vocab, e}, 0.5f));
  RETURN_IF_ERROR(add(p + "embed_positions.weight", {o.positions + 2, h}, 0.3f));
  if (e != h) {
    RETURN_IF_ERROR(add(p + "project_in.weight", {h, e}, 0.2f));
  }
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string b = absl::StrCat(p, "layers.", i, ".");
    for (const char* proj : {"q_proj", "k_proj", "v_proj"}) {
      RETURN_IF_ERROR(w.Linear(b + "self_attn." + proj, h, h, 0.15f));
    }
    RETURN_IF_ERROR(w.Linear(b + "self_attn.out_proj", h, h, 0.1f));
    RETURN_IF_ERROR(w.Norm(b + "self_attn_layer_norm", h));
    RETURN_IF_ERROR(w.Linear(b + "fc1", h, f, 0.15f));
    RETURN_IF_ERROR(w.Linear(b + "fc2", f, h, 0.1f));
    RETURN_IF_ERROR(w.Norm(b + "final_layer_norm", h));
  }
  if (o.pre_norm) {
    RETURN_IF_ERROR(w.Norm(p + "final_layer_norm", h));
  }
  if (e != h) {
    RETURN_IF_ERROR(add(p + "project_out.weight", {e, h}, 0.2f));
  }
  if (!o.tie) {
    RETURN_IF_ERROR(add("lm_head.weight", {o.vocab, e}, 0.3f));
  }
  RETURN_IF_ERROR(w.Write(config));
  return m;
}

absl::StatusOr<TinyModel> WriteTinyBloom(const std::string& dir, const TinyOptions& o) {
  TinyModel m;
  m.dir = dir;
  const int64_t h = o.hidden;
  const std::string config = absl::StrCat(
      R"({"model_type": "bloom", "architectures": ["BloomForCausalLM"], "vocab_size": )", o.vocab,
      R"(, "hidden_size": )", h, R"(, "n_layer": )", o.layers, R"(, "n_head": )", o.heads,
      R"(, "layer_norm_epsilon": 1e-5, "apply_residual_connection_post_layernorm": )",
      o.residual_post_norm ? "true" : "false", R"(, "pretraining_tp": 1, "slow_but_exact": false, "seq_length": )",
      o.positions, R"(, "tie_word_embeddings": )", o.tie ? "true" : "false", "}");
  ASSIGN_OR_RETURN(m.config, ParseModelConfig(config));
  const std::string p = o.prefixed ? "transformer." : "";
  Writer w{m, o.seed * 1000 + 300, {}};
  RETURN_IF_ERROR(w.Add(p + "word_embeddings.weight", {o.vocab, h}, 0.5f));
  RETURN_IF_ERROR(w.Norm(p + "word_embeddings_layernorm", h));
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string b = absl::StrCat(p, "h.", i, ".");
    RETURN_IF_ERROR(w.Norm(b + "input_layernorm", h));
    RETURN_IF_ERROR(w.Linear(b + "self_attention.query_key_value", h, 3 * h, 0.15f));
    RETURN_IF_ERROR(w.Linear(b + "self_attention.dense", h, h, 0.1f));
    RETURN_IF_ERROR(w.Norm(b + "post_attention_layernorm", h));
    RETURN_IF_ERROR(w.Linear(b + "mlp.dense_h_to_4h", h, 4 * h, 0.1f));
    RETURN_IF_ERROR(w.Linear(b + "mlp.dense_4h_to_h", 4 * h, h, 0.05f));
  }
  RETURN_IF_ERROR(w.Norm(p + "ln_f", h));
  if (!o.tie) {
    RETURN_IF_ERROR(w.Add("lm_head.weight", {o.vocab, h}, 0.3f));
  }
  RETURN_IF_ERROR(w.Write(config));
  return m;
}

TinyOptions TinyFlanT5() {
  TinyOptions o;
  o.gated = true;
  o.tie = false;
  o.kv_dim = 8;
  return o;
}

absl::StatusOr<TinyModel> WriteTinyT5(const std::string& dir, const TinyOptions& o) {
  TinyModel m;
  m.dir = dir;
  const int64_t h = o.hidden, kv = o.kv_dim == 0 ? o.hidden / o.heads : o.kv_dim, inner = o.heads * kv;
  const int64_t f = o.intermediate, buckets = 8;
  const std::string config = absl::StrCat(
      R"({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": )", o.vocab,
      R"(, "d_model": )", h, R"(, "d_kv": )", kv, R"(, "d_ff": )", f, R"(, "num_layers": )", o.layers,
      R"(, "num_decoder_layers": )", o.layers, R"(, "num_heads": )", o.heads,
      R"(, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16, "layer_norm_epsilon": 1e-6)",
      R"(, "feed_forward_proj": ")", o.gated ? "gated-gelu" : "relu", R"(", "tie_word_embeddings": )",
      o.tie ? "true" : "false", R"(, "decoder_start_token_id": 0})");
  ASSIGN_OR_RETURN(m.config, ParseModelConfig(config));
  Writer w{m, o.seed * 1000 + 600, {}};
  auto norm = [&w, h](const std::string& name) { return w.Add(name + ".weight", {h}, 0.1f, 1.0f); };
  auto attention = [&](const std::string& p, bool relative) -> absl::Status {
    for (const char* proj : {"q", "k", "v"}) RETURN_IF_ERROR(w.Add(p + "." + proj + ".weight", {inner, h}, 0.15f));
    RETURN_IF_ERROR(w.Add(p + ".o.weight", {h, inner}, 0.1f));
    if (relative) RETURN_IF_ERROR(w.Add(p + ".relative_attention_bias.weight", {buckets, o.heads}, 0.5f));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(w.Add("shared.weight", {o.vocab, h}, 0.5f));
  for (const bool decoder : {false, true}) {
    const std::string s = decoder ? "decoder" : "encoder";
    for (int64_t i = 0; i < o.layers; ++i) {
      const std::string b = absl::StrCat(s, ".block.", i, ".layer.");
      RETURN_IF_ERROR(attention(b + "0.SelfAttention", i == 0));
      RETURN_IF_ERROR(norm(b + "0.layer_norm"));
      int ff = 1;
      if (decoder) {
        RETURN_IF_ERROR(attention(b + "1.EncDecAttention", false));
        RETURN_IF_ERROR(norm(b + "1.layer_norm"));
        ff = 2;
      }
      const std::string fp = absl::StrCat(b, ff, ".DenseReluDense.");
      for (const char* wi : o.gated ? std::vector<const char*>{"wi_0", "wi_1"} : std::vector<const char*>{"wi"}) {
        RETURN_IF_ERROR(w.Add(fp + wi + ".weight", {f, h}, 0.15f));
      }
      RETURN_IF_ERROR(w.Add(fp + "wo.weight", {h, f}, 0.1f));
      RETURN_IF_ERROR(norm(absl::StrCat(b, ff, ".layer_norm")));
    }
    RETURN_IF_ERROR(norm(s + ".final_layer_norm"));
  }
  if (!o.tie) {
    RETURN_IF_ERROR(w.Add("lm_head.weight", {o.vocab, h}, 0.3f));
  }
  RETURN_IF_ERROR(w.Write(config));
  return m;
}

absl::StatusOr<TinyModel> WriteTinyVit(const std::string& dir, const TinyOptions& o) {
  TinyModel m;
  m.dir = dir;
  const int64_t h = o.hidden, f = o.intermediate, n = (o.image / o.patch) * (o.image / o.patch);
  const std::string config = absl::StrCat(
      R"({"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": )", h,
      R"(, "num_hidden_layers": )", o.layers, R"(, "num_attention_heads": )", o.heads, R"(, "intermediate_size": )", f,
      R"(, "image_size": )", o.image, R"(, "patch_size": )", o.patch, R"(, "num_channels": )", o.channels,
      R"(, "num_labels": )", o.labels, R"(, "hidden_act": "gelu", "layer_norm_eps": 1e-12, "qkv_bias": true})");
  ASSIGN_OR_RETURN(m.config, ParseModelConfig(config));
  Writer w{m, o.seed * 1000 + 100, {}};
  RETURN_IF_ERROR(w.Add("vit.embeddings.cls_token", {1, 1, h}, 0.5f));
  RETURN_IF_ERROR(w.Add("vit.embeddings.position_embeddings", {1, n + 1, h}, 0.3f));
  RETURN_IF_ERROR(w.Add("vit.embeddings.patch_embeddings.projection.weight", {h, o.channels, o.patch, o.patch}, 0.2f));
  RETURN_IF_ERROR(w.Add("vit.embeddings.patch_embeddings.projection.bias", {h}, 0.1f));
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string b = absl::StrCat("vit.encoder.layer.", i, ".");
    RETURN_IF_ERROR(w.Norm(b + "layernorm_before", h));
    for (const char* name : {"query", "key", "value"}) {
      RETURN_IF_ERROR(w.Linear(b + "attention.attention." + name, h, h, 0.15f));
    }
    RETURN_IF_ERROR(w.Linear(b + "attention.output.dense", h, h, 0.1f));
    RETURN_IF_ERROR(w.Norm(b + "layernorm_after", h));
    RETURN_IF_ERROR(w.Linear(b + "intermediate.dense", h, f, 0.15f));
    RETURN_IF_ERROR(w.Linear(b + "output.dense", f, h, 0.1f));
  }
  RETURN_IF_ERROR(w.Norm("vit.layernorm", h));
  RETURN_IF_ERROR(w.Linear("classifier", h, o.labels, 0.3f));
  RETURN_IF_ERROR(w.Write(config));
  return m;
}

Tensor PixelValues(int64_t batch, const TinyOptions& o, uint64_t salt) {
  return *Tensor::RandomNormal({batch, o.channels, o.image, o.image}, 7000 + salt);
}

Tensor ImageLabels(int64_t batch, int64_t labels, uint64_t salt) {
  std::vector<int64_t> v(batch);
  for (int64_t i = 0; i < batch; ++i) v[i] = static_cast<int64_t>((i * 5 + salt * 3) % labels);
  return *Tensor::FromInt64s({batch}, v);
}

namespace {

// Leaf Variables of a model's tensors, created on first use, and the layers
// of the reference implementations on them.
class Leaves {
 public:
  explicit Leaves(const TinyModel& m) : m_(m) {}
  absl::StatusOr<Variable> operator()(const std::string& name) { return Get(name, false); }
  // y = x W^T + b, W [out, in] as nn.Linear stores it.
  absl::StatusOr<Variable> Linear(const Variable& x, const std::string& name, bool bias = true) {
    ASSIGN_OR_RETURN(Variable w, Get(name + ".weight", false));
    return Affine(x, w, name, bias);
  }
  // y = x W + b, W [in, out] as GPT-2's Conv1D stores it (held transposed).
  absl::StatusOr<Variable> Conv1D(const Variable& x, const std::string& name) {
    ASSIGN_OR_RETURN(Variable w, Get(name + ".weight", true));
    return Affine(x, w, name, true);
  }
  absl::StatusOr<Variable> LayerNorm(const Variable& x, const std::string& name, double eps) {
    ASSIGN_OR_RETURN(Variable g, Get(name + ".weight", false));
    ASSIGN_OR_RETURN(Variable b, Get(name + ".bias", false));
    return nn::LayerNorm(x, g, b, static_cast<float>(eps));
  }
  // The gradients by name, in the checkpoint's layout (every leaf must have one).
  absl::StatusOr<std::map<std::string, Tensor>> Grads() const {
    std::map<std::string, Tensor> out;
    for (const auto& [name, v] : leaves_) {
      if (!v.grad().has_value()) return absl::InternalError(absl::StrCat(name, " got no gradient"));
      Tensor g = *v.grad();
      if (transposed_.count(name)) {
        ASSIGN_OR_RETURN(g, Transposed(g));
      }
      out[name] = g;
    }
    return out;
  }

 private:
  absl::StatusOr<Variable> Get(const std::string& name, bool transpose) {
    auto it = leaves_.find(name);
    if (it != leaves_.end()) return it->second;
    auto t = m_.tensors.find(name);
    if (t == m_.tensors.end()) return absl::NotFoundError(name);
    Tensor value = t->second;
    if (transpose) {
      ASSIGN_OR_RETURN(value, Transposed(value));
      transposed_.insert(name);
    }
    return leaves_.emplace(name, Variable(value, true)).first->second;
  }
  absl::StatusOr<Variable> Affine(const Variable& x, const Variable& w, const std::string& name, bool bias) {
    if (!bias) return nn::Linear(x, w, std::nullopt);
    ASSIGN_OR_RETURN(Variable b, Get(name + ".bias", false));
    return nn::Linear(x, w, b);
  }

  const TinyModel& m_;
  std::map<std::string, Variable> leaves_;
  std::set<std::string> transposed_;
};

// Mean next-token cross-entropy of logits [B, S, V]; back-propagated.
absl::StatusOr<double> NextTokenLossBackward(const Variable& logits, const Tensor& ids) {
  const int64_t batch = ids.shape()[0], seq = ids.shape()[1], vocab = logits.value().shape()[2];
  ASSIGN_OR_RETURN(Variable shifted, nn::Narrow(logits, 1, 0, seq - 1));
  ASSIGN_OR_RETURN(shifted, nn::Reshape(shifted, {batch * (seq - 1), vocab}));
  ASSIGN_OR_RETURN(Tensor next, ids.Narrow(1, 1, seq - 1));
  ASSIGN_OR_RETURN(Tensor labels, next.Contiguous().Reshape({batch * (seq - 1)}));
  ASSIGN_OR_RETURN(Variable ce, nn::CrossEntropy(shifted, labels));
  ASSIGN_OR_RETURN(Variable total, Sum(ce));
  ASSIGN_OR_RETURN(Variable loss, Scale(total, 1.0f / static_cast<float>(batch * (seq - 1))));
  RETURN_IF_ERROR(Backward(loss));
  return loss.value().ToFloats()[0];
}

// The reference of logits [.., V] against integer labels (as many as the
// logits' rows; -100 left out): the mean cross-entropy back-propagated, the
// labels kept in the logits' leading shape.
absl::StatusOr<Reference> LabelledReference(const Variable& logits, const Tensor& labels, const Leaves& leaf) {
  const Shape& shape = logits.value().shape();
  const int64_t vocab = shape.back(), rows = logits.value().numel() / vocab;
  ASSIGN_OR_RETURN(Variable flat, nn::Reshape(logits, {rows, vocab}));
  ASSIGN_OR_RETURN(Tensor flat_labels, labels.Contiguous().Reshape({rows}));
  ASSIGN_OR_RETURN(Variable ce, nn::CrossEntropy(flat, flat_labels));
  int64_t count = 0;
  for (int64_t l : labels.ToInt64s()) count += l != -100;
  ASSIGN_OR_RETURN(Variable total, Sum(ce));
  ASSIGN_OR_RETURN(Variable loss, Scale(total, 1.0f / static_cast<float>(count)));
  RETURN_IF_ERROR(Backward(loss));
  Reference r;
  r.loss = loss.value().ToFloats()[0];
  r.logits = logits.value();
  ASSIGN_OR_RETURN(r.labels, flat_labels.Reshape(Shape(shape.begin(), shape.end() - 1)));
  r.tokens = count;
  ASSIGN_OR_RETURN(r.grads, leaf.Grads());
  return r;
}

// A causal LM's reference: its logits, the mean next-token loss
// back-propagated, and every leaf's gradient.
absl::StatusOr<Reference> NextTokenReference(const Variable& logits, const Tensor& ids, const Leaves& leaf) {
  Reference r;
  ASSIGN_OR_RETURN(r.loss, NextTokenLossBackward(logits, ids));
  r.tokens = ids.shape()[0] * (ids.shape()[1] - 1);
  r.logits = logits.value();
  ASSIGN_OR_RETURN(r.grads, leaf.Grads());
  return r;
}

}  // namespace

absl::StatusOr<Reference> ReferenceBert(const TinyModel& m, const Tensor& ids, const Tensor& labels) {
  const ModelConfig& c = m.config;
  const std::string p = m.tensors.count("embeddings.word_embeddings.weight") ? "" : "bert.";
  Leaves leaf(m);
  const int64_t batch = ids.shape()[0], seq = ids.shape()[1], h = c.hidden_size, nh = c.num_heads,
                d = c.head_dim();
  auto linear = [&](const Variable& x, const std::string& name) { return leaf.Linear(x, name); };
  auto norm = [&](const Variable& x, const std::string& name) { return leaf.LayerNorm(x, name, c.norm_eps); };
  std::vector<int64_t> pos(batch * seq);
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int64_t>(i) % seq;
  ASSIGN_OR_RETURN(Tensor positions, Tensor::FromInt64s({batch, seq}, pos));
  ASSIGN_OR_RETURN(Tensor types, Tensor::Zeros({batch, seq}, DType::kI64));
  ASSIGN_OR_RETURN(Variable words, leaf(p + "embeddings.word_embeddings.weight"));
  ASSIGN_OR_RETURN(Variable wpos, leaf(p + "embeddings.position_embeddings.weight"));
  ASSIGN_OR_RETURN(Variable wtype, leaf(p + "embeddings.token_type_embeddings.weight"));
  ASSIGN_OR_RETURN(Variable x, nn::Embedding(words, ids));
  ASSIGN_OR_RETURN(Variable e2, nn::Embedding(wpos, positions));
  ASSIGN_OR_RETURN(Variable e3, nn::Embedding(wtype, types));
  ASSIGN_OR_RETURN(x, Add(x, e2));
  ASSIGN_OR_RETURN(x, Add(x, e3));
  ASSIGN_OR_RETURN(x, norm(x, p + "embeddings.LayerNorm"));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string b = absl::StrCat(p, "encoder.layer.", l, ".");
    Variable qkv[3];
    const char* names[] = {"query", "key", "value"};
    for (int i = 0; i < 3; ++i) {
      ASSIGN_OR_RETURN(Variable t, linear(x, b + "attention.self." + names[i]));
      ASSIGN_OR_RETURN(qkv[i], nn::Reshape(t, {batch, seq, nh, d}));
    }
    ASSIGN_OR_RETURN(Variable ctx, nn::Attention(qkv[0], qkv[1], qkv[2], 1.0f / std::sqrt(float(d)), false));
    ASSIGN_OR_RETURN(ctx, nn::Reshape(ctx, {batch, seq, h}));
    ASSIGN_OR_RETURN(Variable ao, linear(ctx, b + "attention.output.dense"));
    ASSIGN_OR_RETURN(ao, Add(ao, x));
    ASSIGN_OR_RETURN(Variable attended, norm(ao, b + "attention.output.LayerNorm"));
    ASSIGN_OR_RETURN(Variable inner, linear(attended, b + "intermediate.dense"));
    ASSIGN_OR_RETURN(inner, nn::Gelu(inner, ops::GeluApprox::kNone));
    ASSIGN_OR_RETURN(Variable out, linear(inner, b + "output.dense"));
    ASSIGN_OR_RETURN(out, Add(out, attended));
    ASSIGN_OR_RETURN(x, norm(out, b + "output.LayerNorm"));
  }
  ASSIGN_OR_RETURN(Variable t, linear(x, "cls.predictions.transform.dense"));
  ASSIGN_OR_RETURN(t, nn::Gelu(t, ops::GeluApprox::kNone));
  ASSIGN_OR_RETURN(t, norm(t, "cls.predictions.transform.LayerNorm"));
  ASSIGN_OR_RETURN(Variable bias, leaf("cls.predictions.bias"));
  ASSIGN_OR_RETURN(Variable logits, nn::Linear(t, words, bias));  // decoder tied to the word embeddings
  return LabelledReference(logits, labels, leaf);
}

absl::StatusOr<Reference> ReferenceLlama(const TinyModel& m, const Tensor& ids) {
  const ModelConfig& c = m.config;
  const std::string p = m.tensors.count("embed_tokens.weight") ? "" : "model.";
  Leaves leaf(m);
  const int64_t batch = ids.shape()[0], seq = ids.shape()[1], h = c.hidden_size, d = c.head_dim();
  const float eps = static_cast<float>(c.norm_eps), theta = static_cast<float>(c.rope_theta);
  auto linear = [&](const Variable& x, const std::string& name) { return leaf.Linear(x, name, /*bias=*/false); };
  auto rms = [&](const Variable& x, const std::string& name) -> absl::StatusOr<Variable> {
    ASSIGN_OR_RETURN(Variable g, leaf(name + ".weight"));
    return nn::RmsNorm(x, g, eps);
  };
  ASSIGN_OR_RETURN(Variable table, leaf(p + "embed_tokens.weight"));
  ASSIGN_OR_RETURN(Variable x, nn::Embedding(table, ids));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string b = absl::StrCat(p, "layers.", l, ".");
    ASSIGN_OR_RETURN(Variable hn, rms(x, b + "input_layernorm"));
    ASSIGN_OR_RETURN(Variable q, linear(hn, b + "self_attn.q_proj"));
    ASSIGN_OR_RETURN(Variable k, linear(hn, b + "self_attn.k_proj"));
    ASSIGN_OR_RETURN(Variable v, linear(hn, b + "self_attn.v_proj"));
    ASSIGN_OR_RETURN(q, nn::Reshape(q, {batch, seq, c.num_heads, d}));
    ASSIGN_OR_RETURN(k, nn::Reshape(k, {batch, seq, c.num_kv_heads, d}));
    ASSIGN_OR_RETURN(v, nn::Reshape(v, {batch, seq, c.num_kv_heads, d}));
    ASSIGN_OR_RETURN(q, nn::Rope(q, theta));
    ASSIGN_OR_RETURN(k, nn::Rope(k, theta));
    ASSIGN_OR_RETURN(Variable att, nn::CausalAttention(q, k, v, 1.0f / std::sqrt(float(d))));
    ASSIGN_OR_RETURN(att, nn::Reshape(att, {batch, seq, h}));
    ASSIGN_OR_RETURN(Variable o, linear(att, b + "self_attn.o_proj"));
    ASSIGN_OR_RETURN(x, Add(x, o));
    ASSIGN_OR_RETURN(Variable hn2, rms(x, b + "post_attention_layernorm"));
    ASSIGN_OR_RETURN(Variable gate, linear(hn2, b + "mlp.gate_proj"));
    ASSIGN_OR_RETURN(Variable up, linear(hn2, b + "mlp.up_proj"));
    ASSIGN_OR_RETURN(Variable act, nn::Silu(gate));
    ASSIGN_OR_RETURN(Variable prod, Mul(act, up));
    ASSIGN_OR_RETURN(Variable down, linear(prod, b + "mlp.down_proj"));
    ASSIGN_OR_RETURN(x, Add(x, down));
  }
  ASSIGN_OR_RETURN(x, rms(x, p + "norm"));
  ASSIGN_OR_RETURN(Variable head, leaf(c.tie_word_embeddings ? p + "embed_tokens.weight" : "lm_head.weight"));
  ASSIGN_OR_RETURN(Variable logits, nn::Linear(x, head, std::nullopt));
  return NextTokenReference(logits, ids, leaf);
}

// OPTForCausalLM.forward as modeling_opt.py writes it: positions from the
// attention mask's cumsum (all ones: s) plus the offset 2, q scaled by
// head_dim^-0.5 after its projection, LayerNorms before (or, for
// do_layer_norm_before false, after) each residual add.
absl::StatusOr<Reference> ReferenceOpt(const TinyModel& m, const Tensor& ids) {
  const ModelConfig& c = m.config;
  const std::string p = m.tensors.count("decoder.embed_tokens.weight") ? "decoder." : "model.decoder.";
  Leaves leaf(m);
  const int64_t batch = ids.shape()[0], seq = ids.shape()[1], h = c.hidden_size, nh = c.num_heads,
                d = c.head_dim();
  auto linear = [&](const Variable& x, const std::string& name) { return leaf.Linear(x, name); };
  auto norm = [&](const Variable& x, const std::string& name) { return leaf.LayerNorm(x, name, 1e-5); };
  std::vector<int64_t> pos(batch * seq);
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int64_t>(i) % seq + 2;
  ASSIGN_OR_RETURN(Tensor positions, Tensor::FromInt64s({batch, seq}, pos));
  ASSIGN_OR_RETURN(Variable tokens, leaf(p + "embed_tokens.weight"));
  ASSIGN_OR_RETURN(Variable wpos, leaf(p + "embed_positions.weight"));
  ASSIGN_OR_RETURN(Variable x, nn::Embedding(tokens, ids));
  if (m.tensors.count(p + "project_in.weight")) {
    ASSIGN_OR_RETURN(x, leaf.Linear(x, p + "project_in", /*bias=*/false));
  }
  ASSIGN_OR_RETURN(Variable where, nn::Embedding(wpos, positions));
  ASSIGN_OR_RETURN(x, Add(x, where));
  auto act = [&](const Variable& v) -> absl::StatusOr<Variable> {
    if (c.activation == "relu") return nn::Relu(v);
    return nn::Gelu(v, c.activation == "gelu" ? ops::GeluApprox::kNone : ops::GeluApprox::kTanh);
  };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string b = absl::StrCat(p, "layers.", l, ".");
    Variable residual = x;
    if (c.norm_before) {
      ASSIGN_OR_RETURN(x, norm(x, b + "self_attn_layer_norm"));
    }
    ASSIGN_OR_RETURN(Variable q, linear(x, b + "self_attn.q_proj"));
    ASSIGN_OR_RETURN(q, Scale(q, 1.0f / std::sqrt(static_cast<float>(d))));
    ASSIGN_OR_RETURN(Variable k, linear(x, b + "self_attn.k_proj"));
    ASSIGN_OR_RETURN(Variable v, linear(x, b + "self_attn.v_proj"));
    ASSIGN_OR_RETURN(q, nn::Reshape(q, {batch, seq, nh, d}));
    ASSIGN_OR_RETURN(k, nn::Reshape(k, {batch, seq, nh, d}));
    ASSIGN_OR_RETURN(v, nn::Reshape(v, {batch, seq, nh, d}));
    ASSIGN_OR_RETURN(Variable att, nn::CausalAttention(q, k, v, 1.0f));
    ASSIGN_OR_RETURN(att, nn::Reshape(att, {batch, seq, h}));
    ASSIGN_OR_RETURN(Variable o, linear(att, b + "self_attn.out_proj"));
    ASSIGN_OR_RETURN(x, Add(residual, o));
    if (!c.norm_before) {
      ASSIGN_OR_RETURN(x, norm(x, b + "self_attn_layer_norm"));
    }
    residual = x;
    if (c.norm_before) {
      ASSIGN_OR_RETURN(x, norm(x, b + "final_layer_norm"));
    }
    ASSIGN_OR_RETURN(Variable inner, linear(x, b + "fc1"));
    ASSIGN_OR_RETURN(inner, act(inner));
    ASSIGN_OR_RETURN(Variable out, linear(inner, b + "fc2"));
    ASSIGN_OR_RETURN(x, Add(residual, out));
    if (!c.norm_before) {
      ASSIGN_OR_RETURN(x, norm(x, b + "final_layer_norm"));
    }
  }
  if (m.tensors.count(p + "final_layer_norm.weight")) {
    ASSIGN_OR_RETURN(x, norm(x, p + "final_layer_norm"));
  }
  if (m.tensors.count(p + "project_out.weight")) {
    ASSIGN_OR_RETURN(x, leaf.Linear(x, p + "project_out", /*bias=*/false));
  }
  ASSIGN_OR_RETURN(Variable head, leaf(c.tie_word_embeddings ? p + "embed_tokens.weight" : "lm_head.weight"));
  ASSIGN_OR_RETURN(Variable logits, nn::Linear(x, head, std::nullopt));
  return NextTokenReference(logits, ids, leaf);
}

// build_alibi_tensor's slopes, written from modeling_bloom.py.
std::vector<float> BloomSlopes(int64_t heads) {
  const int64_t closest = int64_t{1} << static_cast<int>(std::floor(std::log2(static_cast<double>(heads))));
  const double base = std::pow(2.0, -std::pow(2.0, -(std::log2(static_cast<double>(closest)) - 3)));
  std::vector<float> slopes;
  for (int64_t k = 1; k <= closest; ++k) slopes.push_back(static_cast<float>(std::pow(base, k)));
  if (closest != heads) {
    const double extra = std::pow(2.0, -std::pow(2.0, -(std::log2(2.0 * closest) - 3)));
    const int64_t remaining = std::min(closest, heads - closest);
    for (int64_t k = 1; k < 1 + 2 * remaining; k += 2) slopes.push_back(static_cast<float>(std::pow(extra, k)));
  }
  return slopes;
}

// BloomForCausalLM.forward as modeling_bloom.py writes it: per-head fused
// q/k/v ([B, S, heads, 3, head_dim]), ALiBi slopes from build_alibi_tensor,
// the residual before the LayerNorms unless
// apply_residual_connection_post_layernorm.
absl::StatusOr<Reference> ReferenceBloom(const TinyModel& m, const Tensor& ids) {
  const ModelConfig& c = m.config;
  const std::string p = m.tensors.count("word_embeddings.weight") ? "" : "transformer.";
  Leaves leaf(m);
  const int64_t batch = ids.shape()[0], seq = ids.shape()[1], h = c.hidden_size, nh = c.num_heads,
                d = c.head_dim();
  auto linear = [&](const Variable& x, const std::string& name) { return leaf.Linear(x, name); };
  auto norm = [&](const Variable& x, const std::string& name) { return leaf.LayerNorm(x, name, c.norm_eps); };
  const std::vector<float> slopes = BloomSlopes(nh);
  ASSIGN_OR_RETURN(Variable words, leaf(p + "word_embeddings.weight"));
  ASSIGN_OR_RETURN(Variable x, nn::Embedding(words, ids));
  ASSIGN_OR_RETURN(x, norm(x, p + "word_embeddings_layernorm"));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string b = absl::StrCat(p, "h.", l, ".");
    ASSIGN_OR_RETURN(Variable ln, norm(x, b + "input_layernorm"));
    const Variable residual = c.residual_post_norm ? ln : x;
    ASSIGN_OR_RETURN(Variable fused, linear(ln, b + "self_attention.query_key_value"));
    ASSIGN_OR_RETURN(fused, nn::Reshape(fused, {batch, seq, nh, 3, d}));
    Variable qkv[3];
    for (int i = 0; i < 3; ++i) {
      ASSIGN_OR_RETURN(Variable part, nn::Narrow(fused, 3, i, 1));
      ASSIGN_OR_RETURN(qkv[i], nn::Reshape(part, {batch, seq, nh, d}));
    }
    ASSIGN_OR_RETURN(Variable att, nn::AlibiAttention(qkv[0], qkv[1], qkv[2], 1.0f / std::sqrt(float(d)), slopes));
    ASSIGN_OR_RETURN(att, nn::Reshape(att, {batch, seq, h}));
    ASSIGN_OR_RETURN(Variable dense, linear(att, b + "self_attention.dense"));
    ASSIGN_OR_RETURN(Variable attn_out, Add(dense, residual));
    ASSIGN_OR_RETURN(Variable ln2, norm(attn_out, b + "post_attention_layernorm"));
    const Variable residual2 = c.residual_post_norm ? ln2 : attn_out;
    ASSIGN_OR_RETURN(Variable inner, linear(ln2, b + "mlp.dense_h_to_4h"));
    ASSIGN_OR_RETURN(inner, nn::Gelu(inner, ops::GeluApprox::kTanh));
    ASSIGN_OR_RETURN(Variable out, linear(inner, b + "mlp.dense_4h_to_h"));
    ASSIGN_OR_RETURN(x, Add(out, residual2));
  }
  ASSIGN_OR_RETURN(x, norm(x, p + "ln_f"));
  ASSIGN_OR_RETURN(Variable head, leaf(c.tie_word_embeddings ? p + "word_embeddings.weight" : "lm_head.weight"));
  ASSIGN_OR_RETURN(Variable logits, nn::Linear(x, head, std::nullopt));
  return NextTokenReference(logits, ids, leaf);
}

// T5ForConditionalGeneration.forward as modeling_t5.py writes it (no
// attention mask, dropout off): T5LayerNorm is an RMS norm without bias,
// attention scores are unscaled, layer 0's relative_attention_bias gives
// the position bias every block of its stack adds (compute_bias:
// bidirectional buckets in the encoder, causal in the decoder), the
// cross-attention has none, and a tied head reads the decoder output
// scaled by d_model^-0.5.
absl::StatusOr<Reference> ReferenceT5(const TinyModel& m, const Tensor& ids, const Tensor& decoder_ids,
                                      const Tensor& labels) {
  const ModelConfig& c = m.config;
  Leaves leaf(m);
  const int64_t batch = ids.shape()[0], nh = c.num_heads, d = c.kv_dim, inner = nh * d;
  const float eps = static_cast<float>(c.norm_eps);
  auto rms = [&](const Variable& x, const std::string& name) -> absl::StatusOr<Variable> {
    ASSIGN_OR_RETURN(Variable g, leaf(name + ".weight"));
    return nn::RmsNorm(x, g, eps);
  };
  auto linear = [&](const Variable& x, const std::string& name) { return leaf.Linear(x, name, /*bias=*/false); };
  auto bias_of = [&](const std::string& table, int64_t sq, int64_t sk, bool bidirectional) -> absl::StatusOr<Variable> {
    const std::vector<int64_t> buckets =
        nn::RelativePositionBuckets(sq, sk, bidirectional, c.relative_buckets, c.relative_max_distance);
    ASSIGN_OR_RETURN(Tensor ids_t, Tensor::FromInt64s({sq, sk}, buckets));
    ASSIGN_OR_RETURN(Variable t, leaf(table + ".weight"));
    ASSIGN_OR_RETURN(Variable values, nn::Embedding(t, ids_t));  // [sq, sk, heads]
    std::vector<Variable> heads;
    for (int64_t h = 0; h < nh; ++h) {
      ASSIGN_OR_RETURN(Variable col, nn::Narrow(values, 2, h, 1));
      ASSIGN_OR_RETURN(col, nn::Reshape(col, {1, sq, sk}));
      heads.push_back(col);
    }
    return nn::Cat(heads, 0);
  };
  auto attend = [&](const Variable& x, const Variable& kv, const std::string& p, const Variable& bias,
                    bool causal) -> absl::StatusOr<Variable> {
    const int64_t sq = x.value().shape()[1], sk = kv.value().shape()[1];
    ASSIGN_OR_RETURN(Variable q, linear(x, p + ".q"));
    ASSIGN_OR_RETURN(Variable k, linear(kv, p + ".k"));
    ASSIGN_OR_RETURN(Variable v, linear(kv, p + ".v"));
    ASSIGN_OR_RETURN(q, nn::Reshape(q, {batch, sq, nh, d}));
    ASSIGN_OR_RETURN(k, nn::Reshape(k, {batch, sk, nh, d}));
    ASSIGN_OR_RETURN(v, nn::Reshape(v, {batch, sk, nh, d}));
    ASSIGN_OR_RETURN(Variable att, nn::BiasedAttention(q, k, v, 1.0f, causal, bias));
    ASSIGN_OR_RETURN(att, nn::Reshape(att, {batch, sq, inner}));
    return linear(att, p + ".o");
  };
  auto ff = [&](const Variable& x, const std::string& p) -> absl::StatusOr<Variable> {
    Variable inner_act;
    if (c.activation == "gated-gelu") {
      ASSIGN_OR_RETURN(Variable g, linear(x, p + ".wi_0"));
      ASSIGN_OR_RETURN(g, nn::Gelu(g, ops::GeluApprox::kTanh));
      ASSIGN_OR_RETURN(Variable u, linear(x, p + ".wi_1"));
      ASSIGN_OR_RETURN(inner_act, Mul(g, u));
    } else {
      ASSIGN_OR_RETURN(Variable a, linear(x, p + ".wi"));
      ASSIGN_OR_RETURN(inner_act, nn::Relu(a));
    }
    return linear(inner_act, p + ".wo");
  };
  ASSIGN_OR_RETURN(Variable shared, leaf("shared.weight"));
  Variable encoded;
  for (const bool decoder : {false, true}) {
    const std::string s = decoder ? "decoder" : "encoder";
    const Tensor& in = decoder ? decoder_ids : ids;
    const int64_t seq = in.shape()[1];
    ASSIGN_OR_RETURN(Variable x, nn::Embedding(shared, in));
    ASSIGN_OR_RETURN(Variable bias, bias_of(s + ".block.0.layer.0.SelfAttention.relative_attention_bias", seq, seq,
                                            !decoder));
    for (int64_t l = 0; l < (decoder ? c.num_decoder_layers : c.num_layers); ++l) {
      const std::string b = absl::StrCat(s, ".block.", l, ".layer.");
      ASSIGN_OR_RETURN(Variable h, rms(x, b + "0.layer_norm"));
      ASSIGN_OR_RETURN(Variable a, attend(h, h, b + "0.SelfAttention", bias, decoder));
      ASSIGN_OR_RETURN(x, Add(x, a));
      int f = 1;
      if (decoder) {
        ASSIGN_OR_RETURN(Variable hc, rms(x, b + "1.layer_norm"));
        ASSIGN_OR_RETURN(Tensor zeros, Tensor::Zeros({nh, seq, encoded.value().shape()[1]}, DType::kF32));
        ASSIGN_OR_RETURN(Variable cr, attend(hc, encoded, b + "1.EncDecAttention", Variable(zeros), false));
        ASSIGN_OR_RETURN(x, Add(x, cr));
        f = 2;
      }
      ASSIGN_OR_RETURN(Variable hf, rms(x, absl::StrCat(b, f, ".layer_norm")));
      ASSIGN_OR_RETURN(Variable o, ff(hf, absl::StrCat(b, f, ".DenseReluDense")));
      ASSIGN_OR_RETURN(x, Add(x, o));
    }
    ASSIGN_OR_RETURN(x, rms(x, s + ".final_layer_norm"));
    if (!decoder) {
      encoded = x;
      continue;
    }
    if (c.tie_word_embeddings) {
      ASSIGN_OR_RETURN(x, Scale(x, static_cast<float>(std::pow(static_cast<double>(c.hidden_size), -0.5))));
    }
    ASSIGN_OR_RETURN(Variable head, leaf(c.tie_word_embeddings ? "shared.weight" : "lm_head.weight"));
    ASSIGN_OR_RETURN(Variable logits, nn::Linear(x, head, std::nullopt));
    ASSIGN_OR_RETURN(Reference r, LabelledReference(logits, labels, leaf));
    r.decoder_ids = decoder_ids;
    return r;
  }
  return absl::InternalError("unreachable");
}

// ViTForImageClassification.forward as modeling_vit.py writes it. The
// patches are cut by index arithmetic here (the model uses
// nn::ImagePatches): patch (i, j) is token 1 + i * (W / P) + j, its
// elements in the Conv2d weight's (channel, row, column) order.
absl::StatusOr<Reference> ReferenceVit(const TinyModel& m, const Tensor& pixels, const Tensor& labels) {
  const ModelConfig& c = m.config;
  Leaves leaf(m);
  const int64_t batch = pixels.shape()[0], ch = pixels.shape()[1], side = pixels.shape()[2], p = c.patch_size;
  const int64_t per_side = side / p, n = per_side * per_side, h = c.hidden_size, nh = c.num_heads, d = c.head_dim();
  const std::vector<float> px = pixels.ToFloats();
  std::vector<float> rows(batch * n * ch * p * p);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < per_side; ++i) {
      for (int64_t j = 0; j < per_side; ++j) {
        for (int64_t k = 0; k < ch; ++k) {
          for (int64_t y = 0; y < p; ++y) {
            for (int64_t x = 0; x < p; ++x) {
              const int64_t token = i * per_side + j, col = (k * p + y) * p + x;
              rows[(b * n + token) * ch * p * p + col] =
                  px[((b * ch + k) * side + i * p + y) * side + j * p + x];
            }
          }
        }
      }
    }
  }
  ASSIGN_OR_RETURN(Tensor patches, Tensor::FromFloats({batch, n, ch * p * p}, rows));
  ASSIGN_OR_RETURN(Variable conv, leaf("vit.embeddings.patch_embeddings.projection.weight"));
  ASSIGN_OR_RETURN(Variable conv_bias, leaf("vit.embeddings.patch_embeddings.projection.bias"));
  ASSIGN_OR_RETURN(Variable kernel, nn::Reshape(conv, {h, ch * p * p}));
  ASSIGN_OR_RETURN(Variable embedded, nn::Linear(Variable(patches), kernel, conv_bias));
  ASSIGN_OR_RETURN(Variable cls, leaf("vit.embeddings.cls_token"));
  ASSIGN_OR_RETURN(Variable pos, leaf("vit.embeddings.position_embeddings"));
  std::vector<Variable> images;  // each image: [CLS; patches] + positions
  for (int64_t b = 0; b < batch; ++b) {
    ASSIGN_OR_RETURN(Variable mine, nn::Narrow(embedded, 0, b, 1));
    ASSIGN_OR_RETURN(Variable seq, nn::Cat({cls, mine}, 1));
    ASSIGN_OR_RETURN(seq, Add(seq, pos));
    images.push_back(seq);
  }
  ASSIGN_OR_RETURN(Variable x, nn::Cat(images, 0));
  auto linear = [&](const Variable& v, const std::string& name) { return leaf.Linear(v, name); };
  auto norm = [&](const Variable& v, const std::string& name) { return leaf.LayerNorm(v, name, c.norm_eps); };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string b = absl::StrCat("vit.encoder.layer.", l, ".");
    ASSIGN_OR_RETURN(Variable ln, norm(x, b + "layernorm_before"));
    Variable qkv[3];
    const char* names[] = {"query", "key", "value"};
    for (int i = 0; i < 3; ++i) {
      ASSIGN_OR_RETURN(Variable t, linear(ln, b + "attention.attention." + names[i]));
      ASSIGN_OR_RETURN(qkv[i], nn::Reshape(t, {batch, n + 1, nh, d}));
    }
    ASSIGN_OR_RETURN(Variable ctx, nn::Attention(qkv[0], qkv[1], qkv[2], 1.0f / std::sqrt(float(d)), false));
    ASSIGN_OR_RETURN(ctx, nn::Reshape(ctx, {batch, n + 1, h}));
    ASSIGN_OR_RETURN(Variable a, linear(ctx, b + "attention.output.dense"));
    ASSIGN_OR_RETURN(x, Add(a, x));
    ASSIGN_OR_RETURN(Variable ln2, norm(x, b + "layernorm_after"));
    ASSIGN_OR_RETURN(Variable inner, linear(ln2, b + "intermediate.dense"));
    ASSIGN_OR_RETURN(inner, nn::Gelu(inner, ops::GeluApprox::kNone));
    ASSIGN_OR_RETURN(Variable out, linear(inner, b + "output.dense"));
    ASSIGN_OR_RETURN(x, Add(out, x));
  }
  ASSIGN_OR_RETURN(x, norm(x, "vit.layernorm"));
  ASSIGN_OR_RETURN(Variable first, nn::Narrow(x, 1, 0, 1));
  ASSIGN_OR_RETURN(Variable logits, linear(first, "classifier"));  // [B, 1, labels]
  return LabelledReference(logits, labels, leaf);
}

absl::StatusOr<Reference> ReferenceGpt2(const TinyModel& m, const Tensor& ids) {
  const ModelConfig& c = m.config;
  // Checkpoint names with or without the "transformer." prefix.
  const std::string p = m.tensors.count("wte.weight") ? "" : "transformer.";
  Leaves leaf(m);
  auto conv = [&](const Variable& x, const std::string& name) { return leaf.Conv1D(x, name); };
  auto norm = [&](const Variable& x, const std::string& name) { return leaf.LayerNorm(x, name, c.norm_eps); };
  const int64_t batch = ids.shape()[0], seq = ids.shape()[1], h = c.hidden_size, nh = c.num_heads,
                d = c.head_dim();
  std::vector<int64_t> pos(batch * seq);
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int64_t>(i) % seq;
  ASSIGN_OR_RETURN(Tensor positions, Tensor::FromInt64s({batch, seq}, pos));
  ASSIGN_OR_RETURN(Variable wte, leaf(p + "wte.weight"));
  ASSIGN_OR_RETURN(Variable wpe, leaf(p + "wpe.weight"));
  ASSIGN_OR_RETURN(Variable tok, nn::Embedding(wte, ids));
  ASSIGN_OR_RETURN(Variable where, nn::Embedding(wpe, positions));
  ASSIGN_OR_RETURN(Variable x, Add(tok, where));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string b = absl::StrCat(p, "h.", l, ".");
    ASSIGN_OR_RETURN(Variable hn, norm(x, b + "ln_1"));
    ASSIGN_OR_RETURN(Variable qkv, conv(hn, b + "attn.c_attn"));  // [B, S, 3H]: q | k | v
    Variable parts[3];
    for (int i = 0; i < 3; ++i) {
      ASSIGN_OR_RETURN(Variable part, nn::Narrow(qkv, 2, i * h, h));
      ASSIGN_OR_RETURN(parts[i], nn::Reshape(part, {batch, seq, nh, d}));
    }
    ASSIGN_OR_RETURN(Variable att, nn::CausalAttention(parts[0], parts[1], parts[2], 1.0f / std::sqrt(float(d))));
    ASSIGN_OR_RETURN(att, nn::Reshape(att, {batch, seq, h}));
    ASSIGN_OR_RETURN(Variable a, conv(att, b + "attn.c_proj"));
    ASSIGN_OR_RETURN(x, Add(x, a));
    ASSIGN_OR_RETURN(Variable hn2, norm(x, b + "ln_2"));
    ASSIGN_OR_RETURN(Variable fc, conv(hn2, b + "mlp.c_fc"));
    ASSIGN_OR_RETURN(Variable g, nn::Gelu(fc, ops::GeluApprox::kTanh));
    ASSIGN_OR_RETURN(Variable mo, conv(g, b + "mlp.c_proj"));
    ASSIGN_OR_RETURN(x, Add(x, mo));
  }
  ASSIGN_OR_RETURN(x, norm(x, p + "ln_f"));
  ASSIGN_OR_RETURN(Variable logits, nn::Linear(x, wte, std::nullopt));  // tied head
  return NextTokenReference(logits, ids, leaf);
}

void ExpectShardedMatchesReference(const TinyModel& model, const Reference& ref, const ShardConfig& shard,
                                   const Tensor& ids, double tol, const std::string& prefix) {
  using ::colod::testing::ExpectAllClose;
  const int64_t batch = ids.shape()[0];
  const int dp = shard.layout.data_parallel_size();
  ::colod::testing::RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int rank, ProcessGroup& pg) {
    auto sharded = ShardFormer(shard, &pg).Load(model.dir);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    // Each dp replica runs its rows of the batch.
    const int dp_rank = *pg.dp_local_rank();
    const int64_t rows = batch / dp;
    const Tensor mine = ids.Narrow(0, dp_rank * rows, rows)->Contiguous();
    auto logits = ref.decoder_ids.has_value()
                      ? (*sharded)->Forward(mine, ref.decoder_ids->Narrow(0, dp_rank * rows, rows)->Contiguous())
                      : (*sharded)->Forward(mine);
    ASSERT_TRUE(logits.ok()) << logits.status();
    auto full = (*sharded)->GatherLogits(*logits);
    ASSERT_TRUE(full.ok()) << full.status();
    ExpectAllClose(*full, ref.logits.Narrow(0, dp_rank * rows, rows)->Contiguous(), "logits", tol);
    auto loss = !ref.labels.has_value()
                    ? (*sharded)->NextTokenLoss(*logits, mine)
                    : (*sharded)->TokenLoss(*logits, ref.labels->Narrow(0, dp_rank * rows, rows)->Contiguous());
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_NEAR(loss->value, ref.loss, 1e-5 * std::fabs(ref.loss)) << "rank " << rank;
    EXPECT_EQ(loss->tokens, ref.tokens);
    ASSERT_TRUE(Backward(loss->loss).ok());
    auto grads = (*sharded)->GatherHf(/*gradients=*/true);
    ASSERT_TRUE(grads.ok()) << grads.status();
    // Every tensor of the checkpoint is a parameter. Each replica's gradient
    // is its rows' share of the mean's: summed over dp, the whole gradient.
    EXPECT_EQ(grads->size(), ref.grads.size());
    auto dp_comm = pg.Comm("dp");
    ASSERT_TRUE(dp_comm.ok()) << dp_comm.status();
    auto expect_grads = [&](const std::map<std::string, Tensor>& got_grads, const std::string& what) {
      for (const auto& [bare, want] : ref.grads) {
        // Heads (lm_head, cls) live outside the bare model and keep their names.
        const std::string name = got_grads.count(bare) ? bare : prefix + bare;
        ASSERT_EQ(got_grads.count(name), 1u) << name;
        Tensor got = got_grads.at(name).Contiguous();
        if (dp > 1) {
          ASSERT_TRUE(AllReduceInPlace(got, ReduceOp::kSum, **dp_comm, pg.timeout()).ok()) << name;
        }
        ExpectAllClose(got, want, name + what, tol);
      }
    };
    expect_grads(*grads, " gradient");
    // Again, the loss taken as the trainer takes it (ForwardTokenLoss): the
    // LM head fused with the loss in chunks of 3 rows (which do not divide
    // the batch's) wherever the layout allows, a fresh model so that the
    // gradients are this pass's alone.
    auto fused = ShardFormer(shard, &pg).Load(model.dir);
    ASSERT_TRUE(fused.ok()) << fused.status();
    ASSERT_TRUE((*fused)->set_fused_head_rows(3).ok());
    EXPECT_EQ((*fused)->set_fused_head_rows(-2).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*fused)->fused_head_rows(), 3);
    absl::StatusOr<Tensor> labels = ref.labels.has_value() ? ref.labels->Narrow(0, dp_rank * rows, rows)
                                                           : ShardedModel::NextTokenLabels(mine);
    ASSERT_TRUE(labels.ok()) << labels.status();
    auto fused_loss = (*fused)->ForwardTokenLoss(
        [&]() {
          return ref.decoder_ids.has_value()
                     ? (*fused)->Forward(mine, ref.decoder_ids->Narrow(0, dp_rank * rows, rows)->Contiguous())
                     : (*fused)->Forward(mine);
        },
        labels->Contiguous());
    ASSERT_TRUE(fused_loss.ok()) << fused_loss.status();
    const bool one_d = !shard.is_2d() && !shard.is_3d() && !shard.sequence_parallel();
    EXPECT_EQ(fused_loss->fused_head,
              (*fused)->root().Find("lm_head") != nullptr && (shard.layout.tensor_parallel_size() == 1 || one_d));
    EXPECT_NEAR(fused_loss->value, ref.loss, 1e-5 * std::fabs(ref.loss)) << "rank " << rank;
    EXPECT_EQ(fused_loss->tokens, ref.tokens);
    ASSERT_TRUE(Backward(fused_loss->loss).ok());
    auto fused_grads = (*fused)->GatherHf(/*gradients=*/true);
    ASSERT_TRUE(fused_grads.ok()) << fused_grads.status();
    expect_grads(*fused_grads, " gradient, the head fused");
  });
}

}  // namespace colod::shardformer::testing
