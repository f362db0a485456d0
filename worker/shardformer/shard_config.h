// ShardFormer's ShardConfig: how a model is laid out over the ranks (the
// tp/dp sizes, the tensor-parallel mode and depth, sequence_parallel and
// gather_output, as in the proto), the vocabulary padding, the dtype the
// parameters are held in and the device they live on.
//
// Thread-safety: a plain value; copies are independent.
#ifndef COLOD_WORKER_SHARDFORMER_SHARD_CONFIG_H_
#define COLOD_WORKER_SHARDFORMER_SHARD_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "colod/v1/job.pb.h"
#include "worker/tensor/device.h"
#include "worker/tensor/dtype.h"

namespace colod::shardformer {

// This rank's pipeline stage: which of the model's layers it holds, and
// whether it embeds the tokens (the first stage) and computes the logits
// (the last). Without pipeline parallelism, the one stage of every layer.
struct PipelineStage {
  int index = 0;
  int count = 1;
  int64_t begin = 0, end = 0;  // the layers [begin, end)
  // Every stage's layer count (spec's PipelineStageLayers), so a stage knows
  // which others hold what it shares with them; empty without stages.
  std::vector<int64_t> layers;
  bool first() const { return index == 0; }
  bool last() const { return index == count - 1; }
};

// Activation recomputation (Megatron-LM's --recompute-granularity): kFull
// keeps only each transformer block's input through the forward and runs the
// block again in the backward; kSelective keeps the blocks' activations but
// not attention's [S, S] probabilities, which the backward recomputes from
// the queries and keys it keeps (on CUDA the fused attention never keeps
// them: the same as kNone there). Losses and gradients are unchanged.
enum class Recompute { kNone, kFull, kSelective };
// "none", "full" or "selective"; INVALID_ARGUMENT otherwise.
absl::StatusOr<Recompute> ParseRecompute(const std::string& name);
const char* RecomputeName(Recompute r);

struct ShardConfig {
  v1::ShardConfig layout;
  int64_t make_vocab_size_divisible_by = 64;
  // The dtype parameters are held and computed in: f32, or bf16 / f16 for
  // mixed precision (the optimizer then keeps f32 master weights).
  DType param_dtype = DType::kF32;
  // Where this rank's parameters and activations live (a CUDA device runs
  // over NCCL process groups).
  Device device = Device::Cpu();

  Recompute recompute = Recompute::kNone;

  // Interleaved 1F1B (layout.virtual_stages, V): this model is chunk
  // `chunk` of the V this rank holds, and ShardFormer::Load makes it virtual
  // stage chunk * pp + (this rank's pp coordinate) of the pp * V the layers
  // are cut into (spec's PipelineStageLayers).
  int chunk = 0;

  // Set by ShardFormer::Load from the layout and this rank's pp coordinate
  // (and chunk): under virtual stages, index and count are the virtual
  // stage's.
  PipelineStage stage;

  int tp() const { return layout.tensor_parallel_size() < 1 ? 1 : layout.tensor_parallel_size(); }
  int pp() const { return layout.pipeline_parallel_size() < 1 ? 1 : layout.pipeline_parallel_size(); }
  // The model chunks a pipeline rank holds (1 without interleaving).
  int virtual_stages() const { return layout.virtual_stages() < 1 ? 1 : layout.virtual_stages(); }
  bool is_2d() const;  // 2D or 2.5D
  bool is_3d() const;
  // How many ways attention heads split: tp in 1D, q in 2D, 2.5D and 3D.
  int head_split() const;
  bool sequence_parallel() const { return layout.sequence_parallel(); }
};

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_SHARD_CONFIG_H_
