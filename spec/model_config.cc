#include "spec/model_config.h"

#include <algorithm>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/int_math.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "spec/mesh.h"
#include "spec/plan.h"

namespace colod {
namespace {

using Json = nlohmann::json;

absl::Status Field(const std::string& what, const std::string& field, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", field, " ", problem));
}

// A positive integer field; `fallback` (when >= 0) if it is absent or null.
absl::StatusOr<int64_t> Int(const Json& j, const std::string& what, const std::string& field, int64_t fallback = -1) {
  if (!j.contains(field) || j[field].is_null()) {
    if (fallback >= 0) return fallback;
    return Field(what, field, "is missing");
  }
  if (!j[field].is_number_integer() || j[field].get<int64_t>() < 1) return Field(what, field, "must be a positive integer");
  return j[field].get<int64_t>();
}

// A boolean field; `fallback` if it is absent or null. (json::value() would
// throw on a number, and end the coordinator: model_config_fuzz found it.)
absl::StatusOr<bool> Bool(const Json& j, const std::string& what, const std::string& field, bool fallback) {
  if (!j.contains(field) || j[field].is_null()) return fallback;
  if (!j[field].is_boolean()) return Field(what, field, "must be true or false");
  return j[field].get<bool>();
}

absl::StatusOr<double> Num(const Json& j, const std::string& what, const std::string& field, double fallback) {
  if (!j.contains(field) || j[field].is_null()) return fallback;
  if (!j[field].is_number() || j[field].get<double>() <= 0) return Field(what, field, "must be a positive number");
  return j[field].get<double>();
}

// A token id field below `vocab`; `fallback` if it is absent or null.
absl::StatusOr<int64_t> TokenId(const Json& j, const std::string& what, const std::string& field, int64_t fallback,
                                int64_t vocab) {
  if (!j.contains(field) || j[field].is_null()) return fallback;
  const Json& v = j[field];
  if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<uint64_t>() >= static_cast<uint64_t>(vocab)
                                                         : v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab)) {
    return Field(what, field, absl::StrCat("must be a token id in [0, vocab_size ", vocab, ")"));
  }
  return v.get<int64_t>();
}

// A field transformers reads that changes the weights or what they compute,
// which colod does not implement: refused where given anything but `as`
// (what colod computes with) or null, since the model would otherwise load
// and compute another one without a word.
absl::Status OnlyAs(const Json& j, const std::string& what, const std::string& field, const Json& as,
                    const std::string& why) {
  if (!j.contains(field) || j[field].is_null() || j[field] == as) return absl::OkStatus();
  return Field(what, field, absl::StrCat(j[field].dump().substr(0, 200), " is not supported: ", why));
}

absl::StatusOr<std::string> Str(const Json& j, const std::string& field, const std::string& fallback) {
  if (!j.contains(field) || j[field].is_null()) return fallback;
  if (!j[field].is_string()) return absl::InvalidArgumentError(absl::StrCat(field, " must be a string"));
  return j[field].get<std::string>();
}

}  // namespace

