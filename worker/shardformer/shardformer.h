// ShardFormer (../shared/reference/shardformer.md), native: a policy says,
// per module class, which attributes change, which sub-modules become which
// tensor-parallel layers, and which forwards are replaced; ModelSharder
// applies it to a model's module tree (worker/shardformer/module.h) while
// each rank reads its blocks of the checkpoint; the ShardFormer facade loads
// a Hugging Face-style directory with the policy of its model_type.
//
//   ShardFormer sf(shard_config, &pg);
//   ASSIGN_OR_RETURN(auto model, sf.Load("/models/gpt2"));
//   ASSIGN_OR_RETURN(ColoTensor logits, model->Forward(ids));
//   ASSIGN_OR_RETURN(LmLoss loss, model->NextTokenLoss(logits, ids));
//
// Users shard their own models by registering a family (a builder for the
// module tree and a policy) with ModelRegistry, or by passing a policy to
// ShardFormer::Optimize; docs/SHARDFORMER.md walks through an example.
//
// Thread-safety: the registries are thread-safe; a ShardedModel belongs to
// one rank thread.
#ifndef COLOD_WORKER_SHARDFORMER_SHARDFORMER_H_
#define COLOD_WORKER_SHARDFORMER_SHARDFORMER_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "worker/shardformer/layers.h"
#include "spec/model_config.h"
#include "worker/shardformer/model_files.h"
#include "worker/shardformer/module.h"

namespace colod::shardformer {

// Replace the leaf at `suffix` (relative to the described module) with the
// registered layer `target_module` built with `kwargs`.
struct SubModuleReplacementDescription {
  std::string suffix;
  std::string target_module;
  std::map<std::string, double> kwargs;
  bool ignore_if_not_exist = false;
};

// What changes in every module of one class.
struct ModulePolicyDescription {
  // Attributes of the module or its descendants ("attn.num_heads") set to new values.
  std::map<std::string, double> attribute_replacement;
  // Functions run on the module after its sub-modules are replaced.
  std::vector<std::function<absl::Status(Module& module)>> param_replacement;
  std::vector<SubModuleReplacementDescription> sub_module_replacement;
  // The module's new forward; empty keeps the original.
  Module::ForwardFn method_replacement;
};

class Policy {
 public:
  virtual ~Policy() = default;
  // Checks (and adjusts the ShardConfig) before anything is built.
  virtual absl::Status Preprocess(const ModelConfig& config, ShardConfig& shard) { return absl::OkStatus(); }
  // Module class name -> what to do to each module of that class.
  virtual absl::StatusOr<std::map<std::string, ModulePolicyDescription>> ModulePolicy(const ModelConfig& config,
                                                                                      const ShardConfig& shard) = 0;
  // After every leaf is loaded: e.g. tie the LM head to the embedding.
  virtual absl::Status Postprocess(Module& model, const ModelConfig& config, const ShardConfig& shard) {
    return absl::OkStatus();
  }
};

// The common part of the causal-LM policies (GPT-2, LLaMA, OPT, BLOOM):
// preprocess accepts the modes the family takes (spec's LayoutsOf, checked
// by CheckShardable with the model's sizes against the layout); postprocess
// ties LM heads.
class CausalLmPolicy : public Policy {
 public:
  absl::Status Preprocess(const ModelConfig& config, ShardConfig& shard) override;
  absl::Status Postprocess(Module& model, const ModelConfig& config, const ShardConfig& shard) override;
};

// Makes every leaf whose declaration says it is tied to an embedding
// (LayerDecl::tied_to) that embedding layer's TiedHead.
absl::Status TieLmHeads(Module& model);

// A table several pipeline stages hold, each computing with its own copy:
// the module at `path` under the root, held by the (virtual) stages
// `stages` (ascending), of which the first owns it and the others mirror
// it. Their gradients are summed over the holders in stage order after each
// step (train's SumTiedGradients), so every copy takes the same update.
struct TiedTable {
  std::string path;
  std::vector<int> stages;
};

// A model family: its native module tree and its policy.
struct ModelFamily {
  // The bare model's name inside the LM model ("transformer" for GPT-2):
  // checkpoints of the bare model lack it and load all the same.
  std::string base_model_prefix;
  // Parses config.json's text; empty means ParseModelConfig (gpt2, llama,
  // bert). A family of your own reads its own fields here.
  std::function<absl::StatusOr<ModelConfig>(const std::string& json_text, const std::string& what)> parse;
  std::function<absl::StatusOr<std::unique_ptr<Module>>(const ModelConfig& config)> build;
  std::function<std::unique_ptr<Policy>()> policy;
  // Pipeline stages (empty for a family without them): drops from the
  // built tree the layers `stage` does not hold and makes its forward the
  // stage's (the first stage reads the model's input, token ids or pixels,
  // the others the previous stage's activation; only the last gives
  // logits; an encoder-decoder's forward of two inputs takes the decoder's
  // ids on every stage as its second). Returns the tables this stage shares with other stages (the
  // embedding an LM head is tied to, which the last stage keeps as the
  // head's table; T5's shared embedding and position bias tables).
  std::function<absl::StatusOr<std::vector<TiedTable>>(Module& root, const PipelineStage& stage)> split_stage;
};

class ModelRegistry {
 public:
  // Holds gpt2, llama, bert, opt, bloom, vit and t5.
  static ModelRegistry& Global();
  // Adds or replaces the family of `model_type`.
  void Register(const std::string& model_type, ModelFamily family);
  // INVALID_ARGUMENT naming the model type and the known ones.
  absl::StatusOr<ModelFamily> Get(const std::string& model_type) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, ModelFamily> families_ ABSL_GUARDED_BY(mu_);
};

// DIR/config.json parsed by the registered family of its model_type.
// NOT_FOUND without the file; INVALID_ARGUMENT naming the field for a
// missing or unregistered model_type or a bad field.
absl::StatusOr<ModelConfig> LoadConfig(const std::string& dir);

// Applies a policy to a module tree and loads its leaves. With tp = 1 the
// module policy is skipped and every leaf stays native.
class ModelSharder {
 public:
  ModelSharder(Module& model, Policy& policy, const ModelConfig& config, ShardConfig shard, const ModelFiles* files,
               ProcessGroup* pg)
      : model_(model), policy_(policy), config_(config), shard_(std::move(shard)), files_(files), pg_(pg) {}
  absl::Status Shard();
  const ShardConfig& shard_config() const { return shard_; }

