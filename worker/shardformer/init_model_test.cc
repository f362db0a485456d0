// New models from scratch against transformers' initialization: the config
// parses as the family's, every tensor has the family's name and shape, the
// Linear and embedding weights have std 0.02 (GPT-2's residual projections
// 0.02 / sqrt(2 n_layer)), biases 0 and norm weights 1; a seed repeats.
#include "worker/shardformer/init_model.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "spec/model_config.h"
#include "worker/shardformer/safetensors.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::TempPath;

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The mean and standard deviation of a tensor's values.
std::pair<double, double> Moments(const Tensor& t) {
  const std::vector<float> v = t.ToFloats();
  double sum = 0, sq = 0;
  for (float x : v) sum += x;
  const double mean = sum / static_cast<double>(v.size());
  for (float x : v) sq += (x - mean) * (x - mean);
  return {mean, std::sqrt(sq / static_cast<double>(v.size()))};
}

TEST(InitModel, LlamaHasTheFamilysNamesShapesAndInitialization) {
  LlamaShape shape;
  shape.vocab_size = 300;
  shape.hidden_size = 64;
  shape.num_layers = 2;
  shape.num_heads = 8;
  shape.num_kv_heads = 2;
  shape.intermediate_size = 160;
  shape.max_positions = 128;
  const std::string dir = TempPath("llama");
  ASSERT_TRUE(WriteInitializedLlama(dir, shape, 3).ok());
  auto config = ParseModelConfig(ReadText(dir + "/config.json"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->model_type, "llama");
  EXPECT_EQ(config->num_kv_heads, 2);
  EXPECT_EQ(config->intermediate_size, 160);
  EXPECT_FALSE(config->tie_word_embeddings);
  auto file = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), 2u + 2 * 9 + 1);
  // transformers' loader of some releases needs the format in the metadata.
  ASSERT_EQ((*file)->metadata().count("format"), 1u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  const std::pair<const char*, Shape> weights[] = {
      {"model.embed_tokens.weight", {300, 64}},        {"model.layers.1.self_attn.q_proj.weight", {64, 64}},
      {"model.layers.1.self_attn.k_proj.weight", {16, 64}}, {"model.layers.1.self_attn.v_proj.weight", {16, 64}},
      {"model.layers.0.self_attn.o_proj.weight", {64, 64}}, {"model.layers.0.mlp.gate_proj.weight", {160, 64}},
      {"model.layers.0.mlp.up_proj.weight", {160, 64}},     {"model.layers.1.mlp.down_proj.weight", {64, 160}},
      {"lm_head.weight", {300, 64}}};
  for (const auto& [name, want] : weights) {
    auto t = (*file)->Read(name);
    ASSERT_TRUE(t.ok()) << name << ": " << t.status();
    EXPECT_EQ(t->shape(), want) << name;
    const auto [mean, std] = Moments(*t);
    EXPECT_NEAR(mean, 0.0, 0.003) << name;
    EXPECT_NEAR(std, 0.02, 0.002) << name;
  }
  for (const char* name : {"model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
                           "model.norm.weight"}) {
    auto t = (*file)->Read(name);
    ASSERT_TRUE(t.ok()) << name << ": " << t.status();
    EXPECT_EQ(t->ToFloats(), std::vector<float>(64, 1.0f)) << name;
  }
  // A seed repeats; another seed does not.
  ASSERT_TRUE(WriteInitializedLlama(TempPath("llama_again"), shape, 3).ok());
  ASSERT_TRUE(WriteInitializedLlama(TempPath("llama_other"), shape, 4).ok());
  EXPECT_EQ(ReadText(dir + "/model.safetensors"), ReadText(TempPath("llama_again") + "/model.safetensors"));
  EXPECT_NE(ReadText(dir + "/model.safetensors"), ReadText(TempPath("llama_other") + "/model.safetensors"));
  // Sizes that do not fit are refused, naming what.
  LlamaShape bad = shape;
  bad.num_kv_heads = 3;
  EXPECT_EQ(WriteInitializedLlama(TempPath("bad"), bad, 1).code(), absl::StatusCode::kInvalidArgument);
  bad = shape;
  bad.intermediate_size = 0;
  EXPECT_EQ(WriteInitializedLlama(TempPath("bad"), bad, 1).code(), absl::StatusCode::kInvalidArgument);
}

TEST(InitModel, Gpt2ResidualProjectionsAreScaledByDepth) {
  Gpt2Shape shape;
  shape.hidden_size = 96;
  shape.num_heads = 4;
  shape.num_layers = 8;
  const std::string dir = TempPath("gpt2");
  ASSERT_TRUE(WriteInitializedGpt2(dir, shape, 1).ok());
  auto file = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  const auto [fc_mean, fc_std] = Moments(*(*file)->Read("transformer.h.3.mlp.c_fc.weight"));
  const auto [proj_mean, proj_std] = Moments(*(*file)->Read("transformer.h.3.mlp.c_proj.weight"));
  EXPECT_NEAR(fc_std, 0.02, 0.001);
  EXPECT_NEAR(proj_std, 0.02 / std::sqrt(16.0), 0.0005);
  EXPECT_EQ((*file)->Read("transformer.h.0.attn.c_attn.bias")->ToFloats(), std::vector<float>(3 * 96, 0.0f));
}

}  // namespace
}  // namespace colod::shardformer
