// A Hugging Face `config.json`, normalized across the model families colod
// shards (GPT-2, LLaMA, BERT), and the checks a ShardConfig must pass for it.
//
// Thread-safety: a value type.
#ifndef COLOD_WORKER_SHARDFORMER_MODEL_CONFIG_H_
#define COLOD_WORKER_SHARDFORMER_MODEL_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "colod/v1/job.pb.h"

namespace colod::shardformer {

struct ModelConfig {
  std::string model_type;  // "gpt2", "llama" or "bert"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;       // = num_heads except LLaMA's grouped-query attention
  int64_t intermediate_size = 0;  // the MLP's inner size
  int64_t max_positions = 0;
  double norm_eps = 1e-5;     // layer_norm_epsilon / rms_norm_eps / layer_norm_eps
  double rope_theta = 10000;  // LLaMA
  std::string activation;     // "gelu_new", "silu", "gelu"
  bool tie_word_embeddings = true;
  int64_t type_vocab_size = 0;  // BERT
  std::string json;             // the config.json text it was parsed from

  int64_t head_dim() const { return num_heads == 0 ? 0 : hidden_size / num_heads; }
};

// Parses config.json text. INVALID_ARGUMENT naming the field for a missing or
// mistyped required field, an unknown model_type (naming it and the known
// ones), or sizes that do not fit together (hidden_size not divisible by the
// heads, heads not divisible by the kv heads).
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& what = "config.json");
// DIR/config.json is read by LoadConfig (worker/shardformer/shardformer.h),
// which lets a registered family parse its own fields.

// INVALID_ARGUMENT, naming the field and the numbers, when `shard` cannot
// shard `config`: heads (and kv heads) not divisible by tp in 1D; hidden or
// intermediate size not divisible by q in 2D/2.5D/3D; a mode the family's
// policy does not support.
absl::Status CheckShardable(const ModelConfig& config, const v1::ShardConfig& shard);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_MODEL_CONFIG_H_