namespace {

// The fields transformers' GPT2Config reads, with its defaults.
absl::Status ParseGpt2Config(const Json& j, const std::string& what, ModelConfig& c) {
  ASSIGN_OR_RETURN(c.vocab_size, Int(j, what, "vocab_size"));
  ASSIGN_OR_RETURN(c.hidden_size, Int(j, what, "n_embd"));
  ASSIGN_OR_RETURN(c.num_layers, Int(j, what, "n_layer"));
  ASSIGN_OR_RETURN(c.num_heads, Int(j, what, "n_head"));
  ASSIGN_OR_RETURN(c.max_positions, Int(j, what, "n_positions"));
  const std::optional<int64_t> inner = CheckedMul(4, c.hidden_size);
  if (!inner.has_value()) return Field(what, "n_embd", "is too large");
  ASSIGN_OR_RETURN(c.intermediate_size, Int(j, what, "n_inner", *inner));
  ASSIGN_OR_RETURN(c.norm_eps, Num(j, what, "layer_norm_epsilon", 1e-5));
  ASSIGN_OR_RETURN(c.activation, Str(j, "activation_function", "gelu_new"));
  c.num_kv_heads = c.num_heads;
  RETURN_IF_ERROR(OnlyAs(j, what, "tie_word_embeddings", true, "colod's GPT-2 head is the token embedding (wte)"));
  c.tie_word_embeddings = true;
  RETURN_IF_ERROR(OnlyAs(j, what, "scale_attn_weights", true, "attention scores are scaled by 1/sqrt(head_dim)"));
  RETURN_IF_ERROR(OnlyAs(j, what, "scale_attn_by_inverse_layer_idx", false,
                         "attention scores are not scaled by the layer's index"));
  return absl::OkStatus();
}

// The rotary embeddings' scaling: `rope_scaling` (transformers 4), or
// `rope_parameters` (transformers 5, which holds rope_theta too). colod
// computes them unscaled, which is what "default", "linear" with factor 1
// and "dynamic" compute (dynamic NTK changes the frequencies only past
// max_position_embeddings, which no sequence of colod's reaches); any other
// (Llama 3.1's "llama3", "yarn", "longrope", a linear factor) is refused,
// since the model would load and compute another one without a word.
absl::Status CheckRopeScaling(const Json& j, const std::string& what, ModelConfig& c) {
  for (const char* field : {"rope_scaling", "rope_parameters"}) {
    if (!j.contains(field) || j[field].is_null()) continue;
    const Json& r = j[field];
    if (!r.is_object()) return Field(what, field, "must be an object or null");
    std::string type = "default";
    for (const char* key : {"rope_type", "type"}) {
      if (r.contains(key) && r[key].is_string()) type = r[key].get<std::string>();
    }
    double factor = 1;
    if (r.contains("factor") && !r["factor"].is_null()) {
      if (!r["factor"].is_number()) return Field(what, field, "factor must be a number");
      factor = r["factor"].get<double>();
    }
    const bool unscaled = type == "default" || type == "dynamic" || (type == "linear" && factor == 1);
    if (!unscaled) {
      return Field(what, field,
                   absl::StrCat(r.dump().substr(0, 200),
                                " is not supported: rotary embeddings are computed "
                                "unscaled (Llama 3.1 and later scale them: rope_type llama3)"));
    }
    if (std::string(field) == "rope_parameters") {
      ASSIGN_OR_RETURN(c.rope_theta, Num(r, absl::StrCat(what, ": rope_parameters"), "rope_theta", c.rope_theta));
    }
  }
  return absl::OkStatus();
}

// The fields transformers' LlamaConfig reads, with its defaults.
absl::Status ParseLlamaConfig(const Json& j, const std::string& what, ModelConfig& c) {
  ASSIGN_OR_RETURN(c.vocab_size, Int(j, what, "vocab_size"));
  ASSIGN_OR_RETURN(c.hidden_size, Int(j, what, "hidden_size"));
  ASSIGN_OR_RETURN(c.num_layers, Int(j, what, "num_hidden_layers"));
  ASSIGN_OR_RETURN(c.num_heads, Int(j, what, "num_attention_heads"));
  ASSIGN_OR_RETURN(c.num_kv_heads, Int(j, what, "num_key_value_heads", c.num_heads));
  ASSIGN_OR_RETURN(c.intermediate_size, Int(j, what, "intermediate_size"));
  ASSIGN_OR_RETURN(c.max_positions, Int(j, what, "max_position_embeddings", 2048));
  ASSIGN_OR_RETURN(c.norm_eps, Num(j, what, "rms_norm_eps", 1e-6));
  ASSIGN_OR_RETURN(c.rope_theta, Num(j, what, "rope_theta", 10000));
  ASSIGN_OR_RETURN(c.activation, Str(j, "hidden_act", "silu"));
  ASSIGN_OR_RETURN(c.tie_word_embeddings, Bool(j, what, "tie_word_embeddings", false));
  RETURN_IF_ERROR(CheckRopeScaling(j, what, c));
  RETURN_IF_ERROR(OnlyAs(j, what, "attention_bias", false, "colod's LLaMA projections have no biases"));
  RETURN_IF_ERROR(OnlyAs(j, what, "mlp_bias", false, "colod's LLaMA projections have no biases"));
  if (j.contains("head_dim") && !j["head_dim"].is_null() &&
      !(j["head_dim"].is_number_integer() && j["head_dim"].get<int64_t>() > 0 &&
        CheckedMul(j["head_dim"].get<int64_t>(), c.num_heads) == std::optional<int64_t>(c.hidden_size))) {
    return Field(what, "head_dim",
                 absl::StrCat(j["head_dim"].dump().substr(0, 40),
                              " is not supported: a head is hidden_size / "
                              "num_attention_heads wide (",
                              c.hidden_size, " / ", c.num_heads, ")"));
  }
  return absl::OkStatus();
}

// The fields transformers' BertConfig reads, with its defaults.
absl::Status ParseBertConfig(const Json& j, const std::string& what, ModelConfig& c) {
  ASSIGN_OR_RETURN(c.vocab_size, Int(j, what, "vocab_size"));
  ASSIGN_OR_RETURN(c.hidden_size, Int(j, what, "hidden_size"));
  ASSIGN_OR_RETURN(c.num_layers, Int(j, what, "num_hidden_layers"));
  ASSIGN_OR_RETURN(c.num_heads, Int(j, what, "num_attention_heads"));
  ASSIGN_OR_RETURN(c.intermediate_size, Int(j, what, "intermediate_size"));
  ASSIGN_OR_RETURN(c.max_positions, Int(j, what, "max_position_embeddings", 512));
  ASSIGN_OR_RETURN(c.type_vocab_size, Int(j, what, "type_vocab_size", 2));
  ASSIGN_OR_RETURN(c.norm_eps, Num(j, what, "layer_norm_eps", 1e-12));
  ASSIGN_OR_RETURN(c.activation, Str(j, "hidden_act", "gelu"));
  c.num_kv_heads = c.num_heads;
  c.sees_every_position = true;
  RETURN_IF_ERROR(OnlyAs(j, what, "tie_word_embeddings", true,
                         "colod's BERT decoder is the word embedding (BertForMaskedLM ties them)"));
  c.tie_word_embeddings = true;
  RETURN_IF_ERROR(OnlyAs(j, what, "position_embedding_type", "absolute", "positions are learned absolute ones"));
  return absl::OkStatus();
}

// The fields transformers' OPTConfig reads, with its defaults.
absl::Status ParseOptConfig(const Json& j, const std::string& what, ModelConfig& c) {
  ASSIGN_OR_RETURN(c.vocab_size, Int(j, what, "vocab_size"));
  ASSIGN_OR_RETURN(c.hidden_size, Int(j, what, "hidden_size"));
  ASSIGN_OR_RETURN(c.num_layers, Int(j, what, "num_hidden_layers"));
  ASSIGN_OR_RETURN(c.num_heads, Int(j, what, "num_attention_heads"));
  ASSIGN_OR_RETURN(c.intermediate_size, Int(j, what, "ffn_dim"));
  ASSIGN_OR_RETURN(c.max_positions, Int(j, what, "max_position_embeddings", 2048));
  ASSIGN_OR_RETURN(c.embed_dim, Int(j, what, "word_embed_proj_dim", c.hidden_size));
  ASSIGN_OR_RETURN(c.activation, Str(j, "activation_function", "relu"));
  ASSIGN_OR_RETURN(c.norm_before, Bool(j, what, "do_layer_norm_before", true));
  ASSIGN_OR_RETURN(bool remove_final, Bool(j, what, "_remove_final_layer_norm", false));
  c.final_norm = c.norm_before && !remove_final;  // OPTDecoder's final_layer_norm
  ASSIGN_OR_RETURN(c.linear_bias, Bool(j, what, "enable_bias", true));
  ASSIGN_OR_RETURN(bool affine, Bool(j, what, "layer_norm_elementwise_affine", true));
  if (!affine) {
    return Field(what, "layer_norm_elementwise_affine", "false (LayerNorms without weights) is not supported");
  }
  ASSIGN_OR_RETURN(c.tie_word_embeddings, Bool(j, what, "tie_word_embeddings", true));
  c.num_kv_heads = c.num_heads;
  c.norm_eps = 1e-5;  // torch.nn.LayerNorm's default: OPT's config has no epsilon
  c.position_offset = 2;
  if (c.max_positions > kMaxPositions) {
    return Field(what, "max_position_embeddings", absl::StrCat("must be at most ", kMaxPositions));
  }
  return absl::OkStatus();
}

// The fields transformers' BloomConfig reads, with its defaults.
absl::Status ParseBloomConfig(const Json& j, const std::string& what, ModelConfig& c) {
  ASSIGN_OR_RETURN(c.vocab_size, Int(j, what, "vocab_size"));
  // bigscience's configs name the width n_embed; BloomConfig maps it to hidden_size.
  ASSIGN_OR_RETURN(c.hidden_size, Int(j, what, j.contains("n_embed") ? "n_embed" : "hidden_size"));
  ASSIGN_OR_RETURN(c.num_layers, Int(j, what, j.contains("num_hidden_layers") ? "num_hidden_layers" : "n_layer"));
  ASSIGN_OR_RETURN(c.num_heads, Int(j, what, j.contains("num_attention_heads") ? "num_attention_heads" : "n_head"));
  const std::optional<int64_t> inner = CheckedMul(4, c.hidden_size);
  if (!inner.has_value()) return Field(what, "hidden_size", "is too large");
  c.intermediate_size = *inner;  // BloomMLP: 4 * hidden_size
  // ALiBi has no position table: seq_length, where given, bounds the
  // sequences; else BLOOM's training length.
  ASSIGN_OR_RETURN(c.max_positions, Int(j, what, "seq_length", 2048));
  ASSIGN_OR_RETURN(c.norm_eps, Num(j, what, "layer_norm_epsilon", 1e-5));
  ASSIGN_OR_RETURN(c.residual_post_norm, Bool(j, what, "apply_residual_connection_post_layernorm", false));
  ASSIGN_OR_RETURN(c.tie_word_embeddings, Bool(j, what, "tie_word_embeddings", true));
  // pretraining_tp and slow_but_exact change how transformers sums the
  // projections in slices, not what they compute: both are ignored.
  c.activation = "gelu_tanh";  // BloomGelu
  c.num_kv_heads = c.num_heads;
  return absl::OkStatus();
}

// The fields transformers' ViTConfig reads, with its defaults.
absl::Status ParseVitConfig(const Json& j, const std::string& what, ModelConfig& c) {
  ASSIGN_OR_RETURN(c.hidden_size, Int(j, what, "hidden_size"));
  ASSIGN_OR_RETURN(c.num_layers, Int(j, what, "num_hidden_layers"));
  ASSIGN_OR_RETURN(c.num_heads, Int(j, what, "num_attention_heads"));
  ASSIGN_OR_RETURN(c.intermediate_size, Int(j, what, "intermediate_size"));
  ASSIGN_OR_RETURN(c.image_size, Int(j, what, "image_size", 224));
  ASSIGN_OR_RETURN(c.patch_size, Int(j, what, "patch_size", 16));
  ASSIGN_OR_RETURN(c.num_channels, Int(j, what, "num_channels", 3));
  ASSIGN_OR_RETURN(c.norm_eps, Num(j, what, "layer_norm_eps", 1e-12));
  ASSIGN_OR_RETURN(c.activation, Str(j, "hidden_act", "gelu"));
  ASSIGN_OR_RETURN(c.linear_bias, Bool(j, what, "qkv_bias", true));
  // The labels: num_labels, or as many as id2label names (transformers'
  // PretrainedConfig), 2 without either.
  int64_t labels = 2;
  if (j.contains("id2label") && j["id2label"].is_object() && !j["id2label"].empty()) {
    labels = static_cast<int64_t>(j["id2label"].size());
  }
  ASSIGN_OR_RETURN(c.vocab_size, Int(j, what, "num_labels", labels));
  if (c.image_size % c.patch_size != 0) {
    return Field(what, "image_size", absl::StrCat(c.image_size, " is not a multiple of patch_size ", c.patch_size));
  }
  if (c.image_size > (int64_t{1} << 20)) return Field(what, "image_size", "must be at most 1048576");
  const int64_t side = c.image_size / c.patch_size;
  c.max_positions = side * side + 1;  // the patches and the CLS token
  c.num_kv_heads = c.num_heads;
  c.tie_word_embeddings = false;
  return absl::OkStatus();
}

// The fields transformers' T5Config reads, with its defaults.
absl::Status ParseT5Config(const Json& j, const std::string& what, ModelConfig& c) {
  ASSIGN_OR_RETURN(c.vocab_size, Int(j, what, "vocab_size"));
  ASSIGN_OR_RETURN(c.hidden_size, Int(j, what, "d_model"));
  ASSIGN_OR_RETURN(c.kv_dim, Int(j, what, "d_kv"));
  ASSIGN_OR_RETURN(c.intermediate_size, Int(j, what, "d_ff"));
  ASSIGN_OR_RETURN(c.num_layers, Int(j, what, "num_layers"));
  ASSIGN_OR_RETURN(c.num_decoder_layers, Int(j, what, "num_decoder_layers", c.num_layers));
  ASSIGN_OR_RETURN(c.num_heads, Int(j, what, "num_heads"));
  ASSIGN_OR_RETURN(c.relative_buckets, Int(j, what, "relative_attention_num_buckets", 32));
  ASSIGN_OR_RETURN(c.relative_max_distance, Int(j, what, "relative_attention_max_distance", 128));
  ASSIGN_OR_RETURN(c.norm_eps, Num(j, what, "layer_norm_epsilon", 1e-6));
  // T5 v1.0: "relu" (and a tied head); v1.1 and flan-t5: "gated-gelu".
  ASSIGN_OR_RETURN(c.activation, Str(j, "feed_forward_proj", "relu"));
  if (c.activation != "relu" && c.activation != "gated-gelu") {
    return Field(what, "feed_forward_proj", absl::StrCat("\"", c.activation, "\" is not relu or gated-gelu"));
  }
  ASSIGN_OR_RETURN(c.tie_word_embeddings, Bool(j, what, "tie_word_embeddings", true));
  if (c.relative_buckets < 4 || c.relative_buckets > 4096) {
    return Field(what, "relative_attention_num_buckets", "must be in [4, 4096]");
  }
  // The decoder's buckets are one-way: half of them exact (the encoder's,
  // two-way, a quarter); the log bucket divides by log(max_distance / exact).
  if (c.relative_max_distance <= c.relative_buckets / 2) {
    return Field(what, "relative_attention_max_distance",
                 "must exceed the decoder's exact buckets (half of relative_attention_num_buckets)");
  }
  if (!CheckedMul(c.num_heads, c.kv_dim).has_value()) {
    return Field(what, "d_kv", absl::StrCat("times num_heads ", c.num_heads, " overflows"));
  }
  if (c.num_decoder_layers > kMaxLayers) {
    return Field(what, "num_decoder_layers", absl::StrCat("must be at most ", kMaxLayers));
  }
  // The decoder's input is the targets shifted right after its start
  // token, with the pad id where a target is -100 (HF's _shift_right).
  ASSIGN_OR_RETURN(c.pad_token_id, TokenId(j, what, "pad_token_id", 0, c.vocab_size));
  ASSIGN_OR_RETURN(c.decoder_start_token_id, TokenId(j, what, "decoder_start_token_id", c.pad_token_id, c.vocab_size));
  c.num_kv_heads = c.num_heads;
  c.max_positions = int64_t{1} << 20;  // relative positions: no table bounds the length
  return absl::OkStatus();
}

// Each built-in family's config.json, as transformers' config class reads it.
struct ConfigParser {
  const char* model_type;
  absl::Status (*parse)(const Json& j, const std::string& what, ModelConfig& c);
};
constexpr ConfigParser kConfigParsers[] = {
    {"gpt2", ParseGpt2Config},
    {"llama", ParseLlamaConfig},
    {"bert", ParseBertConfig},
    {"opt", ParseOptConfig},
    {"bloom", ParseBloomConfig},
    {"vit", ParseVitConfig},
    {"t5", ParseT5Config},
};

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& what) {
  Json j = ParseJson(json_text);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat(what, ": not a JSON object"));
  if (!j.contains("model_type") || !j["model_type"].is_string()) return Field(what, "model_type", "is missing");
  ModelConfig c;
  c.json = json_text;
  c.model_type = j["model_type"].get<std::string>();
  const ConfigParser* parser = nullptr;
  for (const ConfigParser& p : kConfigParsers) {
    if (c.model_type == p.model_type) parser = &p;
  }
  if (parser == nullptr) {
    std::vector<std::string> known;
    for (const ConfigParser& p : kConfigParsers) known.push_back(p.model_type);
    return Field(what, "model_type",
                 absl::StrCat("'", c.model_type, "' is not one of ", absl::StrJoin(known, ", ")));
  }
  RETURN_IF_ERROR(parser->parse(j, what, c));
  if (c.embed_dim == 0) c.embed_dim = c.hidden_size;
  if (c.kv_dim == 0 && c.hidden_size % c.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the hidden size ", c.hidden_size,
                                                   " is not divisible by the ", c.num_heads, " attention heads"));
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": num_attention_heads ", c.num_heads,
                                                   " is not divisible by num_key_value_heads ", c.num_kv_heads));
  }
  if (c.num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", c.num_layers, " layers; colod takes at most ", kMaxLayers));
  }
  if (absl::StatusOr<int64_t> n = ParameterCount(c); !n.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", n.status().message()));
  }
  return c;
}

