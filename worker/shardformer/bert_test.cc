// BERT through ShardFormer: a tiny random BertForMaskedLM (bidirectional
// attention, post-norm layers, MLM head with the decoder tied to the word
// embeddings) loaded unsharded and 1D at tp = 2 and 4 and with dp; logits,
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

TEST(Bert, OnlyOneDimensionalTensorParallelism) {
  auto model = testing::WriteTinyBert(TempPath("bert_modes"));
  ASSERT_TRUE(model.ok()) << model.status();
  ShardConfig two_d = Layout(4, 1);
  two_d.layout.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
  ShardConfig sp = Layout(2, 1);
  sp.layout.set_sequence_parallel(true);
  for (const ShardConfig& shard : {two_d, sp}) {
    ::colod::testing::RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
      auto m = ShardFormer(shard, &pg).Load(model->dir);
      EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
    });
  }
}

}  // namespace
}  // namespace colod::shardformer
