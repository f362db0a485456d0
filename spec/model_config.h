// A Hugging Face `config.json`, normalized across the model families colod
// shards (GPT-2, LLaMA, BERT, OPT, BLOOM, ViT, T5), and the checks a ShardConfig must pass for it.
//
// Thread-safety: a value type.
#ifndef COLOD_SPEC_MODEL_CONFIG_H_
#define COLOD_SPEC_MODEL_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "colod/v1/job.pb.h"

namespace colod {

struct ModelConfig {
  std::string model_type;  // "gpt2", "llama", "bert", "opt", "bloom", "vit" or "t5"
  int64_t vocab_size = 0;  // the logits' last dim: the vocabulary, or ViT's num_labels
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
  // OPT: pre-norm blocks (do_layer_norm_before; post-norm as opt-350m when
  // false), the decoder's final LayerNorm (pre-norm models not marked
  // _remove_final_layer_norm), biases on every linear (enable_bias), the
  // token embeddings' width (word_embed_proj_dim: project_in/out when it
  // differs from hidden_size), and the learned positions' offset (2: row
  // s + 2 embeds position s).
  bool norm_before = true;
  bool final_norm = true;
  bool linear_bias = true;
  int64_t embed_dim = 0;  // = hidden_size but for OPT's word_embed_proj_dim
  int64_t position_offset = 0;
  // BLOOM: the residuals around attention and MLP are the LayerNorms'
  // outputs rather than their inputs (apply_residual_connection_post_layernorm).
  bool residual_post_norm = false;
  // ViT: square images of image_size pixels and num_channels channels, cut
  // into patch_size squares; (image_size / patch_size)^2 patches and the
  // CLS token make the sequence (max_positions).
  int64_t image_size = 0;
  int64_t patch_size = 0;
  int64_t num_channels = 0;
  // T5: the head dim (d_kv; heads * d_kv need not be hidden_size), the
  // decoder's layers (num_layers counts the encoder's), and the relative
  // position buckets of layer 0's attention bias.
  int64_t kv_dim = 0;
  int64_t num_decoder_layers = 0;
  int64_t relative_buckets = 0;
  int64_t relative_max_distance = 0;
  // T5: what the decoder reads before the first target, and in place of a
  // target left out (-100) when training (both 0 in the published configs).
  int64_t decoder_start_token_id = 0;
  int64_t pad_token_id = 0;
  // BERT: the attention sees every position (not causal), so the model
  // trains as a masked language model. Set by the parse of the family's
  // config, so that a family registered on BERT's (renamed) keeps it.
  bool sees_every_position = false;
  std::string json;  // the config.json text it was parsed from

  int64_t head_dim() const { return kv_dim > 0 ? kv_dim : num_heads == 0 ? 0 : hidden_size / num_heads; }
  // Whether the model is an encoder-decoder reading token ids and decoder ids (T5).
  bool is_encoder_decoder() const { return num_decoder_layers > 0; }
  // Whether the model reads images [B, C, H, W] (ViT) rather than token ids.
  bool takes_images() const { return image_size > 0; }
  // Whether the model sees every position (BERT), so that it trains as a
  // masked language model (TrainSpec.mask_token_id), not on next tokens.
  bool masked_lm() const { return sees_every_position; }
  // Whether queries and keys are rotated (RoPE: LLaMA) before the attention.
  bool rotary() const { return model_type == "llama"; }
  // Whether q, k and v come out of one fused projection, the attention
  // reading them as strided views of its output (GPT-2, BLOOM).
  bool packed_qkv() const { return model_type == "gpt2" || model_type == "bloom"; }
};

// The most layers a config may declare: far deeper than any published model
// (LLaMA 3.1 405B has 126), and it bounds the module tree a worker builds
// before it reads the weights.
inline constexpr int64_t kMaxLayers = 4096;
// The most positions a config with a position offset (OPT) may declare, so
// that the table's rows (positions + offset) count without overflow.
inline constexpr int64_t kMaxPositions = int64_t{1} << 40;

// The fields in which two configs describe models of different parameters
// (their number, shapes or roles: "hidden_size 32, not 64", `a`'s, then
// `b`'s), empty where the parameters are the same. What only changes the
// computation over them (norm_eps, rope_theta, the activation, a rotary
// model's max_positions, T5's relative_max_distance and token ids: a run
// may go on with another) and the text (`json`) are not compared.
std::vector<std::string> ArchitectureDifferences(const ModelConfig& a, const ModelConfig& b);

// Parses config.json text. INVALID_ARGUMENT naming the field for a missing or
// mistyped required field, an unknown model_type (naming it and the known
// ones), sizes that do not fit together (hidden_size not divisible by the
// heads, heads not divisible by the kv heads), more than kMaxLayers layers,
// or a model whose parameter count overflows int64.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& what = "config.json");
// DIR/config.json's text; NOT_FOUND "no config.json in DIR" without it,
// ReadFileToString's error where one is there but cannot be read.
absl::StatusOr<std::string> ReadConfigJson(const std::string& dir);
// DIR/config.json parsed by ParseModelConfig: the built-in families, as the
// coordinator and `coloctl plan` know them. The worker reads it with
// LoadConfig (worker/shardformer/shardformer.h), which also lets a family
// registered in its process parse its own fields.
absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& dir);

