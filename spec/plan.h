// A dry run of a job: what each rank holds (parameters, gradients,
// optimizer state, activations) and what each step moves over each process
// group, from the model's leaves (the families' layers, and how each layout
// splits them) and the collectives' formulas. No tensor is made and no rank
// starts, so the coordinator, `coloctl plan` and a worker's admission check
// all call it; light enough for the coordinator (config.json and the mesh
// only).
//
// What the plan counts is what a run reports: parameter, gradient and
// optimizer bytes as `colod_tensor_bytes` (and the trainer's StepStats), and
// each collective's payload as InstrumentedCommunicator counts it (all-reduce
// and all-gather: the rank's input; reduce-scatter: the whole input). The
// trainer test holds the two together. Wire bytes are what a rank sends
// under the ring algorithms Gloo and NCCL use: 2(p-1)/p n for an all-reduce
// of n bytes, (p-1)/p n for a reduce-scatter of n, (p-1) n for an
// all-gather of n from each rank.
//
// Thread-safety: functions of their arguments.
#ifndef COLOD_SPEC_PLAN_H_
#define COLOD_SPEC_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "colod/v1/job.pb.h"
#include "colod/v1/worker.pb.h"
#include "spec/model_config.h"

namespace colod {

// What a leaf of a model is to the planner: how its parameters split and
// which collectives it makes in each mode. The roles follow the policies
// (worker/shardformer/<family>.cc): a role names the layer a policy puts
// there in 1D and in 2D/2.5D.
enum class LeafRole {
  kWhole,        // native everywhere: replicated (ViT's patches, a classifier)
  kNorm,         // a norm (gamma, and beta with `bias`): whole in 1D (Norm1D), /q in 2D (Norm2D)
  kColumn,       // Linear1D_Col / Linear2D: [in -> out] split by out in 1D
  kRow,          // Linear1D_Row / Linear2D: split by in in 1D; its bias whole in 1D
  kVocabTable,   // VocabParallelEmbedding1D / Embedding2D: [rows = vocab, out = dim]
  kVocabHead,    // an untied LM head: VocabParallelLMHead1D / LMHead2D, [rows = vocab, in = dim]
  kVocabBias,    // VocabParallelBias1D, Bias3D (replicated): [rows = vocab]
  kPositions,    // a position (or token type) table: native in 1D, Embedding2D/3D in 2D/3D
  kProjection,   // native in 1D, Linear2D/3D in 2D/3D (OPT's project_in/out, BERT's MLM transform)
  kTiedHead,     // an LM head tied to a kVocabTable: holds nothing, computes [in = dim -> out = vocab]
};

// Which module a leaf is (a family that builds its tree from its leaves,
// worker/shardformer/table_family.h, makes that module; kOther: the
// family builds it by hand).
enum class LeafKind {
  kOther,
  kLinear,
  kConv1D,
  kEmbedding,
  kLayerNorm,
  kRmsNorm,
  kBias,            // a vector added to the last dim, named by its owner (BERT's cls.predictions)
  kParameter,       // a bare tensor of `shape` (ViT's cls_token)
  kPatchEmbedding,  // a Conv2d over patches, weight `shape` [out, channels, patch, patch] and a bias
};

// One entry of a family's layer table: its one declaration of a layer, which
// the planner counts and, for the families built from it, Build makes and
// the policy replaces.
struct PlanLeaf {
  // The leaves it stands for, by path under the base model ("h.*.attn.c_attn":
  // "*" is each layer), or under the root (`on_root`: an LM head).
  std::string name;
  LeafRole role = LeafRole::kWhole;
  int64_t count = 1;    // how many such leaves the model has (layers)
  int64_t in = 0, out = 0;  // a matrix's features; a table's rows (in) and dim (out); a vector's size (out)
  bool bias = false;    // a matrix's bias / a LayerNorm's beta
  int64_t elements_each = 0;  // kWhole: the leaf's elements (its shape's product)
  int64_t lookups = 1;        // kVocabTable: lookups per forward (T5's encoder and decoder: 2)
  int64_t fused = 1;          // kColumn: projections fused in one leaf (GPT-2's q|k|v: 3)
  LeafKind kind = LeafKind::kOther;
  bool on_root = false;       // a child of the root module, not of the base model
  std::string tied_to;        // kTiedHead: the table's path under the base model
  // kNorm: under sequence parallelism its input is split along the
  // sequence (Norm1D); false for a norm of the embeddings before the split
  // (BLOOM's word_embeddings_layernorm), which stays native.
  bool sequence_split = true;
  std::vector<int64_t> shape;  // kParameter's and kPatchEmbedding's weight's
};

// The model's leaves as its family builds them, in its tree's order (a
// single stack's: the leaves before its layers', the layers', the rest;
// pipeline stages split there). A tied head is a leaf of role kTiedHead,
// which holds nothing. INVALID_ARGUMENT for a model_type without a table, or a
// count that overflows.
absl::StatusOr<std::vector<PlanLeaf>> PlanLeaves(const ModelConfig& config);
// The parameters of `leaf` (all `count` of them), unsplit: ParameterCount
// is their sum over PlanLeaves.
absl::StatusOr<int64_t> LeafElements(const PlanLeaf& leaf);

// The parameters on the rank of `layout` holding the most: each leaf split
// as its policy's layer splits it (the 1D vocabulary padded). Does not
// check that the layout fits the model (CheckShardable does);
// INVALID_ARGUMENT for a mesh that cannot be built, or on overflow.
absl::StatusOr<int64_t> RankParameters(const ModelConfig& config, const v1::ShardConfig& layout);

// One collective of a step, summed over its calls.
struct PlanComm {
  std::string group;  // the mesh axis: "tp", "dp", "tp_row", ...
  std::string op;     // "all_reduce", "all_gather", "reduce_scatter", "broadcast"
  int64_t calls = 0;
  int64_t bytes = 0;       // the payload as InstrumentedCommunicator counts it, on one rank
  int64_t wire_bytes = 0;  // what one rank sends (ring algorithms)
};

struct JobPlan {
  int64_t parameters = 0;       // the whole model's (ParameterCount)
  int64_t rank_parameters = 0;  // on the rank holding the most (every rank, for the layouts colod has)
  // Per rank.
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
  // What the autograd tape keeps through a micro-batch's forward for its
  // backward (TRAIN), or one block's working set (FORWARD): an estimate
  // from the layers' inputs and the attention probabilities.
  int64_t activation_bytes = 0;
  int64_t total_bytes = 0;
  // Per step (TRAIN: every micro-batch, the gradient sync and the
  // reductions of the loss and the norm), or per forward.
  std::vector<PlanComm> comm;
  int64_t wire_bytes = 0;  // the sum over `comm`
  // The tokens of one rank's micro-batch the plan assumed, and its inputs.
  int64_t batch_size = 0, seq_len = 0, micro_batches = 1;
  // Passes of batch_size sequences an optimizer step accumulates (TRAIN).
  int64_t grad_accum = 1;
  // What the plan leaves out or approximates, in words.
  std::vector<std::string> notes;
  // With pipeline stages, the stage whose rank the plan describes: the
  // fullest (the others hold less); -1 without stages.
  int pipeline_stage = -1;
  // The idle share of a 1F1B step with P stages and M micro-batches of
  // equal stages: (P - 1) / (M + P - 1); 0 without stages.
  double bubble_fraction = 0;
};

// The plan of `spec` (TRAIN or FORWARD) for `config`: INVALID_ARGUMENT
// when the layout cannot shard the model (CheckShardable), for sizes that
// do not divide (the batch over dp and the micro-batches), or on overflow.
// A TRAIN spec's batch_size, seq_len (default 8 and 64, as the trainer's),
// micro_batches, grad_accum, precision and optimizer are read; a FORWARD spec plans one
// sequence of max positions per replica unless its train section gives a
// batch and a length. TENSOR jobs plan to zero.
// Where the ranks compute, which decides what the attention keeps for its
// backward: the CPU's per-head GEMMs keep f32 heads-first q, k, v and the
// [S, S] probabilities; the fused CUDA kernel keeps its operands (a copy
// only of strided ones), its output and each query row's log-sum-exp.
enum class PlanDevice { kCpu, kCuda };
// The largest head dim the fused CUDA attention takes (kernels::
// kMaxFusedHeadDim, which plan_test holds it to); larger ones run per head.
inline constexpr int64_t kPlanMaxFusedHeadDim = 256;
absl::StatusOr<JobPlan> PlanJob(const ModelConfig& config, const v1::JobSpec& spec,
                                PlanDevice device = PlanDevice::kCpu);

// Every layout of `world` ranks (tp x pp x dp = world, in each mode whose
// mesh fits: 1d, 2d (tp = q^2), 2.5d (tp = depth q^2, depth 2 and up), 3d
// (tp = q^3); pipeline stages of equal layer counts for a TRAIN spec of a
// family that has them) that the model's policy accepts, with its plan,
// ordered by wire bytes per step (then by memory): the `spec`'s shard
// section is replaced for each, its micro-batches kept (each plan states its
// bubble). Layouts whose plan exceeds `memory_per_rank` (> 0) are left out;
// the reason each other layout was left out is in `refused`.
struct RankedLayout {
  v1::ShardConfig shard;
  JobPlan plan;
};
struct LayoutSearch {
  std::vector<RankedLayout> fits;
  std::vector<std::string> refused;  // "tp8 x dp1 1d: tensor_parallel_size 8 must divide the 12 attention heads ..."
};
absl::StatusOr<LayoutSearch> RankLayouts(const ModelConfig& config, const v1::JobSpec& spec, int world,
                                         int64_t memory_per_rank, PlanDevice device = PlanDevice::kCpu);

// Model FLOPs of training on one token (on one image for ViT), PaLM's MFU
// convention: 6 N + 12 L S H per token, N the parameters of every matrix
// multiply a token goes through (each layer's linears with their biases,
// OPT's and BERT's projections, the LM head, a tied head counted as the
// head; not the embedding lookups or the norms), L the layers, S = seq_len
// and H the attention's width (heads x head dim). No credit for
// recomputation; causal attention counted whole. ViT: S is its patches and
// CLS token, and an image counts the patches' convolution on each patch,
// S tokens' layers and the classifier once. UNIMPLEMENTED for T5 (its
// tokens are the encoder's and the decoder's, of other lengths);
// INVALID_ARGUMENT for a model_type without a table or seq_len < 1.
absl::StatusOr<double> TrainFlopsPerToken(const ModelConfig& config, int64_t seq_len);

// What RunSummary's MFU divides by: the sum of the devices' dense peaks for
// the dtype `spec`'s GEMMs run in (its precision; FP32 as TF32 with
// allow_tf32; unspecified: bf16 on CUDA, f32 on a CPU, as the trainer
// chooses). 0 when a device's peak is not known, not finite or not
// positive, or for no devices: no MFU rather than a wrong one.
double PeakFlopsOf(const v1::JobSpec& spec, const std::vector<v1::WorkerInfo>& devices);
// The same at `precision` in place of the spec's (a run at auto that
// resumed a checkpoint of another precision trains at that one's).
double PeakFlopsOf(v1::Precision precision, bool allow_tf32, const std::vector<v1::WorkerInfo>& devices);

// "tp2 x dp2 1d", "tp8 x dp1 2.5d depth 2", "tp1 x pp2v2 x dp1 1d" (2 model
// chunks a pipeline rank), with " sp" for sequence
// parallelism: how coloctl and the plan's refusals name a layout.
std::string LayoutName(const v1::ShardConfig& shard);

}  // namespace colod

#endif  // COLOD_SPEC_PLAN_H_