 private:
  absl::Status Apply(Module& module, const std::string& path, const ModulePolicyDescription& description);

  Module& model_;
  Policy& policy_;
  const ModelConfig& config_;
  ShardConfig shard_;
  const ModelFiles* files_;
  ProcessGroup* pg_;
};

// The per-token loss of a causal LM over this rank's batch.
struct LmLoss {
  Variable loss;       // this rank's term of the mean, on the tape: Backward(loss) gives d(mean)
  double value = 0;    // the mean over every token of the batch (all dp ranks)
  int64_t tokens = 0;  // how many labelled tokens the batch has (all dp ranks)
  // Where the model defers the read (ShardedModel::set_loss_read_deferred)
  // and a denominator is given: `value` and `tokens` are not read (NaN, -1),
  // and value is sum_on_device's one f32 (the loss summed over the batch's
  // tokens, all dp ranks; ready in stream order on the loss's device)
  // divided by `denominator`, for the caller to read with the rest of its
  // step. A communicator's failure is then seen by the process group's
  // AsyncError after that read.
  std::optional<Tensor> sum_on_device;
  int64_t denominator = 0;
  // Whether the LM head and the loss ran fused (ShardedModel::ForwardTokenLoss).
  bool fused_head = false;
};

class ShardedModel {
 public:
  ShardedModel(std::unique_ptr<Module> root, ModelConfig config, ShardConfig shard, ProcessGroup* pg)
      : root_(std::move(root)), config_(std::move(config)), shard_(std::move(shard)), pg_(pg) {}

  Module& root() { return *root_; }
  const ModelConfig& config() const { return config_; }
  const ShardConfig& shard_config() const { return shard_; }
  ProcessGroup* process_group() const { return pg_; }

