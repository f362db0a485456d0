// The two index files that name where sharded weights lie, parsed and
// checked before any file they name is opened or any tensor they describe
// is allocated:
//   colod_checkpoint.json          a colod sharded checkpoint (checkpoint.h):
//                                  per parameter its global shape, its
//                                  Hugging Face binding and its blocks
//   model.safetensors.index.json   a Hugging Face model split over several
//                                  files: its weight_map, tensor -> file
// Both may come from a user (a model directory, a checkpoint to resume or
// consolidate), so every size in them is overflow-checked and every file
// they name must be a plain name in the same directory (IsPlainFileName):
// an index cannot make a worker read outside the directory it was given.
//
// Thread-safety: value types and free functions.
#ifndef COLOD_WORKER_SHARDFORMER_CHECKPOINT_INDEX_H_
#define COLOD_WORKER_SHARDFORMER_CHECKPOINT_INDEX_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/shardformer/hf_binding.h"
#include "worker/tensor/tensor.h"

namespace colod::shardformer {

inline constexpr char kCheckpointIndex[] = "colod_checkpoint.json";
inline constexpr char kCheckpointFormat[] = "colod-sharded-checkpoint/1";
inline constexpr char kWeightMapIndex[] = "model.safetensors.index.json";

// One block of a parameter: [starts, starts + lengths) of its global shape,
// stored in `file` under the parameter's name.
struct CheckpointBlock {
  std::string file;
  std::vector<int64_t> starts, lengths;
};

struct CheckpointTensor {
  Shape global_shape;
  std::string dtype;      // the safetensors dtype it was written in ("F32")
  std::string dist_spec;  // informational (DistSpec::ToString)
  HfTensor hf;
  std::vector<CheckpointBlock> blocks;
};

struct CheckpointIndex {
  int world_size = 0;
  // The mesh it was written at, its axes (name, size) in order; empty in an
  // index from before the field (2026-11).
  std::vector<std::pair<std::string, int>> mesh;
  std::string model_type;
  std::map<std::string, CheckpointTensor> tensors;  // by parameter name
};

// Parses colod_checkpoint.json. INVALID_ARGUMENT, prefixed with `where`,
// unless: the format is kCheckpointFormat; world_size is in [1, kMaxWorldSize];
// the mesh, where there is one, is at most kernels::kMaxDims axes of a
// plain name and a size of at least 1 whose product is world_size;
// every shape has at most kernels::kMaxDims non-negative dims whose bytes
// fit int64; every block has one start and length per dim, lies inside the
// global shape and names a plain file; the blocks of a parameter hold as
// many elements as it has; and the Hugging Face binding is well formed
// (a name, a narrow_dim of its shape or -1, non-negative offsets).
absl::StatusOr<CheckpointIndex> ParseCheckpointIndex(absl::string_view text, absl::string_view where);

// Reads and parses DIR/colod_checkpoint.json; NOT_FOUND when it is absent.
absl::StatusOr<CheckpointIndex> ReadCheckpointIndex(const std::string& dir);

// Parses a model.safetensors.index.json: its weight_map, tensor name ->
// shard file (a plain name). INVALID_ARGUMENT, prefixed with `where`, for
// anything else.
absl::StatusOr<std::map<std::string, std::string>> ParseWeightMap(absl::string_view text, absl::string_view where);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_CHECKPOINT_INDEX_H_
