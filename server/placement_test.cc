// Rank assignment: tp groups packed onto hosts (best fit), device-ordinal
// order, independence from the listing order, spanning when no host fits,
// and too few workers.
#include "server/placement.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

v1::WorkerInfo W(const std::string& host, int ordinal) {
  v1::WorkerInfo w;
  w.set_worker_id(absl::StrCat(host, "-gpu", ordinal));
  w.set_address(absl::StrCat(host, ":", 7000 + ordinal));
  w.set_host(host);
  w.set_device_ordinal(ordinal);
  return w;
}

DeviceMesh Mesh(int tp, int dp, v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D) {
  v1::ShardConfig s;
  s.set_tensor_parallel_size(tp);
  s.set_data_parallel_size(dp);
  s.set_tensor_parallel_mode(mode);
  return *DeviceMesh::FromShardConfig(s);
}

std::vector<std::string> Ids(const v1::MeshSpec& m) {
  std::vector<std::string> ids;
  for (const auto& r : m.ranks()) ids.push_back(r.worker_id());
  return ids;
}

TEST(Placement, TensorParallelGroupsStayOnOneHostInOrdinalOrder) {
  std::vector<v1::WorkerInfo> workers = {W("b", 1), W("a", 1), W("b", 0), W("a", 0)};
  auto m = AssignRanks(Mesh(2, 2), workers);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(Ids(*m), (std::vector<std::string>{"a-gpu0", "a-gpu1", "b-gpu0", "b-gpu1"}));
  EXPECT_EQ(m->world_size(), 4);
  EXPECT_EQ(m->ranks(3).worker_address(), "b:7001");
  EXPECT_EQ(m->ranks(2).rank(), 2);
  EXPECT_GT(m->groups_size(), 0);  // every group of every axis, from the mesh
  // Any listing order gives the same placement.
  std::mt19937 rng(1);
  for (int i = 0; i < 5; ++i) {
    std::shuffle(workers.begin(), workers.end(), rng);
    EXPECT_EQ(Ids(*AssignRanks(Mesh(2, 2), workers)), Ids(*m));
  }
}

TEST(Placement, BestFitKeepsLargerHostsWhole) {
  // Hosts with 3 and 2 free workers, two groups of 2: the first goes to the
  // 2-worker host, the second to the 3-worker host.
  auto m = AssignRanks(Mesh(2, 2), {W("big", 0), W("big", 1), W("big", 2), W("small", 0), W("small", 1)});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(Ids(*m), (std::vector<std::string>{"small-gpu0", "small-gpu1", "big-gpu0", "big-gpu1"}));
}

TEST(Placement, AGroupNoHostHoldsSpansHostsInOrder) {
  auto m = AssignRanks(Mesh(4, 1), {W("b", 0), W("a", 2), W("a", 0), W("b", 1), W("a", 1)});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(Ids(*m), (std::vector<std::string>{"a-gpu0", "a-gpu1", "a-gpu2", "b-gpu0"}));
}

// Pipeline stages (dp, pp, tp): a stage's tp group on one host, and a
// replica's neighbouring stages on the same host while it has room.
TEST(Placement, NeighbouringPipelineStagesShareAHost) {
  v1::ShardConfig s;
  s.set_tensor_parallel_size(2);
  s.set_pipeline_parallel_size(2);
  s.set_data_parallel_size(2);
  const DeviceMesh mesh = *DeviceMesh::FromShardConfig(s);
  std::vector<v1::WorkerInfo> workers;
  for (const char* host : {"b", "a"}) {
    for (int i = 0; i < 4; ++i) workers.push_back(W(host, i));
  }
  auto m = AssignRanks(mesh, workers);
  ASSERT_TRUE(m.ok()) << m.status();
  // Ranks 0-3 are replica 0's stages 0 and 1, ranks 4-7 replica 1's.
  EXPECT_EQ(Ids(*m), (std::vector<std::string>{"a-gpu0", "a-gpu1", "a-gpu2", "a-gpu3", "b-gpu0", "b-gpu1", "b-gpu2",
                                               "b-gpu3"}));
  bool has_pp = false;
  for (const auto& g : m->groups()) has_pp = has_pp || g.axis() == "pp";
  EXPECT_TRUE(has_pp) << "the mesh's pp groups are in the spec";
}

TEST(Placement, TooFewWorkers) {
  auto m = AssignRanks(Mesh(2, 2), {W("a", 0), W("a", 1), W("b", 0)});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(m.status().message().find("4 ranks but only 3"), std::string::npos) << m.status();
}

TEST(Placement, A1024RankMeshOn128HostsOf8) {
  std::vector<v1::WorkerInfo> workers;
  for (int h = 0; h < 128; ++h) {
    for (int g = 7; g >= 0; --g) workers.push_back(W(absl::StrCat("node", 1000 + h), g));
  }
  auto m = AssignRanks(Mesh(8, 128, v1::TENSOR_PARALLEL_MODE_3D), workers);  // tp = 2 x 2 x 2
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->ranks_size(), 1024);
  for (int r = 0; r < 1024; ++r) {
    EXPECT_EQ(m->ranks(r).host(), m->ranks(r - r % 8).host()) << r;  // the tp group of 8 on one host
    EXPECT_EQ(m->ranks(r).device_ordinal(), r % 8) << r;
  }
}

}  // namespace
}  // namespace colod