  // Logits for int64 token ids [B, S], the batch of this rank's dp replica
  // (the same on every rank of its tp group). INVALID_ARGUMENT for ids
  // outside the vocabulary or longer than max positions. A model that takes
  // images (ViT, ModelConfig::takes_images) reads float pixel values
  // [B, channels, image_size, image_size] instead and gives [B, 1, labels].
  absl::StatusOr<ColoTensor> Forward(const Tensor& ids);
  // An encoder-decoder's (T5's) logits [B, Sd, V] for token ids [B, Se]
  // and decoder ids [B, Sd]. INVALID_ARGUMENT for ids that are not integer
  // [B, S] of one batch, or a model that is not an encoder-decoder.
  absl::StatusOr<ColoTensor> Forward(const Tensor& ids, const Tensor& decoder_ids);
  // The mean cross-entropy of an image classifier's logits [B, 1, labels]
  // against integer labels [B] (-100: left out); `denominator` as for TokenLoss.
  absl::StatusOr<LmLoss> ClassificationLoss(const ColoTensor& logits, const Tensor& labels, int64_t denominator = 0);
  // Mean next-token cross-entropy of `logits` for `ids` (position s
  // predicts ids[s + 1]); collective over the ranks that split the batch.
  absl::StatusOr<LmLoss> NextTokenLoss(const ColoTensor& logits, const Tensor& ids);
  // Mean cross-entropy of `logits` against integer `labels` [B, S] (a masked
  // LM's targets), positions labelled -100 left out. The mean divides by the
  // labelled positions of the batch (over every dp rank), or by
  // `denominator` when it is > 0: a step's micro-batches, each divided by
  // the labelled positions of the whole step, add up to the step's mean
  // however their labels fall. INVALID_ARGUMENT when nothing is labelled and
  // no denominator is given.
  absl::StatusOr<LmLoss> TokenLoss(const ColoTensor& logits, const Tensor& labels, int64_t denominator = 0);
  // `forward` (this model's Forward, or a pipeline stage's root().Forward)
  // and TokenLoss of its logits against `labels`, with the LM head fused
  // into the loss where the model allows: the model ends in a leaf
  // "lm_head" whose layer has a HeadWeight (native, VocabParallelLMHead1D or
  // a tied 1D head, without sequence parallelism) and fused_head_rows() != 0.
  // Then `forward` runs with the head passed through (Module::
  // set_pass_through) and the fused head computes the logits, the loss and
  // their gradient a chunk of rows at a time (fused_head_rows()), so neither
  // the logits nor their gradient need be whole: without pipeline stages
  // nn::VocabParallelLinearCrossEntropySum, which takes the gradients in
  // forward (no chunk's logits computed twice), else
  // nn::VocabParallelLinearCrossEntropy, which recomputes them in backward
  // (a schedule holding several micro-batches would hold each one's f32
  // gradient sums).
  // Otherwise (2D/2.5D/3D heads, sequence parallelism, a model without an
  // lm_head) the head runs as part of `forward` and TokenLoss takes its
  // logits. The same loss and gradients either way, within f32 rounding;
  // LmLoss::fused_head says which ran. INTERNAL if the model's output is not
  // its head's.
  absl::StatusOr<LmLoss> ForwardTokenLoss(const std::function<absl::StatusOr<ColoTensor>()>& forward,
                                          const Tensor& labels, int64_t denominator = 0);
  // Rows of the fused LM head's chunks; 0 runs the head unfused;
  // kFusedHeadByBytes (the default) as many rows as keep a chunk's logits
  // within kFusedHeadChunkBytes: GPT-2 124M's 8192 rows of 50304 bf16 logits
  // go in two chunks, LLaMA's 32000-word vocabulary's in one, a 256k
  // vocabulary's 1024 rows at a time. The budget counts the logits alone, in
  // the dtype they are computed in (f32 where the hidden states' and the
  // head's differ); a
  // chunk's backward holds their gradient beside them, so its peak is about
  // twice the budget. With pipeline stages each chunk costs a head GEMM
  // again in backward, so fewer and larger chunks are faster.
  // INVALID_ARGUMENT for a negative
  // count other than kFusedHeadByBytes.
  static constexpr int64_t kFusedHeadByBytes = -1;
  static constexpr int64_t kFusedHeadChunkBytes = int64_t{512} << 20;
  int64_t fused_head_rows() const { return fused_head_rows_; }
  absl::Status set_fused_head_rows(int64_t rows) {
    if (rows < 0 && rows != kFusedHeadByBytes) {
      return absl::InvalidArgumentError(absl::StrCat("fused head rows ", rows, " is negative"));
    }
    fused_head_rows_ = rows;
    return absl::OkStatus();
  }
  // Whether the losses with a denominator leave their value on the device
  // (LmLoss::sum_on_device) instead of reading it: a training step reads it
  // after its update is enqueued, so the device does not drain at the end
  // of forward. Off by default.
  void set_loss_read_deferred(bool deferred) { loss_read_deferred_ = deferred; }
  bool loss_read_deferred() const { return loss_read_deferred_; }
  // Next-token labels of ids [B, S]: position s is labelled ids[s + 1], the
  // last position -100.
  static absl::StatusOr<Tensor> NextTokenLabels(const Tensor& ids);
  // The logits as a full f32 [B, S, vocab_size] tensor (padding removed) on
  // every rank of the dp replica. Collective.
  absl::StatusOr<Tensor> GatherLogits(const ColoTensor& logits);

