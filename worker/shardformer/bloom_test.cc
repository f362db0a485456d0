// BLOOM through ShardFormer: tiny random BloomForCausalLM directories loaded
// unsharded, 1D at tp = 2 and 4 (with and without sequence parallelism) and
// with dp, with 4 heads and with 6 and 12 (not powers of two, so the slopes
// take transformers' second series) split over tp, the residual before and
// after the LayerNorms, tied and untied heads; logits, loss and every
// gradient against the independent unsharded reference. And BLOOM's quirks
// on their own: the heads each rank holds keep their own slopes.
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

constexpr auto k1D = v1::TENSOR_PARALLEL_MODE_1D;
constexpr auto k2D = v1::TENSOR_PARALLEL_MODE_2D;
constexpr auto k2P5D = v1::TENSOR_PARALLEL_MODE_2P5D;
constexpr auto k3D = v1::TENSOR_PARALLEL_MODE_3D;

struct Case {
  std::string name;
  int tp, dp;
  bool sp;
  int64_t heads;  // hidden 64 or (12 heads) 96
  bool residual_post_norm;
  bool tie;
  v1::TensorParallelMode mode = k1D;
  int depth = 1;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

ShardConfig Layout(int tp, int dp, bool sp, v1::TensorParallelMode mode = k1D, int depth = 1) {
  ShardConfig shard;
  shard.layout.set_tensor_parallel_size(tp);
  shard.layout.set_data_parallel_size(dp);
  shard.layout.set_tensor_parallel_mode(mode);
  shard.layout.set_sequence_parallel(sp);
  if (depth > 1) shard.layout.set_depth(depth);
  return shard;
}

testing::TinyOptions Options(const Case& c) {
  testing::TinyOptions o;
  o.heads = c.heads;
  o.hidden = c.heads == 12 ? 96 : c.heads == 6 ? 48 : 64;
  o.residual_post_norm = c.residual_post_norm;
  o.tie = c.tie;
  return o;
}

class BloomSharded : public ::testing::TestWithParam<Case> {};

TEST_P(BloomSharded, LogitsLossAndEveryGradientMatchTheUnshardedModel) {
  const Case& c = GetParam();
  auto model = testing::WriteTinyBloom(TempPath("bloom_" + c.name), Options(c));
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = testing::TokenIds(4, 8, model->config.vocab_size, 19);
  auto ref = testing::ReferenceBloom(*model, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(*model, *ref, Layout(c.tp, c.dp, c.sp, c.mode, c.depth), ids, kTol);
}

INSTANTIATE_TEST_SUITE_P(Layouts, BloomSharded,
                         ::testing::Values(Case{"unsharded", 1, 1, false, 4, false, true},
                                           Case{"unsharded_12_heads", 1, 1, false, 12, false, true},
                                           Case{"tp2", 2, 1, false, 4, false, true},
                                           Case{"tp2_6_heads", 2, 1, false, 6, false, true},
                                           Case{"tp4_12_heads_untied", 4, 1, false, 12, false, false},
                                           Case{"tp2_sp", 2, 1, true, 4, false, true},
                                           Case{"tp4_sp_post_norm", 4, 1, true, 4, true, true},
                                           Case{"tp2_dp2", 2, 2, false, 6, false, true},
                                           Case{"tp2_post_norm", 2, 1, false, 4, true, true},
                                           // 2D / 2.5D: heads over tp_row; 3D: over each layer's column axis.
                                           Case{"2d", 4, 1, false, 4, false, true, k2D},
                                           Case{"2d_post_norm_untied", 4, 1, false, 6, true, false, k2D},
                                           Case{"2p5d", 8, 1, false, 4, false, true, k2P5D, 2},
                                           Case{"3d", 8, 1, false, 4, false, true, k3D},
                                           Case{"3d_untied_12_heads", 8, 1, false, 12, true, false, k3D}),
                         [](const auto& info) { return info.param.name; });

TEST(Bloom, TheBareModelsNamesLoadTheSame) {
  testing::TinyOptions o;
  o.prefixed = false;  // "word_embeddings.weight", "h.0...", as BloomModel saves them (bigscience/bloom-560m)
  o.tie = true;
  auto model = testing::WriteTinyBloom(TempPath("bloom_bare"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = testing::TokenIds(2, 8, model->config.vocab_size, 23);
  auto ref = testing::ReferenceBloom(*model, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(*model, *ref, Layout(2, 1, false), ids, kTol, "transformer.");
}

// The slopes are a property of the whole model's head index: a model whose
// ranks each took the first slopes (or whose slopes were all one) would give
// other logits. With 6 heads at tp = 2, rank 1's heads 3..5 use 2^-8, 2^-1
// and 2^-3; the sharded model matches the reference (above), and an
// unsharded model with the slopes permuted does not.
TEST(Bloom, EachRanksHeadsKeepTheirSlopes) {
  const std::vector<float> all = nn::AlibiSlopes(6);
  ASSERT_EQ(all.size(), 6u);
  EXPECT_EQ(all[3], std::pow(2.0f, -8.0f));
  EXPECT_EQ(all[4], std::pow(2.0f, -1.0f));
  EXPECT_EQ(all[5], std::pow(2.0f, -3.0f));
  const Tensor q = *Tensor::RandomNormal({1, 6, 6, 8}, 1), k = *Tensor::RandomNormal({1, 6, 6, 8}, 2),
               v = *Tensor::RandomNormal({1, 6, 6, 8}, 3);
  auto right = nn::AlibiAttention(Variable(q), Variable(k), Variable(v), 0.35f, all);
  std::vector<float> swapped = all;
  std::rotate(swapped.begin(), swapped.begin() + 3, swapped.end());  // what rank-local slopes would give
  auto wrong = nn::AlibiAttention(Variable(q), Variable(k), Variable(v), 0.35f, swapped);
  ASSERT_TRUE(right.ok() && wrong.ok());
  double diff = 0;
  const std::vector<float> a = right->value().ToFloats(), b = wrong->value().ToFloats();
  for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(a[i] - b[i])));
  EXPECT_GT(diff, 1e-3);
}

TEST(Bloom, EachRankHoldsOnlyItsShard) {
  testing::TinyOptions o;
  o.tie = true;
  auto model = testing::WriteTinyBloom(TempPath("bloom_shapes"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const ShardConfig shard = Layout(4, 1, false);
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    auto sharded = ShardFormer(shard, &pg).Load(model->dir);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    std::map<std::string, Shape> local;
    for (const NamedParam& p : (*sharded)->Parameters()) local[p.name] = p.bound.param.local().shape();
    // One head (q, k and v of 16 each) per rank.
    EXPECT_EQ(local["transformer.h.0.self_attention.query_key_value.weight"], (Shape{48, 64}));
    EXPECT_EQ(local["transformer.h.0.self_attention.dense.weight"], (Shape{64, 16}));
    EXPECT_EQ(local["transformer.h.1.mlp.dense_h_to_4h.weight"], (Shape{64, 64}));
    EXPECT_EQ(local["transformer.word_embeddings.weight"], (Shape{64, 64}));  // 256 padded rows / 4
    EXPECT_EQ(local["transformer.word_embeddings_layernorm.weight"], (Shape{64}));
    EXPECT_EQ(local.count("lm_head.weight"), 0u);
  });
}

}  // namespace
}  // namespace colod::shardformer
