// OPT through ShardFormer: tiny random OPTForCausalLM directories, pre-norm
// (opt-125m and up) and post-norm with project_in/out (opt-350m), tied and
// untied heads, loaded unsharded, 1D at tp = 2 and 4 (with and without
// sequence parallelism), with dp, 2D and 2.5D; logits, loss and every
// gradient against the independent unsharded reference; and OPT's own
// quirk, positions read two rows down the table.
#include <cmath>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::TempPath;

constexpr double kTol = 2e-4;

struct Case {
  std::string name;
  int tp, dp;
  v1::TensorParallelMode mode;
  bool sp;
  bool pre_norm;
  int64_t embed_dim;  // 0: the hidden size (no project_in/out)
  bool tie;
  int depth = 1;  // 2.5D
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

ShardConfig Layout(const Case& c) {
  ShardConfig shard;
  shard.layout.set_tensor_parallel_size(c.tp);
  shard.layout.set_data_parallel_size(c.dp);
  shard.layout.set_tensor_parallel_mode(c.mode);
  shard.layout.set_sequence_parallel(c.sp);
  if (c.depth > 1) shard.layout.set_depth(c.depth);
  return shard;
}

class OptSharded : public ::testing::TestWithParam<Case> {};

TEST_P(OptSharded, LogitsLossAndEveryGradientMatchTheUnshardedModel) {
  const Case& c = GetParam();
  testing::TinyOptions o;
  o.pre_norm = c.pre_norm;
  o.embed_dim = c.embed_dim;
  o.tie = c.tie;
  auto model = testing::WriteTinyOpt(TempPath("opt_" + c.name), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = testing::TokenIds(4, 8, model->config.vocab_size, 11);
  auto ref = testing::ReferenceOpt(*model, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(*model, *ref, Layout(c), ids, kTol);
}

constexpr auto k1D = v1::TENSOR_PARALLEL_MODE_1D;
constexpr auto k2D = v1::TENSOR_PARALLEL_MODE_2D;
constexpr auto k2P5D = v1::TENSOR_PARALLEL_MODE_2P5D;
constexpr auto k3D = v1::TENSOR_PARALLEL_MODE_3D;
INSTANTIATE_TEST_SUITE_P(
    Layouts, OptSharded,
    ::testing::Values(Case{"unsharded", 1, 1, k1D, false, true, 0, true},
                      Case{"unsharded_350m", 1, 1, k1D, false, false, 32, true},
                      Case{"tp2", 2, 1, k1D, false, true, 0, true},
                      Case{"tp2_350m", 2, 1, k1D, false, false, 32, true},
                      Case{"tp4_untied", 4, 1, k1D, false, true, 0, false},
                      Case{"tp2_sp", 2, 1, k1D, true, true, 0, true},
                      Case{"tp4_sp_350m", 4, 1, k1D, true, false, 32, true},
                      Case{"tp2_dp2", 2, 2, k1D, false, true, 0, true},
                      Case{"tp2_dp2_350m", 2, 2, k1D, false, false, 32, true},
                      Case{"2d", 4, 1, k2D, false, true, 0, true},
                      Case{"2d_350m_untied", 4, 1, k2D, false, false, 32, false},
                      Case{"2p5d", 8, 1, k2P5D, false, true, 0, true, 2},
                      Case{"2p5d_350m", 8, 1, k2P5D, false, false, 32, true, 2},
                      // 3D: project_in/out are lone Linear3Ds, their outputs moved back to the stream's spec.
                      Case{"3d", 8, 1, k3D, false, true, 0, true},
                      Case{"3d_350m", 8, 1, k3D, false, false, 32, true},
                      Case{"3d_untied", 8, 1, k3D, false, true, 0, false}),
    [](const auto& info) { return info.param.name; });

TEST(Opt, TheBareModelsNamesLoadTheSame) {
  testing::TinyOptions o;
  o.prefixed = false;  // "decoder.layers.0...", as OPTModel saves them (the hub's checkpoints)
  o.tie = true;
  auto model = testing::WriteTinyOpt(TempPath("opt_bare"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = testing::TokenIds(2, 8, model->config.vocab_size, 13);
  auto ref = testing::ReferenceOpt(*model, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  Case c{"bare", 2, 1, k1D, false, true, 0, true};
  testing::ExpectShardedMatchesReference(*model, *ref, Layout(c), ids, kTol, "model.");
}

// OPTLearnedPositionalEmbedding reads row s + 2 for position s: rows 0 and 1
// never contribute, so their gradient is exactly zero, and the rows of the
// positions that predict a token, 2 to seq (the last position predicts
// nothing), get one; a model that read row s or s + 1 would differ.
TEST(Opt, PositionSReadsRowSPlusTwo) {
  testing::TinyOptions o;
  o.tie = true;
  o.positions = 16;
  auto model = testing::WriteTinyOpt(TempPath("opt_offset"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t seq = 6;
  const Tensor ids = testing::TokenIds(2, seq, model->config.vocab_size, 17);
  Case c{"offset", 2, 1, k1D, false, true, 0, true};
  const ShardConfig shard = Layout(c);
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    auto sharded = ShardFormer(shard, &pg).Load(model->dir);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    auto logits = (*sharded)->Forward(ids);
    ASSERT_TRUE(logits.ok()) << logits.status();
    auto loss = (*sharded)->NextTokenLoss(*logits, ids);
    ASSERT_TRUE(loss.ok()) << loss.status();
    ASSERT_TRUE(Backward(loss->loss).ok());
    auto grads = (*sharded)->GatherHf(/*gradients=*/true);
    ASSERT_TRUE(grads.ok()) << grads.status();
    const Tensor& g = grads->at("model.decoder.embed_positions.weight");
    ASSERT_EQ(g.shape(), (Shape{18, 64}));  // 16 positions, 2 rows more
    const std::vector<float> v = g.ToFloats();
    for (int64_t row = 0; row < 18; ++row) {
      double norm = 0;
      for (int64_t j = 0; j < 64; ++j) norm += std::fabs(v[row * 64 + j]);
      if (row >= 2 && row <= seq) {
        EXPECT_GT(norm, 0) << "row " << row;
      } else {
        EXPECT_EQ(norm, 0) << "row " << row;
      }
    }
  });
  // The limit is max_position_embeddings, not the table's 18 rows.
  RunMesh(*DeviceMesh::FromShardConfig(Layout(Case{"one", 1, 1, k1D, false, true, 0, true}).layout),
          [&](int, ProcessGroup& pg) {
            auto sharded = ShardFormer(Layout(Case{"one", 1, 1, k1D, false, true, 0, true}), &pg).Load(model->dir);
            ASSERT_TRUE(sharded.ok()) << sharded.status();
            EXPECT_TRUE((*sharded)->Forward(testing::TokenIds(1, 16, 50, 1)).ok());
            auto long_ids = (*sharded)->Forward(testing::TokenIds(1, 17, 50, 1));
            EXPECT_EQ(long_ids.status().code(), absl::StatusCode::kInvalidArgument);
            EXPECT_NE(long_ids.status().message().find("16 positions"), std::string::npos) << long_ids.status();
          });
}

TEST(Opt, EachRankHoldsOnlyItsShard) {
  testing::TinyOptions o;
  o.tie = true;
  o.pre_norm = false;
  o.embed_dim = 32;
  auto model = testing::WriteTinyOpt(TempPath("opt_shapes"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const ShardConfig shard = Layout(Case{"tp4", 4, 1, k1D, false, false, 32, true});
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    auto sharded = ShardFormer(shard, &pg).Load(model->dir);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    std::map<std::string, Shape> local;
    for (const NamedParam& p : (*sharded)->Parameters()) local[p.name] = p.bound.param.local().shape();
    const std::string d = "model.decoder.";
    // 50 tokens padded to 256 (64 * tp), a quarter each, 32 wide.
    EXPECT_EQ(local[d + "embed_tokens.weight"], (Shape{64, 32}));
    EXPECT_EQ(local[d + "layers.0.self_attn.q_proj.weight"], (Shape{16, 64}));
    EXPECT_EQ(local[d + "layers.0.self_attn.out_proj.weight"], (Shape{64, 16}));
    EXPECT_EQ(local[d + "layers.1.fc1.weight"], (Shape{24, 64}));
    EXPECT_EQ(local[d + "layers.1.fc2.weight"], (Shape{64, 24}));
    EXPECT_EQ(local[d + "project_in.weight"], (Shape{64, 32}));  // replicated
    EXPECT_EQ(local[d + "project_out.weight"], (Shape{32, 64}));
    EXPECT_EQ(local.count(d + "final_layer_norm.weight"), 0u);  // post-norm: none
    EXPECT_EQ(local.count("lm_head.weight"), 0u);               // tied to embed_tokens
  });
}

}  // namespace
}  // namespace colod::shardformer