  // Every parameter, in module order, with its checkpoint name.
  std::vector<NamedParam> Parameters();
  // A pipeline stage's input from the previous stage: the spec of the
  // activation its first layer takes (the residual stream's), rank `ndim`.
  absl::StatusOr<DistSpec> StageInputSpec(int64_t ndim);
  // The global shape of a stage's input from the previous stage, for
  // micro-batches of `rows` sequences of `seq` tokens (`decoder_seq` the
  // decoder's, an encoder-decoder's): the residual stream [rows, seq,
  // hidden] (an image classifier's seq its patches and CLS token); an
  // encoder-decoder's (t5.cc) the encoder's stream, or its output on the
  // first decoder stage, [rows, seq, hidden], and on a later decoder stage
  // the decoder's stream and the encoder's output joined along the
  // sequence, [rows, decoder_seq + seq, hidden].
  Shape StageInputShape(int64_t rows, int64_t seq, int64_t decoder_seq) const;
  // The tables this stage shares with others (ModelFamily::split_stage):
  // mirrors on every holder but the first.
  void set_tied_tables(std::vector<TiedTable> tables) { tied_ = std::move(tables); }
  // The tensors of the files it was loaded from that no parameter took
  // (ShardFormer::Load, at pp = 1: a stage reads its layers only), less
  // those a Hugging Face checkpoint carries that no model reads (buffers:
  // GPT-2's attention masks, rotary frequencies, position ids; tied copies
  // of the embedding): a config.json of fewer layers than its weights, a
  // head this model has not. Empty where the files were read whole or the
  // model was built otherwise.
  const std::vector<std::string>& unread_tensors() const { return unread_; }
  void set_unread_tensors(std::vector<std::string> names) { unread_ = std::move(names); }
  // The full checkpoint tensors, by name, of the parameters (or of their
  // gradients: FAILED_PRECONDITION naming a parameter that has none).
  // Collective over the model's ranks.
  absl::StatusOr<std::map<std::string, Tensor>> GatherHf(bool gradients);

 private:
  std::unique_ptr<Module> root_;
  ModelConfig config_;
  ShardConfig shard_;
  std::vector<std::string> unread_;
  // TokenLoss's end: this rank's per-row losses (`count` labelled) summed,
  // the sum and the count summed over `row_axes` and dp, and divided.
  absl::StatusOr<LmLoss> MeanOfRows(const Variable& per_row, int64_t count, std::vector<std::string> row_axes,
                                    int64_t denominator);
  // The same from the rows' losses already summed on this rank (`sum`, []).
  absl::StatusOr<LmLoss> MeanOfSum(const Variable& sum, int64_t count, std::vector<std::string> row_axes,
                                   int64_t denominator);

  ProcessGroup* pg_;
  std::vector<TiedTable> tied_;
  const TiedTable* FindTied(const std::string& path) const;
  // 1024 rows of GPT-2's 50257-word head: 206 MB of f32 logits a chunk.
  int64_t fused_head_rows_ = kFusedHeadByBytes;
  bool loss_read_deferred_ = false;
};

class ShardFormer {
 public:
  ShardFormer(ShardConfig shard, ProcessGroup* pg) : shard_(std::move(shard)), pg_(pg) {}
  // config.json and weights from `dir`, sharded with the registered policy
  // of its model_type. INVALID_ARGUMENT naming the field or tensor for
  // an unknown model_type, a layout the model cannot take (heads not
  // divisible by tp, ...), a missing or misshaped tensor.
  absl::StatusOr<std::unique_ptr<ShardedModel>> Load(const std::string& dir);
  // Every model chunk this rank holds, chunk 0 first: layout.virtual_stages
  // of them under interleaved 1F1B (chunk c is virtual stage c * pp + this
  // rank's pp coordinate), Load's one model otherwise; the config's chunk
  // is ignored.
  absl::StatusOr<std::vector<std::unique_ptr<ShardedModel>>> LoadChunks(const std::string& dir);
  // Shards `model` with `policy`, loading from `files`.
  absl::StatusOr<std::unique_ptr<ShardedModel>> Optimize(std::unique_ptr<Module> model, const ModelConfig& config,
                                                         const ModelFiles& files, Policy& policy);

 private:
  ShardConfig shard_;
  ProcessGroup* pg_;
};

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_SHARDFORMER_H_