absl::StatusOr<int64_t> ParameterCount(const ModelConfig& c) {
  // The plan's leaves, whole.
  ASSIGN_OR_RETURN(std::vector<PlanLeaf> leaves, PlanLeaves(c));
  CheckedSum total;
  for (const PlanLeaf& l : leaves) {
    ASSIGN_OR_RETURN(int64_t n, LeafElements(l));
    total.Add({n});
  }
  return total.Total(absl::StrCat("the parameter count of this ", c.model_type));
}

absl::StatusOr<RankMemoryFloor> MemoryFloorPerRank(const ModelConfig& config, const v1::JobSpec& spec) {
  RankMemoryFloor floor;
  if (spec.kind() == v1::JOB_KIND_TENSOR) return floor;
  ASSIGN_OR_RETURN(floor.parameters, ParameterCount(config));
  // What the rank holding the most holds (replicated norms, the padded
  // vocabulary), or a 1/tp share where the layout has no mesh.
  const int64_t tp = std::max(1, spec.shard().tensor_parallel_size());
  absl::StatusOr<int64_t> held = RankParameters(config, spec.shard());
  const int64_t share = held.ok() ? *held : floor.parameters / tp + (floor.parameters % tp != 0 ? 1 : 0);
  const bool train = spec.kind() == v1::JOB_KIND_TRAIN;
  // Parameter and gradient bytes by precision; unspecified means f32 on a
  // CPU and bf16 on a GPU, so the floor takes bf16's.
  const v1::Precision precision = spec.train().precision();
  const int64_t width = !train || precision == v1::PRECISION_FP32 ? 4 : 2;
  const bool adam = spec.train().optimizer() != v1::OPTIMIZER_SGD;
  const int64_t state = (adam ? 8 : 4) + (width == 2 ? 4 : 0);  // moments (f32), master copy
  floor.rank_parameters = share;
  // ZeRO over dp: the optimizer state (stage 2: and the gradients) of 1/dp
  // of the rank's parameters (a table tied across pipeline stages, kept
  // whole, is left out: the floor stays a floor).
  const int64_t dp = std::max(1, spec.shard().data_parallel_size());
  const int zero = train && dp > 1 ? spec.train().zero_stage() : 0;
  const int64_t partition = zero > 0 ? share / dp + (share % dp != 0 ? 1 : 0) : share;
  CheckedSum params, grads, optimizer, total;
  params.Add({share, width});
  if (train) {
    grads.Add({zero == 2 ? partition : share, width});
    optimizer.Add({partition, state});
  }
  total.Add(params);
  total.Add(grads);
  total.Add(optimizer);
  if (train) {
    // A training step's activations (the planner's estimate, which
    // measured steps never fall below), in bf16 where the precision is left
    // to the workers, on whichever device keeps fewer (the job may run on
    // CPU or CUDA workers). A spec the plan refuses (a batch that does not
    // split) is refused by validation; its floor leaves them out.
    v1::JobSpec planned = spec;
    if (precision == v1::PRECISION_UNSPECIFIED) planned.mutable_train()->set_precision(v1::PRECISION_BF16_MIXED);
    absl::StatusOr<JobPlan> cpu = PlanJob(config, planned, PlanDevice::kCpu);
    absl::StatusOr<JobPlan> cuda = PlanJob(config, planned, PlanDevice::kCuda);
    if (cpu.ok() && cuda.ok()) {
      floor.activation_bytes = std::min(cpu->activation_bytes, cuda->activation_bytes);
      total.Add({floor.activation_bytes});
    }
  }
  const std::string what = "the memory per rank";
  ASSIGN_OR_RETURN(floor.param_bytes, params.Total(what));
  ASSIGN_OR_RETURN(floor.grad_bytes, grads.Total(what));
  ASSIGN_OR_RETURN(floor.optimizer_bytes, optimizer.Total(what));
  ASSIGN_OR_RETURN(floor.total_bytes, total.Total(what));
  return floor;
}

