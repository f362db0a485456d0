// T5 through ShardFormer: tiny random T5ForConditionalGeneration directories,
// v1.0 (ReLU feed-forward, tied head) and v1.1 / flan-t5 (gated GELU,
// untied head, heads * d_kv unlike d_model), loaded unsharded, 1D at tp = 2
// and 4 and tp = 2 x dp = 2; logits, loss and every gradient (the relative
// position bias tables included) against the independent unsharded
// reference.
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

constexpr auto k1D = v1::TENSOR_PARALLEL_MODE_1D;
constexpr auto k2D = v1::TENSOR_PARALLEL_MODE_2D;
constexpr auto k2P5D = v1::TENSOR_PARALLEL_MODE_2P5D;
constexpr auto k3D = v1::TENSOR_PARALLEL_MODE_3D;

struct Case {
  std::string name;
  int tp, dp;
  bool gated;  // v1.1: gated GELU, untied head, d_kv 8 (inner 32 of d_model 64)
  v1::TensorParallelMode mode = k1D;
  int depth = 1;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

ShardConfig Layout(int tp, int dp, v1::TensorParallelMode mode = k1D, int depth = 1) {
  ShardConfig shard;
  shard.layout.set_tensor_parallel_size(tp);
  shard.layout.set_data_parallel_size(dp);
  shard.layout.set_tensor_parallel_mode(mode);
  if (depth > 1) shard.layout.set_depth(depth);
  return shard;
}

testing::TinyOptions Options(bool gated) {
  if (gated) return testing::TinyFlanT5();
  testing::TinyOptions o;  // v1.0: ReLU, tied head, d_kv = hidden / heads
  o.tie = true;
  return o;
}

// Targets: the decoder ids shifted left, the last position unlabelled.
Tensor Targets(const Tensor& decoder_ids) {
  std::vector<int64_t> v = decoder_ids.ToInt64s();
  const int64_t b = decoder_ids.shape()[0], s = decoder_ids.shape()[1];
  std::vector<int64_t> out(v.size(), -100);
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j + 1 < s; ++j) out[i * s + j] = v[i * s + j + 1];
  }
  return *Tensor::FromInt64s({b, s}, out);
}

class T5Sharded : public ::testing::TestWithParam<Case> {};

TEST_P(T5Sharded, LogitsLossAndEveryGradientMatchTheUnshardedModel) {
  const Case& c = GetParam();
  auto model = testing::WriteTinyT5(TempPath("t5_" + c.name), Options(c.gated));
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = testing::TokenIds(4, 10, model->config.vocab_size, 31);
  const Tensor decoder_ids = testing::TokenIds(4, 7, model->config.vocab_size, 37);
  auto ref = testing::ReferenceT5(*model, ids, decoder_ids, Targets(decoder_ids));
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(*model, *ref, Layout(c.tp, c.dp, c.mode, c.depth), ids, kTol);
}

// Sequence parallelism: encoder and decoder sequences (8 and 6 tokens)
// split over tp in the stacks; the projections, the cross-attention's k and
// v and the head gather them.
TEST(T5, SequenceParallelismMatchesTheUnshardedModel) {
  for (bool gated : {false, true}) {
    auto model = testing::WriteTinyT5(TempPath(gated ? "t5_sp_v1_1" : "t5_sp_v1_0"), Options(gated));
    ASSERT_TRUE(model.ok()) << model.status();
    const Tensor ids = testing::TokenIds(4, 8, model->config.vocab_size, 41);
    const Tensor decoder_ids = testing::TokenIds(4, 6, model->config.vocab_size, 43);
    auto ref = testing::ReferenceT5(*model, ids, decoder_ids, Targets(decoder_ids));
    ASSERT_TRUE(ref.ok()) << ref.status();
    for (const auto& [tp, dp] : std::vector<std::pair<int, int>>{{2, 1}, {2, 2}}) {
      SCOPED_TRACE(::testing::Message() << (gated ? "v1.1" : "v1.0") << " sp tp " << tp << " dp " << dp);
      ShardConfig sp = Layout(tp, dp);
      sp.layout.set_sequence_parallel(true);
      testing::ExpectShardedMatchesReference(*model, *ref, sp, ids, kTol);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, T5Sharded,
                         ::testing::Values(Case{"unsharded_v1_0", 1, 1, false}, Case{"unsharded_v1_1", 1, 1, true},
                                           Case{"tp2_v1_0", 2, 1, false}, Case{"tp2_v1_1", 2, 1, true},
                                           Case{"tp4_v1_1", 4, 1, true}, Case{"tp2_dp2_v1_0", 2, 2, false},
                                           // 2D / 2.5D / 3D: each rank's heads read their rows of the
                                           // position bias; the cross-attention's k and v from the
                                           // encoder's output in the same blocks.
                                           Case{"2d_v1_0", 4, 1, false, k2D}, Case{"2d_v1_1", 4, 1, true, k2D},
                                           Case{"2p5d_v1_1", 8, 1, true, k2P5D, 2},
                                           Case{"3d_v1_0", 8, 1, false, k3D}, Case{"3d_v1_1", 8, 1, true, k3D}),
                         [](const auto& info) { return info.param.name; });

TEST(T5, InputsAndLayoutsItCannotTake) {
  auto model = testing::WriteTinyT5(TempPath("t5_errors"), Options(false));
  ASSERT_TRUE(model.ok()) << model.status();
  RunMesh(*DeviceMesh::FromShardConfig(Layout(2, 1).layout), [&](int, ProcessGroup& pg) {
    auto sharded = ShardFormer(Layout(2, 1), &pg).Load(model->dir);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    const Tensor ids = testing::TokenIds(2, 5, 50, 1);
    EXPECT_EQ((*sharded)->Forward(ids).status().code(), absl::StatusCode::kFailedPrecondition);  // no decoder ids
    auto other_batch = (*sharded)->Forward(ids, testing::TokenIds(3, 5, 50, 1));
    EXPECT_EQ(other_batch.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(other_batch.status().message().find("decoder ids must be integers [batch, seq] of one batch"),
              std::string::npos)
        << other_batch.status();
    EXPECT_TRUE((*sharded)->Forward(ids, testing::TokenIds(2, 3, 50, 2)).ok());
  });
}

}  // namespace
}  // namespace colod::shardformer
