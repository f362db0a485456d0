// Device meshes and process-group layout (ColossalAI's ProcessGroup and the
// legacy 2D / 2.5D / 3D tensor-parallel sub-meshes).
//
// A mesh is a list of named axes, outermost first; a rank's coordinates are
// its mixed-radix digits with the innermost axis varying fastest, so ranks
// adjacent in number share the innermost groups (and usually a host). With
// axes {dp, tp} this is exactly ColossalAI's ProcessGroup(tp_degree,
// dp_degree): tp group i = ranks [i*tp, ..., i*tp + tp - 1], dp group j =
// ranks {j, j + tp, j + 2tp, ...}, tp_local_rank = rank % tp and
// dp_local_rank = rank / tp. Example tp=4, dp=2: tp0 = {0,1,2,3}, dp1 = {1,5}.
//
// The tensor-parallel sub-axes follow ColossalAI's legacy conventions; the tp
// local rank (rank % tp) decomposes as
//   2D   (tp = q*q):     local = col*q + row                 axes tp_col, tp_row
//   2.5D (tp = d*q*q):   local = row + q*col + q*q*dep       axes tp_dep, tp_col, tp_row
//   3D   (tp = q*q*q):   local = weight + q*input + q*q*output
//                                                            axes tp_output, tp_input, tp_weight
// A group "along tp_row" holds the ranks that differ only in their row
// coordinate: for 2D these are q consecutive ranks, ColossalAI's
// PARALLEL_2D_ROW group; "along tp_col" is PARALLEL_2D_COL.
#ifndef COLOD_SPEC_MESH_H_
#define COLOD_SPEC_MESH_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "colod/v1/job.pb.h"
#include "colod/v1/mesh.pb.h"

namespace colod {

struct MeshAxis {
  std::string name;
  int size = 1;
  bool operator==(const MeshAxis& o) const { return name == o.name && size == o.size; }
};

// Immutable after Create; thread-safe for concurrent reads.
class DeviceMesh {
 public:
  // INVALID_ARGUMENT for no axes, a size < 1, an empty or repeated name.
  static absl::StatusOr<DeviceMesh> Create(std::vector<MeshAxis> axes);

  // The mesh of a ShardConfig: axes {dp, tp} for 1D, with tp replaced by its
  // sub-axes for 2D, 2.5D and 3D (see the file comment), and {dp, pp, tp..}
  // with pipeline stages (pipeline_parallel_size > 1): a stage's tp group is
  // tp consecutive ranks and neighbouring stages are tp apart.
  // INVALID_ARGUMENT, with the numbers, when the degrees do not fit the mode.
  static absl::StatusOr<DeviceMesh> FromShardConfig(const v1::ShardConfig& shard);
  // The mesh a MeshSpec describes (what a worker is sent): its axes and
  // tensor-parallel mode. INVALID_ARGUMENT, naming the field, for axes Create
  // refuses, a world_size that is not their product, or groups other than
  // the axes' own (ToProto's).
  static absl::StatusOr<DeviceMesh> FromProto(const v1::MeshSpec& spec);

  const std::vector<MeshAxis>& axes() const { return axes_; }
  int world_size() const { return world_size_; }
  // Size of an axis, or the product of the tp sub-axes for "tp"; NOT_FOUND
  // for an unknown axis.
  absl::StatusOr<int> AxisSize(absl::string_view axis) const;

  // Coordinates of `rank`, one per axis, outermost first.
  std::vector<int> Coordinates(int rank) const;
  int RankAt(const std::vector<int>& coordinates) const;

  // The groups along `axis`: each holds the ranks that differ only in that
  // axis' coordinate, ordered by it (the local rank). Groups are ordered by
  // their smallest rank. "tp" on a mesh with sub-axes means all of them
  // together (the whole tensor-parallel group). NOT_FOUND for an unknown axis.
  absl::StatusOr<std::vector<std::vector<int>>> Groups(absl::string_view axis) const;
  // The group along `axis` that contains `rank`, and the rank's index in it.
  absl::StatusOr<std::vector<int>> GroupOf(absl::string_view axis, int rank) const;
  absl::StatusOr<int> LocalRank(absl::string_view axis, int rank) const;

  // Axes and every group of every axis (plus "tp" where it is split), with
  // no rank assignments.
  v1::MeshSpec ToProto() const;

  // Indices into axes() that `axis` names (several for a split "tp"), in
  // increasing order; NOT_FOUND for an unknown axis.
  absl::StatusOr<std::vector<int>> AxisIndices(absl::string_view axis) const;

 private:
  explicit DeviceMesh(std::vector<MeshAxis> axes);
  absl::StatusOr<std::vector<std::vector<int>>> GroupsOver(const std::vector<int>& dims) const;

  std::vector<MeshAxis> axes_;
  int world_size_ = 1;
  v1::TensorParallelMode mode_ = v1::TENSOR_PARALLEL_MODE_UNSPECIFIED;
};

}  // namespace colod

#endif  // COLOD_SPEC_MESH_H_