std::string GiB(int64_t bytes) { return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (1 << 30)); }

std::string DescribeMemoryFloor(const RankMemoryFloor& floor) {
  std::string parts = absl::StrCat(GiB(floor.param_bytes), " of parameters");
  if (floor.grad_bytes > 0 || floor.optimizer_bytes > 0) {
    absl::StrAppend(&parts, ", ", GiB(floor.grad_bytes), " of gradients, ", GiB(floor.optimizer_bytes),
                    " of optimizer state");
  }
  if (floor.activation_bytes > 0) {
    absl::StrAppend(&parts, ", ", GiB(floor.activation_bytes), " of activations");
  }
  return absl::StrCat("at least ", GiB(floor.total_bytes), " per rank (", floor.parameters, " parameters, ",
                      floor.rank_parameters, " on the fullest rank: ", parts, ")");
}

namespace {

// The built-in families' layouts (README's table of families), and why a
// layout cannot exist where that is the reason for a refusal.
struct FamilyRow {
  const char* model_type;
  FamilyLayouts layouts;  // sequence_parallel, two_d, three_d, pipeline_stages
  const char* no_sequence_parallel = nullptr;
};
constexpr FamilyRow kFamilyRows[] = {
    {"gpt2", {true, true, true, true}},
    {"llama", {true, true, true, true}},
    {"bert", {true, true, true, true}},
    {"opt", {true, true, true, true}},
    {"bloom", {true, true, true, true}},
    {"vit",
     {false, true, true, true},
     "its sequence, n^2 patches and the CLS token, never splits evenly 4 ways (n^2 + 1 is 1 or 2 modulo 4) and "
     "2 ways only for an odd n (not ViT-B/16's 14 x 14 patches), and sequence parallelism splits it evenly"},
    {"t5", {true, true, true, true}},
};

// nullptr for a model_type that is not built in.
const FamilyRow* FindRow(const std::string& model_type) {
  for (const FamilyRow& r : kFamilyRows) {
    if (model_type == r.model_type) return &r;
  }
  return nullptr;
}
const FamilyLayouts* FindLayouts(const std::string& model_type) {
  const FamilyRow* r = FindRow(model_type);
  return r != nullptr ? &r->layouts : nullptr;
}

// "gpt2, llama, ... and vit": the built-in families with pipeline stages.
std::string FamiliesWithStages() {
  std::vector<std::string> names;
  for (const FamilyRow& r : kFamilyRows) {
    if (r.layouts.pipeline_stages) names.push_back(r.model_type);
  }
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&out, i == 0 ? "" : i + 1 == names.size() ? " and " : ", ", names[i]);
  }
  return out;
}

}  // namespace

