// Conversion plans: which collectives run, in which order, and what they cost.
#include "worker/colo/redistribute.h"

#include "gtest/gtest.h"

namespace colod {
namespace {

DeviceMesh Mesh(int tp, int dp, v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D) {
  v1::ShardConfig s;
  s.set_tensor_parallel_size(tp);
  s.set_data_parallel_size(dp);
  s.set_tensor_parallel_mode(mode);
  return *DeviceMesh::FromShardConfig(s);
}

// "axis:collective" for every step.
std::vector<std::string> Names(const std::vector<RedistributeStep>& plan) {
  std::vector<std::string> out;
  for (const auto& s : plan) out.push_back(s.axis + ":" + CollectiveName(s.collective));
  return out;
}

std::vector<RedistributeStep> PlanOrDie(const DistSpec& from, const DistSpec& to, const Shape& shape,
                                        const DeviceMesh& mesh) {
  auto f = NormalizeSpec(from, mesh, static_cast<int64_t>(shape.size()));
  auto t = NormalizeSpec(to, mesh, static_cast<int64_t>(shape.size()));
  EXPECT_TRUE(f.ok() && t.ok());
  auto plan = PlanRedistribute(*f, *t, shape, DType::kF32, mesh);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : std::vector<RedistributeStep>{};
}

DistSpec Tp(Placement p) { return DistSpec().Set("tp", std::move(p)); }

using V = std::vector<std::string>;

TEST(PlanRedistribute, MovingAShardBetweenDimsIsOneAllToAll) {
  const DeviceMesh mesh = Mesh(4, 1);
  // [12, 8] f32 = 384 B; all-to-all sends (n-1)/n of the 96 B shard.
  auto plan = PlanOrDie(Tp(Placement::Shard({0}, {4})), Tp(Placement::Shard({1}, {4})), {12, 8}, mesh);
  EXPECT_EQ(Names(plan), (V{"tp:all_to_all"}));
  EXPECT_EQ(plan[0].bytes_per_rank, 72);
  // Through R it would cost an all-gather, (n-1)/n of 384 B = 288 B.
  auto gather = PlanOrDie(Tp(Placement::Shard({0}, {4})), DistSpec(), {12, 8}, mesh);
  EXPECT_EQ(Names(gather), (V{"tp:all_gather"}));
  EXPECT_EQ(gather[0].bytes_per_rank, 288);
}

TEST(PlanRedistribute, EachPairTakesItsCheapestRoute) {
  const DeviceMesh mesh = Mesh(4, 1);
  const Shape shape = {12, 8};
  EXPECT_EQ(Names(PlanOrDie(Tp(Placement::Partial()), Tp(Placement::Shard({1}, {4})), shape, mesh)),
            (V{"tp:reduce_scatter"}));
  auto ar = PlanOrDie(Tp(Placement::Partial()), DistSpec(), shape, mesh);
  EXPECT_EQ(Names(ar), (V{"tp:all_reduce"}));
  EXPECT_EQ(ar[0].bytes_per_rank, 2 * 288);
  EXPECT_EQ(Names(PlanOrDie(Tp(Placement::Shard({0}, {4})), Tp(Placement::Partial()), shape, mesh)),
            (V{"tp:all_gather", "tp:local"}));
  EXPECT_EQ(Names(PlanOrDie(Tp(Placement::Partial(ReduceOp::kSum)), Tp(Placement::Partial(ReduceOp::kMax)),
                            shape, mesh)),
            (V{"tp:all_reduce", "tp:local"}));
  // Blocks on two dims to one dim: the pieces differ in shape, so through R.
  EXPECT_EQ(Names(PlanOrDie(Tp(Placement::Shard({0, 1}, {2, 2})), Tp(Placement::Shard({1}, {4})), shape, mesh)),
            (V{"tp:all_gather", "tp:local"}));
  EXPECT_TRUE(PlanOrDie(Tp(Placement::Shard({1}, {4})), Tp(Placement::Shard({1}, {4})), shape, mesh).empty());
}

TEST(PlanRedistribute, NestedShardsGatherInnermostFirstAndSliceOutermostFirst) {
  const DeviceMesh mesh = Mesh(2, 2);
  const DistSpec nested =
      DistSpec().Set("dp", Placement::Shard({0}, {2})).Set("tp", Placement::Shard({0}, {2}));
  // Dropping dp's half: tp's quarter is in the way, so tp gathers, dp
  // gathers, and tp slices the whole dim again.
  EXPECT_EQ(Names(PlanOrDie(nested, Tp(Placement::Shard({0}, {2})), {8, 4}, mesh)),
            (V{"tp:all_gather", "dp:all_gather", "tp:local"}));
  // Dropping tp's quarter is one gather on tp.
  EXPECT_EQ(Names(PlanOrDie(nested, DistSpec().Set("dp", Placement::Shard({0}, {2})), {8, 4}, mesh)),
            (V{"tp:all_gather"}));
  // From R, slices go outermost first.
  EXPECT_EQ(Names(PlanOrDie(DistSpec(), nested, {8, 4}, mesh)), (V{"dp:local", "tp:local"}));
  // An independent move on tp while dp shards another dim stays one all-to-all.
  EXPECT_EQ(Names(PlanOrDie(DistSpec().Set("dp", Placement::Shard({2}, {2})).Set("tp", Placement::Shard({0}, {2})),
                            DistSpec().Set("dp", Placement::Shard({2}, {2})).Set("tp", Placement::Shard({1}, {2})),
                            {8, 4, 2}, mesh)),
            (V{"tp:all_to_all"}));
}

TEST(PlanRedistribute, OneRankAxesMoveNoBytes) {
  const DeviceMesh mesh = Mesh(1, 2);
  auto plan = PlanOrDie(Tp(Placement::Partial()), Tp(Placement::Shard({0}, {1})), {6, 4}, mesh);
  EXPECT_EQ(Names(plan), (V{"tp:local"}));
  EXPECT_EQ(plan[0].bytes_per_rank, 0);
}

TEST(NormalizeSpec, RejectsOverlappingAxesAndRepeatedDims) {
  const DeviceMesh mesh = Mesh(4, 1, v1::TENSOR_PARALLEL_MODE_2D);
  auto overlap = NormalizeSpec(
      DistSpec().Set("tp", Placement::Shard({0}, {4})).Set("tp_row", Placement::Shard({1}, {2})), mesh, 2);
  EXPECT_EQ(overlap.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(overlap.status().message().find("axes tp and tp_row overlap"), absl::string_view::npos)
      << overlap.status();
  auto twice = NormalizeSpec(DistSpec().Set("tp", Placement::Shard({0, -2}, {2, 2})), mesh, 2);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(twice.status().message().find("dim 0 is listed twice"), absl::string_view::npos) << twice.status();
  // Partition counts whose product wraps int64 to the axis size (4): 4 * 5 *
  // 5581 * 8681 * 49477 * 384773 is 2^64 + 4.
  auto wrapped = NormalizeSpec(
      DistSpec().Set("tp", Placement::Shard({0, 1, 2, 3, 4, 5}, {4, 5, 5581, 8681, 49477, 384773})), mesh, 6);
  EXPECT_EQ(wrapped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrapped.status().message().find("multiply to more than the axis's 4 ranks"), absl::string_view::npos)
      << wrapped.status();
  auto ok = NormalizeSpec(DistSpec().Set("tp_col", Placement::Shard({-1}, {2})), mesh, 2);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->Get("tp_col").dims, (std::vector<int64_t>{1}));
}

TEST(LocalShape, NestedShardsMultiply) {
  const DistSpec s = DistSpec().Set("dp", Placement::Shard({0}, {2})).Set("tp", Placement::Shard({0, 1}, {3, 2}));
  EXPECT_EQ(LocalShape(s, {12, 6, 5}), (Shape{2, 3, 5}));
  EXPECT_TRUE(CheckDivisible(s, {12, 6, 5}).ok());
  EXPECT_EQ(CheckDivisible(s, {6, 6, 5}).code(), absl::StatusCode::kOk);
  EXPECT_EQ(CheckDivisible(s, {9, 6, 5}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace colod
