// Interleaved 1F1B's model chunks (ShardConfig.layout.virtual_stages, ShardFormer::LoadChunks): at pp = 2
// with V = 2, a rank's chunk c loads virtual stage c * 2 + (its pp
// coordinate) of 4, so it holds exactly what stage c * 2 + s holds at
// pp = 4 (names, blocks and values of every parameter, the tied table's
// mirror on the last virtual stage), for GPT-2 (a tied head) and OPT
// (project_in/out around the layers), with tp = 2 inside each stage.
// Mistaken chunk counts are refused.
#include <map>
#include <mutex>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::TempPath;

// name -> (the rank's block's values, whether it is a mirror), per
// (pp coordinate, tp coordinate, chunk).
using Held = std::map<std::string, std::pair<std::vector<float>, bool>>;
using Key = std::tuple<int, int, int>;

std::map<Key, Held> Load(const std::string& dir, int pp, int chunks) {
  ShardConfig shard;
  shard.layout.set_tensor_parallel_size(2);
  shard.layout.set_data_parallel_size(1);
  shard.layout.set_pipeline_parallel_size(pp);
  std::mutex mu;
  std::map<Key, Held> out;
  shard.layout.set_virtual_stages(chunks);
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    auto models = ShardFormer(shard, &pg).LoadChunks(dir);
    ASSERT_TRUE(models.ok()) << models.status();
    ASSERT_EQ(models->size(), static_cast<size_t>(chunks));
    for (int c = 0; c < chunks; ++c) {
      ShardedModel& model = *(*models)[c];
      EXPECT_EQ(model.shard_config().stage.count, pp * chunks);
      EXPECT_EQ(model.shard_config().stage.index, c * pp + *pg.LocalRank("pp"));
      Held held;
      for (const NamedParam& p : model.Parameters()) {
        held[p.name] = {p.bound.param.local().ContiguousAs(DType::kF32)->ToFloats(), p.mirror};
      }
      std::lock_guard<std::mutex> lock(mu);
      out[{*pg.LocalRank("pp"), *pg.LocalRank("tp"), c}] = std::move(held);
    }
  });
  return out;
}

void ExpectChunksAreTheStagesOfFour(const std::string& dir, const std::string& what) {
  const std::map<Key, Held> four = Load(dir, 4, 1);
  const std::map<Key, Held> interleaved = Load(dir, 2, 2);
  ASSERT_EQ(four.size(), 8u) << what;
  ASSERT_EQ(interleaved.size(), 8u) << what;
  for (int s = 0; s < 2; ++s) {
    for (int c = 0; c < 2; ++c) {
      for (int t = 0; t < 2; ++t) {
        const Held& got = interleaved.at({s, t, c});
        const Held& want = four.at({c * 2 + s, t, 0});
        EXPECT_FALSE(got.empty()) << what;
        EXPECT_EQ(got, want) << what << ": rank " << s << " chunk " << c << " (tp " << t << ") against stage "
                             << c * 2 + s << " of 4";
      }
    }
  }
}

TEST(VirtualStages, EachChunkHoldsItsStageOfPTimesV) {
  testing::TinyOptions o;
  o.layers = 4;
  o.tie = true;
  auto gpt2 = testing::WriteTinyGpt2(TempPath("vs_gpt2"), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  ExpectChunksAreTheStagesOfFour(gpt2->dir, "gpt2");
  o.embed_dim = 32;  // project_in on the first virtual stage, project_out on the last
  auto opt = testing::WriteTinyOpt(TempPath("vs_opt"), o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ExpectChunksAreTheStagesOfFour(opt->dir, "opt");
}

TEST(VirtualStages, MistakenChunksAreRefused) {
  testing::TinyOptions o;
  o.layers = 3;
  auto gpt2 = testing::WriteTinyGpt2(TempPath("vs_refused"), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  ShardConfig shard;
  shard.layout.set_tensor_parallel_size(1);
  shard.layout.set_data_parallel_size(1);
  shard.layout.set_pipeline_parallel_size(2);
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    for (const auto& [v, c, message] : std::vector<std::tuple<int, int, std::string>>{
             {2, 0, "pipeline_parallel_size 2 x 2 virtual stages is more stages than the model's 3 layers"},
             {2, 2, "chunk 2 of 2 virtual stages"},
             {-1, 0, "virtual_stages must be in [0, 4096]"},
             {1, -1, "chunk -1 of 1 virtual stages"}}) {
      ShardConfig mine = shard;
      mine.layout.set_virtual_stages(v);
      mine.chunk = c;
      auto model = ShardFormer(mine, &pg).Load(gpt2->dir);
      EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument) << message;
      EXPECT_NE(model.status().message().find(message), std::string::npos) << model.status();
    }
  });
}

}  // namespace
}  // namespace colod::shardformer