FamilyLayouts LayoutsOf(const ModelConfig& config) {
  const FamilyLayouts* f = FindLayouts(config.model_type);
  return f != nullptr ? *f : FamilyLayouts();
}

absl::Status CheckFamilyTakes(const ModelConfig& config, const v1::ShardConfig& shard) {
  if (FindLayouts(config.model_type) == nullptr) return absl::OkStatus();  // a registered policy decides
  const FamilyLayouts f = LayoutsOf(config);
  const v1::TensorParallelMode mode = shard.tensor_parallel_mode();
  const bool blocks = mode == v1::TENSOR_PARALLEL_MODE_2D || mode == v1::TENSOR_PARALLEL_MODE_2P5D;
  if ((blocks && !f.two_d) || (mode == v1::TENSOR_PARALLEL_MODE_3D && !f.three_d)) {
    std::vector<std::string> modes = {"1d"};
    if (f.two_d) modes.insert(modes.end(), {"2d", "2.5d"});
    if (f.three_d) modes.push_back("3d");
    std::string list = modes[0];
    for (size_t i = 1; i < modes.size(); ++i) absl::StrAppend(&list, i + 1 == modes.size() ? " and " : ", ", modes[i]);
    return absl::InvalidArgumentError(absl::StrCat("the ", config.model_type, " policy supports tensor_parallel_mode ",
                                                   list, modes.size() == 1 ? " only" : ""));
  }
  if (shard.sequence_parallel() && !f.sequence_parallel) {
    const char* why = FindRow(config.model_type)->no_sequence_parallel;
    return absl::InvalidArgumentError(absl::StrCat("the ", config.model_type, " policy has no sequence_parallel",
                                                   why != nullptr ? absl::StrCat(": ", why) : ""));
  }
  if (shard.pipeline_parallel_size() > 1 && !f.pipeline_stages) {
    return absl::InvalidArgumentError(absl::StrCat("the ", config.model_type, " policy has no pipeline stages (",
                                                   FamiliesWithStages(), " have)"));
  }
  return absl::OkStatus();
}

