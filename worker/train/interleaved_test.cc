// The interleaved 1F1B step (RunPipelineStep over V model chunks a rank)
// against plain 1F1B on the same pipeline depth: a tiny GPT-2 (its head
// tied to the table, so the first and last virtual stages share it) at
// pp = 2 with V = 2 (2 and 4 micro-batches) and at pp = 4 with V = 2, over
// real Gloo ranks. Every parameter's gradient, the tied table's on the
// first and on the last stage, and the step's loss are 1F1B's bit for bit:
// each layer computes the same micro-batches from the same inputs, and the
// last stage sums the micro-batches' losses in the same order. An
// evaluation (forwards only) gives the same loss.
#include <map>
#include <mutex>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"
#include "worker/train/pipeline.h"

namespace colod::train {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::TempPath;

struct Step {
  double loss = 0, eval_loss = 0;
  // (name, mirror) -> the gradient, over every rank.
  std::map<std::pair<std::string, bool>, std::vector<float>> grads;
};

Step RunStep(const std::string& dir, int pp, int chunks, int micro, const Tensor& ids, const Tensor& labels) {
  shardformer::ShardConfig shard;
  shard.layout.set_tensor_parallel_size(1);
  shard.layout.set_data_parallel_size(1);
  shard.layout.set_pipeline_parallel_size(pp);
  std::mutex mu;
  Step out;
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    std::vector<std::unique_ptr<shardformer::ShardedModel>> owned;
    std::vector<shardformer::ShardedModel*> models;
    std::vector<shardformer::NamedParam> params;
    for (int c = 0; c < chunks; ++c) {
      shardformer::ShardConfig mine = shard;
      mine.virtual_stages = chunks;
      mine.chunk = c;
      auto model = shardformer::ShardFormer(mine, &pg).Load(dir);
      ASSERT_TRUE(model.ok()) << model.status();
      for (shardformer::NamedParam& p : (*model)->Parameters()) params.push_back(p);
      models.push_back(model->get());
      owned.push_back(*std::move(model));
    }
    auto sync = GradSync::Create(params, &pg, 64 << 10);
    ASSERT_TRUE(sync.ok()) << sync.status();
    const int64_t labelled = labels.numel();
    auto step = RunPipelineStep(models, pg, **sync, ids, labels, micro, labelled);
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_TRUE((*sync)->Finish().ok());
    absl::StatusOr<PipelineStepResult> eval;
    {
      NoGradScope no_grad;
      eval = RunPipelineStep(models, pg, **sync, ids, labels, micro, labelled, /*reduce=*/false, /*train=*/false);
    }
    ASSERT_TRUE(eval.ok()) << eval.status();
    std::lock_guard<std::mutex> lock(mu);
    out.loss = step->loss;
    out.eval_loss = eval->loss;
    for (const shardformer::NamedParam& p : params) {
      std::optional<Tensor> g = p.bound.param.variable().grad();
      ASSERT_TRUE(g.has_value()) << p.name;
      out.grads[{p.name, p.mirror}] = g->ContiguousAs(DType::kF32)->ToFloats();
    }
  });
  return out;
}

void ExpectInterleavedIsOneFOneB(int pp, int layers, int micro) {
  shardformer::testing::TinyOptions o;
  o.layers = layers;
  o.tie = true;
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("interleaved_gpt2_" + std::to_string(layers)), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  const int64_t rows = 2 * micro, seq = 8;
  const Tensor ids = shardformer::testing::TokenIds(rows, seq, o.vocab, 3);
  const Tensor labels = shardformer::testing::TokenIds(rows, seq, o.vocab, 5);
  const std::string what = "pp=" + std::to_string(pp) + " m=" + std::to_string(micro);
  const Step plain = RunStep(gpt2->dir, pp, 1, micro, ids, labels);
  const Step interleaved = RunStep(gpt2->dir, pp, 2, micro, ids, labels);
  ASSERT_GT(plain.loss, 0) << what;
  EXPECT_EQ(interleaved.loss, plain.loss) << what;
  EXPECT_EQ(interleaved.eval_loss, plain.eval_loss) << what;
  EXPECT_EQ(plain.eval_loss, plain.loss) << what;
  ASSERT_EQ(interleaved.grads.size(), plain.grads.size()) << what;
  EXPECT_TRUE(plain.grads.count({"transformer.wte.weight", true})) << what << ": the last stage's mirror";
  for (const auto& [key, g] : plain.grads) {
    auto it = interleaved.grads.find(key);
    ASSERT_NE(it, interleaved.grads.end()) << what << ": " << key.first;
    EXPECT_EQ(it->second, g) << what << ": " << key.first << (key.second ? " (mirror)" : "");
  }
}

TEST(Interleaved, TwoChunksOnTwoRanksAreOneFOneB) {
  ExpectInterleavedIsOneFOneB(2, 4, 2);
  ExpectInterleavedIsOneFOneB(2, 4, 4);
}

TEST(Interleaved, TwoChunksOnFourRanksAreOneFOneB) { ExpectInterleavedIsOneFOneB(4, 8, 4); }

TEST(Interleaved, ChunksThatAreNotTheRanksVirtualStagesAreRefused) {
  shardformer::testing::TinyOptions o;
  o.layers = 4;
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("interleaved_refused"), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  shardformer::ShardConfig shard;
  shard.layout.set_tensor_parallel_size(1);
  shard.layout.set_data_parallel_size(1);
  shard.layout.set_pipeline_parallel_size(2);
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    shardformer::ShardConfig mine = shard;
    mine.virtual_stages = 2;
    mine.chunk = 1;
    auto model = shardformer::ShardFormer(mine, &pg).Load(gpt2->dir);
    ASSERT_TRUE(model.ok()) << model.status();
    auto sync = GradSync::Create((*model)->Parameters(), &pg, 64 << 10);
    ASSERT_TRUE(sync.ok()) << sync.status();
    const Tensor ids = shardformer::testing::TokenIds(2, 8, o.vocab, 3);
    // Chunk 1 of 2 passed as a rank's only chunk: refused before any message.
    auto step = RunPipelineStep(std::vector<shardformer::ShardedModel*>{model->get()}, pg, **sync, ids, ids, 2, 16);
    EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument) << step.status();
    EXPECT_NE(step.status().message().find("not "), std::string::npos) << step.status();
  });
}

}  // namespace
}  // namespace colod::train
