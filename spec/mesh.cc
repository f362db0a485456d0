#include "spec/mesh.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/int_math.h"
#include "common/status_macros.h"

namespace colod {
namespace {

constexpr int kMaxWorldSize = 1 << 20;


bool IsTpSubAxis(const std::string& name) { return name.rfind("tp_", 0) == 0; }

}  // namespace

DeviceMesh::DeviceMesh(std::vector<MeshAxis> axes) : axes_(std::move(axes)) {
  for (const MeshAxis& a : axes_) world_size_ *= a.size;
}

absl::StatusOr<DeviceMesh> DeviceMesh::Create(std::vector<MeshAxis> axes) {
  if (axes.empty()) return absl::InvalidArgumentError("mesh: at least one axis is required");
  std::set<std::string> names;
  long long world = 1;
  for (const MeshAxis& a : axes) {
    if (a.name.empty()) return absl::InvalidArgumentError("mesh: an axis has no name");
    if (!names.insert(a.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("mesh: axis '", a.name, "' appears twice"));
    }
    if (a.size < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh: axis '", a.name, "' has size ", a.size, "; it must be >= 1"));
    }
    world *= a.size;
    if (world > kMaxWorldSize) {
      return absl::InvalidArgumentError(absl::StrCat("mesh: more than ", kMaxWorldSize, " ranks"));
    }
  }
  if (names.count("tp") && std::any_of(axes.begin(), axes.end(),
                                       [](const MeshAxis& a) { return IsTpSubAxis(a.name); })) {
    return absl::InvalidArgumentError("mesh: 'tp' and tp_* sub-axes cannot both be axes");
  }
  return DeviceMesh(std::move(axes));
}

absl::StatusOr<DeviceMesh> DeviceMesh::FromShardConfig(const v1::ShardConfig& shard) {
  const int tp = shard.tensor_parallel_size();
  const int dp = shard.data_parallel_size();
  if (tp < 1 || dp < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor_parallel_size (", tp, ") and data_parallel_size (", dp, ") must be >= 1"));
  }
  const int pp = shard.pipeline_parallel_size();
  if (pp < 0) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline_parallel_size must be >= 0, got ", pp));
  }
  std::vector<MeshAxis> axes = {{"dp", dp}};
  if (pp > 1) axes.push_back({"pp", pp});
  switch (shard.tensor_parallel_mode()) {
    case v1::TENSOR_PARALLEL_MODE_UNSPECIFIED:
    case v1::TENSOR_PARALLEL_MODE_1D:
      axes.push_back({"tp", tp});
      break;
    case v1::TENSOR_PARALLEL_MODE_2D: {
      const int q = IntegerRoot(tp, 2);
      if (q == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("2d tensor parallelism needs tp = q*q; tp = ", tp, " is not a square"));
      }
      axes.push_back({"tp_col", q});
      axes.push_back({"tp_row", q});
      break;
    }
    case v1::TENSOR_PARALLEL_MODE_2P5D: {
      const int d = shard.depth();
      const int q = (d >= 1 && tp % d == 0) ? IntegerRoot(tp / d, 2) : 0;
      if (q == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "2.5d tensor parallelism needs tp = depth*q*q; tp = ", tp, ", depth = ", d, " do not fit"));
      }
      axes.push_back({"tp_dep", d});
      axes.push_back({"tp_col", q});
      axes.push_back({"tp_row", q});
      break;
    }
    case v1::TENSOR_PARALLEL_MODE_3D: {
      const int q = IntegerRoot(tp, 3);
      if (q == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("3d tensor parallelism needs tp = q*q*q; tp = ", tp, " is not a cube"));
      }
      axes.push_back({"tp_output", q});
      axes.push_back({"tp_input", q});
      axes.push_back({"tp_weight", q});
      break;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown tensor_parallel_mode ", shard.tensor_parallel_mode()));
  }
  ASSIGN_OR_RETURN(DeviceMesh mesh, Create(std::move(axes)));
  mesh.mode_ = shard.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_UNSPECIFIED
                   ? v1::TENSOR_PARALLEL_MODE_1D
                   : shard.tensor_parallel_mode();
  return mesh;
}

absl::StatusOr<std::vector<int>> DeviceMesh::AxisIndices(absl::string_view axis) const {
  std::vector<int> dims;
  for (int i = 0; i < static_cast<int>(axes_.size()); ++i) {
    if (axes_[i].name == axis || (axis == "tp" && IsTpSubAxis(axes_[i].name))) dims.push_back(i);
  }
  if (dims.empty()) {
    std::vector<std::string> names;
    for (const MeshAxis& a : axes_) names.push_back(a.name);
    return absl::NotFoundError(absl::StrCat("mesh has no axis '", axis, "' (axes: ",
                                            absl::StrJoin(names, ", "), ")"));
  }
  return dims;
}

