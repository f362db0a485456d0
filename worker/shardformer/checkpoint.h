// Sharded checkpoints of a ShardedModel, and their consolidation into a
// Hugging Face directory that loads at any other layout.
//
// A sharded checkpoint directory holds
//   config.json                        the model's config.json
//   rank-00000-of-00004.safetensors    the parameter blocks rank 0 owns, in the
//                                      layers' layouts, named like
//                                      ShardedModel::Parameters()
//   colod_checkpoint.json              the index: the layout (mesh axes, shard
//                                      config) and, per parameter, its global
//                                      shape, dtype, dist spec, the checkpoint
//                                      tensor it maps to (HfTensor) and where
//                                      each of its blocks is
// A parameter replicated over some axes is written once, by the rank at
// coordinate 0 on each of them. With pipeline stages each stage writes its
// own parameters (the last stage's mirror of a tied table is the first
// stage's to write) and its first rank its part of the index, which rank 0
// joins (index-stage-NNNNN.json, removed once joined). The index is written last and atomically
// (as is every file), after every rank's file: a directory with an index is
// complete.
//
// Thread-safety: free functions; SaveShardedCheckpoint is collective.
#ifndef COLOD_WORKER_SHARDFORMER_CHECKPOINT_H_
#define COLOD_WORKER_SHARDFORMER_CHECKPOINT_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/shardformer/checkpoint_index.h"
#include "worker/shardformer/safetensors.h"
#include "worker/shardformer/shardformer.h"

namespace colod::shardformer {

// A file of a colod checkpoint (a rank's parameters or optimizer state),
// opened: SafetensorsFile::Open's errors, and INVALID_ARGUMENT where it
// holds a tensor of a dtype colod never writes (SafetensorsFile::unreadable:
// a damaged header), so that such a checkpoint is damaged as a whole, passed
// over for an older one, not found out at its first read.
absl::StatusOr<std::unique_ptr<SafetensorsFile>> OpenCheckpointFile(const std::string& path);
// The rank files of one checkpoint directory, each opened
// (OpenCheckpointFile) once, on first use. Thread-compatible.
class CheckpointFiles {
 public:
  explicit CheckpointFiles(std::string dir) : dir_(std::move(dir)) {}
  // DIR/`name`, opened now or before; OpenCheckpointFile's errors.
  absl::StatusOr<SafetensorsFile*> Get(const std::string& name);
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

// Every rank of the model calls it with the same `dir` (created if needed,
// on a file system all ranks share).
absl::Status SaveShardedCheckpoint(ShardedModel& model, const std::string& dir);
// The same of every model chunk a rank holds (interleaved 1F1B's virtual
// stages: ShardFormer::LoadChunks), chunk 0 first: one rank file of all of
// them, the index of every virtual stage.
absl::Status SaveShardedCheckpoint(const std::vector<ShardedModel*>& chunks, const std::string& dir);

// Values written in place of the parameters' own (the f32 master weights of
// a mixed-precision run, for its final model). `of` is called for each
// parameter the chunks hold (not mirrors), in the chunks' order (the same
// on every rank of a pipeline stage, which holds the same parameters),
// whether or not this rank writes it (`owns`), so that it may be collective
// within a stage; where `owns`, what it returns (the parameter's local
// shape, in `dtype`) is written, and the index says `dtype`. Where it is
// collective it must fail alike on the ranks it spans (agreeing first):
// TakeRankParts stops calling it at its first error.
struct PartValues {
  DType dtype = DType::kF32;
  std::function<absl::StatusOr<Tensor>(const NamedParam& param, bool owns)> of;
};
// SaveShardedCheckpoint of `values` (nullptr: the parameters' own).
absl::Status SaveShardedCheckpoint(const std::vector<ShardedModel*>& chunks, const std::string& dir,
                                   const PartValues* values);

// One rank's parts of the parameters it writes, copied to the host: what
// SaveShardedCheckpoint writes into the rank's file.
struct RankParts {
  std::vector<std::pair<std::string, Tensor>> tensors;
  // Every rank's parts are in it, where they are not the parameters' dtype
  // (PartValues).
  std::optional<DType> dtype;
};
// Takes them from the chunks (collective only as `values->of` is), or from
// `values` where given (then a part that fails here, not finite, say,
// fails the whole after every value was made). FAILED_PRECONDITION naming
// the first element that is not finite (an update that overflowed, its
// step's loss and gradients finite): such weights are never saved, since a
// restart would resume from them and retention would drop the good
// checkpoints. Only the ranks that write a parameter check it: the mesh
// agrees on every rank's outcome (AgreeOverMesh) before any rank writes.
absl::StatusOr<RankParts> TakeRankParts(const std::vector<ShardedModel*>& chunks, const PartValues* values = nullptr);
// SaveShardedCheckpoint of parts TakeRankParts took from the same chunks,
// once every rank of the mesh agreed that every rank took its parts
// (AgreeOverMesh of TakeRankParts' status: a rank that returned on its
// error would leave its peers waiting in this one's agreements). Each
// step's writes end in an agreement: a rank that could not write fails with
// its own error, the others ABORTED marked IsPeerCaused.
absl::Status SaveShardedCheckpoint(const std::vector<ShardedModel*>& chunks, RankParts parts, const std::string& dir);

// A consolidated model's dtype by its name (spec's kModelDTypes: "" or
// "auto" is nullopt, each tensor in its parameters' own; "f32", "bf16",
// "f16"); INVALID_ARGUMENT for another.
absl::StatusOr<std::optional<DType>> ParseModelDType(const std::string& name);
// Whether a model is written in `dtype` (f32, bf16, f16).
bool IsModelDType(DType dtype);

// Assembles the sharded checkpoint in `dir` into `out_dir` (created if needed):
// config.json and one model.safetensors with every tensor under its Hugging
// Face name and shape, in `dtype`, or where that is nullopt in the dtype its
// parameters were saved in where they agree (a bf16 run's model is bf16), else
// F32; config.json's torch_dtype (and dtype, where it has one) names the dtype
// where every tensor has one, else float32. The model is made one tensor at a
// time as it is written (WriteSafetensorsStreamed): a few F32 copies of its
// largest tensor are held, not the model. A failure leaves nothing in
// `out_dir`, nor `out_dir` where it made it. Runs on one process, no ranks.
// NOT_FOUND for a directory without an index; INVALID_ARGUMENT naming the file
// or tensor for a damaged or incomplete checkpoint (an index
// ParseCheckpointIndex refuses, a missing rank file, a block whose shape does
// not match the index, blocks that do not cover a tensor). Every block's stored
// shape is checked before anything is allocated, so an index cannot make it
// allocate more than the rank files hold.
absl::Status ConsolidateCheckpoint(const std::string& dir, const std::string& out_dir,
                                   std::optional<DType> dtype = std::nullopt);
// Where a block's values come from in place of its rank file's (a training
// checkpoint's f32 master weights): the block of parameter `param` that
// `block` places, in its lengths' shape (any float dtype), or nullopt for
// the rank file's. Called once a block as its tensor is made.
using BlockSource =
    std::function<absl::StatusOr<std::optional<Tensor>>(const std::string& param, const CheckpointBlock& block)>;
// ConsolidateCheckpoint with the blocks from `source` where it gives them.
// The rank files are checked all the same (shapes, coverage), and auto's
// dtype is still theirs.
absl::Status ConsolidateCheckpoint(const std::string& dir, const std::string& out_dir, std::optional<DType> dtype,
                                   const BlockSource& source);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_CHECKPOINT_H_
