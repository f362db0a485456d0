// LLaMA through ShardFormer: tiny random LlamaForCausalLM directories
// (grouped-query attention, SiLU-gated MLP, RMSNorm, rotary embeddings,
// tied or untied LM head) loaded unsharded, 1D at tp = 2 and 4 (with and
// without sequence parallelism), 2D on 4 ranks, 3D on 8 and with dp; logits, loss and
// every gradient against the independent unsharded reference.
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::TempPath;

constexpr double kTol = 2e-4;

struct Case {
  std::string name;
  int tp, dp;
  v1::TensorParallelMode mode;
  bool sp;
  int64_t kv_heads;  // of 4 query heads
  bool tie;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class LlamaSharded : public ::testing::TestWithParam<Case> {};

TEST_P(LlamaSharded, LogitsLossAndEveryGradientMatchTheUnshardedModel) {
  const Case& c = GetParam();
  testing::TinyOptions o;
  o.kv_heads = c.kv_heads;
  o.tie = c.tie;
  auto model = testing::WriteTinyLlama(TempPath("llama_" + c.name), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = testing::TokenIds(4, 8, model->config.vocab_size, 7);
  auto ref = testing::ReferenceLlama(*model, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ShardConfig shard;
  shard.layout.set_tensor_parallel_size(c.tp);
  shard.layout.set_data_parallel_size(c.dp);
  shard.layout.set_tensor_parallel_mode(c.mode);
  shard.layout.set_sequence_parallel(c.sp);
  testing::ExpectShardedMatchesReference(*model, *ref, shard, ids, kTol);
}

constexpr auto k1D = v1::TENSOR_PARALLEL_MODE_1D;
INSTANTIATE_TEST_SUITE_P(Layouts, LlamaSharded,
                         ::testing::Values(Case{"unsharded", 1, 1, k1D, false, 2, false},
                                           Case{"unsharded_tied", 1, 1, k1D, false, 2, true},
                                           Case{"tp2_gqa", 2, 1, k1D, false, 2, false},
                                           Case{"tp2_tied", 2, 1, k1D, false, 2, true},
                                           Case{"tp4", 4, 1, k1D, false, 4, false},
                                           Case{"tp2_sp", 2, 1, k1D, true, 2, false},
                                           Case{"tp4_sp", 4, 1, k1D, true, 4, false},
                                           Case{"tp2_dp2", 2, 2, k1D, false, 2, false},
                                           Case{"2d_gqa", 4, 1, v1::TENSOR_PARALLEL_MODE_2D, false, 2, false},
                                           Case{"2d_tied", 4, 1, v1::TENSOR_PARALLEL_MODE_2D, false, 2, true},
                                           Case{"3d_gqa", 8, 1, v1::TENSOR_PARALLEL_MODE_3D, false, 2, false},
                                           Case{"3d_tied", 8, 1, v1::TENSOR_PARALLEL_MODE_3D, false, 2, true}),
                         [](const auto& info) { return info.param.name; });

TEST(Llama, TheBareModelsNamesLoadTheSame) {
  testing::TinyOptions o;
  o.prefixed = false;  // "embed_tokens.weight", "layers.0...", as LlamaModel saves them
  auto model = testing::WriteTinyLlama(TempPath("llama_bare"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = testing::TokenIds(2, 8, model->config.vocab_size, 9);
  auto ref = testing::ReferenceLlama(*model, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ShardConfig shard;
  shard.layout.set_tensor_parallel_size(2);
  shard.layout.set_data_parallel_size(1);
  testing::ExpectShardedMatchesReference(*model, *ref, shard, ids, kTol, "model.");
}

}  // namespace
}  // namespace colod::shardformer
