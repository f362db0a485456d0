// Test helpers (testonly): tiny random Hugging Face-style model directories
// and independent, unsharded reference implementations of the model
// families, written straight from the transformers modeling code with the
// functional ops, to compare sharded models against.
#ifndef COLOD_WORKER_SHARDFORMER_TESTING_H_
#define COLOD_WORKER_SHARDFORMER_TESTING_H_

#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "spec/model_config.h"
#include "worker/shardformer/shard_config.h"
#include "worker/tensor/tensor.h"

namespace colod::shardformer::testing {

struct TinyOptions {
  int64_t vocab = 50;  // not a multiple of 64: the 1D vocabulary gets padding
  int64_t hidden = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t positions = 16;
  uint64_t seed = 1;
  // GPT-2: names with the LM model's "transformer." prefix, or the bare
  // model's names as on the hub.
  bool prefixed = true;
  // LLaMA: key/value heads (grouped-query attention), MLP size, tied head.
  int64_t kv_heads = 2;
  int64_t intermediate = 96;
  bool tie = false;
  // OPT: pre- or post-norm layers, word_embed_proj_dim (0: the hidden size;
  // otherwise project_in/out), the MLP's activation_function; `tie` as above
  // (OPT ties by default: set it).
  bool pre_norm = true;
  int64_t embed_dim = 0;
  std::string activation = "relu";
  // BLOOM: apply_residual_connection_post_layernorm.
  bool residual_post_norm = false;
  // ViT: images of image x image pixels and `channels` channels in patch x
  // patch squares, `labels` classes.
  int64_t image = 8;
  int64_t patch = 4;
  int64_t channels = 3;
  int64_t labels = 10;
  // T5: gated-gelu (v1.1) rather than relu (v1.0), the head dim d_kv (0:
  // hidden / heads), 8 relative buckets reaching 16 positions (so short
  // sequences meet the logarithmic buckets); `tie` as above.
  bool gated = false;
  int64_t kv_dim = 0;
};

// A tiny T5 of flan-t5's shape: gated GELU, an untied head, and d_kv 8, so
// that heads * d_kv (32) is not the hidden size (64).
TinyOptions TinyFlanT5();

struct TinyModel {
  std::string dir;
  ModelConfig config;
  std::map<std::string, Tensor> tensors;  // as written, by checkpoint name
};

// Creates `dir` with config.json and model.safetensors of a random GPT-2.
absl::StatusOr<TinyModel> WriteTinyGpt2(const std::string& dir, const TinyOptions& options = {});

// Creates `dir` with config.json and model.safetensors of a random LLaMA.
absl::StatusOr<TinyModel> WriteTinyLlama(const std::string& dir, const TinyOptions& options = {});

// Creates `dir` with config.json and model.safetensors of a random
// BertForMaskedLM (intermediate size 2 * hidden).
absl::StatusOr<TinyModel> WriteTinyBert(const std::string& dir, const TinyOptions& options = {});

// Creates `dir` with config.json and model.safetensors of a random
// OPTForCausalLM (names with "model.decoder.", or "decoder." unprefixed).
absl::StatusOr<TinyModel> WriteTinyOpt(const std::string& dir, const TinyOptions& options = {});

// Creates `dir` with config.json and model.safetensors of a random
// BloomForCausalLM (names with "transformer.", or bare).
absl::StatusOr<TinyModel> WriteTinyBloom(const std::string& dir, const TinyOptions& options = {});

// Creates `dir` with config.json and model.safetensors of a random
// T5ForConditionalGeneration (encoder and decoder of `layers` blocks).
absl::StatusOr<TinyModel> WriteTinyT5(const std::string& dir, const TinyOptions& options = {});

// Creates `dir` with config.json and model.safetensors of a random
// ViTForImageClassification (intermediate size `intermediate`).
absl::StatusOr<TinyModel> WriteTinyVit(const std::string& dir, const TinyOptions& options = {});
// Deterministic pixel values [batch, channels, image, image] and labels [batch] in [0, labels).
Tensor PixelValues(int64_t batch, const TinyOptions& options, uint64_t salt);
Tensor ImageLabels(int64_t batch, int64_t labels, uint64_t salt);

// The unsharded model's results for int64 ids [B, S].
struct Reference {
  Tensor logits;                          // [B, S, V]
  double loss = 0;                        // mean next-token cross-entropy
  std::map<std::string, Tensor> grads;    // d loss / d tensor, by checkpoint name
  std::optional<Tensor> labels;           // a masked LM's targets (-100: none); none for next-token
  int64_t tokens = 0;                     // how many predictions the loss averages
  std::optional<Tensor> decoder_ids;      // an encoder-decoder's decoder input [B, Sd]
};
absl::StatusOr<Reference> ReferenceGpt2(const TinyModel& model, const Tensor& ids);
absl::StatusOr<Reference> ReferenceLlama(const TinyModel& model, const Tensor& ids);
absl::StatusOr<Reference> ReferenceOpt(const TinyModel& model, const Tensor& ids);
absl::StatusOr<Reference> ReferenceBloom(const TinyModel& model, const Tensor& ids);
// T5's logits [B, Sd, V] for `ids` [B, Se] and `decoder_ids` [B, Sd], and
// the mean cross-entropy against `labels` [B, Sd] (-100: none).
absl::StatusOr<Reference> ReferenceT5(const TinyModel& model, const Tensor& ids, const Tensor& decoder_ids,
                                      const Tensor& labels);
// Logits [B, 1, labels] of images [B, C, H, W] and the classification loss
// against `labels` [B] (r.labels holds them as [B, 1]).
absl::StatusOr<Reference> ReferenceVit(const TinyModel& model, const Tensor& pixels, const Tensor& labels);
// The masked-LM loss against `labels` [B, S] (-100 where nothing is predicted).
absl::StatusOr<Reference> ReferenceBert(const TinyModel& model, const Tensor& ids, const Tensor& labels);

// Loads `model` sharded as `shard` on a mesh of threads over Gloo and
// checks, with gtest, that every rank's logits (each dp replica running its
// rows of `ids`), the mean next-token loss and the gradient of every
// checkpoint tensor (the replicas' shares summed over dp) equal `ref`'s
// within `tol`. The sharded model
// names tensors as the LM model saves them: `prefix` + the reference's name
// for a bare model's checkpoint.
void ExpectShardedMatchesReference(const TinyModel& model, const Reference& ref, const ShardConfig& shard,
                                   const Tensor& ids, double tol, const std::string& prefix = "");

// Deterministic ids in [0, vocab).
Tensor TokenIds(int64_t batch, int64_t seq, int64_t vocab, uint64_t salt);
// Masked-LM targets: ids at every third position, -100 elsewhere.
Tensor MaskedLabels(const Tensor& ids);

}  // namespace colod::shardformer::testing

#endif  // COLOD_WORKER_SHARDFORMER_TESTING_H_
