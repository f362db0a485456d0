// The decoder-only causal LMs whose layers are declared once, in their
// layer table in spec/plan.cc (PlanLeaves): GPT-2, LLaMA, OPT and BLOOM. The planner
// counts that table; BuildDecoder makes the module tree from it (every
// leaf's module, checkpoint name, sizes and tying), and DecoderPolicy
// derives the policy's sub-module replacements from each leaf's role in the
// layout's mode. What a family adds to its table is its names (DecoderFamily:
// the containers, their classes and forwards, the embedding, norm and head)
// and its attention and MLP forwards. The model forward (embeddings, layers,
// final norm; sequence-parallel split; a pipeline stage's part) and the
// pipeline stage split are shared where a family's differ only in names
// (GPT-2, LLaMA); OPT and BLOOM bring their own model forwards.
//
// Thread-safety: pure functions; the forwards they return capture a copy of
// the DecoderFamily.
#ifndef COLOD_WORKER_SHARDFORMER_DECODER_FAMILY_H_
#define COLOD_WORKER_SHARDFORMER_DECODER_FAMILY_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "spec/model_config.h"
#include "worker/shardformer/module.h"
#include "worker/shardformer/shard_config.h"
#include "worker/shardformer/shardformer.h"

namespace colod::shardformer {

struct DecoderFamily {
  std::string root_class;   // "GPT2LMHeadModel"
  // The base model's path under the root: "transformer" (checkpoint names
  // start with it), "model.decoder" (OPT).
  std::string base;
  std::string base_class;   // "GPT2Model", "OPTDecoder"
  std::string layers;       // the layer list under the base model: "h"
  std::string layer_class;  // "GPT2Block"
  Module::ForwardFn layer_forward;
  // A layer's containers, by name under the layer ("attn"): each leaf of
  // the table below a layer sits in one.
  struct Part {
    std::string name, class_name;
    Module::ForwardFn forward;
  };
  std::vector<Part> parts;
  // The containers from the root down to the base model, when the base
  // model is not the root's child: OPT's "model" (OPTModel) holding "decoder".
  std::vector<Part> outer;
  std::string tokens;      // the token table under the base model: "wte"
  std::string positions;   // the learned position table ("wpe"); empty: none (rotary)
  std::string final_norm;  // "ln_f"
  std::string head;        // the LM head under the root: "lm_head"
  // Sets a layer's attributes (heads, head dim, ...) once its leaves are in,
  // and the base model's.
  std::function<void(Module& layer, const ModelConfig& config)> configure_layer;
  std::function<void(Module& base, const ModelConfig& config)> configure_base;
  // The base model's forward, where it is the family's own (OPT's offset
  // positions and projections, BLOOM's embedding norm); unset:
  // DecoderModelForward. Such a family has no pipeline stages.
  std::function<Module::ForwardFn(bool sequence_parallel)> model_forward;
};

// The family's module tree from its layer table (PlanLeaves(config)), in
// the table's order: the base model's leaves, the layers (each with every
// leaf under "<layers>.*"), then the root's (the head). Norms take
// config.norm_eps. INVALID_ARGUMENT from PlanLeaves; INTERNAL for a table
// entry the family does not place (a container it does not name, a kind
// without a module).
absl::StatusOr<std::unique_ptr<Module>> BuildDecoder(const DecoderFamily& family, const ModelConfig& config);

// The policy's sub-module replacements for `shard`'s mode, from each leaf's
// role, by module class (the root, base model and layer classes are always
// present): 1D column/row-parallel linears (fused projections keep
// n_fused), a vocab-parallel token table and untied head, Norm1D with
// sequence parallelism (and the base model's forward replaced by the
// sequence-parallel one); 2D/2.5D and 3D their Linear, Embedding, norm and
// head layers (a row-parallel linear is the second of its 3D pair: swap).
// INTERNAL for a role it has no rule for.
absl::StatusOr<std::map<std::string, ModulePolicyDescription>> DecoderPolicy(const DecoderFamily& family,
                                                                             const ModelConfig& config,
                                                                             const ShardConfig& shard);

// The base model's forward: the embeddings (token, plus positions where the
// family has them) on the first stage, split along the sequence over tp
// with `sequence_parallel`; the stage's layers; the final norm on the last.
Module::ForwardFn DecoderModelForward(const DecoderFamily& family, bool sequence_parallel, PipelineStage stage = {});
// The root's: the base model (through the outer containers), then the head
// on the last stage.
Module::ForwardFn DecoderLmForward(const DecoderFamily& family, PipelineStage stage = {});

// A pipeline stage's part of the model (ModelFamily::split_stage): its
// layers; the embeddings on the first stage; the final norm and the head on
// the last, which keeps the token table as a tied head's (a mirror of the
// first stage's). Returns the tied table's name on the stages that hold it.
absl::StatusOr<std::vector<std::string>> SplitDecoderStage(const DecoderFamily& family, Module& root,
                                                           const PipelineStage& stage);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_DECODER_FAMILY_H_