bool HasPipelineStages(const ModelConfig& config) { return LayoutsOf(config).pipeline_stages; }

absl::StatusOr<std::vector<int64_t>> PipelineStageLayers(const ModelConfig& config, const v1::ShardConfig& shard) {
  const int64_t ranks = std::max(1, shard.pipeline_parallel_size());
  // An encoder-decoder's layers: the encoder's, then the decoder's (each at
  // most kMaxLayers).
  const int64_t encoder = config.num_layers, layers = config.num_layers + config.num_decoder_layers;
  RETURN_IF_ERROR(CheckVirtualStages(shard));
  const int64_t v = std::max(1, shard.virtual_stages());
  const int64_t pp = ranks * v;  // the (virtual) stages
  if (pp == 1 && shard.pipeline_stage_layers().empty()) return std::vector<int64_t>{layers};
  if (shard.pipeline_parallel_size() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline_parallel_size must be >= 0, got ", shard.pipeline_parallel_size()));
  }
  const std::string stages_name =
      v > 1 ? absl::StrCat("pipeline_parallel_size ", ranks, " x ", v, " virtual stages")
            : absl::StrCat("pipeline_parallel_size ", pp);
  // A family registered in the worker (ShardFormer's ModelRegistry) rather
  // than built in: its own declaration (ModelFamily::split_stage) decides.
  if (pp > 1 && FindLayouts(config.model_type) != nullptr && !HasPipelineStages(config)) {
    return absl::InvalidArgumentError(absl::StrCat("the ", config.model_type, " policy has no pipeline stages (",
                                                   FamiliesWithStages(), " have)"));
  }
  if (pp > layers) {
    return absl::InvalidArgumentError(
        absl::StrCat(stages_name, " is more stages than the model's ", layers, " layers"));
  }
  std::vector<int64_t> out;
  // Even stages of `n` layers over `k` stages, the earlier taking one more.
  auto even = [&out](int64_t n, int64_t k) {
    for (int64_t s = 0; s < k; ++s) out.push_back(n / k + (s < n % k ? 1 : 0));
  };
  if (shard.pipeline_stage_layers().empty()) {
    if (!config.is_encoder_decoder() || pp == 1) {
      even(layers, pp);
      return out;
    }
    // Encoder stages, then decoder stages, in proportion to the stacks'
    // layers (each at least one stage, and at most one a layer).
    const int64_t decoder = config.num_decoder_layers;
    int64_t first = (pp * encoder + layers / 2) / layers;
    first = std::min(std::max({first, int64_t{1}, pp - decoder}), std::min(encoder, pp - 1));
    even(encoder, first);
    even(decoder, pp - first);
    return out;
  }
  if (static_cast<int64_t>(shard.pipeline_stage_layers_size()) != pp) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline_stage_layers lists ", shard.pipeline_stage_layers_size(),
                                                   " stages, not ",
                                                   v > 1 ? stages_name : "pipeline_parallel_size", " = ", pp));
  }
  int64_t sum = 0;
  for (int32_t n : shard.pipeline_stage_layers()) {
    if (n < 1) return absl::InvalidArgumentError(absl::StrCat("pipeline_stage_layers: a stage of ", n, " layers"));
    sum += n;
    out.push_back(n);
  }
  if (sum != layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline_stage_layers sum to ", sum, " layers, not the model's ", layers,
                     config.is_encoder_decoder() ? absl::StrCat(" (the encoder's ", encoder, " and the decoder's ",
                                                                config.num_decoder_layers, ")")
                                                 : ""));
  }
  if (config.is_encoder_decoder()) {
    int64_t at = 0;
    for (size_t s = 0; s < out.size(); ++s) {
      if (at < encoder && at + out[s] > encoder) {
        return absl::InvalidArgumentError(absl::StrCat(
            "pipeline_stage_layers: stage ", s, " (layers ", at, " to ", at + out[s] - 1,
            ") holds both the encoder's and the decoder's; a ", config.model_type,
            " stage holds one stack's layers, and the encoder's are the first ", encoder));
      }
      at += out[s];
    }
  }
  return out;
}

