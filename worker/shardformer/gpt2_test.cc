// GPT-2 through ShardFormer: a tiny random GPT2LMHeadModel written as a
// Hugging Face directory, loaded unsharded, 1D at tp = 2 and 4 (with and
// without sequence parallelism), 2D on 4 ranks, 3D on 8 and with dp; logits, the
// mean next-token loss and every parameter's gradient against the
// independent unsharded reference (worker/shardformer/testing.h).
#include <sys/stat.h>

#include <cmath>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::ExpectAllClose;
using ::colod::testing::RunMesh;
using ::colod::testing::TempPath;
using testing::Reference;
using testing::TinyModel;

// fp32 sums of a few hundred terms in another order: agree to ~1e-6
// relative; DESIGN.md section 7 allows 1e-5 (1D) and 1e-3 (SUMMA).
constexpr double kTol = 2e-4;

ShardConfig Layout(int tp, int dp, v1::TensorParallelMode mode, bool sp = false) {
  ShardConfig s;
  s.layout.set_tensor_parallel_size(tp);
  s.layout.set_data_parallel_size(dp);
  s.layout.set_tensor_parallel_mode(mode);
  s.layout.set_sequence_parallel(sp);
  return s;
}

struct Case {
  std::string name;
  int tp, dp;
  v1::TensorParallelMode mode;
  bool sp;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class Gpt2Sharded : public ::testing::TestWithParam<Case> {};

TEST_P(Gpt2Sharded, LogitsLossAndEveryGradientMatchTheUnshardedModel) {
  const Case& c = GetParam();
  auto model = testing::WriteTinyGpt2(TempPath("gpt2_" + c.name));
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t batch = 4, seq = 8;
  const Tensor ids = testing::TokenIds(batch, seq, model->config.vocab_size, 3);
  auto ref = testing::ReferenceGpt2(*model, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(*model, *ref, Layout(c.tp, c.dp, c.mode, c.sp), ids, kTol);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, Gpt2Sharded,
    ::testing::Values(Case{"unsharded", 1, 1, v1::TENSOR_PARALLEL_MODE_1D, false},
                      Case{"tp2", 2, 1, v1::TENSOR_PARALLEL_MODE_1D, false},
                      Case{"tp4", 4, 1, v1::TENSOR_PARALLEL_MODE_1D, false},
                      Case{"tp2_sp", 2, 1, v1::TENSOR_PARALLEL_MODE_1D, true},
                      Case{"tp4_sp", 4, 1, v1::TENSOR_PARALLEL_MODE_1D, true},
                      Case{"tp2_dp2", 2, 2, v1::TENSOR_PARALLEL_MODE_1D, false},
                      Case{"2d", 4, 1, v1::TENSOR_PARALLEL_MODE_2D, false},
                      Case{"3d", 8, 1, v1::TENSOR_PARALLEL_MODE_3D, false}),
    [](const auto& info) { return info.param.name; });

TEST(Gpt2, TheBareModelsNamesLoadTheSame) {
  testing::TinyOptions o;
  o.prefixed = false;  // "wte.weight", "h.0.attn.c_attn.weight" as on the hub
  auto model = testing::WriteTinyGpt2(TempPath("gpt2_bare"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = testing::TokenIds(2, 8, model->config.vocab_size, 5);
  auto ref = testing::ReferenceGpt2(*model, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(*model, *ref, Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D), ids, kTol,
                                         "transformer.");
}

TEST(Gpt2, EachRankHoldsOnlyItsShard) {
  auto model = testing::WriteTinyGpt2(TempPath("gpt2_shapes"));
  ASSERT_TRUE(model.ok()) << model.status();
  const ShardConfig shard = Layout(4, 1, v1::TENSOR_PARALLEL_MODE_1D);
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    auto sharded = ShardFormer(shard, &pg).Load(model->dir);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    std::map<std::string, Shape> local;
    for (const NamedParam& p : (*sharded)->Parameters()) local[p.name] = p.bound.param.local().shape();
    // 50 tokens padded to 256 (64 * tp), a quarter each; q|k|v a quarter of each.
    EXPECT_EQ(local["transformer.wte.weight"], (Shape{64, 64}));
    EXPECT_EQ(local["transformer.h.0.attn.c_attn.weight"], (Shape{3, 16, 64}));
    EXPECT_EQ(local["transformer.h.0.attn.c_proj.weight"], (Shape{64, 16}));
    EXPECT_EQ(local["transformer.h.1.mlp.c_fc.weight"], (Shape{64, 64}));
    EXPECT_EQ(local["transformer.wpe.weight"], (Shape{16, 64}));  // replicated
    EXPECT_EQ(local.count("lm_head.weight"), 0u);                 // tied to wte
  });
}

}  // namespace
}  // namespace colod::shardformer
