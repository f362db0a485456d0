#include "worker/shardformer/model_config.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/colo/mesh.h"

namespace colod::shardformer {
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

absl::StatusOr<double> Num(const Json& j, const std::string& what, const std::string& field, double fallback) {
  if (!j.contains(field) || j[field].is_null()) return fallback;
  if (!j[field].is_number() || j[field].get<double>() <= 0) return Field(what, field, "must be a positive number");
  return j[field].get<double>();
}

absl::StatusOr<std::string> Str(const Json& j, const std::string& field, const std::string& fallback) {
  if (!j.contains(field) || j[field].is_null()) return fallback;
  if (!j[field].is_string()) return absl::InvalidArgumentError(absl::StrCat(field, " must be a string"));
  return j[field].get<std::string>();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& what) {
  Json j = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat(what, ": not a JSON object"));
  if (!j.contains("model_type") || !j["model_type"].is_string()) return Field(what, "model_type", "is missing");
  ModelConfig c;
  c.json = json_text;
  c.model_type = j["model_type"].get<std::string>();
  if (c.model_type == "gpt2") {
    ASSIGN_OR_RETURN(c.vocab_size, Int(j, what, "vocab_size"));
    ASSIGN_OR_RETURN(c.hidden_size, Int(j, what, "n_embd"));
    ASSIGN_OR_RETURN(c.num_layers, Int(j, what, "n_layer"));
    ASSIGN_OR_RETURN(c.num_heads, Int(j, what, "n_head"));
    ASSIGN_OR_RETURN(c.max_positions, Int(j, what, "n_positions"));
    ASSIGN_OR_RETURN(c.intermediate_size, Int(j, what, "n_inner", 4 * c.hidden_size));
    ASSIGN_OR_RETURN(c.norm_eps, Num(j, what, "layer_norm_epsilon", 1e-5));
    ASSIGN_OR_RETURN(c.activation, Str(j, "activation_function", "gelu_new"));
    c.num_kv_heads = c.num_heads;
    c.tie_word_embeddings = true;  // GPT2LMHeadModel always ties lm_head to wte
  } else if (c.model_type == "llama") {
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
    c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  } else if (c.model_type == "bert") {
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
    c.tie_word_embeddings = true;  // BertForMaskedLM ties the decoder to the word embeddings
  } else {
    return Field(what, "model_type", absl::StrCat("'", c.model_type, "' is not one of gpt2, llama, bert"));
  }
  if (c.hidden_size % c.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the hidden size ", c.hidden_size,
                                                   " is not divisible by the ", c.num_heads, " attention heads"));
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": num_attention_heads ", c.num_heads,
                                                   " is not divisible by num_key_value_heads ", c.num_kv_heads));
  }
  return c;
}

absl::Status CheckShardable(const ModelConfig& config, const v1::ShardConfig& shard) {
  const int64_t tp = shard.tensor_parallel_size();
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
      if (config.model_type == "bert") {
        return absl::InvalidArgumentError("the bert policy supports tensor_parallel_mode 1d only");
      }
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
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError("unknown tensor_parallel_mode");
  }
}

}  // namespace colod::shardformer