absl::Status CheckVirtualStages(const v1::ShardConfig& shard) {
  const int v = shard.virtual_stages();
  if (v < 0 || v > kMaxVirtualStages) {
    return absl::InvalidArgumentError(absl::StrCat("virtual_stages must be in [0, ", kMaxVirtualStages,
                                                   "] (0 or 1: one model chunk a pipeline rank), got ", v));
  }
  if (v > 1 && shard.pipeline_parallel_size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat("virtual_stages ", v, " interleaves pipeline stages: it needs "
                                                   "pipeline_parallel_size >= 2"));
  }
  return absl::OkStatus();
}

absl::Status CheckInterleavedMicroBatches(const v1::ShardConfig& shard, int64_t micro_batches) {
  if (shard.virtual_stages() <= 1) return absl::OkStatus();
  const int64_t pp = std::max(1, shard.pipeline_parallel_size()), m = std::max<int64_t>(1, micro_batches);
  if (m % pp == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("the interleaved schedule (virtual_stages ", shard.virtual_stages(),
                                                 ") runs the micro-batches in groups of the ", pp,
                                                 " pipeline stages: micro_batches ", m, " is not a multiple of ", pp));
}

absl::Status CheckShardable(const ModelConfig& config, const v1::ShardConfig& shard) {
  const int64_t tp = shard.tensor_parallel_size();
  // (job_validation_fuzz: a spec not yet validated reaches here from the admission floor.)
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("tensor_parallel_size must be >= 1, got ", tp));
  RETURN_IF_ERROR(CheckFamilyTakes(config, shard));
  RETURN_IF_ERROR(PipelineStageLayers(config, shard).status());
  if (shard.pipeline_parallel_size() > 1 && shard.sequence_parallel()) {
    return absl::InvalidArgumentError("sequence_parallel does not combine with pipeline_parallel_size yet");
  }
  switch (shard.tensor_parallel_mode()) {
    case v1::TENSOR_PARALLEL_MODE_UNSPECIFIED:
    case v1::TENSOR_PARALLEL_MODE_1D:
      if (config.num_heads % tp != 0 || config.num_kv_heads % tp != 0) {
        return absl::InvalidArgumentError(absl::StrCat("tensor_parallel_size ", tp, " must divide the ",
                                                       config.num_heads, " attention heads and the ",
                                                       config.num_kv_heads, " key/value heads"));
      }
      if (config.intermediate_size % tp != 0) {
        return absl::InvalidArgumentError(absl::StrCat("tensor_parallel_size ", tp,
                                                       " must divide intermediate_size ", config.intermediate_size));
      }
      return absl::OkStatus();
    case v1::TENSOR_PARALLEL_MODE_2D:
    case v1::TENSOR_PARALLEL_MODE_2P5D:
    case v1::TENSOR_PARALLEL_MODE_3D: {
      v1::ShardConfig tp_only = shard;  // the data-parallel degree does not matter here
      tp_only.set_data_parallel_size(1);
      auto mesh = DeviceMesh::FromShardConfig(tp_only);
      if (!mesh.ok()) return mesh.status();
      auto axis = mesh->AxisSize(shard.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_3D ? "tp_weight" : "tp_row");
      if (!axis.ok()) return axis.status();
      const int64_t q = *axis;
      if (config.hidden_size % q != 0 || config.intermediate_size % q != 0 || config.num_heads % q != 0 ||
          config.num_kv_heads % q != 0) {
        return absl::InvalidArgumentError(absl::StrCat("hidden_size ", config.hidden_size, ", intermediate_size ",
                                                       config.intermediate_size, ", the ", config.num_heads,
                                                       " heads and the ", config.num_kv_heads,
                                                       " key/value heads must be divisible by q = ", q));
      }
      if (config.embed_dim % q != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("word_embed_proj_dim ", config.embed_dim, " must be divisible by q = ", q));
      }
      if (shard.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_3D) {
        // A 3D weight splits its outputs q*q ways (worker/nn/linear3d.h).
        const int64_t q2 = q * q, kv = config.num_kv_heads * config.head_dim();
        if (config.hidden_size % q2 != 0 || config.intermediate_size % q2 != 0 || kv % q2 != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "3d splits each linear's outputs q*q = ", q2, " ways: hidden_size ", config.hidden_size,
              ", intermediate_size ", config.intermediate_size, " and the key/value width ", kv,
              " must be divisible by it"));
        }
        if (config.embed_dim % q2 != 0) {  // OPT's project_in/out
          return absl::InvalidArgumentError(absl::StrCat("3d splits each linear's outputs q*q = ", q2,
                                                         " ways: word_embed_proj_dim ", config.embed_dim,
                                                         " must be divisible by it"));
        }
      }
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError("unknown tensor_parallel_mode");
  }
}

