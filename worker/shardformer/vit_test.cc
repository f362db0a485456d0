// ViT through ShardFormer: tiny random ViTForImageClassification directories
// loaded unsharded, 1D at tp = 2 and 4, and tp = 2 x dp = 2; logits, the
// classification loss and every gradient against the independent unsharded
// reference; and the patch order on its own.
#include <cmath>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::TempPath;

constexpr double kTol = 2e-4;

ShardConfig Layout(int tp, int dp, v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D, bool sp = false,
                   int depth = 1) {
  ShardConfig shard;
  shard.layout.set_tensor_parallel_size(tp);
  shard.layout.set_data_parallel_size(dp);
  shard.layout.set_tensor_parallel_mode(mode);
  shard.layout.set_sequence_parallel(sp);
  if (depth > 1) shard.layout.set_depth(depth);
  return shard;
}

constexpr auto k1D = v1::TENSOR_PARALLEL_MODE_1D;
constexpr auto k2D = v1::TENSOR_PARALLEL_MODE_2D;
constexpr auto k2P5D = v1::TENSOR_PARALLEL_MODE_2P5D;
constexpr auto k3D = v1::TENSOR_PARALLEL_MODE_3D;

struct Case {
  std::string name;
  int tp, dp;
  v1::TensorParallelMode mode = k1D;
  bool sp = false;
  int depth = 1;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class VitSharded : public ::testing::TestWithParam<Case> {};

TEST_P(VitSharded, LogitsLossAndEveryGradientMatchTheUnshardedModel) {
  const Case& c = GetParam();
  testing::TinyOptions o;
  auto model = testing::WriteTinyVit(TempPath("vit_" + c.name), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor pixels = testing::PixelValues(4, o, 1);
  const Tensor labels = testing::ImageLabels(4, o.labels, 2);
  auto ref = testing::ReferenceVit(*model, pixels, labels);
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(*model, *ref, Layout(c.tp, c.dp, c.mode, c.sp, c.depth), pixels, kTol);
}

INSTANTIATE_TEST_SUITE_P(Layouts, VitSharded,
                         ::testing::Values(Case{"unsharded", 1, 1}, Case{"tp2", 2, 1}, Case{"tp4", 4, 1},
                                           Case{"tp2_dp2", 2, 2},
                                           Case{"2d", 4, 1, k2D}, Case{"2p5d", 8, 1, k2P5D, false, 2},
                                           Case{"3d", 8, 1, k3D}),
                         [](const auto& info) { return info.param.name; });

// Patch (i, j) of a 3-channel 8 x 8 image in 4 x 4 patches is row
// i * 2 + j, its elements channel-major then row then column (a Conv2d
// weight's order); every pixel's value is its own index here.
TEST(Vit, PatchesAreRowMajorAndFlattenedLikeTheConvWeight) {
  std::vector<float> v(2 * 3 * 8 * 8);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  auto patches = nn::ImagePatches(*Tensor::FromFloats({2, 3, 8, 8}, v), 4);
  ASSERT_TRUE(patches.ok()) << patches.status();
  ASSERT_EQ(patches->shape(), (Shape{2, 4, 48}));
  const std::vector<float> got = patches->ToFloats();
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 2; ++i) {
      for (int64_t j = 0; j < 2; ++j) {
        for (int64_t k = 0; k < 3; ++k) {
          for (int64_t y = 0; y < 4; ++y) {
            for (int64_t x = 0; x < 4; ++x) {
              const float pixel = static_cast<float>(((b * 3 + k) * 8 + i * 4 + y) * 8 + j * 4 + x);
              ASSERT_EQ(got[(b * 4 + i * 2 + j) * 48 + (k * 4 + y) * 4 + x], pixel)
                  << "image " << b << " patch (" << i << ", " << j << ") channel " << k;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(nn::ImagePatches(*Tensor::Zeros({1, 3, 8, 6}, DType::kF32), 4).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Vit, InputsAndLayoutsItCannotTake) {
  testing::TinyOptions o;
  auto model = testing::WriteTinyVit(TempPath("vit_errors"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  RunMesh(*DeviceMesh::FromShardConfig(Layout(2, 1).layout), [&](int, ProcessGroup& pg) {
    auto sharded = ShardFormer(Layout(2, 1), &pg).Load(model->dir);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    for (const Tensor& bad : {*Tensor::Zeros({2, 3, 8, 4}, DType::kF32), *Tensor::Zeros({2, 1, 8, 8}, DType::kF32),
                              testing::TokenIds(2, 8, 10, 1)}) {
      auto r = (*sharded)->Forward(bad);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(r.status().message().find("pixel values must be floats [batch, 3, 8, 8]"), std::string::npos)
          << r.status();
    }
    auto logits = (*sharded)->Forward(testing::PixelValues(2, o, 3));
    ASSERT_TRUE(logits.ok()) << logits.status();
    EXPECT_EQ(logits->global_shape(), (Shape{2, 1, 10}));
    auto out_of_range = (*sharded)->ClassificationLoss(*logits, *Tensor::FromInt64s({2}, {3, 10}));
    EXPECT_EQ(out_of_range.status().code(), absl::StatusCode::kInvalidArgument) << out_of_range.status();
    auto two_d = (*sharded)->ClassificationLoss(*logits, *Tensor::FromInt64s({2, 1}, {3, 4}));
    EXPECT_EQ(two_d.status().code(), absl::StatusCode::kInvalidArgument);
  });
  // Sequence parallelism cannot exist for ViT's n^2 + 1 positions (the
  // reason in the refusal).
  const ShardConfig sp = Layout(2, 1, k1D, /*sp=*/true);
  RunMesh(*DeviceMesh::FromShardConfig(sp.layout), [&](int, ProcessGroup& pg) {
    auto s = ShardFormer(sp, &pg).Load(model->dir).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("the vit policy has no sequence_parallel: its sequence, n^2 patches and the CLS token"),
              std::string::npos)
        << s;
  });
}

}  // namespace
}  // namespace colod::shardformer
