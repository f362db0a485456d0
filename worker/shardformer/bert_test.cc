// BERT through ShardFormer: a tiny random BertForMaskedLM (bidirectional
// attention, post-norm layers, MLM head with the decoder tied to the word
// embeddings) loaded unsharded, 1D at tp = 2 and 4 and with dp, and 3D on 8
// ranks; logits,
// the masked-LM loss and every gradient against the independent reference.
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::TempPath;

ShardConfig Layout(int tp, int dp) {
  ShardConfig s;
  s.layout.set_tensor_parallel_size(tp);
  s.layout.set_data_parallel_size(dp);
  s.layout.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_1D);
  return s;
}

TEST(Bert, LogitsMaskedLmLossAndEveryGradientMatchTheUnshardedModel) {
  auto model = testing::WriteTinyBert(TempPath("bert"));
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = testing::TokenIds(4, 8, model->config.vocab_size, 5);
  auto ref = testing::ReferenceBert(*model, ids, testing::MaskedLabels(ids));
  ASSERT_TRUE(ref.ok()) << ref.status();
  for (const auto& [tp, dp] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {4, 1}, {2, 2}}) {
    SCOPED_TRACE(::testing::Message() << "tp " << tp << " dp " << dp);
    testing::ExpectShardedMatchesReference(*model, *ref, Layout(tp, dp), ids, 2e-4);
  }
  // Sequence parallelism: the layers on sequence shards, the embeddings and
  // the MLM transform on the whole sequence.
  for (const auto& [tp, dp] : std::vector<std::pair<int, int>>{{2, 1}, {4, 1}, {2, 2}}) {
    SCOPED_TRACE(::testing::Message() << "sp tp " << tp << " dp " << dp);
    ShardConfig sp = Layout(tp, dp);
    sp.layout.set_sequence_parallel(true);
    testing::ExpectShardedMatchesReference(*model, *ref, sp, ids, 2e-4);
  }
  // 3D on 8 ranks (q = 2): the batch of 4 splits q*q ways, the MLM
  // transform's output is moved back to the stream's spec, and the
  // vocabulary bias's gradient is summed over the row blocks.
  ShardConfig three_d = Layout(8, 1);
  three_d.layout.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_3D);
  {
    SCOPED_TRACE("3d tp 8");
    testing::ExpectShardedMatchesReference(*model, *ref, three_d, ids, 2e-4);
  }
  // 2D (q = 2) and 2.5D (q = 2, depth 2): the logits' rows split over
  // tp_col (and tp_dep), the vocabulary bias's gradient summed over them.
  ShardConfig two_d = Layout(4, 1);
  two_d.layout.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
  {
    SCOPED_TRACE("2d tp 4");
    testing::ExpectShardedMatchesReference(*model, *ref, two_d, ids, 2e-4);
  }
  ShardConfig two_half_d = Layout(8, 1);
  two_half_d.layout.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2P5D);
  two_half_d.layout.set_depth(2);
  SCOPED_TRACE("2.5d tp 8 depth 2");
  testing::ExpectShardedMatchesReference(*model, *ref, two_half_d, ids, 2e-4);
}

TEST(Bert, TheBareModelsNamesLoadTheSame) {
  testing::TinyOptions o;
  o.prefixed = false;  // "embeddings.word_embeddings.weight", as BertModel saves them
  auto model = testing::WriteTinyBert(TempPath("bert_bare"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = testing::TokenIds(2, 8, model->config.vocab_size, 6);
  auto ref = testing::ReferenceBert(*model, ids, testing::MaskedLabels(ids));
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(*model, *ref, Layout(2, 1), ids, 2e-4, "bert.");
}

// A 3D batch that does not split q*q ways is refused.
TEST(Bert, AThreeDimensionalBatchMustSplit) {
  auto model = testing::WriteTinyBert(TempPath("bert_modes"));
  ASSERT_TRUE(model.ok()) << model.status();
  ShardConfig three_d = Layout(8, 1);
  three_d.layout.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_3D);
  const Tensor two_rows = testing::TokenIds(2, 8, model->config.vocab_size, 5);
  ::colod::testing::RunMesh(*DeviceMesh::FromShardConfig(three_d.layout), [&](int, ProcessGroup& pg) {
    auto m = ShardFormer(three_d, &pg).Load(model->dir);
    ASSERT_TRUE(m.ok()) << m.status();
    auto logits = (*m)->Forward(two_rows);
    EXPECT_EQ(logits.status().code(), absl::StatusCode::kInvalidArgument) << logits.status();
    EXPECT_NE(logits.status().message().find("must divide into 4 blocks"), std::string::npos) << logits.status();
  });
}

}  // namespace
}  // namespace colod::shardformer
