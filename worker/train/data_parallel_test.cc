// Bucketed dp gradient sync: with dp = 2 (and tp = 2 x dp = 2) each replica
// back-propagates its half of the batch, the buckets' all-reduces start
// during backward, and afterwards every gradient is the whole batch's.
#include "worker/train/data_parallel.h"

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"

namespace colod::train {
namespace {

TEST(GradSync, BucketsOverlapBackwardAndSumTheReplicasGradients) {
  auto model = shardformer::testing::WriteTinyGpt2(::colod::testing::TempPath("dp_gpt2"));
  ASSERT_TRUE(model.ok());
  const Tensor ids = shardformer::testing::TokenIds(4, 8, model->config.vocab_size, 3);
  auto ref = shardformer::testing::ReferenceGpt2(*model, ids);
  ASSERT_TRUE(ref.ok());
  for (int tp : {1, 2}) {
    shardformer::ShardConfig shard;
    shard.layout.set_tensor_parallel_size(tp);
    shard.layout.set_data_parallel_size(2);
    ::colod::testing::RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
      auto m = shardformer::ShardFormer(shard, &pg).Load(model->dir);
      ASSERT_TRUE(m.ok());
      auto sync = GradSync::Create((*m)->Parameters(), &pg, /*bucket_bytes=*/32 << 10);
      ASSERT_TRUE(sync.ok()) << sync.status();
      EXPECT_GT((*sync)->buckets(), 3);
      const Tensor mine = ids.Narrow(0, 2 * *pg.dp_local_rank(), 2)->Contiguous();
      auto logits = (*m)->Forward(mine);
      ASSERT_TRUE(logits.ok());
      ASSERT_TRUE(Backward((*m)->NextTokenLoss(*logits, mine)->loss).ok());
      // All but the buckets holding the earliest layers started inside Backward.
      EXPECT_GE((*sync)->started_during_backward(), (*sync)->buckets() - 1);
      ASSERT_TRUE((*sync)->Finish().ok());
      // Every bucket but the last to start (the earliest layers': no gradient
      // is computed after it) was enqueued before backward's last kernel.
      EXPECT_GT((*sync)->last_overlapped_bytes(), 0);
      EXPECT_LT((*sync)->last_overlapped_bytes(), (*sync)->last_bucket_bytes());
      EXPECT_GE((*sync)->last_overlapped_bytes(), (*sync)->last_bucket_bytes() - (64 << 10));
      auto grads = (*m)->GatherHf(/*gradients=*/true);
      ASSERT_TRUE(grads.ok());
      for (const auto& [name, want] : ref->grads) {
        ::colod::testing::ExpectAllClose(grads->at(name), want, name + " gradient", 2e-4);
      }
    });
  }
}

}  // namespace
}  // namespace colod::train
