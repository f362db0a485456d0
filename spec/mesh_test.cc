#include "spec/mesh.h"

#include <map>
#include <set>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

using Groups = std::vector<std::vector<int>>;

v1::ShardConfig Shard(int tp, int dp, v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D,
                      int depth = 0) {
  v1::ShardConfig s;
  s.set_tensor_parallel_size(tp);
  s.set_data_parallel_size(dp);
  s.set_tensor_parallel_mode(mode);
  s.set_depth(depth);
  return s;
}

TEST(DeviceMesh, ColoTensorDocumentLayoutTp4Dp2) {
  auto mesh = DeviceMesh::FromShardConfig(Shard(4, 2));
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->world_size(), 8);
  EXPECT_EQ(*mesh->Groups("tp"), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(*mesh->Groups("dp"), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(*mesh->GroupOf("dp", 5), (std::vector<int>{1, 5}));  // "dp1 contains 1 and 5"
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(*mesh->LocalRank("tp", r), r % 4);
    EXPECT_EQ(*mesh->LocalRank("dp", r), r / 4);
  }
}

TEST(DeviceMesh, Tp2Dp4) {
  auto mesh = DeviceMesh::FromShardConfig(Shard(2, 4));
  ASSERT_TRUE(mesh.ok());
  EXPECT_EQ(*mesh->Groups("tp"), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(*mesh->Groups("dp"), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
}

TEST(DeviceMesh, TwoDimensionalSumma) {
  // q = 3, dp = 2: local = rank % 9, row = local % 3, col = local / 3.
  auto mesh = DeviceMesh::FromShardConfig(Shard(9, 2, v1::TENSOR_PARALLEL_MODE_2D));
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  for (int r = 0; r < 18; ++r) {
    const int local = r % 9;
    EXPECT_EQ(*mesh->LocalRank("tp_row", r), local % 3) << r;
    EXPECT_EQ(*mesh->LocalRank("tp_col", r), local / 3) << r;
    EXPECT_EQ(*mesh->LocalRank("tp", r), local) << r;
    EXPECT_EQ(*mesh->LocalRank("dp", r), r / 9) << r;
  }
  // ColossalAI's PARALLEL_2D_ROW groups are q consecutive ranks, COL groups stride q.
  auto q2 = DeviceMesh::FromShardConfig(Shard(4, 1, v1::TENSOR_PARALLEL_MODE_2D));
  EXPECT_EQ(*q2->Groups("tp_row"), (Groups{{0, 1}, {2, 3}}));
  EXPECT_EQ(*q2->Groups("tp_col"), (Groups{{0, 2}, {1, 3}}));
  EXPECT_EQ(*q2->Groups("tp"), (Groups{{0, 1, 2, 3}}));
}

TEST(DeviceMesh, TwoAndAHalfDimensionalTesseract) {
  // d = 2, q = 2: local = row + 2*col + 4*dep.
  auto mesh = DeviceMesh::FromShardConfig(Shard(8, 1, v1::TENSOR_PARALLEL_MODE_2P5D, 2));
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(*mesh->LocalRank("tp_row", r), r % 2);
    EXPECT_EQ(*mesh->LocalRank("tp_col", r), (r / 2) % 2);
    EXPECT_EQ(*mesh->LocalRank("tp_dep", r), r / 4);
  }
  EXPECT_EQ(*mesh->Groups("tp_dep"), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
}

TEST(DeviceMesh, ThreeDimensional) {
  // q = 2: local = weight + 2*input + 4*output.
  auto mesh = DeviceMesh::FromShardConfig(Shard(8, 2, v1::TENSOR_PARALLEL_MODE_3D));
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  for (int r = 0; r < 16; ++r) {
    const int local = r % 8;
    EXPECT_EQ(*mesh->LocalRank("tp_weight", r), local % 2);
    EXPECT_EQ(*mesh->LocalRank("tp_input", r), (local / 2) % 2);
    EXPECT_EQ(*mesh->LocalRank("tp_output", r), local / 4);
  }
  EXPECT_EQ(*mesh->GroupOf("tp_output", 9), (std::vector<int>{9, 13}));
}

TEST(DeviceMesh, GroupsPartitionTheRanksAlongEachAxis) {
  // Property check on an irregular mesh: every axis' groups partition the
  // ranks, have the axis' size, and members differ only in that coordinate.
  auto mesh = DeviceMesh::Create({{"dp", 3}, {"pp", 2}, {"tp", 5}});
  ASSERT_TRUE(mesh.ok());
  for (int a = 0; a < 3; ++a) {
    const std::string axis = mesh->axes()[a].name;
    auto groups = *mesh->Groups(axis);
    std::set<int> seen;
    for (const auto& g : groups) {
      ASSERT_EQ(static_cast<int>(g.size()), mesh->axes()[a].size);
      for (size_t i = 0; i < g.size(); ++i) {
        EXPECT_TRUE(seen.insert(g[i]).second);
        auto c0 = mesh->Coordinates(g[0]);
        auto ci = mesh->Coordinates(g[i]);
        EXPECT_EQ(ci[a], static_cast<int>(i));
        ci[a] = c0[a];
        EXPECT_EQ(ci, c0);
      }
    }
    EXPECT_EQ(static_cast<int>(seen.size()), 30);
  }
  for (int r = 0; r < 30; ++r) EXPECT_EQ(mesh->RankAt(mesh->Coordinates(r)), r);
}

TEST(DeviceMesh, BadDegreesNameTheNumbers) {
  auto two_d = DeviceMesh::FromShardConfig(Shard(8, 1, v1::TENSOR_PARALLEL_MODE_2D));
  EXPECT_EQ(two_d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(two_d.status().message().find("tp = 8"), absl::string_view::npos) << two_d.status();
  auto three_d = DeviceMesh::FromShardConfig(Shard(4, 1, v1::TENSOR_PARALLEL_MODE_3D));
  EXPECT_NE(three_d.status().message().find("tp = 4"), absl::string_view::npos);
  auto tess = DeviceMesh::FromShardConfig(Shard(8, 1, v1::TENSOR_PARALLEL_MODE_2P5D, 3));
  EXPECT_NE(tess.status().message().find("depth = 3"), absl::string_view::npos);
  EXPECT_FALSE(DeviceMesh::FromShardConfig(Shard(0, 1)).ok());
  EXPECT_FALSE(DeviceMesh::Create({{"tp", 2}, {"tp", 2}}).ok());
  EXPECT_FALSE(DeviceMesh::Create({{"tp", 0}}).ok());
  EXPECT_FALSE(DeviceMesh::Create({}).ok());
  auto mesh = DeviceMesh::FromShardConfig(Shard(2, 2));
  EXPECT_EQ(mesh->Groups("pp").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(mesh->GroupOf("tp", 4).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DeviceMesh, ProtoListsEveryGroupOfEveryAxis) {
  auto mesh = DeviceMesh::FromShardConfig(Shard(4, 2, v1::TENSOR_PARALLEL_MODE_2D));
  v1::MeshSpec spec = mesh->ToProto();
  EXPECT_EQ(spec.world_size(), 8);
  EXPECT_EQ(spec.tensor_parallel_mode(), v1::TENSOR_PARALLEL_MODE_2D);
  ASSERT_EQ(spec.axes_size(), 3);
  EXPECT_EQ(spec.axes(0).name(), "dp");
  std::map<std::string, int> per_axis;
  for (const auto& g : spec.groups()) ++per_axis[g.axis()];
  // dp: 4 groups of 2; tp: 2 of 4; tp_row and tp_col: 4 of 2 each.
  EXPECT_EQ(per_axis, (std::map<std::string, int>{{"dp", 4}, {"tp", 2}, {"tp_col", 4}, {"tp_row", 4}}));
}

// Pipeline stages: axes dp, pp, tp (DESIGN.md section 3); a stage's tp
// group is consecutive ranks, neighbouring stages are tp apart.
TEST(DeviceMesh, PipelineStagesSitBetweenDpAndTp) {
  v1::ShardConfig s;
  s.set_tensor_parallel_size(2);
  s.set_pipeline_parallel_size(2);
  s.set_data_parallel_size(2);
  auto mesh = DeviceMesh::FromShardConfig(s);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  ASSERT_EQ(mesh->axes().size(), 3u);
  EXPECT_EQ(mesh->axes()[1].name, "pp");
  EXPECT_EQ(mesh->world_size(), 8);
  EXPECT_EQ(*mesh->GroupOf("tp", 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(*mesh->GroupOf("pp", 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(*mesh->GroupOf("dp", 5), (std::vector<int>{1, 5}));
  EXPECT_EQ(*mesh->LocalRank("pp", 7), 1);
  s.set_pipeline_parallel_size(1);  // no stages: no pp axis
  EXPECT_EQ(DeviceMesh::FromShardConfig(s)->axes().size(), 2u);
  s.set_pipeline_parallel_size(-1);
  EXPECT_FALSE(DeviceMesh::FromShardConfig(s).ok());
}

// A worker builds its mesh from the MeshSpec the coordinator sends: the same
// mesh back for every layout, and a spec whose numbers do not hold together
// refused, naming the field.
TEST(DeviceMesh, FromProtoGivesTheSameMeshBackAndRefusesAnInconsistentSpec) {
  v1::ShardConfig pp = Shard(2, 2);
  pp.set_pipeline_parallel_size(2);
  for (const v1::ShardConfig& s : {Shard(4, 2), Shard(4, 1, v1::TENSOR_PARALLEL_MODE_2D),
                                   Shard(8, 1, v1::TENSOR_PARALLEL_MODE_2P5D, 2),
                                   Shard(8, 1, v1::TENSOR_PARALLEL_MODE_3D), pp}) {
    auto mesh = DeviceMesh::FromShardConfig(s);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const v1::MeshSpec spec = mesh->ToProto();
    auto back = DeviceMesh::FromProto(spec);
    ASSERT_TRUE(back.ok()) << back.status() << " " << s.ShortDebugString();
    EXPECT_EQ(back->axes(), mesh->axes());
    EXPECT_EQ(back->ToProto().SerializeAsString(), spec.SerializeAsString()) << s.ShortDebugString();
    for (int r = 0; r < mesh->world_size(); ++r) EXPECT_EQ(*back->GroupOf("tp", r), *mesh->GroupOf("tp", r));
  }
  const v1::MeshSpec good = DeviceMesh::FromShardConfig(Shard(2, 2))->ToProto();
  v1::MeshSpec bad = good;
  bad.set_world_size(8);
  EXPECT_EQ(DeviceMesh::FromProto(bad).status().message(), "mesh.world_size: 8 is not the axes' 4 ranks");
  bad = good;
  bad.mutable_groups(0)->set_ranks(0, 3);
  EXPECT_EQ(DeviceMesh::FromProto(bad).status().message(), "mesh.groups: not the groups of mesh.axes");
  bad = good;
  bad.mutable_axes(1)->set_size(0);
  EXPECT_TRUE(absl::StartsWith(DeviceMesh::FromProto(bad).status().message(), "mesh.axes: "))
      << DeviceMesh::FromProto(bad).status();
  EXPECT_EQ(DeviceMesh::FromProto(v1::MeshSpec()).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace colod