// The model's parameters as its Hugging Face checkpoint holds them (a tied
// LM head counted once), from the config alone, in overflow-checked
// arithmetic: INVALID_ARGUMENT when the count overflows int64.
absl::StatusOr<int64_t> ParameterCount(const ModelConfig& config);

// The least memory one rank of a job holds for its model: the parameters
// of the rank holding the most (RankParameters in plan.h: split as the
// layout's layers split them, norms replicated, the vocabulary padded; 1/tp
// where the layout has no mesh), in f32 for
// FORWARD jobs and f32 training; for training also as many gradient bytes
// and the optimizer's state (an f32 momentum, AdamW's second f32 moment, an
// f32 master copy under mixed precision: 16 bytes a parameter with AdamW,
// 12 with SGD, whatever the precision; under ZeRO the state, and with stage 2
// the gradients, of 1/dp of them) and a step's activations (PlanJob's
// estimate, in bf16 unless the spec says fp32; zero where the plan refuses
// the spec). Workspaces come on top: a job whose floor exceeds a worker's
// memory cannot run there.
struct RankMemoryFloor {
  int64_t parameters = 0;       // of the whole model (ParameterCount)
  int64_t rank_parameters = 0;  // on the rank holding the most
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
  int64_t activation_bytes = 0;  // TRAIN jobs
  int64_t total_bytes = 0;
};
// INVALID_ARGUMENT on overflow; for TENSOR jobs (no model) all zero.
absl::StatusOr<RankMemoryFloor> MemoryFloorPerRank(const ModelConfig& config, const v1::JobSpec& spec);
// "at least 25.11 GiB per rank (6738415616 parameters, 1684803584 on the
// fullest rank: 3.14 GiB of parameters, 3.14 GiB of gradients, 18.83 GiB of
// optimizer state)".
std::string DescribeMemoryFloor(const RankMemoryFloor& floor);
// Bytes in GiB with two decimals: "25.10 GiB".
std::string GiB(int64_t bytes);

// INVALID_ARGUMENT, naming the field and the numbers, when `shard` cannot
// shard `config`: tp below 1; heads (and kv heads) not divisible by tp in
// 1D; hidden or intermediate size not divisible by q in 2D/2.5D/3D; a mode
// the family's policy does not support.
absl::Status CheckShardable(const ModelConfig& config, const v1::ShardConfig& shard);

// The layouts a built-in family's policy takes (worker/shardformer/<family>.cc
// builds them; README's table of families): the one declaration that
// CheckShardable, the planner and the policies read.
struct FamilyLayouts {
  bool sequence_parallel = false;  // 1D with sequence parallelism
  bool two_d = false;              // 2D and 2.5D
  bool three_d = false;
  bool pipeline_stages = false;
};
// The family of `config`'s; all false (1D only) for a model_type that is
// not built in.
FamilyLayouts LayoutsOf(const ModelConfig& config);
// INVALID_ARGUMENT naming the family and what it takes when `shard` asks
// for a mode, sequence parallelism or pipeline stages its policy lacks. OK
// for a model_type that is not built in: its registered policy decides.
absl::Status CheckFamilyTakes(const ModelConfig& config, const v1::ShardConfig& shard);

// Whether the family of `config` splits into pipeline stages
// (LayoutsOf(config).pipeline_stages).
bool HasPipelineStages(const ModelConfig& config);

// The most model chunks a rank holds in an interleaved pipeline
// (ShardConfig.virtual_stages; each at least one layer of the model's at
// most 4,096).
inline constexpr int kMaxVirtualStages = 4096;

// The layers of each pipeline stage (pipeline_parallel_size of them, times
// virtual_stages V: the virtual stages of an interleaved pipeline, of which
// pipeline rank r holds r, pp + r, ...; one stage of every layer without
// pipeline parallelism): the ShardConfig's pipeline_stage_layers, or as
// even as they split with the earlier stages taking one more. An
// encoder-decoder's (t5's) layers are the encoder's, then the decoder's, and
// no stage holds both: by default the stages split between the stacks in
// proportion to their layers, each stack's as even as they go.
// INVALID_ARGUMENT for more stages than layers, a list of another length
// or sum, a stage without a layer, a stage across the encoder's end, V
// outside [0, kMaxVirtualStages] or above 1 without pipeline_parallel_size
// >= 2, or a family without pipeline stages (every built-in family has them).
absl::StatusOr<std::vector<int64_t>> PipelineStageLayers(const ModelConfig& config, const v1::ShardConfig& shard);

// ShardConfig.virtual_stages in [0, kMaxVirtualStages], and above 1 only
// with pipeline_parallel_size >= 2: INVALID_ARGUMENT naming it otherwise
// (PipelineStageLayers checks it; the coordinator's validation too).
absl::Status CheckVirtualStages(const v1::ShardConfig& shard);

// Interleaved 1F1B (virtual_stages > 1) runs the micro-batches through a
// rank's chunks in groups of pipeline_parallel_size: INVALID_ARGUMENT
// "... micro_batches M is not a multiple of P" otherwise (micro_batches 0
// counts as 1). OK without interleaving.
absl::Status CheckInterleavedMicroBatches(const v1::ShardConfig& shard, int64_t micro_batches);

}  // namespace colod

#endif  // COLOD_SPEC_MODEL_CONFIG_H_