absl::StatusOr<int> DeviceMesh::AxisSize(absl::string_view axis) const {
  ASSIGN_OR_RETURN(std::vector<int> dims, AxisIndices(axis));
  int size = 1;
  for (int d : dims) size *= axes_[d].size;
  return size;
}

std::vector<int> DeviceMesh::Coordinates(int rank) const {
  std::vector<int> coords(axes_.size());
  for (int i = static_cast<int>(axes_.size()) - 1; i >= 0; --i) {
    coords[i] = rank % axes_[i].size;
    rank /= axes_[i].size;
  }
  return coords;
}

int DeviceMesh::RankAt(const std::vector<int>& coordinates) const {
  int rank = 0;
  for (size_t i = 0; i < axes_.size(); ++i) rank = rank * axes_[i].size + coordinates[i];
  return rank;
}

absl::StatusOr<std::vector<std::vector<int>>> DeviceMesh::GroupsOver(const std::vector<int>& dims) const {
  // Key every rank by its coordinates outside `dims`; within a group, order by
  // the coordinates inside `dims` (outermost first), i.e. by rank.
  std::map<std::vector<int>, std::vector<int>> groups;
  for (int r = 0; r < world_size_; ++r) {
    std::vector<int> c = Coordinates(r);
    for (int d : dims) c[d] = -1;
    groups[c].push_back(r);
  }
  std::vector<std::vector<int>> out;
  for (auto& [key, ranks] : groups) out.push_back(std::move(ranks));
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<std::vector<std::vector<int>>> DeviceMesh::Groups(absl::string_view axis) const {
  ASSIGN_OR_RETURN(std::vector<int> dims, AxisIndices(axis));
  return GroupsOver(dims);
}

absl::StatusOr<std::vector<int>> DeviceMesh::GroupOf(absl::string_view axis, int rank) const {
  if (rank < 0 || rank >= world_size_) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is outside [0, ", world_size_, ")"));
  }
  ASSIGN_OR_RETURN(auto groups, Groups(axis));
  for (auto& g : groups) {
    if (std::find(g.begin(), g.end(), rank) != g.end()) return g;
  }
  return absl::InternalError("rank in no group");
}

absl::StatusOr<int> DeviceMesh::LocalRank(absl::string_view axis, int rank) const {
  ASSIGN_OR_RETURN(std::vector<int> group, GroupOf(axis, rank));
  return static_cast<int>(std::find(group.begin(), group.end(), rank) - group.begin());
}

absl::StatusOr<DeviceMesh> DeviceMesh::FromProto(const v1::MeshSpec& spec) {
  std::vector<MeshAxis> axes;
  for (const v1::MeshAxis& a : spec.axes()) axes.push_back({a.name(), a.size()});
  absl::StatusOr<DeviceMesh> mesh = Create(std::move(axes));
  if (!mesh.ok()) return absl::InvalidArgumentError(absl::StrCat("mesh.axes: ", mesh.status().message()));
  mesh->mode_ = spec.tensor_parallel_mode();
  if (spec.world_size() != mesh->world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("mesh.world_size: ", spec.world_size(), " is not the axes' ",
                                                   mesh->world_size(), " ranks"));
  }
  const v1::MeshSpec own = mesh->ToProto();
  bool same = spec.groups_size() == own.groups_size();
  for (int i = 0; same && i < own.groups_size(); ++i) {
    same = spec.groups(i).SerializeAsString() == own.groups(i).SerializeAsString();
  }
  if (!same) return absl::InvalidArgumentError("mesh.groups: not the groups of mesh.axes");
  return mesh;
}

v1::MeshSpec DeviceMesh::ToProto() const {
  v1::MeshSpec spec;
  spec.set_world_size(world_size_);
  spec.set_tensor_parallel_mode(mode_);
  std::vector<std::string> names;
  for (const MeshAxis& a : axes_) {
    v1::MeshAxis* pa = spec.add_axes();
    pa->set_name(a.name);
    pa->set_size(a.size);
    names.push_back(a.name);
  }
  if (std::any_of(axes_.begin(), axes_.end(), [](const MeshAxis& a) { return IsTpSubAxis(a.name); })) {
    names.push_back("tp");
  }
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    auto groups = Groups(name);
    for (size_t i = 0; i < groups->size(); ++i) {
      v1::ProcessGroupSpec* g = spec.add_groups();
      g->set_axis(name);
      g->set_index(static_cast<int>(i));
      for (int r : (*groups)[i]) g->add_ranks(r);
    }
  }
  return spec;
}

}  // namespace colod