absl::StatusOr<std::string> ReadConfigJson(const std::string& dir) {
  auto text = ReadFileToString(dir + "/config.json");
  if (absl::IsNotFound(text.status())) return absl::NotFoundError(absl::StrCat("no config.json in ", dir));
  return text;  // or why the one there cannot be read (no permission, a directory, EIO)
}

std::vector<std::string> ArchitectureDifferences(const ModelConfig& a, const ModelConfig& b) {
  std::vector<std::string> out;
  const auto text = [](const auto& v) {
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, bool>) {
      return std::string(v ? "true" : "false");
    } else {
      return absl::StrCat(v);
    }
  };
  const auto differ = [&](const char* field, const auto& x, const auto& y) {
    if (x != y) out.push_back(absl::StrCat(field, " ", text(x), ", not ", text(y)));
  };
  differ("model_type", a.model_type, b.model_type);
  differ("vocab_size", a.vocab_size, b.vocab_size);
  differ("hidden_size", a.hidden_size, b.hidden_size);
  differ("num_layers", a.num_layers, b.num_layers);
  differ("num_heads", a.num_heads, b.num_heads);
  differ("num_kv_heads", a.num_kv_heads, b.num_kv_heads);
  differ("intermediate_size", a.intermediate_size, b.intermediate_size);
  // Learned positions are a table of them; rotary ones are none (a longer
  // context with RoPE is the same parameters).
  if (!a.rotary() || !b.rotary()) differ("max_positions", a.max_positions, b.max_positions);
  differ("tie_word_embeddings", a.tie_word_embeddings, b.tie_word_embeddings);
  differ("type_vocab_size", a.type_vocab_size, b.type_vocab_size);
  differ("norm_before", a.norm_before, b.norm_before);
  differ("final_norm", a.final_norm, b.final_norm);
  differ("linear_bias", a.linear_bias, b.linear_bias);
  differ("embed_dim", a.embed_dim, b.embed_dim);
  differ("position_offset", a.position_offset, b.position_offset);
  differ("residual_post_norm", a.residual_post_norm, b.residual_post_norm);
  differ("image_size", a.image_size, b.image_size);
  differ("patch_size", a.patch_size, b.patch_size);
  differ("num_channels", a.num_channels, b.num_channels);
  differ("kv_dim", a.kv_dim, b.kv_dim);
  differ("num_decoder_layers", a.num_decoder_layers, b.num_decoder_layers);
  differ("relative_buckets", a.relative_buckets, b.relative_buckets);
  return out;
}

absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& dir) {
  ASSIGN_OR_RETURN(const std::string text, ReadConfigJson(dir));
  return ParseModelConfig(text, dir + "/config.json");
}

}  // namespace colod
