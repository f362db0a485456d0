// The model families whose layers are declared once, in their layer table
// in spec/plan.cc (PlanLeaves): GPT-2, LLaMA, OPT, BLOOM, BERT, ViT and T5. The
// planner counts that table; BuildFromTable makes the module tree from it
// (every leaf's module, checkpoint name, sizes, shape and tying) and
// TablePolicy derives the policy's sub-module replacements from each leaf's
// role in the layout's mode. What a family adds to its table is its names
// (TableFamily: the containers, their classes and forwards, the layer list)
// and its forwards. The decoder-only LMs' model forward (embeddings, layers,
// final norm; sequence-parallel split; a pipeline stage's part) and their
// pipeline stage split are shared where the families differ only in names
// (GPT-2, LLaMA); OPT, BLOOM, BERT, ViT and T5 bring their own forwards,
// and every single-stack family shares the stage split.
//
// Thread-safety: pure functions; the forwards they return capture a copy of
// the TableFamily.
#ifndef COLOD_WORKER_SHARDFORMER_TABLE_FAMILY_H_
#define COLOD_WORKER_SHARDFORMER_TABLE_FAMILY_H_

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

struct TableFamily {
  std::string root_class;  // "GPT2LMHeadModel"
  // The base model's path under the root: "transformer" (checkpoint names
  // of the table's leaves start with it), "model.decoder" (OPT); empty: the
  // root is the base model (T5: its table's paths are the root's).
  std::string base;
  std::string base_class;  // "GPT2Model", "OPTDecoder"
  // The layer lists under the base model, the decoder-only LMs' first:
  // "h", "encoder.layer", T5's "encoder.block" and "decoder.block"; each
  // layer's class and forward.
  struct LayerList {
    std::string path;
    std::string class_name;  // "GPT2Block"
    Module::ForwardFn forward;
    bool decoder = false;  // config.num_decoder_layers layers (T5's decoder stack), else num_layers
  };
  std::vector<LayerList> layer_lists;
  // Every other container, by its path under the root, a layer's index
  // (the component after a layer list) written "*": "transformer.h.*.attn" (GPT2Attention), "model" (OPT's
  // OPTModel above its decoder), "bert.embeddings", "cls.predictions". A
  // leaf's containers are made on the way to it, in the table's order.
  struct Container {
    std::string path, class_name;
    Module::ForwardFn forward;
  };
  std::vector<Container> containers;
  // The decoder-only LMs' names, for the shared forwards
  // (DecoderModelForward, DecoderLmForward; the stage split reads the
  // tree's order, not these): the token table and the position table
  // ("wte", "wpe"; no positions: empty) under the base model, its final
  // norm, the LM head under the root.
  std::string tokens, positions, final_norm, head;
  // Sets a layer's attributes (heads, head dim, ...) once its leaves are in,
  // and the rest of the tree's once every leaf is.
  std::function<void(Module& layer, const ModelConfig& config)> configure_layer;
  std::function<void(Module& root, const ModelConfig& config)> configure;
  // The base model's and the root's forwards where they are the family's
  // own (OPT's offset positions and projections, BLOOM's embedding norm,
  // BERT's and ViT's); unset: DecoderModelForward and DecoderLmForward.
  // The base model's is made for a pipeline stage (PipelineStage{}: the
  // whole model): the embeddings on the first stage (the others take the
  // previous stage's stream), the final norm and whatever follows it on
  // the last. The root's runs on the last stage (SplitTableStage).
  std::function<Module::ForwardFn(bool sequence_parallel, PipelineStage stage)> model_forward;
  Module::ForwardFn root_forward;
  Module::CrossForwardFn root_cross_forward;  // a root of two inputs (T5's)
  // Replacements set on each leaf's container's class, a layer's leaves
  // included (T5's T5Attention and T5Dense*: its stacks' blocks share a
  // class but not their sublayers), instead of on the layer's class.
  bool anchor_at_container = false;
};

// The family's module tree from its layer table (PlanLeaves(config)), in
// the table's order: the leaves before the first layer's, the layers (each
// with every leaf under "<layers>.*"), then the rest. Norms take
// config.norm_eps. INVALID_ARGUMENT from PlanLeaves; INTERNAL for a table
// entry the family does not place (a container it does not declare, a kind
// without a module).
absl::StatusOr<std::unique_ptr<Module>> BuildFromTable(const TableFamily& family, const ModelConfig& config);

// The policy's sub-module replacements for `shard`'s mode, from each leaf's
// role, by the class of the module they are set on (a leaf in a layer: the
// layer's; any other: its container's): 1D column/row-parallel linears
// (fused projections keep n_fused), a vocab-parallel token table, untied
// head and vocabulary bias, Norm1D with sequence parallelism (and the base
// model's forward replaced by the sequence-parallel one); 2D/2.5D and 3D
// their Linear, Embedding, norm, head and bias layers (a row-parallel
// linear is the second of its 3D pair: swap); projections replicated in 1D;
// whole leaves native. INTERNAL for a role the mode has no layer for.
absl::StatusOr<std::map<std::string, ModulePolicyDescription>> TablePolicy(const TableFamily& family,
                                                                           const ModelConfig& config,
                                                                           const ShardConfig& shard);

// The base model's forward: the embeddings (token, plus positions where the
// family has them) on the first stage, split along the sequence over tp
// with `sequence_parallel`; the stage's layers; the final norm on the last.
Module::ForwardFn DecoderModelForward(const TableFamily& family, bool sequence_parallel, PipelineStage stage = {});
// The root's: the base model (through the containers above it), then the
// head on the last stage.
Module::ForwardFn DecoderLmForward(const TableFamily& family, PipelineStage stage = {});

// A pipeline stage's part of the model (ModelFamily::split_stage), from
// where the tree's modules are around the first layer list (the table's
// order): the stage's layers; what comes before the layers (the
// embeddings) on the first stage; what comes after them (the final norm,
// the heads) on the last, which keeps the table a tied head computes with
// (a mirror of the first stage's). The base model's forward becomes the
// stage's (model_forward), and the root's calls only the base model on a
// stage before the last. Returns the tied tables on the stages that hold
// them, the first and the last (TiedTable::stages {0, count - 1}).
absl::StatusOr<std::vector<TiedTable>> SplitTableStage(const TableFamily& family, Module& root,
                                                       const PipelineStage& stage);

// Drops the child `name` of `parent` (at `at` under the root) with its
// subtree, except the modules at `keep` (paths under the root) and the
// containers on the way to them.
void DropExcept(Module& parent, const std::string& at, const std::string& name, const std::vector<std::string>& keep);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_TABLE_FAMILY_H_
